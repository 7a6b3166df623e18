"""A run's fixed parts, built once: ``setup(config, workdir) -> Run``; its first state: ``init_or_restore(run)``.

``setup``:
1. Check the config and build the mesh; then the work directory: writable? its lock (one run at a time,
   ``training.lock``), does it hold a run made with another config (a longer ``steps`` is an extension,
   ``training.extend``)? The reporter and the checkpoints.
2. Read the data: every bad input fails before any compute.
3. The models (a second one for the precision switch), the optimizer, the state's shardings
   (eval_shape -> logical specs -> NamedShardings); the config record and the data iterators.
Each slow phase is printed with its time (``reading and tokenizing the data ... 12.3 s``).

``init_or_restore``: the newest checkpoint of the work directory that reads back intact (an unreadable one
is reported, moved to ``<workdir>/unreadable_checkpoints/`` and the next older one tried, unless
``config.checkpoint.fallback`` is False); else, with ``config.init_from``, the params of another run's
latest checkpoint with a fresh optimizer at step 0; else a fresh init. The state is created already sharded.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
from typing import Any, Callable

import flax.linen as nn
import jax
import optax
from flax import traverse_util
from jax.experimental import multihost_utils

import fp4jax
from fp4jax.outcontrol import k8 as outcontrol_k8
from models.lm import scanned_params, unscanned_params
from models.report import precision_summary
from models.rules import PrecisionRuleError
from training import checkpoint as ckpt_lib
from training import config as config_lib
from training import data as data_lib
from training import lock as lock_lib
from training import optim
from training import preempt
from training import report as report_lib
from training import sharding
from training import trackers
from training import workdir as workdir_lib
from training.errors import CheckpointError, ConfigChangedError, ConfigError
from training.step import init_state

UNREADABLE_DIR = "unreadable_checkpoints"


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a run is made of except its state; built by ``setup``, closed (once) by ``close``."""
  config: Any
  workdir: str
  mesh: jax.sharding.Mesh
  model: nn.Module
  recipe: fp4jax.Recipe
  late_model: nn.Module | None       # the precision switch's model (same params), or None
  late_recipe: fp4jax.Recipe | None
  switch_step: int                   # the first step of late_model
  tx: optax.GradientTransformation
  schedule: optim.Schedule          # the learning rate by applied updates (an input of the compiled step)
  osci: optim.OsciReset | None       # TetraJet-v2's OsciReset after each update (config.osci_reset), or None
  outcontrol: optim.OutControl | None  # TetraJet-v2's OutControl schedule (config.outcontrol), or None
  init_fn: Callable[[], dict]        # a fresh state, params boxed with logical axis names
  abstract_state: dict               # ShapeDtypeStructs of the state, params unboxed
  state_shardings: dict
  train_iter: Any                    # grain iterator with get_state/set_state
  val_batches: list                  # host batches of the validation split ([] when not evaluating)
  tokens_per_byte: float | None      # of the validation split, for bits per byte
  checkpoints: ckpt_lib.Checkpoints
  reporter: report_lib.Reporter
  process_count: int
  lock: lock_lib.WorkdirLock | None  # process 0's hold on the work directory, released by close()

  @property
  def num_params(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_state["params"]))

  def recipe_at(self, step: int) -> fp4jax.Recipe:
    """The recipe of the step that starts at ``step`` (0-based)."""
    return self.late_recipe if self.late_recipe is not None and step >= self.switch_step else self.recipe

  def outcontrol_phase_at(self, step: int) -> str:
    """OutControl's phase of the step that starts at ``step``: "plain" without OutControl and during the
    precision switch (its recipe runs without the split), else ``optim.OutControl.phase_at``."""
    if self.outcontrol is None or (self.late_recipe is not None and step >= self.switch_step):
      return optim.PLAIN
    return self.outcontrol.phase_at(step)

  def say(self, text: str) -> None:
    self.reporter.message(text)

  def close(self, *, draw: bool = True) -> str | None:
    """Waits for the checkpoint writes (StorageError if one failed), then closes the reporter (loss.png unless
    ``draw`` is False: a run stopped by a signal leaves it to the next start); loss.png's path."""
    try:
      self.checkpoints.close()
    finally:
      try:
        png = self.reporter.close(f"{self.config.name}: {self.config.model.preset}, {self.recipe.name}", draw=draw)
      finally:
        if self.lock is not None:
          self.lock.release()
    return png


