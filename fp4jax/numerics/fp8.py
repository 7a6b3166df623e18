"""FP8 E4M3 with float32 scales: block scaling (the paper's FP8 baseline) or one scale per tensor.

Blocked view (..., NB, B) like ``fp4jax.nvfp4``: 1x128 blocks for activations and gradients, 128x128
tiles (B = 16384) for weights; per-tensor scaling is one block holding the whole tensor.
scale: float32 decode factor 1/enc with enc = min(448 / amax_b, 2^126), amax_b the largest *finite*
magnitude of the block (1 for a block with no nonzero finite element); data: E4M3 values of x · enc.

Non-finite elements: E4M3 (the "fn" variant) has no infinity, so ±inf and NaN are stored as the NaN
code and dequantize to NaN; every GEMM output that reads them is NaN, as in a bf16 GEMM where inf
meets a zero or an opposite inf. The block's other elements are scaled by their own finite amax, so
they are quantized exactly as if the non-finite element were absent. Nothing is silently finite.

The cap enc <= 2^126 keeps the decode factor a normal float32 (>= 2^-126; CPUs flush subnormals),
so a block whose amax is below 448 · 2^-126 (~5.3e-36) uses fewer E4M3 bits instead of vanishing.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp4jax._exact import div, product
from fp4jax.numerics.scales import E4M3_MAX, e4m3_rne_satfinite

_ENC_MAX = np.float32(2.0 ** 126)


def quantize_blocks(x_f32):
  """E4M3 data (shape of x) and float32 decode scales (..., NB) of blocked float32 values."""
  finite = jnp.isfinite(x_f32)
  amax_b = jnp.max(jnp.where(finite, jnp.abs(x_f32), 0.0), axis=-1, initial=0.0)
  usable = amax_b > 0
  enc = jnp.where(usable, jnp.float32(E4M3_MAX) / jnp.where(usable, amax_b, 1.0), jnp.float32(1.0))
  enc = jnp.minimum(enc, _ENC_MAX)
  data = e4m3_rne_satfinite(jnp.where(finite, x_f32 * enc[..., None], jnp.float32(jnp.nan)))
  return data, div(1.0, enc)   # enc is a quotient: never (1·amax)/448 (fp4jax._exact)


def dequantize_blocks(data, scale):
  """data · scale, rounded before any sum the caller forms with it (the scale is not a power of two)."""
  return product(data.astype(jnp.float32), scale[..., None])
