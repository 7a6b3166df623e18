"""The E block's pieces (models.moe): routing as transformers' NemotronHTopkRouter computes it, the dropless
layout, the balance statistics and the aux-loss-free bias update in the train step (a parameter with no
gradient, saved with the params)."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import ModelConfig, moe, presets
from models.lm import LanguageModel
from training import step as step_lib

CONFIG = ModelConfig(vocab_size=32, d_model=16, pattern="E", dtype=jnp.float32, n_routed_experts=8,
                     num_experts_per_tok=3, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                     n_group=4, topk_group=2, routed_scaling_factor=2.0, moe_bias_update_rate=0.1)


def _route_numpy(logits, bias, c):
  """NemotronHTopkRouter's steps, one token at a time in numpy."""
  scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
  weights, experts = [], []
  for s in scores:
    choice = s + bias
    per = c.n_routed_experts // c.n_group
    group = [np.sort(choice[g * per:(g + 1) * per])[-2:].sum() for g in range(c.n_group)]
    keep = np.argsort(group)[-c.topk_group:]
    masked = np.full_like(choice, -np.inf)
    for g in keep:
      masked[g * per:(g + 1) * per] = choice[g * per:(g + 1) * per]
    top = np.argsort(masked)[-c.num_experts_per_tok:]
    w = s[top] / (s[top].sum() + 1e-20) if c.norm_topk_prob else s[top]
    weights.append(w * c.routed_scaling_factor)
    experts.append(top)
  return np.array(weights), np.array(experts)


def test_route_is_group_limited_biased_top_k():
  rng = np.random.default_rng(0)
  logits, bias = rng.standard_normal((40, 8)).astype(np.float32), (0.2 * rng.standard_normal(8)).astype(np.float32)
  for norm in (True, False):
    c = CONFIG.replace(norm_topk_prob=norm)
    weights, experts, _ = moe.route(jnp.asarray(logits), jnp.asarray(bias), c)
    want_w, want_e = _route_numpy(logits, bias, c)
    order = np.argsort(np.asarray(experts), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1), np.sort(want_e, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_w, np.argsort(want_e, -1), -1), rtol=1e-6)


def test_dispatch_is_dropless_sorted_and_padded():
  experts = jnp.asarray([[2, 0], [2, 1], [0, 2]], jnp.int32)
  rows, position, sizes, counts = moe.dispatch(experts, 4, 4)
  np.testing.assert_array_equal(counts, [2, 1, 3, 0])
  np.testing.assert_array_equal(sizes, [4, 4, 4, 0])
  assert rows.shape == (20,)   # 6 pairs + 4 x 3 padding, rounded up to 4
  # expert 0: tokens 0, 2; expert 1: token 1; expert 2: tokens 0, 1, 2 (token order); the rest padding (3 = T)
  np.testing.assert_array_equal(rows[:12], [0, 2, 3, 3, 1, 3, 3, 3, 0, 1, 2, 3])
  np.testing.assert_array_equal(position, [[8, 0], [9, 4], [1, 10]])


def test_load_metrics_and_bias_update():
  m = moe.load_metrics(jnp.asarray([4.0, 4.0, 4.0, 4.0]))
  assert float(m["max_vio"]) == 0.0 and abs(float(m["entropy"]) - 1.0) < 1e-6
  m = moe.load_metrics(jnp.asarray([16.0, 0.0, 0.0, 0.0]))
  assert float(m["max_vio"]) == 3.0 and float(m["entropy"]) == 0.0
  new = moe.bias_update(jnp.zeros(4), jnp.asarray([10.0, 2.0, 4.0, 0.0]), 0.5)
  np.testing.assert_array_equal(new, [-0.5, 0.5, 0.0, 0.5])   # mean 4: the overloaded expert down


def test_sequence_aux_loss_is_one_when_balanced_and_uniform():
  # Every expert chosen equally often and equal scores: Σ f_i P_i = Σ (1)(1/E) = 1.
  experts = jnp.asarray([[[0, 1], [2, 3]]], jnp.int32)
  scores = jnp.full((1, 2, 4), 0.5)
  assert abs(float(moe.sequence_aux_loss(scores, experts, 4)) - 1.0) < 1e-6