def setup(config, workdir: str, *, model_fn: Callable[[Any, Any], nn.Module],
          stop: preempt.Preemption | None = None) -> Run:
  """Checks everything that can be checked, then builds the run (see the module docstring)."""
  stop = stop or preempt.Preemption(config.get("preemption_grace_s", 30.0))
  # 1. Checks, mesh, the work directory.
  config_lib.validate(config)
  recorded = workdir_lib.last_config(workdir).config
  config_lib.keep_recorded_sr_bits(config, recorded)
  tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
  config_lib.keep_recorded_vocab_size(config, vocab_record(config, recorded), tokenizer.vocab_size)
  model_config = config_lib.resolve_model_config(config.model)
  recipe, late_recipe, switch_step = config_lib.resolve_recipes(config)
  outcontrol = config_lib.resolve_outcontrol(config, recipe)
  model_config = model_config.replace(outcontrol_ratio=outcontrol.ratio if outcontrol else 0.0)
  mesh = sharding.make_mesh(config.mesh)
  nproc, pindex = jax.process_count(), jax.process_index()
  batch_ways = sharding.batch_ways(mesh)
  sharding.check_experts(dict(mesh.shape), model_config)
  check_batch(config.batch_size, config.micro_batches, batch_ways, nproc)
  workdir, checkpoints, reporter, lock, resume = _open_workdir(config, workdir, pindex, stop)
  try:
    return _build(config, workdir, model_fn, stop, model_config=model_config, recipe=recipe,
                  late_recipe=late_recipe, switch_step=switch_step, outcontrol=outcontrol, mesh=mesh,
                  checkpoints=checkpoints, reporter=reporter, lock=lock, resume=resume, tokenizer=tokenizer)
  except BaseException:
    checkpoints.close()
    reporter.close()
    if lock is not None:
      lock.release()
    raise


def check_batch(batch_size: int, micro_batches: int, batch_ways: int, nproc: int) -> None:
  """A ConfigError naming the fix unless each of the step's micro-batches (batch_size / micro_batches rows)
  splits evenly over the batch's devices (data x fsdp x expert) and over the processes."""
  unit = micro_batches * math.lcm(batch_ways, nproc)
  if batch_size % unit:
    fix = f"set --config.batch_size={-(-batch_size // unit) * unit}" + (
        f" or lower config.micro_batches={micro_batches}" if micro_batches > 1 else "")
    raise ConfigError(f"config.batch_size={batch_size} must be a multiple of micro_batches x data x fsdp x expert "
                      f"= {micro_batches} x {batch_ways}" + (f" and of {micro_batches} x the {nproc} processes"
                                                            if nproc > 1 else "")
                      + f", so that every micro-batch splits evenly over the devices; {fix}")


