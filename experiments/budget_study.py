"""The tokens-to-loss study: how many tokens each recipe needs to reach the loss of the reference recipe (the
paper's NVFP4) at the budget T. The paper's claim (spec §7): MXFP4 needs ~36% more.

  python -m experiments.budget_study --config configs/study_budget_cpu.py [--workdir results/study_budget_cpu]
  python -m experiments.budget_study --config configs/study_budget_cpu.py --summarize_only   # from finished runs
  python -m experiments.budget_study --config configs/study_budget_cpu.py --quick   # minutes: the whole pipeline

1. The runs (``budget_config``): the reference trained for T (``config.steps``), every other recipe for each
   fraction of T in ``config.study.fractions``, each budget its own run with the schedule scaled to it, for each
   seed. Every run's config is checked before the first one trains. The runs train one after the other in
   ``<runs_dir>/<recipe>_x<fraction>/seed<k>`` (``study.train_runs``: a finished run is skipped, an interrupted
   one resumes from its checkpoint), and the output directory keeps each finished run's records
   (``study_records.keep_records``).
2. After every run the summary is rewritten from all finished runs (``budget_summary``, ``budget_render``):
   ``summary.md`` (per recipe the tokens needed / T with its interval over seeds, and the final validation
   loss of every budget), ``summary.json`` and ``tokens_to_loss.png``.

``--quick`` shrinks the configured study to a few steps of two recipes at two budgets, two seeds and one
validation batch, in ``results/<name>_quick`` and ``runs/<name>_quick``: it checks the pipeline, its numbers
answer nothing.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import study
from experiments.budget_config import budget_run_config, check
from experiments.budget_render import PLOT_FILE, plot_budget, render_markdown
from experiments.budget_summary import collect
from experiments.study_config import set_path
from experiments.study_records import keep_records

# --quick: dotted config paths; the study's name and runs directory gain "_quick".
QUICK = {"steps": 8, "batch_size": 8, "optim.warmup_steps": 2, "log_every": 4, "eval.every_steps": 0,
         "eval.batches": 1, "checkpoint.every_steps": 0, "checkpoint.async_save": False,
         "study.variants": "nvfp4,mxfp4", "study.reference": "nvfp4", "study.fractions": (1.0, 1.5),
         "study.seeds": (0, 1)}


def quick_config(config):
  """``config`` shrunk by ``QUICK`` (its model and data kept), named ``<name>_quick``."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    for path, value in QUICK.items():
      set_path(c, path, value)
    c.name = f"{config.name}_quick"
    c.study.runs_dir = f"{config.study.runs_dir.rstrip('/')}_quick"
  return c


def run_budget_study(config, out_dir: str, *, runs_dir: str | None = None, log: Callable[[str], None] = print,
                     train: bool = True) -> dict:
  """Runs every missing (recipe, budget, seed) of the study in order, rewriting the summary after each.

  Returns the summary dict (also written to ``out_dir/summary.json``)."""
  runs_dir = runs_dir or config.study.runs_dir
  runs = check(config)
  by_name = {r.name: r for r in runs}
  seeds = [int(s) for s in config.study.seeds]

  def make_run(name: str, seed: int):
    return budget_run_config(config, by_name[name], seed)

  todo = study.to_train([(r.name, s) for s in seeds for r in runs], make_run, runs_dir, out_dir, log)
  os.makedirs(out_dir, exist_ok=True)
  summary = write_summary(config, out_dir, runs_dir)
  if not train:
    return summary
  log(f"budget study {config.name}: {len(runs)} (recipe, budget) runs x {len(seeds)} seeds; {len(todo)} to do")
  for _ in study.train_runs(todo, make_run, runs_dir, out_dir, log):
    summary = write_summary(config, out_dir, runs_dir)
  return summary


def write_summary(config, out_dir: str, runs_dir: str) -> dict:
  keep_records(runs_dir, out_dir, [r.name for r in check(config)], [int(k) for k in config.study.seeds])
  s = collect(config, runs_dir, out_dir)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(render_markdown(s))
  with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(study.jsonable(s), f, indent=1)
  plot_budget(s, os.path.join(out_dir, PLOT_FILE))
  return s


def main(argv=None) -> int:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  config_flag = config_flags.DEFINE_config_file("config", os.path.join(root, "configs", "study_budget_cpu.py"),
                                                "Budget study config (configs/study_budget_*.py).",
                                                lock_config=False)
  workdir = flags.DEFINE_string("workdir", None, "Where summary.md/json and the plot go; default "
                                "results/<config.name>.")
  runs_dir = flags.DEFINE_string("runs_dir", None, "Work directories of the runs; default config.study.runs_dir.")
  summarize_only = flags.DEFINE_bool("summarize_only", False, "Only rewrite the summary from finished runs.")
  quick = flags.DEFINE_bool("quick", False, "A few steps of two recipes at two budgets, two seeds (QUICK): "
                            "checks the pipeline in minutes.")

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments {args[1:]}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    config = quick_config(config_flag.value) if quick.value else config_flag.value
    return study.command(config, workdir.value, runs_dir.value, summarize_only.value, run_budget_study,
                         render_markdown)

  app.run(_main, argv=argv)
  return 0


if __name__ == "__main__":
  main()
