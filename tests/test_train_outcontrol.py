"""OutControl in the trainer (config.outcontrol): the layer's three phases (plain, record, on), a toy whose
top-norm channels are known, the trainer's steps bit-identical to a run without OutControl until the split
is on, exact resume inside and after the calibration window, OsciReset on the FP4 rows only, scan_blocks,
the global-batch sum over two devices, and bad config values as ConfigErrors."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import inputs
import fp4jax
from configs import shrunken
from fp4jax import osci_reset, outcontrol
from models import ModelConfig
from models.layers import OUTCONTROL, OutControlDense
from models.lm import LanguageModel, scanned_params
from training import config as config_lib
from training import optim
from training import sharding
from training import trainer
from training.errors import ConfigError
from saved_checkpoints import saved

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

K, N = 256, 128    # k8(256, 0.1) = 128: half the channels in MXFP8
# One MLP block of width 256: both of its linear layers (up 256 -> 256, down 256 -> 256) get k8 = 128.
WIDE = {"model.d_model": 256, "model.pattern": "-", "model.mlp_dim": 256, "eval.batches": 0}
ON = {"outcontrol.enabled": True, "outcontrol.record_start_step": 2, "outcontrol.record_steps": 2}


def _config(steps=6, recipe="tetrajet2", **overrides):
  return shrunken.shrunken_config(steps=steps, recipe=recipe, **{**WIDE, **ON, **overrides})


class _Toy(nn.Module):
  """One OutControl layer K -> N (float32), as the model's linear layers build it."""

  @nn.compact
  def __call__(self, x_MxK):
    return OutControlDense(N, use_bias=False, dot_general_cls=fp4jax.flax.dot_general_cls("tetrajet2"),
                           outcontrol_ratio=0.1, name="dense")(x_MxK)


def _toy_inputs(seed, loud):
  """x (64, K): unit normal, channels ``loud`` 20x larger."""
  scale_K = np.ones(K, np.float32)
  scale_K[loud] = 20.0
  return inputs.normal(jax.random.PRNGKey(seed), (64, K)) * scale_K


# ------------------------------------------------------------------------------------------- the layer

def test_k8_of_the_policy_layers():
  assert [outcontrol.k8(k, 0.1) for k in (32, 127, 128, 256, 1024, 4096)] == [0, 0, 128, 128, 128, 512]
  cfg = ModelConfig(d_model=256, pattern="-", mlp_dim=256, outcontrol_ratio=0.1, bf16_last_blocks=0)
  variables = jax.eval_shape(lambda: LanguageModel(cfg, "tetrajet2").init(
      {"params": jax.random.PRNGKey(0), "fp4": jax.random.PRNGKey(0)}, jnp.zeros((1, 8), jnp.int32)))
  state = traverse_util.flatten_dict(variables[OUTCONTROL])
  assert {p: (v.shape, v.dtype) for p, v in state.items()} == {
      ("blocks_0", "mixer", layer, name): ((256,), dtype) for layer in ("up", "down")
      for name, dtype in (("acc", jnp.float32), ("perm", jnp.int32))}
  # nvfp4 layers, bf16 blocks and a ratio of 0 have no OutControl state (and are plain nn.Dense).
  for model in (LanguageModel(cfg, "nvfp4"), LanguageModel(cfg.replace(outcontrol_ratio=0.0), "tetrajet2"),
                LanguageModel(cfg.replace(bf16_last_blocks=1), "tetrajet2")):
    variables = jax.eval_shape(lambda m=model: m.init(
        {"params": jax.random.PRNGKey(0), "fp4": jax.random.PRNGKey(0)}, jnp.zeros((1, 8), jnp.int32)))
    assert set(variables) == {"params"}


def test_the_toy_picks_its_loud_channels_and_perm_is_numpys_argsort():
  """Channels 7, 100..226 (128 of them) are 20x louder: after two recording calls they are the MXFP8
  channels; acc is the sum of the two calls' column norms and perm numpy's stable descending argsort."""
  loud = np.array([7] + list(range(100, 227)))
  toy = _Toy()
  variables = toy.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, K)))
  np.testing.assert_array_equal(variables[OUTCONTROL]["dense"]["perm"], np.arange(K))
  record = jax.jit(lambda v, x: toy.apply(v, x, mutable=[OUTCONTROL]))
  plain = jax.jit(toy.apply)
  xs = [_toy_inputs(seed, loud) for seed in (1, 2)]
  state = variables[OUTCONTROL]
  for x in xs:
    y, mutated = record({"params": variables["params"], OUTCONTROL: state}, x)
    state = mutated[OUTCONTROL]
    # Recording does not change the forward.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain({"params": variables["params"]}, x)))
  acc, perm = np.asarray(state["dense"]["acc"]), np.asarray(state["dense"]["perm"])
  want_acc = sum(np.sqrt(np.sum(np.square(np.asarray(x, np.float64)), axis=0)) for x in xs)
  np.testing.assert_allclose(acc, want_acc, rtol=1e-5)
  np.testing.assert_array_equal(perm, np.argsort(-acc, kind="stable"))
  assert set(perm[:128].tolist()) == set(loud.tolist())


