"""What a start does with a work directory: the run record (config.json, config_history.jsonl) changes only when
the run does, a refused resume names every field that differs from it with both values, the temporary folders of
interrupted saves go, and a failed background save is reported without waiting for the next one."""
import errno
import os
import shutil
import time

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from configs import shrunken
from training import errors
from training import sharding
from training import trainer
from training import workdir as workdir_lib
from training.checkpoint import TMP_SUFFIX, Checkpoints

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

CLEAR = "clear error"
CORRECT = "correct result"
# test name -> (case, expected verdict, exit code of train.py or None); in docs/RELIABILITY.md's training matrix
CASES = {
    "test_resume_that_trains_nothing_writes_nothing": (
        "resume of a finished run with a smaller config.steps and --allow_config_change: nothing to do, the run "
        "record unchanged; the original command still resumes", CORRECT, 0),
    "test_refusal_names_every_changed_field": (
        "resume changing recipe, lr and steps at once: refused naming all three, with both values", CLEAR, 6),
    "test_leftover_temporary_checkpoint_folders_are_removed": (
        "checkpoints/<step>.orbax-checkpoint-tmp folders of interrupted saves: removed and named at the next "
        "start, the complete checkpoints untouched", CORRECT, 0),
    "test_failed_background_save_is_reported_without_another_save": (
        "a background checkpoint write fails ('File too large'): StorageError naming the step at the first step "
        "after it ended, not at the next save", CLEAR, 7),
}


def _config(steps=6, **overrides):
  return shrunken.shrunken_config(steps=steps, **{"eval.batches": 0, "checkpoint.every_steps": 2, **overrides})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A 6-step run, finished."""
  workdir = str(tmp_path_factory.mktemp("record") / "six")
  trainer.train_and_evaluate(_config(), workdir)
  return workdir


def _copy(finished, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished, workdir)
  return workdir


def _record(workdir):
  out = {}
  for name in (workdir_lib.CONFIG_FILE, workdir_lib.HISTORY_FILE):
    with open(os.path.join(workdir, name), "rb") as f:
      out[name] = f.read()
  return out


def test_resume_that_trains_nothing_writes_nothing(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  before = _record(workdir)
  summary = trainer.train_and_evaluate(_config(steps=4, allow_config_change=True), workdir)
  assert summary["steps_run"] == 0 and summary["step"] == 6
  assert _record(workdir) == before
  # The run's own command still resumes (nothing to do), checked against the config its steps were made with.
  summary = trainer.train_and_evaluate(_config(), workdir)
  assert summary["steps_run"] == 0 and _record(workdir) == before


def test_refusal_names_every_changed_field(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  before = _record(workdir)
  with pytest.raises(errors.ConfigChangedError) as info:
    trainer.train_and_evaluate(_config(steps=10, recipe="nvfp4", **{"optim.lr": 1e-3}), workdir)
  message = str(info.value)
  assert info.value.exit_code == 6
  for phrase in ("3 field(s) differ", "recipe: 'bf16' -> 'nvfp4'", "optim.lr: 0.003 -> 0.001", "steps: 6 -> 10",
                 "--allow_config_change", "all of them"):
    assert phrase in message, message
  assert "\n" not in message
  assert _record(workdir) == before


def test_leftover_temporary_checkpoint_folders_are_removed(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  checkpoints = os.path.join(workdir, "checkpoints")
  before = sorted(os.listdir(checkpoints))
  for name in ("8.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1764770000"):   # a killed save; a stale twin
    os.makedirs(os.path.join(checkpoints, name, "state"))
    with open(os.path.join(checkpoints, name, "state", "partial"), "w") as f:
      f.write("x")
  capsys.readouterr()
  summary = trainer.train_and_evaluate(_config(), workdir)
  assert summary["steps_run"] == 0
  assert sorted(os.listdir(checkpoints)) == before
  printed = capsys.readouterr()
  complete = sorted(int(n) for n in before if n.isdigit())
  assert ("removed 2 temporary folder(s) of interrupted checkpoint saves: 6.orbax-checkpoint-tmp-1764770000, "
          f"8.orbax-checkpoint-tmp (the complete checkpoints {complete} are untouched)") in printed.out


def test_failed_background_save_is_reported_without_another_save(tmp_path, monkeypatch):
  real_finalize = ocp.StandardCheckpointHandler.finalize   # runs in the background thread, after the writes

  def too_large(self, directory):
    if f"{os.sep}3{TMP_SUFFIX}" in str(directory):
      raise OSError(errno.EFBIG, "File too large")
    return real_finalize(self, directory)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "finalize", too_large)
  checkpoints = Checkpoints(str(tmp_path / "checkpoints"), keep=3, async_save=True)
  state = {"w": jnp.ones((64, 64))}
  checkpoints.save(1, state, {"step": 1})
  checkpoints.wait()
  checkpoints.save(3, state, {"step": 3})
  deadline = time.monotonic() + 60
  with pytest.raises(errors.StorageError, match=r"writing checkpoint 3 .* File too large.*\[1\], are intact"):
    while time.monotonic() < deadline:   # what the loop calls after every step; never a save or a wait
      checkpoints.check_background_save()
      time.sleep(0.01)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
