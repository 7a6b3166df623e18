"""Micro-batches (``config.micro_batches``, gradient accumulation): N micro-batches of b rows give the gradient
of one batch of N x b rows (bf16, to float32 summation order); NVFP4 draws micro-batch i's stochastic rounding
from ``fold_in(step key, i)``; moe_tiny trains with them on 8 simulated CPU devices and resumes bit-exactly;
a batch that does not split is refused before any compute; the Super config runs Megatron's 512 x 8192."""
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp4jax
from configs import shrunken
from training import config as config_lib
from training import optim
from training import run as run_lib
from training import sharding
from training import step as step_lib
from training import trainer
from training.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

U = 2.0 ** -24   # float32's unit roundoff


def _grads(model, state, tokens_BxW, micro_batches):
  """(loss, grads) of the train step's accumulation for ``micro_batches``."""
  key = jax.random.fold_in(state["rng"], state["step"])

  def loss_fn(params, outcontrol, tokens, key):
    loss, stats = step_lib.model_loss_and_stats(model, params, tokens[:, :-1], tokens[:, 1:], key)
    return loss, (outcontrol, stats)

  fn = jax.jit(lambda p, t: step_lib.accumulate_gradients(jax.value_and_grad(loss_fn, has_aux=True), p, None, t,
                                                          key, micro_batches))
  (loss, _), grads = fn(state["params"], tokens_BxW)
  return loss, grads


def test_micro_batch_i_is_rows_i_mod_n():
  tokens_BxW = jnp.arange(8 * 3).reshape(8, 3)
  tokens_NxbxW = step_lib.micro_batches_of(tokens_BxW, 4)
  assert tokens_NxbxW.shape == (4, 2, 3)
  for i in range(4):
    np.testing.assert_array_equal(tokens_NxbxW[i], tokens_BxW[i::4])


def test_bf16_micro_batches_give_the_gradient_of_the_whole_batch():
  """The language model (one MLP block, bf16): the loss and every gradient of 4 micro-batches of 2 rows equal
  those of the batch of 8 up to float32 summation order. Each is a float32 sum over the B x L = 256 token
  positions, which the micro-batches add in another order (4 partial sums, then their sum); reordering a sum
  of m terms moves it by at most about m u times its terms' magnitude, so each leaf is compared to m u of its
  largest gradient (measured: 1e-6 of it). The update is built from these by the same optimizer code; the
  NVFP4 test below compares a whole step's update bit for bit."""
  config = shrunken.shrunken_config(**{"model.pattern": "-"})
  model = step_lib.build_model(config_lib.resolve_model_config(config.model), fp4jax.recipes.get("bf16"))
  tx, _ = optim.make_optimizer(config.optim, 10)
  state = step_lib.init_state(model, tx, 0, 32)
  state = dict(state, params=nn.unbox(state["params"]))
  tokens_BxW = jax.random.randint(jax.random.key(3), (8, 33), 0, 256, jnp.int32)
  loss, grads = _grads(model, state, tokens_BxW, 1)
  loss4, grads4 = _grads(model, state, tokens_BxW, 4)
  m = tokens_BxW.shape[0] * (tokens_BxW.shape[1] - 1)
  np.testing.assert_allclose(loss4, loss, rtol=m * U, atol=0)
  for (path, g), g4 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads4)):
    assert g4.dtype == jnp.float32
    np.testing.assert_allclose(g4, g, rtol=0, atol=m * U * float(jnp.max(jnp.abs(g))),
                               err_msg=jax.tree_util.keystr(path))


class _Nvfp4Bigram(nn.Module):
  """Embedding -> one NVFP4 linear layer (stochastic rounding of its gradients) -> logits."""

  @nn.compact
  def __call__(self, tokens_BxL):
    x = nn.Embed(256, 32)(tokens_BxL)
    x = nn.Dense(32, dot_general_cls=fp4jax.flax.dot_general_cls("nvfp4"))(x)
    return nn.Dense(256)(x)


