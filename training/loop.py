"""The loop of a run: ``Loop(run, state, step).run()`` trains to ``config.steps`` (or ``halt_after``).

One jitted, donated train step per batch (a second one, from the same params, for the precision switch's
last steps; with OutControl one per phase, picked by the step like the recipe); the metrics of a step are
read on the host one step later, so the host never waits for the device; validation, checkpoints and
profiling on schedule; with ``config.pgle_steps`` the step is profiled after each start's first step and
compiled again with the profile (``training.pgle``). SIGTERM/SIGINT (``training.preempt``): the first step
of a start (the compile) exits at once, later steps save a checkpoint after the current step when the save
fits before ``config.preemption_grace_s`` runs out, else stop without one; both say so. The loop object owns what
changes while it runs: the state, the step count, the metrics not yet read, the latest read ones, and the
start of the current non-finite streak.
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import tempfile
import time

import jax
import numpy as np

import fp4jax
from training import config as config_lib
from training import data as data_lib
from training import peers
from training import pgle
from training import preempt
from training import sharding
from training.errors import TrainingDiverged
from training.optim import ON, PLAIN, RECORD
from training.run import Run
from training.step import CompiledAtFirstCall, eval_step, eval_step_outcontrol, jit_train_step


class Loop:
  """The moving parts of a run: ``state`` at ``step``, the step's pending metrics, the non-finite streak."""

  def __init__(self, run: Run, state: dict, step: int, stop: preempt.Preemption | None = None,
               watch: peers.PeerWatch | None = None):
    self.run, self.state, self.step = run, state, step
    self.stop = stop or preempt.Preemption(run.config.get("preemption_grace_s", 30.0))
    self.watch = watch or peers.PeerWatch(run.config.get("peer_timeout_s", 300.0), process_index=0,
                                          process_count=1, workdir=run.workdir)  # (not started: no thread)
    self._compiled = set()               # the train and eval functions that have run once in this start
    self.start_step = step
    self.pending = None                  # (step, device metrics) of the latest step, not yet read
    self.metrics: dict = {}              # host metrics of the latest read step
    self.streak_start: int | None = None
    self.validation = (float("nan"), None)  # (loss, bits per byte) of the latest evaluation
    self.pgle_wanted = []                # (program, profile path): train programs compiled, not yet profiled
    self.pgle_capture = None             # (program, profile path, trace dir, last step) while it is traced
    mesh, repl = run.mesh, sharding.replicated(run.mesh)
    batch_sh = sharding.batch_sharding(mesh)
    models = {run.recipe.name: run.model}
    if run.late_model is not None:
      models[run.late_recipe.name] = run.late_model
    phases = (PLAIN,) if run.outcontrol is None else (PLAIN, RECORD, ON)
    options = config_lib.xla_options(run.config, fp4jax.target.Target.of(mesh).device_kind)
    self._train = {(name, phase): jit_train_step(m, run.tx, run.schedule, run.state_shardings, mesh, run.osci, phase,
                                                 compiler_options=options, micro_batches=run.config.micro_batches,
                                                 fsdp_gather=run.config.mesh.get("fsdp_gather", "per_layer"),
                                                 grad_reduce=run.config.mesh.get("grad_reduce", "per_micro_batch"))
                   for name, m in models.items() for phase in phases}  # jit compiles on first use only
    self._eval = {name: CompiledAtFirstCall(jax.jit(functools.partial(eval_step, model=m),
                                                    in_shardings=(run.state_shardings["params"], batch_sh),
                                                    out_shardings=repl))
                  for name, m in models.items()}
    if run.outcontrol is not None:
      self._eval_outcontrol = CompiledAtFirstCall(jax.jit(functools.partial(eval_step_outcontrol, model=run.model),
                                                          in_shardings=(run.state_shardings["params"],
                                                                        run.state_shardings["outcontrol"], batch_sh),
                                                          out_shardings=repl))

  # One step, its metrics, evaluation, checkpoint ----------------------------------------------------

  def train_step(self) -> None:
    batch = sharding.host_batch_to_global(next(self.run.train_iter), self.run.mesh)
    name = self.run.recipe_at(self.step).name
    phase = self.run.outcontrol_phase_at(self.step)
    fn = self._train[name, phase]
    if (name, phase) in self._compiled:
      with jax.profiler.StepTraceAnnotation("train", step_num=self.step):
        self.state, metrics = fn(self.state, batch)
    else:  # the first call compiles: say how long it takes, and how long the first step runs
      self._compiled.add((name, phase))
      reporter = self.run.reporter
      what = "the train step" + (f" ({name}, {phase})" if len(self._train) > 1 else "")
      with self.watch.paused():  # a peer that compiles slower is not a hung peer
        with reporter.phase(f"compiling {what}", hint=_cache_hint, xla=True):
          self.state, metrics = fn(self.state, batch)
        self.stop.phase = preempt.TRAINING
        with reporter.phase(f"step {self.step + 1} (the first of this start)" if self.step == self.start_step
                            else f"step {self.step + 1} (the first with {what})", xla=True):
          jax.block_until_ready(metrics)
        self.pgle_compiled(fn.program, what)
      reporter.mark_start(self.step + 1)
    self.step += 1
    self.stop.step = self.step
    self.read_metrics()  # the previous step's: it is done by now
    self.pending = (self.step, metrics)

  # Profile-guided scheduling (training.pgle) ---------------------------------------------------------

  def pgle_compiled(self, program, what: str) -> None:
    """After a train program's first step: compile it again with its profile when the work directory has
    one, else queue its steps to be traced (``config.pgle_steps``)."""
    run = self.run
    if not run.config.get("pgle_steps", 0):
      return
    fp = pgle.fingerprint(program.hlo_text())
    if fp is None:
      run.say(f"config.pgle_steps={run.config.pgle_steps}: {what} keeps XLA's schedule: the compiler records no "
              "fingerprint to profile it by (profile-guided scheduling is XLA's GPU compiler's)")
      return
    path = pgle.profile_path(run.workdir, fp)
    if os.path.exists(path):
      with self.watch.paused(), run.reporter.phase(f"compiling {what} with its profile {path}", xla=True):
        program.recompile(pgle.compiler_options(path))
    else:
      self.pgle_wanted.append((program, path))

  def pgle_begin(self, profile_steps: list[int]) -> None:
    """Starts tracing the next ``config.pgle_steps`` steps when a queued program runs next, outside the trace
    of ``config.profile_steps`` (sorted: their first to their last step)."""
    n = self.run.config.get("pgle_steps", 0)
    if self.pgle_capture is not None or not self.pgle_wanted or (
        profile_steps and self.step <= profile_steps[-1] and profile_steps[0] < self.step + n):
      return
    program = self._program_at(self.step)
    for program_, path in self.pgle_wanted:
      if program_ is program:
        self.pgle_wanted.remove((program_, path))
        trace_dir = tempfile.mkdtemp(prefix="fp4jax-pgle-")   # this process's own, removed when read
        jax.profiler.start_trace(trace_dir)
        self.pgle_capture = (program, path, trace_dir, self.step + n)
        return

  def pgle_end(self) -> None:
    """After a traced step: at the last one, the trace's profile (process 0's, on every process) written to the
    work directory and the program compiled again with it; a step of another program ends the trace unused."""
    if self.pgle_capture is None:
      return
    program, path, trace_dir, last = self.pgle_capture
    other = self.step < last and self._program_at(self.step) is not program
    if self.step < last and not other:
      return
    jax.block_until_ready(self.state)
    jax.profiler.stop_trace()
    self.pgle_capture = None
    runs = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*"))
    profile = pgle.share(pgle.collect(max(runs)) if runs and not other else b"")
    shutil.rmtree(trace_dir, ignore_errors=True)
    run = self.run
    if other:   # traced again when it next runs
      self.pgle_wanted.append((program, path))
      return
    if not profile:
      run.say(f"steps {last - run.config.pgle_steps + 1}..{last}: the trace holds no instruction times (XLA "
              "measures them on NVIDIA GPUs); the step keeps XLA's schedule")
      return
    if jax.process_index() == 0 or not os.path.exists(path):
      pgle.write(path, profile)
    with self.watch.paused(), run.reporter.phase(
        f"compiling the train step with the profile of steps {last - run.config.pgle_steps + 1}..{last} ({path})",
        xla=True):
      program.recompile(pgle.compiler_options(path))
    run.reporter.mark_start(self.step)

  def _program_at(self, step: int):
    """The compiled train program that runs ``step`` (None before its first call)."""
    return self._train[self.run.recipe_at(step).name, self.run.outcontrol_phase_at(step)].program

  def read_metrics(self) -> None:
    """Host side of the pending step: progress, records, the non-finite guard (TrainingDiverged)."""
    if self.pending is None:
      return
    at_step, metrics = self.pending
    self.pending = None
    m = self.metrics = sharding.to_host(metrics)
    self.watch.beat(at_step)
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
    key = ("eval", fn.func if isinstance(fn, functools.partial) else fn)
    batches = [sharding.host_batch_to_global(b, run.mesh) for b in run.val_batches]
    if key not in self._compiled:
      self._compiled.add(key)
      with self.watch.paused(), run.reporter.phase("compiling the evaluation step", hint=_cache_hint, xla=True):
        losses = [jax.block_until_ready(fn(batches[0]))]
      losses += [fn(b) for b in batches[1:]]
    else:
      losses = [fn(b) for b in batches]
    loss = float(np.mean([sharding.to_host(l) for l in losses]))
    bpb = data_lib.bits_per_byte(loss, run.tokens_per_byte)
    run.reporter.evaluation(self.step, loss, bpb)
    self.validation = (loss, bpb)

  def save(self) -> None:
    self.run.checkpoints.save(self.step, self.state, dict(iterator=self.run.train_iter.get_state(),
                                                          process_count=self.run.process_count, step=self.step))
    self.watch.beat(self.step)  # the save's barriers passed: every peer answered

  def save_before_deadline(self) -> bool:
    """The save after a stop signal: skipped (False) when the last save of this start took longer than the
    time left before ``config.preemption_grace_s`` (with a margin), else saved and waited for (True)."""
    run, stop, step = self.run, self.stop, self.step
    name = stop.signal_name or "another process's stop signal"   # the stop is agreed before this one's came
    estimate = run.checkpoints.last_save_seconds
    left = stop.seconds_left()
    skip = estimate is not None and 1.5 * estimate + 1.0 > left
    if run.process_count > 1:
      skip = sharding.any_process(skip)
    if skip:
      run.say(f"{name}: not saving step {step}: the last save took {estimate:.1f} s and "
              f"{max(left, 0):.1f} s are left of config.preemption_grace_s={stop.grace_s:g}; "
              f"{stop.intact()}; exiting (exit {preempt.exit_code(stop.signal_name)})")
      return False
    start = time.monotonic()
    self.save()
    run.checkpoints.wait()
    run.say(f"{name}: saved checkpoint {step} in {time.monotonic() - start:.1f} s; exiting "
            f"(exit {preempt.exit_code(stop.signal_name)})")
    return True

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
    stop = self.stop
    stop.step = self.step
    stop.phase = preempt.COMPILE
    with sharding.mesh_context(run.mesh):
      try:
        while self.step < end:
          if profile and self.step == profile[0] and not tracing:
            jax.profiler.start_trace(profile_dir)
            tracing = True
          self.pgle_begin(profile)
          self.train_step()
          self.pgle_end()
          step = self.step
          run.checkpoints.check_background_save()   # a failed background write: now, not at the next save
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
          stop_now = step % signal_check_every == 0 and sharding.any_process(stop.requested)
          eval_due = (evaluate and config.eval.every_steps and step % config.eval.every_steps == 0 and step < end
                      and not stop_now)
          ckpt_due = config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0 and step < end
          if eval_due or ckpt_due or stop_now:
            self.read_metrics()
            if eval_due:
              self.evaluate()
            if stop_now:
              self.save_before_deadline()
            elif ckpt_due:
              self.save()
            reporter.mark_start(step)
          if stop_now:
            status = "stopped"
            break
        stop.phase = preempt.FINISHING
        self.read_metrics()
        if status == "done" and self.step < config.steps:
          status = "halted"
        if status != "stopped":
          self.save()
        if evaluate and status != "stopped" and not reporter.has_evaluation(self.step):
          self.evaluate()
      except TrainingDiverged:
        self.save()  # the skipped updates left the last good state in place
        raise
      finally:
        if tracing or self.pgle_capture is not None:
          jax.profiler.stop_trace()
        if self.pgle_capture is not None:
          shutil.rmtree(self.pgle_capture[2], ignore_errors=True)
    return status

  def summary(self, status: str) -> dict:
    reporter = self.run.reporter
    loss, bpb = self.validation
    earlier = dict(reporter.eval_curve).get(self.step)
    if not np.isfinite(loss) and earlier is not None:  # evaluated at this step by an earlier start
      loss = float(earlier)
      bpb = data_lib.bits_per_byte(loss, self.run.tokens_per_byte)
    train_loss = float(self.metrics["loss"]) if self.metrics else reporter.last_train_loss
    signal_name = self.stop.signal_name if status == "stopped" else None
    return dict(status=status, signal=signal_name, step=self.step, train_loss=train_loss, validation_loss=loss, bits_per_byte=bpb,
                tokens_per_second=reporter.tokens_per_second, step_time=reporter.step_time,
                nonfinite_steps=int(sharding.to_host(self.state["nonfinite_total"])),
                workdir=self.run.workdir, steps_run=self.step - self.start_step)


def _cache_hint() -> str:
  """Where compiled programs are cached (so a rerun or resume skips the compile), or how to turn that on."""
  directory = jax.config.jax_compilation_cache_dir
  if directory:
    return f"compiled programs are cached in {directory}, so a rerun or resume of this config skips most of this"
  return "turn on JAX's compilation cache (train.py's --compilation_cache) so that reruns skip this"
