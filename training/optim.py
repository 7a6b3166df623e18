"""Optimizer: AdamW (β 0.9/0.95) with weight decay on matrices only, global-norm clipping, and the
learning-rate schedules: warmup-stable-decay (the paper's), cosine, constant.

Master weights, gradients and optimizer moments are fp32 (``fp32_params`` casts the initialized tree).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


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
