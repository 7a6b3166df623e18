"""OsciReset (TetraJet-v2): snap weights that oscillate across a quantization boundary to the bin centre.

Called after every optimizer step with k = the index of the step just applied (0-based). Per FP4
weight element it keeps w_prev, D_Q and D_FP (float32, shaped like the weight); Q(w) is the
dequantized round-to-nearest DBQ of the float32 master weight along its input-feature axis
(``fp4jax.dbq``). With period P, detection steps N, start S and threshold thr:

  if k >= S:
    k % P == 0:           w_prev = w;  D_Q = 0;  D_FP = 0                          (1) snapshot
    1 <= k % P <= N:      D_Q += |Q(w) - Q(w_prev)|;  D_FP += |w - w_prev|;  w_prev = w   (2) track
    k % P == N + 1:       ratio = D_Q / D_FP (0 where D_FP is 0)                   (3) reset, once
                          w = Q(w) where ratio >= thr;  the state is zeroed
A weight whose quantized value moved thr times as far as its latent value during N steps is flipping
between two FP4 values; it is set to the nearer one. Only the master weights change, never the
optimizer moments. The state is a pytree with fixed shapes (zeros outside a window), so it lives in
the train state and the checkpoint and a resumed run continues bit for bit.

Two ways to use it:
- ``update(params, state, step, config)`` after ``optax.apply_updates``: exact.
- ``transform(config, mask)``, an optax ``GradientTransformation`` to chain last: it turns the final
  updates into ``Q(w) - params`` for the reset elements, so ``apply_updates`` lands on Q(w) up to the
  rounding of that difference (other elements and steps are untouched, bit for bit).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fp4jax.numerics import dbq
from fp4jax._exact import div


@dataclasses.dataclass(frozen=True)
class OsciResetConfig:
  """period P, detect_steps N, start S (steps), threshold thr; axis: the input-feature axis of each
  tracked weight (0 for fp4jax's w_KxN kernels)."""
  period: int = 200
  detect_steps: int = 50
  start: int = 0
  threshold: float = 8.0
  axis: int = 0

  def __post_init__(self):
    if not self.period >= self.detect_steps + 2:
      raise ValueError(f"OsciReset period={self.period} must be at least detect_steps + 2 = "
                       f"{self.detect_steps + 2} (snapshot, {self.detect_steps} tracking steps, reset)")
    if self.detect_steps < 1 or self.start < 0 or self.threshold <= 0:
      raise ValueError("OsciReset needs detect_steps >= 1, start >= 0 and threshold > 0; the paper's "
                       "configs use detect_steps=50, threshold=8 and start at ~60-70% of the run")

  @classmethod
  def for_run(cls, total_steps: int, *, period_fraction=0.012, start_fraction=0.65, **kw):
    """The spec's proposal in fractions of the run: P ≈ 1.2% of the steps (at least N + 2), S ≈ 65%."""
    detect = kw.pop("detect_steps", 50)
    period = max(int(round(total_steps * period_fraction)), detect + 2)
    return cls(period=period, detect_steps=detect, start=int(total_steps * start_fraction), **kw)


class LeafState(NamedTuple):
  w_prev: jnp.ndarray
  d_q: jnp.ndarray
  d_fp: jnp.ndarray


def quantized_weight(w, axis: int = 0):
  """Q(w): RTN DBQ along ``axis`` (zero-padded to a multiple of 128), dequantized, float32, shape of w."""
  w_l = jnp.moveaxis(w.astype(jnp.float32), axis, -1)
  length = w_l.shape[-1]
  extra = -length % dbq.OUTER
  if extra:
    w_l = jnp.pad(w_l, [(0, 0)] * (w_l.ndim - 1) + [(0, extra)])
  q = dbq.dequantize(dbq.quantize(w_l))[..., :length]
  return jnp.moveaxis(q, -1, axis)


def init(params, mask):
  """State for the leaves where ``mask`` (a pytree of bools, or None to track every array) is True."""
  mask = jax.tree.map(lambda _: True, params) if mask is None else mask

  def leaf(p, m):
    if not m:
      return None
    z = jnp.zeros(p.shape, jnp.float32)
    return LeafState(z, z, z)
  return jax.tree.map(leaf, params, mask)


def _leaf_update(w, st, phase, active, config):
  if st is None:
    return w, st
  snapshot = active & (phase == 0)
  track = active & (phase >= 1) & (phase <= config.detect_steps)
  reset = active & (phase == config.detect_steps + 1)

  def work(args):
    w, st = args
    w_f32 = w.astype(jnp.float32)
    q = quantized_weight(w_f32, config.axis)
    q_prev = quantized_weight(st.w_prev, config.axis)
    d_q = jnp.where(track, st.d_q + jnp.abs(q - q_prev), st.d_q)
    d_fp = jnp.where(track, st.d_fp + jnp.abs(w_f32 - st.w_prev), st.d_fp)
    ratio = jnp.where(d_fp == 0, jnp.float32(0.0), div(d_q, jnp.where(d_fp == 0, 1.0, d_fp)))
    snap = reset & (ratio >= config.threshold)
    new_w = jnp.where(snap, q.astype(w.dtype), w)
    zero = jnp.zeros_like(d_q)
    return new_w, LeafState(jnp.where(snapshot | track, w_f32, jnp.where(reset, zero, st.w_prev)),
                            jnp.where(snapshot | reset, zero, d_q), jnp.where(snapshot | reset, zero, d_fp))

  return lax.cond(snapshot | track | reset, work, lambda args: args, (w, st))


def update(params, state, step, config: OsciResetConfig):
  """(params, state) after OsciReset for the optimizer step ``step`` (0-based, the one just applied)."""
  step = jnp.asarray(step, jnp.int32)
  phase = step % config.period
  active = step >= config.start
  leaves, treedef = jax.tree.flatten(params)
  states = treedef.flatten_up_to(state)
  pairs = [_leaf_update(w, st, phase, active, config) for w, st in zip(leaves, states)]
  return (jax.tree.unflatten(treedef, [w for w, _ in pairs]),
          jax.tree.unflatten(treedef, [st for _, st in pairs]))


class TransformState(NamedTuple):
  step: jnp.ndarray     # int32: the index the next applied step will have
  osci: Any             # the ``init`` state


def transform(config: OsciResetConfig, mask=None) -> optax.GradientTransformation:
  """OsciReset as the last link of an optax chain (see the module docstring for the one rounding)."""

  def init_fn(params):
    return TransformState(jnp.zeros((), jnp.int32), init(params, mask))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("OsciReset needs the parameters: call optimizer.update(grads, state, params)")
    stepped = optax.apply_updates(params, updates)
    new_params, osci = update(stepped, state.osci, state.step, config)
    new_updates = jax.tree.map(lambda u, p, s, n: jnp.where(n == s, u, (n - p).astype(u.dtype)),
                               updates, params, stepped, new_params)
    return new_updates, TransformState(state.step + 1, osci)

  return optax.GradientTransformation(init_fn, update_fn)
