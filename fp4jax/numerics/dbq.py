"""Double-block NVFP4 ("nvfp4_dbq", TetraJet-v2): E2M1 elements, an E4M3 scale per 1x16 block and a
float32 scale per 1x128 block instead of one per tensor.

Along the quantized axis L (a multiple of 128), all float32, one rounding per operation:
  os  = (amax_128 / 448) / 6                1 when 0
  is  = (amax_16 / os) / 6                  2^-9 when 0 (an all-zero block stores byte 0x01)
  s_b = e4m3(is);  sp = os · f32(s_b);  inv = 1/sp (0 when sp is 0)
  q   = e2m1(x · inv)                       nearest even, or stochastic with 8 bits per element (§4)
  dequantize: e2m1val(q) · (os · f32(s_b))
  GEMM: per 128-chunk c of the contraction, C += (os_A · os_B) · Σ_{k in c} (e2m1val·s_b)_A (e2m1val·s_b)_B
The per-128 float32 scale needs one float32 rescale per 128-chunk in a GEMM; ``gemm`` emulates that
(each chunk's sum of exact bf16 products accumulated in float32, then scaled and added in order).

TetraJet-v2's own random number generators are kept here as oracles for parity with its kernels: the
sign hash of its RHT-16 (``tj_signs``) and its LCG noise for stochastic rounding (``tj_noise``,
``tj_round_stochastic``). fp4jax itself draws signs and bits with ``jax.random``.
Axis legend: L quantized axis, O = L/128 outer blocks, NB = L/16 inner blocks.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fp4jax.numerics import e2m1
from fp4jax.numerics.amax import abs_max
from fp4jax._exact import div, product
from fp4jax.numerics.scales import e4m3_rne_satfinite

BLOCK = 16
OUTER = 128
_ZERO_BLOCK_SCALE = 2.0 ** -9   # the smallest E4M3 subnormal: byte 0x01


class Dbq(NamedTuple):
  """codes (..., L) uint8, scale (..., NB) float8_e4m3fn, outer (..., O) float32."""
  codes: jnp.ndarray
  scale: jnp.ndarray
  outer: jnp.ndarray


def _check(x):
  if x.shape[-1] % OUTER:
    raise ValueError(f"nvfp4_dbq quantizes 1x128 blocks along the last axis; its length {x.shape[-1]} is "
                     "not a multiple of 128; pad the input or use fp4jax.dot, which pads")


def quantize(x, *, bits=None) -> Dbq:
  """DBQ of x along its last axis; ``bits`` (uint8, shape of x): stochastic rounding (§4), else nearest."""
  x = jnp.asarray(x)
  _check(x)
  x_f32 = x.astype(jnp.float32)
  lead, length = x.shape[:-1], x.shape[-1]
  x_blk = x_f32.reshape(*lead, length // OUTER, OUTER // BLOCK, BLOCK)
  amax_b = abs_max(x_blk, axis=-1)
  os = div(div(abs_max(amax_b, axis=-1), 448.0), 6.0)
  os = jnp.where(os == 0, jnp.float32(1.0), os)
  inner = div(div(amax_b, os[..., None]), 6.0)
  s_b = e4m3_rne_satfinite(jnp.where(inner == 0, jnp.float32(_ZERO_BLOCK_SCALE), inner))
  sp = os[..., None] * s_b.astype(jnp.float32)
  inv = jnp.where(sp != 0, div(1.0, jnp.where(sp != 0, sp, 1.0)), jnp.float32(0.0))
  t = x_blk * inv[..., None]
  if bits is None:
    codes = e2m1.encode_rne(t)
  else:
    codes = e2m1.encode_stochastic(t, bits.reshape(t.shape))
  return Dbq(codes.reshape(x.shape), s_b.reshape(*lead, length // BLOCK), os)


def decode_factor(scale, outer):
  """os · f32(s_b) per 16-block, (..., NB)."""
  return jnp.repeat(outer, OUTER // BLOCK, axis=-1) * scale.astype(jnp.float32)


def dequantize(q: Dbq):
  """float32 values e2m1val(q) · (os · f32(s_b)), rounded before any sum the caller forms with them
  (OsciReset's |Q(w) - Q(w_prev)| would otherwise be one FMA: ``fp4jax._exact``)."""
  return product(e2m1.decode(q.codes), jnp.repeat(decode_factor(q.scale, q.outer), BLOCK, axis=-1))


def scaled_values(q: Dbq):
  """e2m1val(q) · f32(s_b), without the outer scale: exact in bfloat16."""
  return e2m1.decode(q.codes) * jnp.repeat(q.scale.astype(jnp.float32), BLOCK, axis=-1)


def chunked_gemm(part_of, outer_a_of, outer_b_of, n_chunks: int):
  """Σ_c (outer_a_c · outer_b_c) · part_c in order, c over the 128-chunks of the contraction: THE loop of
  every DBQ GEMM (this module's ``gemm``, fp4jax.native's, fp4jax.gemm's grouped one). part_of(c): the
  chunk's float32 GEMM of exact block products; outer_a_of(c), outer_b_of(c): its outer scales,
  broadcastable to it. Each rescaled chunk is rounded before the add (XLA CPU contracts out + o·part
  into an FMA)."""
  out = None
  for c in range(n_chunks):
    term = product(outer_a_of(c) * outer_b_of(c), part_of(c))
    out = term if out is None else out + term
  return out


def gemm(a: Dbq, b: Dbq):
  """a (M, K) · b (N, K)ᵀ -> (M, N) float32, both quantized along K, rescaled per 128-chunk of K."""
  a_vals = scaled_values(a).astype(jnp.bfloat16)
  b_vals = scaled_values(b).astype(jnp.bfloat16)

  def part(c):
    k = slice(c * OUTER, (c + 1) * OUTER)
    return lax.dot_general(a_vals[:, k], b_vals[:, k], (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
  return chunked_gemm(part, lambda c: a.outer[:, c][:, None], lambda c: b.outer[:, c][None, :],
                      a.outer.shape[-1])


def quantized_bytes(shape) -> int:
  """Bytes of a DBQ tensor of ``shape`` (quantized along the last axis): codes, E4M3 and float32 scales."""
  n = 1
  for d in shape:
    n *= d
  return n // 2 + n // BLOCK + 4 * (n // OUTER)


# ---------------------------------------------------------------------------------------------------
# TetraJet-v2's random number generators (oracles for parity, vectors C3 and C4)
# ---------------------------------------------------------------------------------------------------

def tj_signs(seed):
  """The ±1 float32 (16,) sign vector of TetraJet-v2's RHT-16 for a uint32 seed.

  Lane j = 0..3: h = ((seed ^ 7919·j) · 2654435761) mod 2^32, h ^= h >> 16; element 4j + i is negated
  when bit i of h is set.
  """
  seed = jnp.asarray(seed, jnp.uint32)
  j = jnp.arange(4, dtype=jnp.uint32)
  h = (seed ^ (jnp.uint32(7919) * j)) * jnp.uint32(2654435761)
  h = h ^ (h >> 16)
  bit = (h[:, None] >> jnp.arange(4, dtype=jnp.uint32)[None, :]) & 1
  return jnp.float32(1.0) - jnp.float32(2.0) * bit.reshape(16).astype(jnp.float32)


def tj_noise(seed, n):
  """TetraJet-v2's LCG noise r in [-0.5, 0.5) for flat elements 0..n-1 (n a multiple of 4).

  Each thread handles 4 elements from offset = the flat index of its first: state = seed +
  offset·0x9E3779B1, state = state·747796405 + 2891336453, then per element state = state·1664525 +
  1013904223 and r = float(0x3F800000 | state >> 9) - 1.5. uint32 arithmetic throughout.
  """
  offset = jnp.arange(0, n, 4, dtype=jnp.uint32)
  state = jnp.asarray(seed, jnp.uint32) + offset * jnp.uint32(0x9E3779B1)
  state = state * jnp.uint32(747796405) + jnp.uint32(2891336453)
  out = []
  for _ in range(4):
    state = state * jnp.uint32(1664525) + jnp.uint32(1013904223)
    one_to_two = lax.bitcast_convert_type(jnp.uint32(0x3F800000) | (state >> 9), jnp.float32)
    out.append(one_to_two - jnp.float32(1.5))
  return jnp.stack(out, axis=-1).reshape(n)


def tj_round_stochastic(t, r):
  """TetraJet-v2's stochastic rounding of scaled values t with noise r: E2M1 codes.

  |t| <= 2: clamp(|t| + r/2, 0, 2); <= 4: clamp(|t| + r, 2, 4); else clamp(|t| + 2r, 4, 6); the sign
  restored; then nearest even. Values above 6 are clipped to 6 (no margin).
  """
  mag = jnp.abs(t)
  v = jnp.where(mag <= 2.0, jnp.clip(mag + r * 0.5, 0.0, 2.0),
                jnp.where(mag <= 4.0, jnp.clip(mag + r, 2.0, 4.0), jnp.clip(mag + r * 2.0, 4.0, 6.0)))
  return e2m1.encode_rne(jnp.where(jnp.signbit(t), -v, v))
