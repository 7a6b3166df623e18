"""The recipe study: one model, one data stream, the same seeds, trained with each recipe variant.

  python -m experiments.study --config configs/study_cpu.py [--workdir results/study_cpu]
  python -m experiments.study --config configs/study_cpu.py --summarize_only    # tables from finished runs
  python -m experiments.study --config configs/study_cpu.py --config.study.variants=bf16,nvfp4

Variants (spec §6-7): bf16, fp8, mxfp4, nvfp4 (the paper's recipe), nvfp4 without stochastic rounding,
without RHT, without 2D weight tiles, nvfp4 with every linear layer in FP4, and nvfp4 with the precision
switch (the last ``study.switch_fraction`` of the steps with the forward pass in bf16).

1. Each (variant, seed) trains with ``training.train_and_evaluate`` in ``<runs_dir>/<variant>/seed<k>``,
   one after the other in this process. A finished run leaves ``study_result.json`` there and is skipped
   next time; an interrupted one resumes from its latest checkpoint (the trainer's own resume).
   The summary keeps each finished run's small records (``KEPT_FILES``: its result and ``metrics.jsonl``)
   under the output directory, ``<workdir>/runs/<variant>/seed<k>``, and reads a run from there when the runs
   directory (checkpoints, git-ignored) lacks it: a committed output directory survives the machine.
2. After every run the summary is rewritten from all finished runs: ``summary.md`` (final validation loss,
   relative gap to bf16 per seed, mean and spread over seeds, tokens/s, wall time), ``summary.json`` and
   ``loss_gap.png`` (relative validation-loss gap to bf16 against tokens, one line per variant). A model with
   MoE blocks adds the expert balance (``balance_of_records``: MaxVio and load entropy averaged over the E
   blocks, final and late in training, paired with bf16 by seed) as a second table and ``balance.png``.

The gap of a variant is paired by seed: (loss_variant(seed) - loss_bf16(seed)) / loss_bf16(seed), so
init, data order and validation batches are the same on both sides; mean and sample std over seeds.
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import training
from models import count_params, moe
from training import config as config_lib
from training import report as report_lib
from training import sharding

# Each variant is a set of overrides (dotted config paths) of the study's base training config.
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"recipe": "bf16"},
    "fp8": {"recipe": "fp8"},
    "mxfp4": {"recipe": "mxfp4"},
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4_no_sr": {"recipe": "nvfp4_no_sr"},
    "nvfp4_no_rht": {"recipe": "nvfp4_no_rht"},
    "nvfp4_no_2d": {"recipe": "nvfp4_no_2d"},
    "nvfp4_all_fp4": {"recipe": "nvfp4", "model.bf16_first_blocks": 0, "model.bf16_last_blocks": 0},
    "nvfp4_switch": {"recipe": "nvfp4", "precision_switch.mode": "fwd"},  # fraction from study.switch_fraction
    "nvfp4_4over6": {"recipe": "nvfp4_4over6"},
    "quartet2_rtn": {"recipe": "quartet2_rtn"},
    "quartet2": {"recipe": "quartet2"},
    "tetrajet2": {"recipe": "tetrajet2"},
    # Nemotron 3 Super's per-module policy (models.policy) with the paper's recipe, against nvfp4's.
    "nvfp4_super": {"recipe": "nvfp4", "model.precision": "nemotron3_super"},
    # Half of it: the paper's policy plus Mamba out_proj in MXFP8 (Super minus this = attention in bf16).
    "nvfp4_mxfp8_out_proj": {"recipe": "nvfp4", "model.precision": [
        ("blocks_{-1:}/*", "bf16"), ("blocks_*/mixer/out_proj", "mxfp8"), ("*", "recipe")]},
}
# The newer methods with every linear layer in FP4, the setting of their published comparisons.
for _name in ("nvfp4_4over6", "quartet2_rtn", "quartet2", "tetrajet2"):
  VARIANTS[f"{_name}_all_fp4"] = {**VARIANTS[_name], "model.bf16_first_blocks": 0, "model.bf16_last_blocks": 0}

DESCRIPTIONS = {
    "bf16": "no quantization (the reference)",
    "fp8": "E4M3, 1x128 blocks, 128x128 weight tiles",
    "mxfp4": "E2M1, E8M0 scale per 32, SR, RHT-32 on wgrad",
    "nvfp4": "paper recipe: 16x16 weight tiles, SR on grads, RHT-16 on wgrad",
    "nvfp4_no_sr": "nvfp4, round-to-nearest gradients",
    "nvfp4_no_rht": "nvfp4, no Hadamard transform on wgrad",
    "nvfp4_no_2d": "nvfp4, 1x16 weight blocks (dgrad requantizes W)",
    "nvfp4_all_fp4": "nvfp4, every linear layer in FP4 (no bf16 blocks)",
    "nvfp4_switch": "nvfp4, forward in bf16 for the last steps",
    "nvfp4_4over6": "nvfp4 + Four Over Six (MSE, bound 256) on weights and activations",
    "quartet2_rtn": "Quartet II: 1x16 RTN forward, MS-EDEN backward after RHT-128 on both backward GEMMs",
    "quartet2": "Quartet II with a Four Over Six forward",
    "tetrajet2": "TetraJet-v2: double-block scales, SR backward after RHT-16 on both backward GEMMs",
    "nvfp4_super": "nvfp4 with Nemotron 3 Super's policy: attention bf16, Mamba out_proj MXFP8, last "
                   "round(14/88 n) blocks bf16",
    "nvfp4_mxfp8_out_proj": "nvfp4 (last block bf16) with Mamba out_proj in MXFP8, attention in nvfp4",
}
DESCRIPTIONS.update({f"{n}_all_fp4": f"{DESCRIPTIONS[n]}; every linear layer in FP4"
                     for n in ("nvfp4_4over6", "quartet2_rtn", "quartet2", "tetrajet2")})

RESULT_FILE = "study_result.json"
METRICS_FILE = "metrics.jsonl"
KEPT_FILES = (RESULT_FILE, METRICS_FILE)   # a finished run's records the output directory keeps (KB-MB)
KEPT_DIR = "runs"                          # under the output directory


# ------------------------------------------------------------------------------------------- configs

def _set(config, path: str, value) -> None:
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def study_variants(config) -> list[str]:
  """The variant names of ``config.study.variants`` ("all" or comma-separated), bf16 first."""
  spec = config.study.variants
  names = list(VARIANTS) if spec in ("all", "", None) else [
      v.strip() for v in (spec.split(",") if isinstance(spec, str) else spec) if v.strip()]
  unknown = [v for v in names if v not in VARIANTS]
  if unknown:
    raise ValueError(f"config.study.variants: unknown {unknown}; choose from {list(VARIANTS)} or 'all'")
  if "bf16" not in names:
    raise ValueError("config.study.variants must include bf16: every gap is measured against it")
  return ["bf16"] + [v for v in names if v != "bf16"]


def reference_variant(config) -> str | None:
  """The variant every other one is compared with, paired by seed: ``config.study.reference`` if set, else
  nvfp4 (the paper's recipe) or, in a study without it, nvfp4_all_fp4; None if the study has neither."""
  variants = study_variants(config)
  wanted = config.study.get("reference")
  if wanted:
    if wanted not in variants:
      raise ValueError(f"config.study.reference={wanted!r} is not among the study's variants {variants}; "
                       "add it to config.study.variants or choose one of them")
    return wanted
  return next((v for v in ("nvfp4", "nvfp4_all_fp4") if v in variants), None)


def run_config(config, variant: str, seed: int):
  """The training config of one run: the study config without its ``study`` section, plus the variant."""
  run = copy.deepcopy(config)
  with run.unlocked():
    del run["study"]
  run.name = f"{config.name}/{variant}/seed{seed}"
  run.seed = int(seed)
  for path, value in VARIANTS[variant].items():
    _set(run, path, value)
  if variant == "nvfp4_switch":
    run.precision_switch.fraction = float(config.study.switch_fraction)
  return run


# ------------------------------------------------------------------------------------------- running

def read_metrics(workdir: str) -> dict[str, list[dict]]:
  """``metrics.jsonl`` records by kind, in step order; a step logged twice (after a resume) keeps its last record."""
  by_kind = report_lib.read_records(os.path.join(workdir, "metrics.jsonl"))
  return {kind: [records[s] for s in sorted(records)] for kind, records in by_kind.items()}


def _count_params(run) -> int:
  return int(count_params(config_lib.resolve_model_config(run.model)))


def train_one(run, workdir: str, log: Callable[[str], None] = print) -> dict:
  """Trains (or resumes) one run and writes its ``study_result.json``; returns that record."""
  resumed = os.path.isdir(os.path.join(workdir, "checkpoints")) and bool(os.listdir(os.path.join(workdir, "checkpoints")))
  start = time.perf_counter()
  try:
    summary = training.train_and_evaluate(run, workdir)
  except training.TrainingDiverged as e:
    log(f"  diverged: {e}")
    summary = dict(status="diverged", validation_loss=float("nan"), tokens_per_second=float("nan"),
                   step=None, error=str(e))
  wall = time.perf_counter() - start
  record = dict(status=summary["status"], step=summary.get("step"),
                validation_loss=summary.get("validation_loss"), train_loss=summary.get("train_loss"),
                bits_per_byte=summary.get("bits_per_byte"), tokens_per_second=summary.get("tokens_per_second"),
                nonfinite_steps=summary.get("nonfinite_steps"), wall_seconds=wall, resumed=resumed,
                processor=_cpu_name(),
                finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  if record["status"] in ("done", "diverged"):
    with open(os.path.join(workdir, RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(record, f, indent=2)
  return record


def load_result(workdir: str) -> dict | None:
  path = os.path.join(workdir, RESULT_FILE)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def records_dir(runs_dir: str, out_dir: str | None, variant: str, seed: int) -> str | None:
  """Where a finished run's records are: its work directory, else the copy kept under ``out_dir``; None if
  neither holds a result."""
  for root in (runs_dir, os.path.join(out_dir, KEPT_DIR) if out_dir else None):
    if root and load_result(run_dir(root, variant, seed)) is not None:
      return run_dir(root, variant, seed)
  return None


def keep_records(runs_dir: str, out_dir: str, variants: Sequence[str], seeds: Sequence[int]) -> None:
  """Copies ``KEPT_FILES`` of every run finished in ``runs_dir`` to ``out_dir/runs/<variant>/seed<k>``."""
  for v in variants:
    for s in seeds:
      src = run_dir(runs_dir, v, s)
      if load_result(src) is None:
        continue
      dst = run_dir(os.path.join(out_dir, KEPT_DIR), v, s)
      os.makedirs(dst, exist_ok=True)
      for name in KEPT_FILES:
        if os.path.exists(os.path.join(src, name)):
          shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def run_study(config, out_dir: str, *, runs_dir: str | None = None, log: Callable[[str], None] = print,
              train: bool = True) -> dict:
  """Runs every missing (variant, seed) of ``config.study`` in order, rewriting the summary after each.

  Returns the summary dict (also written to ``out_dir/summary.json``).
  """
  runs_dir = runs_dir or config.study.runs_dir
  variants = study_variants(config)
  seeds = [int(s) for s in config.study.seeds]
  os.makedirs(out_dir, exist_ok=True)
  summary = write_summary(config, out_dir, runs_dir)
  if not train:
    return summary
  todo = [(v, s) for s in seeds for v in variants if records_dir(runs_dir, out_dir, v, s) is None]
  log(f"study {config.name}: {len(variants)} variants x {len(seeds)} seeds; {len(todo)} run(s) to do")
  for i, (variant, seed) in enumerate(todo):
    workdir = run_dir(runs_dir, variant, seed)
    if records_dir(runs_dir, out_dir, variant, seed) is not None:   # finished meanwhile by another process
      log(f"\n=== [{i + 1}/{len(todo)}] {variant} seed {seed}: finished meanwhile, skipped")
      continue
    log(f"\n=== [{i + 1}/{len(todo)}] {variant} seed {seed} -> {workdir}")
    try:
      record = train_one(run_config(config, variant, seed), workdir, log)
    except training.WorkdirInUse as e:   # another study process is training it: its result is read when it is done
      log(f"  skipped: {e}")
      continue
    if record["status"] not in ("done", "diverged"):  # stopped by a signal: leave the rest for next time
      log(f"run {variant}/seed{seed} ended with status {record['status']}; stopping the study")
      break
    summary = write_summary(config, out_dir, runs_dir)
  return summary


def run_dir(runs_dir: str, variant: str, seed: int) -> str:
  return os.path.join(runs_dir, variant, f"seed{seed}")


_LOG_RUN = re.compile(r"^=== \[\d+/\d+\] (\S+) seed (\d+) -> ")
_LOG_EVAL = re.compile(r"^step (\d+): validation loss (\S+)\s+(\S+) bits/byte")


def evaluations_of_logs(log_paths: Sequence[str]) -> dict[tuple[str, int], dict[int, dict]]:
  """The ``eval`` records a study's logs print ("step N: validation loss L  B bits/byte", 4 decimals) under
  each run's "=== [i/n] <variant> seed <k> -> ..." line, by (variant, seed) and step; a later line wins."""
  out: dict[tuple[str, int], dict[int, dict]] = {}
  for path in log_paths:
    run = None
    with open(path, encoding="utf-8") as f:
      for line in f:
        if m := _LOG_RUN.match(line):
          run = (m.group(1), int(m.group(2)))
        elif run is not None and (m := _LOG_EVAL.match(line)):
          step = int(m.group(1))
          out.setdefault(run, {})[step] = dict(kind="eval", step=step, loss=float(m.group(2)),
                                               bits_per_byte=float(m.group(3)))
  return out


def seed_kept_records(summary_path: str, log_paths: Sequence[str], out_dir: str) -> list[tuple[str, int]]:
  """Kept records (``keep_records``' layout) for the finished runs of an earlier ``summary.json`` whose work
  directories are gone; returns the (variant, seed) written. Each result holds what the summary kept per
  seed (validation loss, the ``BALANCE_KEYS`` statistics), the variant's mean tokens/s and wall time (the
  summary keeps no per-seed value) and ``kept_from`` saying so; its ``metrics.jsonl`` holds only the
  evaluations its logs printed (4 decimals; no train records, so no balance curve)."""
  with open(summary_path, encoding="utf-8") as f:
    old = json.load(f)
  evals = evaluations_of_logs(log_paths)
  written = []
  for v, row in old["rows"].items():
    for k in row["seeds"]:
      if row["statuses"] != ["done"] or row["nonfinite_steps"]:
        raise ValueError(f"{summary_path}: {v} has statuses {row['statuses']} and {row['nonfinite_steps']} "
                         "non-finite steps; only runs that all finished cleanly can be kept from a summary")
      loss = row["validation_loss"][str(k)]
      curve = evals.get((v, int(k)), {})
      if not curve or abs(curve[max(curve)]["loss"] - loss) > 6e-5:
        raise ValueError(f"{v} seed {k}: the logs' last evaluation {curve and curve[max(curve)]} is not the "
                         f"summary's validation loss {loss}; pass the logs this study printed")
      result = dict(status="done", step=old["steps"], validation_loss=loss, nonfinite_steps=0,
                    tokens_per_second=row["tokens_per_second"], wall_seconds=row["wall_seconds"],
                    processor=old["hardware"]["processor"],
                    balance={key: old["balance"][v][key]["per_seed"][str(k)] for key in BALANCE_KEYS},
                    kept_from=f"{summary_path} (updated {old['updated']}): validation_loss and balance per "
                              "seed; tokens_per_second and wall_seconds are the variant's mean over its "
                              f"seeds {row['seeds']}. {METRICS_FILE}: the evaluations the study's log printed "
                              "(4 decimals), no train records.")
      dst = run_dir(os.path.join(out_dir, KEPT_DIR), v, int(k))
      os.makedirs(dst, exist_ok=True)
      with open(os.path.join(dst, RESULT_FILE), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
      with open(os.path.join(dst, METRICS_FILE), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(curve[st]) + "\n" for st in sorted(curve))
      written.append((v, int(k)))
  return written


# ------------------------------------------------------------------------------------------ summary

def _mean_std(values: Sequence[float]) -> tuple[float, float]:
  vals = [v for v in values if v is not None and math.isfinite(v)]
  if not vals:
    return float("nan"), float("nan")
  return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan")


BALANCE_STATS = ("max_vio", "entropy")


def balance_of_records(train_records: Sequence[dict], steps: int, window: float) -> dict | None:
  """A run's expert balance from its ``train`` records (``moe/<block>/max_vio`` and ``entropy``, the logged
  step's load, ``training.step.moe_balance``), each averaged over the E blocks: ``final_<stat>`` at the last
  logged step, ``late_<stat>`` the mean over the logged steps after ``(1 - window) * steps``, and ``curve``
  [(step, max_vio, entropy)]. None for a run without MoE blocks."""
  curve = []
  for r in train_records:
    per_stat = [[v for k, v in r.items() if k.startswith("moe/") and k.endswith(f"/{stat}") and v is not None]
                for stat in BALANCE_STATS]
    if all(per_stat):
      curve.append((int(r["step"]), *(float(np.mean(v)) for v in per_stat)))
  if not curve:
    return None
  late = [c for c in curve if c[0] > (1.0 - window) * steps] or curve[-1:]
  out = {"curve": curve}
  for i, stat in enumerate(BALANCE_STATS, start=1):
    out[f"final_{stat}"] = curve[-1][i]
    out[f"late_{stat}"] = float(np.mean([c[i] for c in late]))
  return out


BALANCE_KEYS = tuple(f"{when}_{stat}" for stat in BALANCE_STATS for when in ("late", "final"))


def balance_rows(balance: dict[tuple[str, int], dict], variants: Sequence[str], seeds: Sequence[int]) -> dict:
  """Per variant and per ``BALANCE_KEYS`` statistic: the per-seed values, their mean and sample std, and the
  paired difference to bf16 (variant - bf16 with the same seed) per seed, with its mean and std."""
  rows = {}
  for v in variants:
    row = {}
    for key in BALANCE_KEYS:
      values = {s: balance[(v, s)][key] for s in seeds if (v, s) in balance}
      diffs = {s: x - balance[("bf16", s)][key] for s, x in values.items() if ("bf16", s) in balance}
      mean, std = _mean_std(list(values.values()))
      d_mean, d_std = _mean_std(list(diffs.values()))
      row[key] = dict(per_seed=values, mean=mean, std=std, vs_bf16=diffs, vs_bf16_mean=d_mean, vs_bf16_std=d_std)
    rows[v] = row
  return rows


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
    loss_mean, loss_std = _mean_std(list(losses.values()))
    gap_mean, gap_std = _mean_std(list(gaps.values()))
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
      r["vs_reference_mean"], r["vs_reference_std"] = _mean_std(list(diffs.values()))
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
      balance_curves={v: _mean_curve([balance[(v, k)]["curve"] for k in seeds if balance.get((v, k), {}).get("curve")])
                      for v in variants} if balance else None,
      balance_curve_seeds={v: sum(bool(balance.get((v, k), {}).get("curve")) for k in seeds) for v in variants},
      steps=int(config.steps), batch_size=int(config.batch_size), seq_len=int(config.data.seq_len),
      switch_fraction=float(config.study.switch_fraction), switch_tokens=switch_step * tokens_per_step,
      bf16_seed_std_percent=noise, reference=reference,
      model=_model_summary(base_run),
      processors=_processors(results),
      hardware=dict(machine=platform.machine(), processor=_cpu_name(), cpus=os.cpu_count(),
                    platform=jax.devices()[0].platform, device=str(jax.devices()[0].device_kind),
                    jax=jax.__version__, python=platform.python_version()),
      total_wall_seconds=float(sum(r["wall_seconds"] for r in results.values())),
      updated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )


def _mean_curve(curves: Sequence[Sequence[tuple]]) -> list[tuple]:
  """[(step, *means over the curves)] at the steps every curve has."""
  if not curves:
    return []
  by_step = [{c[0]: c[1:] for c in curve} for curve in curves]
  steps = sorted(set.intersection(*(set(b) for b in by_step)))
  return [(st, *(float(x) for x in np.mean([b[st] for b in by_step], axis=0))) for st in steps]


def _processors(results: dict) -> dict[str, list[str]]:
  """{processor: ["variant/seed<k>", ...]} of the finished runs (a result without one: "?")."""
  out: dict[str, list[str]] = {}
  for (v, s), rec in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    out.setdefault(rec.get("processor") or "?", []).append(f"{v}/seed{s}")
  return out


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "?"


def _model_summary(run) -> dict:
  m = config_lib.resolve_model_config(run.model)
  return dict(preset=run.model.preset, pattern=m.pattern, d_model=m.d_model, mlp_dim=m.mlp_dim,
              bf16_first_blocks=m.bf16_first_blocks, bf16_last_blocks=m.bf16_last_blocks, dtype=str(m.dtype))


def _pm(mean: float, std: float, fmt: str) -> str:
  if not math.isfinite(mean):
    return "—"
  return f"{mean:{fmt}} ± {std:{fmt.lstrip('+')}}" if math.isfinite(std) else f"{mean:{fmt}}"


def render_markdown(s: dict) -> str:
  m, hw = s["model"], s["hardware"]
  ref = s.get("reference") or "nvfp4"
  lines = [
      f"# Recipe study `{s['name']}`",
      "",
      f"Model: `{m['preset']}` preset, pattern `{m['pattern']}`, d_model {m['d_model']}, MLP {m['mlp_dim']}, "
      f"{s['params']:,} parameters{_active(s)}; bf16 blocks: first {m['bf16_first_blocks']}, last "
      f"{m['bf16_last_blocks']}. {s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens = "
      f"{s['tokens_per_run']:,} tokens per run ({s['tokens_per_param']:.1f} tokens/parameter"
      f"{_active(s, per_token=True)}). Seeds {s['seeds']}; runs finished "
      f"{s['runs_done']}/{s['runs_total']}.",
      f"Hardware: {_hardware(s)}, jax {hw['jax']}; "
      f"total wall time of the finished runs {s['total_wall_seconds'] / 60:.1f} min. Updated {s['updated']}.",
      "",
      "Gap = (validation loss - bf16 validation loss) / bf16 validation loss, paired by seed; "
      f"vs {ref} = gap - gap of {ref} with the same seed, in percentage points (per seed in brackets): the "
      "seeds move all variants together, so this paired difference is the sharper test of an ablation; "
      "± is the sample standard deviation over seeds. tokens/s excludes compilation; wall time is per run "
      "and includes compilation and evaluation. Both depend on what else the machine runs: on shared cores "
      "they are not comparable between variants (bench/run.py measures nvfp4 vs bf16 back to back).",
      "",
      f"| variant | what | final validation loss | gap to bf16 (%) | per seed (%) | vs {ref} (pp) | tokens/s | wall / run |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for v in s["variants"]:
    r = s["rows"][v]
    if not r["seeds"]:
      lines.append(f"| {v} | {r['description']} | not run yet | | | | | |")
      continue
    status = "" if r["statuses"] == ["done"] else f" ({', '.join(r['statuses'])})"
    per_seed = ", ".join(f"{r['gap_percent'][k]:+.2f}" for k in sorted(r["gap_percent"]))
    gap = "0 (reference)" if v == "bf16" else _pm(r["gap_mean"], r["gap_std"], "+.2f")
    vs = "" if v in ("bf16", s.get("reference")) or not r.get("vs_reference_pp") else (
        _pm(r["vs_reference_mean"], r["vs_reference_std"], "+.2f") + " (" +
        ", ".join(f"{r['vs_reference_pp'][k]:+.2f}" for k in sorted(r["vs_reference_pp"])) + ")")
    lines.append(f"| {v}{status} | {r['description']} | {_pm(r['loss_mean'], r['loss_std'], '.4f')} | {gap} | "
                 f"{'' if v == 'bf16' else per_seed} | {vs} | {r['tokens_per_second']:,.0f} | "
                 f"{r['wall_seconds'] / 60:.1f} min |")
  lines += [
      "",
      f"Seed noise: the bf16 runs' final losses differ by {s['bf16_seed_std_percent']:.2f}% (sample std / mean "
      "over seeds); a gap smaller than that, or than its own ± over seeds, is not a result.",
  ]
  if "nvfp4_switch" in s["variants"]:
    lines.append(f"Precision switch: the last {100 * s['switch_fraction']:.0f}% of the steps (from token "
                 f"{s['switch_tokens']:,}) run the forward pass in bf16.")
  lines += [
      "",
      "![relative loss gap](loss_gap.png)",
      "",
  ]
  if s.get("balance"):
    lines += render_balance(s)
  return "\n".join(lines)


def _hardware(s: dict) -> str:
  """This machine, or per processor the runs that ran on it when they did not all run here."""
  hw, procs = s["hardware"], s.get("processors") or {}
  here = f"{hw['cpus']} x {hw['processor']} ({hw['platform']})"
  if set(procs) <= {hw["processor"]}:
    return here
  return "; ".join(f"{p}: {', '.join(runs)}" for p, runs in procs.items()) + f" (summarized on {here})"


def _active(s: dict, per_token: bool = False) -> str:
  """", N active per token" (or ", T per active parameter") for a model with idle experts, else ""."""
  if s.get("active_params", s["params"]) == s["params"]:
    return ""
  if per_token:
    return f", {s['tokens_per_active_param']:.1f} per active parameter"
  return f" ({s['active_params']:,} active per token)"


def render_balance(s: dict) -> list[str]:
  """The expert-balance table: MaxVio and entropy averaged over the E blocks, per variant, paired with bf16."""
  b, w = s["balance"], s["balance_window"]

  def cell(v, key, fmt):
    c = b[v][key]
    if not c["per_seed"]:
      return "not run yet"
    text = _pm(c["mean"], c["std"], fmt)
    if v != "bf16" and c["vs_bf16"]:
      text += (f"; vs bf16 {_pm(c['vs_bf16_mean'], c['vs_bf16_std'], '+' + fmt)} ("
               + ", ".join(f"{c['vs_bf16'][k]:+{fmt}}" for k in sorted(c["vs_bf16"])) + ")")
    return text

  lines = [
      "## Expert balance",
      "",
      "Per run, each logged step's expert load (the (token, choice) pairs each routed expert received in that "
      "step's batch) gives MaxVio = max load / mean load - 1 (0: balanced) and the load's entropy / log E "
      "(1: balanced), averaged over the E blocks. *late* = the mean over the logged steps of the last "
      f"{100 * w:.0f}% of training, *final* = the last logged step. Mean ± sample std over seeds; vs bf16 = "
      "variant - bf16 with the same seed (per seed in brackets).",
      "",
      "| variant | MaxVio, late | MaxVio, final | entropy, late | entropy, final |",
      "|---|---|---|---|---|",
  ]
  for v in s["variants"]:
    lines.append(f"| {v} | {cell(v, 'late_max_vio', '.3f')} | {cell(v, 'final_max_vio', '.3f')} | "
                 f"{cell(v, 'late_entropy', '.4f')} | {cell(v, 'final_entropy', '.4f')} |")
  ref = b["bf16"]["late_max_vio"]
  lines += [
      "",
      f"Seed noise of the balance: bf16's late MaxVio {_pm(ref['mean'], ref['std'], '.3f')} over seeds.",
      "",
      "![expert balance](balance.png)",
      "",
  ]
  return lines


def plot_gaps(s: dict, path: str) -> None:
  """Relative validation-loss gap to bf16 (%) against tokens, one line per variant (mean over seeds)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 4.8))
  styles = {"fp8": ("tab:green", "-"), "mxfp4": ("tab:red", "-"), "nvfp4": ("tab:blue", "-"),
            "nvfp4_no_sr": ("tab:orange", "--"), "nvfp4_no_rht": ("tab:purple", "--"),
            "nvfp4_no_2d": ("tab:brown", "--"), "nvfp4_all_fp4": ("tab:pink", ":"),
            "nvfp4_switch": ("tab:cyan", "-.")}
  for v in s["variants"]:
    curve = s["rows"][v]["gap_curve"]
    if v == "bf16" or not curve:
      continue
    color, ls = styles.get(v, (None, "-"))
    x, y = zip(*curve)
    n = len(s["rows"][v]["seeds"])
    ax.plot(x, y, ls, color=color, marker="o", ms=3, lw=1.6 if v in ("nvfp4", "mxfp4") else 1.1,
            label=f"{v} ({s['rows'][v]['gap_mean']:+.2f}%, {n} seed{'s' if n != 1 else ''})")
  ax.axhline(0.0, color="black", lw=0.8)
  if "nvfp4_switch" in s["variants"] and s["switch_fraction"] > 0:
    ax.axvline(s["switch_tokens"], color="tab:cyan", lw=0.8, alpha=0.6)
  if math.isfinite(s["bf16_seed_std_percent"]):
    ax.axhspan(-s["bf16_seed_std_percent"], s["bf16_seed_std_percent"], color="gray", alpha=0.15,
               label="bf16 seed noise (±1 std)")
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda t, _: f"{t / 1e6:g}M"))
  ax.set_xlabel("tokens")
  ax.set_ylabel("relative validation loss gap to bf16 (%)")
  ax.set_title(f"{s['name']}: {s['params']:,} params, {s['tokens_per_run'] / 1e6:.2f}M tokens "
               f"({s['tokens_per_param']:.0f}/param), mean over {len(s['seeds'])} seeds")
  ax.grid(alpha=0.3)
  # The first evaluations (still far from converged) can dwarf the end; show the second half's range well.
  ys = [y for v in s["variants"] if v != "bf16" for _, y in s["rows"][v]["gap_curve"][len(s["rows"][v]["gap_curve"]) // 3:]]
  if ys:
    lo, hi = min(ys + [0.0]), max(ys + [0.0])
    pad = 0.15 * (hi - lo or 1.0)
    ax.set_ylim(lo - pad, hi + pad)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_balance(s: dict, path: str) -> None:
  """MaxVio and load entropy (mean over the E blocks and the seeds) against tokens, one line per variant."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  tokens_per_step = s["batch_size"] * s["seq_len"]
  for v in s["variants"]:
    curve = s["balance_curves"].get(v)
    if not curve:
      continue
    steps, max_vio, entropy = zip(*curve)
    x = [st * tokens_per_step / 1e6 for st in steps]
    lw = 1.8 if v == "bf16" else 1.1
    axes[0].plot(x, max_vio, lw=lw, label=f"{v} ({s['balance_curve_seeds'][v]} seeds)")
    axes[1].plot(x, entropy, lw=lw, label=v)
  for ax, label in zip(axes, ("MaxVio (0: balanced)", "load entropy / log E (1: balanced)")):
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.axvline((1 - s["balance_window"]) * s["tokens_per_run"] / 1e6, color="gray", lw=0.8, ls=":")
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=8, loc="best")
  fig.suptitle(f"{s['name']}: expert balance, mean over the E blocks and the seeds (dotted: start of 'late')")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _jsonable(s: dict) -> dict:
  def clean(x):
    if isinstance(x, float):
      return None if not math.isfinite(x) else round(x, 6)
    if isinstance(x, dict):
      return {str(k): clean(v) for k, v in x.items() if not str(k).endswith(("_curve", "_curves"))}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x
  return clean(s)


def write_summary(config, out_dir: str, runs_dir: str) -> dict:
  keep_records(runs_dir, out_dir, study_variants(config), [int(k) for k in config.study.seeds])
  s = collect(config, runs_dir, out_dir)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(render_markdown(s))
  with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(_jsonable(s), f, indent=1)
  plot_gaps(s, os.path.join(out_dir, "loss_gap.png"))
  if s.get("balance"):
    plot_balance(s, os.path.join(out_dir, "balance.png"))
  return s


# ------------------------------------------------------------------------------------- command line

def enable_compilation_cache(directory: str) -> None:
  """Persistent XLA cache: the second seed of a variant (and a resumed study) reuses compiled steps."""
  sharding.use_compilation_cache(os.path.abspath(directory))


def main(argv=None) -> int:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  config_flag = config_flags.DEFINE_config_file("config", os.path.join(root, "configs", "study_cpu.py"),
                                                "Study config (configs/study_*.py).", lock_config=False)
  workdir = flags.DEFINE_string("workdir", None, "Where summary.md/json and loss_gap.png go; default "
                                "results/<config.name>.")
  runs_dir = flags.DEFINE_string("runs_dir", None, "Work directories of the runs; default config.study.runs_dir.")
  summarize_only = flags.DEFINE_bool("summarize_only", False, "Only rewrite the summary from finished runs.")

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments {args[1:]}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    config = config_flag.value
    out = workdir.value or os.path.join("results", config.name)
    runs = runs_dir.value or config.study.runs_dir
    if config.study.get("compilation_cache", True):
      enable_compilation_cache(os.path.join(os.path.dirname(os.path.abspath(runs)), "jax_cache"))
    summary = run_study(config, out, runs_dir=runs, train=not summarize_only.value)
    print(f"\nsummary: {os.path.join(out, 'summary.md')} ({summary['runs_done']}/{summary['runs_total']} runs)")
    print(render_markdown(summary))
    return 0

  app.run(_main, argv=argv)
  return 0


if __name__ == "__main__":
  main()
