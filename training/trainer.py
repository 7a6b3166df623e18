"""train_and_evaluate: a run is set up, given its first state, looped, and closed.

  run = setup(config, workdir)            # checks, mesh, data, models, shardings, work directory
  state, step = init_or_restore(run)      # the newest intact checkpoint, init_from's params, or a fresh init
  status = Loop(run, state, step).run_to_end()
  run.close()                             # waits for the checkpoint writes, writes loss.png

The step functions live in ``training.step`` (re-exported here for older callers).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn

import jax

from models import moe
from training import peers
from training import preempt
from training.errors import ConfigError, TrainingDiverged
from training.loop import Loop
from training.run import init_or_restore, setup
from training.step import build_model, cross_entropy, eval_step, init_state, train_step  # noqa: F401


def train_and_evaluate(config, workdir: str, *, model_fn: Callable[[Any, Any], nn.Module] = build_model) -> dict:
  """Trains ``config`` in ``workdir`` (resuming from its latest intact checkpoint) and returns a summary dict.

  The summary: ``status`` ("done", "halted" after ``config.halt_after`` steps, "stopped" by a signal),
  ``signal`` (its name when stopped, e.g. "SIGTERM"; ``training.preempt.exit_code`` gives the exit status), ``step``,
  ``train_loss``, ``validation_loss``, ``bits_per_byte``, ``tokens_per_second``, ``step_time``,
  ``nonfinite_steps``, ``workdir``, ``steps_run`` (by this call). Raises a ``training.errors.TrainingError``
  subclass on every foreseeable failure: ConfigError / DataError before any compute, ConfigChangedError,
  CheckpointError, StorageError, TrainingDiverged.
  """
  with preempt.Preemption(config.get("preemption_grace_s", 30.0)) as stop:
    run = setup(config, workdir, model_fn=model_fn, stop=stop)
    watch = peers.PeerWatch(config.get("peer_timeout_s", 300.0), process_index=jax.process_index(),
                            process_count=run.process_count, workdir=run.workdir,
                            cleanups=[run.lock.release] if run.lock is not None else [])
    try:
      with watch:
        try:
          stop.detail = "restoring or initializing the state"
          with run.reporter.phase("restoring the latest checkpoint" if run.checkpoints.steps()
                                  else "initializing the state", xla=True):
            state, step = init_or_restore(run)
          active = ""
          if "E" in run.model.config.pattern:   # MoE: the routed experts a token skips are not active
            active = f" ({run.num_params - moe.inactive_params(run.model.config):,} active per token)"
          run.say(f"parameters: {run.num_params:,}{active}")
          loop = Loop(run, state, step, stop, watch)
          status = loop.run_to_end()
        except Exception as e:  # pylint: disable=broad-except  (only a lost peer is handled here)
          _exit_if_peer_lost(run, watch, e)
          raise
    except BaseException:
      try:
        run.close(draw=not stop.requested)
      except Exception:  # pylint: disable=broad-except  (the first error is the one to report)
        pass
      raise
    try:
      png = run.close(draw=status != "stopped")  # waits for the last save: its barriers need every peer
    except Exception as e:  # pylint: disable=broad-except
      _exit_if_peer_lost(run, watch, e)
      raise
  summary = loop.summary(status)
  if status == "stopped":
    return summary
  if summary["steps_run"] == 0:
    run.say(f"nothing to do: the run in {run.workdir} is already at step {summary['step']}"
            + (f" (config.steps={config.steps})" if config.steps == summary["step"] else ""))
  run.say(_final_line(summary, png))
  return summary


def _exit_if_peer_lost(run, watch: peers.PeerWatch, error: Exception) -> None:
  """A collective of a multi-process run failed because a peer is gone: the line, exit 10 (never returns)."""
  if run.process_count > 1 and peers.is_peer_failure(error):
    watch.lost(watch.step, f"a collective failed: {_first_line(error)}", error)


def _first_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
  return (lines[0] if lines else type(error).__name__)[:200]


def _final_line(summary: dict, png: str | None) -> str:
  """``done at step 300: train loss 1.6177, validation loss 1.4527 (2.0959 bits/byte), ...``; unknowns left out."""
  parts = []
  if math.isfinite(summary["train_loss"]):
    parts.append(f"train loss {summary['train_loss']:.4f} (last step)")
  if math.isfinite(summary["validation_loss"]):
    bpb = summary["bits_per_byte"]
    parts.append(f"validation loss {summary['validation_loss']:.4f}" + (f" ({bpb:.4f} bits/byte)" if bpb else ""))
  if math.isfinite(summary["tokens_per_second"]):
    parts.append(f"{summary['tokens_per_second']:,.0f} tokens/s, {1000 * summary['step_time']:.1f} ms/step")
  return (f"{summary['status']} at step {summary['step']}: {', '.join(parts)}"
          + (f"; loss curve {png}" if png else ""))


__all__ = ["ConfigError", "TrainingDiverged", "train_and_evaluate", "train_step", "eval_step", "init_state"]
