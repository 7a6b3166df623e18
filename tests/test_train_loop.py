"""The training loop end to end on CPU: loss falls, resume is bit-exact, bad steps are skipped, the precision
switch, profiling, and SIGTERM leaving a checkpoint that resumes."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import shrunken
from training import sharding
from training import trainer
from saved_checkpoints import assert_same_checkpoint, saved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)  # reruns of one program compile once


def _records(workdir, kind):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_tiny_trains_end_to_end_and_loss_falls(tmp_path):
  workdir = str(tmp_path / "run")
  config = shrunken.shrunken_config(steps=40, **{"optim.lr": 1e-2, "eval.every_steps": 20, "log_every": 10,
                                                "profile_steps": (3, 4)})
  summary = trainer.train_and_evaluate(config, workdir)
  assert summary["status"] == "done" and summary["step"] == 40
  train, evals = _records(workdir, "train"), _records(workdir, "eval")
  assert [r["step"] for r in evals] == [20, 40]
  assert train[-1]["loss"] < train[0]["loss"] - 1.0, train        # from ~ln 256 = 5.5 nats
  assert summary["validation_loss"] < np.log(256) - 1.0
  assert summary["bits_per_byte"] == pytest.approx(summary["validation_loss"] / np.log(2), rel=0.01)
  assert summary["tokens_per_second"] > 0 and summary["nonfinite_steps"] == 0
  for name in ("loss.png", "config.json", "checkpoints/40"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  traces = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces), traces


@pytest.mark.skipif(importlib.util.find_spec("fp4jax.flax") is None,
                    reason="fp4jax.flax (the quantized dot) has not landed yet")
# ~70 s with a cold compilation cache. By default an nvfp4 run trains 6 steps in
# tests/test_checkpoint_faults.py::test_changed_recipe_is_refused, and the loss falls (bf16) above.
@pytest.mark.slow
def test_tiny_trains_in_nvfp4(tmp_path):
  config = shrunken.shrunken_config(steps=24, recipe="nvfp4", **{"optim.lr": 1e-2, "log_every": 8})
  summary = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  train = _records(str(tmp_path / "run"), "train")
  assert train[-1]["recipe"] == "nvfp4" and train[-1]["loss"] < train[0]["loss"] - 0.5, train
  assert summary["nonfinite_steps"] == 0


def test_resume_is_bit_exact_across_the_precision_switch(tmp_path):
  """6 steps straight vs 3 + restart + 3, the last 3 steps in the precision switch's second recipe."""
  overrides = {"eval.batches": 0, "data.read_threads": 1, "data.prefetch": 4, "precision_switch.fraction": 0.5}
  straight = str(tmp_path / "straight")
  # Its checkpoint 3 is saved asynchronously while the next steps reuse the donated buffers.
  trainer.train_and_evaluate(shrunken.shrunken_config(steps=6, **overrides, **{"checkpoint.every_steps": 3}),
                             straight)
  assert [r["recipe"] for r in _records(straight, "train")] == ["bf16"] * 3 + ["bf16_bf16_fprop"] * 3
  split = str(tmp_path / "split")
  first = trainer.train_and_evaluate(shrunken.shrunken_config(steps=6, halt_after=3, **overrides), split)
  assert (first["status"], first["step"]) == ("halted", 3)
  second = trainer.train_and_evaluate(shrunken.shrunken_config(steps=6, **overrides), split)
  assert (second["status"], second["step"]) == ("done", 6)
  for step in (3, 6):
    a = assert_same_checkpoint(straight, split, step)
    assert int(a["step"]) == step


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
  workdir = str(tmp_path / "run")
  config = shrunken.shrunken_config(steps=20, **{"optim.lr": 1e30, "optim.warmup_steps": 0,
                                                "health.max_nonfinite_streak": 3, "eval.batches": 0})
  with pytest.raises(trainer.TrainingDiverged, match="non-finite for 3 steps in a row") as info:
    trainer.train_and_evaluate(config, workdir)
  assert "config.optim.lr" in str(info.value)
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  state, _ = saved(workdir, steps[-1])
  # Metrics arrive one step behind, so the run stops after the step that follows the third bad one.
  assert int(state["nonfinite_total"]) >= 3 and int(state["nonfinite_streak"]) >= 3
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state["params"]))  # bad updates never applied


