"""Scale formats: E4M3 block scales (NVFP4) and E8M0 power-of-two scales (MXFP4, spec §3)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FLT_MAX = float(jnp.finfo(jnp.float32).max)
E4M3_MAX = 448.0


def e4m3_rne_satfinite(v_f32):
  """float8_e4m3fn, round to nearest even, clamped to ±448 first (the plain cast turns >= 464 into NaN)."""
  return jnp.clip(v_f32, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def _frexp_exponent(a_f32):
  """e with a = m·2^e, m in [0.5, 1), and whether m == 0.5 (a an exact power of two). a > 0, finite."""
  m, e = jnp.frexp(a_f32)
  return e.astype(jnp.int32), m == 0.5


def e8m0_exponent(amax_b, rule: str):
  """Unbiased E8M0 exponent of MXFP4 block scales from block amax (float32, >= 0), spec §3.

  floor: floor(log2(amax)) - 2 (OCP; 2 is E2M1's max exponent). rceil: ceil(log2(amax · f32(1/6))).
  Both computed exactly from the binary exponent, never through a rounded log2. Clamped to [-127, 127];
  an all-zero block gets -127 (byte 0). Returns int32.
  """
  amax_b = amax_b.astype(jnp.float32)
  if rule == "floor":
    e, _ = _frexp_exponent(amax_b)
    exp = e - 1 - 2
  elif rule == "rceil":
    y = amax_b * jnp.float32(1.0 / 6.0)
    e, is_pow2 = _frexp_exponent(y)
    exp = jnp.where(is_pow2, e - 1, e)
  else:
    raise ValueError(f"unknown MXFP4 scale rule {rule!r}; use 'rceil' or 'floor'")
  exp = jnp.clip(exp, -127, 127)
  exp = jnp.where(amax_b == 0, -127, exp)
  # inf saturates to the largest scale; frexp of inf is unspecified, so set it explicitly.
  return jnp.where(jnp.isinf(amax_b), 127, exp)


def e8m0_from_exponent(exp_i32, amax_b=None):
  """float8_e8m0fnu scales from unbiased exponents; NaN block amax gives the NaN byte 0xFF."""
  byte = (exp_i32 + 127).astype(jnp.uint8)
  if amax_b is not None:
    byte = jnp.where(jnp.isnan(amax_b), jnp.uint8(0xFF), byte)
  return lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


def e8m0_to_f32(scale_e8m0):
  """2^(byte - 127) as float32 (byte 0 -> 2^-127, a float32 subnormal; 0xFF -> NaN)."""
  byte = lax.bitcast_convert_type(scale_e8m0, jnp.uint8).astype(jnp.int32)
  val = jnp.ldexp(jnp.float32(1.0), byte - 127)
  return jnp.where(byte == 255, jnp.float32(jnp.nan), val)
