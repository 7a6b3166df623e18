"""The hybrid language model: embedding -> blocks from the pattern string -> RMSNorm -> LM head.

Each block is ``x + mixer(rmsnorm(x))`` with the mixer chosen by the pattern character
(``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of experts); block i is the module ``blocks_<i>``, and its linear
layers get their dot_general from ``models.policy``. Embedding and LM head are untied and stay in
bf16 (the head accumulates in float32); logits are float32. With ``config.mtp_depths`` the multi-token
prediction modules ``mtp_<d>`` (``models.mtp``) follow the final norm, in the loss call only.

Quantized recipes draw stochastic-rounding randomness from the ``"fp4"`` rng stream:
``model.apply(variables, tokens, rngs={"fp4": key})`` (and ``init`` with ``{"params", "fp4"}``).
Decoding: ``cache = init_cache(model, batch, max_len)``, then repeatedly
``logits, mut = model.apply({"params": p, "cache": cache}, tokens_BxT, decode=True, mutable=["cache"])``
with ``cache = mut["cache"]``; a call may feed a whole prompt (T > 1) or one token.

Axis legend: B batch, L sequence, D model width, V vocabulary.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from fp4jax import can_quantize_weight, grouped, quantize_weight
from models.attention import Attention
from models.config import ModelConfig
from models.layers import RMSNorm, chunked_cross_entropy, fused_norm_recipe
from models.mamba2 import Mamba2
from models.mlp import MLP
from models import axes as axes_lib, mtp, policy, remat, scopes
from models.moe import PREQUANTIZED, STATS as MOE_STATS, MoE, expert_recipe
from models.policy import layer_precision

_MIXERS = {"mamba": Mamba2, "attention": Attention, "mlp": MLP, "moe": MoE}
_SEQUENCE_MIXERS = ("mamba", "attention")   # the mixers that read other tokens, so take segment ids
_RESIDUAL = ("activation_batch", "activation_seq", "activation_embed")
# Per mixer, the linear layers that read the block's normalized input, where nothing else reads it (the MoE's
# router reads it too: its norm is not pre-quantized).
_NORM_READERS = {"mlp": ("up",), "mamba": ("in_proj",), "attention": ("qkv",)}


def _lookup_split(batch: int, d_model: int):
  """``(batch axes, d_model axes)`` of the embedding lookup under the mesh being traced for, or None when the
  table's d_model is not split (no mesh, or too narrow for its axes: ``models.axes.fit``, as the trainer
  places the table): d_model over the table's own axes, the batch over the batch axes that leaves free."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  _, d_axes = nn.logical_to_mesh_axes(("vocab", "embed"))
  d_axes = axes_lib.fit(d_axes, d_model, mesh.shape, axes_lib.MATRIX_UNIT)
  d_names = (d_axes,) if isinstance(d_axes, str) else tuple(d_axes or ())
  if math.prod(mesh.shape[a] for a in d_names) == 1:
    return None
  (batch_axes,) = nn.logical_to_mesh_axes(("activation_batch",))
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
  return axes_lib.fit(tuple(a for a in batch_axes if a not in d_names), batch, mesh.shape), d_axes


def _lookup(embed: nn.Embed, tokens_BxL: jax.Array, dtype) -> jax.Array:
  """``embed(tokens_BxL)`` in the residual's layout (batch over the batch axes, d_model whole).

  FSDP splits the table along d_model, the tokens arrive split along the batch over the same mesh axes.
  XLA's SPMD partitioner has no partition of that gather's transpose (the scatter-add of the cotangent into
  the table) and falls back to replicating the whole float32 (B, L, D) cotangent on every device
  ("Involuntary full rematerialization"). So the lookup runs in the table's layout: the tokens (int32)
  gathered over the table's d_model axes, each device reads its batch rows' slice of d_model, and an
  all-to-all brings the result to the residual's layout; the backward is the transpose: an all-to-all of
  the cotangent, a local scatter-add, a sum over the remaining batch axes (the same sums as before)."""
  split = _lookup_split(tokens_BxL.shape[0], embed.features)
  if split is None:
    x_BxLxD = embed(tokens_BxL)
  else:
    batch_axes, d_axes = split
    tokens_BxL = jax.lax.with_sharding_constraint(tokens_BxL, P(batch_axes, None))
    x_BxLxD = jax.lax.with_sharding_constraint(embed(tokens_BxL), P(batch_axes, None, d_axes))
  return nn.with_logical_constraint(x_BxLxD.astype(dtype), _RESIDUAL)


