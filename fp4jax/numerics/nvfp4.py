"""NVFP4: E2M1 elements, one E4M3 scale per block, one float32 amax per tensor (spec §2).

The functions here work on a *blocked view*: ``x_f32`` of shape (..., NB, B) where each row of B
elements is one block (1x16 blocks: B = 16; 16x16 tiles flattened: B = 256). Layout (which axis,
tiles) is handled by ``fp4jax.layout``; this module is only the arithmetic, in the spec's order.

Tensors whose amax is far from 1. NVFP4 codes and block scales are invariant under multiplying the
tensor by a power of two (every step of the spec's order scales exactly), so where the spec's float32
arithmetic would leave the normal range, fp4jax evaluates the same formulas on amax (and x) times an
exact power of two and keeps the true amax:
  - quantize, amax_g < 2^-64: S_enc = 2688/amax_g overflows (the spec clamps it to FLT_MAX, and then
    S_dec = 1/S_enc is a subnormal that CPUs flush to 0, saturating every code). Computed on x · 2^64.
  - dequantize, amax_g > 2^64 (f32(s_b) · amax_g overflows from ~7.6e35 up) or < 2^-64 (it goes
    subnormal): computed as (e2m1 · ((f32(s_b) · m) · f32(1/2688))) · 2^e with amax_g = m · 2^e.
Within [2^-64, 2^64] every step is the spec's, bit for bit. Dequantized values are finite for finite
input, up to float32's range: a value 1 ulp above FLT_MAX (amax_g = FLT_MAX) is clamped to FLT_MAX.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp4jax._exact import div, product
from fp4jax.numerics import e2m1
from fp4jax.numerics.amax import abs_max
from fp4jax.numerics.scales import FLT_MAX, e4m3_rne_satfinite

_ONE_SIXTH = np.float32(1.0 / 6.0)
_INV_2688 = np.float32(1.0 / 2688.0)   # 1 / (6 · 448)
_SHIFT = 64                             # |exponent| of the power-of-two rescaling of far-out tensors
_FLT_MAX = np.float32(FLT_MAX)


def _in_range(amax_g):
  """Where the spec's tensor-level arithmetic stays normal (also True for 0, inf and NaN)."""
  lo, hi = jnp.float32(2.0 ** -_SHIFT), jnp.float32(2.0 ** _SHIFT)
  return ~((amax_g > 0) & (amax_g < lo)) & ~((amax_g > hi) & jnp.isfinite(amax_g))


def tensor_amax(x):
  """max |x| over the whole tensor, float32 (NaN if any element is NaN; 0 for a zero-size x)."""
  return abs_max(x)


def global_encode_scale(amax_g, divide=jnp.divide):
  """S_enc = min(448·6 / amax, FLT_MAX); 1 when amax is 0 (or inf, where the quotient is 0); NaN for a NaN
  amax. ``divide``: the correctly rounded division to use (inside a kernel:
  ``fp4jax._pallas_compat.precise_div``). The clip is a select, not a minimum: inside a Triton kernel a
  float minimum lowers to ``minnumf``, which returns the number and drops the NaN."""
  amax_g = jnp.asarray(amax_g, jnp.float32)
  quotient = divide(jnp.float32(2688.0), amax_g)
  s_enc = jnp.where(quotient > jnp.float32(FLT_MAX), jnp.float32(FLT_MAX), quotient)
  return jnp.where((amax_g == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def encode_shift(amax_g):
  """The exact power of two p (float32) that quantization multiplies amax and x by: 2^64 for a tiny
  tensor amax (0 < amax_g < 2^-64), else 1 (module docstring)."""
  amax_g = jnp.asarray(amax_g, jnp.float32)
  tiny = (amax_g > 0) & (amax_g < jnp.float32(2.0 ** -_SHIFT))
  return jnp.where(tiny, jnp.float32(2.0 ** _SHIFT), jnp.float32(1.0))


def block_scales(amax_b, amax_g):
  """E4M3 block scales s_b and the float32 per-block encode factors enc_b (spec §2 order).

  amax_b and amax_g already multiplied by ``encode_shift(amax_g)``; enc_b applies to x times it.
  """
  s_enc = global_encode_scale(amax_g)
  s_dec = div(1.0, s_enc)   # S_enc is a quotient: never amax/2688 (fp4jax._exact)
  s_b = e4m3_rne_satfinite(jnp.minimum(amax_b * (s_enc * _ONE_SIXTH), jnp.float32(FLT_MAX)))
  enc_b = jnp.minimum(jnp.float32(1.0) / (s_b.astype(jnp.float32) * s_dec), jnp.float32(FLT_MAX))
  return s_b, enc_b


def quantize_blocks(x_f32, amax_g, *, bits=None):
  """Codes (uint8, shape of x) and E4M3 scales (..., NB) of blocked float32 values (..., NB, B).

  ``bits`` (uint8/uint32, shape of x): stochastic rounding with those random bits; None: nearest even.
  """
  p = encode_shift(amax_g)
  x_f32 = x_f32 * p          # exact; p = 1 unless the tensor amax is below 2^-64
  amax_b = abs_max(x_f32, axis=-1)
  s_b, enc_b = block_scales(amax_b, jnp.asarray(amax_g, jnp.float32) * p)
  scaled = jnp.clip(x_f32 * enc_b[..., None], -e2m1.MAX, e2m1.MAX)
  if bits is None:
    codes = e2m1.encode_rne(scaled)
  else:
    codes = e2m1.encode_stochastic(scaled, bits)
  return codes, s_b


def decode_factor(s_b, amax_g):
  """Per-block float32 dequantization factor (f32(s_b) · amax) · f32(1/2688) (the spec's; it
  overflows for amax_g above ~7.6e35, which ``dequantize_blocks`` avoids). ``product`` keeps XLA
  from folding a compile-time constant amax into the constant, s_b · (amax · f32(1/2688))."""
  return product(s_b, amax_g) * _INV_2688


def _pow2(e):
  return jnp.ldexp(jnp.float32(1.0), e)


def dequantize_blocks(codes, s_b, amax_g):
  """float32 values (..., NB, B) of blocked codes and their E4M3 scales (..., NB).

  e2m1 · ((f32(s_b) · amax_g) · f32(1/2688)); outside amax_g in [2^-64, 2^64] with amax_g = m · 2^e
  split as m and 2^e, applied last in two exact halves (module docstring).
  """
  amax_g = jnp.asarray(amax_g, jnp.float32)
  # A negative amax (hand-built, under jit where it cannot be checked) gives NaN, not flipped signs.
  amax_g = jnp.where(amax_g < 0, jnp.float32(jnp.nan), amax_g)
  keep = _in_range(amax_g)
  m, e = jnp.frexp(amax_g)
  e = jnp.where(keep, 0, e.astype(jnp.int32))
  m = jnp.where(keep, amax_g, m)
  factor = decode_factor(s_b, m)
  # amax 0 belongs to an all-zero tensor (all scales 0); with a nonzero scale it is a wrong amax.
  factor = jnp.where((amax_g == 0) & (s_b.astype(jnp.float32) != 0), jnp.float32(jnp.nan), factor)
  # Rounded before any sum the caller forms with them (fp4jax._exact); the last power of two too,
  # where it can make the value subnormal (a fused add would not flush it).
  vals = product(e2m1.decode(codes), factor[..., None])
  vals = product(vals * _pow2(e // 2), _pow2(e - e // 2))
  return jnp.where(keep, vals, jnp.clip(vals, -_FLT_MAX, _FLT_MAX))