@pytest.mark.slow   # ~20 s idle; outcontrol's dot is tested in tests/test_recipes_tetrajet2.py by default
def test_the_on_phase_forward_is_outcontrol_dot():
  loud = np.arange(0, K, 2)
  toy = _Toy()
  variables = toy.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, K)))
  x = _toy_inputs(3, loud)
  _, mutated = toy.apply(variables, x, mutable=[OUTCONTROL])
  on = {"params": variables["params"], **mutated}
  perm = mutated[OUTCONTROL]["dense"]["perm"]
  kernel = variables["params"]["dense"]["kernel"]
  key = jax.random.PRNGKey(5)
  got = jax.jit(lambda v, x: toy.apply(v, x, rngs={"fp4": key}))(on, x)
  want = jax.jit(lambda x, w, p: outcontrol.dot(x, w, p, 128, key=key))(x, kernel, perm)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  plain = toy.apply({"params": variables["params"]}, x)
  assert np.any(np.asarray(got) != np.asarray(plain))   # the split changes the result
  # The gradient flows through outcontrol.dot's backward (dgrad in FP4, wgrad split) to x and the kernel.
  grads = jax.grad(lambda p: jnp.sum(toy.apply({"params": p, **mutated}, x, rngs={"fp4": key})))(on["params"])
  assert np.all(np.isfinite(np.asarray(grads["dense"]["kernel"]))) and np.any(grads["dense"]["kernel"] != 0)


@pytest.mark.slow
def test_scanned_blocks_keep_one_state_per_repetition():
  """scan_blocks stacks each repeated block's OutControl state on the repeat axis; recording fills each
  repetition from its own input (the first one's equals the unscanned model's first block: same input),
  and the "on" forward runs on the stacked permutations. (The later blocks' inputs differ between the two
  layouts by bf16 rounding already, so they are not compared.)"""
  cfg = ModelConfig(d_model=256, pattern="--", mlp_dim=256, outcontrol_ratio=0.1)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 256)
  rngs = {"params": jax.random.PRNGKey(0), "fp4": jax.random.PRNGKey(0)}
  flat_model = LanguageModel(cfg, "tetrajet2")
  scan_model = LanguageModel(cfg.replace(scan_blocks=True), "tetrajet2")
  flat_vars = flat_model.init(rngs, tokens)
  scan_vars = scan_model.init(rngs, tokens)
  assert {v.shape for v in jax.tree.leaves(scan_vars[OUTCONTROL])} == {(2, 256)}
  params = nn.unbox(flat_vars["params"])
  record = lambda m, p, s: m.apply({"params": p, OUTCONTROL: s}, tokens, rngs={"fp4": rngs["fp4"]},
                                   mutable=[OUTCONTROL])[1][OUTCONTROL]
  flat_state = jax.jit(lambda p, s: record(flat_model, p, s))(params, flat_vars[OUTCONTROL])
  scan_state = jax.jit(lambda p, s: record(scan_model, p, s))(scanned_params(params, cfg), scan_vars[OUTCONTROL])
  got = traverse_util.flatten_dict(scan_state)
  want = traverse_util.flatten_dict(scanned_params(flat_state, cfg))
  for path, value in got.items():
    np.testing.assert_allclose(np.asarray(value[0], np.float64), np.asarray(want[path][0], np.float64),
                               rtol=1e-6, err_msg=str(path))
    if path[-1] == "acc":
      assert np.all(value > 0) and np.any(value[0] != value[1])
      perm = got[path[:-1] + ("perm",)]
      for r in range(2):
        np.testing.assert_array_equal(perm[r], np.argsort(-np.asarray(value[r]), kind="stable"))
  on = jax.jit(lambda p, s: scan_model.apply({"params": p, OUTCONTROL: s}, tokens, targets_BxL=tokens,
                                             rngs={"fp4": rngs["fp4"]}))
  loss = on(scanned_params(params, cfg), scan_state)
  assert np.isfinite(float(loss))


# ------------------------------------------------------------------------------------------ the config

