"""Small shared pieces: RMSNorm, the policy-aware linear layer (with TetraJet-v2's OutControl), rotary
embeddings, the vocabulary-chunked cross entropy.

Axis legend: B batch, L sequence, D model width, H heads, P head dim, M tokens, K input channels, N output
features.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax import fused, outcontrol, prequantized
from fp4jax import flax as fp4flax
from fp4jax import dispatch
from fp4jax.prequantized import PreQuantized
from models import policy, remat, scopes
from models.config import ModelConfig

OUTCONTROL = "outcontrol"   # the variable collection of OutControl's per-layer state


class RMSNorm(nn.Module):
  """``x / rms(x) * scale`` over the last axis, computed in float32, returned in ``dtype``."""

  eps: float = 1e-5
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x_xD: jax.Array, prequantize_for: Any = None) -> jax.Array:
    """``prequantize_for``: a recipe whose fprop input this norm feeds (``fused_norm_recipe``): the output is
    an ``fp4jax.PreQuantized`` for the next linear layers (``linear``), quantized here, in the norm's pass.
    With the kernel chosen (the impl switch, "rmsnorm_quantize") the norm and the quantization are one
    kernel (``fp4jax.fused.rmsnorm_quantize``, its fixed sum order); else this norm, quantized by
    ``fp4jax.prequantize``: the bits of the unfused norm and dot. None: the plain norm."""
    scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                         (x_xD.shape[-1],), self.param_dtype)
    with scopes.part("rmsnorm"):
      if prequantize_for is not None and _kernel_chosen(fused.OP, prequantize_for) and fused.kernel_ok(
          prequantize_for.roles.fprop_x, x_xD.shape, x_xD.dtype, self.dtype):
        return fused.rmsnorm_quantize(x_xD, scale_D, prequantize_for, eps=self.eps, dtype=self.dtype,
                                      impl="pallas")
      x_xD = x_xD.astype(jnp.float32)
      x_xD = x_xD * jax.lax.rsqrt(jnp.mean(jnp.square(x_xD), axis=-1, keepdims=True) + self.eps)
      h_xD = (x_xD * scale_D.astype(jnp.float32)).astype(self.dtype)
      return h_xD if prequantize_for is None else prequantized.prequantize(h_xD, prequantize_for)


def _kernel_chosen(op: str, recipe: Any) -> bool:
  """Whether the impl switch runs the fused kernel ``op`` for ``recipe``'s fprop input format."""
  return dispatch.choose(op, recipe.roles.fprop_x.fmt) == "pallas"


def fused_norm_recipe(config: ModelConfig, recipe: Any, consumer_paths: Sequence[Sequence[str]]) -> Any:
  """The recipe a norm pre-quantizes its output for (``RMSNorm(prequantize_for=...)``), or None.

  ``consumer_paths``: the module paths of every linear layer that reads the norm's output, and nothing
  else may read it. Fused when every consumer runs the same recipe with a pre-quantizable fprop input
  (``fp4jax.prequantized.supported``: 1D FP4, nearest, no transform) and no OutControl, at a width of
  its K alignment; ``config.fused_producers=False`` turns it off."""
  recipes_ = {policy.decide(config, recipe, path).recipe for path in consumer_paths}
  if len(recipes_) != 1 or any(policy.outcontrol_ratio(config, recipe, p) for p in consumer_paths):
    return None
  (layer_recipe,) = recipes_
  return _fusable(config, layer_recipe, config.d_model)


def fused_activation_recipe(config: ModelConfig, recipe: Any, down_path: Sequence[str]) -> Any:
  """The recipe the MLP's activation (relu² or SwiGLU) pre-quantizes its output for (the down projection's
  fprop input), or None: as ``fused_norm_recipe``. relu² runs ``fp4jax.fused.relu2_quantize`` (its kernel
  where the impl switch picks it, else its XLA twin, relu² exact either way); SwiGLU ``fp4jax.prequantize``."""
  if policy.outcontrol_ratio(config, recipe, down_path):
    return None
  return _fusable(config, policy.decide(config, recipe, down_path).recipe, config.mlp_dim)


def _fusable(config: ModelConfig, layer_recipe: Any, width: int) -> Any:
  """``layer_recipe`` where producers are fused and its fprop input quantizer can pre-quantize a width-``width``
  input; else None."""
  if not config.fused_producers or layer_recipe is None:
    return None
  q = layer_recipe.roles.fprop_x
  if not prequantized.supported(q) or width % layer_recipe.roles.alignment()[1]:
    return None
  return layer_recipe


