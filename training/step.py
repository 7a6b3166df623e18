"""The model and the pure, jitted step functions of the pretraining loop.

A batch is ``tokens_BxW``, or with document masking (``config.data.document_masking``) the packer's
``{"tokens": tokens_BxW, "segment_ids": segment_ids_BxW}`` (``training.data``): the model then keeps each
document of a window to itself, and the loss leaves out every target that starts a document (nothing
before it in its document predicts it).

Legend: B global batch (the optimizer step's), N micro-batches, b = B / N rows of one, L sequence length,
W = L + 1 window, V vocabulary.
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
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from fp4jax import partition_cache
from models import attention, moe, mtp, policy
from models.layers import OUTCONTROL
from models.lm import LanguageModel, compute_params, quantize_dense_ahead, quantize_experts_ahead
from training import optim
from training import sharding


# ------------------------------------------------------------------------------------------ the model

def build_model(model_config, recipe) -> nn.Module:
  """The language model: ``apply({"params": p}, tokens_BxL, rngs={"fp4": key}) -> logits_BxLxV``."""
  return LanguageModel(config=model_config, recipe=recipe)


def batch_parts(batch) -> tuple[jax.Array, jax.Array | None]:
  """(tokens_BxW, segment_ids_BxW or None) of a batch: ``tokens_BxW`` or ``{"tokens", "segment_ids"}``."""
  if isinstance(batch, dict):
    return batch["tokens"], batch["segment_ids"]
  return batch, None


def window(batch) -> tuple[jax.Array, jax.Array, dict]:
  """(inputs_BxL, targets_BxL, documents) of a batch: ``documents`` the ``LanguageModel``'s document-masking
  arguments, ``segment_ids_BxL`` of the inputs and ``target_weights_BxL`` (0 where target t starts another
  document than input t's), or {} without segment ids."""
  tokens_BxW, segment_ids_BxW = batch_parts(batch)
  inputs_BxL, targets_BxL = tokens_BxW[:, :-1], tokens_BxW[:, 1:]
  if segment_ids_BxW is None:
    return inputs_BxL, targets_BxL, {}
  same_BxL = segment_ids_BxW[:, :-1] == segment_ids_BxW[:, 1:]
  return inputs_BxL, targets_BxL, dict(segment_ids_BxL=segment_ids_BxW[:, :-1], target_weights_BxL=same_BxL)


def model_loss(model, params, inputs_BxL, targets_BxL, key, documents=None):
  """Mean next-token cross entropy of ``model`` (the evaluation loss: MTP depths do not run). A
  ``LanguageModel`` computes it inside (vocabulary-chunked, no B x L x V float32 logits) from
  ``compute_params`` (bf16 weights gathered in bf16); any other module returns logits for ``cross_entropy``.
  With MoE blocks and ``moe_aux_loss_weight`` the balance loss is added. ``documents``: ``window``'s."""
  return _apply_loss(model, params, {}, inputs_BxL, targets_BxL, key, mutable=False, with_mtp=False,
                     documents=documents)[0]


def model_loss_and_stats(model, params, inputs_BxL, targets_BxL, key, documents=None, gradient_shardings=None,
                         prequantized=None):
  """(the training objective, stats): the MoE blocks' routing statistics ``moe_stats`` ({} without MoE
  blocks) and, with MTP depths, ``stats[mtp.LOSSES] = {"main": next-token loss, "depths": (depth 1, ...)}``;
  the objective is ``mtp.objective`` of them (plus the MoE balance loss). ``gradient_shardings``: where each
  parameter's gradient goes (``models.lm.compute_params``; default its own logical placement);
  ``prequantized``: weights' codes made ahead (``models.lm.quantize_dense_ahead``'s, or with the weights gathered
  once per step ``quantize_experts_ahead``'s), or None."""
  loss, _, stats = _apply_loss(model, params, _prequantized(prequantized), inputs_BxL, targets_BxL, key,
                               mutable=False, documents=documents, gradient_shardings=gradient_shardings)
  return loss, stats


def _prequantized(tree) -> dict:
  """The variable collections that carry ``tree`` (weights' codes made ahead) to the layers."""
  return {moe.PREQUANTIZED: tree} if tree else {}


def _has_moe(model) -> bool:
  return isinstance(model, LanguageModel) and "E" in model.config.all_patterns


def _has_mtp(model) -> bool:
  return isinstance(model, LanguageModel) and model.config.mtp_depths > 0


def model_loss_outcontrol(model, params, outcontrol, inputs_BxL, targets_BxL, key, *, record: bool,
                          with_mtp: bool = True, documents=None, gradient_shardings=None, prequantized=None):
  """(loss, (OutControl state after the call, stats)) of ``model`` with its ``"outcontrol"`` collection: with
  ``record`` the recipe's forward that also accumulates the channel norms (the collection mutable), else
  the forward with the calibrated MXFP8/NVFP4 channel split (the state returned as it came). ``with_mtp``:
  the training objective (else the next-token loss alone, as ``model_loss``); ``gradient_shardings`` and
  ``prequantized`` as in ``model_loss_and_stats``."""
  loss, updated, stats = _apply_loss(model, params, {OUTCONTROL: outcontrol, **_prequantized(prequantized)},
                                     inputs_BxL, targets_BxL, key,
                                     mutable=[OUTCONTROL] if record else False, with_mtp=with_mtp,
                                     documents=documents, gradient_shardings=gradient_shardings)
  return loss, ((updated[OUTCONTROL] if record else outcontrol), stats)


def _apply_loss(model, params, collections, inputs_BxL, targets_BxL, key, *, mutable, with_mtp: bool = True,
                documents=None, gradient_shardings=None):
  """(loss, the mutable collections after the call, or None, stats) of ``model`` with ``params`` and the
  other variable ``collections``; see ``model_loss`` and ``model_loss_and_stats``."""
  is_lm = isinstance(model, LanguageModel)
  if documents and not is_lm:
    raise ValueError(f"document masking (segment ids in the batch) needs a models.LanguageModel, not a "
                     f"{type(model).__name__}")
  variables = {"params": compute_params(model, params, gradient_shardings) if is_lm else params, **collections}
  kwargs = dict(targets_BxL=targets_BxL, **(documents or {})) if is_lm else {}
  with_moe = _has_moe(model)
  with_mtp = with_mtp and _has_mtp(model)
  collect = (list(mutable) if mutable else []) + ([moe.STATS] if with_moe else []) + ([mtp.LOSSES] if with_mtp else [])
  out = model.apply(variables, inputs_BxL, rngs={"fp4": key}, mutable=collect or False, **kwargs)
  out, updated = out if collect else (out, None)
  loss = out if is_lm else cross_entropy(out, targets_BxL)
  stats = {}
  if with_moe:
    updated = dict(updated)
    stats = dict(updated.pop(moe.STATS, {}))
    aux = [v for path, v in traverse_util.flatten_dict(stats).items() if path[-1] == "aux_loss"]
    if aux and model.config.moe_aux_loss_weight:
      loss = loss + model.config.moe_aux_loss_weight * sum(jnp.sum(jnp.stack(a)) for a in aux)
  if with_mtp:
    updated = dict(updated)
    depths = mtp.sown_losses({mtp.LOSSES: updated.pop(mtp.LOSSES, {})})
    stats[mtp.LOSSES] = {"main": loss, "depths": depths}
    loss = mtp.objective(model.config, loss, depths)
  return loss, (updated if mutable else None), stats


def mtp_metrics(stats) -> dict:
  """``loss`` (the next-token loss), ``objective`` (what the step minimizes), ``mtp/loss`` (the mean over
  depths) and ``mtp/loss_<d>`` of a step with MTP depths; {} without."""
  losses = stats.get(mtp.LOSSES)
  if not losses:
    return {}
  depths = losses["depths"]
  out = {"loss": losses["main"], "mtp/loss": jnp.mean(jnp.stack(list(depths)))}
  out.update({f"mtp/loss_{d}": value for d, value in enumerate(depths, start=1)})
  return out


def moe_balance(params, stats, rate: float):
  """(params with every MoE router's ``e_score_correction_bias`` moved by the aux-loss-free update
  ``bias += rate · sign(mean load - load)`` (``models.moe.bias_update``) from this step's loads, and the
  per-layer metrics ``moe/<block>/max_vio``, ``entropy``, ``dropped`` (the (token, expert) pairs expert
  parallelism dropped in the step's batch, ``moe_receive_factor``; 0 when dropless; for a scanned group the
  mean over its blocks))."""
  flat_stats = traverse_util.flatten_dict({k: v for k, v in stats.items() if k != mtp.LOSSES})
  if not flat_stats:
    return params, {}
  is_box = lambda v: isinstance(v, nn.Partitioned)
  flat = traverse_util.flatten_dict(params, is_leaf=lambda _, v: is_box(v))
  metrics = {}
  for path, loads in flat_stats.items():
    if path[-1] != "load":
      continue
    load = loads[0]
    target = (*path[:-2], "mixer", "router", "e_score_correction_bias")
    if rate:
      leaf = flat[target]
      bias = leaf.unbox() if is_box(leaf) else leaf
      new = jax.lax.stop_gradient(moe.bias_update(bias, load, rate)).astype(bias.dtype)
      flat[target] = leaf.replace_boxed(new) if is_box(leaf) else new
    block = policy.module_path(path[:-2])   # blocks_3, mtp_0/layers_1 (scanned groups' level dropped)
    for name, value in moe.load_metrics(load).items():
      metrics[f"moe/{block}/{name}"] = jnp.mean(value)
    dropped = flat_stats.get((*path[:-1], "dropped"))
    metrics[f"moe/{block}/dropped"] = jnp.zeros((), jnp.float32) if dropped is None else jnp.mean(dropped[0])
  return traverse_util.unflatten_dict(flat), metrics


# ------------------------------------------------------------------------------------- pure functions

def init_state(model, tx, seed: int, seq_len: int, osci: optim.OsciReset | None = None):
  """The train state: fp32 params (boxed with logical axis names), optimizer state, step, RNG, health; with
  ``osci``, OsciReset's state as ``osci_reset``; for a model with OutControl layers (``outcontrol_ratio``),
  their ``"outcontrol"`` collection as ``outcontrol``."""
  root = jax.random.PRNGKey(seed)
  k_params, k_fp4, k_train = jax.random.split(root, 3)
  tokens_1xL = jnp.zeros((1, seq_len), jnp.int32)
  variables = model.init({"params": k_params, "fp4": k_fp4}, tokens_1xL)
  params = variables["params"]
  params = jax.tree.map(lambda p: p.replace_boxed(optim.fp32_params(p.unbox())) if isinstance(p, nn.Partitioned)
                        else optim.fp32_params(p), params, is_leaf=lambda p: isinstance(p, nn.Partitioned))
  state = dict(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(nn.unbox(params)), rng=k_train,
               nonfinite_total=jnp.zeros((), jnp.int32), nonfinite_streak=jnp.zeros((), jnp.int32))
  if osci is not None:
    state["osci_reset"] = osci.init(nn.unbox(params))
  if OUTCONTROL in variables:
    state["outcontrol"] = variables[OUTCONTROL]
  return state


def cross_entropy(logits_BxLxV, targets_BxL):
  """Mean next-token cross entropy in nats, computed in fp32."""
  logits_BxLxV = logits_BxLxV.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def micro_batches_of(batch, micro_batches: int):
  """``batch`` (``tokens_BxW``, or the dict with its segment ids) with each array as N x b x W: micro-batch i
  holds rows i, i + N, i + 2N, ... of the step's batch. The batch's rows are split over the devices in contiguous
  blocks of B / devices (``sharding.batch_sharding``), each a multiple of N, so every device already holds its
  b / devices rows of every micro-batch: the split moves no data."""
  def split(x_BxW):
    b = x_BxW.shape[0] // micro_batches
    x_NxbxW = x_BxW.reshape(b, micro_batches, -1).swapaxes(0, 1)
    return nn.with_logical_constraint(x_NxbxW, (None, "activation_batch", None))
  return jax.tree.map(split, batch)


_COUNTS = ("load", "dropped")   # the MoE blocks' per-step counts (models.moe); every other stat is a loss


def _is_count(path) -> bool:
  """Whether the stat at ``path`` is a count (summed over the batch's parts) rather than a loss (averaged)."""
  return any(getattr(k, "key", None) in _COUNTS for k in path)


def combine_micro_batch_stats(stats_N):
  """The step's stats from its micro-batches' (every leaf with a leading axis of N): the MoE counts summed (the
  whole batch's loads and dropped pairs), the losses (MTP's, the balance loss) averaged as the loss is."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x_N: jnp.sum(x_N, axis=0) if _is_count(path) else jnp.mean(x_N, axis=0), stats_N)


def _summed_gradients(grad_fn, params, outcontrol, batch, key, micro_batches: int):
  """``((loss, (outcontrol, stats)), summed grads)``: ``accumulate_gradients`` before the division by N."""
  def one(carry, xs):
    sum_grads, outcontrol = carry
    index, micro_batch = xs
    (loss, (outcontrol, stats)), grads = grad_fn(params, outcontrol, micro_batch, jax.random.fold_in(key, index))
    sum_grads = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), sum_grads, grads)
    return (sum_grads, outcontrol), (loss, stats)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  xs = (jnp.arange(micro_batches), micro_batches_of(batch, micro_batches))
  (sum_grads, outcontrol), (loss_N, stats_N) = jax.lax.scan(one, (zeros, outcontrol), xs)
  return (jnp.mean(loss_N), (outcontrol, combine_micro_batch_stats(stats_N))), sum_grads


def accumulate_gradients(grad_fn, params, outcontrol, batch, key, micro_batches: int):
  """``((loss, (outcontrol, stats)), grads)`` of the step's batch, where ``grad_fn(params, outcontrol,
  batch, key)`` gives them for one batch. With one micro-batch, ``grad_fn`` of the batch and ``key`` (the
  step without micro-batches, unchanged). With N, a ``lax.scan`` over ``micro_batches_of(batch, N)``:
  micro-batch i draws its stochastic rounding from ``fold_in(key, i)``, OutControl's state is carried from
  one micro-batch to the next, the gradients are summed in float32 and divided by N once, the loss is the
  mean of the micro-batches' (each a mean over its b x L targets: the batch's mean; with document masking each
  micro-batch's mean is over its own unmasked targets), the stats ``combine_micro_batch_stats``."""
  if micro_batches == 1:
    return grad_fn(params, outcontrol, batch, key)
  (loss, aux), sum_grads = _summed_gradients(grad_fn, params, outcontrol, batch, key, micro_batches)
  return (loss, aux), jax.tree.map(lambda s: s / micro_batches, sum_grads)


