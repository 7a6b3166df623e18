"""The recipe-study driver end to end on a micro config: 2 variants, 1 seed, a handful of steps."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from ml_collections import config_dict

from configs import shrunken
from configs.shrunken import shrunken_config
from experiments import study, study_balance, study_config, study_records, study_render
from training import sharding
from training import workdir as workdir_lib
from training.errors import ConfigChangedError

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
  assert study_config.study_variants(c)[0] == "bf16" and len(study_config.study_variants(c)) == len(study_config.VARIANTS)
  run = study_config.run_config(c, "nvfp4_all_fp4", 3)
  assert "study" not in run and "study" in c
  assert (run.seed, run.recipe, run.model.bf16_last_blocks) == (3, "nvfp4", 0)
  switch = study_config.run_config(c, "nvfp4_switch", 0)
  assert (switch.precision_switch.fraction, switch.precision_switch.mode) == (0.25, "fwd")
  c.study.variants = "nvfp4,mxfp4"
  with pytest.raises(ValueError, match="bf16"):
    study_config.study_variants(c)


def test_reference_variant_defaults_to_the_paper_recipe_in_the_study():
  c = micro_study_config()
  c.study.variants = "bf16,mxfp4,nvfp4"
  assert study_config.reference_variant(c) == "nvfp4"
  c.study.variants = "bf16,quartet2_all_fp4,nvfp4_all_fp4"
  assert study_config.reference_variant(c) == "nvfp4_all_fp4"
  c.study.variants = "bf16,mxfp4"
  assert study_config.reference_variant(c) is None
  c.study.reference = "mxfp4"
  assert study_config.reference_variant(c) == "mxfp4"
  c.study.reference = "fp8"
  with pytest.raises(ValueError, match="config.study.reference='fp8' is not among"):
    study_config.reference_variant(c)


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
  mtime = os.path.getmtime(os.path.join(runs, "nvfp4", "seed0", study_records.RESULT_FILE))
  calls = []
  study.run_study(c, out, runs_dir=runs, log=calls.append)
  assert "0 run(s) to do" in calls[0]
  assert os.path.getmtime(os.path.join(runs, "nvfp4", "seed0", study_records.RESULT_FILE)) == mtime


def _finished(runs: str, run, **changed) -> str:
  """A finished run's records as the trainer and the study leave them, trained with ``run`` changed by ``changed``
  (dotted fields)."""
  run = run.copy_and_resolve_references()
  for field, value in changed.items():
    *parents, leaf = field.split(".")
    node = run
    for p in parents:
      node = node[p]
    node[leaf] = value
  where = study_records.run_dir(runs, run.name.split("/")[1], run.seed)
  os.makedirs(where)
  workdir_lib.record_config(where, run, step=0, event="start")
  with open(os.path.join(where, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
    json.dump(dict(status="done", step=run.steps, validation_loss=2.5, nonfinite_steps=0, tokens_per_second=100.0,
                   wall_seconds=10.0), f)
  return where


def test_a_finished_run_of_another_config_stops_the_study(tmp_path, monkeypatch, capsys):
  """A finished run stands for the study's run only if it was trained with the study's config: a changed step
  count (or evaluation) stops the study, and its summary, with the fields named and the fixes; a free field
  (how the run was logged) does not. Before, the study skipped such a run and summarized it as the new config's."""
  c = micro_study_config()
  c.study.variants, c.study.compilation_cache = "bf16", False
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  monkeypatch.setattr(study, "train_one", lambda *a: pytest.fail("a finished run was trained again"))
  where = _finished(runs, study_config.run_config(c, "bf16", 0), **{"log_every": 3})
  assert study.run_study(c, out, runs_dir=runs, log=lambda _: None)["runs_done"] == 1   # log_every is free
  shutil.rmtree(where)
  _finished(runs, study_config.run_config(c, "bf16", 0), **{"steps": 8, "eval.batches": 2})
  for train in (True, False):   # --summarize_only too: its tables would be the other config's
    with pytest.raises(ConfigChangedError, match=r"2 field\(s\) differ .*eval.batches: 2 -> 1; steps: 8 -> 4"):
      study.run_study(c, out, runs_dir=runs, train=train, log=lambda _: None)
  assert study.command(c, out, runs, False, study.run_study, str) == ConfigChangedError.exit_code
  assert capsys.readouterr().err.startswith("error: the finished run in ")


def test_a_study_config_field_the_config_lacks_is_refused(tmp_path, capsys):
  c = micro_study_config()
  c.study.compilation_cache = False
  c.optim.warmup = 5
  assert study.command(c, str(tmp_path / "out"), str(tmp_path / "runs"), False, study.run_study, str) == 2
  assert "config.optim.warmup" in capsys.readouterr().err and not os.path.exists(tmp_path / "out")


