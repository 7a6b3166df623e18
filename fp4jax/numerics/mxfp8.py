"""MXFP8 (OCP MX v1.0 E4M3 elements, one E8M0 scale per block of 32): the ``mxfp8`` recipe's format and
TetraJet-v2's OutControl rows. docs/NUMERICS.md, "MXFP8", has the rules and test vectors.

  scale = 2^(e - 127), e the E8M0 byte (bias 127) of the block's amax_32 by ``scale_rule``:
    "rceil" (default; Transformer Engine's MXFP8 recipe and jax.nn's mxfp8 quantize): amax_32 / 448 (one
            float32 quotient) rounded up to a power of two, clamped to [0, 254]
    "floor" (OCP MX v1.0's conversion): floor(log2 amax_32) - 8 (8 = E4M3's largest exponent), clamped to
            [-127, 127] as an exponent, so e in [0, 254]
    an all-zero block has byte 0 under both; an infinite amax gives byte 254
  data  = e4m3(x · 2^(127 - e))            nearest even, saturating at ±448 (±inf -> ±448, NaN stays NaN)
"rceil" means no finite element exceeds 448 (nothing saturates), at the price of up to one binade of
range; "floor" keeps the binade and saturates amax_32 · 2^(127 - e) in [448, 512) to 448. Elements times
their power-of-two scale are exact in float32, so a GEMM of two MXFP8 operands is a float32 GEMM of their
dequantized values. The byte 0xFF (E8M0's NaN, which no rule emits) dequantizes to NaN.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fp4jax._exact import div
from fp4jax.numerics.amax import abs_max
from fp4jax.numerics.scales import e4m3_rne_satfinite

BLOCK = 32
E4M3_EMAX = 8            # E4M3's largest unbiased exponent (448 = 1.75 · 2^8): OCP's emax_elem
SCALE_RULES = ("rceil", "floor")


class Mxfp8(NamedTuple):
  """data (..., L) float8_e4m3fn, scale (..., L/32) uint8 E8M0 bytes (bias 127)."""
  data: jnp.ndarray
  scale: jnp.ndarray


def e8m0_round_up(v_f32):
  """The E8M0 byte of the smallest power of two >= v (v >= 0): 0 for v <= 2^-127, at most 254 (an
  infinite v saturates to 254; frexp of inf is unspecified, so it is set explicitly)."""
  v_f32 = jnp.asarray(v_f32, jnp.float32)
  m, e = jnp.frexp(v_f32)                      # v = m·2^e, m in [0.5, 1)
  exp = jnp.where(m == 0.5, e - 1, e)          # an exact power of two keeps its exponent
  byte = jnp.where(jnp.isinf(v_f32), 254, jnp.clip(exp + 127, 0, 254))
  return jnp.where(v_f32 == 0, 0, byte).astype(jnp.uint8)


def e8m0_floor(amax_f32):
  """OCP MX v1.0's E8M0 byte for E4M3 elements: floor(log2 amax) - 8 + 127, from the binary exponent
  (never a rounded log2), clamped to [0, 254]; 0 for amax 0, 254 for an infinite amax."""
  amax_f32 = jnp.asarray(amax_f32, jnp.float32)
  _, e = jnp.frexp(amax_f32)                   # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e - 1
  byte = jnp.clip(e.astype(jnp.int32) - 1 - E4M3_EMAX + 127, 0, 254)
  byte = jnp.where(jnp.isinf(amax_f32), 254, byte)
  return jnp.where(amax_f32 == 0, 0, byte).astype(jnp.uint8)


def scale_bytes(amax_f32, scale_rule: str = "rceil"):
  """The E8M0 bytes of blocks with amax ``amax_f32`` (float32, >= 0) by ``scale_rule`` (module docstring)."""
  if scale_rule == "rceil":
    return e8m0_round_up(div(amax_f32, 448.0))
  if scale_rule == "floor":
    return e8m0_floor(amax_f32)
  raise ValueError(f"unknown MXFP8 scale rule {scale_rule!r}; use one of {SCALE_RULES}")


def quantize(x, scale_rule: str = "rceil") -> Mxfp8:
  """MXFP8 of x along its last axis (a multiple of 32), scales by ``scale_rule`` ("rceil" or "floor")."""
  x = jnp.asarray(x)
  if x.shape[-1] % BLOCK:
    raise ValueError(f"MXFP8 quantizes blocks of 32 along the last axis; its length {x.shape[-1]} is not a "
                     "multiple of 32; pad the input")
  x_blk = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
  byte = scale_bytes(abs_max(x_blk, axis=-1), scale_rule)
  scaled = jnp.ldexp(x_blk, (127 - byte.astype(jnp.int32))[..., None])
  return Mxfp8(e4m3_rne_satfinite(scaled).reshape(x.shape), byte)


def dequantize(q: Mxfp8):
  """float32 values data · 2^(e - 127) (exact); NaN for a block of scale byte 0xFF (E8M0's NaN)."""
  d = q.data.astype(jnp.float32)
  d_blk = d.reshape(*d.shape[:-1], d.shape[-1] // BLOCK, BLOCK)
  byte = q.scale.astype(jnp.int32)[..., None]
  out = jnp.where(byte == 255, jnp.float32(jnp.nan), jnp.ldexp(d_blk, byte - 127))
  return out.reshape(d.shape)


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
