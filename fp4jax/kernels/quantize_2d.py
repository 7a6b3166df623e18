"""NVFP4 16x16 2D weight quantization (one E4M3 scale per 16x16 tile), one Pallas kernel.

Axis legend: M, K the last two axes (leading axes flattened into the rows), G = rows/16 tile rows,
NB = K/16 tile columns. Each program loads a (tile_rows·16, tile_cols·16) tile of x as contiguous rows
(wide loads), reshapes it in registers to (G, 16, NB, 16) so a tile's amax is a reduction over axes
(1, 3), encodes with the bit-arithmetic E2M1 encode and packs code pairs along K from a
(rows, NB·8, 2) register view. Codes are packed along K (the last axis); the packed-along-M layout is
the transpose of the quantization of xᵀ (spec §2, 2D tiles are transpose-symmetric), done by the caller.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _pallas_compat as plc
from fp4jax import formats, random_bits
from fp4jax.kernels import _common as C
from fp4jax.numerics.amax import abs_max
from fp4jax.reference import quantize_last_reference

TILE = formats.NVFP4.tile[0]   # square tiles


@dataclasses.dataclass(frozen=True)
class Quantize2dTiles:
  tile_rows: int = 2       # 16x16 tile rows per program (power of two, fitted to G)
  tile_cols: int = 16      # 16x16 tile columns per program (power of two, fitted to NB)
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_TILES = Quantize2dTiles()


def _quantize_2d_kernel(x_ref, a_ref, *refs, sr, k, interpret):
  *bits_refs, q_ref, s_ref = refs
  width = C.block_columns(x_ref, k)
  x_RxK = plc.load_columns(x_ref, width).astype(jnp.float32)
  r, k_block = x_RxK.shape
  g, nb = r // TILE, k_block // TILE
  s_enc6_Gx1, s_dec_Gx1, p_Gx1 = C.nvfp4_tensor_params(a_ref[...], interpret=interpret)   # (1, 1) or per tile row
  x_Gx16xNx16 = x_RxK.reshape(g, TILE, nb, TILE) * p_Gx1[:, :, None, None]   # p (2^64 or 1)
  amax_GxN = abs_max(abs_max(x_Gx16xNx16, axis=3), axis=1)
  byte_GxN, enc_GxN = C.nvfp4_block_encode(amax_GxN, s_enc6_Gx1, s_dec_Gx1, interpret=interpret)
  scaled = C.clip(x_Gx16xNx16 * enc_GxN[:, None, :, None], -6.0, 6.0)
  bits = C.tile_bits(sr, bits_refs, None if k is None else width, interpret=interpret)
  bits = None if bits is None else bits.reshape(g, TILE, nb, TILE)
  codes = C.encode(scaled, bits)
  plc.store_columns(q_ref, C.pack_pairs(codes.reshape(r, k_block // 2, 2)), width // 2)
  plc.store_columns(s_ref, byte_GxN.astype(jnp.uint8), width // TILE)


def _quantize_2d_call(x_RxK, amax, tile_rows, bits, *, tiles, interpret):
  """Packed codes (R, K/2) and tile scale bytes (R/16, K/16), uint8, the tile columns past K masked. ``amax``: of shape tile_rows[:n]
  (``tile_rows``: x's leading axes with R/16 tile rows last); ``bits``: None, uint8 (R, K), or
  ``random_bits.KeyedBits`` with rows (R, 4) (hashed in the kernel)."""
  r, k = x_RxK.shape
  g, nb = r // TILE, k // TILE
  bg, gp = C.fit(g, tiles.tile_rows)
  bn, nbp = C.fit(nb, tiles.tile_cols)
  index = lambda i, j: (i, j)
  spec = plc.BlockSpec((bg * TILE, bn * TILE), index)
  amax_Ax1 = C.amax_operand(amax, tile_rows, gp)
  ops = [C.pad_axis(x_RxK, 0, gp * TILE), amax_Ax1]   # K not padded: the last column block is masked
  in_specs = [spec, C.amax_spec(amax_Ax1, bg, lambda i, j: i)]
  bits_ops, bits_specs = C.bits_operands(bits, r, k, gp * TILE, nbp * TILE, bg * TILE, bn * TILE, index,
                                         masked=True)
  kernel = functools.partial(_quantize_2d_kernel, sr=C.sr_mode(bits), k=None if nbp == nb else k,
                             interpret=interpret)
  q, s = plc.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((gp * TILE, k // 2), jnp.uint8), jax.ShapeDtypeStruct((gp, nb), jnp.uint8)),
      grid=(gp // bg, nbp // bn), in_specs=in_specs + bits_specs,
      out_specs=(plc.BlockSpec((bg * TILE, bn * TILE // 2), lambda i, j: (i, j)),
                 plc.BlockSpec((bg, bn), lambda i, j: (i, j))),
      interpret=interpret,
      name="fp4jax_quantize_nvfp4_16x16" + C.int_ops_suffix(C.sr_mode(bits), gp * nbp * TILE * TILE),
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(*ops, *bits_ops)
  return q[:r], s[:g]


def quantize_2d(x, amax, bits=None, *, tiles=DEFAULT_TILES, interpret=False):
  """NVFP4 16x16-tile quantization of x (..., M, K) with the Pallas kernel.

  amax: float32 tensor amax of shape x.shape[:n] (n = 0 normally). bits: uint8 of x's shape,
  ``random_bits.KeyedBits`` of it (hashed in the kernel), or None.
  Returns packed codes (..., M, K/2) uint8 (packed along K) and scale bytes (..., M/16, K/16) uint8.
  """
  *lead, m, k = x.shape
  if m % TILE or k % TILE:
    raise ValueError(f"x.shape[-2:]={(m, k)} must be multiples of {TILE} for 16x16 tiles; pad it")
  q, s = _quantize_2d_call(x.reshape(-1, k), amax, tuple(lead) + (m // TILE,), bits, tiles=tiles,
                           interpret=interpret)
  return q.reshape(*lead, m, k // 2), s.reshape(*lead, m // TILE, k // TILE)


def quantize_2d_reference(x, amax, bits=None):
  """The oracle: ``quantize_reference(x, 'nvfp4', tile=(16, 16))`` as (codes, scale bytes)."""
  q, s = quantize_last_reference(x, amax, random_bits.drawn(bits), fmt="nvfp4", tiled=True)
  return q, lax.bitcast_convert_type(s, jnp.uint8)
