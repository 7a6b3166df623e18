"""Scaled matmul of two FP4 operands: out (M, N) = factor · sum_k a[m, k] · b[n, k], one Pallas kernel.

Axis legend: M rows of a (leading axes flattened), N rows of b, K the contraction axis (the quantized
and packed axis of both), B the block (16 nvfp4, 32 mxfp4).

Packed codes and scale bytes go in; each program owns a (bm, bn) output tile and walks K in steps of
bk: unpack a (bm, bk/2) byte tile into (bm, bk) codes, decode them and multiply by their block scales
(1x16 / 1x32 blocks, or 16x16 tiles for 2D-quantized weights) — the product is exact in bfloat16 —
then a bf16 x bf16 dot with float32 accumulation (tensor cores on GPU). The tensor factor
(amax_a · amax_b / (6·6·448·448) for NVFP4, 1 for MXFP4) multiplies the float32 accumulator once at
the end; the result is cast to the output dtype. This is the exact emulation of an FP4 tensor-core
GEMM on hardware without FP4 units (spec §2), up to the order of the float32 sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _pallas_compat as plc
from fp4jax import e2m1, formats, reference
from fp4jax.kernels import _common as C

TILE = formats.NVFP4.tile[0]   # side of the square 2D tiles (nvfp4 is the kernel format with tiles)
_MIN_DOT = 16                  # tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class ScaledMatmulTiles:
  bm: int = 128
  bn: int = 128
  bk: int = 128            # elements of K per step (a multiple of the block)
  num_warps: int = 8
  num_stages: int = 3


DEFAULT_TILES = ScaledMatmulTiles()


def _dequant_tile_bf16(packed_RxK2, scale_bytes, *, fmt, tiled):
  """bf16 (R, K) tile of e2m1(code) · block scale (exact) from packed codes and scale bytes."""
  r, k2 = packed_RxK2.shape
  k = 2 * k2
  p = packed_RxK2.astype(jnp.int32)
  codes = jnp.stack([p & 0xF, (p >> 4) & 0xF], axis=-1).reshape(r, k)
  vals = e2m1.decode(codes)
  s = C.e4m3_value(scale_bytes) if fmt == "nvfp4" else C.e8m0_value(scale_bytes)
  if tiled:
    g, nb = s.shape
    s_full = jnp.broadcast_to(s[:, None, :, None], (g, TILE, nb, TILE)).reshape(r, k)
  else:
    nb = s.shape[1]
    b = k // nb
    s_full = jnp.broadcast_to(s[:, :, None], (r, nb, b)).reshape(r, k)
  return (vals * s_full).astype(jnp.bfloat16)


def _scaled_matmul_kernel(a_ref, as_ref, b_ref, bs_ref, f_ref, o_ref, *, fmt, a_tiled, b_tiled,
                          bk, nk):
  bm, bn = o_ref.shape
  blk = formats.BLOCK[fmt]

  def scale_cols(tiled):
    return bk // TILE if tiled else bk // blk

  def body(step, acc):
    kp = plc.multiple_of(step * (bk // 2), bk // 2)
    a_p = a_ref[:, plc.ds(kp, bk // 2)]
    b_p = b_ref[:, plc.ds(kp, bk // 2)]
    ca, cb = scale_cols(a_tiled), scale_cols(b_tiled)
    a_s = as_ref[:, plc.ds(plc.multiple_of(step * ca, ca), ca)]
    b_s = bs_ref[:, plc.ds(plc.multiple_of(step * cb, cb), cb)]
    a_bf16 = _dequant_tile_bf16(a_p, a_s, fmt=fmt, tiled=a_tiled)
    b_bf16 = _dequant_tile_bf16(b_p, b_s, fmt=fmt, tiled=b_tiled)
    return acc + plc.dot_nt_f32(a_bf16, b_bf16)

  acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = (acc * f_ref[0]).astype(o_ref.dtype)


def _scaled_matmul_call(a_data, a_scale, b_data, b_scale, factor_1, *, fmt, a_tiled, b_tiled,
                        out_dtype, tiles, interpret):
  """out (M, N) from a (M, K/2), b (N, K/2) packed codes and their scale bytes."""
  m, k2 = a_data.shape
  n = b_data.shape[0]
  k = 2 * k2
  blk = formats.BLOCK[fmt]
  unit = TILE if (a_tiled or b_tiled) else blk       # K granularity that keeps scales aligned
  unit = max(unit, blk)
  ku, kup = C.fit(k // unit, max(1, tiles.bk // unit))
  bk, kp = ku * unit, kup * unit
  bm, mp = C.fit(m, tiles.bm)
  bn, np_ = C.fit(n, tiles.bn)
  if bm < _MIN_DOT or bn < _MIN_DOT or bk < _MIN_DOT:
    bm, mp = max(bm, _MIN_DOT), -(-m // max(bm, _MIN_DOT)) * max(bm, _MIN_DOT)
    bn, np_ = max(bn, _MIN_DOT), -(-n // max(bn, _MIN_DOT)) * max(bn, _MIN_DOT)
  a_rows = (lambda v: v // TILE) if a_tiled else (lambda v: v)
  b_rows = (lambda v: v // TILE) if b_tiled else (lambda v: v)
  a_cols = (lambda v: v // TILE) if a_tiled else (lambda v: v // blk)
  b_cols = (lambda v: v // TILE) if b_tiled else (lambda v: v // blk)
  a_data = C.pad_axis(C.pad_axis(a_data, 0, mp), 1, kp // 2)
  b_data = C.pad_axis(C.pad_axis(b_data, 0, np_), 1, kp // 2)
  a_scale = C.pad_axis(C.pad_axis(a_scale, 0, a_rows(mp)), 1, a_cols(kp))
  b_scale = C.pad_axis(C.pad_axis(b_scale, 0, b_rows(np_)), 1, b_cols(kp))
  kernel = functools.partial(_scaled_matmul_kernel, fmt=fmt, a_tiled=a_tiled, b_tiled=b_tiled,
                             bk=bk, nk=kp // bk)
  out = plc.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(mp // bm, np_ // bn),
      in_specs=[plc.BlockSpec((bm, kp // 2), lambda i, j: (i, 0)),
                plc.BlockSpec((a_rows(bm), a_cols(kp)), lambda i, j: (i, 0)),
                plc.BlockSpec((bn, kp // 2), lambda i, j: (j, 0)),
                plc.BlockSpec((b_rows(bn), b_cols(kp)), lambda i, j: (j, 0)),
                plc.BlockSpec((1,), lambda i, j: (0,))],
      out_specs=plc.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret, name=f"fp4jax_scaled_matmul_{fmt}",
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(
          a_data, a_scale, b_data, b_scale, factor_1)
  return out[:m, :n]


def scaled_matmul(a_data, a_scale, b_data, b_scale, factor, *, fmt="nvfp4", a_tiled=False,
                  b_tiled=False, out_dtype=jnp.float32, tiles=DEFAULT_TILES, interpret=False):
  """a (..., M, K) · b (N, K)ᵀ from packed codes and scale bytes (uint8), times ``factor``.

  a_data (..., M, K/2), a_scale (..., M, K/B) or (..., M/16, K/16) with ``a_tiled``; b likewise
  without leading axes. factor: float32 scalar (the NVFP4 tensor factor; 1 for MXFP4).
  """
  *lead, m, k2 = a_data.shape
  a2 = a_data.reshape(-1, k2)
  as2 = a_scale.reshape(-1, a_scale.shape[-1])
  out = _scaled_matmul_call(a2, as2, b_data, b_scale,
                            jnp.asarray(factor, jnp.float32).reshape(1), fmt=fmt,
                            a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=out_dtype, tiles=tiles,
                            interpret=interpret)
  return out.reshape(*lead, m, b_data.shape[0])


def scaled_matmul_reference(a, b, out_dtype=jnp.float32):
  """The oracle on QTensors: ``fp4jax.reference.scaled_matmul_reference``."""
  return reference.scaled_matmul_reference(a, b, out_dtype)
