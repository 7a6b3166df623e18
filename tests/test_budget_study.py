"""The tokens-to-loss study: the interpolation and the interval on synthetic numbers, the runs and their
schedules, the driver end to end on fake runs, and (slow) its --quick form trained for real."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from configs import study_budget_cpu
from configs.shrunken import compilation_cache_env
from experiments import budget_config, budget_render, budget_study, budget_summary, study, study_records
from experiments.budget_match import AT_MOST, BRACKETED, MORE_THAN, Match, mean_ratio, t_interval, tokens_to_target
from training import optim
from training import workdir as workdir_lib
from training.errors import ConfigChangedError, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T975_2 = 4.302652729911275   # Student's t, 97.5% quantile, 2 degrees of freedom (tables)


class TestTokensToTarget:

  def test_interpolates_linearly_between_the_bracketing_budgets(self):
    # 1.5 at 100, 1.25 at 120: the target 1.3 is a fifth of the way down, at 100 + 0.8 * 20 tokens.
    m = tokens_to_target([100, 120, 140], [1.5, 1.25, 1.0], 1.3)
    assert m.kind == BRACKETED and m.tokens == pytest.approx(116.0)
    assert tokens_to_target([100, 120, 140], [1.5, 1.4, 1.2], 1.3) == Match(BRACKETED, pytest.approx(130.0))
    assert tokens_to_target([100, 120], [1.5, 1.3], 1.3) == Match(BRACKETED, 120.0)   # reached exactly

  def test_bounds_when_not_bracketed(self):
    assert tokens_to_target([100, 120], [1.2, 1.1], 1.3) == Match(AT_MOST, 100.0)
    assert tokens_to_target([100, 120], [1.3, 1.4], 1.3) == Match(AT_MOST, 100.0)
    assert tokens_to_target([100, 120, 140], [1.6, 1.5, 1.4], 1.3) == Match(MORE_THAN, 140.0)
    assert tokens_to_target([100], [1.4], 1.3) == Match(MORE_THAN, 100.0)

  def test_a_noisy_curve_gives_its_first_crossing(self):
    m = tokens_to_target([100, 120, 140, 160], [1.5, 1.2, 1.35, 1.1], 1.3)
    assert m.kind == BRACKETED and m.tokens == pytest.approx(100 + 20 * 2 / 3)

  def test_bad_input_is_refused(self):
    with pytest.raises(ValueError, match="strictly increasing"):
      tokens_to_target([120, 100], [1.5, 1.2], 1.3)
    with pytest.raises(ValueError, match="one loss per budget"):
      tokens_to_target([100, 120], [1.5], 1.3)
    with pytest.raises(ValueError, match="diverged run"):
      tokens_to_target([100, 120], [1.5, math.nan], 1.3)


def test_t_interval_of_the_mean():
  mean, low, high = t_interval([1.3, 1.4, 1.5])   # s = 0.1, n = 3
  half = T975_2 * 0.1 / math.sqrt(3)
  assert (mean, low, high) == pytest.approx((1.4, 1.4 - half, 1.4 + half))
  mean, low, high = t_interval([2.0])
  assert mean == 2.0 and math.isnan(low) and math.isnan(high)
  assert t_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
  with pytest.raises(ValueError, match="confidence"):
    t_interval([1.0, 2.0], confidence=95)


def test_mean_ratio_is_an_interval_or_a_bound():
  all_in = mean_ratio([Match(BRACKETED, 130.0), Match(BRACKETED, 140.0), Match(BRACKETED, 150.0)], 100.0)
  half = T975_2 * 0.1 / math.sqrt(3)
  assert all_in["kind"] == BRACKETED and all_in["bracketed"] == 3 and all_in["ratios"] == pytest.approx([1.3, 1.4, 1.5])
  assert (all_in["mean"], all_in["low"], all_in["high"]) == pytest.approx((1.4, 1.4 - half, 1.4 + half))
  above = mean_ratio([Match(BRACKETED, 130.0), Match(MORE_THAN, 160.0)], 100.0)
  assert above["kind"] == MORE_THAN and above["mean"] == pytest.approx(1.45) and math.isnan(above["low"])
  below = mean_ratio([Match(AT_MOST, 100.0), Match(AT_MOST, 100.0), Match(BRACKETED, 106.0)], 100.0)
  assert below["kind"] == AT_MOST and below["mean"] == pytest.approx(1.02) and below["bracketed"] == 1
  both = mean_ratio([Match(AT_MOST, 100.0), Match(MORE_THAN, 160.0)], 100.0)
  assert both["kind"] is None and math.isnan(both["mean"])
  assert budget_render.ratio_text(MORE_THAN, 1.6) == "> 1.6" and budget_render.ratio_text(AT_MOST, 1.0) == "≤ 1"


def test_each_budget_is_its_own_run_with_the_schedule_scaled_to_it():
  c = study_budget_cpu.get_config()
  runs = budget_config.check(c)
  assert [(r.variant, r.fraction, r.steps) for r in runs[:3]] == [("nvfp4", 1.0, 2200), ("mxfp4", 1.0, 2200),
                                                                 ("mxfp4", 1.2, 2640)]
  assert len(runs) == 1 + 4 * 4 and {r.variant for r in runs} == {"nvfp4", "mxfp4", "fp8", "quartet2", "tetrajet2"}
  assert runs[2].name == "mxfp4_x1.2" and all(r.fraction == 1.0 for r in runs if r.variant == "nvfp4")
  for r in runs:
    run = budget_config.budget_run_config(c, r, 2)
    assert (run.steps, run.seed, run.model.bf16_last_blocks) == (r.steps, 2, 1) and "study" not in run
    _, _, warmup, knee, _ = optim.schedule(run.optim, run.steps).points
    assert warmup == 100 and knee == r.steps - round(0.2 * r.steps)   # the wsd decay: the last 20% of ITS steps
  c.study.fractions = (0.05, 1.0)   # 110 steps: no room for the 100-step warmup and the decay
  with pytest.raises(ConfigError, match=r"run mxfp4_x0.05 \(110 steps\).*warmup_steps=100"):
    budget_config.check(c)
  c.study.fractions = (1.0, 1.0002)
  with pytest.raises(ValueError, match="two budgets are the same run"):
    budget_config.check(c)
  c.study.fractions, c.study.variants = (1.0,), "mxfp4,fp8"
  with pytest.raises(ValueError, match="reference='nvfp4' is not among"):
    budget_config.check(c)


def micro_budget_config():
  c = budget_study.quick_config(study_budget_cpu.get_config())
  c.study.variants = "nvfp4,mxfp4,fp8"
  c.study.fractions = (1.0, 1.2, 1.4)   # steps 8, 10, 11
  return c


# Final validation losses of fake runs: nvfp4 at T is the target of each seed.
FAKE_LOSS = {("nvfp4_x1", 0): 2.0, ("nvfp4_x1", 1): 2.1,
             ("mxfp4_x1", 0): 2.3, ("mxfp4_x1.2", 0): 2.1, ("mxfp4_x1.4", 0): 1.9,    # 2.0 at 1.3 T
             ("mxfp4_x1", 1): 2.4, ("mxfp4_x1.2", 1): 2.3, ("mxfp4_x1.4", 1): 2.2,    # never: > 1.4 T
             ("fp8_x1", 0): 1.9, ("fp8_x1.2", 0): 1.8, ("fp8_x1.4", 0): 1.7,          # already at T: <= 1 T
             ("fp8_x1", 1): 2.2, ("fp8_x1.2", 1): 2.0, ("fp8_x1.4", 1): 1.9}


def test_the_study_on_fake_runs_writes_the_answer_and_skips_finished_runs(tmp_path, monkeypatch):
  c = micro_budget_config()
  out, runs = str(tmp_path / "out"), str(tmp_path / "runs")
  trained = []

  def fake_train(run, workdir, log):
    name, seed = run.name.split("/")[1], run.seed
    trained.append((name, seed, run.steps))
    os.makedirs(workdir, exist_ok=True)
    workdir_lib.record_config(workdir, run, step=0, event="start")   # as the trainer does
    result = dict(status="done", step=run.steps, validation_loss=FAKE_LOSS[(name, seed)], nonfinite_steps=0,
                  tokens_per_second=1000.0, wall_seconds=6.0)
    with open(os.path.join(workdir, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(result, f)
    return result

  monkeypatch.setattr(study, "train_one", fake_train)
  plotted = []   # the plot is drawn for real once, below
  monkeypatch.setattr(budget_study, "plot_budget", lambda s, path: plotted.append(s["runs_done"]))
  s = budget_study.run_budget_study(c, out, runs_dir=runs, log=lambda _: None)
  assert sorted((n, k) for n, k, _ in trained) == sorted(FAKE_LOSS) and s["runs_done"] == s["runs_total"] == 14
  assert plotted == list(range(15)), "the summary is rewritten before the first run and after each"
  monkeypatch.setattr(budget_study, "plot_budget", budget_render.plot_budget)
  assert {(n, steps) for n, _, steps in trained} >= {("mxfp4_x1", 8), ("mxfp4_x1.2", 10), ("mxfp4_x1.4", 11)}
  t = s["t_tokens"]
  assert t == 8 * 8 * 64
  mx = s["matches"]["mxfp4"]
  # seed 0: 2.0 between 2.1 (10 steps) and 1.9 (11 steps): 10.5 steps; seed 1 over 2.1 at every budget.
  assert mx["per_seed"][0] == dict(kind=BRACKETED, tokens=pytest.approx(10.5 * 512), ratio=pytest.approx(10.5 / 8))
  assert mx["per_seed"][1]["kind"] == MORE_THAN and mx["per_seed"][1]["ratio"] == pytest.approx(11 / 8)
  assert mx["kind"] == MORE_THAN and mx["mean"] == pytest.approx((10.5 + 11) / 16) and mx["bracketed"] == 1
  fp8 = s["matches"]["fp8"]   # seed 0 under 2.0 at T already; seed 1: 2.1 between 2.2 and 2.0 at 9 of 8 steps
  assert fp8["kinds"] == [AT_MOST, BRACKETED] and fp8["ratios"] == pytest.approx([1.0, 9 / 8])
  assert fp8["kind"] == AT_MOST and fp8["mean"] == pytest.approx((1 + 9 / 8) / 2)
  for name in ("summary.md", "summary.json"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  text = open(os.path.join(out, "summary.md"), encoding="utf-8").read()
  assert "| mxfp4 | E2M1, E8M0 scale per 32, SR, RHT-32 on wgrad | > 1.34 | — | 1.312, > 1.38 | 1/2 |" in text
  assert "| fp8 | E4M3, 1x128 blocks, 128x128 weight tiles | ≤ 1.06 | — | ≤ 1, 1.125 | 1/2 |" in text
  assert "per seed 2.0000, 2.1000" in text and "36% more tokens" in text
  saved = json.load(open(os.path.join(out, "summary.json"), encoding="utf-8"))
  assert saved["matches"]["mxfp4"]["per_seed"]["0"]["ratio"] == pytest.approx(1.3125)
  # A second call finds every run finished and trains nothing.
  trained.clear()
  calls = []
  budget_study.run_budget_study(c, out, runs_dir=runs, log=calls.append)
  assert trained == [] and "0 to do" in calls[0]
  assert os.path.getsize(os.path.join(out, budget_render.PLOT_FILE)) > 10_000
  # A runs directory of another T is refused, not read as this study's: by the config each run recorded, and
  # where records were kept without it, by their step counts.
  c.steps = 9
  with pytest.raises(ConfigChangedError, match=r"nvfp4_x1/seed0 was trained with another config .* steps: 8 -> 9"):
    budget_study.run_budget_study(c, str(tmp_path / "out9"), runs_dir=runs, log=lambda _: None)
  for name, seed in FAKE_LOSS:
    for record in (workdir_lib.CONFIG_FILE, workdir_lib.HISTORY_FILE):
      os.remove(os.path.join(study_records.run_dir(runs, name, seed), record))
  with pytest.raises(ValueError, match="a finished run of 8 steps, but nvfp4_x1 of this study has 9"):
    budget_study.run_budget_study(c, str(tmp_path / "out9"), runs_dir=runs, log=lambda _: None)


def test_every_seed_bracketed_gives_the_mean_and_its_interval(tmp_path, monkeypatch):
  c = micro_budget_config()
  c.study.variants, c.study.seeds = "nvfp4,mxfp4", (0, 1, 2)
  losses = {0: (2.0, 2.3, 2.1, 1.9), 1: (2.0, 2.2, 1.9, 1.8), 2: (2.0, 2.4, 2.2, 1.95)}   # nvfp4, mxfp4 x1 .. x1.4
  steps = {"nvfp4_x1": 0, "mxfp4_x1": 1, "mxfp4_x1.2": 2, "mxfp4_x1.4": 3}

  def fake_train(run, workdir, log):
    os.makedirs(workdir, exist_ok=True)
    result = dict(status="done", step=run.steps, validation_loss=losses[run.seed][steps[run.name.split("/")[1]]],
                  wall_seconds=1.0, tokens_per_second=1.0)
    with open(os.path.join(workdir, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(result, f)
    return result

  monkeypatch.setattr(study, "train_one", fake_train)
  monkeypatch.setattr(budget_study, "plot_budget", lambda s, path: None)   # drawn in the test above
  s = budget_study.run_budget_study(c, str(tmp_path / "out"), runs_dir=str(tmp_path / "runs"), log=lambda _: None)
  # The crossings in steps: 10 + 0.1 / 0.2 (seed 0), 8 + 2 * 0.2 / 0.3 (seed 1), 10 + 0.2 / 0.25 (seed 2); T: 8.
  ratios = [x / 8 for x in (10.5, 8 + 4 / 3, 10.8)]
  mean = sum(ratios) / 3
  sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2)
  mx = s["matches"]["mxfp4"]
  assert mx["kind"] == BRACKETED and mx["bracketed"] == 3 and mx["ratios"] == pytest.approx(ratios)
  assert (mx["mean"], mx["low"], mx["high"]) == pytest.approx((mean, mean - T975_2 * sd / math.sqrt(3),
                                                               mean + T975_2 * sd / math.sqrt(3)))
  text = budget_render.render_markdown(s)
  assert f"| **{mean:.3f}** ({100 * (mean - 1):+.0f}%) | {mx['low']:.3f} ... {mx['high']:.3f} |" in text


@pytest.mark.slow   # trains the --quick study (2 recipes, 2 budgets, 2 seeds, 8-12 steps): ~3 min on 2 cores
def test_quick_study_runs_every_run_and_writes_the_summary(tmp_path):
  out, runs = tmp_path / "out", tmp_path / "runs"
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", "experiments.budget_study", "--config", "configs/study_budget_cpu.py",
                         "--quick", f"--workdir={out}", f"--runs_dir={runs}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=1200, env={**os.environ, **compilation_cache_env()})
  assert done.returncode == 0, done.stderr[-3000:]
  print(f"--quick study: {time.perf_counter() - start:.0f} s")
  saved = json.load(open(out / "summary.json", encoding="utf-8"))
  names = {"nvfp4_x1": 8, "mxfp4_x1": 8, "mxfp4_x1.5": 12}
  assert saved["runs_done"] == saved["runs_total"] == 6 and saved["name"] == "study_budget_cpu_quick"
  for name, steps in names.items():
    row = saved["rows"][name]
    assert row["steps"] == steps and row["statuses"] == ["done"] and sorted(row["validation_loss"]) == ["0", "1"]
    assert all(math.isfinite(v) for v in row["validation_loss"].values())
    for seed in (0, 1):
      assert (runs / name / f"seed{seed}" / study_records.RESULT_FILE).exists()
      assert (out / study_records.KEPT_DIR / name / f"seed{seed}" / study_records.RESULT_FILE).exists()
  mx = saved["matches"]["mxfp4"]
  assert sorted(mx["per_seed"]) == ["0", "1"] and mx["seeds"] == 2
  assert all(m["kind"] in (BRACKETED, AT_MOST, MORE_THAN) for m in mx["per_seed"].values())
  text = (out / "summary.md").read_text(encoding="utf-8")
  assert "| recipe | what | tokens needed / T | 95% interval | per seed | seeds bracketed |" in text
  assert "| mxfp4 | " in text and "runs finished 6/6" in text
  assert (out / budget_render.PLOT_FILE).stat().st_size > 10_000


def test_diverged_and_unfinished_runs_leave_their_seed_out(tmp_path):
  c = micro_budget_config()
  c.study.variants, c.study.fractions, c.study.seeds = "nvfp4,mxfp4", (1.0, 1.5), (0, 1, 2)
  runs = str(tmp_path / "runs")
  results = {("nvfp4_x1", 0): 2.0, ("nvfp4_x1", 1): 2.0, ("nvfp4_x1", 2): 2.0, ("mxfp4_x1", 0): 2.2,
             ("mxfp4_x1.5", 0): 1.8, ("mxfp4_x1", 1): 2.2, ("mxfp4_x1.5", 1): None, ("mxfp4_x1", 2): 2.2}
  for (name, seed), loss in results.items():   # seed 1 diverged at 1.5 T; seed 2 has not run 1.5 T yet
    workdir = study_records.run_dir(runs, name, seed)
    os.makedirs(workdir)
    steps = 8 if name.endswith("x1") else 12
    with open(os.path.join(workdir, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(dict(status="done" if loss else "diverged", step=steps if loss else 5, validation_loss=loss), f)
  s = budget_summary.collect(c, runs)
  mx = s["matches"]["mxfp4"]
  assert [mx["per_seed"][k]["kind"] for k in (0, 1, 2)] == [BRACKETED, budget_summary.DIVERGED, budget_summary.PENDING]
  assert mx["measured_seeds"] == [0] and mx["ratios"] == pytest.approx([10 / 8]) and math.isnan(mx["low"])
  assert s["rows"]["mxfp4_x1.5"]["statuses"] == ["diverged", "done"] and s["runs_done"] == 8
  text = budget_render.render_markdown(s)
  assert "| **1.250** (+25%) (1 of 3 seeds) | — | 1.250, diverged: mxfp4_x1.5, pending | 1/3 |" in text
  assert "| mxfp4 | 2.2000 ± 0.0000 | 1.8000 (1 of 3, 1 diverged) |" in text
