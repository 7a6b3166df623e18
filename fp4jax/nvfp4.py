"""NVFP4: E2M1 elements, one E4M3 scale per block, one float32 amax per tensor (spec §2).

The functions here work on a *blocked view*: ``x_f32`` of shape (..., NB, B) where each row of B
elements is one block (1x16 blocks: B = 16; 16x16 tiles flattened: B = 256). Layout (which axis,
tiles) is handled by ``fp4jax.layout``; this module is only the arithmetic, in the spec's order.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax import e2m1
from fp4jax.scales import FLT_MAX, e4m3_rne_satfinite

_ONE_SIXTH = jnp.float32(1.0 / 6.0)
_INV_2688 = jnp.float32(1.0 / 2688.0)   # 1 / (6 · 448)


def tensor_amax(x):
  """max |x| over the whole tensor, float32 (NaN if any element is NaN)."""
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def global_encode_scale(amax_g):
  """S_enc = min(448·6 / amax, FLT_MAX); 1 when amax is 0 (or inf, where the quotient is 0)."""
  amax_g = jnp.asarray(amax_g, jnp.float32)
  s_enc = jnp.minimum(jnp.float32(2688.0) / amax_g, jnp.float32(FLT_MAX))
  return jnp.where((amax_g == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def block_scales(amax_b, amax_g):
  """E4M3 block scales s_b and the float32 per-block encode factors enc_b (spec §2 order)."""
  s_enc = global_encode_scale(amax_g)
  s_dec = jnp.float32(1.0) / s_enc
  s_b = e4m3_rne_satfinite(jnp.minimum(amax_b * (s_enc * _ONE_SIXTH), jnp.float32(FLT_MAX)))
  enc_b = jnp.minimum(jnp.float32(1.0) / (s_b.astype(jnp.float32) * s_dec), jnp.float32(FLT_MAX))
  return s_b, enc_b


def quantize_blocks(x_f32, amax_g, *, bits=None):
  """Codes (uint8, shape of x) and E4M3 scales (..., NB) of blocked float32 values (..., NB, B).

  ``bits`` (uint8/uint32, shape of x): stochastic rounding with those random bits; None: nearest even.
  """
  amax_b = jnp.max(jnp.abs(x_f32), axis=-1)
  s_b, enc_b = block_scales(amax_b, amax_g)
  scaled = jnp.clip(x_f32 * enc_b[..., None], -e2m1.MAX, e2m1.MAX)
  if bits is None:
    codes = e2m1.encode_rne(scaled)
  else:
    codes = e2m1.encode_stochastic(scaled, bits)
  return codes, s_b


def decode_factor(s_b, amax_g):
  """Per-block float32 dequantization factor (f32(s_b) · amax) · f32(1/2688)."""
  return (s_b.astype(jnp.float32) * jnp.asarray(amax_g, jnp.float32)) * _INV_2688


def dequantize_blocks(codes, s_b, amax_g):
  """float32 values (..., NB, B) of blocked codes and their E4M3 scales (..., NB)."""
  return e2m1.decode(codes) * decode_factor(s_b, amax_g)[..., None]
