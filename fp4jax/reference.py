"""Pure-JAX reference quantize / dequantize for every format: the oracle the kernels must match.

No input validation here (``fp4jax.api`` validates at the public boundary); inputs are assumed to fit
their layout. All arithmetic in float32 in the order of NVFP4_SPEC.md.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax import fp8, mxfp4, nvfp4
from fp4jax.layout import Layout, pack_along, unpack_along
from fp4jax.qtensor import QTensor

DEFAULT_BLOCK = {"nvfp4": nvfp4.BLOCK, "mxfp4": mxfp4.BLOCK, "fp8": fp8.BLOCK}


def layout_of(shape, fmt, axis, tile, scaling="block") -> Layout:
  axis = axis % len(shape)
  if fmt == "fp8" and scaling == "tensor":
    return Layout(tuple(shape), axis, 0, None)
  if tile is not None:
    return Layout(tuple(shape), axis, None, tuple(tile))
  return Layout(tuple(shape), axis, DEFAULT_BLOCK[fmt], None)


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


def dequantize_reference(q: QTensor, dtype=jnp.float32):
  """Values of ``q`` in ``dtype`` (computed in float32, rounded once at the end)."""
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