def residual_std(config: ModelConfig) -> float:
  """Init std of projections that write into the residual stream (GPT-2 / Megatron scaling)."""
  return config.init_std / math.sqrt(2 * config.n_blocks)


def linear(parent: nn.Module, name: str, features: int, kernel_axes: Sequence[str], *,
           config: ModelConfig, recipe: Any, std: float | None = None):
  """``x -> y`` through a bias-free ``nn.Dense`` child of ``parent`` whose dot_general the precision
  policy picks; an ``OutControlDense`` where the policy gives the layer an OutControl ratio
  (``config.outcontrol_ratio``).

  Call inside ``parent``'s compact method; the policy sees the layer's full module path. The returned
  callable names its output ``models.remat.LINEAR_OUT`` (what the "save_linear*" remat policies keep).
  """
  path = (*parent.path, name)
  ratio = policy.outcontrol_ratio(config, recipe, path)
  cls = functools.partial(OutControlDense, outcontrol_ratio=ratio) if ratio else fp4flax.Dense
  dense = cls(
      features, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype,
      kernel_init=nn.with_logical_partitioning(
          nn.initializers.normal(config.init_std if std is None else std), tuple(kernel_axes)),
      dot_general_cls=policy.dot_general_cls(config, recipe, path),
      name=name)
  def apply(x):
    if isinstance(x, PreQuantized) and (ratio or dense.dot_general_cls is None):
      x = x.x   # this layer cannot take the codes (fused_norm_recipe fuses only where every consumer can)
    with scopes.part("linear"):
      return remat.tag_linear(dense(x))
  return apply


class OutControlDense(nn.Dense):
  """``nn.Dense`` with TetraJet-v2's OutControl: after calibration, the k8 input channels with the largest
  activation norms run in MXFP8, the rest in NVFP4 (``fp4jax.outcontrol``).

  State, in the ``"outcontrol"`` collection, only where k8 = ``outcontrol.k8(K, outcontrol_ratio)`` > 0:
  ``acc`` (K,) float32, the accumulated channel norms, and ``perm`` (K,) int32, the channels by descending
  ``acc`` (created by ``init``: zeros and 0..K-1). What the caller passes picks the phase (static):
    no "outcontrol" collection     exactly ``nn.Dense`` (the recipe's quantized dot): before the window
    "outcontrol" mutable           the same forward, plus ``acc += ‖x[:, c]‖₂`` over this call's tokens (the
                                   global batch under jit) and ``perm = argsort(-acc)``: the window
    "outcontrol" immutable         ``outcontrol.dot`` with ``perm`` and n_fp8 = k8: after the window
  The kernel, its path and its initialization are ``nn.Dense``'s, so the parameter tree does not change.
  """
  outcontrol_ratio: float = outcontrol.DEFAULT_RATIO

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    k_in = inputs.shape[-1]
    n_fp8 = outcontrol.k8(k_in, self.outcontrol_ratio)
    if not n_fp8:
      return super().__call__(inputs)
    if self.is_initializing():
      self.variable(OUTCONTROL, "acc", outcontrol.calibration_init, k_in)
      self.variable(OUTCONTROL, "perm", lambda: jnp.arange(k_in, dtype=jnp.int32))
      return super().__call__(inputs)
    if not self.has_variable(OUTCONTROL, "perm"):
      return super().__call__(inputs)
    dtype = self.dtype or inputs.dtype
    if self.is_mutable_collection(OUTCONTROL):
      acc = self.variable(OUTCONTROL, "acc", outcontrol.calibration_init, k_in)
      perm = self.variable(OUTCONTROL, "perm", lambda: jnp.arange(k_in, dtype=jnp.int32))
      acc.value = outcontrol.calibration_accumulate(acc.value, inputs.astype(dtype))
      perm.value = outcontrol.calibration_finalize(acc.value)
      return super().__call__(inputs)
    kernel_KxN = self.param("kernel", self.kernel_init, (k_in, self.features), self.param_dtype)
    x_xK, kernel_KxN, _ = self.promote_dtype(inputs, kernel_KxN, None, dtype=self.dtype)
    perm_K = self.get_variable(OUTCONTROL, "perm")
    key = self.make_rng("fp4") if self.has_rng("fp4") else jax.random.PRNGKey(0)  # the backward's bits only
    y_MxN = outcontrol.dot(x_xK.reshape(-1, k_in), kernel_KxN, perm_K, n_fp8, key=key)
    return y_MxN.reshape(*inputs.shape[:-1], self.features).astype(x_xK.dtype)


