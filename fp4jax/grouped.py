"""The grouped quantized dot of mixture-of-experts layers: ``grouped_dot(x, w, group_sizes, recipe=, key=)``.

Axis legend: S sorted rows (the tokens of every expert, expert by expert), E experts (groups), K the
contraction, N output features, U chunks of A rows (A = the recipe's token alignment, ``alignment``).

Rows ``[start_e, start_e + group_sizes[e])`` of x (start_e the sum of the sizes before e) are expert e's
tokens, X_e, and ``y[rows of e] = X_e · w[e]``. Each group size is a multiple of A (the caller pads each
expert's segment with zero rows; ``models.moe`` does); rows past the last group give zeros
(y and dx) and are set to zero before any quantization, so they reach no expert's amax. The contract,
forward and backward, bit for bit (tests/test_moe_grouped.py):

  grouped_dot(x, w, sizes, recipe=r, key=k)[rows of e]  ==  fp4jax.dot(X_e, w[e], recipe=r, key=fold_in(k, e))

and the same for dx (rows of e) and dw[e]; an expert without rows gets dw[e] = 0. So each expert is its own
tensor, as ``fp4jax.dot`` sees it: its own amax for every operand (x, w, dy), its weight's 16x16 tiles, its
own stochastic-rounding bits (counters of its own (M_e, N) and (N, M_e) tensors: ``random_bits.Window``),
its own random signs, the RHT and every block along the tokens inside its segment (A is a multiple of each
of them), and ``fp4jax.dot``'s zero padding of M_e to A, which is exact.

How (no loop over experts): the operands are quantized chunk by chunk (U chunks of A rows, each inside one
expert) with fp4jax's own ``Quantizer``s under ``vmap``: each chunk gets its expert's amax (a segment max of
the chunks' amaxes) and its window of its expert's random bits; weights are quantized per expert under
``vmap``. The GEMMs then run on the exact bfloat16 block products (e2m1 · block scale) as one grouped GEMM,
``lax.ragged_dot`` (fprop, dgrad) or ``lax.ragged_dot_general`` with the token axis ragged (wgrad), float32
accumulation, and each output gets the tensor factor of its expert's pair (the second level of the format),
as ``fp4jax.gemm``'s xla backend applies it. TetraJet-v2's double-block format rescales each 128-chunk of
the contraction: fprop and dgrad loop over those chunks (K / 128, static), wgrad runs a ``lax.scan`` over the
token chunks, adding each into its expert's sum in order. The values equal the per-expert dots where both
sum in float32 in the same order; on the CPU that holds (the test). On a GPU the grouped GEMM's summation
order is the kernel's (``lax.ragged_dot``), as a dense dot's is cuBLAS's.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import formats, random_bits, reference
from fp4jax.dot import (MISSING_KEY_MESSAGE, MISSING_KEY_REASON_MESSAGE, _as_recipe, _gemm_keys,
                        _values)
from fp4jax._exact import product
from fp4jax.api import transpose_tiles
from fp4jax.numerics import dbq, four_over_six as fos, hadamard
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import TRANSPOSED, Quantizer, Roles

SUPPORTED = ("nvfp4", "nvfp4_eden", "nvfp4_dbq", "mxfp4")   # the formats of nvfp4, mxfp4, quartet2, tetrajet2


def alignment(recipe) -> int:
  """A: the multiple every group size must be (the token axis ``fp4jax.dot`` pads M to); 1 unquantized."""
  roles = _as_recipe(recipe).roles   # noqa: SLF001 (fp4jax's own recipe parsing)
  return roles.alignment()[0] if roles.quantizes_anything else 1


# ---------------------------------------------------------------------------------------------------
# Where each chunk of A rows belongs
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("sizes", "expert", "offset", "valid"),
                   meta_fields=("rows",))
@dataclasses.dataclass(frozen=True)
class _Chunks:
  sizes: Any     # (E,) int32: rows of each expert (multiples of A)
  expert: Any    # (U,) int32: the expert of each chunk (the last one for chunks past the groups)
  offset: Any    # (U,) int32: the chunk's first row inside its expert's tensor
  valid: Any     # (U,) bool: inside a group
  rows: int      # A

  @property
  def expert_of_row(self):
    return jnp.repeat(self.expert, self.rows)

  def inside(self, t_SxC):
    """t with the rows past the last group set to zero: they reach no expert's quantization (amax)."""
    return jnp.where(jnp.repeat(self.valid, self.rows)[:, None], t_SxC, jnp.zeros((), t_SxC.dtype))


