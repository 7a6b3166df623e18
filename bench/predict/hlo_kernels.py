"""The custom calls whose work the cost model reads from their text: cuDNN fused attention (its scores'
shape and mask), the block-scaled GEMM, fp4jax's Mosaic GPU GEMMs (dense and grouped), and fp4jax's Pallas
kernels, whose names carry a GEMM shape (``fp4jax_gemm_*``, ``fp4jax_mixed_matmul_*_<M>x<N>x<K>``), FLOPs
(``_<tf32|ieee>_<n>flop``) or integer ops (``_<n>iop``)."""
from __future__ import annotations

import re

from bench.predict.hlo_text import Instr, arrays, prod

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
  numel = lambda a: prod(a[0][1])
  B, H, L, S = dims
  P = numel(q) // (B * H * L)
  kv_heads = numel(k) // (B * S * P)
  Pv = numel(v) // (B * S * max(1, kv_heads))
  mask = _FMHA_MASK.search(ins.attrs)
  window = _FMHA_WINDOW.search(ins.attrs)
  pairs = visible_pairs(L, S, bool(mask) and "CAUSAL" in mask.group(1), int(window.group(1)) if window else 0)
  per_pair = 3 * P + 2 * Pv if "Backward" in target.group(1) else P + Pv
  return 2 * B * H * pairs * per_pair, f"{q[0][0]}x{k[0][0]}", (B * H, L, S, P)


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


def is_pallas_gemm(ins: Instr) -> bool:
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


MOSAIC_TARGET = 'custom_call_target="mosaic_gpu_v2"'
_MOSAIC_GEMM = re.compile(r"fp4jax_mosaic_gemm_nvfp4_(\d+)x(\d+)x(\d+)(?!\d)")


def mosaic_gemm_shape(ins: Instr):
  """(flops, "f4e2m1fnxf4e2m1fn", (M, N, K)) of fp4jax's NVFP4 GEMM on Mosaic GPU (``fp4jax.kernels.mosaic_gemm``,
  a ``mosaic_gpu_v2`` custom call named ``fp4jax_mosaic_gemm_nvfp4_<M>x<N>x<K>``): block-scaled FP4 MMAs, so
  ``gemm_peak`` charges the FP4 rate, as for cuDNN's block-scaled GEMM; its bytes are its operands' (codes,
  scales, factor, residual) and its output's (bf16 or float32, the epilogue inside). The Mosaic GPU lowering
  drops ``pl.CostEstimate``, so the name carries the shape: in the op_name, or, where the op is partitioned
  (custom_partitioning's per-shard call keeps no kernel scope in its op_name), in the kernel's serialized
  module (backend_config). None for any other instruction."""
  if ins.opcode != "custom-call" or MOSAIC_TARGET not in ins.attrs:
    return None
  m = _MOSAIC_GEMM.search(ins.op_name) or _MOSAIC_GEMM.search(ins.attrs)
  if not m:
    return None
  mm, nn, kk = (int(g) for g in m.groups())
  return 2 * mm * nn * kk, "f4e2m1fnxf4e2m1fn", (mm, nn, kk)


_MOSAIC_GROUPED_GEMM = re.compile(r"fp4jax_mosaic_grouped_gemm_nvfp4_(\d+)x(\d+)x(\d+)x(\d+)(?!\d)")


def mosaic_grouped_gemm_shape(ins: Instr):
  """(flops, "f4e2m1fnxf4e2m1fn", (W, T, N, K)) of fp4jax's grouped NVFP4 GEMM on Mosaic GPU (the MoE experts' rows
  GEMM, ``fp4jax.kernels.mosaic_gemm.mosaic_grouped_gemm``: a ``mosaic_gpu_v2`` custom call named
  ``fp4jax_mosaic_grouped_gemm_nvfp4_<W>x<T>x<N>x<K>``): W block-scaled FP4 GEMMs of T x N x K, one per work item,
  2·W·T·N·K FLOPs at the FP4 rate; its bytes are its operands' as they are (a's codes and scales once, every
  expert's weight once: an item's weight is read in place, not gathered, and the items of one expert run
  together, so it stays in L2) and its output's (W, T, N), the epilogue inside. Read from the op_name or the
  kernel's serialized module, as ``mosaic_gemm_shape``. None for any other instruction."""
  if ins.opcode != "custom-call" or MOSAIC_TARGET not in ins.attrs:
    return None
  m = _MOSAIC_GROUPED_GEMM.search(ins.op_name) or _MOSAIC_GROUPED_GEMM.search(ins.attrs)
  if not m:
    return None
  w, t, n, k = (int(g) for g in m.groups())
  return 2 * w * t * n * k, "f4e2m1fnxf4e2m1fn", (w, t, n, k)


_DECLARED_FLOPS = re.compile(r"_(tf32|ieee)_(\d+)flop/pallas_call")
_DECLARED_IOPS = re.compile(r"_(\d+)iop/pallas_call")


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
