"""The native GEMM: a pair of block-scaled QTensors on the hardware's block-scaled tensor cores.

``fp4jax.gemm.matmul(a, b, impl="native")`` lands here (and impl=None on a GPU of compute capability 10.x
for the formats ``fp4jax.dispatch.native_default`` turns on there). Two families:

  NVFP4 (nvfp4, nvfp4_eden, nvfp4_dbq)  values float4_e2m1fn, scales float8_e4m3fn per 1x16 along K
  MXFP8 (mxfp8)                         values float8_e4m3fn, scales float8_e8m0fnu per 1x32 along K

Three steps:

1. ``operand(q)``: a (R, K) QTensor quantized along K becomes the block-scaled layout: its values (R, K)
   and its scales (R, K/blk), row-major, as the QTensor holds them. NVFP4: the E2M1 codes as
   float4_e2m1fn; a 16x16-tiled weight's scale is repeated over the tile's 16 rows (the same product
   e2m1·s for every element); the dgrad weight is the fprop tiles transposed (``fp4jax.transpose_tiles``:
   codes and scales only), and the RHT'd, stochastically rounded wgrad operands are taken as they are
   (quantized along the tokens, which is the GEMM's K). MXFP8: the E4M3 elements and E8M0 scale bytes as
   they are; each GEMM's operands are quantized along its own contraction (``recipes.mxfp8``: x and w
   along K for fprop, dy and w along N for dgrad, xᵀ and dyᵀ along the tokens for wgrad). No value is
   re-rounded: every element·scale is the QTensor's own. The scales go to the GEMM row-major; XLA's
   block-scaled-dot rewrite pads them to the tensor cores' tiles and swizzles them itself
   (``fp4jax._native_compat``).
2. ``block_scaled_matmul``: Σ_k (v·s)_a (v·s)_b in float32, ``jax.nn.scaled_matmul`` on CUDA (cuDNN's
   ``__cudnn$blockScaledDot`` on sm_100, for both families). Elsewhere (the CPU) its twin, the XLA path's
   GEMM: NVFP4's exact products in bfloat16, one bf16 GEMM with float32 accumulation; MXFP8's exact
   dequantized values (``numerics.mxfp8.dequantize``) in one float32 GEMM (``numerics.mxfp8.gemm``).
3. The format's second level on the float32 result, ``fp4jax.epilogue`` (the one the XLA path
   applies): nvfp4's tensor factor (bound 448; per output row for a row-scaled a), 4/6's, MS-EDEN
   s_dec_a·s_dec_b, and DBQ (TetraJet-v2) one block-scaled GEMM per 128-chunk of K, each rescaled by
   its outer scales outer_a[m, c]·outer_b[n, c] and summed in order (``dbq.chunked_gemm``): the outer scale varies
   along both M and N within a chunk, so it fits neither the E4M3 block scale (not exact) nor one
   epilogue factor (not separable). MXFP8 has no second level.

The products are exact in hardware and in the twin, so the result equals the XLA path up to the
order of the float32 sums (bit for bit on the CPU, where the twin is the XLA path's GEMM).

The grouped GEMM of the MoE experts (``fp4jax.gemm.grouped_matmul(_t)``, impl="native") uses steps 1
and 2 on work items: ``grouped_rows`` / ``grouped_tokens`` at the bottom (the section's note says how); the rows
form has a second kernel, fp4jax's grouped Mosaic GEMM (``grouped_rows_mosaic``: each expert's weight read in
place, step 3 inside), where ``dispatch.native_kernel(grouped=True)`` picks "mosaic" (its own proof).

Not native: MXFP4 (jax 0.10.2's XLA does not take E2M1 with E8M0 scales per 32 into cuDNN on sm_100:
it compiles a float32 dequantize and a float32 cuBLASLt GEMM, slower than the bf16 XLA path) and
per-tensor/128-block FP8 (float32 scales, no block-scaled GEMM takes them). ``matmul`` raises for them,
naming impl="xla".
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _native_compat as nc
from fp4jax import epilogue, formats, reference, tiles
from fp4jax.kernels import mosaic_gemm
from fp4jax.numerics import dbq, mxfp8
from fp4jax.primitives import matmul as primitive_matmul
from fp4jax.qtensor import QTensor, validate

NVFP4_FORMATS = ("nvfp4", "nvfp4_eden", "nvfp4_dbq")   # E2M1 codes, E4M3 scales per 16
MX_FORMATS = ("mxfp8",)                                 # E4M3 elements, E8M0 scales per 32
FORMATS = NVFP4_FORMATS + MX_FORMATS
BLOCK = 16        # NVFP4's block (MXFP8's: mxfp8.BLOCK, 32)
NATIVE_KERNELS = ("cudnn", "mosaic")   # the two GEMMs behind impl="native" (``matmul``'s kernel)


class Operand(NamedTuple):
  """One operand of the block-scaled GEMM: values (R, K) and scales (R, K/blk), row-major. NVFP4:
  float4_e2m1fn (uint8 codes 0..15 before ``as_native``) with float8_e4m3fn per 16; MXFP8: float8_e4m3fn
  with float8_e8m0fnu per 32. Leading batch axes allowed."""
  values: object
  scales: object

  @property
  def mx(self) -> bool:
    """Whether this is an MXFP8 operand (E8M0 scales)."""
    return self.scales.dtype == jnp.float8_e8m0fnu

  @property
  def block(self) -> int:
    return mxfp8.BLOCK if self.mx else BLOCK


def _check_format(a: QTensor):
  if a.fmt not in FORMATS:
    why = {"mxfp4": "this jax's XLA compiles E2M1 with E8M0 scales per 32 to a float32 dequantize and "
                    "a float32 GEMM on sm_100, not the block-scaled tensor cores",
           "fp8": "its scales are float32 per 128 elements, which no block-scaled GEMM takes"
           }.get(a.fmt, "it is not a block-scaled format")
    raise ValueError(f"impl='native' takes {FORMATS}; fmt={a.fmt!r} has no native GEMM here ({why}); "
                     "use impl='xla'")


def check(a: QTensor, b: QTensor, *, ndim: int = 2, where: str = "fp4jax.native.matmul"):
  """Raise ValueError unless the pair can run natively: one format of ``FORMATS``, ``ndim``-D (a leading
  chunk or group axis for the grouped GEMM), along K."""
  _check_format(a)
  for name, q in (("lhs", a), ("rhs", b)):
    validate(q, f"{where} ({name})")
    if q.axis != -1 or q.ndim != ndim:
      raise ValueError(f"impl='native' contracts the last axis of two {ndim}-D operands quantized along "
                       f"it; the {name} has shape {q.shape} quantized along axis {q.axis}")
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f"scaled_matmul contraction mismatch: a (M, K)={a.shape}, b (N, K)={b.shape}")
  if b.row_scaled:
    raise ValueError("impl='native' takes a row-scaled nvfp4 lhs only (one amax per output row); the "
                     "rhs has one amax per row too, which no GEMM factor can apply; quantize the rhs "
                     "with one tensor amax")


def codes_operand(q: QTensor) -> Operand:
  """``operand`` with NVFP4's E2M1 codes still uint8 (0..15): what the grouped GEMM gathers and masks.
  MXFP8's elements are float8_e4m3fn already."""
  if q.fmt in MX_FORMATS:
    return Operand(q.data, q.scale)
  return Operand(reference.codes_of(q), reference.block_scales(q))


