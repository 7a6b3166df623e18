"""A study's records on disk: each finished run's ``study_result.json`` and ``metrics.jsonl`` in its work
directory, the copies the output directory keeps (``KEPT_FILES`` under ``<workdir>/runs``), and kept records
rebuilt from an earlier summary and the logs that printed its evaluations."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
from typing import Sequence

from experiments.study_balance import BALANCE_KEYS
from training import report as report_lib
from training import workdir as workdir_lib

RESULT_FILE = "study_result.json"
METRICS_FILE = "metrics.jsonl"
# A finished run's records the output directory keeps (KB-MB): its result, its metrics and the config it was
# trained with (which a later study checks against its own: study.check_finished).
KEPT_FILES = (RESULT_FILE, METRICS_FILE, workdir_lib.CONFIG_FILE)
KEPT_DIR = "runs"                          # under the output directory


def run_dir(runs_dir: str, variant: str, seed: int) -> str:
  return os.path.join(runs_dir, variant, f"seed{seed}")


def load_result(workdir: str) -> dict | None:
  path = os.path.join(workdir, RESULT_FILE)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def read_metrics(workdir: str) -> dict[str, list[dict]]:
  """``metrics.jsonl`` records by kind, in step order; a step logged twice (after a resume) keeps its last record."""
  by_kind = report_lib.read_records(os.path.join(workdir, "metrics.jsonl"))
  return {kind: [records[s] for s in sorted(records)] for kind, records in by_kind.items()}


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


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "?"