def _chunks(sizes_E, s: int, a: int) -> _Chunks:
  sizes_E = sizes_E.astype(jnp.int32)
  ends_E = jnp.cumsum(sizes_E)
  row0_U = jnp.arange(s // a, dtype=jnp.int32) * a
  expert_U = jnp.minimum(jnp.searchsorted(ends_E, row0_U, side="right"), sizes_E.shape[0] - 1)
  expert_U = expert_U.astype(jnp.int32)
  return _Chunks(sizes_E, expert_U, row0_U - (ends_E - sizes_E)[expert_U], row0_U < ends_E[-1], a)


def _window(keys_E, ch: _Chunks, full_of, start_of, shape):
  """The Window of each chunk into its expert's draw (vmapped over U), or None without keys."""
  if keys_E is None:
    return None
  key_data_E = jax.vmap(lambda k: random_bits.Window.of(k, (0, 0), (0, 0), shape).key_data)(keys_E)
  full = jnp.stack(full_of(ch), axis=-1).astype(jnp.uint32)
  start = jnp.stack(start_of(ch), axis=-1).astype(jnp.uint32)
  return random_bits.Window(key_data_E[ch.expert], full, start, tuple(shape))


def _segment_amax(q: Quantizer, t_Uxx, ch: _Chunks):
  """Each chunk's expert's amax of the transformed operand (max over the expert's chunks), or None."""
  if not q.has_tensor_amax:
    return None
  amax_U = jnp.max(jnp.abs(t_Uxx.astype(jnp.float32)).reshape(t_Uxx.shape[0], -1), axis=-1)
  amax_E = jax.ops.segment_max(amax_U, ch.expert, num_segments=ch.sizes.shape[0])
  return amax_E[ch.expert]


def _vmap_quantize(q: Quantizer, t_Uxx, windows, amax_U):
  def one(t, w, a):
    return q._quantize(t, w, a)   # noqa: SLF001 (the quantizer's own arithmetic, one piece of a tensor)
  return jax.vmap(one, in_axes=(0, None if windows is None else 0, None if amax_U is None else 0))(
      t_Uxx, windows, amax_U)


def _check_quantizer(q):
  if isinstance(q, Quantizer) and (q.fmt not in SUPPORTED or q.row_scaled):
    raise NotImplementedError(f"fp4jax.grouped_dot quantizes {SUPPORTED}; a role has fmt={q.fmt!r}"
                              f"{' row_scaled' if q.row_scaled else ''}")


def _quantize_rows(q: Quantizer, t_SxC, ch: _Chunks, keys_E=None, signs_E=None) -> QTensor:
  """t quantized along C, each chunk of rows as part of its expert's (size_e, C) tensor; leading axis U."""
  s, c = t_SxC.shape
  t_UxAxC = ch.inside(t_SxC).reshape(s // ch.rows, ch.rows, c)
  if signs_E is None:
    prepared = jax.vmap(q.prepare)(t_UxAxC)
  else:
    prepared = jax.vmap(q.prepare)(t_UxAxC, signs_E[ch.expert])
  windows = _window(keys_E, ch, lambda h: (h.sizes[h.expert], jnp.full_like(h.expert, c)),
                    lambda h: (h.offset, jnp.zeros_like(h.offset)), (ch.rows, c))
  return _vmap_quantize(q, prepared, windows, _segment_amax(q, prepared, ch))


def _quantize_tokens(q: Quantizer, t_SxC, ch: _Chunks, keys_E=None, signs_E=None) -> QTensor:
  """tᵀ quantized along the tokens, each chunk as part of its expert's (C, size_e) tensor, as
  ``Quantizer.quantize_t`` quantizes it (the fused RHT path's order: xᵀ, then the transform in float32);
  leading axis U, each piece (C, A)."""
  s, c = t_SxC.shape
  t_UxAxC = ch.inside(t_SxC).reshape(s // ch.rows, ch.rows, c)
  fused = signs_E is None and q.rht_size and q.four_over_six is None and q.fmt in formats.FP4
  if fused:   # reference.quantize_rht_t_reference: hadamard.rht(x.T) along the tokens
    prepared = jax.vmap(lambda t: hadamard.rht(t.T, axis=-1, size=q.rht_size, seed=q.rht_seed))(t_UxAxC)
  else:
    cast = q.four_over_six is not None or q.fmt not in formats.NAMES
    as_in = (lambda t: t.astype(jnp.float32)) if cast else (lambda t: t)
    if signs_E is None:
      prepared = jax.vmap(lambda t: q.prepare(as_in(t).T))(t_UxAxC)
    else:
      prepared = jax.vmap(lambda t, sg: q.prepare(as_in(t).T, sg))(t_UxAxC, signs_E[ch.expert])
  windows = _window(keys_E, ch, lambda h: (jnp.full_like(h.expert, c), h.sizes[h.expert]),
                    lambda h: (jnp.zeros_like(h.offset), h.offset), (c, ch.rows))
  return _vmap_quantize(q, prepared, windows, _segment_amax(q, prepared, ch))


# ---------------------------------------------------------------------------------------------------
# The grouped GEMMs on exact bfloat16 block products
# ---------------------------------------------------------------------------------------------------

def _products(q: QTensor):
  """e2m1 · block scale in bfloat16 (exact), without the second level; vmapped over the leading axis."""
  if q.fmt == "nvfp4_dbq":
    return jax.vmap(lambda t: dbq.scaled_values(dbq.Dbq(reference.codes_of(t), t.scale, t.scale2))
                    .astype(jnp.bfloat16))(q)
  return jax.vmap(reference._scaled_codes_bf16)(q)   # noqa: SLF001 (the reference's own exact products)


@dataclasses.dataclass(frozen=True)
class _Level:
  """The second level of one side of a GEMM, broadcast to the outputs (what reference's factor reads)."""
  fmt: str
  amax: Any


def _factor(acc, qa: QTensor, qb: QTensor, second_a, second_b):
  """acc times the tensor factor of each output's pair, as ``fp4jax.gemm``'s xla backend computes it.
  second_a / second_b: the per-output second levels (amax, or MS-EDEN's s_dec), broadcastable to acc."""
  if qa.fmt == "nvfp4" and qa.bound == qb.bound == formats.NVFP4_BOUND:
    return reference.apply_tensor_factor(acc, _Level("nvfp4", second_a), _Level("nvfp4", second_b))
  if qa.fmt == "nvfp4":
    return product(acc, fos.gemm_factor(second_a, second_b, qa.bound, qb.bound))
  if qa.fmt == "nvfp4_eden":
    return product(acc, second_a * second_b)
  return acc   # mxfp4: the scales are in the products


def _second(q: QTensor):
  return q.scale2 if q.fmt == "nvfp4_eden" else q.amax


def _rows_gemm(qa_U: QTensor, qb_E: QTensor, ch: _Chunks, out_dtype):
  """a (S, K) rows · b[e] (N, K)ᵀ per group -> (S, N); qa has the leading chunk axis, qb the expert axis."""
  s = qa_U.data.shape[0] * qa_U.data.shape[1]
  a_SxK = _products(qa_U).reshape(s, -1)
  b_ExKxN = jnp.swapaxes(_products(qb_E), 1, 2)
  ragged = functools.partial(lax.ragged_dot, group_sizes=ch.sizes, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  e_S = ch.expert_of_row
  if qa_U.fmt == "nvfp4_dbq":   # one rescale per 128-chunk of K, the chunks summed in order (dbq.gemm)
    out = None
    outer_a_SxC = qa_U.scale2.reshape(s, -1)
    outer_b_ExNxC = qb_E.scale2
    for c in range(outer_b_ExNxC.shape[-1]):
      k = slice(c * dbq.OUTER, (c + 1) * dbq.OUTER)
      part = ragged(a_SxK[:, k], b_ExKxN[:, k, :])
      term = product(outer_a_SxC[:, c][:, None] * outer_b_ExNxC[e_S, :, c], part)
      out = term if out is None else out + term
    return out.astype(out_dtype)
  acc = ragged(a_SxK, b_ExKxN)
  if _second(qa_U) is None:   # mxfp4: the scales are in the products
    return acc.astype(out_dtype)
  second_a = jnp.repeat(_second(qa_U), ch.rows)[:, None]
  second_b = _second(qb_E)[e_S][:, None]
  return _factor(acc, qa_U, qb_E, second_a, second_b).astype(out_dtype)


def _tokens_gemm(qa_U: QTensor, qb_U: QTensor, ch: _Chunks):
  """Per expert e: a_e (K, size_e) · b_e (N, size_e)ᵀ -> (E, K, N) float32, the tokens the ragged axis."""
  n_e = ch.sizes.shape[0]
  a_UxKxA, b_UxNxA = _products(qa_U), _products(qb_U)
  if qa_U.fmt == "nvfp4_dbq":   # one 128-chunk of tokens per step, added into its expert's sum in order
    k, n = a_UxKxA.shape[1], b_UxNxA.shape[1]

    def step(out_ExKxN, inputs):
      a_KxA, b_NxA, oa_K, ob_N, e, first, valid = inputs
      part = lax.dot_general(a_KxA, b_NxA, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=lax.Precision.HIGHEST)
      term = product(oa_K[:, None] * ob_N[None, :], part)
      new = jnp.where(first, term, out_ExKxN[e] + term)
      return out_ExKxN.at[e].set(jnp.where(valid, new, out_ExKxN[e])), None

    outer_a, outer_b = qa_U.scale2[..., 0], qb_U.scale2[..., 0]   # (U, K), (U, N): one 128-chunk each
    out, _ = lax.scan(step, jnp.zeros((n_e, k, n), jnp.float32),
                      (a_UxKxA, b_UxNxA, outer_a, outer_b, ch.expert, ch.offset == 0, ch.valid))
    return out
  s = a_UxKxA.shape[0] * a_UxKxA.shape[2]
  a_SxK = jnp.swapaxes(a_UxKxA, 1, 2).reshape(s, -1)
  b_SxN = jnp.swapaxes(b_UxNxA, 1, 2).reshape(s, -1)
  acc = _ragged_tokens(a_SxK, b_SxN, ch.sizes, lax.Precision.HIGHEST)
  if _second(qa_U) is None:
    return acc
  second_a = _expert_second(qa_U, ch)[:, None, None]
  second_b = _expert_second(qb_U, ch)[:, None, None]
  return _factor(acc, qa_U, qb_U, second_a, second_b)


def _expert_second(q_U: QTensor, ch: _Chunks):
  """(E,) each expert's second level from its chunks (all equal within an expert; 1 for empty ones)."""
  second_U = _second(q_U)
  if second_U is None:
    return None
  return jnp.ones(ch.sizes.shape, jnp.float32).at[jnp.where(ch.valid, ch.expert, ch.sizes.shape[0])].set(
      second_U, mode="drop")


def _ragged_tokens(a_SxK, b_SxN, sizes_E, precision):
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return lax.ragged_dot_general(a_SxK, b_SxN, sizes_E, dims, precision=precision,
                                preferred_element_type=jnp.float32)


def _values_rows(q_U: QTensor):
  """x̂ of the sorted rows (S, K) float32 from a chunked QTensor (what dot._values gives per expert)."""
  from fp4jax import api   # pylint: disable=g-import-not-at-top
  v = jax.vmap(api.dequantize)(q_U)
  return v.reshape(-1, v.shape[-1])


# ---------------------------------------------------------------------------------------------------
# The custom_vjp on aligned operands
# ---------------------------------------------------------------------------------------------------

def _expert_keys(key, n_e):
  return jax.vmap(lambda e: jax.random.fold_in(key, e))(jnp.arange(n_e, dtype=jnp.uint32))


def _backward_keys(keys_E, rht):
  """Per expert, as ``fp4jax.dot`` splits its key: (signs, first operand's key, second's) of one GEMM."""
  if keys_E is None:
    return None, None, None
  return jax.vmap(lambda k: _gemm_keys(k, rht))(keys_E)   # noqa: SLF001 (the dot's own split)


def _unquantized_rows(a_SxK, b_ExKxN, sizes, precision):
  return lax.ragged_dot(a_SxK, b_ExKxN, sizes, precision=precision, preferred_element_type=jnp.float32)


def _fprop(roles: Roles, precision, out_dtype, x_SxK, w_ExKxN, ch):
  if roles.fprop_x is None:
    return _unquantized_rows(x_SxK, w_ExKxN, ch.sizes, precision).astype(out_dtype), None, None
  q_x = _quantize_rows(roles.fprop_x, x_SxK, ch)
  q_wt = jax.vmap(lambda w: roles.fprop_w(w.T))(w_ExKxN)                              # (E, N, K)
  return _rows_gemm(q_x, q_wt, ch, out_dtype), q_x, q_wt


@functools.partial(jax.tree_util.register_dataclass, data_fields=("key", "w_dgrad", "x_wgrad", "sizes"),
                   meta_fields=("x_dtype", "w_dtype"))
@dataclasses.dataclass(frozen=True)
class _Res:
  """What the forward pass saves: as ``fp4jax.dot``'s residuals (FP4 operands), plus the group sizes."""
  key: Any
  w_dgrad: Any
  x_wgrad: Any
  sizes: Any
  x_dtype: Any
  w_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gdot(roles, precision, out_dtype, rows, x_SxK, w_ExKxN, sizes_E, key):
  del key
  ch = _chunks(sizes_E, x_SxK.shape[0], rows)
  return _fprop(roles, precision, out_dtype, x_SxK, w_ExKxN, ch)[0]


def _gdot_fwd(roles, precision, out_dtype, rows, x_SxK, w_ExKxN, sizes_E, key):
  ch = _chunks(sizes_E, x_SxK.shape[0], rows)
  y, q_x, q_wt = _fprop(roles, precision, out_dtype, x_SxK, w_ExKxN, ch)
  if roles.dgrad_dy is None:
    w_dgrad = w_ExKxN
  elif roles.dgrad_w == TRANSPOSED or roles.requantize:
    w_dgrad = jnp.swapaxes(w_ExKxN, 1, 2) if q_wt is None else q_wt
  else:
    w_dgrad = jax.vmap(roles.dgrad_w)(w_ExKxN)                                        # (E, K, N) along N
  if roles.wgrad_x is None:
    x_wgrad = x_SxK
  elif roles.requantize:
    x_wgrad = x_SxK if q_x is None else q_x
  else:
    x_wgrad = _quantize_tokens(roles.wgrad_x, x_SxK, ch)                              # (U, K, A)
  return y, _Res(key if roles.needs_key else None, w_dgrad, x_wgrad, sizes_E, x_SxK.dtype, w_ExKxN.dtype)


def _gdot_bwd(roles, precision, out_dtype, rows, res, dy_SxN):
  del out_dtype
  key, w_dgrad, x_wgrad, sizes_E, x_dtype, w_dtype = (res.key, res.w_dgrad, res.x_wgrad, res.sizes, res.x_dtype,
                                                      res.w_dtype)
  ch = _chunks(sizes_E, dy_SxN.shape[0], rows)
  n_e = sizes_E.shape[0]
  keys_d = keys_w = None
  if roles.needs_key:
    if key is None:
      raise ValueError(MISSING_KEY_MESSAGE if roles.key_reason is None else
                       MISSING_KEY_REASON_MESSAGE.format(name=roles.name, why=roles.key_reason))
    split_E = jax.vmap(jax.random.split)(_expert_keys(key, n_e))
    keys_d, keys_w = split_E[:, 0], split_E[:, 1]
  # Dgrad dx = dy · w[e]ᵀ, contracting N.
  with jax.named_scope("dgrad"):
    if roles.dgrad_dy is None:
      dx_SxK = _unquantized_rows(dy_SxN, jnp.swapaxes(w_dgrad, 1, 2), sizes_E, precision)
    else:
      signs, k_dy, k_w = _backward_keys(keys_d, roles.dgrad_rht)
      if roles.dgrad_w == TRANSPOSED:
        q_w = jax.vmap(transpose_tiles)(w_dgrad)                                          # (E, K, N)
      elif roles.requantize:
        q_w = jax.vmap(lambda w, k, sg: roles.dgrad_w.quantize_t(_values(w), k, sg),   # noqa: SLF001
                       in_axes=(0, None if k_w is None else 0, None if signs is None else 0))(
            w_dgrad, k_w, signs)
      else:
        q_w = w_dgrad
      q_dy = _quantize_rows(roles.dgrad_dy, dy_SxN, ch, k_dy, signs)
      dx_SxK = _rows_gemm(q_dy, q_w, ch, jnp.float32)
  # Wgrad dw[e] = X_eᵀ · dy_e, both operands along the expert's tokens.
  with jax.named_scope("wgrad"):
    if roles.wgrad_x is None:
      dw_ExKxN = _ragged_tokens(x_wgrad, dy_SxN, sizes_E, precision)
    else:
      signs, k_x, k_dy = _backward_keys(keys_w, roles.wgrad_rht)
      if roles.requantize:
        x_values = _values_rows(x_wgrad) if isinstance(x_wgrad, QTensor) else x_wgrad.astype(jnp.float32)
        q_xt = _quantize_tokens(roles.wgrad_x, x_values, ch, k_x, signs)
      else:
        q_xt = x_wgrad
      q_dyt = _quantize_tokens(roles.wgrad_dy, dy_SxN, ch, k_dy, signs)
      dw_ExKxN = _tokens_gemm(q_xt, q_dyt, ch)
  dx_SxK, dw_ExKxN = lax.optimization_barrier((dx_SxK, dw_ExKxN))   # as fp4jax.dot: dx released with dw
  return dx_SxK.astype(x_dtype), dw_ExKxN.astype(w_dtype), None, None


_gdot.defvjp(_gdot_fwd, _gdot_bwd)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

@jax.named_scope("fp4jax/grouped_dot")
def grouped_dot(x_SxK, w_ExKxN, group_sizes, *, recipe, key=None, precision=None,
                preferred_element_type=None):
  """y (S, N): rows of group e times ``w[e]`` (K, N), every group quantized as ``fp4jax.dot`` would
  quantize that group alone with key ``fold_in(key, e)`` (the module docstring).

  group_sizes: (E,) int, each a multiple of ``alignment(recipe)``, summing to at most S (traced values
    are fine: an MoE's routing). recipe, key, precision: as ``fp4jax.dot``; a recipe that quantizes
    nothing is ``lax.ragged_dot`` with float32 accumulation. Output dtype: ``preferred_element_type``,
    else ``recipe.out_dtype``, else that of x and w.
  """
  recipe = _as_recipe(recipe)   # noqa: SLF001
  x_SxK, w_ExKxN = jnp.asarray(x_SxK), jnp.asarray(w_ExKxN)
  if x_SxK.ndim != 2 or w_ExKxN.ndim != 3 or x_SxK.shape[1] != w_ExKxN.shape[1]:
    raise ValueError(f"fp4jax.grouped_dot takes x (S, K) and w (E, K, N); got {x_SxK.shape} and {w_ExKxN.shape}")
  group_sizes = jnp.asarray(group_sizes)
  if group_sizes.shape != (w_ExKxN.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be ({w_ExKxN.shape[0]},) integers, one per expert; got "
                     f"{group_sizes.dtype} {group_sizes.shape}")
  out_dtype = preferred_element_type or recipe.out_dtype or jnp.result_type(x_SxK, w_ExKxN)
  if not recipe.quantizes_anything:
    return lax.ragged_dot(x_SxK, w_ExKxN, group_sizes, precision=precision,
                          preferred_element_type=jnp.float32).astype(out_dtype)
  roles = recipe.roles
  for q in roles.quantizers:
    _check_quantizer(q)
  rows, align_k, align_n = roles.alignment()
  s, k = x_SxK.shape
  n = w_ExKxN.shape[2]
  if s % rows:
    raise ValueError(f"fp4jax.grouped_dot: {s} rows is not a multiple of {rows} (alignment(recipe)); pad each "
                     "group to a multiple of it and the rows to a multiple of it")
  if key is not None and not roles.needs_key:
    key = None
  x_SxK = pad_to_multiple(x_SxK, 1, align_k)
  w_ExKxN = pad_to_multiple(pad_to_multiple(w_ExKxN, 1, align_k), 2, align_n)
  return _gdot(roles, precision, jnp.dtype(out_dtype), rows, x_SxK, w_ExKxN, group_sizes.astype(jnp.int32),
               key)[:, :n]