def as_native(op: Operand) -> Operand:
  """The GEMM's dtypes: uint8 E2M1 codes as float4_e2m1fn (bit for bit); MXFP8's values as they are."""
  if op.values.dtype != jnp.uint8:
    return op
  return Operand(nc.to_float4(op.values), op.scales)


def operand(q: QTensor) -> Operand:
  """The block-scaled layout of a QTensor quantized along its last axis (module docstring, 1). NVFP4's codes
  are packed along that axis, two to a byte, which is float4_e2m1fn's own layout: the values are the packed
  bytes bitcast (``_native_compat.packed_float4``), no pass over them."""
  if q.fmt in MX_FORMATS:
    return codes_operand(q)
  return Operand(nc.packed_float4(q.data), reference.block_scales(q))


def decode(op: Operand):
  """The float32 block products v·s of an operand (R, K) (exact; the twin GEMM's inputs). MXFP8:
  ``numerics.mxfp8.dequantize``, the XLA path's values."""
  if op.mx:
    return mxfp8.dequantize(mxfp8.Mxfp8(op.values, lax.bitcast_convert_type(op.scales, jnp.uint8)))
  vals = op.values.astype(jnp.float32)
  return vals * jnp.repeat(op.scales.astype(jnp.float32), BLOCK, axis=-1)


