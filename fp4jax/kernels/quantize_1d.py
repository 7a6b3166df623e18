"""NVFP4 (1x16) / MXFP4 (1x32) quantization along the last axis, one Pallas kernel.

Axis legend: R rows (all leading axes flattened), K the quantized axis, NB = K/B blocks of B elements
(B = 16 nvfp4, 32 mxfp4), P = B/2 packed bytes per block.

Each program loads a (rows, blocks·B) tile of x as contiguous rows (wide, vectorized loads; the tile's
last axis is at least 128 elements), reshapes it in registers to (rows, blocks, B) for the block amax,
encodes with the bit-arithmetic E2M1 encode of ``_common`` (RNE, or stochastic with 8 random bits per
element: an input, or hashed in the kernel from the key and the element's counter, ``random_bits.KeyedBits``;
either way the bits of ``jax.random.bits``, so kernel and reference agree bit for bit), and packs code pairs from a
(rows, blocks·P, 2) register view into a (rows, blocks·P) byte tile.
The tensor amax (NVFP4) is computed before this pass (a separate reduction) and enters as it is, one
float32 read by every program (one per row when vmapped: ``_common.amax_operand``); each program derives
the tensor's factors (S_enc/6, 1/S_enc, p) from it (``_common.nvfp4_tensor_params``): p = 2^64 rescales a
tensor whose amax is below 2^-64, as the reference does.
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


@dataclasses.dataclass(frozen=True)
class Quantize1dTiles:
  rows: int = 32           # rows per program (power of two, fitted to R)
  blocks: int = 16         # blocks per program along K (power of two, fitted to NB)
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_TILES = Quantize1dTiles()


def _quantize_1d_kernel(x_ref, a_ref, *refs, fmt, scale_rule, sr, k, stride, interpret):
  *bits_refs, q_ref, s_ref = refs
  b = formats.BLOCK[fmt]
  width = C.block_columns(x_ref, k)
  rows = None if stride is None else C.block_rows(plc.program_id(0) * x_ref.shape[0], x_ref.shape[0])
  bits = C.tile_bits(sr, bits_refs, None if k is None else width, interpret=interpret, rows=rows, stride=stride)
  q, s = encode_rows(plc.load_columns(x_ref, width).astype(jnp.float32), a_ref[...], bits, fmt=fmt,
                     scale_rule=scale_rule, interpret=interpret)
  plc.store_columns(q_ref, q, width // 2)
  plc.store_columns(s_ref, s, width // b)


def encode_rows(x_RxK, amax_Ax1, bits_RxK, *, fmt, scale_rule, interpret):
  """(packed codes (R, K/2), scale bytes (R, NB)) uint8 of a float32 register tile, inside a kernel:
  the body every 1D quantize kernel shares (``fp4jax.kernels.rmsnorm_quantize`` too). ``amax_Ax1``: the
  NVFP4 tensor amax, (1, 1) or one per row (R, 1) (``_common.amax_operand``); ``bits_RxK``: random bits
  (uint8, or uint32 below 256) or None."""
  b = formats.BLOCK[fmt]
  r, k = x_RxK.shape
  x_RxNxB = x_RxK.reshape(r, k // b, b)
  if fmt == "nvfp4":
    s_enc6_Rx1, s_dec_Rx1, p_Rx1 = C.nvfp4_tensor_params(amax_Ax1, interpret=interpret)
    x_RxNxB = x_RxNxB * p_Rx1[:, :, None]     # p: 2^64 for a tensor amax below 2^-64
    amax_RxN = abs_max(x_RxNxB, axis=2)
    byte_RxN, enc_RxN = C.nvfp4_block_encode(amax_RxN, s_enc6_Rx1, s_dec_Rx1, interpret=interpret)
    scaled = C.clip(x_RxNxB * enc_RxN[:, :, None], -6.0, 6.0)
  else:
    amax_RxN = abs_max(x_RxNxB, axis=2)
    byte_RxN, inv_RxN, exp_RxN = C.e8m0_block_encode(amax_RxN, scale_rule)
    scaled = C.mxfp4_scaled(x_RxNxB, inv_RxN[:, :, None], exp_RxN[:, :, None])
  bits = None if bits_RxK is None else bits_RxK.reshape(r, k // b, b)
  codes = C.encode(scaled, bits)
  return C.pack_pairs(codes.reshape(r, k // 2, 2)), byte_RxN.astype(jnp.uint8)


def _quantize_1d_call(x_RxK, amax, lead, bits, *, fmt, scale_rule, tiles, interpret):
  """Packed codes (R, K/2) uint8 and scale bytes (R, NB) uint8; R, NB fitted to power-of-two tiles, the
  blocks past K masked (``plc.load_columns``: no padded copy of x, no slice of the results).
  ``amax``: of shape lead[:n] (``lead``: x's leading axes); ``bits``: None, uint8 (R, K), or
  ``random_bits.KeyedBits`` with rows (R, 4) (hashed in the kernel; only the first row is read where the rows
  count by a ``row_stride`` and x is one run of rows, ``lead`` of one axis and the amax one scalar)."""
  r, k = x_RxK.shape
  b = formats.BLOCK[fmt]
  nb = k // b
  br, rp = C.fit(r, tiles.rows)
  bn, nbp = C.fit(nb, tiles.blocks)
  index = lambda i, j: (i, j)
  amax_Ax1 = C.amax_operand(amax if fmt == "nvfp4" else 0.0, lead, rp)
  ops = [C.pad_axis(x_RxK, 0, rp), amax_Ax1]   # K not padded: the last column block is masked
  in_specs = [plc.BlockSpec((br, bn * b), index), C.amax_spec(amax_Ax1, br, lambda i, j: i)]
  stride = C.counted_stride(bits, len(lead) == 1 and jnp.ndim(amax) == 0)
  bits_ops, bits_specs = C.bits_operands(bits, r, k, rp, nbp * b, br, bn * b, index, masked=True, stride=stride)
  kernel = functools.partial(_quantize_1d_kernel, fmt=fmt, scale_rule=scale_rule, sr=C.sr_mode(bits),
                             k=None if nbp == nb else k, stride=stride, interpret=interpret)
  q, s = plc.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((rp, k // 2), jnp.uint8), jax.ShapeDtypeStruct((rp, nb), jnp.uint8)),
      grid=(rp // br, nbp // bn), in_specs=in_specs + bits_specs,
      out_specs=(plc.BlockSpec((br, bn * b // 2), lambda i, j: (i, j)),
                 plc.BlockSpec((br, bn), lambda i, j: (i, j))),
      interpret=interpret, name=f"fp4jax_quantize_{fmt}_1x{b}" + C.int_ops_suffix(C.sr_mode(bits), rp * nbp * b),
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(*ops, *bits_ops)
  return q[:r], s[:r]


def quantize_1d(x, amax, bits=None, *, fmt="nvfp4", scale_rule="rceil", tiles=DEFAULT_TILES,
                interpret=False):
  """Quantize x (..., K) in 1D blocks along the last axis with the Pallas kernel.

  amax: NVFP4 tensor amax, float32 of shape x.shape[:n] (n = 0 normally; one per vmapped slice);
  ignored for MXFP4. bits: for stochastic rounding, uint8 of x's shape or ``random_bits.KeyedBits`` of it
  (rows of shape x.shape[:-1] + (4,): the kernel hashes the same bits itself); None: nearest even.
  Returns packed codes (..., K/2) uint8 and scale bytes (..., K/B) uint8. K must be a multiple of B.
  """
  *lead, k = x.shape
  b = formats.BLOCK[fmt]
  if k % b:
    raise ValueError(f"{k=} must be a multiple of the block {b} for fmt={fmt!r}; pad the input")
  x_RxK = x.reshape(-1, k)
  q, s = _quantize_1d_call(x_RxK, amax, tuple(lead), bits, fmt=fmt, scale_rule=scale_rule, tiles=tiles,
                           interpret=interpret)
  return q.reshape(*lead, k // 2), s.reshape(*lead, k // b)


def quantize_1d_reference(x, amax, bits=None, *, fmt="nvfp4", scale_rule="rceil"):
  """The oracle: ``fp4jax.reference.quantize_last_reference`` in 1D blocks, as (codes, bytes)."""
  q, s = quantize_last_reference(x, amax, random_bits.drawn(bits), fmt=fmt, scale_rule=scale_rule)
  return q, lax.bitcast_convert_type(s, jnp.uint8)
