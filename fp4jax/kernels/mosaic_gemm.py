"""NVFP4 x NVFP4 GEMM on Blackwell's block-scaled tensor cores (sm_100), one Pallas Mosaic GPU kernel with
the epilogue inside: out (M, N) = cast( factor · Σ_k (e2m1·s)_a[m, k] (e2m1·s)_b[n, k] [+ residual] ).

Axis legend: M rows of a, N rows of b, K the contraction (the quantized axis of both), Kb = K/16 scale
blocks; tm, tn, tk the tile of one CTA and one K step (``GemmTiles``).

Operands as ``fp4jax.native.operand`` makes them (fprop's layout, both K-major): a (M, K) and b (N, K)
float4_e2m1fn, their E4M3 scales (M, Kb), (N, Kb) row-major (a 16x16 weight tile's scale repeated over its
rows). ``tensor_core_scales`` rearranges the scales into the tensor cores' layout (a small XLA pass, 1/8 of
the codes' bytes); factor is ``reference.tensor_factor_parts`` (the tensor factor and three powers of two).

The kernel, one CTA (one warpgroup, 128 threads) per (tm, tn) output tile:
  1. warp 0 loads, by TMA, the codes of a (tm, tk) and b (tn, tk) and their scales into a ring of
     ``stages`` shared-memory slots, each slot reused once the MMA that read it has completed (a tile past the
     end of M, N or K reads zeros: the scales are padded to whole tiles in their layout pass, the codes only to
     whole swizzle tiles, rows by 8 and K by 256);
  2. warp 1 copies each slot's scales to tensor memory (tcgen05.cp; one buffer per slot) and issues the
     block-scaled MMA (tcgen05.mma kind::mxf4nvf4.block_scale.scale_vec::4X: E2M1 products scaled by E4M3
     per 16, float32 accumulation in tensor memory), whose completion frees the slot;
  3. the epilogue, all four warps once the last MMA completed: the accumulator is read from tensor memory
     in (tm, en) column pieces, multiplied by the four factors in the XLA path's order
     (``reference.apply_factor_parts``, each product guarded from fusing into the add after it), the
     residual (loaded by TMA, double-buffered) added in float32, cast, and stored by TMA (clipped to the
     result's columns: no slice after the kernel).

The twin (``mosaic_gemm_reference``, and the kernel's result off CUDA) is the XLA path's: the exact products
e2m1·s in bf16, one GEMM with float32 accumulation, the same epilogue. Both add the same exact products in
float32 and differ only in the order of the sums (bit for bit where every partial sum is exact).

The pallas_call is named ``fp4jax_mosaic_gemm_nvfp4_<M>x<N>x<K>`` (padded sizes): the cost model
(bench/predict/hlo_kernels.py) reads the shape from the name (the Mosaic GPU lowering drops
``pl.CostEstimate``) and charges it as an FP4 block-scaled GEMM of 2·M·N·K FLOPs.

The grouped form for the MoE experts' rows GEMMs (``mosaic_grouped_gemm``, the last section): the same CTA on
the work items of ``fp4jax.tiles``, each reading its item's row tile and expert from two int32 tables.

Layouts: fprop (x (T, K) · w (N, K)ᵀ) is the one written. dgrad (dy (T, N) · w (N, K)) needs w's codes and
scales along N, i.e. the fprop tiles transposed (``transpose_tiles``, as the native path does, or a kernel
reading b N-major: tcgen05 takes only K-major 4-bit operands, so the transpose stays a pass), and wgrad
(dyᵀ · x over the tokens) takes the RHT'd operands quantized along the tokens, K-major as they are.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp4jax import _mosaic_compat as mc
from fp4jax import _native_compat as nc
from fp4jax import reference

BLOCK = 16          # E2M1 elements per E4M3 scale
SCALE_ROWS = 128    # rows of one tensor-core scale tile (its 4 scale columns cover 64 elements of K)
OUT_DTYPES = (jnp.bfloat16, jnp.float32)
FACTOR_WORDS = 32   # the 4 factors padded to 128 bytes: a TMA copy moves a multiple of 128 bytes here


@dataclasses.dataclass(frozen=True)
class GemmTiles:
  tm: int = 128          # output rows per CTA: the MMA's M (one CTA)
  tn: int = 256          # output columns per CTA: the MMA's N (<= 256, a multiple of 128 for the scales)
  tk: int = 256          # K per step: 128 bytes of codes per row, one 128-byte swizzle
  stages: int = 3        # shared-memory slots (each 54 KiB at the defaults)
  en: int = 32           # accumulator columns per epilogue piece

  def __post_init__(self):
    if self.tm != 128 or self.tn % SCALE_ROWS or not 0 < self.tn <= 256 or self.tk != 256:
      raise ValueError(f"{self}: tm must be 128, tn 128 or 256, tk 256 (one 128-byte swizzle of E2M1 codes)")
    if self.tn % self.en or self.en % 8:
      raise ValueError(f"{self}: en must divide tn and be a multiple of 8")


DEFAULT_TILES = GemmTiles()


def _gemm_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, f_gmem, *refs, tiles, k_steps, has_residual):
  """One (tm, tn) output tile of the dense GEMM: a's rows [mi·tm, +tm), b's [ni·tn, +tn) (``_gemm_tile``)."""
  if has_residual:
    r_gmem, out_gmem = refs[:2]
  else:
    (out_gmem,), r_gmem = refs[:1], None
  mi = lax.axis_index("m")
  _gemm_tile(a_gmem, b_gmem, as_gmem, bs_gmem, f_gmem, r_gmem, out_gmem, refs[-15:], tiles=tiles, k_steps=k_steps,
             a_row=mi * tiles.tm, a_scale_tile=mi, out_row=mi * tiles.tm)


def _gemm_tile(a_gmem, b_gmem, as_gmem, bs_gmem, f_gmem, r_gmem, out_gmem, scratch, *, tiles, k_steps, a_row,
               a_scale_tile, out_row):
  """One (tm, tn) output tile (module docstring, 1-3): out[out_row + (0..tm), ni·tn + (0..tn)] from a's rows
  [a_row, +tm) (their scales: tensor-core tile ``a_scale_tile``) and b's rows [ni·tn, +tn). b_gmem, bs_gmem,
  f_gmem and out_gmem may be one expert's or one item's view (``Ref.at[i]``): the grouped kernel's."""
  (a_smem, b_smem, as_smem, bs_smem, f_smem, out_smem, r_smem, acc_tmem, as_tmem, bs_tmem, loaded, consumed,
   mma_done, f_ready, r_ready) = scratch
  has_residual = r_gmem is not None
  plgpu = mc.plgpu()
  tm, tn, tk, stages, en = tiles.tm, tiles.tn, tiles.tk, tiles.stages, tiles.en
  ni = lax.axis_index("n")
  rows, cols = pl.ds(a_row, tm), pl.ds(ni * tn, tn)
  out_rows = pl.ds(out_row, tm)
  sk = tk // (4 * BLOCK)   # tensor-core scale tiles per K step

  plgpu.copy_gmem_to_smem(f_gmem, f_smem, f_ready)
  pieces = tn // en

  def load_residual(j):
    plgpu.copy_gmem_to_smem(r_gmem.at[out_rows, pl.ds(ni * tn + j * en, en)], r_smem.at[j % 2],
                            r_ready.at[j % 2])

  if has_residual:
    load_residual(0)

  @plgpu.warp_map
  def _(warp):
    @pl.when(warp == 0)
    def _load():
      def step(ki, carry):
        slot = lax.rem(ki, stages)

        @pl.when(ki >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[slot])
        ks, kq = pl.ds(ki * tk, tk), pl.ds(ki * sk, sk)
        plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(b_gmem.at[cols, ks], b_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(as_gmem.at[pl.ds(a_scale_tile, 1), kq], as_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(bs_gmem.at[pl.ds(ni * (tn // SCALE_ROWS), tn // SCALE_ROWS), kq],
                                bs_smem.at[slot], loaded.at[slot])
        return carry
      lax.fori_loop(0, k_steps, step, 0)

    @pl.when(warp == 1)
    def _mma():
      def step(ki, carry):
        slot = lax.rem(ki, stages)
        plgpu.barrier_wait(loaded.at[slot])
        for s in range(stages):   # one scale buffer per slot: a static pick
          @pl.when(slot == s)
          def _(s=s):
            plgpu.async_copy_scales_to_tmem(as_smem.at[s], as_tmem[s])
            plgpu.async_copy_scales_to_tmem(bs_smem.at[s], bs_tmem[s])
            plgpu.tcgen05_mma(acc_tmem, a_smem.at[s], plgpu.transpose_ref(b_smem.at[s], (1, 0)), consumed.at[s],
                              a_scale=as_tmem[s], b_scale=bs_tmem[s], accumulate=ki > 0)
        return carry
      lax.fori_loop(0, k_steps, step, 0)
      plgpu.tcgen05_commit_arrive(mma_done)

  plgpu.barrier_wait(f_ready)
  factor = [f_smem[i] for i in range(4)]
  plgpu.barrier_wait(mma_done)
  for j in range(pieces):
    acc = plgpu.async_load_tmem(acc_tmem.at[:, pl.ds(j * en, en)])
    y = reference.apply_factor_parts(acc, factor)
    if has_residual:
      if j + 1 < pieces:
        load_residual(j + 1)
      plgpu.barrier_wait(r_ready.at[j % 2])
      y = y + plgpu.load(r_smem.at[j % 2], (), layout=plgpu.Layout.TCGEN05).astype(jnp.float32)
    out_smem.at[j % 2][...] = y.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[j % 2], out_gmem.at[out_rows, pl.ds(ni * tn + j * en, en)])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  plgpu.wait_smem_to_gmem(0)


def _bits(dtype) -> int:
  return 4 if dtype == jnp.float4_e2m1fn else jnp.dtype(dtype).itemsize * 8


def _tile(dtype, minor: int) -> tuple[int, int]:
  """(rows, elements): the tiling of a shared-memory tile whose rows hold ``minor`` elements of dtype (one
  swizzle's width); a TMA copy between it and an array needs the array's last two dimensions multiples of it."""
  return 8, mc.plgpu().find_swizzle(minor * _bits(dtype)) * 8 // _bits(dtype)


def _swizzled(dtype, minor: int):
  """Tiling and swizzle transforms of a shared-memory tile whose rows hold ``minor`` elements of dtype."""
  plgpu = mc.plgpu()
  rows, elems = _tile(dtype, minor)
  return (plgpu.TilingTransform((rows, elems)), plgpu.SwizzleTransform(elems * _bits(dtype) // 8))


def _scratch(tiles, out_dtype, r_dtype, r_rows: int):
  """The shared and tensor memory of one CTA (``_gemm_tile``'s scratch, in its order) and its barriers."""
  plgpu = mc.plgpu()
  tm, tn, tk, stages, en = tiles.tm, tiles.tn, tiles.tk, tiles.stages, tiles.en
  e4m3 = jnp.float8_e4m3fn
  sk = tk // (4 * BLOCK)
  scales_tmem = lambda rows: tuple(plgpu.TMEM((rows, tk // BLOCK), e4m3, layout=plgpu.TMEMLayout.SCALES_LAYOUT)
                                   for _ in range(stages))
  return (
      plgpu.SMEM((stages, tm, tk), jnp.float4_e2m1fn, transforms=_swizzled(jnp.float4_e2m1fn, tk)),
      plgpu.SMEM((stages, tn, tk), jnp.float4_e2m1fn, transforms=_swizzled(jnp.float4_e2m1fn, tk)),
      plgpu.SMEM((stages, 1, sk, 32, 16), e4m3),
      plgpu.SMEM((stages, tn // SCALE_ROWS, sk, 32, 16), e4m3),
      plgpu.SMEM((FACTOR_WORDS,), jnp.float32),
      plgpu.SMEM((2, tm, en), out_dtype, transforms=_swizzled(out_dtype, en)),
      plgpu.SMEM((2, r_rows, en), r_dtype, transforms=_swizzled(r_dtype, en)),
      plgpu.TMEM((tm, tn), jnp.float32),
      scales_tmem(tm),
      scales_tmem(tn),
      plgpu.Barrier(num_arrivals=4, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
      plgpu.Barrier(orders_tensor_core=True),
      plgpu.Barrier(),
      plgpu.Barrier(num_barriers=2),
  )


def _gemm_call(a, b, a_tc, b_tc, factor, residual, *, out_dtype, tiles, out_shape: tuple[int, int]):
  """out of out_shape: the grid covers whole tiles (the scales, in the tensor cores' layout, padded to them); the
  codes and the residual are read as they are (TMA fills the parts of a tile past an array's end with zeros)
  and the result's tiles are stored clipped to out_shape (TMA drops the writes past its end)."""
  plgpu = mc.plgpu()
  mp, np_, kp = a_tc.shape[0] * SCALE_ROWS, b_tc.shape[0] * SCALE_ROWS, a_tc.shape[1] * 4 * BLOCK
  tm, tn, tk = tiles.tm, tiles.tn, tiles.tk
  # the residual's two buffers: without a residual a token pair of 8 rows (shared memory binds: a float32 result
  # beside full-size float32 buffers would take 232,532 bytes of the 232,448 a CTA may have)
  r_dtype, r_rows = (residual.dtype, tm) if residual is not None else (jnp.bfloat16, 8)
  kernel = functools.partial(_gemm_kernel, tiles=tiles, k_steps=kp // tk, has_residual=residual is not None)
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(mp // tm, np_ // tn),
      grid_names=("m", "n"), scratch_types=_scratch(tiles, out_dtype, r_dtype, r_rows),
      kernel_name=f"fp4jax_mosaic_gemm_nvfp4_{mp}x{np_}x{kp}")
  args = (a, b, a_tc, b_tc, factor) + ((residual,) if residual is not None else ())
  return call(*args)


def tensor_core_scales(scales_RxKb):
  """E4M3 scales (R, Kb), R a multiple of 128 and Kb of 4, in the tensor cores' layout for tcgen05's
  block-scaled MMA: (R/128, Kb/4, 32, 16), where the 128x4 tile (r, c) holds row r's scale c at
  [r mod 32, 4·(r div 32) + c] (PTX ISA, "tcgen05 scale factor A layout 1X")."""
  r, kb = scales_RxKb.shape
  tiles = scales_RxKb.reshape(r // SCALE_ROWS, 4, 32, kb // 4, 4)
  return tiles.transpose(0, 3, 2, 1, 4).reshape(r // SCALE_ROWS, kb // 4, 32, 16)


def _pad(x, rows: int, cols: int):
  if x.shape == (rows, cols):
    return x
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _check(a, a_scales, b, b_scales, factor, residual, out_dtype):
  (m, k), (n, k2) = a.shape, b.shape
  if a.dtype != jnp.float4_e2m1fn or b.dtype != jnp.float4_e2m1fn:
    raise ValueError(f"mosaic_gemm takes float4_e2m1fn operands (fp4jax.native.operand); got {a.dtype}, {b.dtype}")
  if a_scales.dtype != jnp.float8_e4m3fn or b_scales.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"mosaic_gemm takes float8_e4m3fn scales per 16 (NVFP4); got {a_scales.dtype}, "
                     f"{b_scales.dtype}")
  if k != k2 or k % BLOCK or a_scales.shape != (m, k // BLOCK) or b_scales.shape != (n, k // BLOCK):
    raise ValueError(f"mosaic_gemm: a (M, K)={a.shape}, b (N, K)={b.shape} with scales (M, K/16)="
                     f"{a_scales.shape}, (N, K/16)={b_scales.shape}; K must agree and be a multiple of 16")
  if jnp.shape(factor) not in ((4,), (FACTOR_WORDS,)):
    raise ValueError(f"mosaic_gemm: factor must be the (4,) parts of reference.tensor_factor_parts (or its "
                     f"(words={FACTOR_WORDS},) form); got shape {jnp.shape(factor)}")
  if residual is not None and residual.shape != (m, n):
    raise ValueError(f"mosaic_gemm: residual must be (M, N)={(m, n)}; got {residual.shape}")
  if jnp.dtype(out_dtype) not in map(jnp.dtype, OUT_DTYPES):
    raise ValueError(f"mosaic_gemm writes {OUT_DTYPES}; got out_dtype={out_dtype}")


def padded_columns(n: int, n_multiple: int) -> int:
  """n rounded up to a multiple of n_multiple: the result's columns with ``mosaic_gemm(n_multiple=...)``."""
  return -(-n // n_multiple) * n_multiple


def _kernel_path(a, a_scales, b, b_scales, factor, residual, *, out_dtype, tiles, n_multiple):
  """The kernel on the codes as they are where it can: a tile past an array's end reads zeros (zero codes:
  products 0, exact) and its writes past the result's end are dropped, so no pass pads a weight's rows or
  slices the result. Padded: the scales to whole tiles (inside their layout pass; zeros: products 0), and an
  array whose last two dimensions are not whole swizzle tiles (``_tile``: rows by 8; K of the codes by 256, the
  result's and the residual's columns by 32), which a TMA copy cannot take as it is."""
  (m, k), n = a.shape, b.shape[0]
  up = lambda d, t: -(-d // t) * t
  mp, np_, kp = up(m, tiles.tm), up(n, tiles.tn), up(k, tiles.tk)
  whole = lambda x, dtype, minor: _pad(x, *(up(d, t) for d, t in zip(x.shape, _tile(dtype, minor))))
  a, b = whole(a, a.dtype, tiles.tk), whole(b, b.dtype, tiles.tk)
  a_tc = tensor_core_scales(_pad(a_scales, mp, kp // BLOCK))
  b_tc = tensor_core_scales(_pad(b_scales, np_, kp // BLOCK))
  cols = padded_columns(n, n_multiple)
  rows_out, cols_out = (up(d, t) for d, t in zip((m, min(cols, np_)), _tile(out_dtype, tiles.en)))
  if residual is not None:
    residual = whole(residual, residual.dtype, tiles.en)
  factor = jnp.pad(factor, (0, FACTOR_WORDS - factor.shape[0]))   # a pass of its own unless the caller padded
  out = _gemm_call(a, b, a_tc, b_tc, factor, residual, out_dtype=out_dtype, tiles=tiles,
                   out_shape=(rows_out, cols_out))
  return out[:m, :cols] if cols <= cols_out else _pad(out[:m], m, cols)


def mosaic_gemm(a, a_scales, b, b_scales, factor, residual=None, *, out_dtype=jnp.bfloat16,
                tiles: GemmTiles = DEFAULT_TILES, n_multiple: int = 1):
  """out (M, N) = cast(apply_factor_parts(Σ_k (a·s_a)[m, k] (b·s_b)[n, k], factor) [+ residual]).

  a (M, K), b (N, K) float4_e2m1fn; a_scales (M, K/16), b_scales (N, K/16) float8_e4m3fn; factor float32
  (4,) or (FACTOR_WORDS,) (``reference.tensor_factor_parts``, whose ``words=FACTOR_WORDS`` saves the kernel's
  pad of it: one launch per call); residual (M, N) of any float dtype or None; out_dtype bf16 or
  float32. The kernel on CUDA (compute capability 10.x: ``fp4jax.dispatch.native_kernel`` decides when), the
  twin elsewhere. n_multiple: the result's columns padded with zeros to a multiple of it (``tiles.tn``: the
  kernel's own columns, no slice of the result), for a caller that slices later (a reduce-scatter's shard).
  """
  factor = jnp.asarray(factor, jnp.float32)
  _check(a, a_scales, b, b_scales, factor, residual, out_dtype)
  if n_multiple < 1:
    raise ValueError(f"mosaic_gemm: n_multiple must be >= 1; got {n_multiple}")
  kernel = functools.partial(_kernel_path, out_dtype=out_dtype, tiles=tiles, n_multiple=n_multiple)
  cols = padded_columns(b.shape[0], n_multiple)
  twin = lambda *ops: _pad(mosaic_gemm_reference(*ops, out_dtype=out_dtype), a.shape[0], cols)
  return lax.platform_dependent(a, a_scales, b, b_scales, factor, residual, cuda=kernel, default=twin)


def _decoded(codes, scales):
  """The twins' operand: the exact products e2m1·s (E4M3 per 16 along the last axis) in bf16."""
  return (codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), BLOCK, axis=-1)).astype(jnp.bfloat16)


def mosaic_gemm_reference(a, a_scales, b, b_scales, factor, residual=None, *, out_dtype=jnp.bfloat16):
  """The twin: the XLA path's GEMM (the exact products e2m1·s in bf16, float32 accumulation) and the same
  epilogue: ``reference.apply_factor_parts``, the residual added in float32, the cast."""
  acc = lax.dot_general(_decoded(a, a_scales), _decoded(b, b_scales), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
  y = reference.apply_factor_parts(acc, factor)
  if residual is not None:
    y = y + residual.astype(jnp.float32)
  return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------------
# The grouped GEMM of the MoE experts: work items of row tiles, each with its group's weight
# ---------------------------------------------------------------------------------------------------
# Axis legend: S rows of a (sorted by group), E groups (experts), T rows per row tile, W work items
# (``fp4jax.tiles.items``: item w is row tile item_tile[w] with group item_group[w]'s operand), Tm the rows the
# kernel computes per item (T rounded up to whole tm), N, K as above.
#
# The same CTA as the dense GEMM's (``_gemm_tile``), one per (tm, tn) tile of one item: grid (W, N/tn, Tm/tm), the
# last axis the fastest (Mosaic GPU maps it to blockIdx.x), so an item's CTAs run together and the items of one
# group (consecutive: the rows are sorted) share its weight in L2. Each CTA reads its item's
# row tile and group from the two int32 tables (scalar loads from global memory), then TMA-loads a's rows
# [tile·T + mi·tm, +tm) (rows of the next tile or past S, where T is not whole tiles, only feed result rows past
# T, which the store drops; past S TMA reads zeros), b[group]'s rows, their scales, and factor[group], and stores
# item w's (tm, tn) tile of the (W, T, N) result. a's scales go to the tensor cores' layout once (not per item),
# b's once per expert: no operand is gathered per item, and no float32 result and no epilogue pass leave the
# kernel. The items' rows are picked from the result by the caller (``fp4jax.tiles.pick_rows``).
#
# The pallas_call is named ``fp4jax_mosaic_grouped_gemm_nvfp4_<W>x<Tm>x<N>x<K>`` (N, K padded to the tiles): the
# cost model charges it as W block-scaled FP4 GEMMs of Tm x N x K, 2·W·Tm·N·K FLOPs.

def _grouped_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, f_gmem, tile_gmem, group_gmem, out_gmem, *scratch, tiles,
                    k_steps, tile_rows):
  """One (tm, tn) tile of item w: a's rows [item_tile[w]·T + mi·tm, +tm) times b[item_group[w]]."""
  w, mi = lax.axis_index("w"), lax.axis_index("m")
  row_tile, group = tile_gmem[w], group_gmem[w]
  a_row = row_tile * tile_rows + mi * tiles.tm
  # T is a multiple of 128 or there is one row tile (row_tile 0): a's first row is a whole scale tile's
  _gemm_tile(a_gmem, b_gmem.at[group], as_gmem, bs_gmem.at[group], f_gmem.at[group], None, out_gmem.at[w], scratch,
             tiles=tiles, k_steps=k_steps, a_row=a_row, a_scale_tile=lax.div(a_row, SCALE_ROWS),
             out_row=mi * tiles.tm)


def _grouped_call(a, b_E, a_tc, b_tc_E, factor_E, item_tile, item_group, *, tile: int, out_dtype, tiles,
                  out_shape: tuple[int, int, int]):
  """(W, T', N') of out_shape; a (S', K') and b_E (E, N', K') whole swizzle tiles (``_tile``), the scales in the
  tensor cores' layout padded to whole tiles: a_tc's rows cover every item's Tm rows, b_tc_E's N to whole tn."""
  plgpu = mc.plgpu()
  w = item_tile.shape[0]
  tm, tn, tk = tiles.tm, tiles.tn, tiles.tk
  np_, kp = b_tc_E.shape[1] * SCALE_ROWS, b_tc_E.shape[2] * 4 * BLOCK
  m_tiles = -(-tile // tm)
  kernel = functools.partial(_grouped_kernel, tiles=tiles, k_steps=kp // tk, tile_rows=tile)
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(w, np_ // tn, m_tiles),
      grid_names=("w", "n", "m"), scratch_types=_scratch(tiles, out_dtype, jnp.bfloat16, 8),
      kernel_name=f"fp4jax_mosaic_grouped_gemm_nvfp4_{w}x{m_tiles * tm}x{np_}x{kp}")
  return call(a, b_E, a_tc, b_tc_E, factor_E, item_tile, item_group)


def _grouped_kernel_path(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, *, tile, out_dtype, tiles):
  """The kernel on the codes as they are where it can (``_kernel_path``'s rules): a's rows past S read zeros, so
  a is not padded to whole row tiles; the scales padded (zeros) inside their layout pass, a's once, b's per
  expert; the result (W, T, N) written at its shape unless T or N are not whole swizzle tiles (then sliced)."""
  (s, k), n = a.shape, b_E.shape[1]
  up = lambda d, t: -(-d // t) * t
  n_t = -(-s // tile)
  np_, kp = up(n, tiles.tn), up(k, tiles.tk)
  rows_tc = up((n_t - 1) * tile + up(tile, tiles.tm), SCALE_ROWS)   # the last item's last row tile, whole
  whole = lambda x, dtype, minor: _pad(x, *(up(d, t) for d, t in zip(x.shape, _tile(dtype, minor))))
  a = whole(a, a.dtype, tiles.tk)
  rows_b, cols_b = (up(d, t) for d, t in zip((n, k), _tile(b_E.dtype, tiles.tk)))
  if (rows_b, cols_b) != (n, k):
    b_E = jnp.pad(b_E, ((0, 0), (0, rows_b - n), (0, cols_b - k)))
  a_tc = tensor_core_scales(_pad(a_scales, rows_tc, kp // BLOCK))
  b_tc_E = jax.vmap(lambda s_NxKb: tensor_core_scales(_pad(s_NxKb, np_, kp // BLOCK)))(b_scales_E)
  if factor_E.shape[1] != FACTOR_WORDS:
    factor_E = jnp.pad(factor_E, ((0, 0), (0, FACTOR_WORDS - factor_E.shape[1])))
  rows_out, cols_out = (up(d, t) for d, t in zip((tile, min(n, np_)), _tile(out_dtype, tiles.en)))
  out = _grouped_call(a, b_E, a_tc, b_tc_E, factor_E, item_tile, item_group, tile=tile, out_dtype=out_dtype,
                      tiles=tiles, out_shape=(item_tile.shape[0], rows_out, cols_out))
  out = out if out.shape[1:] == (tile, n) else out[:, :tile, :n]
  # inside shard_map (the experts' GEMMs on each device's rows) the kernel's result varies over no mesh axis and
  # the twin's over its operands': lax.platform_dependent takes only branches of one type
  return nc.vary_like(out, a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group)


def _check_grouped(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, tile, out_dtype):
  (s, k), n_g = a.shape, b_E.shape[0]
  if a.dtype != jnp.float4_e2m1fn or b_E.dtype != jnp.float4_e2m1fn:
    raise ValueError(f"mosaic_grouped_gemm takes float4_e2m1fn operands (fp4jax.native.operand); got {a.dtype}, "
                     f"{b_E.dtype}")
  if a_scales.dtype != jnp.float8_e4m3fn or b_scales_E.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"mosaic_grouped_gemm takes float8_e4m3fn scales per 16 (NVFP4); got {a_scales.dtype}, "
                     f"{b_scales_E.dtype}")
  if (b_E.ndim != 3 or b_E.shape[2] != k or k % BLOCK or a_scales.shape != (s, k // BLOCK)
      or b_scales_E.shape != (*b_E.shape[:2], k // BLOCK)):
    raise ValueError(f"mosaic_grouped_gemm: a (S, K)={a.shape}, b (E, N, K)={b_E.shape} with scales (S, K/16)="
                     f"{a_scales.shape}, (E, N, K/16)={b_scales_E.shape}; K must agree and be a multiple of 16")
  if jnp.shape(factor_E) not in ((n_g, 4), (n_g, FACTOR_WORDS)):
    raise ValueError(f"mosaic_grouped_gemm: factor_E must be (E, 4) (reference.tensor_factor_parts per group) or "
                     f"(E, {FACTOR_WORDS}); got shape {jnp.shape(factor_E)} for E={n_g}")
  if item_tile.ndim != 1 or item_group.shape != item_tile.shape or item_tile.dtype != jnp.int32 \
      or item_group.dtype != jnp.int32:
    raise ValueError(f"mosaic_grouped_gemm: item_tile and item_group must be (W,) int32 (fp4jax.tiles.items); "
                     f"got {item_tile.shape} {item_tile.dtype}, {item_group.shape} {item_group.dtype}")
  if tile < 1 or (s > tile and tile % SCALE_ROWS):
    raise ValueError(f"mosaic_grouped_gemm: tile={tile} rows must be a multiple of {SCALE_ROWS} (a whole tile of "
                     f"the tensor cores' scales) unless one tile holds all S={s} rows")
  if jnp.dtype(out_dtype) not in map(jnp.dtype, OUT_DTYPES):
    raise ValueError(f"mosaic_grouped_gemm writes {OUT_DTYPES}; got out_dtype={out_dtype}")


def mosaic_grouped_gemm(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, *, tile: int,
                        out_dtype=jnp.bfloat16, tiles: GemmTiles = DEFAULT_TILES):
  """out (W, T, N): out[w, i] = cast(apply_factor_parts(Σ_k (a·s_a)[item_tile[w]·T + i, k] (b·s_b)[g, n, k],
  factor_E[g])) with g = item_group[w]; rows past S read zeros.

  a (S, K), b_E (E, N, K) float4_e2m1fn (each expert's weight as it is, not gathered per item); a_scales (S, K/16),
  b_scales_E (E, N, K/16) float8_e4m3fn; factor_E float32 (E, 4) or (E, FACTOR_WORDS), group e's
  ``reference.tensor_factor_parts``; item_tile, item_group (W,) int32 (``fp4jax.tiles.items``: every item_tile
  < ceil(S/T), every item_group < E); tile: T, a multiple of 128 unless T >= S (one row tile); out_dtype bf16 or
  float32. The kernel on CUDA (compute capability 10.x), the twin elsewhere."""
  factor_E = jnp.asarray(factor_E, jnp.float32)
  _check_grouped(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, tile, out_dtype)
  kernel = functools.partial(_grouped_kernel_path, tile=tile, out_dtype=out_dtype, tiles=tiles)
  twin = functools.partial(mosaic_grouped_gemm_reference, tile=tile, out_dtype=out_dtype)
  return lax.platform_dependent(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, cuda=kernel,
                                default=twin)


def mosaic_grouped_gemm_reference(a, a_scales, b_E, b_scales_E, factor_E, item_tile, item_group, *, tile: int,
                                  out_dtype=jnp.bfloat16):
  """The twin: the native path's batched GEMM of the work items (``fp4jax.native.grouped_rows``'s: the exact
  products e2m1·s in bf16, a's rows zero-padded to whole row tiles and gathered per item, b's per item, one batched
  GEMM with float32 accumulation) and the dense kernel's epilogue with each item's group's factor."""
  s = a.shape[0]
  n_t = -(-s // tile)
  a_SxK = _decoded(a, a_scales)
  a_SxK = jnp.pad(a_SxK, ((0, n_t * tile - s), (0, 0)))
  tiles_WxTxK = a_SxK.reshape(n_t, tile, -1)[item_tile]
  b_WxNxK = _decoded(b_E, b_scales_E)[item_group]
  acc = lax.dot_general(tiles_WxTxK, b_WxNxK, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST)
  f_WxF = factor_E[item_group]
  y = reference.apply_factor_parts(acc, [f_WxF[:, i, None, None] for i in range(4)])
  return y.astype(out_dtype)
