"""What a study's summary shows, collected from the finished runs on disk: per variant the final validation
loss, the gap to bf16 paired by seed, its spread over seeds, speed and wall time, the gap curve, the
comparison with the reference variant, and the expert balance of a model with MoE blocks."""
from __future__ import annotations

import datetime
import math
import os
import platform

import jax
import numpy as np

from experiments.study_balance import balance_of_records, balance_rows, mean_curve, mean_std
from experiments.study_records import cpu_name, load_result, read_metrics, records_dir
from experiments.study_config import DESCRIPTIONS, reference_variant, run_config, study_variants
from models import count_params, moe
from training import config as config_lib


def _count_params(run) -> int:
  return int(count_params(config_lib.resolve_model_config(run.model)))


def collect(config, runs_dir: str, out_dir: str | None = None) -> dict:
  """Everything the summary shows, from the finished runs on disk (``records_dir``).

  A run's balance comes from its ``train`` records or, for a record that has none (``seed_kept_records``),
  from the ``balance`` statistics its result holds, without a curve."""
  variants = study_variants(config)
  seeds = [int(s) for s in config.study.seeds]
  base_run = run_config(config, "bf16", seeds[0])
  tokens_per_step = int(config.batch_size * config.data.seq_len)
  n_params = _count_params(base_run)
  n_active = n_params - moe.inactive_params(config_lib.resolve_model_config(base_run.model))
  window = float(config.study.get("balance_window", 0.25))
  results, curves, balance = {}, {}, {}
  for v in variants:
    for s in seeds:
      where = records_dir(runs_dir, out_dir, v, s)
      if where is not None:
        rec = results[(v, s)] = load_result(where)
        metrics = read_metrics(where)
        curves[(v, s)] = {int(r["step"]): float(r["loss"]) for r in metrics.get("eval", []) if r["loss"] is not None}
        b = balance_of_records(metrics.get("train", []), int(config.steps), window)
        if b is None and rec.get("balance"):
          b = dict(rec["balance"], curve=[])
        if b is not None:
          balance[(v, s)] = b
  rows = {}
  for v in variants:
    done = [s for s in seeds if (v, s) in results]
    losses = {s: results[(v, s)]["validation_loss"] for s in done}
    gaps = {s: 100.0 * (losses[s] - results[("bf16", s)]["validation_loss"]) / results[("bf16", s)]["validation_loss"]
            for s in done if ("bf16", s) in results and losses[s] is not None and math.isfinite(losses[s])}
    loss_mean, loss_std = mean_std(list(losses.values()))
    gap_mean, gap_std = mean_std(list(gaps.values()))
    tps = [results[(v, s)]["tokens_per_second"] for s in done]
    walls = [results[(v, s)]["wall_seconds"] for s in done]
    # The gap curve: per seed at the evaluation steps both runs have, then the mean over seeds.
    per_seed = []
    for s in done:
      if ("bf16", s) not in curves:
        continue
      ref, cur = curves[("bf16", s)], curves[(v, s)]
      per_seed.append({st: 100.0 * (cur[st] - ref[st]) / ref[st] for st in cur if st in ref})
    steps = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
    curve = [(st * tokens_per_step, float(np.mean([c[st] for c in per_seed]))) for st in steps]
    rows[v] = dict(description=DESCRIPTIONS[v], seeds=done, validation_loss=losses, gap_percent=gaps,
                   loss_mean=loss_mean, loss_std=loss_std, gap_mean=gap_mean, gap_std=gap_std,
                   tokens_per_second=float(np.mean(tps)) if tps else float("nan"),
                   wall_seconds=float(np.mean(walls)) if walls else float("nan"),
                   statuses=sorted({results[(v, s)]["status"] for s in done}),
                   nonfinite_steps=sum(int(results[(v, s)].get("nonfinite_steps") or 0) for s in done),
                   gap_curve=curve)
  # Ablations against the full recipe, paired by seed: gap(variant) - gap(reference) in percentage points.
  reference = reference_variant(config)
  if reference is not None:
    ref = rows[reference]["gap_percent"]
    for v, r in rows.items():
      diffs = {k: g - ref[k] for k, g in r["gap_percent"].items() if k in ref}
      r["vs_reference_pp"] = diffs
      r["vs_reference_mean"], r["vs_reference_std"] = mean_std(list(diffs.values()))
  # Seed noise: how far the bf16 runs of different seeds land from each other (relative to their mean).
  bf16 = [results[("bf16", s)]["validation_loss"] for s in seeds if ("bf16", s) in results]
  noise = 100.0 * float(np.std(bf16, ddof=1) / np.mean(bf16)) if len(bf16) > 1 else float("nan")
  tokens = int(config.steps) * tokens_per_step
  switch_step = int(config.steps) - int(round(float(config.study.switch_fraction) * int(config.steps)))
  return dict(
      name=config.name, variants=variants, seeds=seeds, rows=rows,
      runs_done=len(results), runs_total=len(variants) * len(seeds),
      params=n_params, tokens_per_run=tokens, tokens_per_param=tokens / n_params,
      active_params=n_active, tokens_per_active_param=tokens / n_active,
      balance=balance_rows(balance, variants, seeds) if balance else None, balance_window=window,
      balance_curves={v: mean_curve([balance[(v, k)]["curve"] for k in seeds if balance.get((v, k), {}).get("curve")])
                      for v in variants} if balance else None,
      balance_curve_seeds={v: sum(bool(balance.get((v, k), {}).get("curve")) for k in seeds) for v in variants},
      steps=int(config.steps), batch_size=int(config.batch_size), seq_len=int(config.data.seq_len),
      switch_fraction=float(config.study.switch_fraction), switch_tokens=switch_step * tokens_per_step,
      bf16_seed_std_percent=noise, reference=reference,
      model=model_summary(base_run),
      processors=processors(results),
      hardware=hardware(),
      total_wall_seconds=float(sum(r["wall_seconds"] for r in results.values())),
      updated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )


def hardware() -> dict:
  """This machine and its JAX: where the summary is written."""
  return dict(machine=platform.machine(), processor=cpu_name(), cpus=os.cpu_count(),
              platform=jax.devices()[0].platform, device=str(jax.devices()[0].device_kind),
              jax=jax.__version__, python=platform.python_version())


def processors(results: dict) -> dict[str, list[str]]:
  """{processor: ["<run>/seed<k>", ...]} of the finished runs, ``results`` keyed by (run, seed) (a result
  without one: "?")."""
  out: dict[str, list[str]] = {}
  for (v, s), rec in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    out.setdefault(rec.get("processor") or "?", []).append(f"{v}/seed{s}")
  return out


def model_summary(run) -> dict:
  m = config_lib.resolve_model_config(run.model)
  return dict(preset=run.model.preset, pattern=m.pattern, d_model=m.d_model, mlp_dim=m.mlp_dim,
              bf16_first_blocks=m.bf16_first_blocks, bf16_last_blocks=m.bf16_last_blocks, dtype=str(m.dtype))
