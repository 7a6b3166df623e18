"""The expert balance of a study's MoE runs: MaxVio and load entropy from each run's ``train`` records,
averaged over the E blocks, and per variant over seeds, paired with bf16 by seed."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float]:
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
      mean, std = mean_std(list(values.values()))
      d_mean, d_std = mean_std(list(diffs.values()))
      row[key] = dict(per_seed=values, mean=mean, std=std, vs_bf16=diffs, vs_bf16_mean=d_mean, vs_bf16_std=d_std)
    rows[v] = row
  return rows


def mean_curve(curves: Sequence[Sequence[tuple]]) -> list[tuple]:
  """[(step, *means over the curves)] at the steps every curve has."""
  if not curves:
    return []
  by_step = [{c[0]: c[1:] for c in curve} for curve in curves]
  steps = sorted(set.intersection(*(set(b) for b in by_step)))
  return [(st, *(float(x) for x in np.mean([b[st] for b in by_step], axis=0))) for st in steps]
