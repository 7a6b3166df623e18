"""The recipe study: one model, one data stream, the same seeds, trained with each recipe variant.

  python -m experiments.study --config configs/study_cpu.py [--workdir results/study_cpu]
  python -m experiments.study --config configs/study_cpu.py --summarize_only    # tables from finished runs
  python -m experiments.study --config configs/study_cpu.py --config.study.variants=bf16,nvfp4

Variants (spec §6-7): bf16, fp8, mxfp4, nvfp4 (the paper's recipe), nvfp4 without stochastic rounding,
without RHT, without 2D weight tiles, nvfp4 with every linear layer in FP4, and nvfp4 with the precision
switch (the last ``study.switch_fraction`` of the steps with the forward pass in bf16).

1. Each (variant, seed) trains with ``training.train_and_evaluate`` in ``<runs_dir>/<variant>/seed<k>``,
   one after the other in this process. A finished run leaves ``study_result.json`` there and is skipped
   next time, if the config it was trained with is the one the study now gives it in every field that changes
   its result or evaluation; else the study stops and names the fields (``check_finished``). An interrupted
   run resumes from its latest checkpoint (the trainer's own resume, which checks its config the same way).
   The summary keeps each finished run's small records (``study_records.KEPT_FILES``: its result,
   ``metrics.jsonl`` and ``config.json``) under the output directory, ``<workdir>/runs/<variant>/seed<k>``,
   and reads a run from there when the runs directory (checkpoints, git-ignored) lacks it: a committed output
   directory survives the machine.
2. After every run the summary is rewritten from all finished runs: ``summary.md`` (final validation loss,
   relative gap to bf16 per seed, mean and spread over seeds, tokens/s, wall time), ``summary.json`` and
   ``loss_gap.png`` (relative validation-loss gap to bf16 against tokens, one line per variant). A model with
   MoE blocks adds the expert balance (``study_balance.balance_of_records``: MaxVio and load entropy
   averaged over the E blocks, final and late in training, paired with bf16 by seed) as a second table and
   ``balance.png``.

The gap of a variant is paired by seed: (loss_variant(seed) - loss_bf16(seed)) / loss_bf16(seed), so
init, data order and validation batches are the same on both sides; mean and sample std over seeds.

The pieces, from the bottom: ``study_config`` (the variants, one run's config), ``study_balance`` (the
expert balance), ``study_records`` (the records on disk), ``study_summary`` (what the summary shows),
``study_render`` (its Markdown and plots); this module trains and writes.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

import training
from configs import base as base_config
from experiments.study_config import run_config, study_variants
from experiments.study_records import RESULT_FILE, cpu_name, keep_records, records_dir, run_dir
from experiments.study_render import plot_balance, plot_gaps, render_markdown
from experiments.study_summary import collect
from training import sharding
from training import workdir as workdir_lib


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
                processor=cpu_name(),
                finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  if record["status"] in ("done", "diverged"):
    with open(os.path.join(workdir, RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(record, f, indent=2)
  return record


def run_study(config, out_dir: str, *, runs_dir: str | None = None, log: Callable[[str], None] = print,
              train: bool = True) -> dict:
  """Runs every missing (variant, seed) of ``config.study`` in order, rewriting the summary after each.

  Returns the summary dict (also written to ``out_dir/summary.json``).
  """
  runs_dir = runs_dir or config.study.runs_dir
  variants = study_variants(config)
  seeds = [int(s) for s in config.study.seeds]
  make_run = lambda v, s: run_config(config, v, s)
  todo = to_train([(v, s) for s in seeds for v in variants], make_run, runs_dir, out_dir, log)
  os.makedirs(out_dir, exist_ok=True)
  summary = write_summary(config, out_dir, runs_dir)
  if not train:
    return summary
  log(f"study {config.name}: {len(variants)} variants x {len(seeds)} seeds; {len(todo)} run(s) to do")
  for _ in train_runs(todo, make_run, runs_dir, out_dir, log):
    summary = write_summary(config, out_dir, runs_dir)
  return summary


def to_train(pairs: Sequence[tuple[str, int]], make_run: Callable[[str, int], Any], runs_dir: str, out_dir: str,
             log: Callable[[str], None]) -> list[tuple[str, int]]:
  """The (name, seed) pairs without a finished run's records, in order. The records of each finished one must
  be of the config ``make_run(name, seed)`` gives (``check_finished``)."""
  todo = []
  for name, seed in pairs:
    where = records_dir(runs_dir, out_dir, name, seed)
    if where is None:
      todo.append((name, seed))
    else:
      check_finished(where, make_run(name, seed), log)
  return todo


def check_finished(where: str, run, log: Callable[[str], None] = print) -> None:
  """A finished run's records stand for ``run`` only if the config they were trained with is ``run``'s in every
  field that changes the trained result or its evaluation: else ConfigChangedError, naming the fields and the
  fixes. Records kept without their config (seeded from an earlier summary) cannot be checked; a warning says so."""
  record = workdir_lib.last_config(where)
  if record.config is None:
    log(f"warning: the finished run in {where} keeps no record of its config ({workdir_lib.CONFIG_FILE}); its "
        "results are taken as this config's unchecked")
    return
  changes = workdir_lib.changes_since(record.config, run)
  differ = {k: v for k, v in changes.items() if not workdir_lib.is_free(k) or k.startswith("eval.")}
  if differ:
    diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differ.items())
    raise training.ConfigChangedError(
        f"the finished run in {where} was trained with another config than the study asks for: {len(differ)} "
        f"field(s) differ from its record ({record.source}): {diff}. Its results would stand in for a run this "
        "config does not describe. Give the study the run's values, use another output directory and "
        "config.study.runs_dir, or delete the run's directory (and its copy kept under the output directory) "
        "to train it again")


def train_runs(todo: Sequence[tuple[str, int]], make_run: Callable[[str, int], Any], runs_dir: str,
               out_dir: str, log: Callable[[str], None]) -> Iterator[dict]:
  """Trains each (name, seed) of ``todo`` in ``run_dir(runs_dir, name, seed)`` with the config
  ``make_run(name, seed)``, one after the other, yielding each finished run's record.

  A run another process finished meanwhile (its records found under ``runs_dir`` or ``out_dir``) or is
  training (``training.WorkdirInUse``) is skipped; a run stopped by a signal ends the loop."""
  for i, (name, seed) in enumerate(todo):
    workdir = run_dir(runs_dir, name, seed)
    where = records_dir(runs_dir, out_dir, name, seed)
    if where is not None:   # finished meanwhile by another process
      check_finished(where, make_run(name, seed), log)
      log(f"\n=== [{i + 1}/{len(todo)}] {name} seed {seed}: finished meanwhile, skipped")
      continue
    log(f"\n=== [{i + 1}/{len(todo)}] {name} seed {seed} -> {workdir}")
    try:
      record = train_one(make_run(name, seed), workdir, log)
    except training.WorkdirInUse as e:   # another study process is training it: its result is read when it is done
      log(f"  skipped: {e}")
      continue
    if record["status"] not in ("done", "diverged"):  # stopped by a signal: leave the rest for next time
      log(f"run {name}/seed{seed} ended with status {record['status']}; stopping the study")
      return
    yield record


def jsonable(s: dict) -> dict:
  """A summary as JSON: non-finite floats as null, floats to 6 decimals, curves left out."""
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
    json.dump(jsonable(s), f, indent=1)
  plot_gaps(s, os.path.join(out_dir, "loss_gap.png"))
  if s.get("balance"):
    plot_balance(s, os.path.join(out_dir, "balance.png"))
  return s


# ------------------------------------------------------------------------------------- command line

def enable_compilation_cache(directory: str) -> None:
  """Persistent XLA cache: the second seed of a variant (and a resumed study) reuses compiled steps."""
  sharding.use_compilation_cache(os.path.abspath(directory))


def command(config, workdir: str | None, runs_dir: str | None, summarize_only: bool, run, render) -> int:
  """A study's command line after its flags: ``run(config, out_dir, runs_dir=, train=)`` into ``workdir``
  (default results/<config.name>) with the compilation cache beside the runs, then ``render(summary)``."""
  unknown = base_config.unknown_fields(config, ("study",))
  if unknown:
    print(f"error: the study's config sets {len(unknown)} field(s) that fp4jax's config does not have: "
          f"{', '.join('config.' + f for f in unknown)}; nothing would read them", file=sys.stderr)
    return 2
  out = workdir or os.path.join("results", config.name)
  runs = runs_dir or config.study.runs_dir
  if config.study.get("compilation_cache", True):
    enable_compilation_cache(os.path.join(os.path.dirname(os.path.abspath(runs)), "jax_cache"))
  try:
    summary = run(config, out, runs_dir=runs, train=not summarize_only)
  except training.ConfigChangedError as e:
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code
  print(f"\nsummary: {os.path.join(out, 'summary.md')} ({summary['runs_done']}/{summary['runs_total']} runs)")
  print(render(summary))
  return 0


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
    return command(config_flag.value, workdir.value, runs_dir.value, summarize_only.value, run_study,
                   render_markdown)

  app.run(_main, argv=argv)
  return 0


if __name__ == "__main__":
  main()