class Block(nn.Module):
  """Pre-norm residual block: ``x + mixer(norm(x))``."""

  config: ModelConfig
  kind: str
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    pre = None
    readers = _NORM_READERS.get(self.kind)   # the linear layers that are the norm's only readers
    if readers is not None:
      mixer = (*self.path, "mixer")
      names = readers + (("gate",) if self.kind == "mlp" and cfg.mlp_kind == "swiglu" else ())
      pre = fused_norm_recipe(cfg, self.recipe, [(*mixer, name) for name in names])
    h_BxLxD = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="norm")(x_BxLxD, pre)
    mixer = _MIXERS[self.kind](cfg, self.recipe, self.decode, name="mixer")
    h_BxLxD = mixer(h_BxLxD, segment_ids_BxL) if self.kind in _SEQUENCE_MIXERS else mixer(h_BxLxD)
    with scopes.part("residual"):
      return nn.with_logical_constraint(x_BxLxD + h_BxLxD.astype(x_BxLxD.dtype), _RESIDUAL)


class BlockGroup(nn.Module):
  """Blocks ``start .. start + unit - 1`` as one scan step: ``__call__(x, segment_ids) -> (x, None)``, the
  segment ids (or None) broadcast to every step. The blocks keep the names (hence the precision policy) of
  the group's first repetition."""

  config: ModelConfig
  start: int
  unit: int
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None) -> tuple[jax.Array, None]:
    cfg = self.config
    block_cls = remat.block_class(Block, cfg.remat)
    for i in range(self.start, self.start + self.unit):
      x_BxLxD = block_cls(cfg, cfg.block_kinds[i], self.recipe, self.decode, name=f"blocks_{i}")(
          x_BxLxD, segment_ids_BxL)
    return x_BxLxD, None


