"""``fp4jax_quantize``: x (..., K) -> packed codes (..., K/2) and scales, quantized along the last
axis in 1D blocks or (nvfp4) 16x16 tiles over the last two axes.

Operands: x, the NVFP4 tensor amax (a scalar, or one per vmapped slice: its shape is a prefix of x's;
reduced by the caller; zeros for MXFP4), and optionally the 8-bit random bits of x's shape
(stochastic rounding). Params: fmt, tiled, scale_rule, impl.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp4jax import formats
from fp4jax.kernels import quantize_1d, quantize_2d
from fp4jax.primitives import pair
from fp4jax.primitives import sharding as shd
from fp4jax.primitives.impl import resolve_impl
from fp4jax.reference import quantize_last_reference


def _abstract(x, amax, *bits, fmt, tiled, scale_rule, impl):
  *lead, k = x.shape
  if tiled:
    r, c = formats.TILE[fmt]
    s_shape = tuple(lead[:-1]) + (lead[-1] // r, k // c)
  else:
    s_shape = tuple(lead) + (k // formats.BLOCK[fmt],)
  return (pair.ShapedArray(tuple(lead) + (k // 2,), jnp.uint8),
          pair.ShapedArray(s_shape, formats.SCALE_DTYPE[fmt]))


def _local(x, amax, *bits, fmt, tiled, scale_rule, impl, platform):
  bits = bits[0] if bits else None
  if impl == "pallas" and platform in ("cuda", "cpu"):
    interpret = platform != "cuda"
    if tiled:
      q, s = quantize_2d.quantize_2d(x, amax, bits, interpret=interpret)
    else:
      q, s = quantize_1d.quantize_1d(x, amax, bits, fmt=fmt, scale_rule=scale_rule,
                                     interpret=interpret)
    return q, lax.bitcast_convert_type(s, formats.SCALE_DTYPE[fmt])
  return quantize_last_reference(x, amax, bits, fmt=fmt, tiled=tiled, scale_rule=scale_rule)


def _shardings(mesh, arg_shapes, *, fmt, tiled, **_):
  x, amax = arg_shapes[:2]
  spec = shd.quantize_specs(mesh, x.shape, x.sharding, block=formats.BLOCK[fmt],
                            tile=formats.tile_side(fmt, tiled))
  args = [spec, spec[:len(amax.shape)]] + [spec] * (len(arg_shapes) - 2)
  return args, [spec, spec], ()


def _rule(ndims, *, fmt, tiled, **_):
  return shd.quantize_rule(ndims[0], ndims[1], len(ndims) == 3, block=formats.BLOCK[fmt],
                           tile=formats.tile_side(fmt, tiled))


quantize_p = pair.define(pair.OpSpec(
    "quantize", _abstract, _local, _shardings, _rule, batch_leading=lambda dims: (True,) * len(dims)))


def quantize_last(x, amax, bits=None, *, fmt, tiled=False, scale_rule="rceil", impl=None):
  """(packed codes, scales) of x quantized along its last axis (1D blocks, or 16x16 tiles).

  amax: float32 of shape x.shape[:n] (ignored by MXFP4). bits: uint8 of x's shape or None.
  impl: "pallas" | "xla" | None (the verified default, ``impl.default_impl``).
  """
  impl = resolve_impl(impl, fmt, "quantize_2d" if tiled else "quantize_1d")
  with pair.scope(variant(fmt, tiled, bits is not None)):
    ops = (x, jnp.asarray(amax, jnp.float32)) + (() if bits is None else (bits.astype(jnp.uint8),))
    data, scale = quantize_p.bind(*ops, fmt=fmt, tiled=bool(tiled), scale_rule=scale_rule, impl=impl)
  return data, scale


def variant(fmt: str, tiled: bool, stochastic: bool = False) -> str:
  """The op's name in profiles: "nvfp4_1x16", "nvfp4_16x16_sr", "mxfp4_1x32", ..."""
  r, c = formats.TILE[fmt] if tiled else (1, formats.BLOCK[fmt])
  return f"{fmt}_{r}x{c}" + ("_sr" if stochastic else "")
