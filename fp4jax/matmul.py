"""Scaled matmul of two quantized operands: out[..., m, n] = sum_k a[..., m, k] · b[n, k].

Both operands are quantized along their last axis K, the contraction axis (the "NT" layout FP4 tensor
cores read). NVFP4 operands: the block products e2m1·s_b are exact in bfloat16, so the reference
dequantizes each operand per block to bf16 *without* the tensor scale, runs a bf16 dot with float32
accumulation, and applies amax_a · amax_b · f32(1/(6·6·448·448)) to the float32 result (spec §2) —
exactly what an FP4 tensor core computes, up to the order of the float32 sums. MXFP4 likewise with
power-of-two scales; FP8 operands are dequantized to float32 and multiplied in float32.
"""
from __future__ import annotations


import jax.numpy as jnp
from jax import lax

from fp4jax import e2m1
from fp4jax.qtensor import QTensor
from fp4jax.reference import codes_of, dequantize_reference, layout_of_q
from fp4jax.scales import e8m0_to_f32

_INV_6_6_448_448 = jnp.float32(1.0 / (6.0 * 6.0 * 448.0 * 448.0))


def _scaled_codes_bf16(q: QTensor):
  """e2m1(code) · block scale as bfloat16 (exact), without the tensor-level factor."""
  lay = layout_of_q(q)
  vals = e2m1.decode(lay.to_blocks(codes_of(q)))
  s = lay.scale_from_storage(q.scale)
  s = s.astype(jnp.float32) if q.fmt == "nvfp4" else e8m0_to_f32(s)
  return lay.from_blocks(vals * s[..., None]).astype(jnp.bfloat16)


def tensor_factor(a: QTensor, b: QTensor):
  """The float32 factor applied after accumulation (1 for MXFP4 and FP8)."""
  if a.fmt == "nvfp4":
    return (a.amax * b.amax) * _INV_6_6_448_448
  return jnp.float32(1.0)


def _contract_last(a, b, preferred):
  dims = (((a.ndim - 1,), (1,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=preferred,
                         precision=lax.Precision.HIGHEST)


def scaled_matmul_reference(a: QTensor, b: QTensor, out_dtype=jnp.float32):
  """The pure-JAX oracle of ``scaled_matmul`` (no validation)."""
  if a.fmt in ("nvfp4", "mxfp4"):
    acc = _contract_last(_scaled_codes_bf16(a), _scaled_codes_bf16(b), jnp.float32)
    return (acc * tensor_factor(a, b)).astype(out_dtype)
  acc = _contract_last(dequantize_reference(a), dequantize_reference(b), jnp.float32)
  return acc.astype(out_dtype)


def check_operands(a: QTensor, b: QTensor):
  if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
    raise TypeError("scaled_matmul takes two QTensors from fp4jax.quantize")
  if a.fmt != b.fmt:
    raise ValueError(f"scaled_matmul operands must share a format; got {a.fmt!r} and {b.fmt!r}")
  if a.axis != -1 or b.axis != -1:
    raise ValueError("scaled_matmul contracts the last axis of both operands; quantize them with axis=-1 "
                     f"(got axis {a.axis} and {b.axis})")
  if len(b.shape) != 2:
    raise ValueError(f"the right operand must be 2-D (N, K); got shape {b.shape}")
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f"contraction lengths differ: lhs K={a.shape[-1]}, rhs K={b.shape[-1]}")


def scaled_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, impl: str | None = None):
  """a (..., M, K) · b (N, K)ᵀ -> (..., M, N) in ``out_dtype``, from quantized operands.

  FP4 operands run as the ``fp4jax_scaled_matmul`` primitive. impl: "pallas" (the Pallas kernel;
  interpreted on CPU), "xla" (the reference), or None = "pallas" where
  ``fp4jax.primitives.can_use_pallas``, else "xla". fp8 operands run the reference.
  """
  from fp4jax import primitives
  check_operands(a, b)
  impl = primitives.resolve_impl(impl, a.fmt)
  if a.fmt not in primitives.KERNEL_FORMATS:
    return scaled_matmul_reference(a, b, out_dtype)
  return primitives.scaled_matmul(a, b, out_dtype=out_dtype, impl=impl)


def transpose_tiles(q: QTensor) -> QTensor:
  """The 2D-tiled QTensor of the transposed matrix, from codes and scales alone (no requantization).

  With square tiles (nvfp4 16x16, fp8 128x128) the quantization of Wᵀ is exactly the transpose of W's
  codes and scales (spec §2), so the dgrad GEMM reuses the fprop weight. The result is packed (nvfp4)
  along its last axis.
  """
  if q.tile is None or len(q.shape) != 2:
    raise ValueError("transpose_tiles needs a 2-D QTensor quantized with tile= (nvfp4 (16, 16) or "
                     "fp8 (128, 128))")
  if q.fmt == "nvfp4":
    data = e2m1.pack(codes_of(q).T)
  elif q.fmt == "fp8":
    data = q.data.T
  else:
    raise ValueError(f"transpose_tiles supports nvfp4 and fp8 tiles; got fmt={q.fmt!r}")
  return QTensor(data, q.scale.T, q.amax, q.fmt, -1, None, q.tile, q.dtype, q.scale_rule)
