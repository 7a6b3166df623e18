"""Optimizer: AdamW (β 0.9/0.95) with weight decay on matrices only, global-norm clipping, and the
learning-rate schedules: warmup-stable-decay (the paper's), cosine, constant.

Master weights, gradients and optimizer moments are fp32 (``fp32_params`` casts the initialized tree).

``OsciReset``: TetraJet-v2's oscillation reset as the trainer runs it, after ``optax.apply_updates``, on the
linear kernels the precision policy quantizes; its state is the train state's ``osci_reset`` entry.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fp4jax import osci_reset
from models import layer_precision


def schedule(optim_config, total_steps: int) -> optax.Schedule:
  """Learning rate as a function of the number of applied updates.

  ``wsd``: linear warmup to ``lr``, constant, then linear decay to ``lr * min_lr_ratio`` over the last
  ``decay_fraction`` of the steps, reaching it at the last step (the paper: 4.5e-4 -> 4.5e-6 over the last 20%).
  ``cosine``: linear warmup, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``.
  """
  peak = optim_config.lr
  floor = peak * optim_config.min_lr_ratio
  warmup = min(optim_config.warmup_steps, total_steps)
  if optim_config.schedule == "constant":
    if not warmup:
      return optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup])
  if optim_config.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end_value=floor)
  decay = int(round(optim_config.decay_fraction * total_steps))
  stable = max(total_steps - decay - warmup, 0)
  pieces = [optax.linear_schedule(0.0, peak, warmup)] if warmup else []
  pieces += [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, max(decay - 1, 1))]
  boundaries = ([warmup] if warmup else []) + [warmup + stable]
  return optax.join_schedules(pieces, boundaries)


def decay_mask(params):
  """True for matrices (ndim >= 2): no weight decay on norms, biases, or any other 1-D parameter."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim_config, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  lr = schedule(optim_config, total_steps)
  tx = optax.chain(
      optax.clip_by_global_norm(optim_config.grad_clip),
      optax.adamw(lr, b1=optim_config.b1, b2=optim_config.b2, eps=optim_config.eps,
                  weight_decay=optim_config.weight_decay, mask=decay_mask),
  )
  return tx, lr


def global_norm(tree) -> jax.Array:
  """The L2 norm of all leaves together, in fp32 (what clip_by_global_norm clips)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def fp32_params(params):
  """Master weights are fp32 whatever the model's param_dtype: floating leaves are cast."""
  return jax.tree.map(lambda p: p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


@dataclasses.dataclass(frozen=True)
class OsciReset:
  """``fp4jax.osci_reset`` on the FP4 kernels of ``recipe`` under the model's precision policy.

  Tracked: every ``kernel`` of a linear layer that ``models.layer_precision`` puts in the recipe (the
  quantized ``nn.Dense`` kernels, ``in_features x out_features``, stacked on a leading axis when blocks
  are scanned); Q(w) runs along the input-feature axis (-2), as the forward GEMM quantizes the weight.
  The state is a nested dict holding ``osci_reset.LeafState`` only at those kernels' paths.
  """
  config: osci_reset.OsciResetConfig
  model_config: Any
  recipe: Any

  def tracked(self, params) -> list[tuple[str, ...]]:
    """The paths (name tuples) of the tracked kernels in ``params`` (plain, unboxed)."""
    return [path for path, leaf in traverse_util.flatten_dict(params).items()
            if path[-1] == "kernel" and len(leaf.shape) >= 2
            and layer_precision(self.model_config, self.recipe, path[:-1]) != "bf16"]

  def init(self, params) -> dict:
    """The zero state: an ``osci_reset.LeafState`` of zeros at each tracked kernel's path, nothing else."""
    flat = traverse_util.flatten_dict(params)
    subset = traverse_util.unflatten_dict({path: flat[path] for path in self.tracked(params)})
    return osci_reset.init(subset, None)

  def apply(self, params, state, step):
    """(params, state) after OsciReset of the optimizer step ``step`` (0-based, the one just applied): the
    pure ``osci_reset.update`` on the tracked kernels, every other leaf returned as it came."""
    flat = traverse_util.flatten_dict(params)
    paths = self.tracked(params)
    subset = traverse_util.unflatten_dict({path: flat[path] for path in paths})
    new_subset, new_state = osci_reset.update(subset, state, step, self.config)
    flat.update(traverse_util.flatten_dict(new_subset))
    return traverse_util.unflatten_dict(flat), new_state
