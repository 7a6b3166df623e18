"""E2M1, the 4-bit element format: rounding, codes and packing (spec §1, §4).

Codes 0..7 are the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same with the sign bit set.
Everything here works elementwise on float32 values that are already scaled into [-6, 6] (values
outside saturate), so the same functions serve NVFP4 and MXFP4 and the Pallas kernels.

codes: uint8, one E2M1 code per element (low nibble).
packed: uint8, two codes per byte along the last axis, element 2j in the low nibble, 2j+1 in the high.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

MAX = 6.0
VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Round-to-nearest-even decision points between consecutive magnitudes. At a tie the even code wins,
# so the comparison alternates: code 0 keeps 0.25, code 2 takes 0.75 and keeps 1.25, code 4 takes
# 1.75 and keeps 2.5, code 6 takes 3.5 and keeps 5.
_RNE_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))   # (point, inclusive)


def _sign_bit(x_f32):
  return jnp.where(jnp.signbit(x_f32), jnp.uint8(8), jnp.uint8(0))


def encode_rne(x_f32):
  """E2M1 codes of float32 values, round to nearest, ties to even code, saturating at ±6.

  Negative values keep their sign bit even when they round to zero (code 8 is -0). NaN gives the code
  of ±0 (its sign bit); callers detect non-finite values separately.
  """
  mag = jnp.abs(x_f32)
  code = jnp.zeros(x_f32.shape, jnp.uint8)
  for point, inclusive in _RNE_THRESHOLDS:
    above = mag >= point if inclusive else mag > point
    code = code + above.astype(jnp.uint8)
  return code | _sign_bit(x_f32)


def _sr_step(v):
  return jnp.where(v < 2.0, jnp.float32(0.5), jnp.where(v < 4.0, jnp.float32(1.0), jnp.float32(2.0)))


def round_stochastic(x_f32, bits):
  """Stochastically rounded E2M1 values (float32) of ``x_f32`` using 8 random bits per element (spec §4).

  u = (bits & 0xFF) / 256; t = |x| + u·step(|x|); q = min(floor(t / step(t))·step(t), 6), sign of x.
  u·step is exact in float32 (8 significant bits times a power of two), so the multiply-add is exact.
  """
  u = (bits.astype(jnp.uint32) & 0xFF).astype(jnp.float32) * jnp.float32(1.0 / 256.0)
  mag = jnp.abs(x_f32)
  t = mag + u * _sr_step(mag)
  step_t = _sr_step(t)
  q = jnp.minimum(jnp.floor(t / step_t) * step_t, jnp.float32(MAX))
  return jnp.where(jnp.signbit(x_f32), -q, q)


def encode_stochastic(x_f32, bits):
  """E2M1 codes with stochastic rounding (spec §4)."""
  q = round_stochastic(x_f32, bits)
  return encode_rne(q)   # q is on the grid; keeps -0 for negative inputs that round to zero


def decode(codes):
  """float32 values of E2M1 codes (uint8, low nibble)."""
  codes = codes.astype(jnp.int32)
  mag_code = codes & 7
  # Magnitude from the code without a gather: 0, .5, 1, 1.5 for codes 0..3; 2, 3, 4, 6 for 4..7.
  low = mag_code.astype(jnp.float32) * 0.5
  high = jnp.where(mag_code == 7, 6.0, (mag_code - 2).astype(jnp.float32))
  mag = jnp.where(mag_code < 4, low, high)
  return jnp.where((codes & 8) != 0, -mag, mag)


def pack(codes):
  """Two codes per byte along the last axis (even element in the low nibble). Last dim must be even."""
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack(packed):
  """Inverse of ``pack``: uint8 codes, the last axis twice as long."""
  low = packed & 0xF
  high = (packed >> 4) & 0xF
  return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
