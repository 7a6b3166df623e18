"""``fp4jax_dequantize``: codes packed along the last axis (1D blocks or nvfp4 16x16 tiles), their
scales and the tensor amax -> values of the original shape as ``dtype``.

Both impls lower to the XLA reference: dequantization is elementwise and XLA fuses it into its
consumers. Params: fmt, tiled, dtype, impl.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax import dispatch, formats
from fp4jax.primitives import pair
from fp4jax.primitives import sharding as shd
from fp4jax.primitives.quantize import variant
from fp4jax.reference import dequantize_last_reference


def _abstract(data, scale, amax, *, fmt, tiled, dtype, impl):
  return (pair.ShapedArray(data.shape[:-1] + (data.shape[-1] * 2,), dtype),)


def _local(data, scale, amax, *, fmt, tiled, dtype, impl, platform):
  return (dequantize_last_reference(data, scale, amax, fmt=fmt, tiled=tiled, dtype=dtype),)


def _shardings(mesh, arg_shapes, *, fmt, tiled, **_):
  data, _, amax = arg_shapes
  x_shape = data.shape[:-1] + (data.shape[-1] * 2,)
  spec = shd.quantize_specs(mesh, x_shape, data.sharding, block=formats.BLOCK[fmt],
                            tile=formats.tile_side(fmt, tiled))
  return [spec, spec, spec[:len(amax.shape)]], [spec], ()


def _rule(ndims, *, fmt, tiled, **_):
  return shd.dequantize_rule(ndims[0], ndims[2], block=formats.BLOCK[fmt],
                             tile=formats.tile_side(fmt, tiled))


dequantize_p = pair.define(pair.OpSpec(
    "dequantize", _abstract, _local, _shardings, _rule, batch_leading=lambda dims: (True,) * 3))


def dequantize_last(data, scale, amax, *, fmt, tiled=False, dtype=jnp.float32, impl=None):
  """Values of codes packed along the last axis (1D blocks or 16x16 tiles), as ``dtype``."""
  impl = dispatch.choose("dequantize", fmt, impl)    # both impls lower to the reference
  with pair.scope(variant(fmt, tiled)):
    amax = jnp.zeros((), jnp.float32) if amax is None else jnp.asarray(amax, jnp.float32)
    (out,) = dequantize_p.bind(data, scale, amax, fmt=fmt, tiled=bool(tiled),
                               dtype=jnp.dtype(dtype), impl=impl)
  return out