def accumulate_gradients_unreduced(grad_fn, params, batch, key, micro_batches: int, gather: sharding.StepGather):
  """``accumulate_gradients`` (without OutControl's state) with each gradient reduced over the mesh axes
  ``gather.unreduced`` once, after the micro-batches: they run inside a ``shard_map`` manual over those axes,
  on ``params`` whole along them, each device on its own rows of every micro-batch (the same rows as without:
  ``micro_batches_of``), under ``gather.rules``; device d's float32 sum over its micro-batches leaves the
  ``shard_map`` as row d of a stack along a new leading axis, whose sum, constrained to ``gather.stored``, is the
  one reduction (a reduce-scatter to the fsdp shard). ``grad_fn(params, outcontrol, batch, key)`` is called
  with the device's rows, so every statistic of the batch is the device's: its loss a mean over its targets
  (the step's loss and gradient the mean over devices: the same to float32 summation order when every device
  has as many targets, as without document masking), its random bits drawn from ``fold_in(micro-batch key,
  device index along the axes)`` (so that no two devices draw the same), the MoE counts summed over the devices
  and the other stats averaged (docs/TRAINING.md, "Gradients reduced once per step"). What the model may hold
  inside: ``check_unreduced``."""
  axes = gather.unreduced
  devices = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)

  def local(params, batch, key):
    key = jax.random.fold_in(key, jax.lax.axis_index(axes))
    (loss, (_, stats)), sum_grads = _summed_gradients(grad_fn, params, None, batch, key, micro_batches)

    stats = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.lax.psum(x, axes) if _is_count(path) else jax.lax.pmean(x, axes), stats)
    return jax.lax.pmean(loss, axes), stats, jax.tree.map(lambda s: s[None], sum_grads)

  rows = P(axes)
  loss, stats, sums = jax.shard_map(local, in_specs=(P(), rows, P()), out_specs=(P(), P(), rows),
                                    axis_names=set(axes), check_vma=False)(params, batch, key)
  with jax.named_scope("reduce_gradients"):
    grads = jax.tree.map(lambda s_D, placed: jax.lax.with_sharding_constraint(jnp.sum(s_D, axis=0), placed),
                         sums, gather.stored)
  return (loss, (None, stats)), jax.tree.map(lambda g: g / (micro_batches * devices), grads)