def test_sqnr_of_gaussian_data_orders_the_formats():
  import numpy as np
  from experiments import numerics_study as ns
  x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)  # 96: not a multiple of 32 or 128
  nv, mx, f8 = (ns.sqnr_db(x, fmt, axis=-1) for fmt in ("nvfp4", "mxfp4", "fp8"))
  assert 18.0 < nv < 23.0 and mx < nv < f8 and f8 > 28.0   # docs/PERF.md: 20.4 / 18.8 / 31.8 dB
  assert ns.sqnr_db(x, "nvfp4", axis=0, rht_size=16) > 15.0
  exact = np.tile(np.array([0, .5, 1, 1.5, 2, 3, 4, 6] * 2, np.float32), (4, 1))
  assert ns.sqnr_db(exact, "nvfp4") == float("inf")


def _moe_record(step, max_vio, entropy):
  """A synthetic ``train`` record of a model with two E blocks (blocks_1, blocks_4), as the trainer logs it."""
  return {"kind": "train", "step": step, "loss": 3.0,
          "moe/blocks_1/max_vio": max_vio[0], "moe/blocks_4/max_vio": max_vio[1],
          "moe/blocks_1/entropy": entropy[0], "moe/blocks_4/entropy": entropy[1],
          "moe/blocks_1/dropped": 0.0, "moe/blocks_4/dropped": 0.0}


def test_balance_of_records_averages_blocks_and_the_late_window():
  records = [_moe_record(4 * i, (0.1 * i, 0.3 * i), (0.9, 0.95)) for i in range(1, 6)]   # steps 4 ... 20
  b = study_balance.balance_of_records(records, steps=20, window=0.25)   # late: steps > 15, i.e. 16 and 20
  assert b["curve"][0] == pytest.approx((4, 0.2, 0.925))
  assert b["final_max_vio"] == pytest.approx(1.0) and b["final_entropy"] == pytest.approx(0.925)
  assert b["late_max_vio"] == pytest.approx((0.8 + 1.0) / 2)
  # A dense run logs no moe/ metrics: no balance. A window that holds no logged step falls back to the last.
  assert study_balance.balance_of_records([{"kind": "train", "step": 4, "loss": 3.0}], steps=20, window=0.25) is None
  assert study_balance.balance_of_records(records[:2], steps=20, window=0.25)["late_max_vio"] == pytest.approx(0.4)


def test_balance_rows_pair_each_variant_with_bf16_by_seed():
  def run(late_vio):
    return {"late_max_vio": late_vio, "final_max_vio": late_vio + 0.5, "late_entropy": 0.99, "final_entropy": 0.98}
  balance = {("bf16", 0): run(0.2), ("bf16", 1): run(0.4), ("nvfp4", 0): run(0.5), ("nvfp4", 1): run(0.6),
             ("tetrajet2", 0): run(0.1)}
  rows = study_balance.balance_rows(balance, ["bf16", "nvfp4", "tetrajet2"], [0, 1])
  vio = rows["nvfp4"]["late_max_vio"]
  assert vio["per_seed"] == {0: 0.5, 1: 0.6} and vio["mean"] == pytest.approx(0.55)
  assert vio["vs_bf16"] == pytest.approx({0: 0.3, 1: 0.2}) and vio["vs_bf16_mean"] == pytest.approx(0.25)
  assert vio["vs_bf16_std"] == pytest.approx(0.0707107, abs=1e-6)
  one = rows["tetrajet2"]["final_max_vio"]   # one seed: a difference, no spread
  assert one["vs_bf16"] == pytest.approx({0: -0.1}) and one["vs_bf16_std"] != one["vs_bf16_std"]
  text = "\n".join(study_render.render_balance(dict(balance=rows, balance_window=0.25,
                                             variants=["bf16", "nvfp4", "tetrajet2"])))
  assert "| nvfp4 | 0.550 ± 0.071; vs bf16 +0.250 ± 0.071 (+0.300, +0.200) |" in text
  assert "| tetrajet2 | 0.100; vs bf16 -0.100 (-0.100) |" in text
  assert "bf16's late MaxVio 0.300 ± 0.141" in text