def block_groups(config: ModelConfig) -> list[tuple[int, int, int]]:
  """``[(start, unit, repeats)]`` covering the blocks in order: ``repeats`` back-to-back copies of the
  ``unit`` blocks from ``start``, equal in kind and in precision (bf16 or the recipe) block by block.
  Greedy: the run that saves the most blocks, ``unit x (repeats - 1)``, then the same on what is left on
  either side. The 12B pattern (bf16 first 2, last 8) gives (0, 2, 1), (2, 9, 5), (47, 2, 2), (51, 3, 1),
  (54, 2, 4): 18 distinct blocks to compile instead of 62."""
  signature = [(kind, policy.block_signature(config, i)) for i, kind in enumerate(config.pattern)]

  def split(lo: int, hi: int) -> list[tuple[int, int, int]]:
    best = (0, lo, hi - lo, 1)     # (blocks saved, start, unit, repeats)
    for unit in range(1, (hi - lo) // 2 + 1):
      for start in range(lo, hi - 2 * unit + 1):
        repeats = 1
        while (start + (repeats + 1) * unit <= hi and signature[start + repeats * unit:start + (repeats + 1) * unit]
               == signature[start:start + unit]):
          repeats += 1
        if unit * (repeats - 1) > best[0]:
          best = (unit * (repeats - 1), start, unit, repeats)
    saved, start, unit, repeats = best
    if not saved:
      return [(lo, hi - lo, 1)] if hi > lo else []
    return split(lo, start) + [(start, unit, repeats)] + split(start + unit * repeats, hi)

  return split(0, config.n_blocks)


def scanned_params(params: dict, config: ModelConfig) -> dict:
  """The per-block parameter tree (``blocks_<i>``) rearranged into the ``scan_blocks=True`` model's: each
  repeated group ``blocks_<start>_<repeats>x<unit>`` holds its first repetition's block names with the
  repetitions stacked on axis 0. Works on arrays and on ShapeDtypeStructs' shapes alike (via jnp.stack)."""
  out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
  for start, unit, repeats in block_groups(config):
    if repeats == 1:
      out.update({f"blocks_{i}": params[f"blocks_{i}"] for i in range(start, start + unit)})
      continue
    out[f"blocks_{start}_{repeats}x{unit}"] = {
        f"blocks_{start + j}": jax.tree.map(lambda *xs: jnp.stack(xs),
                                            *[params[f"blocks_{start + r * unit + j}"] for r in range(repeats)])
        for j in range(unit)}
  return out


def unscanned_params(params: dict, config: ModelConfig) -> dict:
  """The inverse of ``scanned_params``: a ``scan_blocks=True`` tree back to one ``blocks_<i>`` per block."""
  out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
  for start, unit, repeats in block_groups(config):
    if repeats == 1:
      out.update({f"blocks_{i}": params[f"blocks_{i}"] for i in range(start, start + unit)})
      continue
    group = params[f"blocks_{start}_{repeats}x{unit}"]
    for r in range(repeats):
      for j in range(unit):
        out[f"blocks_{start + r * unit + j}"] = jax.tree.map(lambda x, r=r: x[r], group[f"blocks_{start + j}"])
  return out


class LMHead(nn.Module):
  """The untied output projection ``kernel_DxV`` (float32 accumulation): logits, or with targets the mean
  cross entropy computed vocabulary chunk by chunk (``config.loss_chunk`` columns; no B x L x V logits)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, targets_BxL: jax.Array | None = None,
               weights_BxL: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    kernel_DxV = self.param(
        "kernel", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("embed", "vocab")),
        (x_BxLxD.shape[-1], cfg.vocab_size), cfg.param_dtype)
    x_BxLxD = x_BxLxD.astype(cfg.dtype)
    if targets_BxL is not None:
      return chunked_cross_entropy(x_BxLxD, kernel_DxV, targets_BxL, chunk=cfg.loss_chunk, weights_BxL=weights_BxL)
    with scopes.part("lm_head"):
      logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, kernel_DxV.astype(cfg.dtype),
                                preferred_element_type=jnp.float32)
      return nn.with_logical_constraint(logits_BxLxV, ("activation_batch", "activation_seq", "activation_vocab"))


class LanguageModel(nn.Module):
  """``__call__(tokens_BxL int32, *, decode=False) -> logits_BxLxV float32``; with ``targets_BxL`` the
  mean next-token cross entropy instead (float32, nats), without materializing the logits, and with MTP
  depths each depth's loss sown into ``models.mtp.LOSSES`` (``models.mtp.objective`` combines them).
  ``mtp_logits=True`` (no targets; tests, analysis) returns ``(logits, (depth 1 logits, ...))``, depth d
  embedding token t+d from ``tokens_BxL`` itself (zeros past the end).

  Document masking: ``segment_ids_BxL`` (``models.segments``) keeps every document of a packed window to
  itself in the attention and Mamba-2 blocks (the MTP depths' included), and ``target_weights_BxL`` (0/1:
  0 where a target starts another document than its input's) leaves those targets out of the mean loss,
  and out of every MTP depth's whose target lies past a document's end."""

  config: ModelConfig
  recipe: Any = "bf16"   # an fp4jax.Recipe or a name for fp4jax.recipes.get

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, *, decode: bool = False, targets_BxL: jax.Array | None = None,
               mtp_logits: bool = False, segment_ids_BxL: jax.Array | None = None,
               target_weights_BxL: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.init_std), ("vocab", "embed")), name="embed")
    with scopes.part("embed"):
      x_BxLxD = _lookup(embed, tokens_BxL, cfg.dtype)
    if mtp_logits and (targets_BxL is not None or decode or not cfg.mtp_depths):
      raise ValueError("mtp_logits=True takes no targets_BxL and decode=False, on a model with mtp_depths > 0")
    if target_weights_BxL is not None and targets_BxL is None:
      raise ValueError("target_weights_BxL weights the loss's targets: give targets_BxL too")
    block_cls = remat.block_class(Block, cfg.remat)
    if not cfg.scan_blocks:
      for i, kind in enumerate(cfg.block_kinds):
        x_BxLxD = block_cls(cfg, kind, self.recipe, decode, name=f"blocks_{i}")(x_BxLxD, segment_ids_BxL)
    else:
      for start, unit, repeats in block_groups(cfg):
        if repeats == 1:
          for i in range(start, start + unit):
            x_BxLxD = block_cls(cfg, cfg.block_kinds[i], self.recipe, decode, name=f"blocks_{i}")(
                x_BxLxD, segment_ids_BxL)
          continue
        group_cls = nn.scan(BlockGroup, variable_axes={"params": 0, "cache": 0, "outcontrol": 0, MOE_STATS: 0,
                                                       PREQUANTIZED: 0},
                            split_rngs={"params": True, "fp4": True}, length=repeats, in_axes=nn.broadcast,
                            metadata_params={nn.PARTITION_NAME: None})
        x_BxLxD, _ = group_cls(cfg, start, unit, self.recipe, decode,
                               name=f"blocks_{start}_{repeats}x{unit}")(x_BxLxD, segment_ids_BxL)
    x_BxLxD = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="final_norm")(x_BxLxD)
    head = LMHead(cfg, name="lm_head")
    out = head(x_BxLxD, targets_BxL, target_weights_BxL)
    if cfg.mtp_depths and not decode and (targets_BxL is not None or mtp_logits or self.is_initializing()):
      depth_out = self._mtp(embed, head, x_BxLxD, tokens_BxL, targets_BxL, block_cls, segment_ids_BxL,
                            target_weights_BxL)
      if mtp_logits:
        out = (out, depth_out)
    if self.is_initializing():   # every layer exists now: a precision rule that matches none is a typo
      policy.check_rules(cfg, traverse_util.flatten_dict(nn.unbox(self.variables.get("params", {}))))
    return out

  def _mtp(self, embed, head, h_BxLxD, tokens_BxL, targets_BxL, block_cls, segment_ids_BxL, target_weights_BxL):
    """The MTP depths (``models.mtp``) on the main model's final hidden state: each depth's loss sown into
    ``mtp.LOSSES`` (with targets), or the depths' logits (without; init builds the modules this way)."""
    cfg = self.config
    modules = [mtp.MTPDepth(cfg, block_cls, self.recipe, name=f"mtp_{d}") for d in range(cfg.mtp_modules)]
    out = []
    for depth in range(1, cfg.mtp_depths + 1):
      if targets_BxL is None:
        tokens_d = mtp.shift_left(tokens_BxL, depth)
      else:
        tokens_d, targets_d, weights_d = mtp.depth_inputs(targets_BxL, depth, target_weights_BxL)
      with scopes.part("embed"):
        e_BxLxD = _lookup(embed, tokens_d, cfg.dtype)
      h_BxLxD = modules[min(depth, cfg.mtp_modules) - 1](h_BxLxD, e_BxLxD, segment_ids_BxL)
      if targets_BxL is None:
        out.append(head(h_BxLxD))
      else:
        self.sow(mtp.LOSSES, "loss", head(h_BxLxD, targets_d, weights_d))
    return tuple(out)


def abstract_variables(model: LanguageModel, batch_size: int = 1, length: int = 1, *, decode=False):
  """``jax.eval_shape`` of ``model.init``: the boxed (logically partitioned) variable tree, unallocated."""
  key = jax.random.key(0)
  tokens = jnp.zeros((batch_size, length), jnp.int32)
  return jax.eval_shape(lambda: model.init({"params": key, "fp4": key}, tokens, decode=decode))


def count_params(config: ModelConfig) -> int:
  """Number of parameters, without allocating them."""
  params = abstract_variables(LanguageModel(config))["params"]
  return sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))


