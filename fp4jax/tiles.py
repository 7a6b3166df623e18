"""Row tiles of a grouped GEMM: S sorted rows in groups of traced sizes met by a static count of work items.

Axis legend: S sorted rows, E groups, T rows per tile, W = S/T + E - 1 work items, K the contraction, N the
output features.

A GEMM whose rows are ragged (group e's rows times b[e]) has a traced size per group and a static shape. The
S rows are cut into tiles of T rows and at every group end: W pieces (a static count; some empty), each
inside one tile and one group. One batched GEMM runs them: batch element i is piece i's tile (T rows,
gathered) with its group's operand (gathered). The rows ragged (fprop, dgrad): each row's result is read
from its piece (``pick_rows``); the contraction ragged (wgrad): each piece's tile has its rows outside the
piece masked (``keep_rows``), and a group's pieces are summed in order (``sum_groups``). Both waste at most
E - 1 tiles of rows; the choice of T is ``grouped_tile`` (docs/DESIGN.md, "The native grouped GEMM").

Two users: ``fp4jax.native`` (the block-scaled GEMM of NVFP4 operands, masking by zero block scales) and
the XLA path's ``rows`` / ``tokens`` below: plain float dots with float32 accumulation, which a GPU target
runs instead of ``lax.ragged_dot`` (``fp4jax.gemm.ragged_rows``): XLA:GPU expands a ragged dot to a dense
dot over every group, E times the FLOPs and the bytes of its output (docs/PERF.md, "nemotron3_super's experts sized by traffic, and the tile rows").
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Items(NamedTuple):
  """The work items of S rows in tiles of T: item i is rows [lo[i], hi[i]) of tile lo[i] // T, all in
  group ``group[i]`` (empty where hi <= lo; rows past the last group are in none)."""
  lo: object      # (W,) int32, sorted
  hi: object      # (W,) int32
  tile: object    # (W,) int32
  group: object   # (W,) int32


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How a grouped GEMM cuts S rows into tiles (``grouped_tile``): one tile of all S rows for up to
  ``one_tile_groups`` groups (each group's GEMM padded to S), else tiles of ``rows`` rows (rounded up to
  a multiple of the group-size multiple). The numbers behind the defaults: docs/DESIGN.md, "The native grouped GEMM"."""
  one_tile_groups: int = 1
  rows: int = 1024


# 1024-row tiles for both paths. 512 is within 2% of 1024 at E = 64 and 9% slower at E = 8 (docs/
# DESIGN.md); at Nemotron 3 Super's expert GEMMs per GPU (E = 64, S = 271,296 rows, K = 1024, N = 2688) 512-row
# tiles crash XLA:GPU's LLVM NVPTX backend, native and XLA path alike (a segfault in
# MachineRegisterInfo::constrainRegClass, jax 0.10.2's CUDA 13 plugin; 1024 and 2048 compile; the threshold
# lies between 455 and 533 work items of 1024 x 2688), and 1024 is the faster prediction there (XLA path
# 17.5 ms for y, dx, dw vs 19.5 ms at 2048: fewer gathered weights, W·K·N bytes). docs/PERF.md, "nemotron3_super's experts sized by traffic, and the tile rows".
TILING = Tiling()