def test_step_with_nonfinite_loss_leaves_the_state_alone():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from training import optim  # pylint: disable=g-import-not-at-top

  class Bigram(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      return nn.Embed(256, 256)(tokens)

  config = shrunken.shrunken_config()
  tx, lr = optim.make_optimizer(config.optim, 10)
  model = Bigram()
  state = trainer.init_state(model, tx, 0, 8)
  state["params"] = jax.tree.map(lambda p: p.at[0, 0].set(jnp.nan), state["params"])
  tokens = jnp.zeros((2, 9), jnp.int32)
  new, metrics = jax.jit(lambda s, t: trainer.train_step(s, t, model=model, tx=tx, lr_fn=lr))(state, tokens)
  assert not np.isfinite(metrics["loss"]) and int(metrics["nonfinite_streak"]) == 1
  for x, y in zip(jax.tree.leaves((state["params"], state["opt_state"])),
                  jax.tree.leaves((new["params"], new["opt_state"]))):
    np.testing.assert_array_equal(x, y)
  assert int(new["step"]) == 1 and int(new["nonfinite_total"]) == 1


def _read_until(stream, pattern, deadline, sink):
  """Collects lines of ``stream`` into ``sink`` until one contains ``pattern`` (False at the deadline)."""
  found = threading.Event()

  def reader():
    for line in stream:
      sink.append(line)
      if pattern in line:
        found.set()
    found.set()

  threading.Thread(target=reader, daemon=True).start()
  found.wait(max(deadline - time.monotonic(), 0))
  return any(pattern in line for line in sink)


def test_sigterm_saves_a_checkpoint_that_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
             f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}", *shrunken.shrunken_flags(steps=100_000, **{"eval.batches": 0})]
  process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  try:
    assert _read_until(process.stdout, " 3/100000", time.monotonic() + 120, lines), "".join(lines)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, "".join(lines)  # 128 + SIGTERM: a scheduler sees a preemption
  finally:
    if process.poll() is None:
      process.kill()
  time.sleep(0.2)
  output = "".join(lines)
  assert "SIGTERM: saved checkpoint" in output and "exiting (exit 143)" in output, output
  saved = max(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert saved >= 3
  config = shrunken.shrunken_config(steps=100_000, halt_after=2, **{"eval.batches": 0})  # the same program
  summary = trainer.train_and_evaluate(config, workdir)
  assert (summary["status"], summary["step"]) == ("halted", saved + 2)
  assert _records(workdir, "train")[-1]["step"] == saved + 2


def test_document_masking_leaves_each_documents_first_token_out_of_the_loss():
  """A batch with segment ids: the loss is the cross entropy of the packed model's logits (documents kept to
  themselves) over the targets whose document is their input's: no document's first token is predicted from
  the document before it."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from training import config as config_lib, step  # pylint: disable=g-import-not-at-top

  config = shrunken.shrunken_config()
  model = step.build_model(config_lib.resolve_model_config(config.model), "bf16")
  tokens = jax.random.randint(jax.random.key(0), (2, 13), 1, 256)
  segment_ids = jnp.asarray([[0] * 4 + [1] * 6 + [2] * 3, [0] * 13], jnp.int32)
  params = model.init({"params": jax.random.key(1)}, tokens[:, :-1])["params"]
  inputs, targets, documents = step.window({"tokens": tokens, "segment_ids": segment_ids})
  np.testing.assert_array_equal(documents["target_weights_BxL"][0], [1, 1, 1, 0] + [1] * 5 + [0, 1, 1])
  assert bool(documents["target_weights_BxL"][1].all())
  loss = step.model_loss(model, params, inputs, targets, jax.random.key(2), documents)
  logits = model.apply({"params": params}, inputs, segment_ids_BxL=documents["segment_ids_BxL"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  weights = documents["target_weights_BxL"]
  np.testing.assert_allclose(loss, jnp.sum(ce * weights) / jnp.sum(weights), rtol=2e-6)
  np.testing.assert_allclose(step.eval_step(params, {"tokens": tokens, "segment_ids": segment_ids}, model=model),
                             loss, rtol=2e-6)
  assert abs(float(loss) - float(step.eval_step(params, tokens, model=model))) > 1e-4   # off: another loss


# ~30 s loaded (two compiles). By default: the masked loss (above), the packer's batches
# (tests/test_train_data.py) and their placement on the mesh (tests/test_train_sharding.py).
@pytest.mark.slow
def test_tiny_trains_with_document_masking(tmp_path, capfd):
  """config.data.document_masking=True end to end: the packer's segment ids reach the step and the evaluation,
  and the loss falls."""
  workdir = str(tmp_path / "run")
  config = shrunken.shrunken_config(steps=12, **{"optim.lr": 1e-2, "data.document_masking": True,
                                                "eval.every_steps": 12})
  summary = trainer.train_and_evaluate(config, workdir)
  assert summary["status"] == "done" and np.isfinite(summary["validation_loss"])
  assert "document masking: documents end at token 0" in capfd.readouterr().out
  train = _records(workdir, "train")
  assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["data"]["document_masking"] is True
