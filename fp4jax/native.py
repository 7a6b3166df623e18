"""The native GEMM: a pair of NVFP4-family QTensors on the hardware's block-scaled tensor cores.

``fp4jax.gemm.matmul(a, b, impl="native")`` lands here (and impl=None on a GPU of compute
capability 10.x, ``fp4jax.primitives.impl.default_gemm_backend``). Three steps:

1. ``operand(q)``: a (R, K) QTensor quantized along K becomes the block-scaled layout: its E2M1 codes
   as float4_e2m1fn (R, K), and its E4M3 scales per 1x16 along K, (R, K/16). A 16x16-tiled weight's
   scale is repeated over the tile's 16 rows (the same product e2m1·s for every element); the dgrad
   weight is the fprop tiles transposed (``fp4jax.transpose_tiles``: codes and scales only), and the
   RHT'd, stochastically rounded wgrad operands are taken as they are (quantized along the tokens,
   which is the GEMM's K). No value is re-rounded: every e2m1·s is the QTensor's own.
2. ``block_scaled_matmul``: Σ_k (e2m1·s)_a (e2m1·s)_b in float32, ``jax.nn.scaled_matmul`` on CUDA
   (cuDNN's ``__cudnn$blockScaledDot`` on sm_100). Elsewhere (the CPU) its twin: the same products,
   exact in bfloat16, one bf16 GEMM with float32 accumulation, which is the XLA path's GEMM.
3. The format's second level on the float32 result, ``fp4jax.epilogue`` (the one the XLA path
   applies): nvfp4's tensor factor (bound 448; per output row for a row-scaled a), 4/6's, MS-EDEN
   s_dec_a·s_dec_b, and DBQ (TetraJet-v2) one block-scaled GEMM per 128-chunk of K, each rescaled by
   its outer scales outer_a[m, c]·outer_b[n, c] and summed in order (``dbq.chunked_gemm``): the outer scale varies
   along both M and N within a chunk, so it fits neither the E4M3 block scale (not exact) nor one
   epilogue factor (not separable).

The products are exact in hardware and in the twin, so the result equals the XLA path up to the
order of the float32 sums (bit for bit on the CPU, where the twin is the XLA path's GEMM).

Not native: MXFP4 (jax 0.10.2's XLA does not take E2M1 with E8M0 scales per 32 into cuDNN on sm_100:
it compiles a float32 dequantize and a float32 cuBLASLt GEMM, slower than the bf16 XLA path), MXFP8
and per-tensor/128-block FP8 (not FP4). ``matmul`` raises for them, naming impl="xla".
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fp4jax import _native_compat as nc
from fp4jax import epilogue, reference
from fp4jax.numerics import dbq
from fp4jax.qtensor import QTensor, validate

FORMATS = ("nvfp4", "nvfp4_eden", "nvfp4_dbq")   # the formats with E2M1 codes and E4M3 scales per 16
BLOCK = 16


class Operand(NamedTuple):
  """One operand of the block-scaled GEMM: values float4_e2m1fn (R, K), scales float8_e4m3fn (R, K/16)."""
  values: object
  scales: object


def check(a: QTensor, b: QTensor):
  """Raise ValueError unless the pair can run natively: one NVFP4-family format, 2-D, along K."""
  if a.fmt not in FORMATS:
    why = {"mxfp4": "this jax's XLA compiles E2M1 with E8M0 scales per 32 to a float32 dequantize and "
                    "a float32 GEMM on sm_100, not the block-scaled tensor cores",
           "mxfp8": "it is an FP8 format (its native GEMM is not built)",
           "fp8": "it is an FP8 format"}.get(a.fmt, "it is not an E2M1/E4M3 format")
    raise ValueError(f"impl='native' takes {FORMATS}; fmt={a.fmt!r} has no native GEMM here ({why}); "
                     "use impl='xla'")
  for name, q in (("lhs", a), ("rhs", b)):
    validate(q, f"fp4jax.native.matmul ({name})")
    if q.axis != -1 or q.ndim != 2:
      raise ValueError(f"impl='native' contracts the last axis of two 2-D operands quantized along "
                       f"it; the {name} has shape {q.shape} quantized along axis {q.axis}")
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f"scaled_matmul contraction mismatch: a (M, K)={a.shape}, b (N, K)={b.shape}")
  if _row_scaled(b):
    raise ValueError("impl='native' takes a row-scaled nvfp4 lhs only (one amax per output row); the "
                     "rhs has one amax per row too, which no GEMM factor can apply; quantize the rhs "
                     "with one tensor amax")


def _row_scaled(q: QTensor) -> bool:
  return q.fmt == "nvfp4" and q.amax is not None and q.amax.ndim == 1


def operand(q: QTensor) -> Operand:
  """The block-scaled layout of a 2-D QTensor quantized along its last axis (module docstring, 1)."""
  values = nc.to_float4(reference.codes_of(q))
  scales = q.scale
  if q.tile is not None:   # one scale per 16x16 tile: the same scale for each of its 16 rows
    scales = jnp.repeat(scales, q.tile[0], axis=0)
  return Operand(values, scales)


def decode(op: Operand):
  """The float32 block products e2m1·s of an operand (R, K) (exact; the twin GEMM's inputs)."""
  vals = op.values.astype(jnp.float32)
  return vals * jnp.repeat(op.scales.astype(jnp.float32), BLOCK, axis=-1)


def _twin(a_vals, b_vals, a_scales, b_scales):
  """The block-scaled GEMM off the GPU: the exact products in bf16, float32 accumulation."""
  a16 = decode(Operand(a_vals, a_scales)).astype(jnp.bfloat16)
  b16 = decode(Operand(b_vals, b_scales)).astype(jnp.bfloat16)
  return lax.dot_general(a16, b16, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def block_scaled_matmul(a: Operand, b: Operand):
  """float32 (M, N) = Σ_k (e2m1·s)_a[m, k] (e2m1·s)_b[n, k]: the hardware's on CUDA, the twin elsewhere."""
  return lax.platform_dependent(a.values, b.values, a.scales, b.scales,
                                cuda=nc.block_scaled_matmul, default=_twin)


def _dbq(a: QTensor, b: QTensor, oa: Operand, ob: Operand):
  per = dbq.OUTER // BLOCK

  def part(c):
    k, s = slice(c * dbq.OUTER, (c + 1) * dbq.OUTER), slice(c * per, (c + 1) * per)
    return block_scaled_matmul(Operand(oa.values[:, k], oa.scales[:, s]),
                               Operand(ob.values[:, k], ob.scales[:, s]))
  return dbq.chunked_gemm(part, lambda c: a.scale2[:, c][:, None], lambda c: b.scale2[:, c][None, :],
                          a.scale2.shape[-1])


def matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32):
  """a (M, K) · b (N, K)ᵀ -> (M, N) on the block-scaled GEMM, the format's second level applied to the
  float32 result as the XLA path applies it (``fp4jax.epilogue``)."""
  check(a, b)
  oa, ob = operand(a), operand(b)
  if a.fmt == "nvfp4_dbq":
    return _dbq(a, b, oa, ob).astype(out_dtype)
  return epilogue.apply(block_scaled_matmul(oa, ob), a, b).astype(out_dtype)


scaled_matmul = matmul   # former name
