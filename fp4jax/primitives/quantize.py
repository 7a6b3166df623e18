"""``fp4jax_quantize``: x (..., K) -> packed codes (..., K/2) and scales, quantized along the last
axis in 1D blocks or (nvfp4) 16x16 tiles over the last two axes.

Operands: x, the NVFP4 tensor amax (a scalar, or one per vmapped slice: its shape is a prefix of x's;
reduced by the caller; zeros for MXFP4), and for stochastic rounding either the 8-bit random bits of x's
shape, or (param ``keyed``: their layout, "jax", "packed" or "philox") the two small operands of
``random_bits.KeyedBits``, rows (..., 4) per row of x and cols (K, 2), from which the kernel hashes the same bits
(the XLA side draws them as an array).
Params: fmt, tiled, scale_rule, keyed, row_stride (KeyedBits' ``row_stride``), impl, stored (the XLA side
reads x as its dtype stores it, ``_exact.stored``; a kernel reads x from memory, where it is stored already).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp4jax import _exact, dispatch, formats, random_bits
from fp4jax.kernels import quantize_1d, quantize_2d
from fp4jax.primitives import pair
from fp4jax.primitives import sharding as shd
from fp4jax.reference import quantize_last_reference


def _abstract(x, amax, *bits, fmt, tiled, scale_rule, keyed, row_stride, impl, stored):
  *lead, k = x.shape
  if keyed and (bits[0].shape != tuple(lead) + (4,) or bits[1].shape != (k, 2)):
    raise ValueError(f"fp4jax_quantize: KeyedBits rows {bits[0].shape} and cols {bits[1].shape} do not fit "
                     f"x {x.shape}; they are (..., 4) per row of x and (K, 2) (random_bits.KeyedBits.of)")
  if tiled:
    r, c = formats.TILE[fmt]
    s_shape = tuple(lead[:-1]) + (lead[-1] // r, k // c)
  else:
    s_shape = tuple(lead) + (k // formats.BLOCK[fmt],)
  return (pair.ShapedArray(tuple(lead) + (k // 2,), jnp.uint8),
          pair.ShapedArray(s_shape, formats.SCALE_DTYPE[fmt]))


def sr_bits(bits, keyed, row_stride=None):
  """The op's rounding-bits operands as the kernels take them: None, the array, or KeyedBits (``keyed``: its
  layout, "jax", "packed" or "philox"; ``row_stride``: its ``row_stride``)."""
  if not bits:
    return None
  return random_bits.KeyedBits(*bits, layout=keyed, row_stride=row_stride) if keyed else bits[0]


def keyed_param(bits):
  """The ops' param ``keyed``: the layout of KeyedBits ("jax" | "packed" | "philox"), False for an array or None."""
  return bits.layout if isinstance(bits, random_bits.KeyedBits) else False


def row_stride_param(bits):
  """The ops' param ``row_stride``: KeyedBits' ``row_stride`` (None for anything else)."""
  return bits.row_stride if isinstance(bits, random_bits.KeyedBits) else None


def _local(x, amax, *bits, fmt, tiled, scale_rule, keyed, row_stride, impl, stored, platform):
  bits = sr_bits(bits, keyed, row_stride)
  if stored and not (impl == "pallas" and platform == "cuda"):
    # A compiled kernel reads x from memory, where it is stored (the rounding is the buffer's; applying it here
    # would make XLA write a rounded copy for the kernel to read). XLA, and the interpreted kernel, which XLA
    # compiles and fuses with x's producer, read it through ``_exact.stored``.
    x = _exact.stored(x)
  if impl == "pallas" and platform in ("cuda", "cpu"):
    interpret = platform != "cuda"
    if tiled:
      q, s = quantize_2d.quantize_2d(x, amax, bits, interpret=interpret)
    else:
      q, s = quantize_1d.quantize_1d(x, amax, bits, fmt=fmt, scale_rule=scale_rule,
                                     interpret=interpret)
    return q, lax.bitcast_convert_type(s, formats.SCALE_DTYPE[fmt])
  return quantize_last_reference(x, amax, random_bits.drawn(bits), fmt=fmt, tiled=tiled, scale_rule=scale_rule)


