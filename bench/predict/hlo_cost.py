"""A roofline cost model of an optimized (compiled) XLA GPU HLO module, read from its text.

  cost = analyze(compiled.as_text(), peaks)      # peaks: bench.predict.peaks.peaks(target)

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
- fp4jax's Mosaic GPU NVFP4 GEMM (``mosaic_gemm_shape``: M, N, K in its name) and its grouped form for the MoE
  experts (``mosaic_grouped_gemm_shape``: W work items of T x N x K) as block-scaled FP4 GEMMs, their bytes their
  operands and their output (the epilogue is inside);
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

from bench.predict.hlo_kernels import declared_flops, declared_int_ops, fmha_shape
from bench.predict.hlo_text import Instr, arrays, collective, nbytes
from bench.predict.hlo_walk import Module

# Ops that move no data of their own (aliases, metadata, control) or whose work is charged elsewhere.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "optimization-barrier",
        "after-all", "partition-id", "replica-id", "iota", "while", "call", "conditional",
        "add-dependency", "domain", "opt-barrier", "send", "recv", "send-done", "recv-done",
        "async-done", "async-update", "copy-done"}


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


def _kind_of(mod: Module, ins: Instr) -> str:
  if ins.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return "kernel" if target and "triton" in target.group(1) else "other"
  if ins.opcode == "fusion":
    return "fusion"
  if ins.opcode in ("copy", "copy-start"):
    return "copy"
  return "other"


def analyze(text: str, peaks: dict) -> dict:
  """The cost of one compiled module under ``peaks`` ({"flops": {dtype: FLOP/s}, "hbm": B/s,
  "link": B/s}): per-op rows, totals, GEMMs, collectives, counts."""
  mod = Module(text)
  mult = mod.multipliers()
  ops: list[Op] = []
  coll = collections.defaultdict(lambda: [0, 0, 0])
  for comp, m in mult.items():
    for ins in mod.comps[comp]:
      kind = collective(ins)
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


def naive_bytes(text: str) -> int:
  """Operand + output bytes of every non-free instruction times its loop trip counts, with no slice
  accounting: what a walk that charges each fusion its whole stacked buffers would say."""
  mod = Module(text)
  total = 0
  for comp, m in mod.multipliers().items():
    for ins in mod.comps[comp]:
      if ins.opcode in FREE or collective(ins) or ins.opcode.endswith("-done"):
        continue
      total += mod.plain_bytes(ins) * m
  return total


def dumps(cost: dict) -> str:
  return json.dumps(cost, indent=1)
