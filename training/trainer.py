"""train_and_evaluate: the pretraining loop.

Legend: B global batch, L sequence length, W = L + 1 window, V vocabulary.

1. Check the config, build the mesh, read the data: every bad input fails here, before any compute.
2. Initialize the state already sharded (eval_shape -> logical specs -> NamedShardings -> jit(init,
   out_shardings)), or restore the latest checkpoint of the work directory (state and data iterator).
3. Loop: one jitted, donated train step per batch (a second one, from the same params, for the precision
   switch's last steps); metrics fetched one step behind; validation, checkpoints, profiling on schedule;
   SIGTERM/SIGINT save a checkpoint and return.
4. Final validation, checkpoint, loss curve.
"""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import threading
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from training import checkpoint as ckpt_lib
from training import config as config_lib
from training import data as data_lib
from training import optim
from training import report as report_lib
from training import sharding
from training.config import ConfigError
from training.step import build_model, cross_entropy, eval_step, init_state, train_step  # noqa: F401


class TrainingDiverged(RuntimeError):
  """The loss or gradient norm was non-finite for ``config.health.max_nonfinite_streak`` steps in a row."""


# -------------------------------------------------------------------------------------- signal handling

class _StopRequest:
  """SIGTERM / SIGINT set a flag the loop polls; a second SIGINT interrupts at once."""

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------- the loop

