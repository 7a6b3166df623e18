"""Pure-JAX references for every format and op: the oracles the kernels and primitives must match.

Quantize / dequantize of any layout, the scaled matmul (and its tensor factor), and the per-shard ops
the primitives run (last-axis quantize and dequantize, the RHT-transposed quantize). No input
validation here (``fp4jax.api`` validates at the public boundary); inputs are assumed to fit their
layout. All arithmetic in float32 in the order of the format modules.

Scaled matmul: both operands are quantized along their last axis K, the contraction axis (the "NT"
layout FP4 tensor cores read). NVFP4 operands: the block products e2m1·s_b are exact in bfloat16, so
the reference dequantizes each operand per block to bf16 *without* the tensor scale, runs a bf16 dot
with float32 accumulation, and applies amax_a · amax_b · f32(1/(6·6·448·448)) to the float32 result —
exactly what an FP4 tensor core computes, up to the order of the float32 sums. MXFP4 likewise with
power-of-two scales; FP8 operands are dequantized to float32 and multiplied in float32.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import formats
from fp4jax._exact import product
from fp4jax.numerics import dbq, e2m1, eden, four_over_six, fp8, hadamard, mxfp4, mxfp8, nvfp4
from fp4jax.numerics.layout import Layout, pack_along, unpack_along
from fp4jax.qtensor import QTensor, along_last
from fp4jax.numerics.scales import e8m0_to_f32

_INV_6_6_448_448 = np.float32(1.0 / (6.0 * 6.0 * 448.0 * 448.0))


# ------------------------------------------------------------------------------ quantize / dequantize

def layout_of(shape, fmt, axis, tile, scaling="block") -> Layout:
  axis = axis % len(shape)
  if fmt == "fp8" and scaling == "tensor":
    return Layout(tuple(shape), axis, 0, None)
  if tile is not None:
    return Layout(tuple(shape), axis, None, tuple(tile))
  return Layout(tuple(shape), axis, formats.BLOCK[fmt], None)


def layout_of_q(q: QTensor) -> Layout:
  """The blocked-view layout a QTensor was quantized with."""
  shape = q.shape
  return Layout(shape, q.axis % len(shape), q.block, q.tile)


def quantize_reference(x, fmt, *, axis=-1, tile=None, bits=None, amax=None, scale_rule="rceil",
                       scaling="block") -> QTensor:
  """Quantize ``x`` (float32/bf16/fp16) to ``fmt``; ``bits`` (shape of x) selects stochastic rounding."""
  lay = layout_of(x.shape, fmt, axis, tile, scaling)
  x_blk = lay.to_blocks(x.astype(jnp.float32))
  bits_blk = None if bits is None else lay.to_blocks(bits)
  neg_axis = lay.axis - x.ndim
  block = lay.block
  if fmt == "nvfp4":
    amax_g = nvfp4.tensor_amax(x) if amax is None else jnp.asarray(amax, jnp.float32).reshape(())
    codes, s_b = nvfp4.quantize_blocks(x_blk, amax_g, bits=bits_blk)
    data = pack_along(lay.from_blocks(codes), lay.axis)
    return QTensor(data, lay.scale_to_storage(s_b), amax_g, fmt, neg_axis, block, lay.tile, x.dtype)
  if fmt == "mxfp4":
    codes, s_b = mxfp4.quantize_blocks(x_blk, scale_rule=scale_rule, bits=bits_blk)
    data = pack_along(lay.from_blocks(codes), lay.axis)
    return QTensor(data, lay.scale_to_storage(s_b), None, fmt, neg_axis, block, lay.tile, x.dtype,
                   scale_rule)
  if fmt == "fp8":
    data, s_b = fp8.quantize_blocks(x_blk)
    return QTensor(lay.from_blocks(data), lay.scale_to_storage(s_b), None, fmt, neg_axis, block,
                   lay.tile, x.dtype)
  raise ValueError(f"unknown format {fmt!r}")


def codes_of(q: QTensor):
  """Unpacked E2M1 codes (uint8) of an nvfp4/mxfp4 QTensor, in the original tensor's shape."""
  return unpack_along(q.data, q.axis)


def block_scales(q: QTensor):
  """q's scales per 1x16 block along its last axis: a 16x16-tiled weight's scale repeated over the tile's 16
  rows (the same product e2m1·s for every element); what a block-scaled GEMM reads."""
  if q.tile is None:
    return q.scale
  return jnp.repeat(q.scale, q.tile[0], axis=-2)