def grouped_tile(s: int, n_groups: int, rows: int, tiling: Tiling | None = None) -> int:
  """T for S sorted rows in ``n_groups`` groups whose sizes are multiples of ``rows``."""
  t = TILING if tiling is None else tiling
  if n_groups <= t.one_tile_groups or s <= t.rows:
    return s
  return -(-t.rows // rows) * rows


def items(sizes_E, s: int, tile: int) -> Items:
  """The W = S/T + E - 1 work items of S rows (a multiple of T) for the traced group sizes."""
  n_t, n_g = s // tile, sizes_E.shape[0]
  ends_E = jnp.cumsum(sizes_E.astype(jnp.int32))
  lo = jnp.sort(jnp.concatenate([jnp.arange(n_t, dtype=jnp.int32) * tile, jnp.minimum(ends_E[:-1], s)]))
  hi = jnp.minimum(jnp.concatenate([lo[1:], jnp.full((1,), s, jnp.int32)]), ends_E[-1])
  group = jnp.minimum(jnp.searchsorted(ends_E, lo, side="right"), n_g - 1).astype(jnp.int32)
  return Items(lo, hi, jnp.minimum(lo // tile, n_t - 1), group)


def pick_rows(out_WxTxN, it: Items, sizes_E, s: int, tile: int, fill_S=None):
  """(S, N): each row's result from the item that holds it; for the rows past the last group zero, or
  ``fill_S[r]`` (S,) of the result's dtype (a caller whose epilogue gives those rows a value of their own)."""
  r_S = jnp.arange(s, dtype=jnp.int32)
  item_S = jnp.searchsorted(it.lo, r_S, side="right").astype(jnp.int32) - 1
  acc_SxN = out_WxTxN.reshape(-1, out_WxTxN.shape[-1])[item_S * tile + r_S % tile]
  inside = r_S < jnp.sum(sizes_E.astype(jnp.int32))
  outside = jnp.zeros((), acc_SxN.dtype) if fill_S is None else fill_S.astype(acc_SxN.dtype)[:, None]
  return jnp.where(inside[:, None], acc_SxN, outside)


def keep_rows(it: Items, tile: int, step: int = 1):
  """(W, T / step) bool: whether row (or block of ``step`` rows) j of item i's tile is inside the item."""
  row_W = it.tile[:, None] * tile + jnp.arange(0, tile, step, dtype=jnp.int32)[None, :]
  return (row_W >= it.lo[:, None]) & (row_W < it.hi[:, None])


def sum_groups(part_WxKxN, it: Items, n_groups: int, n_tiles: int):
  """(E, K, N): each group's items summed in order (one item per group when there is one tile)."""
  if n_tiles == 1:
    return part_WxKxN
  return jax.ops.segment_sum(part_WxKxN, it.group, num_segments=n_groups, indices_are_sorted=True)


def pad_rows(t, s: int, axis: int = 0):
  """t zero-padded along ``axis`` to s."""
  widths = [(0, 0)] * t.ndim
  widths[axis] = (0, s - t.shape[axis])
  return jnp.pad(t, widths)


# ---------------------------------------------------------------------------------------------------
# The XLA path's tiled grouped GEMM: plain dots, float32 accumulation
# ---------------------------------------------------------------------------------------------------

def _dot(a, b, contract, precision):
  return lax.dot_general(a, b, ((contract, (1,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                         precision=precision)


def _rows(a_SxK, b_ExKxN, sizes_E, tile: int, precision, out_dtype=jnp.float32):
  s = a_SxK.shape[0]
  s_pad = -(-s // tile) * tile
  n_t, n_g = s_pad // tile, b_ExKxN.shape[0]
  it = items(sizes_E, s_pad, tile)
  a_pad = pad_rows(a_SxK, s_pad)
  if n_t == 1:   # item i is group i, over every row
    tiles_a, tiles_b = jnp.broadcast_to(a_pad, (n_g, *a_pad.shape)), b_ExKxN
  else:
    tiles_a, tiles_b = a_pad.reshape(n_t, tile, -1)[it.tile], b_ExKxN[it.group]
  return pick_rows(_dot(tiles_a, tiles_b, (2,), precision).astype(out_dtype), it, sizes_E, s, tile)


def _tokens(a_SxK, b_SxN, sizes_E, tile: int, precision):
  s, n_g = a_SxK.shape[0], sizes_E.shape[0]
  s_pad = -(-s // tile) * tile
  n_t = s_pad // tile
  it = items(sizes_E, s_pad, tile)
  split = lambda t: pad_rows(t, s_pad).reshape(n_t, tile, -1)
  if n_t == 1:
    tiles_a = jnp.broadcast_to(split(a_SxK), (n_g, tile, a_SxK.shape[1]))
    tiles_b = jnp.broadcast_to(split(b_SxN), (n_g, tile, b_SxN.shape[1]))
  else:
    tiles_a, tiles_b = split(a_SxK)[it.tile], split(b_SxN)[it.tile]
  tiles_a = jnp.where(keep_rows(it, tile)[..., None], tiles_a, jnp.zeros((), tiles_a.dtype))
  return sum_groups(_dot(tiles_a, tiles_b, (1,), precision), it, n_g, n_t)


def _tile(s: int, n_groups: int, tiling: Tiling | None):
  return grouped_tile(s, n_groups, 1, tiling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rows_vjp(a_SxK, b_ExKxN, sizes_E, tiling, precision, out_dtype):
  return _rows(a_SxK, b_ExKxN, sizes_E, _tile(a_SxK.shape[0], b_ExKxN.shape[0], tiling), precision, out_dtype)


def _rows_fwd(a_SxK, b_ExKxN, sizes_E, tiling, precision, out_dtype):
  return _rows_vjp(a_SxK, b_ExKxN, sizes_E, tiling, precision, out_dtype), (a_SxK, b_ExKxN, sizes_E)


def _rows_bwd(tiling, precision, out_dtype, res, dy_SxN):
  del out_dtype   # dy arrives in it: the float32 accumulations below take it as it is
  a_SxK, b_ExKxN, sizes_E = res
  tile = _tile(a_SxK.shape[0], b_ExKxN.shape[0], tiling)
  da = _rows(dy_SxN, jnp.swapaxes(b_ExKxN, 1, 2), sizes_E, tile, precision)
  db = _tokens(a_SxK, dy_SxN, sizes_E, tile, precision)
  # da is released only together with db, as fp4jax.dot releases dx with dw: without it XLA's scheduler ran
  # the wgrad of Super's unscanned bf16 E blocks at the end of the backward and kept its tiles live across it
  # (block 87: 3.4 GiB + 1.0 GiB of receive buffers, docs/PERF.md, "nemotron3_super on 64 GPUs"). It changes no value.
  da, db = lax.optimization_barrier((da.astype(a_SxK.dtype), db.astype(b_ExKxN.dtype)))
  return da, db, None


_rows_vjp.defvjp(_rows_fwd, _rows_bwd)


def rows(a_SxK, b_ExKxN, sizes_E, *, precision=lax.Precision.HIGHEST, tiling: Tiling | None = None,
         out_dtype=jnp.float32):
  """(S, N) ``out_dtype``: row r of a times b[e] for r in group e, zero past the last group (``lax.ragged_dot``'s
  result, float32 accumulation rounded once to ``out_dtype``), as one batched dot of the work items
  (``tiling``: default ``TILING``). Differentiable: dgrad is ``rows`` of dy and bᵀ, wgrad ``tokens`` (float32
  partials per item, summed per group), each rounded once to its operand's dtype. A bf16 ``out_dtype`` (what
  a bf16 caller casts to anyway) halves the (W, T, N) result and makes the cotangent bf16, so the backward's
  GEMMs read bf16 tiles (bf16 x bf16, float32 accumulation) instead of float32 ones."""
  return _rows_vjp(a_SxK, b_ExKxN, sizes_E.astype(jnp.int32), tiling, precision, jnp.dtype(out_dtype))


def tokens(a_SxK, b_SxN, sizes_E, *, precision=lax.Precision.HIGHEST, tiling: Tiling | None = None):
  """float32 (E, K, N): per group e, its rows of a contracted with its rows of b (the wgrad GEMM:
  ``lax.ragged_dot_general`` with the rows ragged), one batched dot of the work items with the rows
  outside each item masked, the items summed per group. Not differentiated (a backward's GEMM)."""
  s = a_SxK.shape[0]
  return _tokens(a_SxK, b_SxN, sizes_E.astype(jnp.int32), _tile(s, sizes_E.shape[0], tiling), precision)