def init_cache(model: LanguageModel, batch_size: int, max_len: int):
  """Zeroed decode cache (the "cache" collection) for sequences of up to ``max_len`` tokens."""
  abstract = abstract_variables(model, batch_size, max_len, decode=True)["cache"]
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)


@functools.lru_cache(maxsize=16)
def _logical_axes(config: ModelConfig) -> dict[tuple[str, ...], tuple[str, ...]]:
  """``{parameter path: logical axis names}`` (the parameter tree does not depend on the recipe)."""
  boxed = abstract_variables(LanguageModel(config))["params"]
  flat = traverse_util.flatten_dict(boxed, is_leaf=lambda _, v: isinstance(v, nn.Partitioned))
  return {path: leaf.names for path, leaf in flat.items() if isinstance(leaf, nn.Partitioned)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _shard_gradient(p, names):
  """Identity on a parameter; its gradient is constrained to the parameter's own (sharded) layout the
  moment it is complete, behind an optimization barrier. Without it the partitioner's all-reduce +
  dynamic-slice keeps the whole reduced gradient alive until the optimizer consumes the slice (the
  CPU compiler fuses the slice into the update), i.e. every layer's full float32 gradient at once.
  ``names``: the parameter's logical axis names, or the ``jax.sharding.Sharding`` its gradient goes to."""
  del names
  return p


def _shard_gradient_fwd(p, names):
  del names
  return p, None


def _shard_gradient_bwd(names, _, g):
  if isinstance(names, jax.sharding.Sharding):
    return (jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(g, names)),)
  return (jax.lax.optimization_barrier(nn.with_logical_constraint(g, names)),)


_shard_gradient.defvjp(_shard_gradient_fwd, _shard_gradient_bwd)