def _twin_operands(a_vals, b_vals, a_scales, b_scales):
  """The twin GEMM's operands: NVFP4's exact products in bf16; MXFP8's values in float32 (the XLA path's
  CPU GEMM, ``numerics.mxfp8.gemm``)."""
  a, b = Operand(a_vals, a_scales), Operand(b_vals, b_scales)
  dtype = jnp.float32 if a.mx else jnp.bfloat16
  return decode(a).astype(dtype), decode(b).astype(dtype)


def _twin(a_vals, b_vals, a_scales, b_scales):
  """The block-scaled GEMM off the GPU: the exact products, float32 accumulation."""
  a_, b_ = _twin_operands(a_vals, b_vals, a_scales, b_scales)
  return lax.dot_general(a_, b_, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def _twin_batched(a_vals, b_vals, a_scales, b_scales):
  """The batched block-scaled GEMM off the GPU: (B, M, K) · (B, N, K) -> (B, M, N), as ``_twin``."""
  a_, b_ = _twin_operands(a_vals, b_vals, a_scales, b_scales)
  return lax.dot_general(a_, b_, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def block_scaled_matmul(a: Operand, b: Operand):
  """float32 (M, N) = Σ_k (v·s)_a[m, k] (v·s)_b[n, k]: the hardware's on CUDA, the twin elsewhere."""
  return lax.platform_dependent(a.values, b.values, a.scales, b.scales,
                                cuda=nc.block_scaled_matmul, default=_twin)


def batched_block_scaled_matmul(a: Operand, b: Operand):
  """float32 (B, M, N): ``block_scaled_matmul`` of each of B pairs (one batched GEMM on CUDA)."""
  return lax.platform_dependent(a.values, b.values, a.scales, b.scales,
                                cuda=nc.batched_block_scaled_matmul, default=_twin_batched)


def _dbq(a: QTensor, b: QTensor, oa: Operand, ob: Operand):
  per = dbq.OUTER // BLOCK

  def part(c):
    k, s = slice(c * dbq.OUTER, (c + 1) * dbq.OUTER), slice(c * per, (c + 1) * per)
    return block_scaled_matmul(Operand(oa.values[:, k], oa.scales[:, s]),
                               Operand(ob.values[:, k], ob.scales[:, s]))
  return dbq.chunked_gemm(part, lambda c: a.scale2[:, c][:, None], lambda c: b.scale2[:, c][None, :],
                          a.scale2.shape[-1])


def mosaic_takes(a: QTensor, b: QTensor, out_dtype) -> bool:
  """Whether fp4jax's Mosaic GPU GEMM (``kernels.mosaic_gemm``) computes this pair: plain nvfp4 (one tensor
  amax each, bound 448: its epilogue is ``reference.tensor_factor_parts``), a bf16 or float32 result."""
  return (a.fmt == b.fmt == "nvfp4" and a.bound == b.bound == formats.NVFP4_BOUND and not a.row_scaled
          and jnp.dtype(out_dtype) in map(jnp.dtype, mosaic_gemm.OUT_DTYPES))


def matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, kernel: str = "cudnn"):
  """a (M, K) · b (N, K)ᵀ -> (M, N) on the block-scaled GEMM, the format's second level applied to the
  float32 result as the XLA path applies it (``fp4jax.epilogue``).

  kernel: "cudnn" (``jax.nn.scaled_matmul``, then the epilogue as an XLA pass) or "mosaic" (fp4jax's
  tcgen05 kernel with the epilogue and the cast inside, ``kernels.mosaic_gemm``, as the partitioned op
  ``primitives.matmul.mosaic_matmul``: on a mesh each device runs it on its shards) where ``mosaic_takes``
  the pair, else cuDNN's. ``dispatch.native_kernel`` says which one impl=None runs."""
  if kernel not in NATIVE_KERNELS:
    raise ValueError(f"kernel={kernel!r}; one of {NATIVE_KERNELS}")
  check(a, b)
  if kernel == "mosaic" and mosaic_takes(a, b, out_dtype):
    return primitive_matmul.mosaic_matmul(a, b, out_dtype=out_dtype)
  oa, ob = operand(a), operand(b)
  if a.fmt == "nvfp4_dbq":
    return _dbq(a, b, oa, ob).astype(out_dtype)
  return epilogue.apply(block_scaled_matmul(oa, ob), a, b).astype(out_dtype)


# ---------------------------------------------------------------------------------------------------
# The grouped GEMM: S sorted rows in groups of traced sizes (fp4jax.gemm.grouped_matmul, impl="native")
# ---------------------------------------------------------------------------------------------------
# Axis legend: S sorted rows, E groups, T rows per tile, W = S/T + E - 1 work items, K, N as above.
# jax 0.10.2 has no ragged block-scaled GEMM (``lax.ragged_dot`` takes no scales, ``jax.nn.scaled_matmul``
# has a batch axis only), so a traced size is met with a static count of work items: the S rows are cut
# into tiles of T rows and at every group end, and each piece [lo, hi) (inside one tile and one group)
# is one batch element of one batched block-scaled GEMM of its tile's T rows with its group's operand.
# T = S is one tile: each group's GEMM over all S rows (the padding of every group to S); smaller T
# wastes at most E - 1 tiles of rows instead (``grouped_tile``, chosen in docs/DESIGN.md, issue 31). The
# tiling is ``fp4jax.tiles``'s, shared with the XLA path's tiled GEMM.

Items, Tiling, items = tiles.Items, tiles.Tiling, tiles.items
TILING = tiles.TILING   # the tiling of the native grouped GEMM (bench/predict/moe_gpu_aot.py and the tests set it)


def grouped_tile(s: int, n_groups: int, rows: int, tiling: Tiling | None = None) -> int:
  """T for S sorted rows in ``n_groups`` groups whose sizes are multiples of ``rows`` (``TILING``)."""
  return tiles.grouped_tile(s, n_groups, rows, TILING if tiling is None else tiling)


def _pad_rows(op: Operand, s: int, axis: int) -> Operand:
  """op with its rows (values along ``axis``) zero-padded to s; MXFP8's scales with byte 0 (a float 0
  cast to float8_e8m0fnu is its NaN byte 0xFF, which would poison the zero rows' products)."""
  per = 1 if axis == 0 else op.block
  scales = op.scales
  if op.mx:
    raw = tiles.pad_rows(lax.bitcast_convert_type(scales, jnp.uint8), s // per, axis)
    scales = lax.bitcast_convert_type(raw, scales.dtype)
  else:
    scales = tiles.pad_rows(scales, s // per, axis)
  return Operand(tiles.pad_rows(op.values, s, axis), scales)


def grouped_rows(a: Operand, b: Operand, sizes_E, tile: int):
  """float32 (S, N): row r of a (S, K) times b[e] (N, K)ᵀ for r in group e; zero past the last group.
  a, b with uint8 codes (``codes_operand``); one batched block-scaled GEMM of W items (section note)."""
  s, n_g = a.values.shape[0], b.values.shape[0]
  s_pad = -(-s // tile) * tile
  a = _pad_rows(a, s_pad, 0)
  n_t = s_pad // tile
  it = items(sizes_E, s_pad, tile)
  if n_t == 1:   # item i is group i, over every row
    tiles_a, tiles_b = Operand(*(jnp.broadcast_to(t, (n_g, *t.shape)) for t in a)), b
  else:
    tiles_a = Operand(*(t.reshape(n_t, tile, -1)[it.tile] for t in a))
    tiles_b = Operand(*(t[it.group] for t in b))
  out_WxTxN = batched_block_scaled_matmul(as_native(tiles_a), as_native(tiles_b))
  return tiles.pick_rows(out_WxTxN, it, sizes_E, s, tile)


def local_trace() -> bool:
  """Whether this trace computes one device's arrays: no mesh, or inside a ``shard_map`` manual over every mesh
  axis of size > 1 (the experts' shard_map, ``models.expert_parallel``). A kernel without a partitioning rule
  (the grouped Mosaic GEMM) runs there as it is; under an automatic (GSPMD) ``jax.set_mesh`` mesh XLA would
  gather its operands to every device instead."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or all(size == 1 or name in mesh.manual_axes for name, size in mesh.shape.items())


def mosaic_grouped_takes(a: QTensor, b: QTensor, out_dtype, s: int, tile: int) -> bool:
  """Whether fp4jax's Mosaic GPU grouped GEMM (``kernels.mosaic_gemm.mosaic_grouped_gemm``) computes the rows GEMM
  of this pair here: the pairs ``mosaic_takes`` (plain nvfp4, one factor per group), with row tiles of whole
  tensor-core scale tiles (T a multiple of 128) or one row tile of all S rows, in a ``local_trace``."""
  return (mosaic_takes(a, b, out_dtype) and (tile >= s or tile % mosaic_gemm.SCALE_ROWS == 0)
          and local_trace())


def grouped_rows_mosaic(a: Operand, b: Operand, factor_E, sizes_E, tile: int, *, out_dtype, fill_S=None):
  """(S, N) ``out_dtype``: row r of a (S, K) times b[e] (N, K)ᵀ for r in group e, times group e's factor
  (``reference.apply_factor_parts`` of factor_E[e]), cast; ``fill_S`` (or zero) past the last group. a, b
  packed (``operand``: float4_e2m1fn, b (E, N, K)); fp4jax's Mosaic GPU grouped GEMM of the work items (its twin
  off CUDA), which reads each expert's weight as it is and applies the factor and the cast inside, then the
  rows picked from its (W, T, N) result (``tiles.pick_rows``). ``grouped_rows`` with the epilogue applied, bit
  for bit on the CPU."""
  s = a.values.shape[0]
  it = items(sizes_E, -(-s // tile) * tile, tile)
  out_WxTxN = mosaic_gemm.mosaic_grouped_gemm(a.values, a.scales, b.values, b.scales, factor_E, it.tile, it.group,
                                              tile=tile, out_dtype=out_dtype)
  return tiles.pick_rows(out_WxTxN, it, sizes_E, s, tile, fill_S)


def grouped_tokens(a: Operand, b: Operand, sizes_E, tile: int):
  """float32 (E, K, N): per group e, a's columns of e (K, size_e) times b's (N, size_e)ᵀ; a (K, S),
  b (N, S) quantized along the S sorted rows (the contraction; wgrad). The items' rows outside their
  piece are masked: NVFP4 by zero block scales (every piece boundary is a multiple of the 16-row
  block), MXFP8 by zero elements (E8M0 has no zero; its smallest scale is 2^-127). A group's items are
  summed in order (``jax.ops.segment_sum`` on sorted indices; one item per group when T = S)."""
  s, n_g = a.values.shape[-1], sizes_E.shape[0]
  s_pad = -(-s // tile) * tile
  a, b = _pad_rows(a, s_pad, 1), _pad_rows(b, s_pad, 1)
  n_t = s_pad // tile
  it = items(sizes_E, s_pad, tile)
  split = lambda t, per: jnp.swapaxes(t.reshape(t.shape[0], n_t, tile // per), 0, 1)   # (n_t, R, T/per)
  if n_t == 1:
    pick = lambda t, per: jnp.broadcast_to(split(t, per), (n_g, t.shape[0], tile // per))
  else:
    pick = lambda t, per: split(t, per)[it.tile]
  blk = a.block
  values_a, scales_a = pick(a.values, 1), pick(a.scales, blk)
  if a.mx:
    keep_WxT = tiles.keep_rows(it, tile)
    values_a = jnp.where(keep_WxT[:, None, :], values_a, jnp.zeros((), values_a.dtype))
  else:
    keep_WxB = tiles.keep_rows(it, tile, blk)
    scales_a = jnp.where(keep_WxB[:, None, :], scales_a, jnp.zeros((), scales_a.dtype))
  tiles_a = Operand(values_a, scales_a)
  tiles_b = Operand(pick(b.values, 1), pick(b.scales, blk))
  part_WxKxN = batched_block_scaled_matmul(as_native(tiles_a), as_native(tiles_b))
  return tiles.sum_groups(part_WxKxN, it, n_g, n_t)
