"""The training pipeline's fault tests share these: shrunken runs (a few steps, the shared compilation cache),
the command line run as a subprocess, its one-line errors, the metrics and checkpoints a run leaves, and a
finished run to copy into each checkpoint-fault case."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from configs import shrunken
from training import sharding
from training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

CLEAR = "clear error"
CORRECT = "correct result"


def run_config(steps=4, **overrides):
  return shrunken.shrunken_config(steps=steps, **{"eval.batches": 0, "checkpoint.every_steps": 2, **overrides})


def train_cli(workdir, *args, timeout=300):
  command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
             f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}", *args]
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def shrunken_cli(workdir, *args, steps=4):
  return train_cli(workdir, "--config=configs/shrunken.py", f"--config.steps={steps}", *args)


def assert_clear(result, exit_code, *phrases):
  assert result.returncode == exit_code, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
  message = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(message) == 1, result.stderr[-3000:]
  for phrase in phrases:
    assert phrase in message[0], message[0]
  return message[0]


def read_metrics(workdir):
  """metrics.jsonl, parsed strictly (no NaN/Infinity tokens)."""
  def reject(token):
    raise AssertionError(f"not JSON: {token}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def checkpoint_state(workdir, step):
  with ocp.StandardCheckpointer() as checkpointer:
    return jax.tree.map(np.asarray, checkpointer.restore(os.path.join(workdir, "checkpoints", str(step), "state")))


def assert_same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def make_finished(base) -> tuple[str, str]:
  """A 4-step run with checkpoints 2 and 4, and a 6-step run straight through (the exact reference), in
  ``base``: the ``finished`` fixture (tests/conftest.py)."""
  four, six = str(base / "four"), str(base / "six")
  trainer.train_and_evaluate(run_config(steps=6, halt_after=4), four)
  trainer.train_and_evaluate(run_config(steps=6), six)
  return four, six


def copy_run(finished, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished[0], workdir)
  return workdir
