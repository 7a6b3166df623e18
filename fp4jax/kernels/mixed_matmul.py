"""Mixed-input scaled matmul: out (M, N) = factor · sum_k a[m, k] · b[n, k], one Pallas kernel that
dequantizes as it loads (docs/DESIGN.md, "The Hopper GEMM that dequantizes as it loads").

Axis legend: M rows of a (leading axes flattened), N rows of b, K the contraction axis (the quantized
and packed axis of both), B the block (16 nvfp4, 32 mxfp4).

Design (Hopper has no FP4 tensor cores; the products e2m1 · block scale are exact in bfloat16):
  one program per (bm, bn) output tile; its K loop loads bk/2 bytes of packed E2M1 codes and bk/B
  (or, for 16x16 tiles, (b/16)·(bk/16)) scale bytes of each operand, decodes them to bf16 in
  registers by bit operations (``_common.dequantize_tile``, the decode of ``scaled_matmul``'s
  dequantize pass: same bits), and feeds a bf16 x bf16 MMA with float32 accumulation (tl.dot). The
  epilogue multiplies the accumulator by the four parts of ``reference.tensor_factor_parts`` in the
  reference's order and casts to the output dtype. HBM sees 0.5 byte per element plus the scales of
  each operand and the output; no bf16 copy of either operand is written or read.
The price is issue work: each element of a is decoded N/bn times and each of b M/bm times (once per
output tile that reads it), against once in ``scaled_matmul``'s dequantize pass. Whether the saved
bytes beat that on a device is what the on-device proof times (``tools.prove``, op "mixed_matmul").

The pallas_call is named ``fp4jax_mixed_matmul_<fmt>_<layout>_<M>x<N>x<K>`` (padded sizes): the
cost model (bench/predict/hlo_kernels.py) reads its GEMM shape from the name and charges it as a bf16 GEMM of
2·M·N·K FLOPs, its bytes those of its operands (packed codes and scales) and output.

The XLA composition (``fp4jax.reference.scaled_matmul_reference``: dequantize to bf16, one
``dot_general``) is the same computation; the two differ only in the order of the float32 sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax.kernels import _common as C

TILE = formats.NVFP4.tile[0]   # side of the square 2D tiles (nvfp4 is the kernel format with tiles)


@dataclasses.dataclass(frozen=True)
class MixedMatmulTiles:
  bm: int = 128            # output rows per program
  bn: int = 256            # output columns per program (wide: each a tile is decoded N/bn times)
  bk: int = 64             # elements of K per step (a multiple of the block and of the 16x16 tile)
  num_warps: int = 8
  num_stages: int = 3


DEFAULT_TILES = MixedMatmulTiles()


def _mixed_kernel(a_ref, as_ref, b_ref, bs_ref, f_ref, o_ref, *, fmt, a_tiled, b_tiled, bk, nk):
  bm, bn = o_ref.shape
  blk = formats.BLOCK[fmt]

  def tile(p_ref, s_ref, tiled, k0):
    unit = TILE if tiled else blk   # elements of K per scale column
    p = p_ref[:, plc.ds(k0 // 2, bk // 2)]
    s = s_ref[:, plc.ds(k0 // unit, bk // unit)]
    return C.dequantize_tile(p, s, fmt=fmt, tiled=tiled, tile=TILE).astype(jnp.bfloat16)

  def body(step, acc):
    k0 = plc.multiple_of(step * bk, bk)
    return acc + plc.dot_nt_f32(tile(a_ref, as_ref, a_tiled, k0), tile(b_ref, bs_ref, b_tiled, k0))

  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = ((((acc * f_ref[0]) * f_ref[1]) * f_ref[2]) * f_ref[3]).astype(o_ref.dtype)


def layout_name(fmt: str, a_tiled: bool, b_tiled: bool) -> str:
  """"1x16_16x16" etc.: each operand's scale granularity, a then b."""
  one = lambda tiled: f"{TILE}x{TILE}" if tiled else f"1x{formats.BLOCK[fmt]}"
  return f"{one(a_tiled)}_{one(b_tiled)}"


def kernel_name(fmt: str, a_tiled: bool, b_tiled: bool, m: int, n: int, k: int) -> str:
  """The pallas_call's name; bench/predict/hlo_kernels.py reads the GEMM shape M x N x K from its end."""
  return f"fp4jax_mixed_matmul_{fmt}_{layout_name(fmt, a_tiled, b_tiled)}_{m}x{n}x{k}"



