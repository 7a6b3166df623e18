"""What the budget study's summary shows, collected from the finished runs on disk: each run's final validation
loss, per recipe and seed the tokens at which it reaches the reference's loss at T (``budget_match``), and
their mean over seeds with a t-interval."""
from __future__ import annotations

import datetime
import functools
import math

import jax

from experiments.budget_config import budget_fractions, budget_run_config, budget_runs, budget_variants
from experiments.budget_match import Match, mean_ratio, tokens_to_target
from experiments.study_balance import mean_std
from experiments.study_config import DESCRIPTIONS
from experiments.study_records import load_result, records_dir
from experiments.study_summary import hardware, model_summary, processors
from models import ModelConfig, count_params, lm
from training import config as config_lib

PENDING = "pending"     # a budget of the seed (or the reference's run of the seed) has not finished
DIVERGED = "diverged"   # a budget of the seed diverged: no finite loss to interpolate


@functools.lru_cache(maxsize=8)
def param_counts(model: ModelConfig) -> tuple[int, int]:
  """(parameters, parameters outside the token embedding and the LM head): what tokens-per-parameter ratios
  count. Cached: the summary is rewritten after every run."""
  params = lm.abstract_variables(lm.LanguageModel(model))["params"]
  non_embedding = sum(leaf.size for name, tree in params.items() if name not in ("embed", "lm_head")
                      for leaf in jax.tree_util.tree_leaves(tree))
  return int(count_params(model)), int(non_embedding)


def collect(config, runs_dir: str, out_dir: str | None = None) -> dict:
  """Everything the summary shows, from the finished runs on disk (``study_records.records_dir``).

  A finished run whose step count is not its budget's (a runs directory of another T) is refused."""
  variants = budget_variants(config)
  reference = variants[0]
  fractions = budget_fractions(config)
  runs = budget_runs(config)
  seeds = [int(s) for s in config.study.seeds]
  confidence = float(config.study.get("confidence", 0.95))
  tokens_per_step = int(config.batch_size * config.data.seq_len)
  base_run = budget_run_config(config, runs[0], seeds[0])
  results = {}
  for run in runs:
    for s in seeds:
      where = records_dir(runs_dir, out_dir, run.name, s)
      if where is None:
        continue
      rec = results[(run.name, s)] = load_result(where)
      if rec.get("status") == "done" and rec.get("step") != run.steps:
        raise ValueError(f"{where}: a finished run of {rec.get('step')} steps, but {run.name} of this study has "
                         f"{run.steps} (T = config.steps = {config.steps}); its runs directory belongs to another "
                         "study: pass another --runs_dir (and --workdir)")

  def loss(run, s):
    rec = results.get((run.name, s))
    if rec is None:
      return None
    value = rec.get("validation_loss")
    return float(value) if value is not None and rec["status"] == "done" else float("nan")

  # The final validation loss of every run, mean and sample std over the seeds that finished it.
  rows = {}
  for run in runs:
    losses = {s: loss(run, s) for s in seeds if loss(run, s) is not None}
    mean, std = mean_std(list(losses.values()))
    rows[run.name] = dict(variant=run.variant, fraction=run.fraction, steps=run.steps,
                          tokens=run.steps * tokens_per_step, validation_loss=losses, loss_mean=mean, loss_std=std,
                          statuses=sorted({results[(run.name, s)]["status"] for s in losses}),
                          wall_seconds={s: results[(run.name, s)].get("wall_seconds") for s in losses},
                          tokens_per_second={s: results[(run.name, s)].get("tokens_per_second") for s in losses})
  # The target of seed k: the reference's final validation loss at T with seed k (same init, data, validation).
  target = rows[runs[0].name]["validation_loss"]
  t_tokens = runs[0].steps * tokens_per_step
  matches = {}
  for v in variants[1:]:
    mine = [r for r in runs if r.variant == v]
    per_seed = {}
    for s in seeds:
      losses = {r.name: rows[r.name]["validation_loss"].get(s) for r in [runs[0]] + mine}
      if any(x is None for x in losses.values()):
        per_seed[s] = dict(kind=PENDING)
      elif not all(math.isfinite(x) for x in losses.values()):
        per_seed[s] = dict(kind=DIVERGED, runs=[name for name, x in losses.items() if not math.isfinite(x)])
      else:
        m = tokens_to_target([r.steps * tokens_per_step for r in mine], [losses[r.name] for r in mine], target[s])
        per_seed[s] = dict(kind=m.kind, tokens=m.tokens, ratio=m.tokens / t_tokens)
    measured = {s: m for s, m in per_seed.items() if m["kind"] not in (PENDING, DIVERGED)}
    summary = mean_ratio([Match(m["kind"], m["tokens"]) for m in measured.values()], t_tokens, confidence)
    matches[v] = dict(description=DESCRIPTIONS[v], per_seed=per_seed, measured_seeds=sorted(measured), **summary)
  n_params, n_core = param_counts(config_lib.resolve_model_config(base_run.model))
  return dict(
      name=config.name, reference=reference, variants=variants, fractions=fractions, seeds=seeds,
      confidence=confidence, descriptions={v: DESCRIPTIONS[v] for v in variants},
      runs=[dict(name=r.name, variant=r.variant, fraction=r.fraction, steps=r.steps) for r in runs],
      rows=rows, target=target, matches=matches,
      runs_done=len(results), runs_total=len(runs) * len(seeds),
      steps=int(config.steps), batch_size=int(config.batch_size), seq_len=int(config.data.seq_len),
      warmup_steps=int(config.optim.warmup_steps), decay_fraction=float(config.optim.decay_fraction),
      schedule=str(config.optim.schedule), tokens_per_step=tokens_per_step, t_tokens=t_tokens,
      params=n_params, non_embedding_params=n_core, tokens_per_param=t_tokens / n_params,
      tokens_per_non_embedding_param=t_tokens / n_core,
      model=model_summary(base_run), processors=processors(results), hardware=hardware(),
      total_wall_seconds=float(sum(r.get("wall_seconds") or 0.0 for r in results.values())),
      updated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )
