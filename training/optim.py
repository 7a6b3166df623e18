"""Optimizer: AdamW (β 0.9/0.95) with weight decay on matrices only, global-norm clipping, and the
learning-rate schedules: warmup-stable-decay (the paper's), cosine, constant.

Master weights, gradients and optimizer moments are fp32 (``fp32_params`` casts the initialized tree).

``OsciReset``: TetraJet-v2's oscillation reset as the trainer runs it, after ``optax.apply_updates``, on the
linear kernels the precision policy quantizes; its state is the train state's ``osci_reset`` entry.

``OutControl``: TetraJet-v2's OutControl schedule, the phase of each step (plain, record, on); its state is
the model's ``"outcontrol"`` variable collection (``models.layers.OutControlDense``), the train state's
``outcontrol`` entry.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from fp4jax import osci_reset, outcontrol, recipes
from models import layer_precision


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The learning rate as a function of the number of applied updates: ``kind`` ("wsd", "cosine",
  "constant") and ``points``, float32 [peak, floor, warmup, knee, decay_steps] (steps as floats).

  ``wsd``: linear warmup to ``peak``, constant, then linear decay to ``floor`` over ``decay_steps``, from the
  ``knee`` on (the paper: 4.5e-4 -> 4.5e-6 over the last 20%). ``cosine``: linear warmup, then cosine decay
  from ``peak`` at ``warmup`` to ``floor`` at the ``knee`` (the run's last step), flat after.
  ``constant``: linear warmup, then ``peak``. The train step takes ``points`` as an argument (``learning_rate``
  on traced points): runs that differ only in length or learning rate share one compiled step."""
  kind: str
  points: np.ndarray

  def __call__(self, count):
    return learning_rate(self.kind, jnp.asarray(self.points), count)


def schedule(optim_config, total_steps: int) -> Schedule:
  """``config.optim``'s schedule for a run of ``total_steps`` steps."""
  peak = optim_config.lr
  floor = peak * optim_config.min_lr_ratio
  warmup = min(optim_config.warmup_steps, total_steps)
  if optim_config.schedule == "cosine":
    knee, steps = max(total_steps, warmup + 1), 1
  else:
    decay = int(round(optim_config.decay_fraction * total_steps))
    knee, steps = warmup + max(total_steps - decay - warmup, 0), max(decay - 1, 1)
  return Schedule(optim_config.schedule, np.asarray([peak, floor, warmup, knee, steps], np.float32))


