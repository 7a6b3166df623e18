"""``fp4jax_quantize_rht_t``: the weight-gradient operand path, x (T, C) -> RHT(x)ᵀ (C, T) quantized
along T: packed codes (C, T/2) and scales (C, T/B).

Axis legend: T tokens, C channels, B the block (16 nvfp4, 32 mxfp4). Operands: x, the NVFP4 tensor
amax of RHT(x) (a scalar, reduced by the caller; zero for MXFP4), optionally bits (C, T) or (param
``keyed``) ``random_bits.KeyedBits`` of (C, T) as rows (C, 4) and cols (T, 2), hashed in the kernel.
Params: fmt, rht_size, rht_seed, scale_rule, keyed, row_stride, impl, stored (as ``fp4jax_quantize``'s).
Under vmap the op takes leading axes (x (..., T, C), amax (...), the bits' rows (..., C, 4); KeyedBits' cols
are the shape's constants) and stays one op: one kernel whose grid runs over the leading axes too
(``fp4jax.grouped``'s chunks of every expert in one launch).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _exact, dispatch, formats, random_bits
from fp4jax.kernels import quantize_rht_t as kernel
from fp4jax.primitives import pair
from fp4jax.primitives.quantize import batch_leading, keyed_param, row_stride_param, sr_bits, sr_operands
from fp4jax.primitives import sharding as shd
from fp4jax.reference import quantize_rht_t_reference


def _rows(fmt, rht_size):
  """Token rows one transform-and-quantize unit spans: whole blocks and whole RHT chunks."""
  return max(formats.BLOCK[fmt], rht_size)


def _abstract(x, amax, *bits, fmt, rht_size, rht_seed, scale_rule, keyed, row_stride, impl, stored):
  *lead, t, c = x.shape
  return (pair.ShapedArray((*lead, c, t // 2), jnp.uint8),
          pair.ShapedArray((*lead, c, t // formats.BLOCK[fmt]), formats.SCALE_DTYPE[fmt]))


def _local(x, amax, *bits, platform, **params):
  """One (T, C) slice per leading index, vmapped: a kernel's grid gains the leading axes, XLA's fusion
  batches them."""
  f = functools.partial(_local_2d, platform=platform, **params)
  for _ in range(x.ndim - 2):   # KeyedBits' cols (the 4th operand) are shared by every slice
    f = jax.vmap(f, in_axes=(0, 0) + tuple(None if i == 1 else 0 for i in range(len(bits))))
  return f(x, amax, *bits)


def _local_2d(x, amax, *bits, fmt, rht_size, rht_seed, scale_rule, keyed, row_stride, impl, stored, platform):
  bits = sr_bits(bits, keyed, row_stride)
  if stored and not (impl == "pallas" and platform == "cuda"):   # as in fp4jax_quantize's _local
    x = _exact.stored(x)
  if impl == "pallas" and platform in ("cuda", "cpu"):
    q, s = kernel.quantize_rht_t(x, amax, bits, fmt=fmt, rht_size=rht_size, rht_seed=rht_seed,
                                 scale_rule=scale_rule, interpret=platform != "cuda")
    return q, lax.bitcast_convert_type(s, formats.SCALE_DTYPE[fmt])
  if fmt == "nvfp4":   # the reference's bits in a form XLA's GPU compiler fuses (docs/DESIGN.md, "The XLA composition on the GPU")
    return kernel.quantize_rht_t_rows(x, amax, random_bits.drawn(bits), rht_size=rht_size, rht_seed=rht_seed)
  return quantize_rht_t_reference(x, amax, random_bits.drawn(bits), fmt=fmt, rht_size=rht_size, rht_seed=rht_seed,
                                  scale_rule=scale_rule)


def _shardings(mesh, arg_shapes, *, fmt, rht_size, keyed, **_):
  x = arg_shapes[0]
  lead, t_e, c_e = shd.quantize_rht_t_specs(mesh, x.shape, x.sharding, rows=_rows(fmt, rht_size))
  sr = [lead + [c_e, None], [t_e, None]] if keyed else [lead + [c_e, t_e]] * (len(arg_shapes) - 2)
  args = [lead + [t_e, c_e], lead] + sr
  return args, [lead + [c_e, t_e], lead + [c_e, t_e]], ()


def _rule(ndims, *, fmt, rht_size, keyed, **_):
  return shd.quantize_rht_t_rule("key" if keyed else len(ndims) == 3, rows=_rows(fmt, rht_size),
                                 block=formats.BLOCK[fmt], lead=ndims[0] - 2)


quantize_rht_t_p = pair.define(pair.OpSpec(
    "quantize_rht_t", _abstract, _local, _shardings, _rule, batch_leading=batch_leading))


def quantize_rht_t(x, amax, bits=None, *, fmt, rht_size=16, rht_seed=None, scale_rule="rceil",
                   impl=None, stored=False):
  """(packed codes (C, T/2), scales (C, T/B)) of RHT(x)ᵀ quantized along T; x of shape (T, C).

  bits: uint8 (C, T), ``random_bits.KeyedBits`` of (C, T), or None.
  impl: "pallas" | "xla" | None (the default: ``dispatch.choose``). stored: as ``quantize_last``'s."""
  impl = dispatch.choose("quantize_rht_t", fmt, impl)
  name = f"{fmt}_rht{rht_size}_t_1x{formats.BLOCK[fmt]}" + ("_sr" if bits is not None else "")
  with pair.scope(name):
    ops = (x, jnp.asarray(amax, jnp.float32)) + sr_operands(bits)
    data, scale = quantize_rht_t_p.bind(*ops, fmt=fmt, rht_size=int(rht_size), rht_seed=rht_seed,
                                        scale_rule=scale_rule, keyed=keyed_param(bits),
                                        row_stride=row_stride_param(bits), impl=impl, stored=bool(stored))
  return data, scale
