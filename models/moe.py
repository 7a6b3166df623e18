"""The mixture-of-experts block's mixer (pattern letter ``E``): transformers' ``NemotronHMoE``.

  1. Router, float32, never quantized: logits = x · router (D, E); scores = sigmoid(logits). The choice
     uses scores + ``e_score_correction_bias`` (a parameter the optimizer never moves: its gradient is
     stopped, and the trainer's aux-loss-free update sets it, ``moe_bias_update``). Group-limited top-k:
     per group of E / n_group experts the sum of its two best scores, keep the ``topk_group`` best groups,
     then the ``num_experts_per_tok`` best experts among them. Weights are the unbiased scores of the
     chosen experts, divided by (their sum + 1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.
  2. Routed experts, dropless: every (token, choice) pair is sorted by expert (stable: an expert's tokens
     in token order), each expert's segment padded with zero rows to the recipe's alignment
     (``fp4jax.grouped.alignment``), and the non-gated expert MLP up -> relu² -> down runs as two grouped
     GEMMs (``fp4jax.grouped.grouped_dot``: per expert exactly ``fp4jax.dot``, key ``fold_in(key, e)``).
     The outputs are weighted and summed per token in float32. With ``moe_latent_size`` the experts work in
     a latent space: ``fc1_latent_proj`` before, ``fc2_latent_proj`` after (transformers' order: the
     weighted sum is taken in the latent space). On a mesh whose ``expert`` axis splits the experts, the same
     per-expert rows are formed on the device that holds each expert, by all-to-all
     (``models.expert_parallel``), and sent back for the weighted sum.
  3. Shared experts: a relu² MLP of ``moe_shared_expert_intermediate_size`` on the block input, added.

Statistics, sown into the ``"moe_stats"`` collection when it is mutable (the train step): ``load`` (E,), the
(token, choice) pairs the router sent each expert; ``dropped``, the pairs of them expert parallelism dropped
(``moe_receive_factor``; 0 when dropless); ``aux_loss``, DeepSeek-V3's sequence-wise balance loss
(E / (k·L) · Σ_i f_i P_i per sequence, averaged), which the train step adds with weight
``moe_aux_loss_weight``.

Axis legend: B batch, L sequence, D model width, T tokens (B·L), E experts, R = num_experts_per_tok,
S sorted and padded rows, F expert width, Q latent width (D without the latent projections).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax import PREQUANTIZED, QuantizedWeight, can_quantize_weight, grouped, recipes
from models import axes as axes_lib, expert_parallel, policy, scopes
from models.config import ModelConfig
from models.layers import linear, residual_std

STATS = "moe_stats"   # the variable collection of the per-step routing statistics
# PREQUANTIZED (fp4jax.dot's): the routed experts' fprop codes made ahead of the layers
# (``models.lm.quantize_experts_ahead``: the weights gathered once per step as codes and scales); a layer that
# finds its kernel's codes there uses them
_ACT = ("activation_batch", "activation_seq", "activation_mlp")


def route(logits_TxE, bias_E, config: ModelConfig):
  """(weights_TxR float32, experts_TxR int32, scores_TxE): the router's choice (module docstring, step 1)."""
  cfg = config
  n_e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  scores_TxE = jax.nn.sigmoid(logits_TxE.astype(jnp.float32))
  choice_TxE = scores_TxE + bias_E.astype(jnp.float32)
  if cfg.n_group > 1:
    per_group = choice_TxE.reshape(-1, cfg.n_group, n_e // cfg.n_group)
    group_TxG = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_TxG, cfg.topk_group)
    keep_TxG = jnp.zeros_like(group_TxG, bool).at[jnp.arange(group_TxG.shape[0])[:, None], best_groups].set(True)
    keep_TxE = jnp.repeat(keep_TxG, n_e // cfg.n_group, axis=-1)
    choice_TxE = jnp.where(keep_TxE, choice_TxE, -jnp.inf)
  _, experts_TxR = jax.lax.top_k(choice_TxE, k)
  weights_TxR = jnp.take_along_axis(scores_TxE, experts_TxR, axis=-1)
  if cfg.norm_topk_prob:
    weights_TxR = weights_TxR / (jnp.sum(weights_TxR, axis=-1, keepdims=True) + 1e-20)
  return weights_TxR * cfg.routed_scaling_factor, experts_TxR.astype(jnp.int32), scores_TxE


def dispatch(experts_TxR, n_experts: int, align: int):
  """The dropless layout: (rows_S, position_TxR, sizes_E).

  rows_S: the token each padded sorted row reads (T for a padding row: a zero row); position_TxR: the row
  each (token, choice) pair landed in; sizes_E: each expert's segment, its count rounded up to ``align``.
  S = T·R + E·(align - 1), rounded up to ``align``: room for every padding, a static shape."""
  t, r = experts_TxR.shape
  flat = experts_TxR.reshape(-1)
  order = jnp.argsort(flat, stable=True)               # pairs by expert, in token order inside each
  sorted_e = flat[order]
  counts_E = jnp.zeros(n_experts, jnp.int32).at[flat].add(1)
  sizes_E = (counts_E + align - 1) // align * align
  pad_start_E = jnp.cumsum(sizes_E) - sizes_E
  count_start_E = jnp.cumsum(counts_E) - counts_E
  dest = pad_start_E[sorted_e] + jnp.arange(t * r, dtype=jnp.int32) - count_start_E[sorted_e]
  s = -(-(t * r + n_experts * (align - 1)) // align) * align
  rows_S = jnp.full((s,), t, jnp.int32).at[dest].set((order // r).astype(jnp.int32))
  position_TxR = jnp.zeros(t * r, jnp.int32).at[order].set(dest).reshape(t, r)
  return rows_S, position_TxR, sizes_E, counts_E


def sequence_aux_loss(scores_BxLxE, experts_BxLxR, n_experts: int):
  """DeepSeek-V3's sequence-wise balance loss: per sequence Σ_i f_i P_i with f_i = E/(R·L) · (tokens choosing
  i) and P_i the mean over the sequence of the scores normalized over the experts; mean over sequences."""
  _, length, r = experts_BxLxR.shape
  chosen_BxE = jax.nn.one_hot(experts_BxLxR, n_experts, dtype=jnp.float32).sum(axis=(1, 2))
  f_BxE = chosen_BxE * (n_experts / (r * length))
  p_BxE = jnp.mean(scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True), axis=1)
  return jnp.mean(jnp.sum(f_BxE * p_BxE, axis=-1))


def load_metrics(load_E) -> dict[str, jax.Array]:
  """MaxVio = max load / mean load - 1 (0 when balanced) and the load's entropy over log E (1 when
  balanced), from the pairs each expert received."""
  load_E = load_E.astype(jnp.float32)
  mean = jnp.mean(load_E)
  p_E = load_E / jnp.maximum(jnp.sum(load_E), 1.0)
  entropy = -jnp.sum(jnp.where(p_E > 0, p_E * jnp.log(jnp.where(p_E > 0, p_E, 1.0)), 0.0))
  return {"max_vio": jnp.max(load_E) / jnp.maximum(mean, 1e-9) - 1.0,
          "entropy": entropy / math.log(load_E.shape[-1])}


def bias_update(bias_E, load_E, rate: float):
  """The aux-loss-free balance step (DeepSeek-V3): bias += rate · sign(mean load - load), per expert."""
  load_E = load_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E)


class Router(nn.Module):
  """``kernel`` (D, E) float32 and ``e_score_correction_bias`` (E,); returns (weights, experts, scores)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_TxD):
    cfg = self.config
    # Replicated over the experts (None, not "experts"): every token's choice needs all E columns.
    kernel_DxE = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                                   ("embed", None)),
                            (x_TxD.shape[-1], cfg.n_routed_experts), jnp.float32)
    bias_E = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                        (cfg.n_routed_experts,), jnp.float32)
    with scopes.part("moe_router"):
      logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), kernel_DxE.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
      return route(logits_TxE, jax.lax.stop_gradient(bias_E), cfg)


class RoutedExperts(nn.Module):
  """The experts' two GEMMs' operands (``ExpertLinear``: kernels, recipes, keys); ``mlp`` runs them."""

  config: ModelConfig
  q_axis: str
  recipe: Any = "bf16"

  @nn.compact
  def __call__(self, q: int):
    cfg = self.config
    up = ExpertLinear(cfg, q, cfg.moe_intermediate_size, ("expert_kernels", self.q_axis, "mlp"), cfg.init_std,
                      self.recipe, name="up")()
    down = ExpertLinear(cfg, cfg.moe_intermediate_size, q, ("expert_kernels", "mlp", self.q_axis), residual_std(cfg),
                        self.recipe, name="down")()
    return up, down


@functools.partial(jax.tree_util.register_dataclass, data_fields=("kernel", "key"),
                   meta_fields=("recipe", "dtype", "observe", "scope"))
@dataclasses.dataclass(frozen=True)
class ExpertGemm:
  """One grouped GEMM's operands: kernel (E, in, out) in the compute dtype (or a ``fp4jax.QuantizedWeight``
  of it: the kernel with its fprop codes), its recipe, and its key (one
  key, or (E,) keys: fold_in(key, e), which expert parallelism splits with the kernel), or None.
  ``observe(x_SxK)``, where set, sees each input (the export's calibration reads its amax). ``scope``: the
  layer's name (``experts/up``), a named scope around the GEMM, so that its ops are named by their layer
  wherever ``mlp`` runs them (the module that made the operands has returned by then); metadata only."""
  kernel: jax.Array
  key: Any
  recipe: Any
  dtype: Any
  observe: Any = None
  scope: str = ""

  def __call__(self, x_SxK, sizes_E):
    if self.observe is not None:
      self.observe(x_SxK)
    with jax.named_scope(self.scope) if self.scope else contextlib.nullcontext():
      return grouped.grouped_dot(x_SxK.astype(self.dtype), self.kernel, sizes_E, recipe=self.recipe, key=self.key,
                                 preferred_element_type=self.dtype)

  def per_expert_keys(self):
    """The same GEMM with its key as (E,) keys fold_in(key, e) (what grouped_dot derives from one key)."""
    if self.key is None:
      return self
    n_e = self.kernel.shape[0]
    keys_E = jax.vmap(lambda e: jax.random.fold_in(self.key, e))(jnp.arange(n_e, dtype=jnp.uint32))
    return dataclasses.replace(self, key=keys_E)


def mlp(h_SxQ, sizes_E, gemms):
  """The routed experts' MLP on sorted rows: ``down(relu(up(h))²)``, two grouped GEMMs."""
  up, down = gemms
  return down(jnp.square(jax.nn.relu(up(h_SxQ, sizes_E))), sizes_E)


class ExpertLinear(nn.Module):
  """One of the routed experts' two GEMMs: ``kernel`` (E, in, out), run by ``fp4jax.grouped_dot`` with the
  precision the policy gives the path ``.../experts/up`` or ``.../experts/down``; returns its ExpertGemm."""

  config: ModelConfig
  in_features: int
  features: int
  axes: tuple[str, str, str]
  std: float
  recipe: Any = "bf16"

  @nn.compact
  def __call__(self):
    cfg = self.config
    kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(self.std), self.axes),
                        (cfg.n_routed_experts, self.in_features, self.features), cfg.param_dtype)
    recipe = expert_recipe(cfg, self.recipe, self.path)
    key = None
    if recipe.needs_key and self.has_rng("fp4"):
      key = self.make_rng("fp4")
    # Cast on each device's shard (the parameter's own placement): the per-layer gather of the experts then
    # moves the compute dtype, not the float32 master weights; where the recipe reads the weight only through
    # its fprop codes, each device also quantizes its own experts, and the gather moves codes and scales. Codes
    # made ahead of the layer (PREQUANTIZED) are the same codes, gathered once per step; the kernel's values
    # are then not read (its gradient still comes here).
    kernel = axes_lib.as_param(kernel.astype(cfg.dtype), self.axes)
    if self.has_variable(PREQUANTIZED, "kernel"):
      kernel = QuantizedWeight(kernel, self.get_variable(PREQUANTIZED, "kernel"), recipe)
    elif can_quantize_weight(recipe):
      kernel = grouped.quantize_experts(kernel, recipe=recipe)
    if isinstance(kernel, QuantizedWeight):
      kernel = dataclasses.replace(kernel, q=jax.tree.map(
          lambda a: axes_lib.as_param(a, self.axes[:1] + (None,) * (a.ndim - 1)), kernel.q))
    return ExpertGemm(kernel, key, recipe, cfg.dtype, scope="/".join(self.path[-2:]))   # experts/up, experts/down