def check_unreduced(model, outcontrol: bool = False) -> None:
  """A ValueError unless ``model`` can run its micro-batches with the gradients reduced once per step
  (``accumulate_gradients_unreduced``): inside a ``shard_map`` manual over some mesh axes, jax 0.10.2 hands a
  ``custom_partitioning`` op no mesh, so fp4jax's quantized ops would run replicated over the other axes (XLA
  gathers their operands) and jax's own (cuDNN attention, the block-scaled GEMM) fail to compile. So: the bf16
  recipe, attention not on cuDNN, and no OutControl state (its channel norms are over the whole batch)."""
  fix = "or set config.mesh.grad_reduce='per_micro_batch'"
  recipe = getattr(model, "recipe", "bf16")
  name = recipe if isinstance(recipe, str) else recipe.name
  if name != "bf16":
    raise ValueError(f"config.mesh.grad_reduce='per_step' with the {name} recipe: its quantized ops are "
                     "custom-partitioned, which jax 0.10.2 cannot partition inside the shard_map that keeps the "
                     f"gradients unreduced (docs/TRAINING.md, \"Gradients reduced once per step\"); use the bf16 recipe {fix}")
  if outcontrol:
    raise ValueError("OutControl's state with config.mesh.grad_reduce='per_step': its channel norms are over the "
                     f"whole batch, which the per-step reduction splits by device; {fix}")
  cfg = getattr(model, "config", None)
  if cfg is not None and "*" in cfg.all_patterns and attention.resolve_attention_impl(cfg, cfg.dtype) == "cudnn":
    raise ValueError("config.mesh.grad_reduce='per_step' with cuDNN attention: jax partitions it with "
                     "custom_partitioning, which jax 0.10.2 cannot do inside the shard_map that keeps the gradients "
                     f"unreduced; set config.model.attention_impl='chunked' {fix}")