@pytest.mark.slow   # covered by test_load_metrics_and_bias_update
def test_train_step_moves_the_bias_not_by_gradient():
  model = LanguageModel(CONFIG.replace(moe_aux_loss_weight=0.01), "bf16")
  tx = optax.adamw(1.0)   # train_step scales by lr_fn
  state = step_lib.init_state(model, tx, 0, 8)
  state = dict(state, params=nn.unbox(state["params"]))   # as the trainer runs it (training.run)
  bias_path = ("blocks_0", "mixer", "router", "e_score_correction_bias")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, 9)), jnp.int32)

  def get(params):
    node = nn.unbox(params)
    for k in bias_path:
      node = node[k]
    return node

  loss_fn = lambda p: step_lib.model_loss(model, p, tokens[:, :-1], tokens[:, 1:], jax.random.key(0))
  grads = jax.grad(loss_fn)(state["params"])
  np.testing.assert_array_equal(get(grads), 0.0)     # the bias is not a gradient
  new, metrics = jax.jit(lambda s, t: step_lib.train_step(s, t, model=model, tx=tx, lr_fn=lambda _: 1e-3))(state, tokens)
  moved = np.asarray(get(new["params"]) - get(state["params"]))
  assert np.all(np.isclose(np.abs(moved), 0.1, rtol=1e-6) | (moved == 0)) and np.any(moved != 0)   # ± γ or 0
  assert {"moe/blocks_0/max_vio", "moe/blocks_0/entropy", "moe/blocks_0/dropped"} <= set(metrics)
  assert float(metrics["moe/blocks_0/dropped"]) == 0.0
  assert float(metrics["moe/blocks_0/max_vio"]) > 0.0


def test_moe_tiny_counts_active_parameters():
  c = presets.get_model_config("moe_tiny")
  q, f = c.moe_latent_size, c.moe_intermediate_size
  assert moe.inactive_params(c) == 2 * (c.n_routed_experts - c.num_experts_per_tok) * 2 * q * f


def test_bad_moe_configs_are_refused():
  with pytest.raises(ValueError, match="n_group"):
    CONFIG.replace(n_group=3)
  with pytest.raises(ValueError, match="topk_group"):
    CONFIG.replace(topk_group=5)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    CONFIG.replace(num_experts_per_tok=9)


def test_dropped_pairs_are_a_metric_and_a_log_line(tmp_path):
  """The ``dropped`` statistic (expert parallelism past ``moe_receive_factor``) becomes the metric
  moe/<block>/dropped (the mean over a scanned group's blocks) and the train log line says it."""
  import io   # pylint: disable=import-outside-toplevel
  from training import report as report_lib   # pylint: disable=import-outside-toplevel
  stats = {"blocks_0": {"mixer": {"load": (jnp.asarray([3.0, 1.0]),), "dropped": (jnp.asarray(5.0),)}},
           "blocks_1": {"mixer": {"load": (jnp.asarray([[2.0, 2.0], [4.0, 0.0]]),),
                                  "dropped": (jnp.asarray([0.0, 2.0]),)}}}
  _, metrics = step_lib.moe_balance({}, stats, 0.0)
  assert float(metrics["moe/blocks_0/dropped"]) == 5.0 and float(metrics["moe/blocks_1/dropped"]) == 1.0
  stream = io.StringIO()
  reporter = report_lib.Reporter(str(tmp_path), total_steps=1, tokens_per_step=8, log_every=1, stream=stream)
  reporter.train_step(1, dict(metrics, loss=1.0, grad_norm=1.0, lr=1e-3, nonfinite_total=0), recipe="bf16")
  reporter.close(draw=False)
  assert "moe dropped 6 pairs" in stream.getvalue()


def test_receive_factor_is_checked():
  assert ModelConfig(pattern="E", moe_receive_factor=1.5).moe_receive_factor == 1.5
  assert ModelConfig(pattern="E", moe_receive_factor=0).moe_receive_factor == 0   # dropless
  with pytest.raises(ValueError, match="moe_receive_factor=-1.0 must be > 0"):
    ModelConfig(pattern="E", moe_receive_factor=-1.0)