def _dequantize_last(q: QTensor):
  """float32 values of the formats quantized by ``fp4jax.quantizers`` (along the last axis), each in
  its own module's order: 4/6 (``bound`` 256), MS-EDEN, DBQ, MXFP8."""
  if q.fmt == "nvfp4":
    if q.tile is None and q.axis != -1:
      moved = dataclasses.replace(q, data=jnp.moveaxis(q.data, q.axis, -1),
                                  scale=jnp.moveaxis(q.scale, q.axis, -1), axis=-1)
      return jnp.moveaxis(_dequantize_last(moved), -1, q.axis)
    return four_over_six.dequantize(codes_of(q), q.scale, q.amax, tiled=q.tile is not None, bound=q.bound)
  if q.fmt == "nvfp4_eden":
    return eden.dequantize(codes_of(q), q.scale, q.scale2)
  if q.fmt == "nvfp4_dbq":
    return dbq.dequantize(dbq.Dbq(codes_of(q), q.scale, q.scale2))
  if q.fmt == "mxfp8":
    return mxfp8.dequantize(mxfp8.Mxfp8(q.data, lax.bitcast_convert_type(q.scale, jnp.uint8)))
  raise ValueError(f"unknown format {q.fmt!r}")


def dequantize_reference(q: QTensor, dtype=jnp.float32):
  """Values of ``q`` in ``dtype`` (computed in float32, rounded once at the end)."""
  if q.fmt not in formats.NAMES or q.bound != formats.NVFP4_BOUND:
    return _dequantize_last(q).astype(dtype)
  lay = layout_of_q(q)
  s_blk = lay.scale_from_storage(q.scale)
  if q.fmt == "nvfp4":
    vals = nvfp4.dequantize_blocks(lay.to_blocks(codes_of(q)), s_blk, q.amax)
  elif q.fmt == "mxfp4":
    vals = mxfp4.dequantize_blocks(lay.to_blocks(codes_of(q)), s_blk)
  elif q.fmt == "fp8":
    vals = fp8.dequantize_blocks(lay.to_blocks(q.data), s_blk)
  else:
    raise ValueError(f"unknown format {q.fmt!r}")
  return lay.from_blocks(vals).astype(dtype)


# ------------------------------------------------------------------------------ the per-shard ops

def _vmap_leading(fn, n: int, in_axes):
  for _ in range(n):
    fn = jax.vmap(fn, in_axes=in_axes)
  return fn


def quantize_last_reference(x, amax, bits=None, *, fmt, tiled=False, scale_rule="rceil"):
  """(packed codes, scales) of x quantized along its last axis, in 1D blocks or the format's tiles.

  amax: float32 of shape x.shape[:n], one NVFP4 tensor amax per slice over the leading n axes (n = 0
  normally; vmapped slices otherwise); ignored by MXFP4. bits: uint8 of x's shape or None.
  """
  def one(x1, a1, b1):
    q = quantize_reference(x1, fmt, axis=-1, tile=formats.TILE[fmt] if tiled else None, bits=b1,
                           amax=a1 if fmt == "nvfp4" else None, scale_rule=scale_rule)
    return q.data, q.scale

  amax = jnp.asarray(amax, jnp.float32)
  return _vmap_leading(one, amax.ndim, (0, 0, None if bits is None else 0))(x, amax, bits)


def dequantize_last_reference(data, scale, amax, *, fmt, tiled=False, dtype=jnp.float32):
  """Values of codes packed along the last axis; amax as for ``quantize_last_reference``."""
  def one(d1, s1, a1):
    return dequantize_reference(along_last(d1, s1, a1, fmt=fmt, tiled=tiled, dtype=dtype), dtype)

  return _vmap_leading(one, amax.ndim, (0, 0, 0))(data, scale, amax)


def quantize_rht_t_reference(x, amax, bits=None, *, fmt, rht_size=16, rht_seed=None,
                             scale_rule="rceil"):
  """(packed codes (C, T/2), scales (C, T/B)) of RHT(xᵀ) quantized along T; x of shape (T, C)."""
  y = hadamard.rht(x.T, axis=-1, size=rht_size, seed=rht_seed)
  q = quantize_reference(y, fmt, axis=-1, bits=bits, amax=amax if fmt == "nvfp4" else None,
                         scale_rule=scale_rule)
  return q.data, q.scale


# ------------------------------------------------------------------------------ scaled matmul

def scaled_codes_bf16(q: QTensor):
  """e2m1(code) · block scale as bfloat16 (exact), without the tensor-level factor."""
  lay = layout_of_q(q)
  vals = e2m1.decode(lay.to_blocks(codes_of(q)))
  s = lay.scale_from_storage(q.scale)
  s = e8m0_to_f32(s) if q.fmt == "mxfp4" else s.astype(jnp.float32)
  return lay.from_blocks(vals * s[..., None]).astype(jnp.bfloat16)


