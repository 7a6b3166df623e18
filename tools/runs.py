"""A training run on disk: ``<workdir>/config.json`` and the orbax checkpoints ``train.py`` writes.

``load_run(workdir)`` gives the model config, the tokenizer spec and the parameters of the latest (or a
chosen) checkpoint, read by ``training.checkpoint.Checkpoints.restore_params`` (the optimizer state is
never loaded). ``write_run(workdir, config, params)`` writes such a run (step 0, fresh optimizer state)
from parameters made elsewhere (``tools.hf import``), so the trainer and ``sample.py`` can read it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from configs import base as base_config
from models import LanguageModel, ModelConfig
from training import checkpoint as ckpt_lib
from training import config as config_lib
from training import data as data_lib
from training import optim
from training.step import init_state


class RunError(ValueError):
  """A work directory that is not a usable run; the message says what is missing and how to fix it."""


@dataclasses.dataclass
class Run:
  workdir: str
  config: config_dict.ConfigDict   # the training config the run was made with
  model_config: ModelConfig
  params: Any                      # unboxed float32 parameter tree (host or default device)
  step: int


def load_config(workdir: str) -> config_dict.ConfigDict:
  """The run's training config, read back from ``<workdir>/config.json``."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise RunError(f"work directory {workdir!r} does not exist; pass the --workdir of a train.py run")
  if not os.path.isfile(path):
    raise RunError(f"{path} is missing: {workdir!r} is not a train.py work directory (train.py writes "
                   "config.json when it starts)")
  with open(path, encoding="utf-8") as f:
    try:
      plain = json.load(f)
    except json.JSONDecodeError as e:
      raise RunError(f"{path} is not valid JSON ({e}); restore it or retrain") from None
  if not isinstance(plain, dict) or "model" not in plain:
    raise RunError(f"{path} has no 'model' section; it was not written by train.py")
  return config_dict.ConfigDict(plain)


def model_config_of(config: config_dict.ConfigDict) -> ModelConfig:
  try:
    return config_lib.resolve_model_config(config.model)
  except config_lib.ConfigError as e:
    raise RunError(f"the run's config.json does not describe a model this version builds: {e}") from None


def _abstract_state(config, model_config: ModelConfig):
  """The trainer's state tree (``training.step.init_state``), unallocated, params unboxed."""
  model = LanguageModel(model_config, recipe="bf16")   # the parameter tree does not depend on the recipe
  tx, _ = optim.make_optimizer(config.optim, config.steps)
  abstract = jax.eval_shape(functools.partial(init_state, model, tx, config.seed, 1))
  return dict(abstract, params=nn.unbox(abstract["params"])), tx


def load_run(workdir: str, step: int | None = None) -> Run:
  """The run in ``workdir`` with the parameters of checkpoint ``step`` (default: the latest)."""
  config = load_config(workdir)
  model_config = model_config_of(config)
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise RunError(f"{directory} does not exist: the run in {workdir!r} has saved no checkpoint yet "
                   "(train.py saves every config.checkpoint.every_steps steps and at the end)")
  checkpoints = ckpt_lib.Checkpoints(directory, keep=max(int(config.checkpoint.keep), 1), async_save=False,
                                     create=False)
  try:
    steps = checkpoints.steps()
    if not steps:
      raise RunError(f"{directory} holds no finished checkpoint; train longer or wait for the save to finish")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise RunError(f"{directory} has no checkpoint {step}; it has steps {steps}")
    abstract, _ = _abstract_state(config, model_config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract["params"])
    try:
      params = checkpoints.restore_params(step, target)   # the optimizer state stays on disk
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
      raise RunError(f"checkpoint {directory}/{step} does not match the run's config.json: {str(e)[:300]}") from None
  finally:
    checkpoints.close()
  return Run(os.path.abspath(workdir), config, model_config, params, int(step))


def training_config(model_config: ModelConfig, *, base: config_dict.ConfigDict | None = None,
                    name: str = "imported") -> config_dict.ConfigDict:
  """A full training config (``base``, default ``configs/base.py``'s fields) whose model section states
  every ``ModelConfig`` field of ``model_config`` explicitly (on top of the ``tiny`` preset)."""
  config = config_dict.ConfigDict(config_lib.to_plain(base)) if base is not None else _base_config()
  config.name = name
  for field in dataclasses.fields(model_config):
    value = getattr(model_config, field.name)
    if isinstance(value, (jnp.dtype, type)) or field.name.endswith("dtype"):
      value = jnp.dtype(value).name
    config.model[field.name] = list(value) if isinstance(value, tuple) else value
  config.model.preset = "tiny"
  return config


def _base_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(config_lib.to_plain(base_config.get_config()))


def write_run(workdir: str, config: config_dict.ConfigDict, params, *, note: str = "") -> str:
  """Writes ``params`` as checkpoint 0 of a new run in ``workdir`` (fresh optimizer state, the trainer's
  layout) and the training ``config`` as its config.json. Returns the checkpoint directory."""
  model_config = model_config_of(config)
  abstract, tx = _abstract_state(config, model_config)
  params = nn.unbox(params)
  describe = lambda x: f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"
  got, want = jax.tree.map(describe, params), jax.tree.map(describe, abstract["params"])
  if got != want:
    raise RunError("the parameters do not fit the config's model (shapes or dtypes differ); "
                   f"first differences: {_first_diffs(got, want)}")
  directory = os.path.join(workdir, "checkpoints")
  if os.path.isdir(directory) and os.listdir(directory):
    raise RunError(f"{directory} already holds checkpoints; choose a new --out directory")
  os.makedirs(workdir, exist_ok=True)
  params = jax.tree.map(jnp.asarray, params)
  _, _, k_train = jax.random.split(jax.random.PRNGKey(config.seed), 3)
  state = dict(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=k_train,
               nonfinite_total=jnp.zeros((), jnp.int32), nonfinite_streak=jnp.zeros((), jnp.int32))
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_lib.to_plain(config), f, indent=2)
  checkpoints = ckpt_lib.Checkpoints(directory, keep=max(int(config.checkpoint.keep), 1), async_save=False)
  try:
    checkpoints.save(0, state, dict(iterator=_fresh_iterator_state(), process_count=1, step=0, note=note))
    checkpoints.wait()
  finally:
    checkpoints.close()
  return directory


def _fresh_iterator_state() -> dict:
  """The state of a data iterator that has produced nothing yet (the same for every split and seed), so
  that train.py resuming this work directory starts its data from the beginning."""
  split = data_lib.Split([np.zeros(2, np.uint8)], window=2)
  return data_lib.batches(split, global_batch=1, seed=0, process_index=0, process_count=1,
                          read_threads=0, prefetch=0).get_state()


def _first_diffs(got, want, limit: int = 3) -> str:
  flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  lines = []
  for path in sorted(set(flat_got) | set(flat_want), key=str):
    a, b = flat_got.get(path), flat_want.get(path)
    if a != b:
      lines.append(f"{jax.tree_util.keystr(path)}: got {a}, the model has {b}")
  return "; ".join(lines[:limit]) or "tree structure"
