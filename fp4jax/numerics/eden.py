"""Quartet II's backward quantizer: RHT-128 with fresh signs, then MS-EDEN (NVFP4 with an unbiased scale).

MS-EDEN rounds the elements to nearest and puts the randomness in the scales: per group of 128 values
(one RHT chunk, 8 blocks of 16) a correction c = Σ xs² / Σ xs·q makes the quantized group's projection
on the input equal the input's norm, and each corrected block scale s_b·c is rounded stochastically
to E4M3 with 16 random bits, so its expectation is exact. After the random rotation the quantized
tensor is then an unbiased estimate of the input, with less error than stochastic rounding of the
elements. All arithmetic float32, one rounding per operation, no fused multiply-add (``_exact``):

  SO = (17/16)·0.93;  VAL_MAX = f32(6/SO);  SCALE_MAX = f32(255.99)
  amax  = max|y| over the tensor;  s_dec = (amax / SCALE_MAX) / VAL_MAX  (1 when amax is 0)
  s_b   = e4m3((amax_b / VAL_MAX) / s_dec)            1.0 when that is 0
  xs_i  = y_i / (s_b · s_dec);   q_i = e2m1(xs_i)      nearest even, saturating at ±6
  c_g   = fold(xs·xs) / fold(xs·e2m1val(q))            per group (128, or 16 as the option); 1 if 0/0
  scale_b = e4m3_sr16(s_b · c_g, r16_b)
  dequantize: e2m1val(q_i) · (f32(scale_b) · s_dec); a GEMM scales its float32 sum by s_dec_A·s_dec_B

``fold`` sums by halving (v[:n/2] + v[n/2:], repeated), each product rounded before it is added.
Axis legend: L the quantized axis (a multiple of 128), G = L/group, NB = L/16.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import random_bits
from fp4jax.numerics import e2m1
from fp4jax.numerics.amax import abs_max
from fp4jax._exact import div, product
from fp4jax.numerics.hadamard import fwht_last
from fp4jax.numerics.scales import e4m3_rne_satfinite

BLOCK = 16
RHT_SIZE = 128
GROUPS = (128, 16)
SCALE_OVERRIDE = (17.0 / 16.0) * 0.93              # python double, as the reference
VAL_MAX = np.float32(6.0 / SCALE_OVERRIDE)          # 6.0721064: the block max maps slightly above 6
SCALE_MAX = np.float32(255.99)                      # the largest block's scale: room for c up to 1.75
_RHT_NORM = np.float32(2.0 ** -3.5)                 # 1/sqrt(128)
_E4M3_MIN_NORMAL = np.float32(2.0 ** -6)


class Eden(NamedTuple):
  """MS-EDEN of y (..., L): codes (..., L) uint8, scale (..., NB) float8_e4m3fn, s_dec float32 ()."""
  codes: jnp.ndarray
  scale: jnp.ndarray
  s_dec: jnp.ndarray
  rtn_scale: jnp.ndarray    # E4M3 scales before the correction (..., NB), for tests and diagnostics
  correction: jnp.ndarray   # c per group (..., G)


# ---------------------------------------------------------------------------------------------------
# RHT-128 with random signs
# ---------------------------------------------------------------------------------------------------

def random_signs(key, size: int = RHT_SIZE):
  """±1 float32 (size,) from ``size`` random bits (one per sign) of ``jax.random.bits``."""
  bits = random_bits.bits(key, (size,), jnp.uint8) & 1
  return jnp.float32(1.0) - jnp.float32(2.0) * bits.astype(jnp.float32)


def rht(x, signs, *, axis: int = -1):
  """(x ∘ s)·H/√n on consecutive n-chunks along ``axis`` (n = len(signs)): float32 butterfly in natural
  order, then one multiply by f32(1/√n) (for n = 128, f32(2^-3.5)). Shape of x, float32."""
  n = signs.shape[-1]
  axis = axis % x.ndim
  if x.shape[axis] % n:
    raise ValueError(f"RHT along axis {axis} of length {x.shape[axis]}: the length must be a multiple of "
                     f"{n}; pad the tensor (fp4jax.dot pads for you)")
  x_f32 = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  lead = x_f32.shape[:-1]
  chunks = x_f32.reshape(*lead, x_f32.shape[-1] // n, n) * signs.astype(jnp.float32)
  norm = _RHT_NORM if n == RHT_SIZE else jnp.float32(1.0 / np.sqrt(n))
  y = product(fwht_last(chunks), norm)   # 2^-3.5 is inexact: rounded before a caller's sum
  return jnp.moveaxis(y.reshape(x_f32.shape), -1, axis)


# ---------------------------------------------------------------------------------------------------
# E4M3 with stochastic rounding from 16 bits
# ---------------------------------------------------------------------------------------------------

def e4m3_sr16(t_f32, r16):
  """Stochastically rounded E4M3 of t >= 0 with one uint16 per value.

  Rounds up iff the 20 float32 mantissa bits below E4M3's 3 exceed r16·16, so P(up) is the position
  of t between its two E4M3 neighbours to 2^-16. Outside E4M3's normal range (t > 448 or t < 2^-6):
  plain nearest-even, saturating at 448.
  """
  t_f32 = jnp.asarray(t_f32, jnp.float32)
  b = lax.bitcast_convert_type(t_f32, jnp.uint32)
  up = (b & 0xFFFFF) > (r16.astype(jnp.uint32) << 4)
  moved = lax.bitcast_convert_type(jnp.where(up, b | 0xFFFFF, b & ~jnp.uint32(0xFFFFF)), jnp.float32)
  outside = (t_f32 > 448.0) | (t_f32 < _E4M3_MIN_NORMAL)
  return e4m3_rne_satfinite(jnp.where(outside, t_f32, moved))


# ---------------------------------------------------------------------------------------------------
# MS-EDEN
# ---------------------------------------------------------------------------------------------------

def fold_sum_last(t):
  """Σ over the last axis (a power of two) by halving."""
  while t.shape[-1] > 1:
    half = t.shape[-1] // 2
    t = t[..., :half] + t[..., half:]
  return t[..., 0]


def decode_scale(amax):
  """s_dec = (amax / 255.99) / VAL_MAX, 1 when amax is 0."""
  amax = jnp.asarray(amax, jnp.float32)
  return jnp.where(amax == 0, jnp.float32(1.0), div(div(amax, SCALE_MAX), VAL_MAX))


def quantize(y, r16, *, group: int = 128, amax=None) -> Eden:
  """MS-EDEN of y (..., L) along its last axis (L a multiple of 128; rotate it first).

  r16: uint16 (..., NB), one per 16-block. group: 128 (the research reference, default: one
  correction per RHT chunk) or 16 (the CUDA kernels: one per block). amax: defaults to max|y|.
  """
  if group not in GROUPS:
    raise ValueError(f"eden_group={group!r}; use 128 (default) or 16")
  y = jnp.asarray(y, jnp.float32)
  if y.shape[-1] % RHT_SIZE:
    raise ValueError(f"MS-EDEN quantizes groups of 128 along the last axis; its length {y.shape[-1]} is "
                     "not a multiple of 128; pad the input or use fp4jax.dot, which pads")
  lead, length = y.shape[:-1], y.shape[-1]
  if tuple(r16.shape) != (*lead, length // BLOCK):
    raise ValueError(f"r16 has shape {r16.shape}; it must be {(*lead, length // BLOCK)} (one per block)")
  amax = abs_max(y) if amax is None else jnp.asarray(amax, jnp.float32).reshape(())
  s_dec = decode_scale(amax)
  y_blk = y.reshape(*lead, length // BLOCK, BLOCK)
  rtn = e4m3_rne_satfinite(div(div(abs_max(y_blk, axis=-1), VAL_MAX), s_dec))
  s_b = jnp.where(rtn.astype(jnp.float32) == 0, jnp.float32(1.0), rtn.astype(jnp.float32))
  xs = div(y_blk, (s_b * s_dec)[..., None])
  codes = e2m1.encode_rne(xs)
  xs_g = xs.reshape(*lead, length // group, group)
  q_g = e2m1.decode(codes).reshape(xs_g.shape)
  num = fold_sum_last(product(xs_g, xs_g))
  den = fold_sum_last(product(xs_g, q_g))
  c = jnp.where(den == 0, jnp.float32(1.0), div(num, jnp.where(den == 0, jnp.float32(1.0), den)))
  t = s_b * jnp.repeat(c, group // BLOCK, axis=-1)
  scale = e4m3_sr16(t, r16)
  return Eden(codes.reshape(y.shape), scale, s_dec, rtn, c)


def scaled_values(codes, scale):
  """e2m1val(q) · f32(scale) without s_dec (exact in bfloat16), shaped like codes."""
  return e2m1.decode(codes) * jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=-1)


def dequantize(codes, scale, s_dec):
  """float32 values e2m1val(q) · (f32(scale) · s_dec)."""
  factor = scale.astype(jnp.float32) * jnp.asarray(s_dec, jnp.float32)
  return product(e2m1.decode(codes), jnp.repeat(factor, BLOCK, axis=-1))   # rounded before a caller's sum


def scale_bits(key, shape):
  """The random bits of ``quantize``: one uint16 per 16-block of a (..., L) tensor."""
  return random_bits.bits(key, (*shape[:-1], shape[-1] // BLOCK), jnp.uint16)
