"""The native GEMM: a pair of NVFP4-family QTensors on the hardware's block-scaled tensor cores.

``fp4jax.gemm.matmul(a, b, impl="native")`` lands here (and impl=None on a GPU of compute
capability 10.x, ``fp4jax.primitives.impl.default_gemm_backend``). Three steps:

1. ``operand(q)``: a (R, K) QTensor quantized along K becomes the block-scaled layout: its E2M1 codes
   as float4_e2m1fn (R, K), and its E4M3 scales per 1x16 along K, (R, K/16). A 16x16-tiled weight's
   scale is repeated over the tile's 16 rows (the same product e2m1·s for every element); the dgrad
   weight is the fprop tiles transposed (``fp4jax.transpose_tiles``: codes and scales only), and the
   RHT'd, stochastically rounded wgrad operands are taken as they are (quantized along the tokens,
   which is the GEMM's K). No value is re-rounded: every e2m1·s is the QTensor's own.
2. ``block_scaled_matmul``: Σ_k (e2m1·s)_a (e2m1·s)_b in float32, ``jax.nn.scaled_matmul`` on CUDA
   (cuDNN's ``__cudnn$blockScaledDot`` on sm_100). Elsewhere (the CPU) its twin: the same products,
   exact in bfloat16, one bf16 GEMM with float32 accumulation, which is the XLA path's GEMM.
3. The format's second level on the float32 result, ``fp4jax.epilogue`` (the one the XLA path
   applies): nvfp4's tensor factor (bound 448; per output row for a row-scaled a), 4/6's, MS-EDEN
   s_dec_a·s_dec_b, and DBQ (TetraJet-v2) one block-scaled GEMM per 128-chunk of K, each rescaled by
   its outer scales outer_a[m, c]·outer_b[n, c] and summed in order (``dbq.chunked_gemm``): the outer scale varies
   along both M and N within a chunk, so it fits neither the E4M3 block scale (not exact) nor one
   epilogue factor (not separable).

The products are exact in hardware and in the twin, so the result equals the XLA path up to the
order of the float32 sums (bit for bit on the CPU, where the twin is the XLA path's GEMM).

The grouped GEMM of the MoE experts (``fp4jax.gemm.grouped_matmul(_t)``, impl="native") uses steps 1
and 2 on work items: ``grouped_rows`` / ``grouped_tokens`` at the bottom (the section's note says how).

Not native: MXFP4 (jax 0.10.2's XLA does not take E2M1 with E8M0 scales per 32 into cuDNN on sm_100:
it compiles a float32 dequantize and a float32 cuBLASLt GEMM, slower than the bf16 XLA path), MXFP8
and per-tensor/128-block FP8 (not FP4). ``matmul`` raises for them, naming impl="xla".
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _native_compat as nc
from fp4jax import epilogue, reference, tiles
from fp4jax.numerics import dbq
from fp4jax.qtensor import QTensor, validate

FORMATS = ("nvfp4", "nvfp4_eden", "nvfp4_dbq")   # the formats with E2M1 codes and E4M3 scales per 16
BLOCK = 16


class Operand(NamedTuple):
  """One operand of the block-scaled GEMM: values float4_e2m1fn (R, K), scales float8_e4m3fn (R, K/16)."""
  values: object
  scales: object


def _check_format(a: QTensor):
  if a.fmt not in FORMATS:
    why = {"mxfp4": "this jax's XLA compiles E2M1 with E8M0 scales per 32 to a float32 dequantize and "
                    "a float32 GEMM on sm_100, not the block-scaled tensor cores",
           "mxfp8": "it is an FP8 format (its native GEMM is not built)",
           "fp8": "it is an FP8 format"}.get(a.fmt, "it is not an E2M1/E4M3 format")
    raise ValueError(f"impl='native' takes {FORMATS}; fmt={a.fmt!r} has no native GEMM here ({why}); "
                     "use impl='xla'")


def check(a: QTensor, b: QTensor, *, ndim: int = 2, where: str = "fp4jax.native.matmul"):
  """Raise ValueError unless the pair can run natively: one NVFP4-family format, ``ndim``-D (a leading
  chunk or group axis for the grouped GEMM), along K."""
  _check_format(a)
  for name, q in (("lhs", a), ("rhs", b)):
    validate(q, f"{where} ({name})")
    if q.axis != -1 or q.ndim != ndim:
      raise ValueError(f"impl='native' contracts the last axis of two {ndim}-D operands quantized along "
                       f"it; the {name} has shape {q.shape} quantized along axis {q.axis}")
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f"scaled_matmul contraction mismatch: a (M, K)={a.shape}, b (N, K)={b.shape}")
  if _row_scaled(b):
    raise ValueError("impl='native' takes a row-scaled nvfp4 lhs only (one amax per output row); the "
                     "rhs has one amax per row too, which no GEMM factor can apply; quantize the rhs "
                     "with one tensor amax")


def _row_scaled(q: QTensor) -> bool:
  """One amax per row (a leading chunk or group axis adds one to both ranks)."""
  return q.fmt == "nvfp4" and q.amax is not None and q.amax.ndim == q.ndim - 1


def codes_operand(q: QTensor) -> Operand:
  """``operand`` with the E2M1 codes still uint8 (0..15): what the grouped GEMM gathers and masks."""
  scales = q.scale
  if q.tile is not None:   # one scale per 16x16 tile: the same scale for each of its 16 rows
    scales = jnp.repeat(scales, q.tile[0], axis=-2)
  return Operand(reference.codes_of(q), scales)


def as_float4(op: Operand) -> Operand:
  return Operand(nc.to_float4(op.values), op.scales)


def operand(q: QTensor) -> Operand:
  """The block-scaled layout of a QTensor quantized along its last axis (module docstring, 1)."""
  return as_float4(codes_operand(q))


def decode(op: Operand):
  """The float32 block products e2m1·s of an operand (R, K) (exact; the twin GEMM's inputs)."""
  vals = op.values.astype(jnp.float32)
  return vals * jnp.repeat(op.scales.astype(jnp.float32), BLOCK, axis=-1)


def _twin(a_vals, b_vals, a_scales, b_scales):
  """The block-scaled GEMM off the GPU: the exact products in bf16, float32 accumulation."""
  a16 = decode(Operand(a_vals, a_scales)).astype(jnp.bfloat16)
  b16 = decode(Operand(b_vals, b_scales)).astype(jnp.bfloat16)
  return lax.dot_general(a16, b16, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def _twin_batched(a_vals, b_vals, a_scales, b_scales):
  """The batched block-scaled GEMM off the GPU: (B, M, K) · (B, N, K) -> (B, M, N), as ``_twin``."""
  a16 = decode(Operand(a_vals, a_scales)).astype(jnp.bfloat16)
  b16 = decode(Operand(b_vals, b_scales)).astype(jnp.bfloat16)
  return lax.dot_general(a16, b16, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def block_scaled_matmul(a: Operand, b: Operand):
  """float32 (M, N) = Σ_k (e2m1·s)_a[m, k] (e2m1·s)_b[n, k]: the hardware's on CUDA, the twin elsewhere."""
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


def matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32):
  """a (M, K) · b (N, K)ᵀ -> (M, N) on the block-scaled GEMM, the format's second level applied to the
  float32 result as the XLA path applies it (``fp4jax.epilogue``)."""
  check(a, b)
  oa, ob = operand(a), operand(b)
  if a.fmt == "nvfp4_dbq":
    return _dbq(a, b, oa, ob).astype(out_dtype)
  return epilogue.apply(block_scaled_matmul(oa, ob), a, b).astype(out_dtype)


scaled_matmul = matmul   # former name


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
TILING = tiles.TILING   # the tiling of the native grouped GEMM (bench/moe_gpu_aot.py and the tests set it)


def grouped_tile(s: int, n_groups: int, rows: int, tiling: Tiling | None = None) -> int:
  """T for S sorted rows in ``n_groups`` groups whose sizes are multiples of ``rows`` (``TILING``)."""
  return tiles.grouped_tile(s, n_groups, rows, TILING if tiling is None else tiling)


def _pad_rows(op: Operand, s: int, axis: int) -> Operand:
  """op with its rows (values along ``axis``) zero-padded to s."""
  per = 1 if axis == 0 else BLOCK
  return Operand(tiles.pad_rows(op.values, s, axis), tiles.pad_rows(op.scales, s // per, axis))


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
  out_WxTxN = batched_block_scaled_matmul(as_float4(tiles_a), as_float4(tiles_b))
  return tiles.pick_rows(out_WxTxN, it, sizes_E, s, tile)


def grouped_tokens(a: Operand, b: Operand, sizes_E, tile: int):
  """float32 (E, K, N): per group e, a's columns of e (K, size_e) times b's (N, size_e)ᵀ; a (K, S),
  b (N, S) quantized along the S sorted rows (the contraction; wgrad). The items' rows outside their
  piece are masked by zero block scales (every piece boundary is a multiple of the 16-row block); a
  group's items are summed in order (``jax.ops.segment_sum`` on sorted indices; one item per group
  when T = S)."""
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
  keep_WxB = tiles.keep_rows(it, tile, BLOCK)
  scales_a = jnp.where(keep_WxB[:, None, :], pick(a.scales, BLOCK), jnp.zeros((), a.scales.dtype))
  tiles_a = Operand(pick(a.values, 1), scales_a)
  tiles_b = Operand(pick(b.values, 1), pick(b.scales, BLOCK))
  part_WxKxN = batched_block_scaled_matmul(as_float4(tiles_a), as_float4(tiles_b))
  return tiles.sum_groups(part_WxKxN, it, n_g, n_t)