def tensor_factor(a: QTensor, b: QTensor):
  """The float32 factor applied after accumulation (1 for MXFP4 and FP8), as the spec computes it."""
  if a.fmt == "nvfp4":
    factor = product(a.amax, b.amax) * _INV_6_6_448_448   # product: never re-associated with the constant
    return jnp.where((a.amax < 0) | (b.amax < 0), jnp.float32(jnp.nan), factor)   # wrong amax: NaN
  return jnp.float32(1.0)


def _pow2(e):
  return jnp.ldexp(jnp.float32(1.0), e)


def tensor_factor_parts(a: QTensor, b: QTensor, words: int = 4):
  """float32 (words,): the factor and three exact powers of two that ``apply_tensor_factor`` multiplies
  acc by, in that order (for the Pallas GEMM's epilogue, which applies them to its accumulator), then
  ``words - 4`` zeros (the Mosaic GEMM reads 32 words, one 128-byte copy: padded here, in the same pass).

  The four come back as one array through an optimization barrier: XLA otherwise folds the stack back into
  four scalars that its fusion keeps apart (each is too costly to recompute per element of the epilogue, and
  scalars are not worth a multi-output fusion to it), one launch each per GEMM on a GPU; behind the barrier
  they are one fusion. No value changes."""
  if words < 4:
    raise ValueError(f"tensor_factor_parts: words={words}; the four parts need at least 4")
  zeros = [jnp.float32(0.0)] * (words - 4)
  if a.fmt != "nvfp4":
    return jnp.stack([jnp.float32(1.0)] * 4 + zeros)
  amax_a, amax_b = jnp.asarray(a.amax, jnp.float32), jnp.asarray(b.amax, jnp.float32)
  nan = jnp.float32(jnp.nan)
  amax_a, amax_b = jnp.where(amax_a < 0, nan, amax_a), jnp.where(amax_b < 0, nan, amax_b)
  prod = amax_a * amax_b
  finite = jnp.isfinite(amax_a) & jnp.isfinite(amax_b) & (amax_a > 0) & (amax_b > 0)
  keep = ~finite | (jnp.isfinite(prod) & (prod >= jnp.float32(2.0 ** -100)))
  m_a, e_a = jnp.frexp(amax_a)
  m_b, e_b = jnp.frexp(amax_b)
  e = jnp.where(keep, 0, e_a.astype(jnp.int32) + e_b.astype(jnp.int32))
  factor = product(jnp.where(keep, amax_a, m_a), jnp.where(keep, amax_b, m_b)) * _INV_6_6_448_448
  e1 = e // 3
  e2 = (e - e1) // 2
  return lax.optimization_barrier(jnp.stack([factor, _pow2(e1), _pow2(e2), _pow2(e - e1 - e2)] + zeros))


def apply_tensor_factor(acc, a: QTensor, b: QTensor):
  """acc · ``tensor_factor(a, b)``, without spurious overflow or underflow of the factor.

  The spec's (amax_a · amax_b) · f32(1/(6·6·448·448)) overflows when amax_a · amax_b > FLT_MAX (e.g.
  both ~1e20) although most outputs are finite, and goes subnormal (flushed to 0 on CPU) below 2^-100.
  There the amaxes are split as m · 2^e (frexp) and the result is (acc · ((m_a · m_b) · f32(1/...)))
  · 2^(e_a + e_b), the power of two applied last in three exact parts: the spec's value, computed
  with an unbounded exponent range. Elsewhere (and for zero, inf or NaN amaxes) exactly the spec's.
  """
  if a.fmt != "nvfp4":
    return acc
  return apply_factor_parts(acc, tensor_factor_parts(a, b))


def apply_factor_parts(acc, f):
  """acc · f[0] · f[1] · f[2] · f[3] in that order (``tensor_factor_parts``), float32: the epilogue of every
  NVFP4 GEMM, the XLA path's and the kernels' (plain jnp, so it also runs inside a kernel). Rounded before
  any sum the caller forms with the result (fp4jax._exact): the inexact factor, and the last power of two,
  which can make a value subnormal."""
  return product(((product(acc, f[0]) * f[1]) * f[2]), f[3])


def _contract_last(a, b, preferred):
  dims = (((a.ndim - 1,), (1,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=preferred,
                         precision=lax.Precision.HIGHEST)


def scaled_matmul_reference(a: QTensor, b: QTensor, out_dtype=jnp.float32):
  """a (..., M, K) · b (N, K)ᵀ -> (..., M, N): the oracle of ``fp4jax.api.scaled_matmul``."""
  if formats.TABLE[a.fmt].packed:
    acc = _contract_last(scaled_codes_bf16(a), scaled_codes_bf16(b), jnp.float32)
    return apply_tensor_factor(acc, a, b).astype(out_dtype)
  acc = _contract_last(dequantize_reference(a), dequantize_reference(b), jnp.float32)
  return acc.astype(out_dtype)
