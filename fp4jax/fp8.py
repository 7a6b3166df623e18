"""FP8 E4M3 with float32 scales: block scaling (the paper's FP8 baseline) or one scale per tensor.

Blocked view (..., NB, B) like ``fp4jax.nvfp4``: 1x128 blocks for activations and gradients, 128x128
tiles (B = 16384) for weights; per-tensor scaling is one block holding the whole tensor.
scale: float32 decode factor amax/448 (1 for an all-zero block); data: E4M3 values of x · 448/amax.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax.scales import E4M3_MAX, e4m3_rne_satfinite


def quantize_blocks(x_f32):
  """E4M3 data (shape of x) and float32 decode scales (..., NB) of blocked float32 values."""
  amax_b = jnp.max(jnp.abs(x_f32), axis=-1)
  usable = (amax_b > 0) & jnp.isfinite(amax_b)
  enc = jnp.where(usable, jnp.float32(E4M3_MAX) / jnp.where(usable, amax_b, 1.0), jnp.float32(1.0))
  data = e4m3_rne_satfinite(x_f32 * enc[..., None])
  return data, jnp.float32(1.0) / enc


def dequantize_blocks(data, scale):
  return data.astype(jnp.float32) * scale[..., None]