def test_the_config_is_off_by_default_and_on_for_tetrajet2():
  tj2 = fp4jax.recipes.get("tetrajet2")
  default = shrunken.shrunken_config(steps=1000, recipe="tetrajet2")
  assert config_lib.resolve_outcontrol(default, tj2) is None
  on = shrunken.shrunken_config(steps=1000, recipe="tetrajet2", **{"outcontrol.enabled": True})
  oc = config_lib.resolve_outcontrol(on, tj2)
  assert oc == optim.OutControl(ratio=0.1, record_start=500, record_steps=50)
  phases = [oc.phase_at(s) for s in (0, 499, 500, 549, 550, 999)]
  assert phases == ["plain", "plain", "record", "record", "on", "on"]


@pytest.mark.parametrize("overrides, match", [
    ({"recipe": "nvfp4"}, "needs a TetraJet-v2 recipe.*--config.recipe=tetrajet2"),
    ({"outcontrol.ratio": 0.0}, "ratio=0.0 must be in"),
    ({"outcontrol.ratio": 1.5}, "ratio=1.5 must be in"),
    ({"outcontrol.record_start_step": -1}, "record_start_step=-1 must be an integer >= 0"),
    ({"outcontrol.record_steps": 0}, "record_steps=0 must be an integer >= 1"),
    ({"outcontrol.record_start_step": 4}, "record_start_step to at most 3"),
    ({"outcontrol.record_steps": 6}, "record_steps below 6"),
    ({"precision_switch.fraction": 0.5}, "precision switch starts at step 3"),
])
def test_bad_values_are_config_errors(overrides, match):
  recipe = overrides.pop("recipe", "tetrajet2")
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(_config(recipe=recipe, **overrides))


def test_a_model_without_wide_enough_layers_is_a_config_error(tmp_path):
  config = _config(**{"model.d_model": 32, "model.mlp_dim": 64})
  with pytest.raises(ConfigError, match="no quantized linear layer of this model has enough input channels"):
    trainer.train_and_evaluate(config, str(tmp_path / "narrow"))


# ------------------------------------------------------------------------------------------ the trainer

def _leaves_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


EVERY = {"checkpoint.every_steps": 1, "checkpoint.keep": 10}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """A 6-step run with OutControl, a checkpoint after every step: steps 0-1 plain, 2-3 record, 4-5 on."""
  workdir = str(tmp_path_factory.mktemp("outcontrol") / "straight")
  trainer.train_and_evaluate(_config(**EVERY), workdir)
  return workdir


@pytest.mark.slow   # with its fixture ~1 min; the on-phase forward and the scanned state run by default
def test_until_the_split_is_on_the_run_equals_one_without_outcontrol(straight, tmp_path):
  """(1) After the plain and the recording steps the state equals a run without OutControl bit for bit;
  (2) the state saved after the window is perm = argsort(-acc), acc zero before the window and unchanged
  after it; (3) the split then changes the training."""
  off = str(tmp_path / "off")
  trainer.train_and_evaluate(_config(halt_after=5, **EVERY, **{"outcontrol.enabled": False}), off)
  for step in (2, 4):
    with_oc, without = saved(straight, step)[0], saved(off, step)[0]
    assert set(with_oc) - set(without) == {"outcontrol"}
    assert _leaves_equal({k: with_oc[k] for k in without}, without), step
  assert not _leaves_equal(saved(straight, 5)[0]["params"], saved(off, 5)[0]["params"])
  state = traverse_util.flatten_dict(saved(straight, 4)[0]["outcontrol"])
  assert len(state) == 4
  for path, acc in state.items():
    if path[-1] == "acc":
      assert np.all(acc > 0)
      np.testing.assert_array_equal(state[path[:-1] + ("perm",)], np.argsort(-acc, kind="stable"))
  acc_path = next(path for path in state if path[-1] == "acc")
  before, after = (traverse_util.flatten_dict(saved(straight, s)[0]["outcontrol"])[acc_path] for s in (2, 6))
  np.testing.assert_array_equal(before, np.zeros(256, np.float32))   # nothing recorded before the window
  np.testing.assert_array_equal(after, state[acc_path])              # nor after it


@pytest.mark.slow
def test_resume_inside_and_after_the_window_is_bit_exact(straight, tmp_path):
  """3 steps + restart + 3 (resumed with one recording step left), and the straight run's checkpoints up to
  step 5 + restart + 1 (resumed with the split on): both end where the straight run ends, bit for bit."""
  split = str(tmp_path / "split")
  assert trainer.train_and_evaluate(_config(halt_after=3), split)["step"] == 3
  assert trainer.train_and_evaluate(_config(), split)["step"] == 6
  late = str(tmp_path / "late")
  shutil.copytree(straight, late)
  shutil.rmtree(os.path.join(late, "checkpoints", "6"))
  assert trainer.train_and_evaluate(_config(**EVERY), late)["step"] == 6
  for other in (split, late):
    (a, data_a), (b, data_b) = saved(straight, 6), saved(other, 6)
    assert data_a == data_b
    assert _leaves_equal(a, b), other