def _build(config, workdir, model_fn, stop, *, model_config, recipe, late_recipe, switch_step, outcontrol, mesh,
           checkpoints, reporter, lock, resume, tokenizer) -> Run:
  """Steps 2 and 3 of ``setup``, in the work directory it opened."""
  nproc, pindex, seq_len = jax.process_count(), jax.process_index(), config.data.seq_len
  say = reporter.message
  say(f"fp4jax train: {config.name}  model {config.model.preset} ({model_config.n_blocks} blocks "
      f"'{model_config.pattern}', d_model {model_config.d_model}"
      + (f"; MTP {model_config.mtp_depths} depth(s) '{model_config.mtp_pattern}', weight {model_config.mtp_loss_weight}"
         if model_config.mtp_depths else "") + f")  recipe {recipe.name}"
      + (f" (sr_bits {recipe.sr_bits})" if recipe.sr_bits != fp4jax.random_bits.DEFAULT else "")
      + (f" -> {late_recipe.name} from step {switch_step}" if late_recipe else ""))
  if lock is not None and lock.taken_over:
    say(f"warning: {lock.taken_over}")
  for line in resume.messages:
    say(line)
  # 2. The data.
  stop.detail = "reading the data"
  with reporter.phase("reading and tokenizing the data"):
    train_split, val_split, data_summary, evaluate = _load_data(config, model_config, tokenizer)
  say(f"data: {data_lib.describe(data_summary)}"
      + (f"; model vocab_size {model_config.vocab_size}" if model_config.vocab_size != tokenizer.vocab_size else ""))

  # 3. Models, optimizer, shardings.
  stop.detail = "building the model"
  with reporter.phase("building the model and its shardings"):
    model, late_model, tx, schedule, osci, init_fn, abstract, state_sh = _layout(
        config, model_fn, model_config, recipe, late_recipe, outcontrol, mesh)

  say(f"precision ({_precision_name(model_config)}): {precision_summary(model_config, recipe, abstract['params'])}"
      + (f"; from step {switch_step}: {precision_summary(model_config, late_recipe, abstract['params'])}"
         if late_recipe else ""))
  if outcontrol is not None:
    say(f"OutControl: channel norms recorded in steps {outcontrol.record_start}..{outcontrol.on_step - 1}, "
        f"then {_outcontrol_summary(abstract['outcontrol'], outcontrol.ratio)} in MXFP8 from step "
        f"{outcontrol.on_step}")
  nodes = sharding.describe_nodes(config.mesh, dict(mesh.shape))
  once = sharding.describe_step(config.mesh, dict(mesh.shape), config.micro_batches)
  say(f"mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
      f"{nproc} process(es)" + (f" ({nodes})" if nodes else "") + f"; batch {config.batch_size} x {seq_len} tokens"
      + (f" in {config.micro_batches} micro-batches of {config.batch_size // config.micro_batches}"
         if config.micro_batches > 1 else "")
      + (f"; {once}" if once else "") + f"; workdir {workdir}")
  if reporter.writers:
    say("metrics: " + ", ".join(writer.where for writer in reporter.writers))
  # The run record changes only when the run does: a resume at or past config.steps trains nothing and writes
  # nothing (a later start is then checked against the config the checkpoints were made with).
  if pindex == 0 and (resume.step is None or resume.step < config.steps):
    workdir_lib.record_config(workdir, config, step=resume.step or 0, event="resume" if resume.step else "start",
                              changes=resume.changes)
  train_iter = data_lib.batches(train_split, global_batch=config.batch_size, seed=config.seed,
                                process_index=pindex, process_count=nproc,
                                read_threads=config.data.read_threads, prefetch=config.data.prefetch)
  # Validation runs in micro-batches too (N times as many, N times smaller: the same windows, the same mean).
  micro = config.micro_batches
  val_batches = (data_lib.eval_batches(val_split, global_batch=config.batch_size // micro,
                                       num_batches=config.eval.batches * micro, seed=config.seed,
                                       process_index=pindex, process_count=nproc)
                 if evaluate else [])
  return Run(config=config, workdir=workdir, mesh=mesh, model=model, recipe=recipe, late_model=late_model,
             late_recipe=late_recipe, switch_step=switch_step, tx=tx, schedule=schedule, osci=osci, outcontrol=outcontrol,
             init_fn=init_fn,
             abstract_state=abstract, state_shardings=state_sh, train_iter=train_iter, val_batches=val_batches,
             tokens_per_byte=val_split.tokens_per_byte, checkpoints=checkpoints, reporter=reporter,
             process_count=nproc, lock=lock)


def vocab_record(config, recorded: dict | None) -> dict | None:
  """The record whose ``model.vocab_size`` a run keeps (``config.keep_recorded_vocab_size``): the run's own,
  else, for a new run with ``config.init_from``, that of the run whose params it starts from."""
  if recorded is not None or not config.get("init_from"):
    return recorded
  source = os.path.abspath(os.path.expanduser(config.init_from))
  if os.path.basename(source) == "checkpoints":
    source = os.path.dirname(source)
  return workdir_lib.last_config(source).config


