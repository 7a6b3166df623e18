"""Sharded training on CPU: an 8-device mesh (data 2 x fsdp 2 x tensor 2) and two jax.distributed processes
on localhost both reproduce the 1-device run's losses. The runs go in subprocesses, started together."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from configs import shrunken
from training import sharding
from training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
TIMEOUT_S = 300
sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

_DRIVER = """
import json, sys
sys.path.insert(0, {root!r})
import jax
if {coordinator!r}:
  jax.distributed.initialize(coordinator_address={coordinator!r}, num_processes=2, process_id={process_id},
                             initialization_timeout=120)
from configs import shrunken
from training import trainer
config = shrunken.shrunken_config(steps={steps}, **{overrides!r})
summary = trainer.train_and_evaluate(config, {workdir!r})
print("SUMMARY " + json.dumps(dict(summary, devices=jax.device_count(), processes=jax.process_count())))
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, *, overrides, devices=1, coordinator="", process_id=0):
  env = dict(os.environ, **shrunken.compilation_cache_env(),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  code = _DRIVER.format(root=ROOT, coordinator=coordinator, process_id=process_id, steps=STEPS,
                        overrides=overrides, workdir=workdir)
  return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(process):
  try:
    output, _ = process.communicate(timeout=TIMEOUT_S)
  finally:
    if process.poll() is None:
      process.kill()
  assert process.returncode == 0, output
  line = [l for l in output.splitlines() if l.startswith("SUMMARY ")][-1]
  return json.loads(line[len("SUMMARY "):])


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return np.asarray([r["last_loss"] for r in map(json.loads, f) if r["kind"] == "train"])


@pytest.mark.slow   # covered by the mesh: test_sharding_mesh.py::test_eight_devices
def test_8_device_mesh_and_2_processes_match_1_device(tmp_path):
  base = {"eval.batches": 1, "checkpoint.every_steps": 2}
  mesh8 = str(tmp_path / "mesh8")
  two = str(tmp_path / "two")
  address = f"127.0.0.1:{_free_port()}"
  processes = [_start(mesh8, devices=8, overrides={**base, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})]
  processes += [_start(two, coordinator=address, process_id=i, overrides=base) for i in (0, 1)]
  try:
    one = str(tmp_path / "one")
    reference = trainer.train_and_evaluate(shrunken.shrunken_config(steps=STEPS, **base), one)
    summaries = [_finish(p) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  mesh_summary, *process_summaries = summaries
  assert (mesh_summary["devices"], mesh_summary["processes"]) == (8, 1)
  assert [(s["devices"], s["processes"]) for s in process_summaries] == [(2, 2), (2, 2)]

  # fp32 tolerance: the same math, reduced in another order across devices.
  expected = _losses(one)
  assert len(expected) == STEPS
  np.testing.assert_allclose(_losses(mesh8), expected, rtol=2e-5, atol=0)
  np.testing.assert_allclose(_losses(two), expected, rtol=2e-5, atol=0)
  np.testing.assert_allclose(mesh_summary["validation_loss"], reference["validation_loss"], rtol=2e-5)

  # The two processes hold one replicated result: they agree exactly.
  a, b = process_summaries
  assert (a["train_loss"], a["validation_loss"], a["step"]) == (b["train_loss"], b["validation_loss"], b["step"])
  np.testing.assert_allclose(a["validation_loss"], reference["validation_loss"], rtol=2e-5)
  assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["2", "4"]
