"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one E8M0 power-of-two scale per block of 32 (spec §3).

Works on a blocked view (..., NB, 32) like ``fp4jax.nvfp4``. No tensor-level scale.

Near float32's top: the RCEIL rule gives a finite block at most the exponent 126, and codes 4 and 6
times 2^126 are 2^128 and more, which float32 cannot hold. Finite elements of such a block saturate
at code 3 (3 · 2^126 = 1.5 · 2^127 ≈ 2.55e38, the largest finite float32 any MXFP4 block can
denote), the way E4M3 saturates at 448; exponent 127 (blocks holding inf) likewise caps finite
elements at 1.5, while ±inf keeps code ±6 and dequantizes to ±inf. Below exponent 126 nothing changes.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax.numerics import e2m1
from fp4jax.numerics.amax import abs_max
from fp4jax.numerics.scales import e8m0_exponent, e8m0_from_exponent, e8m0_to_f32


def _finite_limit(exp):
  """The largest E2M1 magnitude whose value times 2^exp is a finite float32."""
  return jnp.where(exp >= 127, jnp.float32(1.5),
                   jnp.where(exp == 126, jnp.float32(3.0), jnp.float32(e2m1.MAX)))


def quantize_blocks(x_f32, *, scale_rule="rceil", bits=None):
  """Codes (uint8, shape of x) and float8_e8m0fnu scales (..., NB) of blocked float32 values."""
  amax_b = abs_max(x_f32, axis=-1)
  exp = e8m0_exponent(amax_b, scale_rule)
  # x / 2^exp as multiplies by exact powers of two; 2^-127 would be a float32 subnormal (flushed to
  # zero on CPU), so exponent 127 is applied as 2^-126 · 2^-1.
  inv = jnp.ldexp(jnp.float32(1.0), jnp.maximum(-exp, -126))
  inv_rest = jnp.ldexp(jnp.float32(1.0), jnp.minimum(126 - exp, 0))
  limit = jnp.where(jnp.isinf(x_f32), jnp.float32(e2m1.MAX), _finite_limit(exp)[..., None])
  scaled = jnp.clip((x_f32 * inv[..., None]) * inv_rest[..., None], -limit, limit)
  if bits is None:
    codes = e2m1.encode_rne(scaled)
  else:
    codes = e2m1.encode_stochastic(scaled, bits)
  return codes, e8m0_from_exponent(exp, amax_b)


def dequantize_blocks(codes, scale):
  """float32 values (..., NB, 32) of blocked codes and their E8M0 scales (..., NB)."""
  return e2m1.decode(codes) * e8m0_to_f32(scale)[..., None]