def _layout(config, model_fn, model_config, recipe, late_recipe, outcontrol, mesh):
  """The models, the optimizer and the state's abstract tree and shardings (no array is made)."""
  seq_len = config.data.seq_len
  model = model_fn(model_config, recipe)
  late_model = model_fn(model_config, late_recipe) if late_recipe else None
  tx, schedule = optim.make_optimizer(config.optim, config.steps)
  osci_config = config_lib.resolve_osci_reset(config, recipe)
  osci = optim.OsciReset(osci_config, model_config, recipe) if osci_config is not None else None
  init_fn = functools.partial(init_state, model, tx, config.seed, seq_len, osci)
  with sharding.mesh_context(mesh):
    try:
      abstract = jax.eval_shape(init_fn)
    except PrecisionRuleError as e:   # a rule that matches no layer, or aims at a never-quantized one
      raise ConfigError(f"config.model.precision: {e}") from None
    if late_model is not None:
      late_params = jax.eval_shape(lambda: init_state(late_model, tx, config.seed, seq_len)["params"])
      shapes = functools.partial(jax.tree.map, lambda x: (x.shape, x.dtype))
      if shapes(late_params) != shapes(abstract["params"]):
        raise ConfigError(f"recipes {recipe.name} and {late_recipe.name} give different parameter trees; "
                          "the precision switch needs the same parameters")
  abstract, state_sh = sharding.train_state_shardings(abstract, tx, mesh)
  if outcontrol is not None:
    if "outcontrol" not in abstract:
      raise ConfigError("config.outcontrol.enabled=True, but no quantized linear layer of this model has enough "
                        f"input channels for an MXFP8 part (k8 = 0 below 128 channels, or K * ratio < 1 with "
                        f"ratio={outcontrol.ratio}); widen the model (d_model, mlp_dim >= 128) or turn it off")
    state_sh["outcontrol"] = jax.tree.map(lambda _: sharding.replicated(mesh), abstract["outcontrol"])
  return model, late_model, tx, schedule, osci, init_fn, abstract, state_sh


def _precision_name(model_config) -> str:
  precision = model_config.precision
  return precision if isinstance(precision, str) else f"{len(precision)} rules"


def _outcontrol_summary(abstract_outcontrol, ratio: float) -> str:
  """"k8 of K input channels" for each OutControl layer (stacked layers counted once per repetition)."""
  counts = {}
  for path, leaf in traverse_util.flatten_dict(abstract_outcontrol).items():
    if path[-1] == "perm":
      k_in = leaf.shape[-1]
      key = f"{outcontrol_k8(k_in, ratio)} of {k_in}"
      counts[key] = counts.get(key, 0) + math.prod(leaf.shape[:-1])
  return ", ".join(f"{n} layer(s) {key}" for key, n in sorted(counts.items())) + " input channels"


def _load_data(config, model_config, tokenizer):
  """(train split, validation split, summary, whether to evaluate); DataError/ConfigError when they do not fit."""
  if tokenizer.vocab_size > model_config.vocab_size:
    padded = config_lib.padded_vocab_size(tokenizer.vocab_size)
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but config.model.vocab_size is "
                      f"{model_config.vocab_size}, so the embedding has no row for the tokens past it; set "
                      f"--config.model.vocab_size={padded} (the tokenizer's size rounded up to a multiple of "
                      f"{config_lib.VOCAB_MULTIPLE}) or more, or leave it unset for a new run to take that")
  train_split, val_split, summary = data_lib.load_splits(config.data, tokenizer)
  data_lib.check_vocab(train_split, model_config.vocab_size)
  evaluate = config.eval.batches > 0 and config.data.validation_fraction > 0
  if evaluate and val_split.num_windows == 0:
    raise ConfigError(f"the validation split has {val_split.num_tokens} tokens, fewer than seq_len + 1 = "
                      f"{config.data.seq_len + 1}; raise config.data.validation_fraction, lower seq_len, or set "
                      "config.eval.batches=0")
  return train_split, val_split, summary, evaluate


