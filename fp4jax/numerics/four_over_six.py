"""Four Over Six (4/6): per block, keep the better of "block max maps to 6" and "block max maps to 4".

An NVFP4 variant with the same storage (E2M1 codes, one E4M3 scale per 1x16 block or 16x16 tile, one
float32 amax per tensor) and two changes: the tensor scale maps amax to 6·B with a bound B = 256 (room
for the 1.5x larger map-to-4 scale, 256·1.5 = 384 <= 448; B = 448 is the option), and every block is
quantized twice and keeps the candidate with the smaller dequantization error (MSE by default, MAE
as the option; a tie keeps map-to-6). All arithmetic float32, one rounding per written operation:

  S_enc = min(f32(6B) / amax_g, FLT_MAX)   (1 when amax_g is 0)        S_dec = 1 / S_enc
  base  = (amax_b / 6) · S_enc            (divide first, then multiply: not NVFP4's amax_b·(S_enc/6))
  s4 = e4m3(min(base·1.5, 448))           s6 = e4m3(min(base, 448))
  q_k = e2m1(x · min(1 / (f32(s_k)·S_dec), FLT_MAX))                    nearest even, saturating
  d_k = ((e2m1val(q_k)·f32(s_k))·amax_g) / f32(6B) − x                 error in the input domain
  err_k = Σ d_k²  (or Σ |d_k|), the 16 terms of a row left to right from +0; the 16 row sums of a
          16x16 tile by halving (r_i + r_{i+8}, then + 4, + 2, + 1)
  pick map-4 iff err_4 < err_6

No fused multiply-add: every square is rounded to float32 before it is added, and every division is
a true division (``fp4jax._exact`` keeps XLA from turning a division by a broadcast into a multiply by
a reciprocal and LLVM from contracting a product into an add). tests/test_recipes_four_over_six.py
checks the error sums bit for bit against scalar numpy loops.

Blocked views: 1x16 blocks along the last axis, x (..., K) -> (..., K/16, 16); 16x16 tiles over the
last two axes, x (..., M, K) -> (..., M/16, K/16, 256) with the tile's rows consecutive (row r holds
elements 16r..16r+15). Scales come out as (..., K/16) and (..., M/16, K/16).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from fp4jax.numerics import e2m1
from fp4jax.numerics.amax import abs_max
from fp4jax._exact import div, product
from fp4jax.numerics.scales import FLT_MAX, e4m3_rne_satfinite

BLOCK = 16
TILE = (16, 16)
BOUNDS = (256, 448)
METRICS = ("mse", "mae")
ROLES = ("off", "weights", "activations", "all")
DEFAULT_BOUND = 256
DEFAULT_METRIC = "mse"


class Choice(NamedTuple):
  """Result of quantizing blocked values (..., NB, B): codes (..., NB, B), E4M3 scales (..., NB)."""
  codes: jnp.ndarray
  scale: jnp.ndarray
  map4: jnp.ndarray      # bool (..., NB): the block kept the map-to-4 candidate
  err4: jnp.ndarray      # float32 (..., NB): the candidates' errors
  err6: jnp.ndarray


def check_options(bound, metric):
  if bound not in BOUNDS:
    raise ValueError(f"four_over_six_bound={bound!r}; use 256 (the default of all implementations) or "
                     "448 (the plain NVFP4 range)")
  if metric not in METRICS:
    raise ValueError(f"four_over_six_metric={metric!r}; use 'mse' (default) or 'mae' (TE's default)")


def global_encode_scale(amax_g, bound=DEFAULT_BOUND):
  """S_enc = min(6·B / amax_g, FLT_MAX), 1 when amax_g is 0 (or inf, where the quotient is 0)."""
  amax_g = jnp.asarray(amax_g, jnp.float32)
  s_enc = jnp.minimum(div(6.0 * bound, amax_g), jnp.float32(FLT_MAX))
  return jnp.where((amax_g == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def candidate_scales(amax_b, amax_g, bound=DEFAULT_BOUND):
  """(s4, s6): the E4M3 scales of the map-to-4 and map-to-6 candidates, in TE's order."""
  base = div(amax_b, 6.0) * global_encode_scale(amax_g, bound)
  s4 = e4m3_rne_satfinite(jnp.minimum(base * jnp.float32(1.5), jnp.float32(448.0)))
  s6 = e4m3_rne_satfinite(jnp.minimum(base, jnp.float32(448.0)))
  return s4, s6


