"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one E8M0 power-of-two scale per block of 32 (spec §3).

Works on a blocked view (..., NB, 32) like ``fp4jax.nvfp4``. No tensor-level scale.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax import e2m1
from fp4jax.scales import e8m0_exponent, e8m0_from_exponent, e8m0_to_f32


def quantize_blocks(x_f32, *, scale_rule="rceil", bits=None):
  """Codes (uint8, shape of x) and float8_e8m0fnu scales (..., NB) of blocked float32 values."""
  amax_b = jnp.max(jnp.abs(x_f32), axis=-1)
  exp = e8m0_exponent(amax_b, scale_rule)
  # x / 2^exp as a multiply by an exact power of two; 2^-127 would be a float32 subnormal (flushed to
  # zero on CPU), and exp = 127 only happens for blocks holding inf, whose codes saturate either way.
  inv = jnp.ldexp(jnp.float32(1.0), jnp.maximum(-exp, -126))
  scaled = jnp.clip(x_f32 * inv[..., None], -e2m1.MAX, e2m1.MAX)
  if bits is None:
    codes = e2m1.encode_rne(scaled)
  else:
    codes = e2m1.encode_stochastic(scaled, bits)
  return codes, e8m0_from_exponent(exp, amax_b)


def dequantize_blocks(codes, scale):
  """float32 values (..., NB, 32) of blocked codes and their E8M0 scales (..., NB)."""
  return e2m1.decode(codes) * e8m0_to_f32(scale)[..., None]