def _shardings(mesh, arg_shapes, *, fmt, tiled, keyed, **_):
  x, amax = arg_shapes[:2]
  spec = shd.quantize_specs(mesh, x.shape, x.sharding, block=formats.BLOCK[fmt],
                            tile=formats.tile_side(fmt, tiled))
  if keyed:   # rows shard with x's rows, cols (global counters) with its last axis
    sr = [spec[:-1] + [None], [spec[-1], None]]
  else:
    sr = [spec] * (len(arg_shapes) - 2)
  return [spec, spec[:len(amax.shape)]] + sr, [spec, spec], ()


def _rule(ndims, *, fmt, tiled, keyed, **_):
  return shd.quantize_rule(ndims[0], ndims[1], "key" if keyed else len(ndims) == 3,
                           block=formats.BLOCK[fmt], tile=formats.tile_side(fmt, tiled))


def batch_leading(dims):
  """Every operand takes the vmapped axis in front, except KeyedBits' cols (the 4th operand), constants
  of the shape that are never batched (a vmapped key or window start lives in the rows). The quantize ops'
  rule (``fp4jax_quantize``, ``fp4jax_quantize_rht_t``)."""
  if len(dims) == 4 and dims[3] is not None:
    raise ValueError("fp4jax quantize: KeyedBits cols are batched under vmap; they must be the shape's "
                     "constants (random_bits.KeyedBits.of puts keys and window starts in the rows)")
  return (True,) * min(len(dims), 3) + (False,) * (len(dims) - 3)


quantize_p = pair.define(pair.OpSpec(
    "quantize", _abstract, _local, _shardings, _rule, batch_leading=batch_leading))


def quantize_last(x, amax, bits=None, *, fmt, tiled=False, scale_rule="rceil", impl=None, stored=False):
  """(packed codes, scales) of x quantized along its last axis (1D blocks, or 16x16 tiles).

  amax: float32 of shape x.shape[:n] (ignored by MXFP4). bits: uint8 of x's shape,
  ``random_bits.KeyedBits`` of it (the kernel hashes them; the XLA side draws them), or None.
  impl: "pallas" | "xla" | None (the default: ``dispatch.choose``). stored: the XLA side quantizes
  ``_exact.stored(x)`` (the kernel gets x: no rounded copy of it is written for the kernel to read).
  """
  impl = dispatch.choose("quantize_2d" if tiled else "quantize_1d", fmt, impl)
  with pair.scope(variant(fmt, tiled, bits is not None)):
    ops = (x, jnp.asarray(amax, jnp.float32)) + sr_operands(bits)
    data, scale = quantize_p.bind(*ops, fmt=fmt, tiled=bool(tiled), scale_rule=scale_rule,
                                  keyed=keyed_param(bits), row_stride=row_stride_param(bits), impl=impl,
                                  stored=bool(stored))
  return data, scale


def sr_operands(bits) -> tuple:
  """The primitive operands of rounding bits: (), (uint8 bits,), or KeyedBits' (rows, cols)."""
  if bits is None:
    return ()
  if isinstance(bits, random_bits.KeyedBits):
    return (bits.rows.astype(jnp.uint32), bits.cols.astype(jnp.uint32))
  return (bits.astype(jnp.uint8),)


def variant(fmt: str, tiled: bool, stochastic: bool = False) -> str:
  """The op's name in profiles: "nvfp4_1x16", "nvfp4_16x16_sr", "mxfp4_1x32", ..."""
  r, c = formats.TILE[fmt] if tiled else (1, formats.BLOCK[fmt])
  return f"{fmt}_{r}x{c}" + ("_sr" if stochastic else "")
