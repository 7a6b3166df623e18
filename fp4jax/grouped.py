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

How (no loop over experts): this is ``fp4jax.dot``'s one custom_vjp and role logic, run on the experts'
operands (``Experts``, the operations of ``fp4jax.dot.Dense`` for groups of rows). What is specific to
experts lives here: the operands are quantized chunk by chunk (U chunks of A rows, each inside one expert)
with fp4jax's own ``Quantizer``s under ``vmap``, each pass one op over all chunks of all experts (the
RHT-transposed wgrad quantize is ``fp4jax_quantize_rht_t`` with the chunk axis in front; no loop): each chunk
gets its expert's amax (a segment max of the chunks' amaxes) and its window of its expert's random bits;
weights are quantized per expert under ``vmap``; each expert's key is fold_in(key, e). The GEMMs are ``fp4jax.gemm``'s grouped GEMM
(``grouped_matmul``: ``lax.ragged_dot``; ``grouped_matmul_t``: ``ragged_dot_general`` with the token axis
ragged; on a compute capability 10.x target the native block-scaled GEMM of ``fp4jax.native``'s work
items; the epilogue of each output's pair, ``fp4jax.epilogue``). Every role ``fp4jax.dot`` takes runs
(nvfp4, 4/6, row-scaled activations, mxfp4, MS-EDEN, DBQ, fp8, mxfp8). The values equal the per-expert
dots where both sum in float32 in the same order; on the CPU that holds for the FP4 formats (bfloat16
products; the test), fp8 and mxfp8 (float32 products) are equal within float32 summation error. On a GPU
the grouped GEMM's summation order is the kernel's (``lax.ragged_dot``), as a dense dot's is cuBLAS's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp4jax import _exact, gemm, random_bits
from fp4jax.dot import QuantizedWeight, can_quantize_weight, fprop_weight, gemm_keys, quantized_dot, values
from fp4jax.api import rht_amax, transpose_tiles
from fp4jax.numerics.amax import abs_max
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import Quantizer
from fp4jax.recipes import as_recipe

def alignment(recipe) -> int:
  """A: the multiple every group size must be (the token axis ``fp4jax.dot`` pads M to); 1 unquantized."""
  roles = as_recipe(recipe).roles
  return roles.alignment()[0] if roles.quantizes_anything else 1


# ---------------------------------------------------------------------------------------------------
# Each expert's pieces of a tensor: its amax, its window of random bits
# ---------------------------------------------------------------------------------------------------

def _window(keys_E, ch: gemm.Groups, full_of, start_of, shape):
  """The Window of each chunk into its expert's draw (vmapped over U), or None without keys."""
  if keys_E is None:
    return None
  key_data_E = jax.vmap(lambda k: random_bits.Window.of(k, (0, 0), (0, 0), shape).key_data)(keys_E)
  full = jnp.stack(full_of(ch), axis=-1).astype(jnp.uint32)
  start = jnp.stack(start_of(ch), axis=-1).astype(jnp.uint32)
  return random_bits.Window(key_data_E[ch.group], full, start, tuple(shape))


def _segment_amax(amax_U, ch: gemm.Groups):
  """Each chunk's expert's amax: the maximum of the amaxes of the expert's chunks."""
  amax_E = jax.ops.segment_max(amax_U, ch.group, num_segments=ch.sizes.shape[0])
  return amax_E[ch.group]


def _chunk_amax(q: Quantizer, t_Uxx, ch: gemm.Groups):
  """Each chunk's expert's amax of the transformed operand t (U, ...), or None without a tensor amax."""
  if not q.has_tensor_amax:
    return None
  return _segment_amax(abs_max(t_Uxx.reshape(t_Uxx.shape[0], -1), axis=-1), ch)


def _vmap_quantize(quantize, t_Uxx, windows, amax_U):
  """``quantize(t, window, amax)`` of every chunk: one op over the chunk axis (windows and amaxes optional)."""
  return jax.vmap(quantize, in_axes=(0, None if windows is None else 0,
                                     None if amax_U is None else 0))(t_Uxx, windows, amax_U)


def _check_roles(roles):
  """A clear error for the role tables grouped_dot cannot run (a row-scaled quantizer draws one key per
  row, which has no window into an expert's draw; and it is an activation's format of the rows GEMMs)."""
  for name in ("fprop_w", "dgrad_w", "wgrad_x", "wgrad_dy", "fprop_x", "dgrad_dy"):
    q = getattr(roles, name)
    if isinstance(q, Quantizer) and q.row_scaled and (q.stochastic or name not in ("fprop_x", "dgrad_dy")):
      raise ValueError(f"fp4jax.grouped_dot: Roles {roles.name!r} has a row-scaled {name}"
                       f"{' with stochastic rounding' if q.stochastic else ''}; grouped_dot takes row-scaled "
                       "nvfp4 for fprop_x / dgrad_dy with nearest rounding only (as fp4jax's presets use it)")


def _quantize_rows(q: Quantizer, t_SxC, ch: gemm.Groups, keys_E=None, signs_E=None) -> QTensor:
  """t quantized along C, each chunk of rows as part of its expert's (size_e, C) tensor; leading axis U."""
  s, c = t_SxC.shape
  t_UxAxC = ch.inside(t_SxC).reshape(s // ch.rows, ch.rows, c)
  if signs_E is None:
    prepared = jax.vmap(q.prepare)(t_UxAxC)
  else:
    prepared = jax.vmap(q.prepare)(t_UxAxC, signs_E[ch.group])
  windows = _window(keys_E, ch, lambda h: (h.sizes[h.group], jnp.full_like(h.group, c)),
                    lambda h: (h.offset, jnp.zeros_like(h.offset)), (ch.rows, c))
  return _vmap_quantize(q.quantize_prepared, prepared, windows, _chunk_amax(q, prepared, ch))


def _quantize_tokens(q: Quantizer, t_SxC, ch: gemm.Groups, keys_E=None, signs_E=None) -> QTensor:
  """tᵀ quantized along the tokens, each chunk as part of its expert's (C, size_e) tensor, as
  ``Quantizer.quantize_t`` quantizes it (the fused RHT path's order: xᵀ, then the transform in float32);
  leading axis U, each piece (C, A)."""
  s, c = t_SxC.shape
  t_UxAxC = ch.inside(t_SxC).reshape(s // ch.rows, ch.rows, c)
  windows = _window(keys_E, ch, lambda h: (jnp.full_like(h.group, c), h.sizes[h.group]),
                    lambda h: (jnp.zeros_like(h.offset), h.offset), (c, ch.rows))
  if q.fused_t(signs_E):   # the RHT-transposed quantize of every chunk: one fused op
    amax_U = None
    if q.has_tensor_amax:
      one = lambda t_AxC: rht_amax(_exact.stored(t_AxC), rht_size=q.rht_size, rht_seed=q.rht_seed, one_pass=True)
      amax_U = _segment_amax(jax.vmap(one)(t_UxAxC), ch)
    return _vmap_quantize(lambda t, w, a: q.quantize_t(t, w, amax=a), t_UxAxC, windows, amax_U)
  if signs_E is None:
    prepared = jax.vmap(q.prepare_t)(t_UxAxC)
  else:
    prepared = jax.vmap(q.prepare_t)(t_UxAxC, signs_E[ch.group])
  return _vmap_quantize(q.quantize_prepared, prepared, windows, _chunk_amax(q, prepared, ch))


# ---------------------------------------------------------------------------------------------------
# The experts' operands for fp4jax.dot's role logic
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Experts:
  """The operands of E experts for ``fp4jax.dot``'s one custom_vjp: x (S, K) sorted rows in groups of
  ``rows`` (A), w (E, K, N); ``bind`` takes the traced group sizes."""
  rows: int

  def bind(self, sizes_E, s):
    return _Bound(gemm.groups(sizes_E, s, self.rows))


def _expert_vmap(f, *args):
  """f vmapped over the expert axis of every argument that is not None."""
  return jax.vmap(f, in_axes=tuple(None if a is None else 0 for a in args))(*args)


@dataclasses.dataclass(frozen=True)
class _Bound:
  """``fp4jax.dot.Dense``'s operations, each expert its own tensor (module docstring)."""
  ch: gemm.Groups

  def rows(self, q, t_SxC, keys_E=None, signs_E=None, amax=None):
    del amax   # always None: each expert has its own amaxes (``amaxes``)
    return _quantize_rows(q, t_SxC, self.ch, keys_E, signs_E)

  def tokens(self, q, t_SxC, keys_E=None, signs_E=None, amax=None):
    del amax
    return _quantize_tokens(q, t_SxC, self.ch, keys_E, signs_E)

  def amaxes(self, q_rows, q_tokens, t_SxC):
    """Not shared: each expert's operand has its own tensor amaxes, taken where its pieces are quantized."""
    del q_rows, q_tokens, t_SxC
    return None, None

  def weight(self, q, w_Exx, keys_E=None, signs_E=None):
    return _expert_vmap(q, w_Exx, keys_E, signs_E)

  def weight_t(self, q, w_Exx, keys_E=None, signs_E=None):
    return _expert_vmap(q.quantize_t, w_Exx, keys_E, signs_E)

  def transpose(self, w_Exx):
    return jnp.swapaxes(w_Exx, 1, 2)

  def transpose_tiles(self, q_w):
    return jax.vmap(transpose_tiles)(q_w)

  def values(self, t):
    """x̂ of the sorted rows (S, K) float32 (a chunked QTensor: what dot's values gives per expert)."""
    if not isinstance(t, QTensor):
      return t.astype(jnp.float32)
    v = jax.vmap(values)(t)
    return v.reshape(-1, v.shape[-1])

  def weight_values(self, t):
    return jax.vmap(values)(t)

  def gemm(self, q_a, q_b, out_dtype):   # q_a's rows quantized here (``rows``): one amax per expert
    return gemm.grouped_matmul(q_a, q_b, self.ch, out_dtype=out_dtype, amax_per_group=True)

  def gemm_tokens(self, q_a, q_b, out_dtype):
    return gemm.grouped_matmul_t(q_a, q_b, self.ch, out_dtype=out_dtype)

  def exact(self, a, b, gemm_name, precision):
    sizes = self.ch.sizes
    if gemm_name == "wgrad":
      return gemm.ragged_tokens(a, b, sizes, precision)
    return gemm.ragged_rows(a, b if gemm_name == "fprop" else jnp.swapaxes(b, 1, 2), sizes, precision)

  def split(self, key):
    """Each expert's two streams, as fp4jax.dot splits the key fold_in(key, e) (or expert e's own key)."""
    n_e = self.ch.sizes.shape[0]
    split_E = jax.vmap(jax.random.split)(key if _key_shape(key) == (n_e,) else _expert_keys(key, n_e))
    return split_E[:, 0], split_E[:, 1]

  def gemm_keys(self, keys_E, rht_size):
    if keys_E is None:
      return None, None, None
    return jax.vmap(lambda k: gemm_keys(k, rht_size))(keys_E)


_WEIGHTS = _Bound(None)   # the experts' weight operations: they read no groups


def _key_shape(key):
  """The shape of a typed key array, or of a raw uint32 one (its last axis: the key data)."""
  return key.shape if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]


def _expert_keys(key, n_e):
  return jax.vmap(lambda e: jax.random.fold_in(key, e))(jnp.arange(n_e, dtype=jnp.uint32))


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def quantize_experts(w_ExKxN, *, recipe) -> QuantizedWeight:
  """w (E, K, N) with its fprop quantization for ``grouped_dot(..., recipe=recipe)``, as a ``QuantizedWeight``
  whose codes, scales and amax all have the leading axis E: bit for bit the codes grouped_dot computes from w
  itself (each expert its own tensor and amax). Each expert's codes depend on that expert's weight alone, so under
  a sharding of the leading axis E each device quantizes its own experts, and where the experts are gathered
  across devices only the codes and scales need to cross the wire (grouped_dot does not read w's values)."""
  recipe = as_recipe(recipe)
  if not can_quantize_weight(recipe):
    raise ValueError(f"recipe {recipe.name!r} reads the experts' weight itself in a GEMM besides fprop's codes "
                     "(fp4jax.can_quantize_weight); pass the weight to grouped_dot as it is")
  w_ExKxN = jnp.asarray(w_ExKxN)
  _, align_k, align_n = recipe.roles.alignment()
  w_p = pad_to_multiple(pad_to_multiple(w_ExKxN, 1, align_k), 2, align_n)
  return QuantizedWeight(w_ExKxN, fprop_weight(recipe.roles, _WEIGHTS, jax.lax.stop_gradient(w_p)), recipe)


@jax.named_scope("fp4jax/grouped_dot")
def grouped_dot(x_SxK, w_ExKxN, group_sizes, *, recipe, key=None, precision=None,
                preferred_element_type=None):
  """y (S, N): rows of group e times ``w[e]`` (K, N), every group quantized as ``fp4jax.dot`` would
  quantize that group alone with key ``fold_in(key, e)`` (the module docstring).

  group_sizes: (E,) int, each a multiple of ``alignment(recipe)``, summing to at most S (traced values
    are fine: an MoE's routing). recipe, key, precision: as ``fp4jax.dot``; a recipe that quantizes
    nothing is ``lax.ragged_dot`` with float32 accumulation. Output dtype: ``preferred_element_type``,
    else ``recipe.out_dtype``, else that of x and w.
  w_ExKxN: the experts' weight, or a ``QuantizedWeight`` of it (``quantize_experts``, the same recipe): its
    codes go into the GEMMs as they are, bit for bit what the dot would compute from the weight.
  key: one key (expert e uses fold_in(key, e)), or (E,) keys, expert e's own: an expert-parallel caller
    holding experts [e0, e0 + E) of a larger set passes fold_in(key, e0 + i) for its i-th, so that each
    expert draws the bits it draws on one device (``models.expert_parallel``).
  """
  recipe = as_recipe(recipe)
  pre_w = None
  if isinstance(w_ExKxN, QuantizedWeight):
    if w_ExKxN.recipe != recipe:
      raise ValueError(f"fp4jax.grouped_dot: the experts were quantized for recipe {w_ExKxN.recipe.name!r}, the "
                       f"dot runs {recipe.name!r}; quantize them with the dot's recipe (quantize_experts)")
    w_ExKxN, pre_w = w_ExKxN.w, w_ExKxN.q
  x_SxK, w_ExKxN = jnp.asarray(x_SxK), jnp.asarray(w_ExKxN)
  if x_SxK.ndim != 2 or w_ExKxN.ndim != 3 or x_SxK.shape[1] != w_ExKxN.shape[1]:
    raise ValueError(f"fp4jax.grouped_dot takes x (S, K) and w (E, K, N); got {x_SxK.shape} and {w_ExKxN.shape}")
  group_sizes = jnp.asarray(group_sizes)
  if group_sizes.shape != (w_ExKxN.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be ({w_ExKxN.shape[0]},) integers, one per expert; got "
                     f"{group_sizes.dtype} {group_sizes.shape}")
  out_dtype = preferred_element_type or recipe.out_dtype or jnp.result_type(x_SxK, w_ExKxN)
  if not recipe.quantizes_anything:
    return gemm.ragged_rows(x_SxK, w_ExKxN, group_sizes, precision, out_dtype=out_dtype)
  roles = recipe.roles
  _check_roles(roles)
  rows, align_k, align_n = roles.alignment()
  s, k = x_SxK.shape
  n = w_ExKxN.shape[2]
  if s % rows:
    raise ValueError(f"fp4jax.grouped_dot: {s} rows is not a multiple of {rows} (alignment(recipe)); pad each "
                     "group to a multiple of it and the rows to a multiple of it")
  if key is not None and not roles.needs_key:
    key = None
  if key is not None and _key_shape(key) not in ((), (w_ExKxN.shape[0],)):
    raise ValueError(f"fp4jax.grouped_dot: key has shape {jnp.shape(key)}; pass one key or "
                     f"({w_ExKxN.shape[0]},) keys, one per expert")
  x_SxK = pad_to_multiple(x_SxK, 1, align_k)
  w_ExKxN = pad_to_multiple(pad_to_multiple(w_ExKxN, 1, align_k), 2, align_n)
  return quantized_dot(roles, Experts(rows), x_SxK, w_ExKxN, key, group_sizes.astype(jnp.int32),
                       precision=precision, out_dtype=out_dtype, pre_w=pre_w)[:, :n]