# ---------------------------------------------------------------------------------------- with OsciReset

def test_osci_reset_tracks_the_fp4_rows_in_their_gathered_order():
  """In the "on" phase OsciReset runs on the kernel's rows gathered by perm: the FP4 rows (k8..K) are the
  plain update of that gathered block, the MXFP8 rows are never reset and keep a zero state."""
  cfg = ModelConfig(d_model=256, pattern="-", mlp_dim=256, outcontrol_ratio=0.1)
  recipe = fp4jax.recipes.get("tetrajet2")
  osci = optim.OsciReset(osci_reset.OsciResetConfig(period=4, detect_steps=2, start=0, threshold=1.0, axis=-2),
                         cfg, recipe)
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  w = {"blocks_0": {"mixer": {"up": {"kernel": inputs.normal(keys[0], (K, K))},
                              "down": {"kernel": inputs.normal(keys[1], (K, K))}}}}
  perm = {"blocks_0": {"mixer": {"up": {"perm": jax.random.permutation(keys[2], K).astype(jnp.int32),
                                        "acc": jnp.zeros(K)}}}}     # "down" stays plain
  state = osci.init(w)
  apply = jax.jit(lambda p, s, k: osci.apply(p, s, k, outcontrol_state=perm))
  plain = jax.jit(lambda p, s, k: osci_reset.update(p, s, k, osci.config))
  p_up = np.asarray(perm["blocks_0"]["mixer"]["up"]["perm"])
  gathered = lambda t: t[..., p_up, :]
  up = ("blocks_0", "mixer", "up", "kernel")
  ref_state = osci_reset.init(jnp.zeros((K - 128, K)), None)
  for k in range(4):    # snapshot, two tracking steps, the reset
    w = jax.tree.map(lambda x, i=k: x + 0.3 * inputs.normal(keys[3 + i], x.shape), w)
    ref_w = gathered(np.asarray(traverse_util.flatten_dict(w)[up]))[128:]
    new_w, state = apply(w, state, k)
    ref_w_new, ref_state = plain(ref_w, ref_state, k)
    got = gathered(np.asarray(traverse_util.flatten_dict(new_w)[up]))
    np.testing.assert_array_equal(got[128:], np.asarray(ref_w_new))
    np.testing.assert_array_equal(got[:128], gathered(np.asarray(traverse_util.flatten_dict(w)[up]))[:128])
    leaf = traverse_util.flatten_dict(state)[up]
    for x, y in zip(leaf, ref_state):
      np.testing.assert_array_equal(gathered(np.asarray(x))[128:], np.asarray(y))
      assert not gathered(np.asarray(x))[:128].any()
    w = new_w
  assert np.any(np.asarray(ref_w_new) != ref_w)   # some FP4 elements were reset at step 3


# --------------------------------------------------------------------------------------- two devices

_TWO_DEVICES = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, "tests")
    from test_train_outcontrol import _Toy, _toy_inputs, OUTCONTROL
    from jax.sharding import NamedSharding, PartitionSpec as P
    toy = _Toy()
    variables = toy.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, 256)))
    x = _toy_inputs(1, np.arange(40, 168))
    record = jax.jit(lambda v, x: toy.apply(v, x, mutable=[OUTCONTROL])[1][OUTCONTROL]["dense"])
    mesh = jax.make_mesh((2,), ("data",))
    x_split = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    one = record(variables, jax.device_put(x, jax.devices()[0]))
    two = record(variables, x_split)
    print("RESULT " + json.dumps(dict(devices=len(x_split.sharding.device_set),
        acc_one=np.asarray(one["acc"]).tolist(), acc_two=np.asarray(two["acc"]).tolist(),
        perm_one=np.asarray(one["perm"]).tolist(), perm_two=np.asarray(two["perm"]).tolist())))
""")


def test_the_norms_are_over_the_global_batch_on_two_devices():
  """Under jit with the batch split over two devices, acc is the norm over all the batch's tokens (not a
  sum of per-device norms): equal to the one-device result up to the order of the float32 sum."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.split("RESULT ", 1)[1])
  assert result["devices"] == 2
  np.testing.assert_allclose(result["acc_two"], result["acc_one"], rtol=1e-6)
  assert result["perm_two"][:128] == result["perm_one"][:128]
  x = np.asarray(_toy_inputs(1, np.arange(40, 168)), np.float64)
  np.testing.assert_allclose(result["acc_one"], np.sqrt(np.sum(x * x, axis=0)), rtol=1e-5)
