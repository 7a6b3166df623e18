"""Shrunken: a seconds-long variant of the tiny config, for tests and smoke runs.

  python train.py --config configs/shrunken.py --workdir /tmp/shrunken

The model keeps one block of each kind (Mamba-2, attention, MLP) at width 32; sequences of 32 bytes,
batches of 4, 8 steps (a warmup of 2, of steps - 1 in shorter runs); recipe bf16. From Python: ``shrunken_config(steps=8, recipe="nvfp4", **overrides)``
(overrides are dotted paths); on the command line: ``shrunken_flags(...)`` on top of configs/tiny.py.
Tests and subprocess runs share one persistent compilation cache, ``TEST_COMPILATION_CACHE``.
"""
from __future__ import annotations

import os
import tempfile

from configs import tiny

TEST_COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), "fp4jax_test_compilation_cache")

SHRUNKEN_MODEL = dict(d_model=32, pattern="M*-", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
                      ssm_head_dim=16, chunk_size=16, bf16_first_blocks=0, bf16_last_blocks=0)
_SHRUNKEN_FIELDS = {"batch_size": 4, "log_every": 1, "data.seq_len": 32, "data.read_threads": 0,
                    "data.prefetch": 0, "optim.warmup_steps": 2, "eval.every_steps": 0, "eval.batches": 2,
                    "checkpoint.every_steps": 0}


def _fields(steps: int) -> dict:
  """The shrunken fields for a run of ``steps``: a warmup of 2 steps, shorter in runs of 2 steps or fewer (the
  trainer refuses a warmup as long as the run)."""
  return {**_SHRUNKEN_FIELDS, "optim.warmup_steps": min(_SHRUNKEN_FIELDS["optim.warmup_steps"], steps - 1)}


def _set(config, path: str, value) -> None:
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def shrunken_config(*, steps: int = 8, recipe: str = "bf16", **overrides):
  """``configs/tiny.py`` made tiny; ``overrides`` are dotted paths: ``shrunken_config(**{"data.seq_len": 16})``."""
  c = tiny.get_config()
  c.name = "shrunken"
  c.recipe = recipe
  c.steps = steps
  for path, value in _fields(steps).items():
    _set(c, path, value)
  for name, value in SHRUNKEN_MODEL.items():
    c.model[name] = value
  for path, value in overrides.items():
    _set(c, path, value)
  return c


def shrunken_flags(*, steps: int = 8, recipe: str = "bf16", **overrides) -> list[str]:
  """The same config as ``train.py`` command-line flags (on top of configs/tiny.py), each field once (train.py
  refuses a flag given twice); ``overrides`` are dotted paths, as for ``shrunken_config``."""
  fields = {**_fields(steps), **{f"model.{k}": v for k, v in SHRUNKEN_MODEL.items()}, **overrides}
  return [f"--config.recipe={recipe}", f"--config.steps={steps}"] + [f"--config.{k}={v}" for k, v in fields.items()]


def compilation_cache_env(path: str = TEST_COMPILATION_CACHE) -> dict:
  """Environment variables that turn on JAX's persistent compilation cache in a subprocess."""
  return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


# For a process that compiles programs only to read them (their partitioned or optimized HLO) and runs none: the
# CPU's machine code at LLVM's lowest optimization level, which leaves every HLO pass as it is and takes about a
# quarter less CPU to compile (tests/test_sharding_wire.py with tests/test_mesh_nodes.py: 87 -> 64 s). Never for
# a process whose results are compared: at that level LLVM contracts no multiply-add into an FMA, which the
# users' default compile does (docs/PERF.md, "A lower LLVM optimization level, rejected").
READ_ONLY_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes"


def get_config():
  return shrunken_config()