def _open_workdir(config, workdir: str, process_index: int, stop: preempt.Preemption):
  """(absolute workdir, checkpoints, reporter, lock or None, resume plan): checks the directory can be written,
  takes its lock (process 0), and checks that a resume keeps the run's config (``workdir_lib.check_resume``)."""
  workdir = workdir_lib.prepare(workdir, process_index)
  lock = (lock_lib.hold(workdir, stale_after_s=config.get("lock_stale_s", 300.0)) if process_index == 0
          else None)
  if lock is not None:
    stop.at_exit(lock.release)
  try:
    checkpoints = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                       async_save=config.checkpoint.async_save)
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  stop.checkpoints = checkpoints.on_disk
  try:
    latest = checkpoints.latest_step()
    resume = workdir_lib.check_resume(workdir, config, latest)
    writers = functools.partial(trackers.open_writers, config.report, workdir, name=config.name,
                                config=config_lib.to_plain(config))
    reporter = report_lib.Reporter(workdir, total_steps=config.steps,
                                   tokens_per_step=config.batch_size * config.data.seq_len,
                                   log_every=config.log_every, primary=process_index == 0, open_writers=writers)
    removed = checkpoints.remove_leftovers() if lock is not None else []   # this run holds the directory
    if removed:
      resume = dataclasses.replace(resume, messages=resume.messages + (
          f"removed {len(removed)} temporary folder(s) of interrupted checkpoint saves: {', '.join(removed)} "
          f"(the complete checkpoints {checkpoints.on_disk()} are untouched)",))
  except BaseException:
    checkpoints.close()
    if lock is not None:
      lock.release()
    raise
  stop.reporter = reporter
  return workdir, checkpoints, reporter, lock, resume


# ------------------------------------------------------------------------------------- the first state

def init_or_restore(run: Run) -> tuple[dict, int]:
  """(state, step): the newest intact checkpoint, else ``config.init_from``'s params, else a fresh init."""
  restored = _restore_latest_intact(run)
  if restored is not None:
    return restored
  if run.config.get("init_from"):
    return _init_from(run, run.config.init_from), 0
  with sharding.mesh_context(run.mesh):
    state = jax.jit(lambda: _unboxed(run.init_fn()), out_shardings=run.state_shardings)()
  return state, 0


def _restore_latest_intact(run: Run) -> tuple[dict, int] | None:
  checkpoints, config = run.checkpoints, run.config
  steps = checkpoints.steps()
  target = ckpt_lib.abstract_like(run.abstract_state, run.state_shardings)
  unreadable = []
  for step in reversed(steps):
    try:
      state, data_state = checkpoints.restore(step, target)
    except ckpt_lib.CheckpointReadError as e:
      if e.reason == "incompatible":
        raise CheckpointError(f"{e}. The run in {run.workdir} was made with another model or optimizer config; "
                              "resume with that config (see config.json there), or use a new --workdir") from e
      unreadable.append(step)
      older = [s for s in steps if s < step]
      if not config.checkpoint.get("fallback", True):
        raise CheckpointError(f"{e}. config.checkpoint.fallback is False, so the older checkpoints {older} are "
                              "not tried; set it to True to resume from the newest intact one") from e
      moved = _move_aside(run, step)
      run.say(f"warning: {e}; moved it to {moved}; "
              + (f"falling back to checkpoint {older[-1]}" if older else "no older checkpoint is left"))
      continue
    if data_state.get("process_count") != run.process_count:
      raise ConfigChangedError(f"checkpoint step {step} was saved by {data_state.get('process_count')} "
                               f"process(es); resume with the same number (now {run.process_count})")
    if data_state.get("iterator") is not None:
      run.train_iter.set_state(data_state["iterator"])
    else:
      run.say(f"checkpoint {step} holds no data-iterator state (an imported checkpoint?): the data starts "
              "from its beginning")
    run.say(f"resumed from {checkpoints.directory}/{step}"
            + (f" (checkpoints {unreadable} were unreadable)" if unreadable else ""))
    return state, step
  if unreadable:
    raise CheckpointError(f"none of the checkpoints {sorted(unreadable)} of {run.workdir} could be read (reasons "
                          f"above; they are in {os.path.join(run.workdir, UNREADABLE_DIR)}). Rerun to start from "
                          "step 0, or set config.init_from to another run")
  return None


