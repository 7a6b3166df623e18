"""Scaled matmul of two FP4 operands: out (M, N) = factor · sum_k a[m, k] · b[n, k], two Pallas kernels.

Axis legend: M rows of a (leading axes flattened), N rows of b, K the contraction axis (the quantized
and packed axis of both), B the block (16 nvfp4, 32 mxfp4).

Design (Hopper has no FP4 tensor cores; the products e2m1 · block scale are exact in bfloat16):
  1. ``_dequantize_kernel`` reads each operand's packed codes and scale bytes once and writes
     e2m1(code) · block scale as bfloat16 (exact; no tensor factor) — every element is decoded exactly
     once, by bit operations, in a memory-bound pass (0.56 bytes in, 2 bytes out per element), not in
     the K loop of the GEMM where it would compete with the MMA for issue slots.
  2. ``_gemm_kernel``: a bf16 x bf16 GEMM with float32 accumulation on (bm, bn) tiles with wide N tiles
     (tensor cores on GPU); the tensor factor (amax_a · amax_b / (6·6·448·448) for NVFP4, 1 for MXFP4,
     with three exact powers of two where the reference rescales extreme amaxes:
     ``reference.tensor_factor_parts``) multiplies the float32 accumulator in the reference's order,
     then the cast to the output dtype.
The XLA composition (``fp4jax.reference.scaled_matmul_reference``: dequantize to bf16, one
``dot_general``, cuBLAS on GPU) is the same computation and the baseline this pair must beat
(``scripts/gpu_check.py``); they differ only in the order of the float32 sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4jax import _pallas_compat as plc
from fp4jax import formats, reference
from fp4jax.kernels import _common as C

TILE = formats.NVFP4.tile[0]   # side of the square 2D tiles (nvfp4 is the kernel format with tiles)


@dataclasses.dataclass(frozen=True)
class ScaledMatmulTiles:
  bm: int = 128            # GEMM output rows per program
  bn: int = 256            # GEMM output columns per program (wide: fewer re-reads of a)
  bk: int = 64             # elements of K per GEMM step (a multiple of the block)
  num_warps: int = 8
  num_stages: int = 3
  dq_rows: int = 32        # dequantize pass: rows per program
  dq_cols: int = 512       # dequantize pass: elements of K per program


DEFAULT_TILES = ScaledMatmulTiles()


def _dequantize_kernel(p_ref, s_ref, o_ref, *, fmt, tiled):
  """bf16 (R, K) tile of e2m1(code) · block scale (exact) from packed codes and scale bytes."""
  o_ref[...] = C.dequantize_tile(p_ref[...], s_ref[...], fmt=fmt, tiled=tiled, tile=TILE).astype(jnp.bfloat16)


def _pow2_divisor(dim: int, pref: int, unit: int) -> int:
  """The largest unit·2^i <= max(pref, unit) that divides ``dim`` (a multiple of ``unit``)."""
  d = unit
  while d * 2 <= pref and dim % (d * 2) == 0:
    d *= 2
  return d


def _dequantize_call(data, scale, *, fmt, tiled, rows, cols, tiles, interpret):
  """bf16 (rows, cols) of packed codes (R, K/2) and scale bytes, zero-padded to (rows, cols)."""
  r, k2 = data.shape
  blk = formats.BLOCK[fmt]
  r_unit, c_unit = (TILE, TILE) if tiled else (1, blk)
  data = C.pad_axis(C.pad_axis(data, 0, rows), 1, cols // 2)
  scale = C.pad_axis(C.pad_axis(scale, 0, rows // r_unit), 1, cols // c_unit)
  br = _pow2_divisor(rows, tiles.dq_rows, r_unit)
  bc = _pow2_divisor(cols, tiles.dq_cols, c_unit)
  return plc.pallas_call(
      functools.partial(_dequantize_kernel, fmt=fmt, tiled=tiled),
      out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16),
      grid=(rows // br, cols // bc),
      in_specs=[plc.BlockSpec((br, bc // 2), lambda i, j: (i, j)),
                plc.BlockSpec((br // r_unit, bc // c_unit), lambda i, j: (i, j))],
      out_specs=plc.BlockSpec((br, bc), lambda i, j: (i, j)),
      interpret=interpret, name=f"fp4jax_dequantize_bf16_{fmt}_{'16x16' if tiled else f'1x{blk}'}",
      num_warps=4, num_stages=2)(data, scale)


def _gemm_kernel(a_ref, b_ref, f_ref, o_ref, *, bk, nk):
  bm, bn = o_ref.shape

  def body(step, acc):
    k0 = plc.multiple_of(step * bk, bk)
    return acc + plc.dot_nt_f32(a_ref[:, plc.ds(k0, bk)], b_ref[:, plc.ds(k0, bk)])

  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = (((acc * f_ref[0]) * f_ref[1]) * f_ref[2] * f_ref[3]).astype(o_ref.dtype)


def _gemm_call(a_bf16, b_bf16, factor_4, *, bm, bn, bk, out_dtype, tiles, interpret):
  """out (M, N) = a (M, K) · b (N, K)ᵀ times the 4 factors in turn, M, N, K multiples of their tiles."""
  mp, kp = a_bf16.shape
  np_ = b_bf16.shape[0]
  return plc.pallas_call(
      functools.partial(_gemm_kernel, bk=bk, nk=kp // bk),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(mp // bm, np_ // bn),
      in_specs=[plc.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                plc.BlockSpec((bn, kp), lambda i, j: (j, 0)),
                plc.BlockSpec((4,), lambda i, j: (0,))],
      out_specs=plc.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret, name="fp4jax_gemm_bf16_f32acc",
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(a_bf16, b_bf16, factor_4)



def _scaled_matmul_call(a_data, a_scale, b_data, b_scale, factor_4, *, fmt, a_tiled, b_tiled,
                        out_dtype, tiles, interpret):
  """out (M, N) from a (M, K/2), b (N, K/2) packed codes and their scale bytes."""
  m, k2 = a_data.shape
  n = b_data.shape[0]
  k = 2 * k2
  blk = formats.BLOCK[fmt]
  unit = max(TILE if (a_tiled or b_tiled) else blk, blk)   # K granularity that keeps scales aligned
  ku, kup = C.fit(k // unit, max(1, tiles.bk // unit))      # bk >= unit >= 16
  bk, kp = ku * unit, kup * unit
  bm, mp = C.fit_dot(m, tiles.bm)
  bn, np_ = C.fit_dot(n, tiles.bn)
  dq = functools.partial(_dequantize_call, fmt=fmt, cols=kp, tiles=tiles, interpret=interpret)
  a_bf16 = dq(a_data, a_scale, tiled=a_tiled, rows=mp)
  b_bf16 = dq(b_data, b_scale, tiled=b_tiled, rows=np_)
  out = _gemm_call(a_bf16, b_bf16, factor_4, bm=bm, bn=bn, bk=bk, out_dtype=out_dtype, tiles=tiles,
                   interpret=interpret)
  return out[:m, :n]


def dequantize_bf16(data, scale, *, fmt="nvfp4", tiled=False, tiles=DEFAULT_TILES, interpret=False):
  """e2m1(code) · block scale as bf16 (R, K) (exact, no tensor factor) with the dequantize kernel.

  data (R, K/2) packed codes, scale (R, K/B) scale bytes, or (R/16, K/16) with ``tiled``.
  """
  r, k2 = data.shape
  return _dequantize_call(data, scale, fmt=fmt, tiled=tiled, rows=r, cols=2 * k2, tiles=tiles,
                          interpret=interpret)


def pallas_matmul(a_data, a_scale, b_data, b_scale, factor, *, fmt="nvfp4", a_tiled=False,
                  b_tiled=False, out_dtype=jnp.float32, tiles=DEFAULT_TILES, interpret=False):
  """a (..., M, K) · b (N, K)ᵀ from packed codes and scale bytes (uint8), times ``factor``.

  a_data (..., M, K/2), a_scale (..., M, K/B) or (..., M/16, K/16) with ``a_tiled``; b likewise
  without leading axes. factor: float32 scalar (the NVFP4 tensor factor; 1 for MXFP4), or the four
  parts of ``reference.tensor_factor_parts`` (factor, then three powers of two, applied in turn).
  """
  factor = jnp.asarray(factor, jnp.float32).reshape(-1)
  if factor.shape == (1,):
    factor = jnp.concatenate([factor, jnp.ones((3,), jnp.float32)])
  *lead, m, k2 = a_data.shape
  a2 = a_data.reshape(-1, k2)
  as2 = a_scale.reshape(-1, a_scale.shape[-1])
  out = _scaled_matmul_call(a2, as2, b_data, b_scale, factor, fmt=fmt,
                            a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=out_dtype, tiles=tiles,
                            interpret=interpret)
  return out.reshape(*lead, m, b_data.shape[0])




def scaled_matmul_reference(a, b, out_dtype=jnp.float32):
  """The oracle on QTensors: ``fp4jax.reference.scaled_matmul_reference``."""
  return reference.scaled_matmul_reference(a, b, out_dtype)


def scaled_matmul_narrow_xla(a, b, out_dtype):
  """The XLA composition of an nvfp4 scaled matmul whose result is narrower than float32 (bf16, f16),
  for the GPU: ``reference.scaled_matmul_reference`` without the ``fp4jax._exact`` masks on the
  epilogue, so that XLA's GPU compiler fuses the tensor factor and the cast into the GEMM (the GEMM then
  writes bf16: 512 MiB less traffic per 8192² GEMM than a float32 result, a masked pass and a cast).

  The same values: the masks only stop compiler rewrites, and here there is none to stop. The chain is
  four multiplies ending in the cast to ``out_dtype``; no add follows a multiply inside it (so nothing
  can contract into an FMA), the cast rounds right after the last one, and the factors are computed at
  run time from the amaxes (so nothing re-associates with a constant). tests/test_gpu_aot_cuts.py checks
  it against the reference bit for bit on the CPU; ``fp4jax.primitives`` uses it only on "cuda".
  """
  acc = reference._contract_last(reference.scaled_codes_bf16(a), reference.scaled_codes_bf16(b),  # noqa: SLF001
                                 jnp.float32)
  f = reference.tensor_factor_parts(a, b)
  return ((((acc * f[0]) * f[1]) * f[2]) * f[3]).astype(out_dtype)