def test_run_study_skips_runs_another_process_finished_or_holds(tmp_path, monkeypatch):
  """Two study processes on one runs directory: a run finished meanwhile is not retrained, a locked one skipped."""
  import training
  c = micro_study_config()
  c.study.variants, c.study.seeds = "bf16,nvfp4,mxfp4", (0,)
  runs = str(tmp_path / "runs")
  trained = []

  def fake_train(run, workdir, log):
    variant = run.name.split("/")[1]
    if variant == "bf16":   # meanwhile another process finishes nvfp4 and is training mxfp4
      other = study_records.run_dir(runs, "nvfp4", 0)
      os.makedirs(other)
      with open(os.path.join(other, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
        json.dump({"status": "done"}, f)
    if variant == "mxfp4":
      raise training.WorkdirInUse("in use by another run")
    trained.append(variant)
    return {"status": "done"}

  monkeypatch.setattr(study, "train_one", fake_train)
  monkeypatch.setattr(study, "write_summary", lambda *a: {})
  logs = []
  study.run_study(c, str(tmp_path / "out"), runs_dir=runs, log=logs.append)
  assert trained == ["bf16"]
  assert any("nvfp4 seed 0: finished meanwhile, skipped" in line for line in logs)
  assert any("skipped: in use by another run" in line for line in logs)


def test_kept_records_stand_in_for_a_lost_runs_directory(tmp_path, monkeypatch):
  """The output directory keeps each finished run's records: with the runs directory gone nothing retrains and
  the summary is the same; a summary.json plus its logs seed such records for runs finished before."""
  c = micro_study_config()
  c.study.seeds = (0, 1)
  out, runs = str(tmp_path / "results"), str(tmp_path / "runs")
  loss = {("bf16", 0): 2.5, ("bf16", 1): 2.25, ("nvfp4", 0): 2.625, ("nvfp4", 1): 2.3125}
  trained = []

  def fake_train(run, workdir, log):
    variant, seed = run.name.split("/")[1], run.seed
    trained.append((variant, seed))
    os.makedirs(workdir, exist_ok=True)
    workdir_lib.record_config(workdir, run, step=0, event="start")
    with open(os.path.join(workdir, study_records.METRICS_FILE), "w", encoding="utf-8") as f:
      for step in (2, 4):
        f.write(json.dumps(dict(kind="train", step=step, loss=3.0, **{"moe/blocks_1/max_vio": 0.1 * step + seed,
                                                                     "moe/blocks_1/entropy": 0.9})) + "\n")
        f.write(json.dumps(dict(kind="eval", step=step, loss=loss[(variant, seed)] + 4 - step,
                                bits_per_byte=1.0)) + "\n")
    result = dict(status="done", step=4, validation_loss=loss[(variant, seed)], nonfinite_steps=0,
                  tokens_per_second=100.0 + seed, wall_seconds=10.0)
    with open(os.path.join(workdir, study_records.RESULT_FILE), "w", encoding="utf-8") as f:
      json.dump(result, f)
    return result

  monkeypatch.setattr(study, "train_one", fake_train)
  first = study.run_study(c, out, runs_dir=runs, log=lambda _: None)
  assert sorted(trained) == sorted(loss) and first["runs_done"] == 4
  for v, k in loss:
    kept = study_records.run_dir(os.path.join(out, study_records.KEPT_DIR), v, k)
    assert sorted(os.listdir(kept)) == sorted(study_records.KEPT_FILES)
  shutil.rmtree(runs)
  trained.clear()
  again = study.run_study(c, out, runs_dir=runs, log=lambda _: None)
  assert trained == [] and again["runs_done"] == 4
  assert again["rows"]["nvfp4"]["gap_percent"] == first["rows"]["nvfp4"]["gap_percent"]
  assert again["rows"]["nvfp4"]["gap_curve"] == first["rows"]["nvfp4"]["gap_curve"] != []
  assert again["balance"] == first["balance"]
  assert again["balance"]["nvfp4"]["late_max_vio"]["per_seed"] == {0: 0.4, 1: 1.4}

  # An earlier study's summary.json and log, its runs directory gone: seeded records, no retraining.
  log = tmp_path / "log.txt"
  log.write_text("".join(f"=== [1/4] {v} seed {k} -> runs/{v}/seed{k}\n"
                         f"step 2: validation loss {x + 2:.4f}  1.0 bits/byte\n"
                         f"step 4: validation loss {x:.4f}  1.0 bits/byte\n" for (v, k), x in loss.items()))
  seeded = str(tmp_path / "seeded")
  assert sorted(study_records.seed_kept_records(os.path.join(out, "summary.json"), [str(log)], seeded)) == sorted(loss)
  summary = study.run_study(c, seeded, runs_dir=runs, log=lambda _: None)
  assert trained == [] and summary["runs_done"] == 4
  for v in ("bf16", "nvfp4"):
    assert summary["rows"][v]["gap_percent"] == pytest.approx(first["rows"][v]["gap_percent"], abs=1e-5)
    curve, kept = summary["rows"][v]["gap_curve"], first["rows"][v]["gap_curve"]   # (tokens, gap) pairs
    assert [tokens for tokens, _ in curve] == [tokens for tokens, _ in kept]
    assert [gap for _, gap in curve] == pytest.approx([gap for _, gap in kept], abs=1e-5)
    for key in study_balance.BALANCE_KEYS:
      assert summary["balance"][v][key]["per_seed"] == pytest.approx(first["balance"][v][key]["per_seed"], abs=1e-6)
  assert summary["balance_curve_seeds"] == {"bf16": 0, "nvfp4": 0}   # the summary kept no balance curve
  with open(study_records.run_dir(os.path.join(seeded, study_records.KEPT_DIR), "nvfp4", 1) + "/" + study_records.RESULT_FILE) as f:
    assert "kept_from" in json.load(f)
  log.write_text(log.read_text().replace("2.3125", "2.3000"))
  with pytest.raises(ValueError, match="nvfp4 seed 1: the logs' last evaluation"):
    study_records.seed_kept_records(os.path.join(out, "summary.json"), [str(log)], str(tmp_path / "bad"))