def step_gradients(state, batch, *, model, outcontrol_phase: str = optim.PLAIN, micro_batches: int = 1,
                   gather: sharding.StepGather | None = None):
  """``((loss, (OutControl state, stats)), grads)`` of ``train_step``'s batch (its arguments of the same names),
  each gradient in its parameter's dtype and placement: the micro-batches' accumulation
  (``accumulate_gradients``), or with ``gather.unreduced`` ``accumulate_gradients_unreduced``."""
  key = jax.random.fold_in(state["rng"], state["step"])
  params, rules, placed, codes = state["params"], contextlib.nullcontext(), None, None
  unreduced = gather is not None and bool(gather.unreduced)
  if unreduced:
    check_unreduced(model, "outcontrol" in state)
  if gather is not None:
    with jax.named_scope("gather_weights"):
      narrow = params
      if isinstance(model, LanguageModel):
        # the experts the recipe reads through their codes cross the wire as codes and scales, not bf16
        narrow = compute_params(model, params)
        codes = gather.gather_codes(quantize_experts_ahead(model, narrow)) if not unreduced else None
      params, rules, placed = gather.gather(narrow), nn.logical_axis_rules(gather.rules), gather.stored
  elif isinstance(model, LanguageModel):
    # the weights do not change within a step: their codes made once, not per layer call, remat and micro-batch
    with jax.named_scope("quantize_weights"):
      codes = quantize_dense_ahead(model, params) or None

  def loss_fn(params, outcontrol, batch, key):
    inputs_BxL, targets_BxL, documents = window(batch)
    gradient_shardings = placed
    if unreduced:   # inside the shard_map: each gradient reduced within the other axes, onto its gathered spec
      mesh = jax.sharding.get_abstract_mesh()
      gradient_shardings = jax.tree.map(lambda s: NamedSharding(mesh, sharding.without(s, gather.unreduced).spec),
                                        gather.gathered)
    if outcontrol_phase == optim.PLAIN:
      loss, stats = model_loss_and_stats(model, params, inputs_BxL, targets_BxL, key, documents, gradient_shardings,
                                         codes)
      return loss, (outcontrol, stats)
    return model_loss_outcontrol(model, params, outcontrol, inputs_BxL, targets_BxL, key,
                                 record=outcontrol_phase == optim.RECORD, documents=documents,
                                 gradient_shardings=gradient_shardings, prequantized=codes)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  with jax.named_scope("forward_backward"), rules:
    if unreduced:
      (loss, (outcontrol, stats)), grads = accumulate_gradients_unreduced(grad_fn, params, batch, key, micro_batches,
                                                                          gather)
    else:
      (loss, (outcontrol, stats)), grads = accumulate_gradients(grad_fn, params, state.get("outcontrol"), batch, key,
                                                                micro_batches)
  return (loss, (outcontrol, stats)), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])