def learning_rate(kind: str, points, count) -> jax.Array:
  """``Schedule``'s learning rate after ``count`` applied updates, ``points`` concrete or traced."""
  peak, floor, warmup, knee, steps = (points[i] for i in range(5))
  count = jnp.asarray(count, jnp.float32)
  rising = peak * (jnp.minimum(count, warmup) / jnp.maximum(warmup, 1.0))
  if kind == "constant":
    after = peak
  elif kind == "cosine":
    frac = jnp.minimum(count - warmup, knee - warmup) / (knee - warmup)
    after = floor + (peak - floor) * (0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
  else:
    frac = jnp.clip(count - knee, 0.0, steps) / steps
    after = peak + (floor - peak) * frac
  return jnp.where(count < warmup, rising, after)


def decay_mask(params):
  """True for matrices (ndim >= 2): no weight decay on norms, biases, or any other 1-D parameter."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim_config, total_steps: int) -> tuple[optax.GradientTransformation, Schedule]:
  """(AdamW with clipping at learning rate 1, the schedule): ``training.step.train_step`` scales the
  optimizer's updates by the schedule's learning rate, so the compiled step does not depend on it."""
  tx = optax.chain(
      optax.clip_by_global_norm(optim_config.grad_clip),
      optax.adamw(1.0, b1=optim_config.b1, b2=optim_config.b2, eps=optim_config.eps,
                  weight_decay=optim_config.weight_decay, mask=decay_mask),
  )
  return tx, schedule(optim_config, total_steps)


def global_norm(tree) -> jax.Array:
  """The L2 norm of all leaves together, in fp32 (what clip_by_global_norm clips)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def fp32_params(params):
  """Master weights are fp32 whatever the model's param_dtype: floating leaves are cast."""
  return jax.tree.map(lambda p: p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


@dataclasses.dataclass(frozen=True)
class OsciReset:
  """``fp4jax.osci_reset`` on the FP4 kernels of ``recipe`` under the model's precision policy.

  Tracked: every ``kernel`` of a linear layer that ``models.layer_precision`` puts in the recipe itself (not
  the bf16 layers, nor those a precision rule gives another recipe such as MXFP8; the
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
            and layer_precision(self.model_config, self.recipe, path[:-1]) == recipes.get(self.recipe).name]

  def init(self, params) -> dict:
    """The zero state: an ``osci_reset.LeafState`` of zeros at each tracked kernel's path, nothing else."""
    flat = traverse_util.flatten_dict(params)
    subset = traverse_util.unflatten_dict({path: flat[path] for path in self.tracked(params)})
    return osci_reset.init(subset, None)

  def apply(self, params, state, step, outcontrol_state=None):
    """(params, state) after OsciReset of the optimizer step ``step`` (0-based, the one just applied): the
    pure ``osci_reset.update`` on the tracked kernels, every other leaf returned as it came.

    ``outcontrol_state``: OutControl's calibrated state (the "on" phase). A kernel with an OutControl ``perm``
    is tracked in its gathered channel order, so Q(w) forms its blocks over the FP4 channels as the forward
    GEMM does (k8 is a multiple of 128: no block mixes FP8 and FP4 channels); its k8 MXFP8 channels are
    never reset and their state stays zero. The state stays in the kernel's own channel order.
    """
    flat = traverse_util.flatten_dict(params)
    paths = self.tracked(params)
    flat_outcontrol = traverse_util.flatten_dict(outcontrol_state) if outcontrol_state is not None else {}
    perms = {path[:-1]: perm for path, perm in flat_outcontrol.items() if path[-1] == "perm"}
    plain = [path for path in paths if path[:-1] not in perms]
    flat_state = traverse_util.flatten_dict(state)
    subset = traverse_util.unflatten_dict({path: flat[path] for path in plain})
    sub_state = traverse_util.unflatten_dict({path: flat_state[path] for path in plain})
    new_subset, new_sub_state = osci_reset.update(subset, sub_state, step, self.config)
    flat.update(traverse_util.flatten_dict(new_subset))
    flat_state.update(traverse_util.flatten_dict(new_sub_state))
    for path in paths:
      if path[:-1] in perms:
        flat[path], flat_state[path] = self._update_gathered(flat[path], flat_state[path], perms[path[:-1]], step)
    return traverse_util.unflatten_dict(flat), traverse_util.unflatten_dict(flat_state)

  def _update_gathered(self, w_xKxN, leaf_state, perm_xK, step):
    """``osci_reset.update`` of one OutControl kernel on its rows gathered by ``perm`` (FP8 rows first)."""
    k_in = w_xKxN.shape[-2]
    n_fp8 = outcontrol.k8(k_in, self.model_config.outcontrol_ratio)
    order, inverse = perm_xK[..., :, None], jnp.argsort(perm_xK, axis=-1)[..., :, None]
    fp4_rows = (jnp.arange(k_in) >= n_fp8)[:, None]
    cfg = self.config
    step = jnp.asarray(step, jnp.int32)
    in_window = (step >= cfg.start) & (step % cfg.period <= cfg.detect_steps + 1)

    def work(args):
      w, st = args
      gather = lambda t: jnp.take_along_axis(t, order, axis=-2)
      scatter = lambda t: jnp.take_along_axis(t, inverse, axis=-2)
      w_g = gather(w)
      new_w_g, new_st_g = osci_reset.update(w_g, osci_reset.LeafState(*map(gather, st)), step, cfg)
      new_w_g = jnp.where(fp4_rows, new_w_g, w_g)
      new_st_g = osci_reset.LeafState(*(jnp.where(fp4_rows, x, jnp.zeros_like(x)) for x in new_st_g))
      return scatter(new_w_g), osci_reset.LeafState(*map(scatter, new_st_g))

    return jax.lax.cond(in_window, work, lambda args: args, (w_xKxN, leaf_state))


PLAIN, RECORD, ON = "plain", "record", "on"


@dataclasses.dataclass(frozen=True)
class OutControl:
  """TetraJet-v2's OutControl schedule: the phase of the step of index ``step`` (0-based).

  ``plain`` before ``record_start`` (the recipe's forward, bit for bit as without OutControl); ``record`` for
  the ``record_steps`` steps from there (the same forward, plus the channel norms accumulated and the
  permutation re-sorted, so it is final after the last of them); ``on`` from ``on_step`` to the end (the
  k8 top-norm channels of each layer in MXFP8). ``ratio`` is the model's ``outcontrol_ratio``.
  """
  ratio: float
  record_start: int
  record_steps: int

  @property
  def on_step(self) -> int:
    """The first step with the channel split."""
    return self.record_start + self.record_steps

  def phase_at(self, step: int) -> str:
    if step < self.record_start:
      return PLAIN
    return RECORD if step < self.on_step else ON
