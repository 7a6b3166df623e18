"""The recipe-study driver end to end on a micro config: 2 variants, 1 seed, a handful of steps."""
from __future__ import annotations

import json
import os

import pytest
from ml_collections import config_dict

from configs import shrunken
from configs.shrunken import shrunken_config
from experiments import study
from training import sharding

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)  # reruns compile once


def micro_study_config(steps: int = 4):
  c = shrunken_config(steps=steps, recipe="bf16", **{"eval.every_steps": 2, "eval.batches": 1,
                                                     "checkpoint.async_save": False})
  c.name = "micro_study"
  c.study = config_dict.ConfigDict(dict(seeds=(0,), variants="bf16,nvfp4", runs_dir="", switch_fraction=0.25))
  return c


def test_run_config_applies_variant_overrides():
  c = micro_study_config()
  c.study.variants = "all"
  assert study.study_variants(c)[0] == "bf16" and len(study.study_variants(c)) == len(study.VARIANTS)
  run = study.run_config(c, "nvfp4_all_fp4", 3)
  assert "study" not in run and "study" in c
  assert (run.seed, run.recipe, run.model.bf16_last_blocks) == (3, "nvfp4", 0)
  switch = study.run_config(c, "nvfp4_switch", 0)
  assert (switch.precision_switch.fraction, switch.precision_switch.mode) == (0.25, "fwd")
  c.study.variants = "nvfp4,mxfp4"
  with pytest.raises(ValueError, match="bf16"):
    study.study_variants(c)


def test_reference_variant_defaults_to_the_paper_recipe_in_the_study():
  c = micro_study_config()
  c.study.variants = "bf16,mxfp4,nvfp4"
  assert study.reference_variant(c) == "nvfp4"
  c.study.variants = "bf16,quartet2_all_fp4,nvfp4_all_fp4"
  assert study.reference_variant(c) == "nvfp4_all_fp4"
  c.study.variants = "bf16,mxfp4"
  assert study.reference_variant(c) is None
  c.study.reference = "mxfp4"
  assert study.reference_variant(c) == "mxfp4"
  c.study.reference = "fp8"
  with pytest.raises(ValueError, match="config.study.reference='fp8' is not among"):
    study.reference_variant(c)


@pytest.mark.slow   # ~40 s: trains the micro study's runs
def test_micro_study_writes_summary_and_skips_finished_runs(tmp_path):
  c = micro_study_config()
  out, runs = str(tmp_path / "results"), str(tmp_path / "runs")
  summary = study.run_study(c, out, runs_dir=runs, log=lambda _: None)
  assert summary["runs_done"] == summary["runs_total"] == 2
  for name in ("summary.md", "summary.json", "loss_gap.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
    saved = json.load(f)
  row = saved["rows"]["nvfp4"]
  assert row["statuses"] == ["done"] and row["seeds"] == [0]
  assert row["gap_percent"]["0"] == pytest.approx(
      100 * (row["validation_loss"]["0"] / saved["rows"]["bf16"]["validation_loss"]["0"] - 1), abs=1e-3)
  assert summary["rows"]["nvfp4"]["gap_curve"], "the gap curve needs the evaluations at steps 2 and 4"
  text = open(os.path.join(out, "summary.md"), encoding="utf-8").read()
  assert "| nvfp4 |" in text and "| bf16 |" in text
  # A second call finds both runs finished and trains nothing.
  mtime = os.path.getmtime(os.path.join(runs, "nvfp4", "seed0", study.RESULT_FILE))
  calls = []
  study.run_study(c, out, runs_dir=runs, log=calls.append)
  assert "0 run(s) to do" in calls[0]
  assert os.path.getmtime(os.path.join(runs, "nvfp4", "seed0", study.RESULT_FILE)) == mtime


def test_sqnr_of_gaussian_data_orders_the_formats():
  import numpy as np
  from experiments import numerics_study as ns
  x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)  # 96: not a multiple of 32 or 128
  nv, mx, f8 = (ns.sqnr_db(x, fmt, axis=-1) for fmt in ("nvfp4", "mxfp4", "fp8"))
  assert 18.0 < nv < 23.0 and mx < nv < f8 and f8 > 28.0   # docs/PERF.md: 20.4 / 18.8 / 31.8 dB
  assert ns.sqnr_db(x, "nvfp4", axis=0, rht_size=16) > 15.0
  exact = np.tile(np.array([0, .5, 1, 1.5, 2, 3, 4, 6] * 2, np.float32), (4, 1))
  assert ns.sqnr_db(exact, "nvfp4") == float("inf")