def train_step(state, batch, *, model, tx, lr_fn, osci: optim.OsciReset | None = None,
               outcontrol_phase: str = optim.PLAIN, micro_batches: int = 1, gather: sharding.StepGather | None = None):
  """One AdamW step on ``batch`` (``tokens_BxW``, or with segment ids: the module's docstring): ``tx``'s update
  at learning rate 1 (``optim.make_optimizer``) times ``lr_fn(applied updates)``; then OsciReset
  (with ``osci``) on the updated params, as the step of index "steps applied so far"; a step whose loss or
  gradient norm is non-finite leaves params, moments and OsciReset's and OutControl's state untouched.
  ``outcontrol_phase`` (static, ``optim.OutControl.phase_at``): "plain" runs the recipe's forward (the
  OutControl state, if any, passes through), "record" also accumulates the channel norms, "on" runs the
  calibrated channel split. ``micro_batches`` (static): the gradient of the batch is accumulated over that many
  micro-batches (``step_gradients``) and applied once. ``gather`` (``sharding.step_gather``): the weights,
  in the compute dtype (``models.lm.compute_params``), gathered once ahead of the micro-batches, which run under
  its rules and reduce each gradient to the parameter's own placement (the forward's numbers are the per-layer
  gather's: the same casts and quantization; the gradients' sums over the devices are grouped otherwise, the same
  to float32 summation order: docs/TRAINING.md, "Weights gathered once per step"); with ``gather.unreduced`` the
  gradients are reduced over those axes once per step (``accumulate_gradients_unreduced``)."""
  (loss, (outcontrol, stats)), grads = step_gradients(state, batch, model=model, outcontrol_phase=outcontrol_phase,
                                                      micro_batches=micro_batches, gather=gather)
  with jax.named_scope("grad_norm"):
    grad_norm = optim.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  applied = state["step"] - state["nonfinite_total"]
  lr = lr_fn(applied)
  with jax.named_scope("optimizer"):
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], jax.tree.map(lambda u: u * lr, updates))
  with jax.named_scope("moe_balance"):   # after the step, from its loads: not a gradient
    rate = model.config.moe_bias_update_rate if _has_moe(model) else 0.0
    params, moe_metrics = moe_balance(params, stats, rate)
  keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
  if osci is not None:
    with jax.named_scope("osci_reset"):
      perms = state["outcontrol"] if outcontrol_phase == optim.ON else None
      params, osci_state = osci.apply(params, state["osci_reset"], applied, outcontrol_state=perms)
  with jax.named_scope("nonfinite_guard"):
    new_state = dict(
        step=state["step"] + 1,
        params=keep(params, state["params"]),
        opt_state=keep(opt_state, state["opt_state"]),
        rng=state["rng"],
        nonfinite_total=state["nonfinite_total"] + (~ok).astype(jnp.int32),
        nonfinite_streak=jnp.where(ok, 0, state["nonfinite_streak"] + 1),
    )
    if osci is not None:
      new_state["osci_reset"] = keep(osci_state, state["osci_reset"])
    if outcontrol is not None:
      new_state["outcontrol"] = keep(outcontrol, state["outcontrol"])
  metrics = dict(loss=loss, grad_norm=grad_norm, lr=lr, nonfinite_total=new_state["nonfinite_total"],
                 nonfinite_streak=new_state["nonfinite_streak"], **moe_metrics)
  if _has_mtp(model):   # "loss" becomes the next-token loss, comparable with runs without MTP
    metrics.update(objective=loss, **mtp_metrics(stats))
  return new_state, metrics


