"""A seconds-long variant of the tiny config, for tests and smoke runs: ``shrunken_config(steps=8)``.

The model keeps one block of each kind (Mamba-2, attention, MLP) at width 32; sequences of 32 bytes,
batches of 4; recipe bf16 unless given.
"""
from __future__ import annotations

import os
import tempfile

TEST_COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), "fp4jax_test_compilation_cache")

SHRUNKEN_MODEL = dict(d_model=32, pattern="M*-", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
                      ssm_head_dim=16, chunk_size=16, bf16_first_blocks=0, bf16_last_blocks=0)


def shrunken_config(*, steps: int = 8, recipe: str = "bf16", **overrides):
  """``configs/tiny.py`` made tiny; ``overrides`` are dotted paths: ``shrunken_config(**{"data.seq_len": 16})``."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.name = "shrunken"
  c.recipe = recipe
  c.steps = steps
  c.batch_size = 4
  c.log_every = 1
  c.data.seq_len = 32
  c.data.read_threads = 0
  c.data.prefetch = 0
  c.optim.warmup_steps = 2
  c.eval.every_steps = 0
  c.eval.batches = 2
  c.checkpoint.every_steps = 0
  for name, value in SHRUNKEN_MODEL.items():
    c.model[name] = value
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def shrunken_flags(*, steps: int = 8, recipe: str = "bf16") -> list[str]:
  """The same config as ``train.py`` command-line flags (on top of configs/tiny.py)."""
  flags = [f"--config.recipe={recipe}", f"--config.steps={steps}", "--config.batch_size=4", "--config.log_every=1",
           "--config.data.seq_len=32", "--config.data.read_threads=0", "--config.data.prefetch=0",
           "--config.optim.warmup_steps=2", "--config.eval.every_steps=0", "--config.eval.batches=2",
           "--config.checkpoint.every_steps=0"]
  flags += [f"--config.model.{k}={v}" for k, v in SHRUNKEN_MODEL.items()]
  return flags


def compilation_cache_env(path: str = TEST_COMPILATION_CACHE) -> dict:
  """Environment variables that turn on JAX's persistent compilation cache in a subprocess."""
  return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
