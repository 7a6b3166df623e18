"""One GEMM for any pair of QTensors, and the grouped GEMM of mixture-of-experts layers:

  matmul(a, b)                          a (M, K) · b (N, K)ᵀ -> (M, N), both quantized along K
  grouped_matmul(a_U, b_E, groups)      rows of group e times b[e]: (S, N), the rows ragged (fprop, dgrad)
  grouped_matmul_t(a_U, b_U, groups)    per group a_eᵀ-side · b_e along its rows: (E, K, N) (wgrad)

Every path multiplies the exact block products (``epilogue.products``) with float32 accumulation and then
applies the format's second level, ``fp4jax.epilogue`` (DBQ: ``dbq.chunked_gemm``, one rescale per
128-chunk of K).

impl (``fp4jax.dispatch``, the switch of every op; resolved once, by ``dispatch.choose``):
  "xla"     the block products in bf16 (exact), one bf16 GEMM with float32 accumulation, the epilogue:
              nvfp4 (bound 448) and mxfp4: ``fp4jax.scaled_matmul`` (the primitive); fp8 its reference;
              4/6, MS-EDEN, DBQ, MXFP8 and row-scaled nvfp4 (the factor per output row): here
              (MXFP8's dequantized values in float32 on the CPU, in bf16 on a GPU target: ``mxfp8.gemm``)
  "pallas"  the Triton kernels (nvfp4 with bound 448, mxfp4: ``formats.KERNEL_FORMATS``)
  "native"  the hardware's block-scaled GEMM (``fp4jax.native``: nvfp4, 4/6, MS-EDEN, DBQ, MXFP8; on CUDA
            ``jax.nn.scaled_matmul``, cuDNN on sm_100; its exact twin elsewhere)
  None      the default, ``dispatch.choose("scaled_matmul", fmt)``: "native" for those formats on a GPU of
            compute capability 10.x (``dispatch.NATIVE_DEFAULTS``); else "xla" unless a device run put
            a Pallas GEMM in ``dispatch.VERIFIED_KERNELS``. FP4JAX_DEFAULT_IMPL=xla|pallas|native overrides.

The grouped GEMM (``Groups``: traced (E,) group sizes, each a multiple of A rows) takes its operands in
chunks of A rows, each chunk inside one group: a_U (U, A, K) with a second level per chunk (its group's),
b_E (E, N, K) one per group. It is ``lax.ragged_dot`` (the rows ragged) or ``lax.ragged_dot_general``
(the contraction ragged) on the exact products with impl="xla" (on a GPU target their tiled form,
``fp4jax.tiles``: ``on_gpu_target``); with impl="native" the block-scaled GEMM
of ``fp4jax.native``'s work items (pieces of 1024-row tiles inside one group, one batched
``jax.nn.scaled_matmul``: ``native.grouped_rows`` / ``grouped_tokens``; the rows form of plain nvfp4 on fp4jax's
grouped Mosaic GEMM, the factor and the cast inside, where ``dispatch.native_kernel(grouped=True)`` picks "mosaic":
forced or proved, never by default); then the epilogue of each
output's pair, the same for both. DBQ's wgrad runs a ``lax.scan`` over the chunks of rows, adding each
into its group's sum in order. Rows past the last group give zeros. impl=None: "native" where the dense
GEMM's default is native (``dispatch.choose("grouped_matmul", fmt)``: compute capability 10.x), else "xla".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _native_compat as nc
from fp4jax import api, dispatch, epilogue, formats, native, reference, target, tiles
from fp4jax.numerics import dbq, mxfp8
from fp4jax.qtensor import QTensor, validate

IMPLS = dispatch.IMPLS
_bf16_products = epilogue.products


def _contract(a_bf16, b_bf16):
  return lax.dot_general(a_bf16, b_bf16, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def _xla_only(a: QTensor, b: QTensor):
  """float32 (M, N) for the pairs ``fp4jax.scaled_matmul`` does not take (see the module docstring)."""
  fmt = a.fmt
  if fmt in ("nvfp4", "nvfp4_eden"):       # Four Over Six on one or both operands; MS-EDEN
    return epilogue.apply(_contract(_bf16_products(a), _bf16_products(b)), a, b)
  if fmt == "nvfp4_dbq":
    codes = lambda q: reference.codes_of(q)
    return dbq.gemm(dbq.Dbq(codes(a), a.scale, a.scale2), dbq.Dbq(codes(b), b.scale, b.scale2))
  if fmt == "mxfp8":   # on a GPU target in bf16 (the same values for every block of scale byte >= 3)
    as_mx = lambda q: mxfp8.Mxfp8(q.data, lax.bitcast_convert_type(q.scale, jnp.uint8))
    return mxfp8.gemm(as_mx(a), as_mx(b), operand_dtype=jnp.bfloat16 if on_gpu_target() else jnp.float32)
  raise ValueError(f"no GEMM for fmt={fmt!r}")


def on_gpu_target() -> bool:
  """Whether the program is compiled for a GPU (``fp4jax.target.current()``), where XLA:GPU lowers a
  float32 GEMM at HIGHEST to its float32 units and a ragged dot to a dense one (E times the FLOPs and the
  output's bytes): there the float GEMMs with ragged rows run tiled (``fp4jax.tiles``: the work items of
  row tiles, one batched dot); elsewhere (the CPU) as ``lax.ragged_dot``, the twin the tiles are tested
  against. Not a switch: the target decides."""
  return target.current().platform in ("gpu", "cuda", "rocm")


def _check(a, b):
  if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
    raise TypeError("fp4jax.gemm.matmul takes two QTensors; got "
                    f"{type(a).__name__} and {type(b).__name__}")
  if a.fmt != b.fmt:
    raise ValueError(f"scaled_matmul operands must share a format; got {a.fmt!r} and {b.fmt!r}")


def _pallas_takes(a: QTensor, b: QTensor) -> bool:
  """Whether the Pallas GEMMs compute this pair (``_dense`` refuses impl="pallas" for the others)."""
  return (not (a.row_scaled and not b.row_scaled) and a.fmt in formats.NAMES
          and a.bound == b.bound == formats.NVFP4_BOUND)


def _dense(a: QTensor, b: QTensor, out_dtype, impl):
  if impl == "native":
    return native.matmul(a, b, out_dtype=out_dtype, kernel=dispatch.native_kernel(a.fmt))
  if a.row_scaled and not b.row_scaled:   # row-scaled activations: the factor per output row
    if impl == "pallas":
      raise ValueError("there are no Pallas kernels for row-scaled nvfp4; use impl='xla'")
    validate(a, "fp4jax.gemm.matmul (lhs)")
    validate(b, "fp4jax.gemm.matmul (rhs)", scalar_amax=True)
    return epilogue.apply(_contract(_bf16_products(a), _bf16_products(b)), a, b).astype(out_dtype)
  if a.fmt in formats.NAMES and a.bound == b.bound == formats.NVFP4_BOUND:
    return api.scaled_matmul(a, b, out_dtype=out_dtype, impl=impl)
  if impl == "pallas":
    raise ValueError(f"there are no Pallas kernels for fmt={a.fmt!r}"
                     + (" with the 4/6 bound" if a.fmt == "nvfp4" else "") + "; use impl='xla'")
  validate(a, "fp4jax.gemm.matmul (lhs)", scalar_amax=True)
  validate(b, "fp4jax.gemm.matmul (rhs)", scalar_amax=True)
  if a.axis != -1 or b.axis != -1 or a.ndim != 2 or b.ndim != 2 or a.shape[-1] != b.shape[-1]:
    raise ValueError(f"scaled_matmul contracts the last axis of two 2-D operands; got shapes {a.shape}, "
                     f"{b.shape} quantized along axes {a.axis}, {b.axis}")
  return _xla_only(a, b).astype(out_dtype)


def matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, impl: str | None = None):
  """a (M, K) · b (N, K)ᵀ -> (M, N) in ``out_dtype`` for any pair of QTensors of one format quantized
  along K (the module docstring has the impls)."""
  _check(a, b)
  chosen = dispatch.choose("scaled_matmul", a.fmt, impl)
  if impl is None and chosen == "pallas" and not _pallas_takes(a, b):   # the default: a kernel only where one is
    chosen = "xla"
  impl = chosen
  out_dtype = api.as_float_dtype(out_dtype, "fp4jax.gemm.matmul", "out_dtype")
  return _dense(a, b, out_dtype, impl)


# ---------------------------------------------------------------------------------------------------
# The grouped GEMM: traced group sizes, operands in chunks of A rows
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("sizes", "group", "offset", "valid"),
                   meta_fields=("rows",))
@dataclasses.dataclass(frozen=True)
class Groups:
  """Where each chunk of A rows of S sorted rows belongs (U = S / A chunks)."""
  sizes: Any     # (E,) int32: rows of each group (multiples of A)
  group: Any     # (U,) int32: the group of each chunk (the last one for chunks past the groups)
  offset: Any    # (U,) int32: the chunk's first row inside its group
  valid: Any     # (U,) bool: inside a group
  rows: int      # A

  @property
  def group_of_row(self):
    return jnp.repeat(self.group, self.rows)

  def inside(self, t_SxC):
    """t with the rows past the last group set to zero."""
    return jnp.where(jnp.repeat(self.valid, self.rows)[:, None], t_SxC, jnp.zeros((), t_SxC.dtype))

  def per_group(self, v_U):
    """(E,) each group's value from its chunks' (all equal within a group; 1 for empty groups)."""
    n_g = self.sizes.shape[0]
    return jnp.ones((n_g,), jnp.float32).at[jnp.where(self.valid, self.group, n_g)].set(v_U, mode="drop")


def groups(sizes_E, s: int, rows: int) -> Groups:
  """The chunks of ``rows`` rows of s sorted rows, rows [start_e, start_e + sizes_E[e]) in group e."""
  sizes_E = sizes_E.astype(jnp.int32)
  ends_E = jnp.cumsum(sizes_E)
  row0_U = jnp.arange(s // rows, dtype=jnp.int32) * rows
  # one U x E comparison (a single fusion), not the default binary search (a while loop: kernels per trip)
  found_U = jnp.searchsorted(ends_E, row0_U, side="right", method="compare_all")
  group_U = jnp.minimum(found_U, sizes_E.shape[0] - 1)
  group_U = group_U.astype(jnp.int32)
  return Groups(sizes_E, group_U, row0_U - (ends_E - sizes_E)[group_U], row0_U < ends_E[-1], rows)


def _grouped_impl(a: QTensor, b: QTensor, impl, where):
  """impl for the grouped GEMM: "xla" or "native" (``dispatch.choose("grouped_matmul", fmt, impl)``)."""
  impl = dispatch.choose("grouped_matmul", a.fmt, impl)
  if impl == "native":
    native.check(a, b, ndim=3, where=where)
  return impl


def ragged_rows(a_SxK, b_ExKxN, sizes_E, precision=lax.Precision.HIGHEST, out_dtype=jnp.float32):
  """(S, N): rows of group e times b[e] (``tiles.rows`` where ``on_gpu_target``, else ``lax.ragged_dot``),
  float32 accumulation rounded once to ``out_dtype`` (the tiled GEMM writes it: ``tiles.rows``)."""
  if on_gpu_target():
    return tiles.rows(a_SxK, b_ExKxN, sizes_E, precision=precision, out_dtype=out_dtype)
  return lax.ragged_dot(a_SxK, b_ExKxN, sizes_E, precision=precision,
                        preferred_element_type=jnp.float32).astype(out_dtype)


def ragged_tokens(a_SxK, b_SxN, sizes_E, precision=lax.Precision.HIGHEST):
  """float32 (E, K, N): per group, its rows of a contracted with its rows of b (``tiles.tokens`` where
  ``on_gpu_target``, else ``lax.ragged_dot_general``)."""
  if on_gpu_target():
    return tiles.tokens(a_SxK, b_SxN, sizes_E, precision=precision)
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return lax.ragged_dot_general(a_SxK, b_SxN, sizes_E, dims, precision=precision,
                                preferred_element_type=jnp.float32)


def _rows_operand(q_U: QTensor, s: int) -> native.Operand:
  """The native operand (S, C) of a chunked QTensor (U, A, C) quantized along C."""
  op = jax.vmap(native.codes_operand)(q_U)
  return native.Operand(op.values.reshape(s, -1), op.scales.reshape(s, -1))


def _tokens_operand(q_U: QTensor) -> native.Operand:
  """The native operand (C, S) of a chunked QTensor (U, C, A) quantized along its rows A."""
  op = jax.vmap(native.codes_operand)(q_U)
  join = lambda t: jnp.swapaxes(t, 0, 1).reshape(t.shape[1], -1)
  return native.Operand(join(op.values), join(op.scales))


def _grouped_rows_mosaic(a_U: QTensor, b_E: QTensor, g: Groups, s: int, tile: int, out_dtype):
  """``grouped_matmul`` of plain nvfp4 on fp4jax's Mosaic GPU grouped GEMM (``native.grouped_rows_mosaic``): the
  tensor factor applied per group inside the kernel, from group e's amaxes (a's: the one its chunks carry, as
  ``fp4jax.grouped`` quantizes each expert's rows with one amax); the rows past the last group get what the
  epilogue gives their zero accumulator with their chunk's amaxes (0, or NaN for a non-finite factor), as the
  other paths do. The packed codes go to the kernel as they are (bitcasts), the weights per expert."""
  a = jax.vmap(native.operand)(a_U)
  a = native.Operand(a.values.reshape(s, -1), a.scales.reshape(s, -1))
  b = jax.vmap(native.operand)(b_E)
  factor_E = epilogue.nvfp4_factor_parts(g.per_group(a_U.amax), b_E.amax)
  fill_U = epilogue.factor(jnp.zeros(a_U.amax.shape, jnp.float32), "nvfp4", a_U.amax, b_E.amax[g.group])
  return native.grouped_rows_mosaic(a, b, factor_E, g.sizes, tile, out_dtype=out_dtype,
                                    fill_S=jnp.repeat(fill_U.astype(out_dtype), g.rows))


def grouped_matmul(a_U: QTensor, b_E: QTensor, g: Groups, *, out_dtype=jnp.float32, impl=None,
                   amax_per_group: bool = False):
  """a (S, K) rows · b[e] (N, K)ᵀ per group -> (S, N); a in chunks (U, A, K), b per group (E, N, K).
  impl: "xla" (``lax.ragged_dot`` of the exact products) or "native" (``native.grouped_rows``: the
  batched block-scaled GEMM of the work items; for plain nvfp4 with ``amax_per_group`` fp4jax's Mosaic grouped
  GEMM instead where ``dispatch.native_kernel(grouped=True)`` picks "mosaic"); None:
  ``dispatch.choose("grouped_matmul", fmt)``.
  amax_per_group: the caller's promise that a's tensor amax is one per group, every chunk of a group (and each
  chunk past the groups, of the last group) carrying its group's, as ``fp4jax.grouped`` quantizes: the Mosaic
  kernel applies the tensor factor per group, not per chunk."""
  impl = _grouped_impl(a_U, b_E, impl, "fp4jax.gemm.grouped_matmul")
  s = a_U.data.shape[0] * a_U.data.shape[1]
  g_S = g.group_of_row
  if impl == "native":
    tile = native.grouped_tile(s, g.sizes.shape[0], g.rows)
    if (amax_per_group and dispatch.native_kernel(a_U.fmt, grouped=True) == "mosaic"
        and native.mosaic_grouped_takes(a_U, b_E, out_dtype, s, tile)):
      return _grouped_rows_mosaic(a_U, b_E, g, s, tile, out_dtype)
    oa, ob = _rows_operand(a_U, s), jax.vmap(native.codes_operand)(b_E)
    per = native.BLOCK

    def acc(k):   # k: a slice of K, a multiple of the 16-block
      ks = slice(None) if k.start is None else slice(k.start // per, k.stop // per)
      return native.grouped_rows(native.Operand(oa.values[:, k], oa.scales[:, ks]),
                                 native.Operand(ob.values[..., k], ob.scales[..., ks]), g.sizes, tile)
  else:
    a_SxK = epilogue.batched_products(a_U).reshape(s, -1)
    b_ExKxN = jnp.swapaxes(epilogue.batched_products(b_E), 1, 2)
    acc = lambda k: ragged_rows(a_SxK[:, k], b_ExKxN[:, k, :], g.sizes)
  if a_U.fmt == "nvfp4_dbq":   # one rescale per 128-chunk of K, the chunks summed in order
    outer_a_SxC = a_U.scale2.reshape(s, -1)
    k = lambda c: slice(c * dbq.OUTER, (c + 1) * dbq.OUTER)
    out = dbq.chunked_gemm(lambda c: acc(k(c)), lambda c: outer_a_SxC[:, c][:, None],
                           lambda c: b_E.scale2[g_S, :, c], outer_a_SxC.shape[-1])
    return out.astype(out_dtype)
  acc = acc(slice(None))
  second_a, second_b = epilogue.second(a_U), epilogue.second(b_E)
  if second_a is None:
    return acc.astype(out_dtype)
  # a's second level: (U,) one per chunk (its group's tensor), or (U, A) row-scaled: one per row
  second_a = (second_a.reshape(s) if second_a.ndim == 2 else jnp.repeat(second_a, g.rows))[:, None]
  return epilogue.factor(acc, a_U.fmt, second_a, second_b[g_S][:, None], a_U.bound, b_E.bound
                         ).astype(out_dtype)


def grouped_matmul_t(a_U: QTensor, b_U: QTensor, g: Groups, *, out_dtype=jnp.float32, impl=None):
  """Per group e: a_e (K, size_e) · b_e (N, size_e)ᵀ -> (E, K, N), both in chunks (U, K, A), (U, N, A)
  quantized along the rows (the contraction; the wgrad GEMM). impl as ``grouped_matmul`` ("native":
  ``native.grouped_tokens``; DBQ: one block-scaled GEMM per 128-chunk of rows)."""
  impl = _grouped_impl(a_U, b_U, impl, "fp4jax.gemm.grouped_matmul_t")
  n_g = g.sizes.shape[0]
  if impl == "native":
    oa = jax.vmap(native.codes_operand)(a_U)
    ob = jax.vmap(native.codes_operand)(b_U)
    chunk = lambda op: (op.values, op.scales)
    part = lambda a_, b_: native.block_scaled_matmul(native.as_native(native.Operand(*a_)),
                                                     native.as_native(native.Operand(*b_)))
    xs_a, xs_b = chunk(oa), chunk(ob)
  else:
    xs_a, xs_b = epilogue.batched_products(a_U), epilogue.batched_products(b_U)
    part = lambda a_KxA, b_NxA: lax.dot_general(a_KxA, b_NxA, (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32,
                                                precision=lax.Precision.HIGHEST)
  if a_U.fmt == "nvfp4_dbq":   # one 128-chunk of rows per step, added into its group's sum in order
    k, n = a_U.shape[1], b_U.shape[1]

    def step(out_ExKxN, inputs):
      a_c, b_c, oa_K, ob_N, e, first, valid = inputs
      term = dbq.chunked_gemm(lambda c: part(a_c, b_c), lambda c: oa_K[:, None], lambda c: ob_N[None, :], 1)
      new = jnp.where(first, term, out_ExKxN[e] + term)
      return out_ExKxN.at[e].set(jnp.where(valid, new, out_ExKxN[e])), None

    outer_a, outer_b = a_U.scale2[..., 0], b_U.scale2[..., 0]   # (U, K), (U, N): one 128-chunk each
    xs = (xs_a, xs_b, outer_a, outer_b, g.group, g.offset == 0, g.valid)
    # Inside shard_map the carry varies over the axes the chunks vary over (the scan's types must match).
    out, _ = lax.scan(step, nc.vary_like(jnp.zeros((n_g, k, n), jnp.float32), xs), xs)
    return out.astype(out_dtype)
  if impl == "native":
    s = a_U.data.shape[0] * g.rows
    acc = native.grouped_tokens(_tokens_operand(a_U), _tokens_operand(b_U), g.sizes,
                                native.grouped_tile(s, n_g, g.rows))
  else:
    s = xs_a.shape[0] * xs_a.shape[2]
    acc = ragged_tokens(jnp.swapaxes(xs_a, 1, 2).reshape(s, -1), jnp.swapaxes(xs_b, 1, 2).reshape(s, -1),
                        g.sizes)
  second_a, second_b = epilogue.second(a_U), epilogue.second(b_U)
  if second_a is None:
    return acc.astype(out_dtype)
  return epilogue.factor(acc, a_U.fmt, g.per_group(second_a)[:, None, None], g.per_group(second_b)[:, None, None],
                         a_U.bound, b_U.bound).astype(out_dtype)