def eval_step(params, batch, *, model):
  """Mean validation loss of one batch (the forward pass of the recipe in use, with a fixed key); with
  segment ids, over the targets that do not start a document."""
  inputs_BxL, targets_BxL, documents = window(batch)
  return model_loss(model, params, inputs_BxL, targets_BxL, jax.random.PRNGKey(0), documents)


def eval_step_outcontrol(params, outcontrol, batch, *, model):
  """``eval_step`` with OutControl's calibrated channel split (after the window)."""
  inputs_BxL, targets_BxL, documents = window(batch)
  return model_loss_outcontrol(model, params, outcontrol, inputs_BxL, targets_BxL, jax.random.PRNGKey(0),
                               record=False, with_mtp=False, documents=documents)[0]


def jit_train_step(model, tx, schedule: optim.Schedule, state_shardings, mesh, osci: optim.OsciReset | None = None,
                   outcontrol_phase: str = optim.PLAIN, compiler_options: dict | None = None,
                   micro_batches: int = 1, fsdp_gather: str = "per_layer", grad_reduce: str = "per_micro_batch"):
  """``train_step`` jitted as the trainer runs it: explicit in/out shardings, the state donated.

  ``state_shardings`` from ``sharding.train_state_shardings``; call (or ``.lower``) it under
  ``sharding.mesh_context(mesh)`` so the model's logical constraints resolve. ``compiler_options``: XLA
  options for its compile (``training.config.xla_options``: the config's, for the mesh's device kind).
  ``micro_batches``: ``config.micro_batches``; ``fsdp_gather`` and ``grad_reduce``: ``config.mesh.fsdp_gather`` and
  ``config.mesh.grad_reduce`` (``sharding.step_gather``).
  The schedule's points are an input of the program (``ScheduledStep``).
  """
  gather = sharding.step_gather({"fsdp_gather": fsdp_gather, "grad_reduce": grad_reduce}, state_shardings["params"],
                                micro_batches)

  def fn(state, batch, points):
    lr_fn = functools.partial(optim.learning_rate, schedule.kind, points)
    return train_step(state, batch, model=model, tx=tx, lr_fn=lr_fn, osci=osci, outcontrol_phase=outcontrol_phase,
                      micro_batches=micro_batches, gather=gather)

  fn.__name__ = fn.__qualname__ = "train_step"   # the program's name: jit_train_step (profiles, dumps, the ruler)
  repl = sharding.replicated(mesh)
  jitted = jax.jit(fn, in_shardings=(state_shardings, sharding.batch_sharding(mesh), repl),
                   out_shardings=(state_shardings, repl), donate_argnums=(0,),
                   compiler_options=dict(compiler_options) if compiler_options else None)
  return ScheduledStep(jitted, schedule.points, repl)


