"""The quantized dot: ``fp4jax.dot_general`` / ``fp4jax.dot``, spec §6 as a ``jax.custom_vjp``.

Axis legend: M tokens (every free axis of lhs, flattened), K the contraction (every contracting axis,
flattened), N output features (every free axis of rhs, flattened), B the dot_general batch axes.
lhs is the activation x_MxK, rhs the weight w_KxN. The three GEMMs of y = x·w and their operands:

  fprop  y_MxN  = x · w      x 1x16 along K, nearest;  w 16x16 tiles (``weight_2d``) or 1x16 along K
  dgrad  dx_MxK = dy · wᵀ    dy 1x16 along N, stochastic;  w: the fprop tiles transposed (no new
                             quantization) with ``weight_2d``, else w quantized 1x16 along N
  wgrad  dw_KxN = xᵀ · dy    RHT(xᵀ) and RHT(dyᵀ) along M, then 1x16 along M; dy stochastic

(16 for nvfp4; mxfp4 uses 1x32 blocks and no 2D tiles; fp8 1x128 blocks, 128x128 weight tiles, no
stochastic rounding and no RHT.) A GEMM whose format is "bf16" is a plain ``lax.dot_general`` of the
unquantized operands. The residuals are the *quantized* wgrad x and dgrad w; an unquantized operand is
saved only when a GEMM in "bf16" needs it. All three GEMMs accumulate in float32; dx and dw come back
in the dtypes of x and w.

Shapes that are not multiples of the blocks (and of ``rht_size`` along M) are zero-padded in whole
elements before quantization. Zeros change neither a tensor's amax nor any block's or tile's amax, so
every real element is quantized exactly as it would be without the padding, and padded elements
quantize to zero and contribute nothing; the result is sliced back to the unpadded shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import formats, recipes, schemes
from fp4jax.api import (check_dot_inputs, quantize, quantize_rht_transposed, scaled_matmul,
                        transpose_tiles)
from fp4jax.layout import pad_to_multiple
from fp4jax.recipes import Recipe

_BLOCK = {**formats.BLOCK, "bf16": 1}
_FP4 = formats.FP4

MISSING_KEY_MESSAGE = (
    "stochastic rounding of the gradients (Recipe.stochastic_grad=True) needs random bits, and no key "
    "was given. Pass key=jax.random.key(...) to fp4jax.dot / fp4jax.dot_general; with the Flax modules "
    "provide the 'fp4' rng stream: linen model.apply(variables, x, rngs={'fp4': key}), NNX "
    "Fp4DotGeneralNNX(recipe, rngs=nnx.Rngs(fp4=seed)). Or use a recipe with stochastic_grad=False.")


# ---------------------------------------------------------------------------------------------------
# Which quantization each operand gets
# ---------------------------------------------------------------------------------------------------

def _weight_tile(fmt, recipe):
  return formats.TILE[fmt] if recipe.weight_2d and fmt in formats.TILE else None


def _rounding(fmt, recipe):
  return "stochastic" if recipe.stochastic_grad and fmt in _FP4 else "nearest"


def _uses_rht(recipe):
  return recipe.rht and recipe.wgrad in _FP4


def needs_key(recipe: Recipe) -> bool:
  """Whether the backward pass of ``recipe`` draws random bits (stochastic rounding of dy)."""
  return recipe.needs_key


def _shares_fprop_weight(recipe):
  """dgrad reads the fprop tiles transposed (spec §2): the same quantized tensor in both GEMMs."""
  return recipe.weight_2d and recipe.fprop == recipe.dgrad and recipe.fprop in formats.TILE


def _alignment(recipe):
  """Multiples (M, K, N) that the operands of all three GEMMs need."""
  f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad
  f_tile, d_tile = _weight_tile(f, recipe), _weight_tile(d, recipe)
  m = math.lcm(_BLOCK[g], recipe.rht_size if _uses_rht(recipe) else 1)
  k = math.lcm(_BLOCK[f], d_tile[0] if d_tile else 1)
  n = math.lcm(_BLOCK[d], f_tile[0] if f_tile else 1)
  return m, k, n


def _quantize_kw(fmt, recipe):
  return {"scale_rule": recipe.mxfp4_scale_rule} if fmt == "mxfp4" else {}


def _wgrad_operand(t_TxC, fmt, recipe, rounding="nearest", key=None):
  """xᵀ or dyᵀ for wgrad: (C, T) quantized along the token axis T, after the RHT when on."""
  kw = _quantize_kw(fmt, recipe)
  if _uses_rht(recipe):
    return quantize_rht_transposed(t_TxC, fmt, rht_size=recipe.rht_size, rht_seed=recipe.rht_seed,
                                   rounding=rounding, key=key, **kw)
  return quantize(t_TxC.T, fmt, axis=-1, rounding=rounding, key=key, **kw)


def _exact(a, b, dims, precision):
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------
# The custom_vjp on aligned 2-D operands x_MxK, w_KxN
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("key", "w_dgrad", "x_wgrad"),
                   meta_fields=("x_dtype", "w_dtype"))
@dataclasses.dataclass(frozen=True)
class _Residuals:
  key: Any        # None unless the backward pass rounds stochastically
  w_dgrad: Any    # QTensor (K, N) along N, or the fprop QTensor (N, K) in 16x16 tiles, or w (dgrad bf16)
  x_wgrad: Any    # QTensor (K, M) along M (after RHT), or x itself (wgrad bf16)
  x_dtype: Any
  w_dtype: Any


@jax.named_scope("fprop")
def _fprop(recipe, precision, out_dtype, x_MxK, w_KxN):
  """y and the fprop-quantized weight (None when fprop runs unquantized)."""
  fmt = recipe.fprop
  if fmt == "bf16":
    return _exact(x_MxK, w_KxN, ((1,), (0,)), precision).astype(out_dtype), None
  kw = _quantize_kw(fmt, recipe)
  q_x = quantize(x_MxK, fmt, axis=-1, **kw)
  q_wt = quantize(w_KxN.T, fmt, axis=-1, tile=_weight_tile(fmt, recipe), **kw)   # (N, K)
  return scaled_matmul(q_x, q_wt, out_dtype=out_dtype), q_wt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _qdot(recipe, precision, out_dtype, x_MxK, w_KxN, key):
  del key
  return _fprop(recipe, precision, out_dtype, x_MxK, w_KxN)[0]


def _qdot_fwd(recipe, precision, out_dtype, x_MxK, w_KxN, key):
  y_MxN, q_wt = _fprop(recipe, precision, out_dtype, x_MxK, w_KxN)
  d, g = recipe.dgrad, recipe.wgrad
  if d == "bf16":
    w_dgrad = w_KxN
  elif _shares_fprop_weight(recipe):
    w_dgrad = q_wt                       # transposed in the backward pass: codes and scales only
  else:
    w_dgrad = quantize(w_KxN, d, axis=-1, tile=_weight_tile(d, recipe), **_quantize_kw(d, recipe))
  with jax.named_scope("wgrad"):
    x_wgrad = x_MxK if g == "bf16" else _wgrad_operand(x_MxK, g, recipe)
  res = _Residuals(key if needs_key(recipe) else None, w_dgrad, x_wgrad, x_MxK.dtype, w_KxN.dtype)
  return y_MxN, res


def _qdot_bwd(recipe, precision, out_dtype, res, dy_MxN):
  del out_dtype
  key_d = key_w = None
  if needs_key(recipe):
    if res.key is None:
      raise ValueError(MISSING_KEY_MESSAGE)
    key_d, key_w = jax.random.split(res.key)   # independent streams for the two GEMMs
  d, g = recipe.dgrad, recipe.wgrad
  # Dgrad dx = dy · wᵀ.
  with jax.named_scope("dgrad"):   # inside "fp4jax/dot" (the caller's scope)
    if d == "bf16":
      dx_MxK = _exact(dy_MxN, res.w_dgrad, ((1,), (1,)), precision)
    else:
      q_w = transpose_tiles(res.w_dgrad) if _shares_fprop_weight(recipe) else res.w_dgrad   # (K, N)
      q_dy = quantize(dy_MxN, d, axis=-1, rounding=_rounding(d, recipe), key=key_d, **_quantize_kw(d, recipe))
      dx_MxK = scaled_matmul(q_dy, q_w, out_dtype=jnp.float32)
  # Wgrad dw = xᵀ · dy, both operands along the tokens.
  with jax.named_scope("wgrad"):
    if g == "bf16":
      dw_KxN = _exact(res.x_wgrad, dy_MxN, ((0,), (0,)), precision)
    else:
      q_dyt = _wgrad_operand(dy_MxN, g, recipe, _rounding(g, recipe), key_w)    # (N, M)
      dw_KxN = scaled_matmul(res.x_wgrad, q_dyt, out_dtype=jnp.float32)
  # dx is released only together with dw. Without this the scheduler runs the input-gradient chain through
  # every earlier layer first and keeps each layer's wgrad operands live until its deferred wgrad GEMM
  # (docs/PERF.md, issue 13: the 12B step on 64 devices 36.3 -> 23.1 GiB). The barrier changes no value.
  dx_MxK, dw_KxN = lax.optimization_barrier((dx_MxK, dw_KxN))
  return dx_MxK.astype(res.x_dtype), dw_KxN.astype(res.w_dtype), None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def _dot_2d(recipe, precision, out_dtype, x_MxK, w_KxN, key):
  m, k = x_MxK.shape
  n = w_KxN.shape[1]
  beyond = schemes.uses_schemes(recipe)   # 4/6, Quartet II, TetraJet-v2: fp4jax.schemes
  align_m, align_k, align_n = schemes.alignment(recipe) if beyond else _alignment(recipe)
  x_MxK = pad_to_multiple(pad_to_multiple(x_MxK, 0, align_m), 1, align_k)
  w_KxN = pad_to_multiple(pad_to_multiple(w_KxN, 0, align_k), 1, align_n)
  if beyond:
    y_MxN = schemes.qdot(recipe, precision, out_dtype, x_MxK, w_KxN, key)
  else:
    y_MxN = _qdot(recipe, precision, out_dtype, x_MxK, w_KxN, key)
  return y_MxN[:m, :n]


def _as_recipe(recipe) -> Recipe:
  if isinstance(recipe, str):
    return recipes.get(recipe)
  if not isinstance(recipe, Recipe):
    raise TypeError(f"recipe must be an fp4jax.Recipe or a preset name such as 'nvfp4' "
                    f"(one of {recipes.NAMES}); got {type(recipe).__name__}")
  return recipe


@jax.named_scope("fp4jax/dot")   # names every op of the three GEMMs in XLA profiles
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                recipe, key=None, out_sharding=None):
  """``lax.dot_general`` with the three GEMMs of training quantized as ``recipe`` says (spec §6).

  lhs is treated as the activation (1D blocks along its contracting axes), rhs as the weight (2D tiles
  with ``recipe.weight_2d``). Batch dimensions give independent GEMMs (each with its own tensor amax).
  recipe: an ``fp4jax.Recipe`` or a preset name ("nvfp4", "mxfp4", "fp8", "bf16", ...).
  key: a ``jax.random`` key for stochastic rounding in the backward pass; needed only when the
    gradient is taken with a recipe that rounds stochastically. Use a different key per call site
    and step.
  Output dtype: ``preferred_element_type`` if given, else ``recipe.out_dtype``, else that of
  ``lax.dot_general(lhs, rhs)``. ``precision`` applies to the GEMMs that run unquantized.
  A recipe that quantizes nothing is exactly ``lax.dot_general`` (values and gradients).
  """
  recipe = _as_recipe(recipe)
  lhs, rhs = check_dot_inputs(lhs, rhs, dimension_numbers, preferred_element_type, key,
                              recipe.quantizes_anything)
  if preferred_element_type is None and recipe.out_dtype is not None:
    preferred_element_type = recipe.out_dtype
  sharding_kw = {} if out_sharding is None else {"out_sharding": out_sharding}
  if not recipe.quantizes_anything:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **sharding_kw)
  # lax validates the dimension numbers and tells us the output shape and dtype.
  out = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                                         preferred_element_type=preferred_element_type), lhs, rhs)
  (lc, rc), (lb, rb) = [[tuple(int(a) % arr.ndim for a in axes) for axes, arr in zip(pair, (lhs, rhs))]
                        for pair in dimension_numbers]
  lhs_free = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
  rhs_free = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
  b = math.prod(lhs.shape[a] for a in lb)
  k = math.prod(lhs.shape[a] for a in lc)
  m = math.prod(lhs.shape[a] for a in lhs_free)
  n = math.prod(rhs.shape[a] for a in rhs_free)
  x_BxMxK = jnp.transpose(lhs, (*lb, *lhs_free, *lc)).reshape(b, m, k)
  w_BxKxN = jnp.transpose(rhs, (*rb, *rc, *rhs_free)).reshape(b, k, n)
  if key is not None and not needs_key(recipe):
    key = None
  dot_2d = functools.partial(_dot_2d, recipe, precision, out.dtype)
  if not lb:
    y_BxMxN = dot_2d(x_BxMxK[0], w_BxKxN[0], key)[None]
  elif key is None:
    y_BxMxN = jax.vmap(lambda x, w: dot_2d(x, w, None))(x_BxMxK, w_BxKxN)
  else:
    y_BxMxN = jax.vmap(dot_2d)(x_BxMxK, w_BxKxN, jax.random.split(key, b))
  y = y_BxMxN.reshape(out.shape)
  if out_sharding is not None:
    y = lax.with_sharding_constraint(y, out_sharding)
  return y


def dot(x, w, *, recipe, key=None, preferred_element_type=None):
  """x [..., K] · w [K, N] -> [..., N], quantized as ``recipe`` says (see ``dot_general``)."""
  x, w = jnp.asarray(x), jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"fp4jax.dot takes a 2-D weight w [K, N]; got shape {w.shape}. "
                     "Use fp4jax.dot_general for other layouts")
  return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                     preferred_element_type=preferred_element_type, recipe=recipe, key=key)