def train_and_evaluate(config, workdir: str, *, model_fn: Callable[[Any, Any], nn.Module] = build_model) -> dict:
  """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint) and returns a summary dict.

  The summary: ``status`` ("done", "halted" after ``config.halt_after`` steps, "stopped" by a signal), ``step``,
  ``train_loss``, ``validation_loss``, ``bits_per_byte``, ``tokens_per_second``, ``step_time``,
  ``nonfinite_steps``. Raises ConfigError on bad input (before compute), TrainingDiverged on divergence.
  """
  # 1. Checks, mesh, data.
  config_lib.validate(config)
  model_config = config_lib.resolve_model_config(config.model)
  recipe, late_recipe, switch_step = config_lib.resolve_recipes(config)
  mesh = sharding.make_mesh(config.mesh)
  nproc, pindex = jax.process_count(), jax.process_index()
  batch_ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if config.batch_size % batch_ways or config.batch_size % nproc:
    raise ConfigError(f"config.batch_size={config.batch_size} must be a multiple of data * fsdp = {batch_ways} "
                      f"and of the {nproc} processes")
  seq_len = config.data.seq_len
  tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
  train_split, val_split, data_summary = data_lib.load_splits(config.data, tokenizer)
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but config.model.vocab_size is "
                      f"{model_config.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size} or more")
  data_lib.check_vocab(train_split, model_config.vocab_size)
  evaluate = config.eval.batches > 0 and config.data.validation_fraction > 0
  if evaluate and val_split.num_windows == 0:
    raise ConfigError(f"the validation split has {val_split.num_tokens} tokens, fewer than seq_len + 1 = "
                      f"{seq_len + 1}; raise config.data.validation_fraction, lower seq_len, or set "
                      "config.eval.batches=0")
  primary = pindex == 0
  os.makedirs(workdir, exist_ok=True)
  reporter = report_lib.Reporter(workdir, total_steps=config.steps, tokens_per_step=config.batch_size * seq_len,
                                 log_every=config.log_every, primary=primary)
  say = reporter.message
  say(f"fp4jax train: {config.name}  model {config.model.preset} ({model_config.n_blocks} blocks "
      f"'{model_config.pattern}', d_model {model_config.d_model})  recipe {recipe.name}"
      + (f" -> {late_recipe.name} from step {switch_step}" if late_recipe else ""))
  say(f"data: {data_lib.describe(data_summary)}")
  say(f"mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
      f"{nproc} process(es); batch {config.batch_size} x {seq_len} tokens; workdir {os.path.abspath(workdir)}")
  if primary:
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config_lib.to_plain(config), f, indent=2)

  # 2. State: shardings first, then init or restore.
  model = model_fn(model_config, recipe)
  late_model = model_fn(model_config, late_recipe) if late_recipe else None
  tx, lr_fn = optim.make_optimizer(config.optim, config.steps)
  init_fn = functools.partial(init_state, model, tx, config.seed, seq_len)
  with sharding.mesh_context(mesh):
    abstract = jax.eval_shape(init_fn)
    if late_model is not None:
      late_params = jax.eval_shape(lambda: init_state(late_model, tx, config.seed, seq_len)["params"])
      shapes = functools.partial(jax.tree.map, lambda x: (x.shape, x.dtype))
      if shapes(late_params) != shapes(abstract["params"]):
        raise ConfigError(f"recipes {recipe.name} and {late_recipe.name} give different parameter trees; "
                          "the precision switch needs the same parameters")
  repl = sharding.replicated(mesh)
  param_sh = sharding.logical_shardings(abstract["params"], mesh)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], param_sh,
                                 transform_non_params=lambda _: repl)
  state_sh = dict(step=repl, params=param_sh, opt_state=opt_sh, rng=repl, nonfinite_total=repl,
                  nonfinite_streak=repl)
  abstract = dict(abstract, params=nn.unbox(abstract["params"]))
  checkpoints = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                     async_save=config.checkpoint.async_save)
  train_iter = data_lib.batches(train_split, global_batch=config.batch_size, seed=config.seed,
                                process_index=pindex, process_count=nproc,
                                read_threads=config.data.read_threads, prefetch=config.data.prefetch)
  latest = checkpoints.latest_step()
  if latest is not None:
    try:
      state, data_state = checkpoints.restore(latest, ckpt_lib.abstract_like(abstract, state_sh))
    except (ValueError, KeyError, TypeError) as e:
      checkpoints.close()
      reporter.close()
      raise ConfigError(f"the checkpoint {checkpoints.directory}/{latest} does not fit this config (another model "
                        f"or optimizer?): {str(e)[:300]}; use a new --workdir, or the config it was made with") from e
    if data_state.get("process_count") != nproc:
      checkpoints.close()
      reporter.close()
      raise ConfigError(f"checkpoint step {latest} was saved by {data_state.get('process_count')} process(es); "
                        f"resume with the same number (now {nproc})")
    train_iter.set_state(data_state["iterator"])
    say(f"resumed from {checkpoints.directory}/{latest}")
  else:
    with sharding.mesh_context(mesh):
      state = jax.jit(lambda: _unboxed(init_fn()), out_shardings=state_sh)()
  step = latest or 0
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract["params"]))
  say(f"parameters: {n_params:,}")

  # 3. The jitted steps.
  batch_sh = sharding.batch_sharding(mesh)

  def jit_train(m):
    fn = functools.partial(train_step, model=m, tx=tx, lr_fn=lr_fn)
    return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=(0,))

  step_fns = {recipe.name: jit_train(model)}
  if late_model is not None:
    step_fns[late_recipe.name] = jit_train(late_model)
  eval_fns = {name: jax.jit(functools.partial(eval_step, model=m), in_shardings=(param_sh, batch_sh),
                            out_shardings=repl)
              for name, m in ((recipe.name, model), (late_recipe.name if late_recipe else None, late_model))
              if m is not None}
  val_batches = (data_lib.eval_batches(val_split, global_batch=config.batch_size, num_batches=config.eval.batches,
                                       seed=config.seed, process_index=pindex, process_count=nproc)
                 if evaluate else [])

  def active_recipe(at_step: int) -> str:
    return late_recipe.name if late_recipe is not None and at_step >= switch_step else recipe.name

  def run_eval(at_step: int) -> tuple[float, float | None]:
    fn = eval_fns[active_recipe(max(at_step - 1, 0))]
    with sharding.mesh_context(mesh):
      losses = [fn(state["params"], sharding.host_batch_to_global(b, mesh)) for b in val_batches]
    loss = float(np.mean([sharding.to_host(l) for l in losses]))
    bpb = data_lib.bits_per_byte(loss, val_split.tokens_per_byte)
    reporter.evaluation(at_step, loss, bpb)
    return loss, bpb

  def save(at_step: int) -> None:
    checkpoints.save(at_step, state, dict(iterator=train_iter.get_state(), process_count=nproc, step=at_step))

  last = dict(loss=float("nan"))
  first_bad = [None]

  def consume(at_step: int, metrics) -> None:
    """Host side of the step that ended at ``at_step``: progress, records, the non-finite guard."""
    m = sharding.to_host(metrics)
    last.update(m)
    streak = int(m["nonfinite_streak"])
    note = ""
    if streak:
      first_bad[0] = first_bad[0] or at_step
      note = f"  non-finite: step skipped ({streak} in a row, {int(m['nonfinite_total'])} in all)"
      say(f"step {at_step}: non-finite loss {float(m['loss'])} or grad norm {float(m['grad_norm'])}; "
          f"update skipped ({streak} in a row)")
    else:
      first_bad[0] = None
    reporter.train_step(at_step, m, recipe=active_recipe(at_step - 1), nonfinite_note=note)
    if streak >= config.health.max_nonfinite_streak:
      raise TrainingDiverged(
          f"the loss or gradient norm was non-finite for {streak} steps in a row (steps {first_bad[0]}.."
          f"{at_step}); those updates were skipped, so the checkpoint holds the last good state. Lower "
          f"config.optim.lr (now {config.optim.lr}), raise config.optim.warmup_steps, or try another recipe; "
          f"the limit is config.health.max_nonfinite_streak={config.health.max_nonfinite_streak}")

  # 4. The loop.
  end = config.steps if not config.halt_after else min(config.steps, step + config.halt_after)
  profile = sorted(set(config.profile_steps))
  status = "done"
  val_loss, bpb = float("nan"), None
  pending = None
  tracing = False
  signal_check_every = 1 if nproc == 1 else max(config.log_every, 1)
  reporter.mark_start(step)
  with _StopRequest() as stop, sharding.mesh_context(mesh):
    try:
      while step < end:
        if profile and step == profile[0] and not tracing:
          jax.profiler.start_trace(os.path.join(workdir, "profile"))
          tracing = True
        tokens = sharding.host_batch_to_global(next(train_iter), mesh)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          state, metrics = step_fns[active_recipe(step)](state, tokens)
        step += 1
        if pending is not None:
          consume(*pending)
        pending = (step, metrics)
        if tracing and step > profile[-1]:
          jax.block_until_ready(state)
          jax.profiler.stop_trace()
          tracing = False
          say(f"profile of steps {profile[0]}..{profile[-1]} written to {os.path.join(workdir, 'profile')}")
        if late_recipe is not None and step == switch_step:
          say(f"step {step}: precision switch to {late_recipe.name}")
          reporter.mark_start(step)
        stop_now = step % signal_check_every == 0 and sharding.any_process(stop.signal_name is not None)
        eval_due = evaluate and config.eval.every_steps and step % config.eval.every_steps == 0 and step < end
        ckpt_due = config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0 and step < end
        if eval_due or ckpt_due or stop_now:
          consume(*pending)
          pending = None
          if eval_due:
            val_loss, bpb = run_eval(step)
          if ckpt_due or stop_now:
            save(step)
          reporter.mark_start(step)
        if stop_now:
          status = "stopped"
          say(f"received {stop.signal_name or 'a stop request'}: saved checkpoint {step}, stopping")
          break
      if pending is not None:
        consume(*pending)
        pending = None
      if status == "done" and step < config.steps:
        status = "halted"
      save(step)
      if evaluate and status != "stopped":
        val_loss, bpb = run_eval(step)
    except TrainingDiverged:
      save(step)  # the skipped updates left the last good state in place
      raise
    finally:
      if tracing:
        jax.profiler.stop_trace()
      checkpoints.close()  # waits for every started save
      png = reporter.close(f"{config.name}: {config.model.preset}, {recipe.name}")
  title = f"{config.name}: {config.model.preset}, {recipe.name}"
  png = reporter.close(title)
  summary = dict(status=status, step=step, train_loss=float(last["loss"]), validation_loss=val_loss,
                 bits_per_byte=bpb, tokens_per_second=reporter.tokens_per_second, step_time=reporter.step_time,
                 nonfinite_steps=int(last.get("nonfinite_total", 0)), workdir=os.path.abspath(workdir))
  if status != "stopped":
    say(f"{status} at step {step}: train loss {summary['train_loss']:.4f}, validation loss {val_loss:.4f}"
        + (f" ({bpb:.4f} bits/byte)" if bpb is not None else "")
        + f", {summary['tokens_per_second']:,.0f} tokens/s, {1000 * summary['step_time']:.1f} ms/step"
        + (f"; loss curve {png}" if png else ""))
  return summary


def _unboxed(state):
  return dict(state, params=nn.unbox(state["params"]))


__all__ = ["ConfigError", "TrainingDiverged", "train_and_evaluate", "train_step", "eval_step", "init_state"]