def _mixed_call(a_data, a_scale, b_data, b_scale, factor_4, *, fmt, a_tiled, b_tiled, out_dtype, tiles,
                interpret):
  """out (M, N) from a (M, K/2), b (N, K/2) packed codes and their scale bytes (2-D, uint8)."""
  m, k2 = a_data.shape
  n = b_data.shape[0]
  k = 2 * k2
  blk = formats.BLOCK[fmt]
  unit = max(TILE if (a_tiled or b_tiled) else blk, blk)   # K granularity that keeps scales aligned
  if k % unit:
    raise ValueError(f"K={k} must be a multiple of {unit} for fmt={fmt!r} with these layouts; quantize "
                     "a K that is (fp4jax.dot pads), or use impl='xla'")
  ku, kup = C.fit(k // unit, max(1, tiles.bk // unit))   # bk: whole 1xB blocks and 16-column tiles
  bk, kp = ku * unit, kup * unit
  bm, mp = C.fit_dot(m, tiles.bm)
  bn, np_ = C.fit_dot(n, tiles.bn)

  def pad(data, scale, tiled, rows):
    r_unit, c_unit = (TILE, TILE) if tiled else (1, blk)
    data = C.pad_axis(C.pad_axis(data, 0, rows), 1, kp // 2)
    scale = C.pad_axis(C.pad_axis(scale, 0, rows // r_unit), 1, kp // c_unit)
    return data, scale

  a_data, a_scale = pad(a_data, a_scale, a_tiled, mp)
  b_data, b_scale = pad(b_data, b_scale, b_tiled, np_)
  s_rows = lambda tiled, rows: rows // TILE if tiled else rows
  s_cols = lambda tiled: kp // TILE if tiled else kp // blk
  out = plc.pallas_call(
      functools.partial(_mixed_kernel, fmt=fmt, a_tiled=a_tiled, b_tiled=b_tiled, bk=bk, nk=kp // bk),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(mp // bm, np_ // bn),
      in_specs=[plc.BlockSpec((bm, kp // 2), lambda i, j: (i, 0)),
                plc.BlockSpec((s_rows(a_tiled, bm), s_cols(a_tiled)), lambda i, j: (i, 0)),
                plc.BlockSpec((bn, kp // 2), lambda i, j: (j, 0)),
                plc.BlockSpec((s_rows(b_tiled, bn), s_cols(b_tiled)), lambda i, j: (j, 0)),
                plc.BlockSpec((4,), lambda i, j: (0,))],
      out_specs=plc.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret, name=kernel_name(fmt, a_tiled, b_tiled, mp, np_, kp),
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(a_data, a_scale, b_data, b_scale, factor_4)
  return out[:m, :n]


def mixed_matmul(a_data, a_scale, b_data, b_scale, factor, *, fmt="nvfp4", a_tiled=False, b_tiled=False,
                 out_dtype=jnp.float32, tiles=DEFAULT_TILES, interpret=False):
  """a (..., M, K) · b (N, K)ᵀ from packed codes and scale bytes (uint8), times ``factor``, decoded in
  the GEMM's K loop.

  a_data (..., M, K/2), a_scale (..., M, K/B) or (..., M/16, K/16) with ``a_tiled``; b likewise
  without leading axes. factor: float32 scalar (the NVFP4 tensor factor; 1 for MXFP4), or the four
  parts of ``reference.tensor_factor_parts`` (factor, then three powers of two, applied in turn).
  """
  if fmt not in formats.KERNEL_FORMATS:
    raise ValueError(f"mixed_matmul takes fmt in {formats.KERNEL_FORMATS}; got {fmt!r} (use impl='xla')")
  if b_data.ndim != 2:
    raise ValueError(f"mixed_matmul: b_data must be 2-D (N, K/2); got shape {b_data.shape}")
  if a_data.shape[-1] != b_data.shape[-1]:
    raise ValueError(f"mixed_matmul: a and b must share K; packed shapes {a_data.shape} and {b_data.shape}")
  factor = jnp.asarray(factor, jnp.float32).reshape(-1)
  if factor.shape == (1,):
    factor = jnp.concatenate([factor, jnp.ones((3,), jnp.float32)])
  *lead, m, k2 = a_data.shape
  out = _mixed_call(a_data.reshape(-1, k2), a_scale.reshape(-1, a_scale.shape[-1]), b_data, b_scale, factor,
                    fmt=fmt, a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=out_dtype, tiles=tiles,
                    interpret=interpret)
  return out.reshape(*lead, m, b_data.shape[0])