@dataclasses.dataclass(eq=False)   # hashed by identity: the loop keys what it has compiled by the function
class CompiledAtFirstCall:
  """A jitted function compiled at its first call by ``fp4jax.partition_cache.compile`` (so a program with
  fp4jax's sharded ops is found in the persistent compilation cache by a later process: a resumed run skips
  its compile on a mesh too); every call runs that one executable, on arguments of the first call's shapes and
  shardings (the trainer's are fixed)."""
  jitted: Any
  _compiled: Any = None
  _lowered: Any = None

  def __call__(self, *args):
    if self._compiled is None:
      self._lowered = self.jitted.lower(*args)
      self._compiled = partition_cache.compile(self._lowered)
    return self._compiled(*args)

  def lower(self, *args):
    return self.jitted.lower(*args)

  def hlo_text(self) -> str:
    """The compiled program's optimized HLO (after the first call)."""
    return self._compiled.as_text()

  def recompile(self, compiler_options: dict) -> None:
    """Compiles the first call's program again with ``compiler_options`` added to the jit's; later calls run
    that executable (``training.pgle``: the same program scheduled with a profile)."""
    self._compiled = partition_cache.compile(self._lowered, compiler_options)


@dataclasses.dataclass
class ScheduledStep:
  """A jitted ``(state, batch, points)`` step called as ``(state, batch)``, the schedule's points bound: the
  compiled program takes them as an input, so it is the same for every run length and learning rate. The
  points go to the devices at the first call (a deviceless compile only lowers), when the step is compiled
  (``CompiledAtFirstCall``)."""
  jitted: Any
  points: np.ndarray
  sharding: Any
  _on_devices: jax.Array | None = None
  _compiled: CompiledAtFirstCall | None = None

  def __call__(self, state, batch):
    if self._on_devices is None:
      self._on_devices = jax.device_put(self.points, self.sharding)
      self._compiled = CompiledAtFirstCall(self.jitted)
    return self._compiled(state, batch, self._on_devices)

  def lower(self, state, batch):
    return self.jitted.lower(state, batch, self.points)

  @property
  def program(self) -> CompiledAtFirstCall | None:
    """What the first call compiled (None before it)."""
    return self._compiled
