"""A resume with another ``steps``: an extension (or an earlier end) when nothing done so far changes.

``plan(before, config, step)`` compares the run's last config (``before``, plain) with this one at the resume
step. The change is accepted, without ``allow_config_change``, when every step already trained and the next
one keep their learning rate (``optim.schedule`` of both plans agrees on steps 0..step) and their recipe
(the precision switch and OsciReset, which are placed by fractions of ``steps``, do not move across
``step``). The rule this gives, printed on resume:

  wsd       decay not started: the stable phase stretches (or shrinks) so that the decay is again the last
            ``decay_fraction`` of the new ``steps``; decay started: refused (the lr would jump)
  constant  always accepted: the same lr continues to the new end
  cosine    accepted only during the warmup (the cosine's shape depends on ``steps`` from the first step on)

A refused change raises ``ConfigChangedError`` naming both learning rates and the ways out: keep ``steps``,
start a new run from these weights (``config.init_from``, a fresh warmup), or ``allow_config_change``, which
continues with the new plan and prints the jump. Never a silent jump.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from ml_collections import config_dict

from training import config as config_lib
from training import optim
from training.errors import ConfigChangedError, ConfigError


@dataclasses.dataclass(frozen=True)
class Plan:
  accepted: bool    # the change keeps every step done so far (no allow_config_change needed)
  message: str      # the rule (accepted) or why not (refused)


def _lrs(optim_config, total: int, upto: int) -> np.ndarray:
  fn = optim.schedule(optim_config, total)
  return np.asarray([float(fn(t)) for t in range(upto + 1)], np.float64)


def _decay_start(optim_config, total: int) -> int:
  """The first step of the WSD decay (``optim.schedule``'s knee)."""
  return int(optim.schedule(optim_config, total).points[3])


def _placed_by_steps(config, step: int) -> tuple:
  """What of the recipe sequence up to ``step`` depends on ``steps``: the switch step and OsciReset's start
  and period, each clipped at ``step`` (a difference beyond ``step`` changes nothing done so far)."""
  recipe, late, switch = config_lib.resolve_recipes(config)
  osci = config_lib.resolve_osci_reset(config, recipe)
  switch_part = min(switch, step + 1) if late is not None else None
  osci_part = None
  if osci is not None:
    start = getattr(osci, "start", None)
    period = getattr(osci, "period", None)
    osci_part = (min(start, step + 1) if isinstance(start, int) else start,
                 period if isinstance(start, int) and start <= step else None)
  return switch_part, osci_part


def plan(before: dict, config, step: int) -> Plan:
  """The verdict on ``before["steps"] -> config.steps`` at checkpoint ``step`` (see the module docstring)."""
  old_total, new_total = int(before["steps"]), int(config.steps)
  old_config = config_dict.ConfigDict(before)
  old_optim = old_config.optim
  try:
    old_lr, new_lr = _lrs(old_optim, old_total, step), _lrs(config.optim, new_total, step)
    moved = _placed_by_steps(old_config, step) != _placed_by_steps(config, step)
  except (ConfigError, AttributeError, KeyError, TypeError, ValueError) as e:
    return Plan(False, f"config.steps {old_total} -> {new_total}: the run's previous config cannot be "
                       f"re-planned ({e})")
  differ = np.flatnonzero(~np.isclose(old_lr, new_lr, rtol=1e-6, atol=0.0))
  what = "extend" if new_total > old_total else "shorten"
  if differ.size:
    first = int(differ[0])
    why = (f"the learning rate of step {first} would change from {old_lr[first]:.4g} (the run's plan) to "
           f"{new_lr[first]:.4g}")
    if config.optim.schedule == "wsd" and old_optim.schedule == "wsd":
      old_start, new_start = _decay_start(old_optim, old_total), _decay_start(config.optim, new_total)
      why += (f": the run's decay started at step {old_start} and it is at step {step}" if old_start <= step else
              f": the new decay would start at step {new_start}, before the resume step {step}")
    elif config.optim.schedule == "cosine":
      why += ": a cosine schedule's shape depends on config.steps from the end of the warmup on"
    return Plan(False, f"config.steps {old_total} -> {new_total} at step {step} cannot {what} this run without a "
                       f"jump: {why}")
  if moved:
    return Plan(False, f"config.steps {old_total} -> {new_total} at step {step} would move the precision switch "
                       "or OsciReset (placed by fractions of config.steps) across the steps already trained")
  return Plan(True, _rule(old_optim, config.optim, old_total, new_total, step))


def _rule(old_optim, new_optim, old_total: int, new_total: int, step: int) -> str:
  head = (f"config.steps {old_total} -> {new_total}: {'extending' if new_total > old_total else 'ending early'}"
          f" at step {step}; ")
  peak, floor = new_optim.lr, new_optim.lr * new_optim.min_lr_ratio
  if new_optim.schedule == "wsd":
    old_start, new_start = _decay_start(old_optim, old_total), _decay_start(new_optim, new_total)
    return head + (f"the decay had not started (it was due at step {old_start}), so the stable phase "
                   f"{'stretches' if new_start >= old_start else 'ends earlier'}: lr {peak:g} until step {new_start}, "
                   f"then the linear decay to {floor:g} over steps {new_start}..{new_total}")
  if new_optim.schedule == "constant":
    return head + f"the constant lr {peak:g} continues to step {new_total}"
  return head + (f"still in the warmup, so the cosine decay is re-planned to reach {floor:g} at step {new_total}")


def lr_jump(before: dict, config, step: int) -> str | None:
  """``the learning rate at step 70 changes from 3e-05 to 0.002`` when an allowed change moves it, else None."""
  try:
    old = float(optim.schedule(config_dict.ConfigDict(before).optim, int(before["steps"]))(step))
    new = float(optim.schedule(config.optim, config.steps)(step))
  except (ConfigError, AttributeError, KeyError, TypeError, ValueError):
    return None
  if np.isclose(old, new, rtol=1e-6, atol=0.0):
    return None
  return (f"the learning rate at step {step} jumps from {old:.4g} (the run's plan) to {new:.4g} (the new "
          f"config's schedule for steps={config.steps})")


def refuse(message: str, workdir: str) -> ConfigChangedError:
  return ConfigChangedError(
      f"{message}. Keep the run's config.steps, or continue from these weights as a new run with its own "
      f"warmup (--config.init_from={workdir} --workdir <new>), or pass --allow_config_change to continue with "
      "the new schedule and its jump")