def test_nvfp4_micro_batches_draw_their_keys_from_the_micro_batch_index():
  """The train step with 2 micro-batches equals the accumulation built by hand with the documented keys:
  micro-batch i (rows i, i + 2, ...) rounds with ``fold_in(fold_in(rng, step), i)``, its float32 gradients
  summed and halved, one AdamW update; bit for bit. The same accumulation with the step key for both
  micro-batches gives another update (the keys are what the micro-batches differ in)."""
  config = shrunken.shrunken_config(**{"optim.warmup_steps": 0, "optim.schedule": "constant"})
  tx, lr_fn = optim.make_optimizer(config.optim, 10)
  model = _Nvfp4Bigram()
  state = step_lib.init_state(model, tx, 0, 16)
  tokens_BxW = jax.random.randint(jax.random.key(3), (8, 17), 0, 256, jnp.int32)

  def by_hand(state, tokens_BxW, keys):
    def loss(params, tokens, key):
      return step_lib.model_loss(model, params, tokens[:, :-1], tokens[:, 1:], key)
    total, losses = None, []
    for i, key in enumerate(keys):
      loss_i, grads_i = jax.value_and_grad(loss)(state["params"], tokens_BxW[i::2], key)
      total = grads_i if total is None else jax.tree.map(jnp.add, total, grads_i)
      losses.append(loss_i)
    updates, _ = tx.update(jax.tree.map(lambda g: g / 2, total), state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u: u * lr_fn(0), updates)   # tx is at learning rate 1 (optim.make_optimizer)
    return (losses[0] + losses[1]) / 2, optax.apply_updates(state["params"], updates)

  def both(state, tokens_BxW):
    new, metrics = step_lib.train_step(state, tokens_BxW, model=model, tx=tx, lr_fn=lr_fn, micro_batches=2)
    key = jax.random.fold_in(state["rng"], state["step"])
    documented = by_hand(state, tokens_BxW, [jax.random.fold_in(key, i) for i in range(2)])
    one_key = by_hand(state, tokens_BxW, [key, key])
    return new, metrics, documented, one_key

  new, metrics, (loss, params), (_, params_one_key) = jax.jit(both)(state, tokens_BxW)
  assert float(metrics["loss"]) == float(loss)
  kernel = lambda p: np.asarray(nn.unbox(p)["Dense_0"]["kernel"])
  assert not np.array_equal(kernel(new["params"]), kernel(state["params"]))   # a step was taken
  for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(kernel(params_one_key), kernel(params))


def test_the_stats_of_micro_batches_count_the_whole_batch():
  """MoE loads and dropped pairs are counts of the step's batch (summed); the losses are averaged."""
  stats_N = {"blocks_0": {"mixer": {"load": (jnp.asarray([[3.0, 1.0], [2.0, 2.0]]),),
                                    "dropped": (jnp.asarray([1.0, 4.0]),),
                                    "aux_loss": (jnp.asarray([1.0, 3.0]),)}}}
  stats = step_lib.combine_micro_batch_stats(stats_N)["blocks_0"]["mixer"]
  np.testing.assert_array_equal(stats["load"][0], [5.0, 3.0])
  assert float(stats["dropped"][0]) == 5.0 and float(stats["aux_loss"][0]) == 2.0


# moe_tiny made tiny (tests/test_mesh_matrix.py's): a Mamba and an E block of 4 routed experts, 2 per token.
SHRUNKEN_MOE = dict(d_model=32, pattern="ME", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
                    ssm_head_dim=16, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, moe_latent_size=16,
                    n_group=2, topk_group=2, bf16_first_blocks=0, bf16_last_blocks=0)

_DRIVER = r"""
import json, os, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, os.path.join({root!r}, "tests"))
import jax
from configs import shrunken
from training import sharding, trainer
from training.errors import ConfigError
from saved_checkpoints import assert_same_checkpoint

def config(**overrides):
  fields = {{"eval.batches": 0, "data.seq_len": 32, "batch_size": 16, "micro_batches": 2, "mesh.data": 2,
            "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 1, "checkpoint.every_steps": 0,
            "optim.warmup_steps": 0, "optim.schedule": "constant"}}
  c = shrunken.shrunken_config(steps=2, recipe={recipe!r}, **dict(fields, **overrides))
  c.model.preset = "moe_tiny"
  for k, v in {model!r}.items():
    c.model[k] = v
  return c

out = dict(devices=jax.device_count())
out["node_order"] = [d.id for d in sharding.make_mesh(config(**dict({runs!r})["split"]).mesh).devices.flat]
try:   # 8 rows in 2 micro-batches of 4, over data x fsdp x expert = 8 devices
  trainer.train_and_evaluate(config(batch_size=8), os.path.join({base!r}, "refused"))
except ConfigError as e:
  out["refused"] = str(e)
for name, overrides in {runs!r}:
  summary = trainer.train_and_evaluate(config(**overrides), os.path.join({base!r}, name))
  out.setdefault(name, []).append([summary["status"], summary["step"]])
state = assert_same_checkpoint(os.path.join({base!r}, "straight"), os.path.join({base!r}, "split"), 2)
out["checkpoint_step"] = int(state["step"])
print("RESULT " + json.dumps(out))
"""
# The split run trains in 2 simulated nodes of 4 with fsdp across them (data and expert within): a placement
# whose device order is not the flat mesh's (training.sharding.node_grid; data across the nodes would be).
NODES = {"mesh.dcn_fsdp": 2, "mesh.devices_per_node": 4}
RESUME_RUNS = (("straight", {}), ("split", dict(NODES, halt_after=1)), ("split", NODES))
# The same layout with the weights gathered over fsdp once per step, ahead of the micro-batches: the same forward,
# the gradients' sums over the devices grouped otherwise (float32 summation order).
PER_STEP = ("per_step", dict(NODES, **{"mesh.fsdp_gather": "per_step"}))
# And with the gradients summed unreduced over data and fsdp through the micro-batches, reduced once per step
# (bf16 only: training.step.check_unreduced), halted after the first step and resumed.
REDUCED = dict(PER_STEP[1], **{"mesh.grad_reduce": "per_step"})
REDUCED_RUNS = (("reduced", dict(REDUCED, halt_after=1)), ("reduced", REDUCED))


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r["last_loss"] for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.mark.parametrize("pattern, recipe, layouts", [
    ("E", "bf16", "resume"), pytest.param("E", "bf16", "every", marks=pytest.mark.slow),
    pytest.param("ME", "nvfp4", "every", marks=pytest.mark.slow)])
