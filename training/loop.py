"""The loop of a run: ``Loop(run, state, step).run()`` trains to ``config.steps`` (or ``halt_after``).

One jitted, donated train step per batch (a second one, from the same params, for the precision switch's
last steps; with OutControl one per phase, picked by the step like the recipe); the metrics of a step are
read on the host one step later, so the host never waits for the device; validation, checkpoints and
profiling on schedule; SIGTERM/SIGINT save a checkpoint and stop. The loop object owns what changes while it runs: the state, the step count, the metrics not yet read, the
latest read ones, and the start of the current non-finite streak.
"""
from __future__ import annotations

import functools
import os
import signal
import threading

import jax
import numpy as np

from training import data as data_lib
from training import sharding
from training.errors import TrainingDiverged
from training.optim import ON, PLAIN, RECORD
from training.run import Run
from training.step import eval_step, eval_step_outcontrol, jit_train_step


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


class Loop:
  """The moving parts of a run: ``state`` at ``step``, the step's pending metrics, the non-finite streak."""

  def __init__(self, run: Run, state: dict, step: int):
    self.run, self.state, self.step = run, state, step
    self.start_step = step
    self.pending = None                  # (step, device metrics) of the latest step, not yet read
    self.metrics: dict = {}              # host metrics of the latest read step
    self.streak_start: int | None = None
    self.validation = (float("nan"), None)  # (loss, bits per byte) of the latest evaluation
    mesh, repl = run.mesh, sharding.replicated(run.mesh)
    batch_sh = sharding.batch_sharding(mesh)
    models = {run.recipe.name: run.model}
    if run.late_model is not None:
      models[run.late_recipe.name] = run.late_model
    phases = (PLAIN,) if run.outcontrol is None else (PLAIN, RECORD, ON)
    self._train = {(name, phase): jit_train_step(m, run.tx, run.lr_fn, run.state_shardings, mesh, run.osci, phase)
                   for name, m in models.items() for phase in phases}  # jit compiles on first use only
    self._eval = {name: jax.jit(functools.partial(eval_step, model=m),
                                in_shardings=(run.state_shardings["params"], batch_sh), out_shardings=repl)
                  for name, m in models.items()}
    if run.outcontrol is not None:
      self._eval_outcontrol = jax.jit(functools.partial(eval_step_outcontrol, model=run.model),
                                      in_shardings=(run.state_shardings["params"],
                                                    run.state_shardings["outcontrol"], batch_sh),
                                      out_shardings=repl)

  # One step, its metrics, evaluation, checkpoint ----------------------------------------------------

  def train_step(self) -> None:
    tokens = sharding.host_batch_to_global(next(self.run.train_iter), self.run.mesh)
    name = self.run.recipe_at(self.step).name
    phase = self.run.outcontrol_phase_at(self.step)
    with jax.profiler.StepTraceAnnotation("train", step_num=self.step):
      self.state, metrics = self._train[name, phase](self.state, tokens)
    self.step += 1
    self.read_metrics()  # the previous step's: it is done by now
    self.pending = (self.step, metrics)

  def read_metrics(self) -> None:
    """Host side of the pending step: progress, records, the non-finite guard (TrainingDiverged)."""
    if self.pending is None:
      return
    at_step, metrics = self.pending
    self.pending = None
    m = self.metrics = sharding.to_host(metrics)
    config, say = self.run.config, self.run.say
    streak = int(m["nonfinite_streak"])
    note = ""
    if streak:
      self.streak_start = self.streak_start or at_step
      note = f"  non-finite: step skipped ({streak} in a row, {int(m['nonfinite_total'])} in all)"
      say(f"step {at_step}: non-finite loss {float(m['loss'])} or grad norm {float(m['grad_norm'])}; "
          f"update skipped ({streak} in a row)")
    else:
      self.streak_start = None
    self.run.reporter.train_step(at_step, m, recipe=self.run.recipe_at(at_step - 1).name, nonfinite_note=note)
    if streak >= config.health.max_nonfinite_streak:
      raise TrainingDiverged(
          f"the loss or gradient norm was non-finite for {streak} steps in a row (steps {self.streak_start}.."
          f"{at_step}); those updates were skipped, so the checkpoint holds the last good state. Lower "
          f"config.optim.lr (now {config.optim.lr}), raise config.optim.warmup_steps, or try another recipe; "
          f"the limit is config.health.max_nonfinite_streak={config.health.max_nonfinite_streak}")

  def evaluate(self) -> None:
    run = self.run
    last = max(self.step - 1, 0)
    if run.outcontrol_phase_at(last) == ON:   # the split the last step trained with
      fn = functools.partial(self._eval_outcontrol, self.state["params"], self.state["outcontrol"])
    else:
      fn = functools.partial(self._eval[run.recipe_at(last).name], self.state["params"])
    losses = [fn(sharding.host_batch_to_global(b, run.mesh)) for b in run.val_batches]
    loss = float(np.mean([sharding.to_host(l) for l in losses]))
    bpb = data_lib.bits_per_byte(loss, run.tokens_per_byte)
    run.reporter.evaluation(self.step, loss, bpb)
    self.validation = (loss, bpb)

  def save(self) -> None:
    self.run.checkpoints.save(self.step, self.state, dict(iterator=self.run.train_iter.get_state(),
                                                          process_count=self.run.process_count, step=self.step))

  # The schedule -------------------------------------------------------------------------------------

  def run_to_end(self) -> str:
    """Trains to the end of the run or of this slice; "done", "halted" or "stopped" (by a signal)."""
    run, config, reporter = self.run, self.run.config, self.run.reporter
    end = config.steps if not config.halt_after else min(config.steps, self.step + config.halt_after)
    evaluate = bool(run.val_batches)
    profile = sorted(set(config.profile_steps))
    profile_dir = os.path.join(run.workdir, "profile")
    tracing = False
    signal_check_every = 1 if run.process_count == 1 else max(config.log_every, 1)
    status = "done"
    reporter.mark_start(self.step)
    with _StopRequest() as stop, sharding.mesh_context(run.mesh):
      try:
        while self.step < end:
          if profile and self.step == profile[0] and not tracing:
            jax.profiler.start_trace(profile_dir)
            tracing = True
          self.train_step()
          step = self.step
          if tracing and step > profile[-1]:
            jax.block_until_ready(self.state)
            jax.profiler.stop_trace()
            tracing = False
            run.say(f"profile of steps {profile[0]}..{profile[-1]} written to {profile_dir}")
          if run.late_recipe is not None and step == run.switch_step:
            run.say(f"step {step}: precision switch to {run.late_recipe.name}")
            reporter.mark_start(step)
          if run.outcontrol is not None and step in (run.outcontrol.record_start, run.outcontrol.on_step):
            what = ("records the channel norms" if step == run.outcontrol.record_start
                    else "calibrated: the top-norm channels run in MXFP8")
            run.say(f"step {step}: OutControl {what}")
            reporter.mark_start(step)
          stop_now = step % signal_check_every == 0 and sharding.any_process(stop.signal_name is not None)
          eval_due = evaluate and config.eval.every_steps and step % config.eval.every_steps == 0 and step < end
          ckpt_due = config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0 and step < end
          if eval_due or ckpt_due or stop_now:
            self.read_metrics()
            if eval_due:
              self.evaluate()
            if ckpt_due or stop_now:
              self.save()
            reporter.mark_start(step)
          if stop_now:
            status = "stopped"
            run.say(f"received {stop.signal_name or 'a stop request'}: saved checkpoint {step}, stopping")
            break
        self.read_metrics()
        if status == "done" and self.step < config.steps:
          status = "halted"
        self.save()
        if evaluate and status != "stopped" and not reporter.has_evaluation(self.step):
          self.evaluate()
      except TrainingDiverged:
        self.save()  # the skipped updates left the last good state in place
        raise
      finally:
        if tracing:
          jax.profiler.stop_trace()
    return status

  def summary(self, status: str) -> dict:
    reporter = self.run.reporter
    loss, bpb = self.validation
    earlier = dict(reporter.eval_curve).get(self.step)
    if not np.isfinite(loss) and earlier is not None:  # evaluated at this step by an earlier start
      loss = float(earlier)
      bpb = data_lib.bits_per_byte(loss, self.run.tokens_per_byte)
    train_loss = float(self.metrics["loss"]) if self.metrics else reporter.last_train_loss
    return dict(status=status, step=self.step, train_loss=train_loss, validation_loss=loss, bits_per_byte=bpb,
                tokens_per_second=reporter.tokens_per_second, step_time=reporter.step_time,
                nonfinite_steps=int(sharding.to_host(self.state["nonfinite_total"])),
                workdir=self.run.workdir, steps_run=self.step - self.start_step)
