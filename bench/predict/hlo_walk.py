"""One compiled HLO module walked: how many times each computation runs per step (loop trip counts, calls,
branches), the bytes an instruction reads and writes (a fusion charged the slices it reads and the
update it writes in place), its integer elementwise ops, where an op's input came from, and the shape of
a GEMM."""
from __future__ import annotations

import collections
import re

from bench.predict.hlo_kernels import (BLOCK_SCALED_TARGET, block_scaled_shape, is_pallas_gemm, mixed_gemm_shape,
                                      mosaic_gemm_shape, mosaic_grouped_gemm_shape)
from bench.predict.hlo_text import OPERAND, Instr, arrays, nbytes, parse_module, prod

GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$blockScaledDot")
INT_ELEMENTWISE = ("add", "subtract", "multiply", "and", "or", "xor", "not", "shift-left", "shift-right-logical",
                   "shift-right-arithmetic", "negate")
INT_DTYPES = ("s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64")

_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')


class Module:
  def __init__(self, text: str):
    self.comps, self.entry = parse_module(text)
    self.shapes = {i.name: i.shape for instrs in self.comps.values() for i in instrs}
    self.by_name = {i.name: i for instrs in self.comps.values() for i in instrs}

  def trip_count(self, ins: Instr) -> int:
    """Iterations of a while loop: XLA's known_trip_count, else its condition's ``i < N`` (or ``<=``) read
    against the induction variable's start in the loop's initial tuple (XLA's collective pipeliner peels
    iterations out of a loop and starts the rest at 1, without a known_trip_count), else the one s32
    constant of its condition (a scan's ``i < N``), else 1."""
    m = _TRIPS.search(ins.attrs)
    if m:
      return int(m.group(1))
    bound, start = self._loop_bound(ins.attr("condition")), self._induction_start(ins)
    if bound is not None and start is not None:
      n, direction = bound
      return max(0, n - start + (1 if direction == "LE" else 0))
    values = {int(i.args) for i in self.comps.get(ins.attr("condition"), [])
              if i.opcode == "constant" and i.shape.startswith("s32[]") and i.args.isdigit()}
    return values.pop() if len(values) == 1 else 1

  def _loop_bound(self, cond: str, depth: int = 0):
    """``(N, "LT" | "LE")`` of a loop condition whose root compares a value with an s32 constant N, in the
    condition or in the fusion its root is; else None."""
    instrs = self.comps.get(cond, [])
    root = next((i for i in instrs if i.root), instrs[-1] if instrs else None)
    if root is None:
      return None
    if root.opcode == "fusion" and depth < 2:
      return self._loop_bound(root.attr("calls"), depth + 1)
    direction = re.search(r"direction=(LT|LE)", root.attrs)
    if root.opcode != "compare" or direction is None or len(root.operands) != 2:
      return None
    local = {i.name: i for i in instrs}
    bound = local.get(root.operands[1])
    if bound is None or bound.opcode != "constant" or not bound.args.lstrip("-").isdigit():
      return None
    return int(bound.args), direction.group(1)

  def _induction_start(self, ins: Instr) -> int | None:
    """The induction variable's initial value (XLA's known_induction_variable, element 0 without it) when the
    loop's initial tuple holds a constant there (through copies), else None."""
    index = re.search(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"(\d+)"', ins.attrs)
    init = self.by_name.get(ins.operands[0]) if ins.operands else None
    if init is None or init.opcode != "tuple":
      return None
    k = int(index.group(1)) if index else 0
    value = self.by_name.get(init.operands[k]) if k < len(init.operands) else None
    while value is not None and value.opcode in ("copy", "bitcast") and value.operands:
      value = self.by_name.get(value.operands[0])
    if value is None or value.opcode != "constant" or not value.args.lstrip("-").isdigit():
      return None
    return int(value.args)

  def multipliers(self) -> dict[str, int]:
    """``{computation: executions per step}`` for the entry and the control flow it reaches (while
    bodies and conditions times their trip counts, calls, conditional branches, async wrappers)."""
    mult = collections.Counter()

    def visit(comp, m, depth=0):
      if comp not in self.comps or depth > 64:
        return
      mult[comp] += m
      for ins in self.comps[comp]:
        if ins.opcode == "while":
          trips = self.trip_count(ins)
          visit(ins.attr("body"), m * trips, depth + 1)
          visit(ins.attr("condition"), m * (trips + 1), depth + 1)
        elif ins.opcode == "call":
          visit(ins.attr("to_apply"), m, depth + 1)
        elif ins.opcode == "conditional":
          branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
          names = OPERAND.findall(branches.group(1)) if branches else [
              ins.attr("true_computation"), ins.attr("false_computation")]
          for b in names:
            visit(b, m, depth + 1)     # every branch charged: an upper bound
        elif ins.opcode.endswith("-start") or ins.opcode == "async-start":
          called = ins.attr("calls")
          if called:
            visit(called, m, depth + 1)
    visit(self.entry, 1)
    return mult

  # ------------------------------------------------------------------ bytes of one fusion

  def _users(self, comp: str) -> dict[str, list[Instr]]:
    users = collections.defaultdict(list)
    for ins in self.comps.get(comp, []):
      for o in ins.operands:
        users[o].append(ins)
    return users

  def _read_bytes(self, comp: str, param: Instr, users) -> int:
    """Bytes a fused computation reads of one parameter: the slices it takes when every use is a
    (dynamic-)slice (through bitcasts), the in-place buffer of a dynamic-update-slice nothing, else
    all of it."""
    frontier, sliced, seen = [param.name], 0, set()
    while frontier:
      name = frontier.pop()
      if name in seen:
        continue
      seen.add(name)
      for u in users.get(name, []):
        if u.opcode in ("bitcast", "reshape"):
          frontier.append(u.name)
        elif u.opcode in ("dynamic-slice", "slice") and u.operands and u.operands[0] == name:
          sliced += nbytes(u.shape)
        elif u.opcode == "dynamic-update-slice" and u.operands and u.operands[0] == name:
          continue          # written in place: the update is charged as the output
        else:
          return nbytes(param.shape)
    return min(sliced, nbytes(param.shape))

  def _write_bytes(self, comp: str, out_shape: str) -> int:
    """Output bytes of a fusion, an in-place dynamic-update-slice counted at its update."""
    instrs = self.comps.get(comp, [])
    by_name = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.root), None)
    if root is None:
      return nbytes(out_shape)
    outs = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0
    for o in outs:
      while o is not None and o.opcode == "bitcast":
        o = by_name.get(o.operands[0])
      if o is not None and o.opcode == "dynamic-update-slice" and len(o.operands) > 1:
        upd = by_name.get(o.operands[1])
        total += nbytes(upd.shape if upd is not None else self.shapes.get(o.operands[1], ""))
      elif o is not None:
        total += nbytes(o.shape)
    return total or nbytes(out_shape)

  def reads(self, ins: Instr) -> list[tuple[str, int]]:
    """``[(operand, bytes read of it)]`` of one instruction: a fusion's slice accounting
    (``_read_bytes``), else every operand whole."""
    comp = ins.attr("calls") if ins.opcode == "fusion" else None
    if comp not in self.comps:
      return [(o, nbytes(self.shapes.get(o, ""))) for o in ins.operands]
    params = {}
    for i in self.comps[comp]:
      if i.opcode == "parameter" and i.args.isdigit():
        params[int(i.args)] = i
    users = self._users(comp)
    return [(operand, self._read_bytes(comp, params[k], users) if k in params
             else nbytes(self.shapes.get(operand, ""))) for k, operand in enumerate(ins.operands)]

  def fusion_bytes(self, ins: Instr) -> int:
    comp = ins.attr("calls")
    if comp not in self.comps:
      return self.plain_bytes(ins)
    return sum(b for _, b in self.reads(ins)) + self._write_bytes(comp, ins.shape)

  def int_ops(self, ins: Instr) -> int:
    """Integer elementwise ops of a fusion (one per element of each integer-typed add, xor, shift, ...
    in its computation and the fusions nested in it); 0 for other instructions."""
    if ins.opcode != "fusion":
      return 0
    total, todo, seen = 0, [ins.attr("calls")], set()
    while todo:
      comp = todo.pop()
      if comp in seen or comp not in self.comps:
        continue
      seen.add(comp)
      for i in self.comps[comp]:
        if i.opcode == "fusion":
          todo.append(i.attr("calls"))
        elif i.opcode in INT_ELEMENTWISE:
          for dtype, dims in arrays(i.shape):
            if dtype in INT_DTYPES:
              total += prod(dims)
    return total

  def plain_bytes(self, ins: Instr) -> int:
    return sum(nbytes(self.shapes.get(o, "")) for o in ins.operands) + nbytes(ins.shape)

  def origin(self, ins: Instr, depth: int = 4) -> str:
    """The op_name of the nearest instruction upstream of ``ins`` that has one (breadth-first over the
    operands, ``depth`` levels, through fusions' own op_names): XLA's copies and layout fusions carry
    none, so they are charged to the work that made their input. "" when none is found."""
    frontier, seen = list(ins.operands), set()
    for _ in range(depth):
      nxt = []
      for name in frontier:
        if name in seen or name not in self.by_name:
          continue
        seen.add(name)
        producer = self.by_name[name]
        if producer.op_name:
          return producer.op_name
        nxt.extend(producer.operands)
      frontier = nxt
    return ""

  def producer(self, name: str) -> str:
    """The instruction that made a value, looking through the ops that only rename one
    (bitcasts, tuple elements): a loop's parameter when it came in through the loop."""
    seen = 0
    while name in self.by_name and seen < 64:
      ins = self.by_name[name]
      if ins.opcode not in ("bitcast", "get-tuple-element") or not ins.operands:
        return name
      name, seen = ins.operands[0], seen + 1
    return name

  # ------------------------------------------------------------------ GEMMs

  def _dot_in(self, comp: str, depth: int = 0):
    """The first dot / scaled-dot of a computation (looking into the fusions it calls)."""
    for i in self.comps.get(comp, []):
      if i.opcode in ("dot", "scaled-dot"):
        return i
    if depth < 3:
      for i in self.comps.get(comp, []):
        if i.opcode == "fusion":
          d = self._dot_in(i.attr("calls"), depth + 1)
          if d is not None:
            return d
    return None

  def gemm_shape(self, ins: Instr):
    """(flops, operand dtype, (M, N, K)) of a GEMM instruction, or None if it is not one."""
    dot = None
    if ins.opcode == "fusion":
      kind = _KIND.search(ins.attrs)
      dot = self._dot_in(ins.attr("calls"))
      if dot is None or (kind is None and "dot" not in dot.opcode):
        return None
      lhs = arrays(self.shapes.get(dot.operands[0], ""))
      rhs = arrays(self.shapes.get(dot.operands[1], ""))
      out = arrays(dot.shape)
      lc = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attrs)
      lb = re.search(r"lhs_batch_dims=\{([\d,]*)\}", dot.attrs)
      contracting = [int(x) for x in lc.group(1).split(",") if x] if lc else []
      batch = [int(x) for x in lb.group(1).split(",") if x] if lb else []
    elif ins.opcode == "custom-call" and is_pallas_gemm(ins):
      # a Pallas GEMM kernel: a (..., M, K) · b (N, K)ᵀ -> (..., M, N), its operand dtypes as loaded
      a = arrays(self.shapes.get(ins.operands[0], ""))
      b = arrays(self.shapes.get(ins.operands[1], ""))
      out = arrays(ins.shape)
      if not (a and b and out) or a[0][1][-1] != b[0][1][-1] or len(b[0][1]) != 2:
        return None
      k = a[0][1][-1]
      n_out = 1
      for d in out[0][1]:
        n_out *= d
      return 2 * n_out * k, f"{a[0][0]}x{b[0][0]}", (n_out // b[0][1][0], b[0][1][0], k)
    elif ins.opcode == "custom-call" and mixed_gemm_shape(ins) is not None:
      return mixed_gemm_shape(ins)
    elif ins.opcode == "custom-call" and mosaic_gemm_shape(ins) is not None:
      return mosaic_gemm_shape(ins)
    elif ins.opcode == "custom-call" and mosaic_grouped_gemm_shape(ins) is not None:
      return mosaic_grouped_gemm_shape(ins)
    elif ins.opcode == "custom-call" and BLOCK_SCALED_TARGET in ins.attrs:
      return block_scaled_shape(self.shapes.get(ins.operands[0], ""), self.shapes.get(ins.operands[1], ""))
    elif ins.opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
      if not target or not any(target.group(1).startswith(t) for t in GEMM_TARGETS):
        return None
      lhs = arrays(self.shapes.get(ins.operands[0], ""))
      rhs = arrays(self.shapes.get(ins.operands[1], ""))
      out = arrays(ins.shape)[:1]
      cfg = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
      bcfg = re.search(r'"lhs_batch_dimensions":\[([^\]]*)\]', ins.attrs)
      contracting = [int(x.strip('" ')) for x in cfg.group(1).split(",") if x.strip('" ')] if cfg else []
      batch = [int(x.strip('" ')) for x in bcfg.group(1).split(",") if x.strip('" ')] if bcfg else []
    else:
      return None
    if not (lhs and rhs and out):
      return None
    lhs_dtype, lhs_dims = lhs[0]
    k = 1
    for d in contracting:
      k *= lhs_dims[d]
    n_out = 1
    for d in out[0][1]:
      n_out *= d
    b = 1
    for d in batch:
      b *= lhs_dims[d]
    m = 1
    for i, d in enumerate(lhs_dims):
      if i not in contracting and i not in batch:
        m *= d
    n = n_out // max(1, b * m)
    return 2 * n_out * k, f"{lhs_dtype}x{rhs[0][0]}", (b * m, n, k) if b == 1 else (b, m, n, k)