def test_moe_tiny_trains_in_micro_batches_on_8_devices_and_resumes_bit_exactly(tmp_path, pattern, recipe, layouts):
  """moe_tiny on data 2 x fsdp 2 x expert 2 simulated CPU devices, 16 rows per step in 2 micro-batches: 2 steps
  straight on the flat mesh and 1 + resume + 1 laid out in 2 nodes of 4 (``NODES``: the same program on the
  devices in another order) leave the same checkpoint (state and data position, compared on the 8 devices) and
  the same losses, bit for bit; 8 rows in 2 micro-batches cannot split over the 8 devices and are refused. By
  default the E block alone in bf16, these runs only (``layouts="resume"``, ~30 s). Slow (``"every"``), also:
  the split layout with the weights gathered once per step (``PER_STEP``, ``mesh.fsdp_gather``) computes the
  first loss bit for bit and the second to float32 summation order (its gradients' sums over the devices are
  grouped otherwise: measured 1e-7 relative in the updated weights; 1e-5 allowed); in bf16 the losses are those
  of the batch of 16 in one piece (float32 summation order, carried through an AdamW step: measured 2e-7
  relative; 1e-5 allowed), and the same layout with the gradients reduced once per step (``REDUCED``,
  ``mesh.grad_reduce``), halted after its first step and resumed, trains to the same losses to float32
  summation order; and a Mamba and an E block in NVFP4 (the step's program does not reach the compilation
  cache: about 35 s per start). The per-step layouts' gradients run by default in
  test_gradients_reduced_once_per_step_are_the_gradients_to_float32_summation_order."""
  env = dict(os.environ, **shrunken.compilation_cache_env(),
             XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  runs = RESUME_RUNS
  if layouts == "every":
    runs += (PER_STEP,) + ((("one_batch", {"micro_batches": 1}),) + REDUCED_RUNS if recipe == "bf16" else ())
  code = _DRIVER.format(root=ROOT, model=dict(SHRUNKEN_MOE, pattern=pattern), base=str(tmp_path), recipe=recipe,
                        runs=runs)
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
  out = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
  assert out["devices"] == 8
  assert out["node_order"] == [0, 1, 4, 5, 2, 3, 6, 7]   # fsdp's two positions in two nodes
  assert "micro_batches x data x fsdp x expert = 2 x 8" in out["refused"], out["refused"]
  assert "--config.batch_size=16" in out["refused"], out["refused"]
  assert out["straight"] == [["done", 2]] and out["split"] == [["halted", 1], ["done", 2]]
  assert out["checkpoint_step"] == 2
  losses = _train_losses(str(tmp_path / "straight"))
  assert len(losses) == 2 and all(np.isfinite(losses)) and losses[0] != losses[1], losses
  assert _train_losses(str(tmp_path / "split")) == losses
  if layouts == "resume":
    return
  assert out["per_step"] == [["done", 2]]
  per_step = _train_losses(str(tmp_path / "per_step"))
  assert per_step[0] == losses[0]   # the first step's loss: the same weights, gathered once
  np.testing.assert_allclose(per_step, losses, rtol=1e-5, atol=0)
  if recipe == "bf16":
    np.testing.assert_allclose(losses, _train_losses(str(tmp_path / "one_batch")), rtol=1e-5, atol=0)
    assert out["reduced"] == [["halted", 1], ["done", 2]]
    assert "weights gathered over fsdp once per step; gradients reduced over data x fsdp once per step" in p.stdout
    np.testing.assert_allclose(_train_losses(str(tmp_path / "reduced")), per_step, rtol=1e-5, atol=0)


@pytest.mark.parametrize("overrides, phrase", [
    ({"micro_batches": 0}, "config.micro_batches=0 must be an integer >= 1"),
    ({"micro_batches": 3}, "multiple of 3: set --config.batch_size=6"),
])
def test_a_batch_that_does_not_split_is_refused(tmp_path, overrides, phrase):
  config = shrunken.shrunken_config(**overrides)   # batch_size 4
  with pytest.raises(ConfigError, match=phrase):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_each_micro_batch_must_split_over_the_devices_and_processes():
  run_lib.check_batch(16, 2, 8, 1)
  with pytest.raises(ConfigError, match=r"2 x 8.*--config.batch_size=16 or lower config.micro_batches=2"):
    run_lib.check_batch(8, 2, 8, 1)
  with pytest.raises(ConfigError, match=r"of 4 x the 2 processes.*--config.batch_size=8"):
    run_lib.check_batch(4, 4, 1, 2)


def test_super_runs_megatrons_batch_in_micro_batches_of_two_sequences_per_gpu():
  """configs/nemotron3_super.py: 512 sequences of 8192 per optimizer step (Megatron-Bridge's Super rows), in 4
  micro-batches of 128, two sequences per GPU of its 64 (expert 8 x fsdp 8); steps count 25T tokens at that batch."""
  from test_train_config import _load   # pylint: disable=import-outside-toplevel,import-error
  c = _load(os.path.join(ROOT, "configs", "nemotron3_super.py"))
  config_lib.validate(c)
  assert (c.batch_size, c.data.seq_len, c.micro_batches) == (512, 8192, 4)
  assert c.batch_size // c.micro_batches == 128 == 2 * c.mesh.expert * 8
  assert c.steps == 25_000_000_000_000 // (512 * 8192)
  run_lib.check_batch(c.batch_size, c.micro_batches, 64, 8)


def test_the_compiled_step_takes_the_whole_batch_and_scans_its_micro_batches():
  """bench.scale.build_step (bench/predict/gpu_aot.py's step): the batch is micro_batches x batch_per_device x
  ranks rows, and the step's program has one loop more than without micro-batches: the scan over them."""
  from bench import scale   # pylint: disable=import-outside-toplevel
  from test_train_config import _load   # pylint: disable=import-outside-toplevel,import-error
  loops = {}
  for micro in (1, 4):
    c = _load(os.path.join(ROOT, "configs", "tiny.py"), "--config.model.pattern=-", "--config.data.seq_len=32",
              "--config.recipe=bf16", f"--config.micro_batches={micro}")
    mesh = sharding.make_mesh(c.mesh)
    built = scale.build_step(c, mesh, 2)
    assert built["tokens_in"].shape == (micro * 2 * sharding.batch_ways(mesh), 33)
    with sharding.mesh_context(mesh):
      loops[micro] = built["step_fn"].lower(built["state_in"], built["tokens_in"]).as_text().count("stablehlo.while")
  assert loops[4] == loops[1] + 1, loops


def test_document_masked_micro_batches_split_the_segment_ids_with_the_tokens():
  """With document masking a batch is the tokens and their segment ids: micro-batch i takes its rows (i mod N)
  of both, so the accumulated loss and gradients are the mean of each micro-batch's own masked ones (to
  float32 summation order: the scan's program is not the separate calls')."""
  config = shrunken.shrunken_config(**{"model.pattern": "-"})
  model = step_lib.build_model(config_lib.resolve_model_config(config.model), fp4jax.recipes.get("bf16"))
  tx, _ = optim.make_optimizer(config.optim, 10)
  state = step_lib.init_state(model, tx, 0, 32)
  params = nn.unbox(state["params"])
  key = jax.random.key(5)
  tokens_BxW = jax.random.randint(jax.random.key(3), (4, 33), 1, 256, jnp.int32)
  starts_B = jnp.array([[10], [20], [5], [40]])   # where each row's second document starts (40: none)
  batch = {"tokens": tokens_BxW, "segment_ids": (jnp.arange(33)[None, :] >= starts_B).astype(jnp.int32)}

  def loss_fn(params, outcontrol, batch, key):
    inputs_BxL, targets_BxL, documents = step_lib.window(batch)
    loss, stats = step_lib.model_loss_and_stats(model, params, inputs_BxL, targets_BxL, key, documents)
    return loss, (outcontrol, stats)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, _), grads = jax.jit(lambda p, b: step_lib.accumulate_gradients(grad_fn, p, None, b, key, 2))(params, batch)
  each = [jax.jit(grad_fn)(params, None, jax.tree.map(lambda x: x[i::2], batch), jax.random.fold_in(key, i))
          for i in range(2)]
  (unmasked, _), _ = jax.jit(grad_fn)(params, None, tokens_BxW[0::2], jax.random.fold_in(key, 0))
  assert float(unmasked) != float(each[0][0][0])   # the segment ids reach the loss
  m = 2 * 32
  np.testing.assert_allclose(loss, (each[0][0][0] + each[1][0][0]) / 2, rtol=m * U, atol=0)
  for g, g0, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(each[0][1]), jax.tree.leaves(each[1][1])):
    want = (g0 + g1) / 2
    np.testing.assert_allclose(g, want, rtol=0, atol=m * U * float(jnp.max(jnp.abs(want))))


