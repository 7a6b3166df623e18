"""OsciReset in the trainer (config.osci_reset): the step applies fp4jax.osci_reset.update to exactly the
kernels the precision policy quantizes, its state is checkpointed and a resumed run is bit-exact, and bad
config values are ConfigErrors."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

import inputs
import fp4jax
from configs import shrunken
from fp4jax import osci_reset
from models import describe_linear_layers
from training import config as config_lib
from training import optim
from training import sharding
from training import trainer
from training.errors import ConfigError
from saved_checkpoints import assert_same_checkpoint, saved

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

# Period max(round(0.4 * 10), 2 + 2) = 4 from step 0: snapshot 0, track 1-2, reset 3, snapshot 4, ...
SMALL = {"eval.batches": 0, "osci_reset.detect_steps": 2, "osci_reset.period_fraction": 0.4,
         "osci_reset.start_fraction": 0.0}


def _config(steps=10, recipe="tetrajet2", **overrides):
  return shrunken.shrunken_config(steps=steps, recipe=recipe, **{**SMALL, **overrides})


def test_the_config_turns_it_on_for_tetrajet2_only():
  cfg = config_lib.resolve_osci_reset(_config(), fp4jax.recipes.get("tetrajet2"))
  assert (cfg.period, cfg.detect_steps, cfg.start, cfg.threshold, cfg.axis) == (4, 2, 0, 8.0, -2)
  assert config_lib.resolve_osci_reset(_config(recipe="nvfp4"), fp4jax.recipes.get("nvfp4")) is None
  on = _config(recipe="nvfp4", **{"osci_reset.enabled": "on"})
  assert config_lib.resolve_osci_reset(on, fp4jax.recipes.get("nvfp4")) is not None
  off = _config(**{"osci_reset.enabled": "off"})
  assert config_lib.resolve_osci_reset(off, fp4jax.recipes.get("tetrajet2")) is None
  # The defaults on a 10,000-step run: P = 120 (1.2%), S = 6500 (65%), N = 50, thr = 8.
  default = shrunken.shrunken_config(steps=10_000, recipe="tetrajet2")
  cfg = config_lib.resolve_osci_reset(default, fp4jax.recipes.get("tetrajet2"))
  assert (cfg.period, cfg.start, cfg.detect_steps, cfg.threshold) == (120, 6500, 50, 8.0)


@pytest.mark.parametrize("field, value, match", [
    ("osci_reset.enabled", "maybe", "use 'auto'"),
    ("osci_reset.threshold", 0.0, "threshold=0.0 must be > 0"),
    ("osci_reset.detect_steps", 0, "detect_steps=0 must be an integer >= 1"),
    ("osci_reset.period_fraction", 0.0, "period_fraction=0.0 must be in"),
    ("osci_reset.period_fraction", 1.5, "period_fraction=1.5 must be in"),
    ("osci_reset.start_fraction", 1.0, "start_fraction=1.0 must be in"),
    ("osci_reset.start_fraction", -0.1, "start_fraction=-0.1 must be in"),
])
def test_bad_values_are_config_errors(field, value, match):
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(_config(**{field: value}))


def test_on_for_a_recipe_without_fp4_weights_is_a_config_error():
  with pytest.raises(ConfigError, match="quantizes no linear layer"):
    config_lib.validate(_config(recipe="bf16", **{"osci_reset.enabled": "on"}))


def _setup(threshold):
  config = _config(**{"osci_reset.threshold": threshold, "model.bf16_last_blocks": 1})
  model_config = config_lib.resolve_model_config(config.model)
  recipe = fp4jax.recipes.get(config.recipe)
  model = trainer.build_model(model_config, recipe)
  tx, lr = optim.make_optimizer(config.optim, config.steps)
  osci = optim.OsciReset(config_lib.resolve_osci_reset(config, recipe), model_config, recipe)
  state = trainer.init_state(model, tx, 0, config.data.seq_len, osci)
  state = dict(state, params=nn.unbox(state["params"]))
  return model_config, recipe, model, tx, lr, osci, state


@pytest.mark.slow   # ~55 s idle; the config checks and the scanned-kernel tracking run by default
def test_the_step_resets_exactly_what_the_pure_update_resets():
  """Steps 0-2 of the trainer (snapshot, two tracking steps), then the reset step 3 compared with AdamW alone
  followed by fp4jax.osci_reset.update on the quantized kernels: bit for bit, some elements reset, others not."""
  model_config, recipe, model, tx, lr, osci, state = _setup(threshold=1.0)
  # The tracked kernels are exactly the quantized linear layers (the last block stays bf16 here).
  quantized = {row[0] for row in describe_linear_layers(model_config, recipe) if row[1] != "bf16"}
  assert {"/".join(p[:-1]) for p in osci.tracked(state["params"])} == quantized
  assert quantized and all(not name.startswith("blocks_2/") for name in quantized)
  with_osci = jax.jit(lambda s, t: trainer.train_step(s, t, model=model, tx=tx, lr_fn=lr, osci=osci))
  without = jax.jit(lambda s, t: trainer.train_step(s, t, model=model, tx=tx, lr_fn=lr))
  batches = jax.random.randint(jax.random.PRNGKey(1), (4, 4, 33), 0, 256)
  for k in range(3):
    state, _ = with_osci(state, batches[k])
  d_fp = [np.asarray(s.d_fp) for s in jax.tree.leaves(state["osci_reset"], is_leaf=lambda x: isinstance(
      x, osci_reset.LeafState))]
  assert all(np.any(x > 0) for x in d_fp)  # two tracking steps accumulated
  got, _ = with_osci(state, batches[3])
  adamw, _ = without(state, batches[3])
  flat = traverse_util.flatten_dict(adamw["params"])
  paths = osci.tracked(adamw["params"])
  subset = traverse_util.unflatten_dict({p: flat[p] for p in paths})
  want_subset, want_state = jax.jit(lambda p, s: osci_reset.update(p, s, 3, osci.config))(
      subset, state["osci_reset"])
  want = {**flat, **traverse_util.flatten_dict(want_subset)}
  got_flat = traverse_util.flatten_dict(got["params"])
  reset = 0
  for path, value in want.items():
    np.testing.assert_array_equal(np.asarray(got_flat[path]), np.asarray(value), err_msg=str(path))
    changed = np.asarray(got_flat[path]) != np.asarray(flat[path])
    if path not in paths:
      assert not changed.any(), path
    reset += int(changed.sum())
  total = sum(int(np.prod(flat[p].shape)) for p in paths)
  assert 0 < reset < total, (reset, total)
  for a, b in zip(jax.tree.leaves(got["osci_reset"]), jax.tree.leaves(want_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(got["osci_reset"]))  # zeroed after the reset
  # The reset elements sit exactly on Q(w) of the updated weight (before the reset), Q jitted as in the step.
  quantized_weight = jax.jit(osci_reset.quantized_weight, static_argnums=1)
  for path in paths:
    w = np.asarray(got_flat[path])
    q = np.asarray(quantized_weight(flat[path], -2))
    changed = w != np.asarray(flat[path])
    np.testing.assert_array_equal(w[changed], q[changed])


@pytest.mark.slow   # ~2 min on 2 cores; run with -m slow
def test_resume_inside_the_detection_window_is_bit_exact(tmp_path):
  """10 steps straight vs 6 + restart + 4; after 6 steps the window of the snapshot at step 4 is open."""
  straight = str(tmp_path / "straight")
  trainer.train_and_evaluate(_config(**{"checkpoint.every_steps": 6}), straight)
  split = str(tmp_path / "split")
  first = trainer.train_and_evaluate(_config(halt_after=6), split)
  assert (first["status"], first["step"]) == ("halted", 6)
  second = trainer.train_and_evaluate(_config(), split)
  assert (second["status"], second["step"]) == ("done", 10)
  mid, _ = saved(split, 6)
  assert any(np.any(x > 0) for x in jax.tree.leaves(mid["osci_reset"]))  # the window's state is in it
  for step in (6, 10):
    assert_same_checkpoint(straight, split, step)
  # OsciReset did something: the same run without it ends elsewhere.
  off = str(tmp_path / "off")
  trainer.train_and_evaluate(_config(**{"osci_reset.enabled": "off", "osci_reset.threshold": 1.0}), off)
  low = str(tmp_path / "low")
  trainer.train_and_evaluate(_config(**{"osci_reset.threshold": 1.0}), low)
  p_off, p_low = saved(off, 10)[0]["params"], saved(low, 10)[0]["params"]
  assert "osci_reset" not in saved(off, 10)[0]
  assert any(np.any(x != y) for x, y in zip(jax.tree.leaves(p_off), jax.tree.leaves(p_low)))


def test_scanned_blocks_track_the_stacked_kernels_along_their_input_axis():
  """With scan_blocks the repeated blocks' kernels are stacked (R, K, N); their state has that shape and
  every (r, n) column is quantized along K, as the unstacked kernels are."""
  config = _config(**{"model.pattern": "M*-M*-", "model.scan_blocks": True})
  model_config = config_lib.resolve_model_config(config.model)
  recipe = fp4jax.recipes.get(config.recipe)
  osci = optim.OsciReset(config_lib.resolve_osci_reset(config, recipe), model_config, recipe)
  params = nn.unbox(jax.eval_shape(lambda: trainer.init_state(
      trainer.build_model(model_config, recipe), optax.identity(), 0, 8, osci))["params"])
  tracked = osci.tracked(params)
  assert len(tracked) == 6 and all(len(params_at(params, p).shape) == 3 for p in tracked)
  w = inputs.normal(jax.random.PRNGKey(0), (2, 40, 8))
  q = jax.jit(osci_reset.quantized_weight, static_argnums=1)
  np.testing.assert_array_equal(np.asarray(q(w, -2))[1], np.asarray(q(w[1], 0)))


def params_at(tree, path):
  for name in path:
    tree = tree[name]
  return tree
