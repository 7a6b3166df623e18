"""Profile-guided scheduling (config.pgle_steps, training/pgle.py): the steps traced, the profile kept by the
program's fingerprint, the step compiled again with it, a resume compiling with it at once, the numerics unchanged.

XLA measures instruction times on NVIDIA GPUs only, and its CPU compile records no fingerprint: on the CPU the
run says so and keeps its schedule; the GPU path is run here with the fingerprint and the profile's bytes stood in."""
import json
import os

import pytest

from configs import shrunken
from training import pgle
from training import sharding
from training import step as step_lib
from training import trainer
from training.config import ConfigError, validate

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

# A ProfiledInstructionsProto with one cost (field 1: {name: "fusion", cost_us: 1.0}), as XLA serializes it.
PROFILE = b"\n\x11\n\x06fusion\x11\x00\x00\x00\x00\x00\x00\xf0?"


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.fixture
def gpu_standins(monkeypatch):
  """The fingerprint a GPU compile records and the profile its trace gives; the options of every recompile."""
  recompiles, traced = [], []
  monkeypatch.setattr(pgle, "fingerprint", lambda text: "0123abcd")

  def collect(run_dir):
    traced.append(run_dir)
    assert any(f.endswith(".xplane.pb") for f in os.listdir(run_dir))
    return PROFILE
  monkeypatch.setattr(pgle, "collect", collect)
  recompile = step_lib.CompiledAtFirstCall.recompile

  def recording(self, options):
    recompiles.append(dict(options))
    return recompile(self, options)
  monkeypatch.setattr(step_lib.CompiledAtFirstCall, "recompile", recording)
  return recompiles, traced


def test_profiled_then_compiled_again_and_resumed_with_it(tmp_path, gpu_standins, capfd):
  recompiles, traced = gpu_standins
  plain = str(tmp_path / "plain")
  trainer.train_and_evaluate(shrunken.shrunken_config(steps=8, log_every=1), plain)
  assert not recompiles
  run = str(tmp_path / "pgle")
  path = os.path.join(run, "pgle", "0123abcd.pb")
  config = shrunken.shrunken_config(steps=8, log_every=1, pgle_steps=2, halt_after=4)
  assert trainer.train_and_evaluate(config, run)["status"] == "halted"
  assert len(traced) == 1 and not os.path.exists(traced[0])  # steps 2 and 3 traced once, the trace removed
  with open(path, "rb") as f:
    assert f.read() == PROFILE
  assert recompiles == [{pgle.OPTION: path}]
  assert "compiling the train step with the profile of steps 2..3" in capfd.readouterr().out
  config = shrunken.shrunken_config(steps=8, log_every=1, pgle_steps=2)
  assert trainer.train_and_evaluate(config, run)["status"] == "done"
  assert len(traced) == 1                                    # the resume found the profile: nothing traced
  assert recompiles == [{pgle.OPTION: path}] * 2
  assert f"compiling the train step with its profile {path}" in capfd.readouterr().out
  assert _losses(run) == _losses(plain)                      # the schedule changes no number


def test_cpu_compile_keeps_its_schedule(tmp_path, capfd):
  run = str(tmp_path / "run")
  assert trainer.train_and_evaluate(shrunken.shrunken_config(steps=3, pgle_steps=1), run)["status"] == "done"
  assert "keeps XLA's schedule: the compiler records no fingerprint" in capfd.readouterr().out
  assert not os.path.exists(os.path.join(run, "pgle"))


def test_fingerprint_is_read_from_the_compiled_module():
  head = 'HloModule jit_train_step, is_scheduled=true, frontend_attributes={fingerprint_before_lhs="42c9f559"}\n'
  assert pgle.fingerprint(head) == "42c9f559"
  layout = "entry_computation_layout={(" + ", ".join(["bf16[4096,5376]{1,0}"] * 2000) + ")}"   # a large model's
  assert pgle.fingerprint(head.replace("is_scheduled=true", f"is_scheduled=true, {layout}")) == "42c9f559"
  assert pgle.fingerprint("HloModule jit_f, is_scheduled=true\n") is None


def test_bad_pgle_steps_is_refused():
  with pytest.raises(ConfigError, match="config.pgle_steps=-1"):
    validate(shrunken.shrunken_config(steps=3, pgle_steps=-1))