_GRADS_DRIVER = r"""
import functools, json, os, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from flax import traverse_util
from configs import shrunken
from training import config as config_lib, optim, sharding, step as step_lib

fields = {{"data.seq_len": 32, "batch_size": 16, "micro_batches": 2, "mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2,
          "mesh.tensor": 1, "mesh.dcn_fsdp": 2, "mesh.devices_per_node": 4, "mesh.fsdp_gather": "per_step"}}
c = shrunken.shrunken_config(steps=2, **fields)
c.model.preset = "moe_tiny"
for k, v in {model!r}.items():
  c.model[k] = v
recipe, _, _ = config_lib.resolve_recipes(c)
model = step_lib.build_model(config_lib.resolve_model_config(c.model), recipe)
tx, _ = optim.make_optimizer(c.optim, c.steps)
mesh = sharding.make_mesh(c.mesh)
init = lambda: step_lib.init_state(model, tx, 0, 32)
with sharding.mesh_context(mesh):
  abstract = jax.eval_shape(init)
_, state_sh = sharding.train_state_shardings(abstract, tx, mesh)
out = {{}}
with sharding.mesh_context(mesh):
  state = jax.jit(lambda: (lambda s: dict(s, params=nn.unbox(s["params"])))(init()), out_shardings=state_sh)()
  tokens = jax.device_put(np.random.default_rng(0).integers(0, 256, (16, 33), dtype=np.int32),
                          sharding.batch_sharding(mesh))
  for reduce in ("per_micro_batch", "per_step"):
    gather = sharding.step_gather({{"fsdp_gather": "per_step", "grad_reduce": reduce}}, state_sh["params"], 2)
    (loss, _), grads = jax.jit(functools.partial(step_lib.step_gradients, model=model, micro_batches=2,
                                                 gather=gather))(state, tokens)
    flat = traverse_util.flatten_dict(jax.tree.map(lambda g: np.asarray(g).tolist(), grads))
    out[reduce] = dict(loss=float(loss), grads={{"/".join(k): v for k, v in flat.items()}})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("pattern", ["-", pytest.param("E", marks=pytest.mark.slow)])
def test_gradients_reduced_once_per_step_are_the_gradients_to_float32_summation_order(pattern):
  """On data 2 x fsdp 2 x expert 2 simulated CPU devices in 2 nodes of 4 (fsdp across them), 16 rows in 2
  micro-batches, bf16: the step's loss and every gradient with ``mesh.grad_reduce`` "per_step" (each device's
  float32 sum over its micro-batches, reduced over data and fsdp once) against "per_micro_batch" (each
  micro-batch's gradient reduced over every device, then summed). Both sum the same B x L = 512 per-position
  terms in another order, so each leaf is compared to m u of its largest gradient, m = 512 (measured: at most
  2.3 u). By default an MLP block; slow: moe_tiny's E block (the experts' bf16 gradients: at most 1.9 u)."""
  env = dict(os.environ, **shrunken.compilation_cache_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  code = _GRADS_DRIVER.format(root=ROOT, model=dict(SHRUNKEN_MOE, pattern=pattern))
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
  out = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
  want, got = out["per_micro_batch"], out["per_step"]
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=512 * U, atol=0)
  assert set(got["grads"]) == set(want["grads"])
  for path, g in want["grads"].items():
    g, h = np.asarray(g), np.asarray(got["grads"][path])
    assert np.max(np.abs(h - g)) <= 512 * U * np.max(np.abs(g)), path