def _move_aside(run: Run, step: int) -> str:
  """Moves an unreadable checkpoint out of the checkpoints directory (kept, not deleted); its new path."""
  target = os.path.join(run.workdir, UNREADABLE_DIR, str(step))
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
      shutil.rmtree(target)
    shutil.move(os.path.join(run.checkpoints.directory, str(step)), target)
  if run.process_count > 1:
    multihost_utils.sync_global_devices(f"moved unreadable checkpoint {step}")
  run.checkpoints.reload()
  return target


def _init_from(run: Run, source: str) -> dict:
  """A fresh state (optimizer, RNG, counters, step 0) whose params are ``source``'s latest checkpoint's."""
  source = os.path.abspath(os.path.expanduser(source))
  directory = source if os.path.basename(source) == "checkpoints" else os.path.join(source, "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"config.init_from={source!r}: no checkpoints directory {directory}; give the work "
                          "directory of a run (it holds checkpoints/<step>)")
  checkpoints = ckpt_lib.Checkpoints(directory, keep=None, async_save=False, create=False)
  try:
    steps = checkpoints.steps()
    if not steps:
      raise CheckpointError(f"config.init_from={source!r}: {directory} holds no checkpoint")
    target = ckpt_lib.abstract_like(run.abstract_state["params"], run.state_shardings["params"])
    try:
      params = checkpoints.restore_params(steps[-1], target)
    except ckpt_lib.CheckpointReadError as e:
      params = _restore_other_layout(run, checkpoints, steps[-1])
      if params is None:
        raise CheckpointError(f"config.init_from: {e}; give a run whose model matches config.model") from e
  finally:
    checkpoints.close()
  rest_sh = {k: v for k, v in run.state_shardings.items() if k != "params"}
  with sharding.mesh_context(run.mesh):  # the random init of the params is dead code here: XLA drops it
    rest = jax.jit(lambda: {k: v for k, v in _unboxed(run.init_fn()).items() if k != "params"},
                   out_shardings=rest_sh)()
  run.say(f"initialized the params from {directory}/{steps[-1]} (optimizer state fresh, step 0)")
  return dict(rest, params=params)


def _restore_other_layout(run: Run, checkpoints, step: int):
  """Params stored in the other ``scan_blocks`` layout (e.g. an imported per-block checkpoint for a scanned
  run), restored with that layout's shardings and rearranged into this run's; None when they fit neither."""
  cfg = getattr(run.model, "config", None)
  if not hasattr(cfg, "scan_blocks"):
    return None
  other = run.model.clone(config=cfg.replace(scan_blocks=not cfg.scan_blocks))
  with sharding.mesh_context(run.mesh):
    boxed = jax.eval_shape(functools.partial(init_state, other, run.tx, run.config.seed, run.config.data.seq_len))
  abstract, shardings = sharding.train_state_shardings(boxed, run.tx, run.mesh)
  try:
    params = checkpoints.restore_params(step, ckpt_lib.abstract_like(abstract["params"], shardings["params"]))
  except ckpt_lib.CheckpointReadError:
    return None
  convert = scanned_params if cfg.scan_blocks else unscanned_params
  with sharding.mesh_context(run.mesh):
    params = jax.jit(lambda p: convert(p, cfg), out_shardings=run.state_shardings["params"])(params)
  run.say(f"init_from: the checkpoint's blocks are {'unstacked' if cfg.scan_blocks else 'stacked'}; "
          f"rearranged for scan_blocks={cfg.scan_blocks}")
  return params


def _unboxed(state):
  return dict(state, params=nn.unbox(state["params"]))
