"""MXFP8 E4M3 as TetraJet-v2's OutControl uses it: blocks of 32, a power-of-two scale rounded UP.

  scale = 2^(e - 127), e = the E8M0 byte of amax_32 / 448 rounded up to a power of two (saturating at
          byte 254; byte 0 for an all-zero block)
  data  = e4m3(x · 2^(127 - e))            nearest even, saturating at ±448
Rounding the scale up means no element exceeds 448 (no saturation), at the price of up to one binade
of range. Elements times their power-of-two scale are exact in float32, so a GEMM of two MXFP8
operands is a float32 GEMM of their dequantized values.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fp4jax._exact import div
from fp4jax.numerics.scales import e4m3_rne_satfinite

BLOCK = 32


class Mxfp8(NamedTuple):
  """data (..., L) float8_e4m3fn, scale (..., L/32) uint8 E8M0 bytes (bias 127)."""
  data: jnp.ndarray
  scale: jnp.ndarray


def e8m0_round_up(v_f32):
  """The E8M0 byte of the smallest power of two >= v (v >= 0 finite): 0 for v <= 2^-127, at most 254."""
  v_f32 = jnp.asarray(v_f32, jnp.float32)
  m, e = jnp.frexp(v_f32)                      # v = m·2^e, m in [0.5, 1)
  exp = jnp.where(m == 0.5, e - 1, e)          # an exact power of two keeps its exponent
  byte = jnp.clip(exp + 127, 0, 254)
  return jnp.where(v_f32 == 0, 0, byte).astype(jnp.uint8)


def quantize(x) -> Mxfp8:
  """MXFP8 of x along its last axis (a multiple of 32)."""
  x = jnp.asarray(x)
  if x.shape[-1] % BLOCK:
    raise ValueError(f"MXFP8 quantizes blocks of 32 along the last axis; its length {x.shape[-1]} is not a "
                     "multiple of 32; pad the input")
  x_blk = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
  byte = e8m0_round_up(div(jnp.max(jnp.abs(x_blk), axis=-1), 448.0))
  scaled = jnp.ldexp(x_blk, (127 - byte.astype(jnp.int32))[..., None])
  return Mxfp8(e4m3_rne_satfinite(scaled).reshape(x.shape), byte)


def dequantize(q: Mxfp8):
  """float32 values data · 2^(e - 127) (exact)."""
  d = q.data.astype(jnp.float32)
  d_blk = d.reshape(*d.shape[:-1], d.shape[-1] // BLOCK, BLOCK)
  return jnp.ldexp(d_blk, (q.scale.astype(jnp.int32) - 127)[..., None]).reshape(d.shape)


def gemm(a: Mxfp8, b: Mxfp8, operand_dtype=jnp.float32):
  """a (M, K) · b (N, K)ᵀ -> (M, N) float32 from the dequantized values, float32 accumulation.

  ``operand_dtype`` float32: the exact values in one float32 GEMM (HIGHEST: no TF32). bfloat16: the same
  values in a bf16 GEMM (a GPU's tensor cores instead of its float32 units). They are the same values for
  every block of scale byte e >= 3: data · 2^(e - 127) has at most 4 significant bits, the last at
  2^(e - 136) >= 2^-133 (bf16's smallest subnormal), and bf16 has float32's range. A block of byte < 3
  (nonzero values all below 448 · 2^-124 ~ 1e-35) may round to bf16's subnormal grid where the platform
  keeps subnormals (XLA's CPU flushes them in either dtype); an all-zero block (byte 0) is exact."""
  deq = lambda q: dequantize(q).astype(operand_dtype)
  return lax.dot_general(deq(a), deq(b), (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