def _seq_sum_last(t):
  """Σ over the last axis, left to right from +0 (the order is the contract)."""
  acc = jnp.zeros(t.shape[:-1], jnp.float32)
  for i in range(t.shape[-1]):
    acc = acc + t[..., i]
  return acc


def fold_sum_last(t):
  """Σ over the last axis (a power of two) by halving: v[:n/2] + v[n/2:], repeated."""
  while t.shape[-1] > 1:
    half = t.shape[-1] // 2
    t = t[..., :half] + t[..., half:]
  return t[..., 0]


def _block_error(d_blk, metric, rows):
  """Error of blocks (..., NB, rows·16): seq over each row of 16, fold over the rows."""
  if metric == "mse":
    term = product(d_blk, d_blk)   # rounded squares, never fused into the sums
  else:
    term = jnp.abs(d_blk)
  row_sums = _seq_sum_last(term.reshape(*term.shape[:-1], rows, BLOCK))
  return fold_sum_last(row_sums) if rows > 1 else row_sums[..., 0]


def _candidate(x_blk, s_k, s_dec, amax_g, bound, metric, rows, bits):
  s_f32 = s_k.astype(jnp.float32)
  enc = jnp.minimum(div(1.0, s_f32 * s_dec), jnp.float32(FLT_MAX))
  scaled = x_blk * enc[..., None]
  codes = e2m1.encode_rne(scaled) if bits is None else e2m1.encode_stochastic(scaled, bits)
  v = div((e2m1.decode(codes) * s_f32[..., None]) * amax_g, 6.0 * bound)
  return codes, _block_error(v - x_blk, metric, rows)


def quantize_blocks(x_blk, amax_g, *, bound=DEFAULT_BOUND, metric=DEFAULT_METRIC, rows=1,
                    bits=None) -> Choice:
  """4/6 of float32 blocks (..., NB, rows·16): rows = 1 for 1x16 blocks, 16 for 16x16 tiles.

  bits (uint8, shape of x_blk): stochastic rounding (§4) of both candidates with the same bits, the
  choice made on the rounded candidates' errors (the 4/6 authors' gradient option). The choice then
  depends on the random outcome, so the result is biased; not used by any fp4jax recipe.
  """
  x_blk = x_blk.astype(jnp.float32)
  amax_g = jnp.asarray(amax_g, jnp.float32)
  s_dec = div(1.0, global_encode_scale(amax_g, bound))
  s4, s6 = candidate_scales(abs_max(x_blk, axis=-1), amax_g, bound)
  codes4, err4 = _candidate(x_blk, s4, s_dec, amax_g, bound, metric, rows, bits)
  codes6, err6 = _candidate(x_blk, s6, s_dec, amax_g, bound, metric, rows, bits)
  map4 = err4 < err6
  return Choice(jnp.where(map4[..., None], codes4, codes6), jnp.where(map4, s4, s6), map4, err4, err6)


def decode_factor(scale, amax_g, bound=DEFAULT_BOUND):
  """Per-block dequantization factor (f32(s_b) · amax_g) · f32(1/(6B))."""
  return product(scale, amax_g) * jnp.float32(1.0 / (6.0 * bound))   # product: see nvfp4.decode_factor


def gemm_factor(amax_a, amax_b, bound_a=DEFAULT_BOUND, bound_b=DEFAULT_BOUND):
  """The factor a GEMM applies to its float32 sum of e2m1·scale products: (amax_A·amax_B)/(36·B_A·B_B)."""
  return product(amax_a, amax_b) * jnp.float32(1.0 / (36.0 * bound_a * bound_b))