def expert_recipe(config: ModelConfig, recipe, path):
  """The recipe the policy gives an expert GEMM (bf16 where the policy keeps the layer in high precision).

  A rule may give the experts another recipe than the run's (``config.precision``); a rule that overrides
  single GEMMs of an expert layer (a Roles table) is refused: ``fp4jax.grouped_dot`` takes one recipe."""
  decision = policy.decide(config, recipes.get(recipe), path)
  if decision.recipe is None:
    return recipes.bf16()
  if not isinstance(decision.recipe, recipes.Recipe):
    raise ValueError(f"precision rule {decision.why!r} overrides single GEMMs of the MoE expert layer "
                     f"{'/'.join(path)}; expert layers take one recipe for all three GEMMs: give the rule a "
                     "recipe without fprop/dgrad/wgrad overrides")
  return policy.released(config, decision.recipe)


class MoE(nn.Module):
  """``NemotronHMoE``'s forward (module docstring): routed experts (+ latent projections) + shared experts."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False   # unused; every mixer takes it

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    b, length, d = x_BxLxD.shape
    x_TxD = x_BxLxD.reshape(b * length, d)
    weights_TxR, experts_TxR, scores_TxE = Router(cfg, name="router")(x_TxD)
    dense = lambda name, features, axes, **kw: linear(self, name, features, axes, config=cfg, recipe=self.recipe, **kw)
    # 2. Routed experts on the sorted, padded rows.
    h_TxQ = x_TxD
    if cfg.moe_latent_size:
      h_TxQ = dense("fc1_latent_proj", cfg.moe_latent_size, ("embed", "moe_latent"))(x_TxD)
    q_axis = "moe_latent" if cfg.moe_latent_size else "embed"
    up_path = (*self.path, "experts", "up")
    align = max(grouped.alignment(expert_recipe(cfg, self.recipe, up_path)),
                grouped.alignment(expert_recipe(cfg, self.recipe, (*self.path, "experts", "down"))))
    gemms = RoutedExperts(cfg, q_axis, self.recipe, name="experts")(h_TxQ.shape[-1])
    where = expert_parallel.layout(cfg.n_routed_experts, x_TxD.shape[0])
    if where is None:
      with scopes.part("moe_dispatch"):
        rows_S, position_TxR, sizes_E, counts_E = dispatch(experts_TxR, cfg.n_routed_experts, align)
        h_SxQ = jnp.concatenate([h_TxQ, jnp.zeros((1, h_TxQ.shape[-1]), h_TxQ.dtype)])[rows_S]
      with scopes.part("moe_experts"):
        out_SxQ = mlp(h_SxQ, sizes_E, gemms)
      with scopes.part("moe_dispatch"):
        picked_TxRxQ = out_SxQ[position_TxR]
      dropped = jnp.zeros((), jnp.int32)   # one device holds every expert: dropless
    else:   # expert parallelism: the same per-expert rows, on the device that holds the expert
      counts_E = jnp.zeros(cfg.n_routed_experts, jnp.int32).at[experts_TxR.reshape(-1)].add(1)
      gemms = tuple(g.per_expert_keys() for g in gemms)
      specs = jax.tree.map(lambda a: expert_parallel.expert_spec(where, a.ndim), gemms)
      with scopes.part("moe_experts"):   # dispatch, experts and combine in one shard_map
        picked_TxRxQ, dropped = expert_parallel.routed_dropping(
            h_TxQ, experts_TxR, gemms, specs, experts_fn=mlp, n_experts=cfg.n_routed_experts, align=align,
            where=where, receive_factor=cfg.moe_receive_factor)
    with scopes.part("moe_dispatch"):
      picked_TxRxQ = picked_TxRxQ.astype(jnp.float32)
      routed_TxQ = jnp.sum(picked_TxRxQ * weights_TxR[..., None], axis=1).astype(cfg.dtype)
    if cfg.moe_latent_size:
      routed_TxQ = dense("fc2_latent_proj", d, ("moe_latent", "embed"), std=residual_std(cfg))(routed_TxQ)
    y_TxD = routed_TxQ
    # 3. Shared experts.
    if cfg.moe_shared_expert_intermediate_size:
      shared = SharedExperts(cfg, self.recipe, name="shared_experts")(x_TxD)
      y_TxD = y_TxD + shared
    self.sow(STATS, "load", counts_E.astype(jnp.float32))
    self.sow(STATS, "dropped", dropped.astype(jnp.float32))
    if cfg.moe_aux_loss_weight:
      self.sow(STATS, "aux_loss", sequence_aux_loss(scores_TxE.reshape(b, length, -1),
                                                    experts_TxR.reshape(b, length, -1), cfg.n_routed_experts))
    return y_TxD.reshape(b, length, d).astype(cfg.dtype)


class SharedExperts(nn.Module):
  """The shared expert: ``down(relu(up(x))²)`` of width ``moe_shared_expert_intermediate_size``."""

  config: ModelConfig
  recipe: Any = "bf16"

  @nn.compact
  def __call__(self, x_TxD):
    cfg = self.config
    dense = lambda name, features, axes, **kw: linear(self, name, features, axes, config=cfg, recipe=self.recipe, **kw)
    h_TxF = jnp.square(jax.nn.relu(dense("up", cfg.moe_shared_expert_intermediate_size, ("embed", "mlp"))(x_TxD)))
    return dense("down", cfg.d_model, ("mlp", "embed"), std=residual_std(cfg))(h_TxF)


def inactive_params(config: ModelConfig) -> int:
  """Parameters a token does not use: the routed experts it is not sent to, in every ``E`` block, those of the
  MTP modules (``mtp_<i>``, each with the ``E`` blocks of ``mtp_pattern``) included."""
  q = config.moe_latent_size or config.d_model
  per_expert = 2 * q * config.moe_intermediate_size
  idle = config.n_routed_experts - config.num_experts_per_tok
  blocks = config.pattern.count("E") + config.mtp_modules * config.mtp_pattern.count("E")
  return blocks * idle * per_expert