def rope(x_BxLxHxP: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (rotate-half form), computed in float32."""
  with scopes.part("attention_rope"):
    P = x_BxLxHxP.shape[-1]
    inv_freq_P2 = theta ** (-jnp.arange(0, P, 2, dtype=jnp.float32) / P)
    angle_BxLxP2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_P2
    sin_BxLx1xP2, cos_BxLx1xP2 = jnp.sin(angle_BxLxP2)[:, :, None], jnp.cos(angle_BxLxP2)[:, :, None]
    x1, x2 = jnp.split(x_BxLxHxP.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_BxLx1xP2 - x2 * sin_BxLx1xP2,
                               x2 * cos_BxLx1xP2 + x1 * sin_BxLx1xP2], axis=-1)
    return rotated.astype(x_BxLxHxP.dtype)


# ----------------------------------------------------------------------- vocabulary-chunked cross entropy

def _vocab_chunks(w_DxV: jax.Array, n_chunks: int) -> jax.Array:
  """``w_QxDxVc``: chunk q holds the columns v = i Q + q (strided, so a vocab axis sharded over a mesh
  axis stays sharded along Vc and every chunk has the same width). V is padded to a multiple of Q."""
  D, V = w_DxV.shape
  w_DxV = jnp.pad(w_DxV, [(0, 0), (0, -V % n_chunks)])
  return jnp.moveaxis(w_DxV.reshape(D, -1, n_chunks), -1, 0)


def _compute_chunk(w_DxVc, dtype):
  """The chunk cast to the compute dtype where it lives (sharded like the weight), so a gather moves that."""
  return nn.with_logical_constraint(w_DxVc.astype(dtype), ("embed", "vocab"))


def _chunk_logits(x_BxLxD, w_DxVc, q, n_chunks, vocab):
  """float32 logits of one vocabulary chunk (w already in x's dtype); padded columns (v >= vocab) are -inf."""
  logits_BxLxVc = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxVc, preferred_element_type=jnp.float32)
  if vocab % n_chunks:
    column_Vc = jnp.arange(w_DxVc.shape[-1]) * n_chunks + q
    logits_BxLxVc = jnp.where(column_Vc < vocab, logits_BxLxVc, -jnp.inf)
  return logits_BxLxVc


def _ce_forward(x_BxLxD, w_DxV, targets_BxL, weights_BxL, n_chunks):
  """(mean loss, logsumexp_BxL): an online logsumexp over the chunks, never more than one chunk of logits.
  With ``weights_BxL`` the mean is weighted: ``sum(weights * loss) / _weight_total(weights)``."""
  B, L, _ = x_BxLxD.shape
  V = w_DxV.shape[1]
  w_QxDxVc = _vocab_chunks(w_DxV, n_chunks)
  chunk_of_target_BxL, column_of_target_BxL = targets_BxL % n_chunks, targets_BxL // n_chunks

  def body(carry, inputs):
    max_BxL, sum_BxL, target_BxL = carry
    q, w_DxVc = inputs
    logits_BxLxVc = _chunk_logits(x_BxLxD, _compute_chunk(w_DxVc, x_BxLxD.dtype), q, n_chunks, V)
    new_max_BxL = jnp.maximum(max_BxL, logits_BxLxVc.max(-1))
    sum_BxL = sum_BxL * jnp.exp(max_BxL - new_max_BxL) + jnp.exp(logits_BxLxVc - new_max_BxL[..., None]).sum(-1)
    picked_BxL = jnp.take_along_axis(logits_BxLxVc, column_of_target_BxL[..., None], axis=-1)[..., 0]
    target_BxL = jnp.where(chunk_of_target_BxL == q, picked_BxL, target_BxL)
    return (new_max_BxL, sum_BxL, target_BxL), None

  zeros = jnp.zeros((B, L), jnp.float32)
  init = (jnp.full((B, L), -jnp.inf, jnp.float32), zeros, zeros)
  (max_BxL, sum_BxL, target_BxL), _ = jax.lax.scan(body, init, (jnp.arange(n_chunks), w_QxDxVc))
  lse_BxL = max_BxL + jnp.log(sum_BxL)
  if weights_BxL is None:
    return jnp.mean(lse_BxL - target_BxL), lse_BxL
  return jnp.sum(weights_BxL * (lse_BxL - target_BxL)) / _weight_total(weights_BxL), lse_BxL


def _weight_total(weights_BxL):
  """The weighted mean's divisor: the sum of the 0/1 weights, at least 1 (no target: a loss of 0, not NaN)."""
  return jnp.maximum(jnp.sum(weights_BxL), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_ce(x_BxLxD, w_DxV, targets_BxL, weights_BxL, n_chunks):
  return _ce_forward(x_BxLxD, w_DxV, targets_BxL, weights_BxL, n_chunks)[0]


def _chunked_ce_fwd(x_BxLxD, w_DxV, targets_BxL, weights_BxL, n_chunks):
  loss, lse_BxL = _ce_forward(x_BxLxD, w_DxV, targets_BxL, weights_BxL, n_chunks)
  return loss, (x_BxLxD, w_DxV, targets_BxL, weights_BxL, lse_BxL)


def _chunked_ce_bwd(n_chunks, res, g):
  """Per chunk: recompute the logits, d logits = (softmax - onehot) g / (B L) (g weights / sum(weights) with
  weights), then dx += d wᵀ (float32 carry) and dw_chunk = xᵀ d, constrained to the weight's sharding so each
  chunk is reduced where it lives."""
  x_BxLxD, w_DxV, targets_BxL, weights_BxL, lse_BxL = res
  B, L, D = x_BxLxD.shape
  V = w_DxV.shape[1]
  cdt = x_BxLxD.dtype
  if weights_BxL is None:
    scale = g.astype(jnp.float32) / (B * L)
  else:
    scale = (g.astype(jnp.float32) * weights_BxL / _weight_total(weights_BxL))[..., None]
  chunk_of_target_BxL, column_of_target_BxL = targets_BxL % n_chunks, targets_BxL // n_chunks

  def body(dx_BxLxD, inputs):
    q, w_DxVc = inputs
    w_c_DxVc = _compute_chunk(w_DxVc, cdt)   # gathered once, for both GEMMs of the chunk
    logits_BxLxVc = _chunk_logits(x_BxLxD, w_c_DxVc, q, n_chunks, V)
    p_BxLxVc = jnp.exp(logits_BxLxVc - lse_BxL[..., None])
    onehot_BxLxVc = ((jnp.arange(w_DxVc.shape[-1]) == column_of_target_BxL[..., None])
                     & (chunk_of_target_BxL == q)[..., None])
    d_BxLxVc = ((p_BxLxVc - onehot_BxLxVc) * scale).astype(cdt)
    dx_BxLxD = dx_BxLxD + jnp.einsum("blv,dv->bld", d_BxLxVc, w_c_DxVc,
                                     preferred_element_type=jnp.float32)
    dw_DxVc = jnp.einsum("bld,blv->dv", x_BxLxD, d_BxLxVc, preferred_element_type=jnp.float32)
    dw_DxVc = nn.with_logical_constraint(dw_DxVc.astype(w_DxV.dtype), ("embed", "vocab"))
    return dx_BxLxD, dw_DxVc

  w_QxDxVc = _vocab_chunks(w_DxV, n_chunks)
  dx_BxLxD, dw_QxDxVc = jax.lax.scan(body, jnp.zeros((B, L, D), jnp.float32),
                                     (jnp.arange(n_chunks), w_QxDxVc))
  dw_DxV = jnp.moveaxis(dw_QxDxVc, 0, -1).reshape(D, -1)[:, :V]
  return dx_BxLxD.astype(cdt), dw_DxV, None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def chunked_cross_entropy(x_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, *,
                          chunk: int, weights_BxL: jax.Array | None = None) -> jax.Array:
  """Mean softmax cross entropy of ``logits = x · w`` (float32 accumulation) against integer targets,
  without ever holding more than ``B x L x chunk`` logits: the vocabulary is split into
  ``ceil(V / chunk)`` strided chunks, the forward pass keeps an online logsumexp, and the backward pass
  recomputes each chunk's logits. The GEMMs run in ``x.dtype`` (w is cast per chunk); the gradient of w
  comes back in w's dtype (float32 for the master weights), chunk by chunk. ``weights_BxL`` (a 0/1
  mask of the positions that have a target: ``models.mtp``, document masking) makes it the mean over those
  positions (0 when there are none); they get no gradient."""
  V = w_DxV.shape[1]
  if chunk <= 0:
    raise ValueError(f"{chunk=} must be > 0 (vocabulary columns per chunk)")
  if weights_BxL is not None:
    weights_BxL = jax.lax.stop_gradient(weights_BxL).astype(jnp.float32)
  with scopes.part("cross_entropy"):
    return _chunked_ce(x_BxLxD, w_DxV, targets_BxL.astype(jnp.int32), weights_BxL, -(-V // chunk))