# ---------------------------------------------------------------------------------------------------
# Whole tensors: 1x16 blocks along the last axis, or 16x16 tiles over the last two axes
# ---------------------------------------------------------------------------------------------------

def to_tiles(x_MxK):
  """(..., M, K) -> (..., M/16, K/16, 256), each tile's rows consecutive."""
  *lead, m, k = x_MxK.shape
  t = x_MxK.reshape(*lead, m // 16, 16, k // 16, 16)
  return jnp.swapaxes(t, -3, -2).reshape(*lead, m // 16, k // 16, 256)


def from_tiles(t_blk, shape):
  *lead, m, k = shape
  t = t_blk.reshape(*lead, m // 16, k // 16, 16, 16)
  return jnp.swapaxes(t, -3, -2).reshape(shape)


def _check_shape(x, tiled):
  if tiled:
    if x.ndim < 2 or x.shape[-1] % 16 or x.shape[-2] % 16:
      raise ValueError(f"4/6 with 16x16 tiles needs the last two axes multiples of 16; got shape "
                       f"{x.shape}; pad the input or use fp4jax.dot, which pads")
  elif x.shape[-1] % BLOCK:
    raise ValueError(f"4/6 quantizes 1x16 blocks along the last axis; its length {x.shape[-1]} is not a "
                     "multiple of 16; pad the input or use fp4jax.dot, which pads")


def quantize(x, *, tiled=False, bound=DEFAULT_BOUND, metric=DEFAULT_METRIC, amax=None):
  """(codes uint8 shaped like x, E4M3 scales, float32 amax) of x with 4/6.

  tiled=False: 1x16 blocks along the last axis, scales (..., K/16). tiled=True: 16x16 tiles over the
  last two axes, scales (..., M/16, K/16), one decision per tile from its rows; the transpose of the
  codes and scales is then the quantization of xᵀ with the same decisions.
  amax: the tensor amax to use instead of max|x|.
  """
  check_options(bound, metric)
  x = jnp.asarray(x)
  _check_shape(x, tiled)
  x_f32 = x.astype(jnp.float32)
  amax_g = abs_max(x_f32) if amax is None else jnp.asarray(amax, jnp.float32).reshape(())
  if tiled:
    choice = quantize_blocks(to_tiles(x_f32), amax_g, bound=bound, metric=metric, rows=16)
    return from_tiles(choice.codes, x.shape), choice.scale, amax_g
  x_blk = x_f32.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
  choice = quantize_blocks(x_blk, amax_g, bound=bound, metric=metric)
  return choice.codes.reshape(x.shape), choice.scale, amax_g


def scaled_values(codes, scale, *, tiled=False):
  """e2m1val(code) · f32(s_b) without the tensor factor (exact in bfloat16), shaped like codes."""
  vals = e2m1.decode(codes)
  s = scale.astype(jnp.float32)
  if tiled:
    s = jnp.repeat(jnp.repeat(s, 16, axis=-2), 16, axis=-1)
  else:
    s = jnp.repeat(s, BLOCK, axis=-1)
  return vals * s


def dequantize(codes, scale, amax_g, *, tiled=False, bound=DEFAULT_BOUND):
  """float32 values: e2m1val(q) · ((f32(s_b) · amax_g) · f32(1/(6B)))."""
  factor = decode_factor(scale, amax_g, bound)
  if tiled:
    factor = jnp.repeat(jnp.repeat(factor, 16, axis=-2), 16, axis=-1)
  else:
    factor = jnp.repeat(factor, BLOCK, axis=-1)
  return product(e2m1.decode(codes), factor)   # rounded before any sum the caller forms with it


def transpose_tiles(codes, scale):
  """Codes and scales of xᵀ from those of a tiled 2-D x: the decisions are per tile, so transpose both."""
  return codes.T, scale.T
