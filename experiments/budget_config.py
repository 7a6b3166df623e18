"""The budget study's runs: the reference recipe (``config.study.reference``) trained for the budget T
(``config.steps``), every other recipe of ``config.study.variants`` for each fraction of T in
``config.study.fractions``, each budget its own run: round(fraction x T's steps) steps, the same warmup, the
wsd decay over the last ``optim.decay_fraction`` of its own steps (and OsciReset's fractions of its own steps)."""
from __future__ import annotations

import dataclasses
import math

from experiments.study_config import VARIANTS, run_config
from training import config as config_lib
from training.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BudgetRun:
  """One (recipe, budget) of the study; ``name`` is its directory under the runs directory."""
  name: str
  variant: str
  fraction: float
  steps: int


def budget_variants(config) -> list[str]:
  """``config.study.variants`` (comma-separated), the reference first."""
  spec = config.study.variants
  names = [v.strip() for v in (spec.split(",") if isinstance(spec, str) else spec) if v.strip()]
  unknown = [v for v in names if v not in VARIANTS]
  if unknown:
    raise ValueError(f"config.study.variants: unknown {unknown}; choose from {list(VARIANTS)}")
  reference = config.study.reference
  if reference not in names:
    raise ValueError(f"config.study.reference={reference!r} is not among config.study.variants {names}; every "
                     "other recipe is matched against its loss at T: add it or choose one of them")
  if len(names) < 2:
    raise ValueError(f"config.study.variants={spec!r}: name the reference and at least one recipe to match")
  return [reference] + [v for v in dict.fromkeys(names) if v != reference]


def budget_fractions(config) -> list[float]:
  """``config.study.fractions``, the budgets of the non-reference recipes as fractions of T, increasing."""
  fractions = sorted(float(f) for f in config.study.fractions)
  if not fractions or not all(math.isfinite(f) and f > 0 for f in fractions):
    raise ValueError(f"config.study.fractions={tuple(config.study.fractions)} must be positive fractions of T, "
                     "e.g. (1.0, 1.2, 1.4, 1.6)")
  steps = [budget_steps(config, f) for f in fractions]
  if len(set(steps)) != len(steps):
    raise ValueError(f"config.study.fractions={tuple(fractions)} give the step counts {steps} of "
                     f"config.steps={config.steps}: two budgets are the same run; drop one or raise config.steps")
  return fractions


def budget_steps(config, fraction: float) -> int:
  return int(round(fraction * int(config.steps)))


def run_name(variant: str, fraction: float) -> str:
  """"mxfp4_x1.2": the recipe trained for 1.2 T."""
  return f"{variant}_x{fraction:g}"


def budget_runs(config) -> list[BudgetRun]:
  """The reference at T, then each other recipe at each fraction of T."""
  reference, *others = budget_variants(config)
  runs = [BudgetRun(run_name(reference, 1.0), reference, 1.0, budget_steps(config, 1.0))]
  return runs + [BudgetRun(run_name(v, f), v, f, budget_steps(config, f))
                 for v in others for f in budget_fractions(config)]


def budget_run_config(config, run: BudgetRun, seed: int):
  """The training config of one (recipe, budget, seed): the variant's (``run_config``) for ``run.steps``."""
  c = run_config(config, run.variant, seed)
  c.name = f"{config.name}/{run.name}/seed{seed}"
  c.steps = run.steps
  return c


def check(config) -> list[BudgetRun]:
  """``budget_runs``, after the trainer's own checks of every run's config (``training.config.validate``, e.g.
  a warmup longer than a short budget), so that a bad budget fails before hours of training, not after."""
  runs = budget_runs(config)
  for run in runs:
    try:
      config_lib.validate(budget_run_config(config, run, int(config.study.seeds[0])))
    except ConfigError as e:
      raise ConfigError(f"the budget study's run {run.name} ({run.steps} steps): {e}") from None
  return runs