def compute_params(model: LanguageModel, params, gradient_shardings=None):
  """``params`` (float32 master weights) with the embedding, the routed experts' kernels (which
  ``models.moe.ExpertLinear`` casts, quantized or not) and every bf16-policy linear kernel cast to
  ``config.dtype`` where they live: the cast is constrained to the parameter's own logical sharding, so an
  FSDP all-gather moves the compute dtype rather than float32, and the gradient comes back through the
  cast in float32 as before (the GEMMs and their rounding are unchanged). Quantized dense layers keep their
  float32 kernels (fp4jax quantizes the shard and gathers the codes), as does an MoE router (float32 by
  definition); the LM head casts per vocabulary
  chunk itself; norms, conv and SSM parameters stay float32. Every parameter's gradient is reduced to its
  shard as soon as it is complete (``_shard_gradient``): the parameter's logical sharding, or with
  ``gradient_shardings`` (a tree like ``params`` of ``jax.sharding.Sharding``) the one given (a caller that
  passes parameters gathered ahead of the layers keeps their gradients where it stores them). A parameter
  already in ``config.dtype`` is not cast again."""
  cfg = model.config
  axes = _logical_axes(cfg)
  flat = traverse_util.flatten_dict(nn.unbox(params))
  placed = traverse_util.flatten_dict(gradient_shardings) if gradient_shardings is not None else {}
  for path, p in flat.items():
    p = _shard_gradient(p, placed.get(path, axes[path]))
    gemm_weight = path[-1] in ("kernel", "embedding") and path[0] != "lm_head" and "router" not in path
    expert = len(path) >= 3 and path[-3] == "experts"
    bf16 = expert or layer_precision(cfg, model.recipe, path[:-1]) == "bf16"
    if gemm_weight and p.dtype != cfg.dtype and bf16:
      with scopes.part("param_cast"):
        p = nn.with_logical_constraint(p.astype(cfg.dtype), axes[path])
    flat[path] = p
  return traverse_util.unflatten_dict(flat)


def quantize_experts_ahead(model: LanguageModel, params) -> dict:
  """The routed experts' fprop codes and scales, made from ``params`` (``compute_params``'s, placed as they are
  stored) ahead of the layers, for the ``PREQUANTIZED`` collection: a tree like ``params`` holding, at each
  experts' kernel whose recipe reads it only through those codes (``fp4jax.can_quantize_weight``),
  the ``QTensor`` that ``models.moe.ExpertLinear`` would make from that kernel (a scanned group's stacked
  along its leading axis). Each expert's codes depend on that expert's weight alone, so each device makes its
  own experts' and a gather of the tree moves codes and scales where a gather of the kernels moves bf16 (the
  weights gathered once per step, ``training.step.step_gradients``). The same bits as the layer's own."""
  cfg = model.config
  out = {}
  for path, kernel in traverse_util.flatten_dict(nn.unbox(params)).items():
    if len(path) < 3 or path[-3] != "experts" or path[-1] != "kernel":
      continue
    recipe = expert_recipe(cfg, model.recipe, path[:-1])
    if not can_quantize_weight(recipe):
      continue
    with scopes.part("moe_experts"):
      out[path] = _codes(lambda w, recipe=recipe: grouped.quantize_experts(w, recipe=recipe).q, kernel, 3, cfg)
  return traverse_util.unflatten_dict(out)


def _codes(quantize, kernel, ndim: int, cfg: ModelConfig):
  """``quantize`` (of one layer's ``ndim``-dimensional kernel) of ``kernel`` cast to the compute dtype, as the
  layer casts it, vmapped over a scanned group's leading layer axes."""
  for _ in range(kernel.ndim - ndim):
    quantize = jax.vmap(quantize)
  return quantize(kernel.astype(cfg.dtype))


def quantize_dense_ahead(model: LanguageModel, params) -> dict:
  """The linear layers' fprop codes and scales, made from ``params`` once per step ahead of the layers, for the
  ``PREQUANTIZED`` collection: at each dense kernel whose layer's recipe (``policy.decide``) reads it only through
  those codes (``fp4jax.can_quantize_weight``; OutControl layers excepted), the ``QTensor`` that the layer's
  ``fp4jax.flax.Dense`` would make from it, of the kernel cast to the compute dtype as the layer casts it (a
  scanned group's stacked along its leading axes: one quantize for all its layers). The same bits as the
  layer's own; the layer scan then neither quantizes its weights nor saves their codes per layer. A kernel no
  Dense reads (the MoE router's) gets codes that nothing uses and XLA drops."""
  cfg = model.config
  out = {}
  for path, kernel in traverse_util.flatten_dict(nn.unbox(params)).items():
    if path[-1] != "kernel" or "experts" in path or kernel.ndim < 2:
      continue
    recipe = policy.decide(cfg, model.recipe, path[:-1]).recipe
    if recipe is None or not can_quantize_weight(recipe) or policy.outcontrol_ratio(cfg, model.recipe, path[:-1]):
      continue
    with scopes.part("linear"):
      out[path] = _codes(lambda w, recipe=recipe: quantize_weight(w, recipe=recipe).q, kernel, 2, cfg)
  return traverse_util.unflatten_dict(out)
