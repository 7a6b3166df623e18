"""A roofline cost model of an optimized (compiled) XLA GPU HLO module, read from its text.

  cost = analyze(compiled.as_text(), peaks)      # peaks: gpu_aot.PEAKS[target]

Every instruction that launches work is charged once per execution, times the trip counts of the
while loops around it (nested loops multiply; XLA's ``known_trip_count``, else the loop condition's one
integer constant):

- a GEMM (a fusion that XLA hands to a GEMM emitter, a cuBLAS/cuDNN custom call, or a fusion whose
  computation holds a ``dot``/``scaled-dot``) at max(flops / peak of its operand dtype, bytes / HBM
  bandwidth);
- a cuDNN fused attention (``__cudnn$fmha*`` custom calls, forward and backward) at max(flops / peak of
  its operand dtype, bytes / HBM bandwidth), kind "attention": the forward is two batched products,
  Q·Kᵀ and P·V, 2·B·H·(L·S visible)·(P + Pv) flops, the backward five (the scores recomputed, dV, dP,
  dQ, dK), 2·B·H·(visible)·(3P + 2Pv) (2.5x the forward at Pv = P); a causal mask keeps
  L·(L+1)/2 of the L·S pairs (about half), a sliding window fewer. The scores never reach HBM: its
  bytes are its operands and outputs;
- fp4jax's mixed-input GEMM kernel (``mixed_gemm_shape``: M, N, K in its name) as a bf16 GEMM, its
  bytes the packed operands, scales and output it reads and writes;
- a Pallas kernel that declares its FLOPs in its name (``declared_flops``: the SSD and gated-norm kernels) at
  max(flops / the TF32 or float32 peak it declares, bytes / HBM bandwidth);
- integer work, when ``peaks`` has an "int" rate (ops/s; ``gpu_aot.py --int_ops``): a fusion's integer
  elementwise ops (add, xor, shifts, ... on integer arrays, one op per element: the threefry hash of
  ``jax.random.bits`` is about 126 per element) and the ops a Pallas kernel declares in its name
  (``declared_int_ops``: the quantize kernels that hash their stochastic-rounding bits) at max(ops / int
  rate, bytes / HBM bandwidth). Without the rate they are counted (``int_ops``), not charged;
- any other fusion, Pallas/Triton kernel, copy or standalone op at the bytes it moves / HBM bandwidth:
  its operands and outputs, except that an operand the fused computation only reads through
  dynamic-slice/slice is charged the slices, and an output built by dynamic-update-slice into an
  operand buffer (in place) is charged the update. A fusion inside a scanned layer stack therefore pays
  for the layer it touches, not the whole stacked buffer, per trip;
- collectives apart, by kind and dtype, at their output bytes per device (reported, not added: the
  model assumes they overlap with compute).

Ignored: autotuning (a deviceless compile has none; every GEMM has its fallback tiles), overlap between
kernels, launch latency and kernel prologues, caches (every byte goes to HBM), occupancy and tail
effects, and the difference between a kernel's logical bytes and its real access pattern (strided or
transposed reads cost the same as contiguous ones here). Times are sums, serial.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re

BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8,
        "f8e8m0fnu": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "bf16": 16, "f16": 16, "s16": 16,
        "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64, "c64": 64,
        "c128": 128, "token": 0}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
# Ops that move no data of their own (aliases, metadata, control) or whose work is charged elsewhere.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "optimization-barrier",
        "after-all", "partition-id", "replica-id", "iota", "while", "call", "conditional",
        "add-dependency", "domain", "opt-barrier", "send", "recv", "send-done", "recv-done",
        "async-done", "async-update", "copy-done"}
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$blockScaledDot")
GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn$fusion",
                     "__triton_scaled_dot_fusion")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')


@dataclasses.dataclass
class Instr:
  name: str
  shape: str             # the result shape text, a tuple "(...)" or one array
  opcode: str
  operands: list[str]
  attrs: str             # everything after the operand list
  root: bool = False
  args: str = ""         # the operand list as written (a constant's value)

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str:
    m = _OP_NAME.search(self.attrs)
    return m.group(1) if m else ""


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at text[start] == '('."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c == "(":
      depth += 1
    elif c == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def parse_instr(line: str) -> Instr | None:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    sp = rest.find(" ")
    if sp < 0:
      return None
    shape, rest = rest[:sp], rest[sp + 1:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  end = _balanced(rest, paren)
  operands = _OPERAND.findall(rest[paren + 1:end - 1])
  return Instr(m.group(2), shape, opcode, operands, rest[end:], root=bool(m.group(1)),
               args=rest[paren + 1:end - 1].strip())


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str | None]:
  """``({computation: instructions}, entry name)`` of HLO module text."""
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    if line and not line[0].isspace():
      header = _HEADER.match(line)
      if header and not line.startswith("HloModule"):
        name = header.group(2)
        comps[name] = []
        if header.group(1):
          entry = name
        continue
      if line.startswith("}"):
        name = None
        continue
    if name is not None:
      ins = parse_instr(line)
      if ins is not None:
        comps[name].append(ins)
  return comps, entry


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
  total = 0
  for dtype, dims in arrays(shape):
    n = 1
    for d in dims:
      n *= d
    total += n * BITS.get(dtype, 32) // 8
  return total


@dataclasses.dataclass
class Op:
  """One charged instruction: its kind ("gemm", "attention" = cuDNN fused attention, "kernel" =
  Pallas/Triton custom call, "fusion",
  "copy", "other", or a collective), executions per step, bytes per execution, and for a GEMM its
  flops, operand dtype and (M, N, K)."""
  name: str
  kind: str
  count: int
  bytes: int
  op_name: str
  flops: int = 0
  dtype: str = ""
  mnk: tuple = ()
  seconds: float = 0.0
  bound: str = ""
  highest: bool = False   # a GEMM whose dot asks for full f32 precision (no TF32)
  iops: int = 0           # integer elementwise ops per execution (a fusion's, or a kernel's declared)
  reads: tuple = ()       # ((producer of an operand, bytes read of it), ...) per execution
  origin: str = ""        # for an op without an op_name: the op_name of the nearest producer that has one


class Module:
  def __init__(self, text: str):
    self.comps, self.entry = parse_module(text)
    self.shapes = {i.name: i.shape for instrs in self.comps.values() for i in instrs}
    self.by_name = {i.name: i for instrs in self.comps.values() for i in instrs}

  def trip_count(self, ins: Instr) -> int:
    """Iterations of a while loop: XLA's known_trip_count, else the one s32 constant of its
    condition (a scan's ``i < N``), else 1."""
    m = _TRIPS.search(ins.attrs)
    if m:
      return int(m.group(1))
    values = {int(i.args) for i in self.comps.get(ins.attr("condition"), [])
              if i.opcode == "constant" and i.shape.startswith("s32[]") and i.args.isdigit()}
    return values.pop() if len(values) == 1 else 1

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
          names = _OPERAND.findall(branches.group(1)) if branches else [
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
              total += _prod(dims)
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
    elif ins.opcode == "custom-call" and _is_pallas_gemm(ins):
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


BLOCK_SCALED_TARGET = 'custom_call_target="__cudnn$blockScaledDot"'
FMHA_TARGET = "__cudnn$fmha"   # cuDNN fused attention: fmhaSoftmax, fmhaSoftmaxBackward, ...Dropout, ...
_FMHA_SCORES = re.compile(r'"intermediate_tensor_shape"\s*:\s*\{\s*"element_type"\s*:\s*"\w+"\s*,\s*'
                          r'"dimensions"\s*:\s*\[([^\]]*)\]')
_FMHA_MASK = re.compile(r'"mask_type"\s*:\s*"(\w+)"')
_FMHA_WINDOW = re.compile(r'"sliding_window_length"\s*:\s*"?(\d+)')


def visible_pairs(L: int, S: int, causal: bool, window: int = 0) -> int:
  """(query, key) pairs an attention computes: all L·S (a window of W keys: each query's last W), or
  with a causal mask (query i sees keys 0..i, cuDNN's top-left alignment) and a window of W keys, the
  keys j with max(0, i - W + 1) <= j <= min(i, S - 1)."""
  if not causal:
    return L * (min(S, window) if window else S)
  if not window:
    ramp = min(L, S)   # queries 0..ramp-1 see i + 1 keys, the rest all S
    return ramp * (ramp + 1) // 2 + (L - ramp) * S
  return sum(max(0, min(i, S - 1) - max(0, i - window + 1) + 1) for i in range(L))


def fmha_shape(ins: Instr, shapes: dict):
  """(flops, operand dtypes, (B·H, L, S, P)) of a cuDNN fused attention custom call, or None.

  Read from its backend config: the scores' shape (B, H, L, S) and the mask; the head dims from the
  operands q (B·L·H·P elements), k (B·S·K·P) and v (B·S·K·Pv), whatever their layout."""
  target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
  scores = _FMHA_SCORES.search(ins.attrs)
  if not (target and target.group(1).startswith(FMHA_TARGET) and scores and len(ins.operands) >= 3):
    return None
  dims = [int(d.strip('" ')) for d in scores.group(1).split(",") if d.strip('" ')]
  q, k, v = (arrays(shapes.get(o, "")) for o in ins.operands[:3])
  if len(dims) != 4 or not (q and k and v):
    return None
  numel = lambda a: _prod(a[0][1])
  B, H, L, S = dims
  P = numel(q) // (B * H * L)
  kv_heads = numel(k) // (B * S * P)
  Pv = numel(v) // (B * S * max(1, kv_heads))
  mask = _FMHA_MASK.search(ins.attrs)
  window = _FMHA_WINDOW.search(ins.attrs)
  pairs = visible_pairs(L, S, bool(mask) and "CAUSAL" in mask.group(1), int(window.group(1)) if window else 0)
  per_pair = 3 * P + 2 * Pv if "Backward" in target.group(1) else P + Pv
  return 2 * B * H * pairs * per_pair, f"{q[0][0]}x{k[0][0]}", (B * H, L, S, P)


def _prod(dims) -> int:
  n = 1
  for d in dims:
    n *= d
  return n


def block_scaled_shape(lhs_shape: str, rhs_shape: str):
  """(flops, operand dtypes, (M, N, K)) of a block-scaled GEMM (``__cudnn$blockScaledDot``, from
  ``jax.nn.scaled_matmul``): lhs (B, M, K) · rhs (B, N, K), contracting the last axis, B a batch axis
  ((B, M, N, K) when B > 1). The dtypes are the operands' (``f4e2m1fnxf4e2m1fn`` for NVFP4), so
  ``gemm_peak`` charges the FP4 rate. Its custom call carries no dimension numbers in the optimized
  HLO; the layout is the one jax's lowering fixes."""
  lhs, rhs = arrays(lhs_shape), arrays(rhs_shape)
  if not (lhs and rhs) or len(lhs[0][1]) != 3 or len(rhs[0][1]) != 3:
    return None
  (a_dtype, (b, m, k)), (b_dtype, (_, n, _)) = lhs[0], rhs[0]
  return 2 * b * m * n * k, f"{a_dtype}x{b_dtype}", (m, n, k) if b == 1 else (b, m, n, k)


_KERNEL_NAME = re.compile(r'\bname = "([^"]+)"')


def kernel_label(ins: Instr) -> str:
  """``<kernel name>/pallas_call`` of a Pallas kernel's Triton custom call, the form the readers below
  match: its op_name where that ends so; else (a primitive partitioned by ``custom_partitioning`` under a
  mesh, whose op_name ends in ``custom_partitioning`` instead) the kernel name its backend_config carries.
  The op_name of anything else."""
  if ins.opcode != "custom-call" or ins.op_name.endswith("/pallas_call"):
    return ins.op_name
  m = _KERNEL_NAME.search(ins.attrs)
  return f"{ins.op_name}/{m.group(1)}/pallas_call" if m else ins.op_name


_PALLAS_GEMM = re.compile(r"fp4jax_(?:gemm|scaled_matmul)\w*/pallas_call")


def _is_pallas_gemm(ins: Instr) -> bool:
  """A Triton custom call from a Pallas kernel whose name says it is a GEMM (fp4jax names its GEMM
  kernels ``fp4jax_gemm_*``; the op_name ends in ``<kernel name>/pallas_call``)."""
  return ('custom_call_target="__gpu$xla.gpu.triton"' in ins.attrs
          and bool(_PALLAS_GEMM.search(kernel_label(ins))))


_MIXED_GEMM = re.compile(r"fp4jax_mixed_matmul_\w*?_(\d+)x(\d+)x(\d+)/pallas_call")


def mixed_gemm_shape(ins: Instr):
  """(flops, "bf16xbf16", (M, N, K)) of fp4jax's mixed-input GEMM (``fp4jax.kernels.mixed_matmul``, named
  ``fp4jax_mixed_matmul_<fmt>_<layout>_<M>x<N>x<K>``): its operands are packed E2M1 codes and scale
  bytes, decoded to bf16 in the K loop, so its MMAs run at the bf16 peak; its bytes are its operands'
  (0.5 byte per element plus the scales) and its output's. None for any other instruction."""
  if 'custom_call_target="__gpu$xla.gpu.triton"' not in ins.attrs:
    return None
  m = _MIXED_GEMM.search(kernel_label(ins))
  if not m:
    return None
  mm, nn, kk = (int(g) for g in m.groups())
  return 2 * mm * nn * kk, "bf16xbf16", (mm, nn, kk)


_DECLARED_FLOPS = re.compile(r"_(tf32|ieee)_(\d+)flop/pallas_call")
_DECLARED_IOPS = re.compile(r"_(\d+)iop/pallas_call")
INT_ELEMENTWISE = ("add", "subtract", "multiply", "and", "or", "xor", "not", "shift-left", "shift-right-logical",
                   "shift-right-arithmetic", "negate")
INT_DTYPES = ("s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64")


def declared_int_ops(ins: Instr) -> int:
  """Integer ops a Pallas kernel declares in its name, ``<name>_<n>iop`` (fp4jax's quantize kernels that
  hash their rounding bits: ``kernels._common.int_ops_suffix``); 0 when it declares none."""
  m = _DECLARED_IOPS.search(kernel_label(ins)) if ins.opcode == "custom-call" else None
  return int(m.group(1)) if m else 0


def declared_flops(ins: Instr) -> tuple[int, bool]:
  """(FLOPs, at IEEE float32) a Pallas kernel declares in its name, ``<name>_<tf32|ieee>_<n>flop``
  (models.ssd_pallas's SSD kernels and models.gated_norm's: an analytic count from their shapes, their
  modules' ``kernel_flops``);
  (0, False) when it declares none. The name is the carrier because the Triton backend drops
  ``pl.CostEstimate``."""
  m = _DECLARED_FLOPS.search(kernel_label(ins)) if ins.opcode == "custom-call" else None
  return (int(m.group(2)), m.group(1) == "ieee") if m else (0, False)


def _kind_of(mod: Module, ins: Instr) -> str:
  if ins.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return "kernel" if target and "triton" in target.group(1) else "other"
  if ins.opcode == "fusion":
    return "fusion"
  if ins.opcode in ("copy", "copy-start"):
    return "copy"
  return "other"


def _collective(ins: Instr) -> str | None:
  op = ins.opcode[:-6] if ins.opcode.endswith("-start") else ins.opcode
  return op if op in COLLECTIVES else None


def analyze(text: str, peaks: dict) -> dict:
  """The cost of one compiled module under ``peaks`` ({"flops": {dtype: FLOP/s}, "hbm": B/s,
  "link": B/s}): per-op rows, totals, GEMMs, collectives, counts."""
  mod = Module(text)
  mult = mod.multipliers()
  ops: list[Op] = []
  coll = collections.defaultdict(lambda: [0, 0, 0])
  for comp, m in mult.items():
    for ins in mod.comps[comp]:
      kind = _collective(ins)
      if kind is not None:
        shapes = arrays(ins.shape)
        if ins.opcode in ("all-gather-start", "reduce-scatter-start", "all-to-all-start"):
          result = shapes[len(shapes) // 2:]     # ((operands...), (results...)): combined ones have several
        elif ins.opcode == "collective-permute-start":
          result = shapes[:1]
        else:
          result = shapes
        for dtype, dims in result:
          b = nbytes(f"{dtype}[{','.join(map(str, dims))}]")
          row = coll[(kind, dtype)]
          row[0] += m
          row[1] += b
          row[2] += b * m
        continue
      if ins.opcode in FREE or ins.opcode.endswith("-done") or ins.opcode in ("async-start",):
        continue
      fmha = fmha_shape(ins, mod.shapes) if ins.opcode == "custom-call" else None
      if fmha is not None:
        flops, dtype, mnk = fmha
        ops.append(Op(ins.name, "attention", m, mod.plain_bytes(ins), ins.op_name, flops=flops,
                      dtype=dtype, mnk=mnk))
        continue
      gemm = mod.gemm_shape(ins)
      if gemm is not None:
        flops, dtype, mnk = gemm
        b = mod.fusion_bytes(ins) if ins.opcode == "fusion" else mod.plain_bytes(ins)
        text = ins.attrs + "".join(i.attrs for i in mod.comps.get(ins.attr("calls") or "", []))
        highest = "operand_precision={highest" in text or "algorithm=dot_f32_f32_f32" in text
        ops.append(Op(ins.name, "gemm", m, b, ins.op_name, flops=flops, dtype=dtype, mnk=mnk,
                      highest=highest))
        continue
      b = mod.fusion_bytes(ins) if ins.opcode == "fusion" else mod.plain_bytes(ins)
      flops, ieee = declared_flops(ins)
      iops = declared_int_ops(ins) or mod.int_ops(ins)
      reads = tuple((mod.producer(o), r) for o, r in mod.reads(ins))
      ops.append(Op(ins.name, _kind_of(mod, ins), m, b, ins.op_name, flops=flops, dtype="f32" if flops else "",
                    highest=ieee, iops=iops, reads=reads, origin="" if ins.op_name else mod.origin(ins)))
  int_rate = peaks.get("int")
  for op in ops:
    mem_s = op.bytes / peaks["hbm"]
    if int_rate and op.iops and not op.flops and op.kind not in ("gemm", "attention"):
      int_s = op.iops / int_rate
      op.seconds = max(int_s, mem_s) * op.count
      op.bound = "integer" if int_s >= mem_s else "memory"
    elif op.kind in ("gemm", "attention") or op.flops:
      # a kernel that declares its FLOPs: float32 dots, TF32 or (highest) IEEE
      peak = gemm_peak(peaks, op.dtype, highest=op.highest)
      flop_s = op.flops / peak
      op.seconds = max(flop_s, mem_s) * op.count
      op.bound = "compute" if flop_s >= mem_s else "memory"
    else:
      op.seconds = mem_s * op.count
      op.bound = "memory"
  collectives = [dict(kind=k, dtype=d, count=c, bytes=b, bytes_per_step=t)
                 for (k, d), (c, b, t) in sorted(coll.items())]
  gemm_s = sum(o.seconds for o in ops if o.kind == "gemm")
  attention_s = sum(o.seconds for o in ops if o.kind == "attention")
  other_s = sum(o.seconds for o in ops if o.kind not in ("gemm", "attention"))
  counts = collections.Counter()
  for o in ops:
    counts[o.kind] += o.count
  link = peaks.get("link")
  coll_bytes = sum(c["bytes_per_step"] for c in collectives)
  return dict(
      seconds=gemm_s + attention_s + other_s, gemm_seconds=gemm_s, attention_seconds=attention_s,
      other_seconds=other_s, gemm_flops=sum(o.flops * o.count for o in ops if o.kind == "gemm"),
      attention_flops=sum(o.flops * o.count for o in ops if o.kind == "attention"),
      other_bytes=sum(o.bytes * o.count for o in ops if o.kind not in ("gemm", "attention")),
      int_ops=sum(o.iops * o.count for o in ops), int_ops_charged=bool(int_rate),
      counts=dict(counts), collectives=collectives,
      collective_bytes=coll_bytes, collective_seconds=coll_bytes / link if link else None,
      ops=[dataclasses.asdict(o) for o in ops])


def gemm_peak(peaks: dict, dtype_pair: str, highest: bool = False) -> float:
  """FLOP/s of a GEMM whose operand dtypes are ``"bf16xbf16"``: the peak of the wider operand (a
  mixed-precision GEMM runs at the slower one's rate); dtypes without a peak use the f32 one. f32
  operands run as TF32 on the tensor cores (JAX's default precision on a GPU) unless the dot asks for
  the highest precision."""
  flops = peaks["flops"]
  f32 = flops["f32"] if highest else flops.get("tf32", flops["f32"])
  rates = [f32 if d == "f32" else flops.get(d, flops["f32"]) for d in dtype_pair.split("x")]
  return min(rates)


_PASS = re.compile(r"\b(fprop|dgrad|wgrad)\b")
_PRIM = re.compile(r"fp4jax/(quantize_rht_t|quantize|dequantize|scaled_matmul|rht|random_bits|rmsnorm_quantize|relu2_quantize)\b")


def label(op_name: str) -> str:
  """What an op belongs to, from its op_name: ``<pass>/<primitive>`` inside fp4jax.dot (pass =
  fprop/dgrad/wgrad), ``<primitive>`` elsewhere, else ``other``."""
  prims = _PRIM.findall(op_name)
  passes = _PASS.findall(op_name)
  prim = prims[-1] if prims else None
  if prim is None:
    return f"{passes[-1]}/other" if passes else "other"
  return f"{passes[-1]}/{prim}" if passes else prim


def by_label(cost: dict) -> list[tuple[str, float, int]]:
  """``[(label, seconds, bytes per step)]`` of the ops that are neither GEMMs nor fused attention,
  largest first."""
  acc = collections.defaultdict(lambda: [0.0, 0])
  for o in cost["ops"]:
    if o["kind"] in ("gemm", "attention"):
      continue
    row = acc[label(o["op_name"])]
    row[0] += o["seconds"]
    row[1] += o["bytes"] * o["count"]
  return sorted(((k, s, b) for k, (s, b) in acc.items()), key=lambda r: -r[1])


def scope(op_name: str) -> str | None:
  """The call of an fp4jax primitive an op belongs to: its op_name up to the last
  ``fp4jax/<primitive>`` (``.../blocks_0/mixer/in_proj/fprop/fp4jax/quantize``), or None."""
  last = None
  for last in _PRIM.finditer(op_name):
    pass
  return op_name[:last.end()] if last else None


def passes(cost: dict) -> list[dict]:
  """The fp4jax primitives' passes over memory, each as a multiple of one copy of what it reads.

  A pass is every non-GEMM op of one primitive call (``scope``: the quantize of fprop's operands in
  one layer, the wgrad RHT + quantize, a dequantize before a GEMM with its epilogue). What it reads
  is the values that come from outside the call, each counted once (at its largest read: a slice
  counts as the slice). One copy of those moves twice their bytes (read, then write), so
  ``copy_ratio`` = bytes the pass moves / (2 x bytes it reads): a quantize of bf16 that reads its
  input once and writes 4-bit codes + scales is 0.64, one that also reads the input for its amax
  1.14. Rows: ``dict(label, calls, ms, bytes, read_bytes, copy_ratio)`` per label (``by_label``'s
  names, all layers together), largest first."""
  groups = collections.defaultdict(list)
  for o in cost["ops"]:
    if o["kind"] in ("gemm", "attention"):
      continue
    s = scope(o["op_name"])
    if s is not None:
      groups[s].append(o)
  acc = collections.defaultdict(lambda: dict(calls=0, seconds=0.0, bytes=0, read_bytes=0))
  for s, ops in groups.items():
    inside = {o["name"] for o in ops}
    external = {}
    for o in ops:
      for src, b in o["reads"]:
        if src not in inside:
          external[src] = max(external.get(src, 0), b * o["count"])
    row = acc[label(s)]
    row["calls"] += 1
    row["seconds"] += sum(o["seconds"] for o in ops)
    row["bytes"] += sum(o["bytes"] * o["count"] for o in ops)
    row["read_bytes"] += sum(external.values())
  rows = [dict(label=k, calls=v["calls"], ms=v["seconds"] * 1e3, bytes=v["bytes"],
               read_bytes=v["read_bytes"],
               copy_ratio=v["bytes"] / (2 * v["read_bytes"]) if v["read_bytes"] else float("inf"))
          for k, v in acc.items()]
  return sorted(rows, key=lambda r: -r["bytes"])


# ------------------------------------------------------------------ the model's parts (models.scopes)

_MODEL_PART = re.compile(r"\bmodels/([a-z0-9_]+)")
_STEP_PART = re.compile(r"(?:^|/)(optimizer|grad_norm|nonfinite_guard|moe_balance|osci_reset)(?:/|$)")
LINEAR_PARTS = ("linear", "moe_experts")   # the model parts whose GEMMs are linear layers'
# fp4jax labels of quantize passes (``label``'s names; a dequantize is not one)
_QUANTIZE = re.compile(r"(?:^|/)(?:quantize|quantize_rht_t|rht|random_bits|rmsnorm_quantize|relu2_quantize)$")


def part(op_name: str) -> str:
  """Where an op belongs: fp4jax's ``label`` inside fp4jax.dot or a primitive (``fprop/quantize``,
  ``wgrad/other``, ...), else the innermost ``models/<part>`` scope (``models.scopes``:
  ``mamba2_conv_silu``, ``rmsnorm``, ...), else a train-step scope (``optimizer``, ``grad_norm``, ...),
  else "unscoped" (an op_name outside every named part) or "" (no op_name)."""
  lab = label(op_name)
  if lab != "other":
    return lab
  parts = _MODEL_PART.findall(op_name)
  if parts:
    return parts[-1]
  step = _STEP_PART.findall(op_name)
  if step:
    return step[-1]
  return "unscoped" if op_name else ""


def phase(op_name: str) -> str:
  """"fwd", "remat" (a rematerialized forward, inside the backward pass) or "bwd" (jvp's transpose)."""
  if "rematted_computation" in op_name:
    return "remat"
  return "bwd" if "transpose(" in op_name else "fwd"


def by_part(cost: dict) -> list[dict]:
  """The step's time by ``part`` and ``phase``: ``dict(part, fwd, remat, bwd, ms, gib, gemm_ms)`` per
  part (ms per step; an op without an op_name is charged to ``origin``'s part, its name prefixed with
  "copy:"), largest first. GEMMs and attention included (``gemm_ms`` says how much of ``ms`` they are)."""
  acc = collections.defaultdict(lambda: dict(fwd=0.0, remat=0.0, bwd=0.0, gib=0.0, gemm_ms=0.0))
  for o in cost["ops"]:
    name = o["op_name"] or o.get("origin", "")
    key = part(name) if o["op_name"] else f"copy:{part(name) or '?'}"
    row = acc[key]
    row[phase(name)] += o["seconds"] * 1e3
    row["gib"] += o["bytes"] * o["count"] / 2 ** 30
    if o["kind"] in ("gemm", "attention"):
      row["gemm_ms"] += o["seconds"] * 1e3
  rows = [dict(part=k, ms=v["fwd"] + v["remat"] + v["bwd"], **v) for k, v in acc.items()]
  return sorted(rows, key=lambda r: -r["ms"])


def columns(cost: dict) -> dict:
  """The step's time in the issue-29 table's columns (ms): ``linear_gemm`` (GEMMs of linear layers:
  inside a ``models/linear`` or ``models/moe_experts`` scope, or fp4jax's dots), ``other_gemm`` (the
  rest: the LM head, the XLA SSD's einsums, a router), ``attention`` (cuDNN's fused attention and
  every op of ``models/attention_core``), ``ssd`` (every op of ``models/mamba2_ssd``: the Pallas kernels,
  or ssd_chunked's GEMMs and elementwise work), ``quantize`` (fp4jax's quantize, RHT and random-bits
  passes), ``other`` (everything else: norms, conv, gates, the dot's dequantize and epilogue work, the
  optimizer, copies)."""
  out = dict(linear_gemm=0.0, other_gemm=0.0, attention=0.0, ssd=0.0, quantize=0.0, other=0.0)
  for o in cost["ops"]:
    name = o["op_name"] or o.get("origin", "")
    parts = _MODEL_PART.findall(name)
    inner = parts[-1] if parts else ""
    ms = o["seconds"] * 1e3
    if o["kind"] == "attention" or inner == "attention_core":
      out["attention"] += ms
    elif inner == "mamba2_ssd":
      out["ssd"] += ms
    elif o["kind"] == "gemm":
      linear = inner in LINEAR_PARTS or re.search(r"fp4jax/(dot|grouped_dot)\b", name)
      out["linear_gemm" if linear else "other_gemm"] += ms
    elif _QUANTIZE.search(label(name)):
      out["quantize"] += ms
    else:
      out["other"] += ms
  return out


def naive_bytes(text: str) -> int:
  """Operand + output bytes of every non-free instruction times its loop trip counts, with no slice
  accounting: what a walk that charges each fusion its whole stacked buffers would say."""
  mod = Module(text)
  total = 0
  for comp, m in mod.multipliers().items():
    for ins in mod.comps[comp]:
      if ins.opcode in FREE or _collective(ins) or ins.opcode.endswith("-done"):
        continue
      total += mod.plain_bytes(ins) * m
  return total


def dumps(cost: dict) -> str:
  return json.dumps(cost, indent=1)
