"""The launches of a compiled step, counted by what they belong to and what they do: the census behind
docs/PERF.md's kernel count (``census``).

Each row is (``part``, ``work``) with its launches per step, loop trip counts applied, as the ruler counts
its compute kernels (``hlo_cost.analyze``'s ops; collectives apart, by kind). ``part`` is
``hlo_parts.part`` of the op's op_name (an op without one: "copy:" and the part of the work that made its
input): the dot's passes (``fprop/quantize``, ``wgrad/quantize_rht_t``, ``dgrad/other``, ...), fp4jax's
producers (``rmsnorm_quantize``, ``relu2_quantize``), the model's parts. ``work`` says what the launch
does, from its kind and, for a fusion, the instructions of its fused computation:

  GEMM, attention, kernel     a GEMM (cuBLAS, cuDNN's block-scaled dot, a fusion XLA hands to a GEMM
                              emitter), cuDNN's fused attention, a Pallas/Triton kernel
  reduce                      a fusion holding a reduce (an amax, a norm's sums, a gradient's sums)
  scalar                      a fusion whose outputs hold at most ``SCALAR`` elements (per-tensor factors,
                              loop counters)
  pack                        integer bit work on packed codes (shifts and masks on 4- and 8-bit integers):
                              the E2M1 codes unpacked or repacked, e.g. uint8 to uint4 for the GEMM
  random                      integer hashing on 32-bit integers: stochastic-rounding bits drawn by XLA
  update-slice, slice         a dynamic-update-slice (a loop's saved residual, written in place) or a
                              (dynamic-)slice, and nothing else
  transpose, pad, concatenate, broadcast, convert
                              a fusion of only data movement whose root is that op
  copy                        XLA's copies
  elementwise                 any other fusion (arithmetic: an epilogue, a norm, an activation)
"""
from __future__ import annotations

import collections

from bench.predict import hlo_cost, hlo_parts
from bench.predict.hlo_text import arrays, collective, prod
from bench.predict.hlo_walk import Module

SCALAR = 16   # a fusion whose every output has at most this many elements is "scalar" work

_MOVES = {"parameter", "constant", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
          "concatenate", "pad", "transpose", "copy", "convert", "tuple", "get-tuple-element", "iota", "reverse"}
_BITS = {"shift-left", "shift-right-logical", "shift-right-arithmetic", "and", "or", "xor", "not"}
_NARROW = ("u4", "s4", "u8", "s8")
_WIDE = ("u32", "s32", "u64", "s64")


def _fused(mod: Module, comp: str | None, depth: int = 0) -> list:
  """The instructions of a fused computation and of the fusions nested in it."""
  out = []
  for i in mod.comps.get(comp or "", []):
    if i.opcode == "fusion" and depth < 4:
      out.extend(_fused(mod, i.attr("calls"), depth + 1))
    else:
      out.append(i)
  return out


def _root(instrs):
  root = next((i for i in instrs if i.root), None)
  if root is None or root.opcode != "tuple":
    return [root] if root is not None else []
  by_name = {i.name: i for i in instrs}
  return [by_name[o] for o in root.operands if o in by_name]


def work(mod: Module, op: dict) -> str:
  """What one charged op of ``hlo_cost.analyze`` does (the module docstring's ``work``)."""
  if op["kind"] == "gemm":
    return "GEMM"
  if op["kind"] in ("attention", "kernel", "copy"):
    return op["kind"]
  ins = mod.by_name[op["name"]]
  if ins.opcode != "fusion":
    return "kernel" if ins.opcode == "custom-call" else ins.opcode
  instrs = _fused(mod, ins.attr("calls"))
  opcodes = {i.opcode for i in instrs}
  # index arithmetic (a loop's slice offsets) does not make a data movement arithmetic
  moving = {i.opcode for i in instrs if not all(prod(dims) <= 1 for _, dims in arrays(i.shape))}
  if "reduce" in opcodes or "reduce-window" in opcodes:
    return "reduce"
  if all(prod(dims) <= SCALAR for _, dims in arrays(ins.shape)):
    return "scalar"
  bits = [i for i in instrs if i.opcode in _BITS]
  if bits and all(i.opcode in _MOVES | _BITS | {"add", "subtract", "multiply", "select", "compare"}
                  for i in instrs):
    dtypes = {d for i in bits for d, _ in arrays(i.shape)}
    if dtypes & set(_WIDE) and any(i.opcode in ("xor", "shift-left") for i in bits):
      return "random"
    if dtypes <= set(_NARROW) | {"pred"}:
      return "pack"
  if moving <= _MOVES:
    roots = {r.opcode for r in _root(instrs)} - {"bitcast"}
    if "dynamic-update-slice" in roots:
      return "update-slice"
    if roots <= {"slice", "dynamic-slice"}:
      return "slice"
    for name in ("transpose", "pad", "concatenate", "broadcast", "convert", "copy"):
      if name in roots:
        return name
    return "copy"
  return "elementwise"


def _part(op: dict) -> str:
  """``hlo_parts.by_part``'s key of an op."""
  name = op["op_name"] or op.get("origin", "")
  return hlo_parts.part(name) if op["op_name"] else f"copy:{hlo_parts.part(name) or '?'}"


def census(text: str, cost: dict | None = None, peaks: dict | None = None) -> list[dict]:
  """``[dict(part, work, launches)]`` per step of a compiled module (``cost``: its ``hlo_cost.analyze``, or
  computed with ``peaks``), collectives as part "collective" with their kind as ``work``; most first."""
  mod = Module(text)
  cost = cost if cost is not None else hlo_cost.analyze(text, peaks or {"flops": {"f32": 1.0}, "hbm": 1.0})
  acc = collections.Counter()
  for o in cost["ops"]:
    acc[(_part(o), work(mod, o))] += o["count"]
  for comp, m in mod.multipliers().items():
    for ins in mod.comps[comp]:
      kind = collective(ins)
      if kind is not None:
        acc[("collective", kind)] += m
  rows = [dict(part=p, work=w, launches=n) for (p, w), n in acc.items()]
  return sorted(rows, key=lambda r: (-r["launches"], r["part"], r["work"]))


def by_work(rows: list[dict]) -> dict[str, int]:
  """Launches per step by ``work`` alone."""
  acc = collections.Counter()
  for r in rows:
    acc[r["work"]] += r["launches"]
  return dict(acc.most_common())


def compare(rows: list[dict], twin: list[dict]) -> list[tuple[str, str, int, int]]:
  """``[(part, work, launches, the twin's launches)]`` over both censuses, by the difference, largest first."""
  a = {(r["part"], r["work"]): r["launches"] for r in rows}
  b = {(r["part"], r["work"]): r["launches"] for r in twin}
  keys = set(a) | set(b)
  return sorted(((p, w, a.get((p, w), 0), b.get((p, w), 0)) for p, w in keys),
                key=lambda r: (-(r[2] - r[3]), r[0], r[1]))
