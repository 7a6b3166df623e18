"""The training pipeline's checkpoint faults: resume, the run record and its fallbacks, corrupt, truncated and
unreadable checkpoints, failed saves and a full disk, and init_from. Each case asserts a specific error (and exit
code) or an exactly specified result; ``CASES`` names every case and its expected verdict, and
``scripts/reliability_training.py`` runs this file (slow cases included) into the table of docs/RELIABILITY.md.

A finished 4-step run with checkpoints 2 and 4 (the ``finished`` fixture, tests/conftest.py) is made once and
copied into each case.
"""
import errno
import glob
import json
import os
import shutil
import subprocess

import flax.linen
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models import LanguageModel
from models.lm import scanned_params
from tools import runs
from training import config as config_lib
from training import errors
from training import report as report_lib
from training import run as run_lib
from training import trainer
from training import workdir as workdir_lib
from training.checkpoint import TMP_SUFFIX
from train_runs import (CLEAR, CORRECT, assert_clear, assert_same_tree, checkpoint_state, copy_run,
                        read_metrics, run_config, shrunken_cli)

# test name -> (case, expected verdict, exit code of train.py or None)
CASES = {
    "test_resume_of_a_finished_run": ("rerun of a finished run: no step, no repeated evaluation", CORRECT, 0),
    "test_metrics_after_a_resume": ("halt + resume: whole-run curve, no 'nan' progress line", CORRECT, 0),
    "test_nonfinite_metrics_are_valid_json": ("NaN/inf metric values in metrics.jsonl", CORRECT, None),
    "test_metrics_line_cut_short": ("metrics.jsonl ends in a half-written line", CORRECT, None),
    "test_corrupt_checkpoint_falls_back_exactly": ("latest checkpoint's array bytes flipped", CORRECT, 0),
    "test_truncated_array_data_falls_back": ("latest checkpoint's array data truncated", CORRECT, 0),
    "test_truncated_metadata_is_not_blamed_on_the_config": ("latest checkpoint's _METADATA truncated", CORRECT, 0),
    "test_truncated_iterator_state_falls_back": ("latest checkpoint's data-iterator JSON truncated", CORRECT, 0),
    "test_missing_state_item_falls_back": ("latest checkpoint's state directory deleted", CORRECT, 0),
    "test_fallback_disabled": ("unreadable latest checkpoint, checkpoint.fallback=False", CLEAR, 5),
    "test_every_checkpoint_unreadable": ("every checkpoint unreadable", CLEAR, 5),
    "test_incompatible_checkpoint": ("resume with another model (allowed change)", CLEAR, 5),
    "test_changed_recipe_is_refused": ("resume with another recipe", CLEAR, 6),
    "test_changed_optimizer_and_data_are_refused": ("resume with another lr and seq_len", CLEAR, 6),
    "test_allowed_config_change_is_recorded": ("resume with --allow_config_change", CORRECT, 0),
    "test_unreadable_config_json_falls_back_to_history": ("config.json truncated, empty, not JSON or not a "
                                                          "config: the last config_history.jsonl entry, a "
                                                          "warning naming the file", CORRECT, None),
    "test_history_line_cut_short_is_skipped": ("config.json unreadable and config_history.jsonl's last line cut "
                                               "short: its last complete entry", CORRECT, None),
    "test_resume_with_unreadable_config_json_trains_on": ("resume with an unreadable config.json: exact, and "
                                                          "the record rewritten", CORRECT, 0),
    "test_unreadable_run_record_is_refused": ("config.json and config_history.jsonl both unreadable: refused "
                                              "with the fix", CLEAR, 6),
    "test_cli_unreadable_run_record": ("train.py resume with {\"broken config.json: --config.recipe=mxfp4 "
                                       "refused; both files broken: refused", CLEAR, 6),
    "test_failed_save_keeps_earlier_checkpoints": ("checkpoint write fails (ENOSPC)", CLEAR, 7),
    "test_full_disk": ("work directory on a full file system (tmpfs; root only)", CLEAR, 7),
    "test_init_from_takes_params_and_starts_fresh": ("config.init_from = a run's work directory", CORRECT, 0),
    "test_init_from_a_per_block_run_into_a_scanned_model": ("config.init_from = a per-block run, scan_blocks=True",
                                                            CORRECT, 0),
    "test_init_from_bad_sources": ("config.init_from: missing / other model", CLEAR, 5),
    "test_init_from_an_imported_run": ("config.init_from = a run written by tools.runs.write_run (importers)",
                                       CORRECT, 0),
    "test_failed_sync_save_names_its_step": ("checkpoint write fails, async_save=False: the failed step, the "
                                             "checkpoints on disk", CLEAR, 7),
}


def _largest_array_file(workdir, step):
  files = glob.glob(os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0", "d", "*"))
  return max(files, key=os.path.getsize)


def _resume_falls_back(workdir, capsys, reason):
  summary = trainer.train_and_evaluate(run_config(steps=6), workdir)
  out = capsys.readouterr().out
  assert f"checkpoints/4 is {reason}" in out and "falling back to checkpoint 2" in out, out
  assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("checkpoints/2"), out
  assert os.path.isdir(os.path.join(workdir, run_lib.UNREADABLE_DIR, "4"))  # kept, not deleted
  assert (summary["status"], summary["step"], summary["steps_run"]) == ("done", 6, 4)
  return out


# ------------------------------------------------------------------------------ resume and the records

def test_resume_of_a_finished_run(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  config = run_config(steps=2, **{"eval.batches": 1})
  first = trainer.train_and_evaluate(config, workdir)
  capsys.readouterr()
  again = trainer.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert "nothing to do" in out and "nan" not in out, out
  assert again["steps_run"] == 0 and again["train_loss"] == first["train_loss"]
  assert again["validation_loss"] == first["validation_loss"]
  evals = [r["step"] for r in read_metrics(workdir) if r["kind"] == "eval"]
  assert evals == [2]


@pytest.mark.slow
def test_metrics_after_a_resume(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(run_config(steps=4, halt_after=2, **{"eval.batches": 1, "eval.every_steps": 1}), workdir)
  capsys.readouterr()
  trainer.train_and_evaluate(run_config(steps=4, **{"eval.batches": 1, "eval.every_steps": 1}), workdir)
  out = capsys.readouterr().out
  assert "nan" not in out.lower(), out
  records = read_metrics(workdir)
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
  assert [r["step"] for r in records if r["kind"] == "eval"] == [1, 2, 3, 4]  # each once
  reporter = report_lib.Reporter(workdir, total_steps=4, tokens_per_step=1, log_every=1)
  assert [s for s, _ in reporter.train_curve] == [1, 2, 3, 4]  # the curve of loss.png: both starts
  reporter.close()
  history = [json.loads(l) for l in open(os.path.join(workdir, workdir_lib.HISTORY_FILE), encoding="utf-8")]
  assert [(h["event"], h["step"]) for h in history] == [("start", 0), ("resume", 2)]
  assert history[1]["changes"] == {"halt_after": [2, 0]}


def test_nonfinite_metrics_are_valid_json(tmp_path):
  reporter = report_lib.Reporter(str(tmp_path), total_steps=2, tokens_per_step=8, log_every=1)
  nan, inf = float("nan"), float("inf")
  reporter.train_step(1, dict(loss=nan, grad_norm=inf, lr=0.1, nonfinite_total=1, nonfinite_streak=1), recipe="bf16")
  reporter.evaluation(1, nan, None)
  reporter.close()
  train, evaluation = read_metrics(str(tmp_path))
  assert (train["loss"], train["last_loss"], train["grad_norm"], train["tokens_per_second"]) == (None,) * 4
  assert train["lr"] == 0.1 and evaluation["loss"] is None


def test_metrics_line_cut_short(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.write('{"kind": "train", "step": 1, "loss": 5.0, "last_loss": 5.0}\n{"kind": "train", "st')
  reporter = report_lib.Reporter(str(tmp_path), total_steps=2, tokens_per_step=8, log_every=1)
  assert reporter.train_curve == [(1, 5.0)] and reporter.last_train_loss == 5.0
  assert reporter.close().endswith("loss.png")


# ------------------------------------------------------------------------------------ checkpoint faults

def test_corrupt_checkpoint_falls_back_exactly(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  path = _largest_array_file(workdir, 4)
  data = bytearray(open(path, "rb").read())
  for i in range(len(data) // 3, len(data) // 3 + 64):
    data[i] ^= 0x5A
  open(path, "wb").write(bytes(data))
  _resume_falls_back(workdir, capsys, "corrupt")
  assert_same_tree(checkpoint_state(workdir, 6), checkpoint_state(finished[1], 6))  # the steps after 2 redone, bit for bit


def test_truncated_array_data_falls_back(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  path = _largest_array_file(workdir, 4)
  os.truncate(path, os.path.getsize(path) // 2)
  _resume_falls_back(workdir, capsys, "truncated")


def test_truncated_metadata_is_not_blamed_on_the_config(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  path = os.path.join(workdir, "checkpoints", "4", "state", "_METADATA")
  os.truncate(path, os.path.getsize(path) // 2)
  out = _resume_falls_back(workdir, capsys, "truncated")
  assert "another model" not in out and "incompatible" not in out


def test_truncated_iterator_state_falls_back(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  path = os.path.join(workdir, "checkpoints", "4", "data", "metadata")
  os.truncate(path, os.path.getsize(path) // 2)
  _resume_falls_back(workdir, capsys, "truncated")


def test_missing_state_item_falls_back(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4", "state"))
  _resume_falls_back(workdir, capsys, "truncated")


def test_fallback_disabled(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  os.truncate(_largest_array_file(workdir, 4), 10)
  with pytest.raises(errors.CheckpointError, match=r"checkpoints/4 is truncated.*fallback is False") as info:
    trainer.train_and_evaluate(run_config(steps=6, **{"checkpoint.fallback": False}), workdir)
  assert info.value.exit_code == 5
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]  # nothing moved


def test_every_checkpoint_unreadable(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  for step in (2, 4):
    os.truncate(_largest_array_file(workdir, step), 10)
  with pytest.raises(errors.CheckpointError, match=r"none of the checkpoints \[2, 4\]"):
    trainer.train_and_evaluate(run_config(steps=6), workdir)


def test_incompatible_checkpoint(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  config = run_config(steps=6, allow_config_change=True, **{"model.d_model": 48})
  with pytest.raises(errors.CheckpointError, match="incompatible with this config") as info:
    trainer.train_and_evaluate(config, workdir)
  assert "differ in shape" in str(info.value) and "truncated" not in str(info.value)


def test_changed_recipe_is_refused(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'nvfp4'") as info:
    trainer.train_and_evaluate(run_config(steps=6, recipe="nvfp4"), workdir)
  assert info.value.exit_code == 6 and "--allow_config_change" in str(info.value)


def test_changed_optimizer_and_data_are_refused(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  with pytest.raises(errors.ConfigChangedError) as info:
    trainer.train_and_evaluate(run_config(steps=6, **{"optim.lr": 1e-2, "data.seq_len": 16}), workdir)
  assert "optim.lr: 0.003 -> 0.01" in str(info.value) and "data.seq_len: 32 -> 16" in str(info.value)
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    assert json.load(f)["optim"]["lr"] == 0.003  # the refused config was not recorded


def test_allowed_config_change_is_recorded(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  summary = trainer.train_and_evaluate(run_config(steps=6, allow_config_change=True, **{"optim.lr": 1e-3}), workdir)
  assert (summary["status"], summary["step"]) == ("done", 6)
  assert "optim.lr: 0.003 -> 0.001" in capsys.readouterr().out
  history = [json.loads(l) for l in open(os.path.join(workdir, workdir_lib.HISTORY_FILE), encoding="utf-8")]
  assert history[-1]["changes"]["optim.lr"] == [0.003, 0.001] and history[-1]["step"] == 4
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    assert json.load(f)["optim"]["lr"] == 0.001


# A corrupt run record: config.json unreadable falls back to config_history.jsonl; both: refused.
CORRUPT_RECORDS = {"truncated": '{"broken', "empty": "", "not JSON": "\x00\x01garbage", "not a config": "[1, 2]"}


def _corrupt(workdir, name, text):
  with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
    f.write(text)


@pytest.mark.parametrize("kind", sorted(CORRUPT_RECORDS))
def test_unreadable_config_json_falls_back_to_history(finished, tmp_path, kind):
  workdir = copy_run(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS[kind])
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'mxfp4'"):   # the guard still holds
    workdir_lib.check_resume(workdir, run_config(steps=6, recipe="mxfp4"), 4)
  resume = workdir_lib.check_resume(workdir, run_config(steps=6), 4)
  assert resume.changes == {"halt_after": (4, 0)}   # the recorded start halted after step 4
  [warning] = resume.messages
  assert warning.startswith(f"warning: {os.path.join(workdir, workdir_lib.CONFIG_FILE)} cannot be read ("), warning
  assert f"taken from {os.path.join(workdir, workdir_lib.HISTORY_FILE)}, line 1" in warning, warning


def test_history_line_cut_short_is_skipped(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, "")
  with open(os.path.join(workdir, workdir_lib.HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write('{"time": "2026-12-01T00:00:00+00:00", "event": "resume", "config": {"reci')   # a crash mid-append
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'mxfp4'"):
    workdir_lib.check_resume(workdir, run_config(steps=6, recipe="mxfp4"), 4)
  assert "line 1 instead" in workdir_lib.check_resume(workdir, run_config(steps=6), 4).messages[0]


def test_resume_with_unreadable_config_json_trains_on(finished, tmp_path, capsys):
  workdir = copy_run(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS["truncated"])
  summary = trainer.train_and_evaluate(run_config(steps=6), workdir)
  out = capsys.readouterr().out
  assert f"{workdir_lib.CONFIG_FILE} cannot be read" in out and "instead" in out, out
  assert (summary["status"], summary["step"]) == ("done", 6)
  assert_same_tree(checkpoint_state(workdir, 6), checkpoint_state(finished[1], 6))   # resumed exactly
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    assert json.load(f)["recipe"] == "bf16"   # the record is whole again


@pytest.mark.parametrize("kind", sorted(CORRUPT_RECORDS))
def test_unreadable_run_record_is_refused(finished, tmp_path, kind):
  workdir = copy_run(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS[kind])
  _corrupt(workdir, workdir_lib.HISTORY_FILE, CORRUPT_RECORDS[kind])
  with pytest.raises(errors.RunRecordUnreadable) as info:
    workdir_lib.check_resume(workdir, run_config(steps=6), 4)
  message = str(info.value)
  assert info.value.exit_code == 6
  for phrase in (workdir_lib.CONFIG_FILE, workdir_lib.HISTORY_FILE, "at step 4", "--allow_config_change",
                 "a new --workdir"):
    assert phrase in message, message
  allowed = run_config(steps=6, allow_config_change=True)
  [warning] = workdir_lib.check_resume(workdir, allowed, 4).messages
  assert "without checking the config (allowed by allow_config_change)" in warning, warning
  assert workdir_lib.check_resume(workdir, run_config(steps=6), None).step is None   # a fresh start needs no record


@pytest.mark.slow   # ~6 s idle; the run-record fallbacks are tested in-process above
def test_cli_unreadable_run_record(finished, tmp_path):
  workdir = copy_run(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS["truncated"])
  assert_clear(shrunken_cli(workdir, "--config.recipe=mxfp4", steps=6), 6, "recipe: 'bf16' -> 'mxfp4'")
  _corrupt(workdir, workdir_lib.HISTORY_FILE, CORRUPT_RECORDS["truncated"])
  assert_clear(shrunken_cli(workdir, steps=6), 6, "config record cannot be read", "--allow_config_change")


def _disk_full_at_step(monkeypatch, step):
  """Makes the checkpoint save of ``step`` fail as a full disk does (ENOSPC); other saves go through."""
  real_save = ocp.JsonCheckpointHandler._save_fn  # pylint: disable=protected-access

  def disk_full(self, item, directory):
    if item.get("step") == step:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(self, item, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)


def test_failed_save_keeps_earlier_checkpoints(finished, tmp_path, monkeypatch):
  workdir = copy_run(finished, tmp_path)
  _disk_full_at_step(monkeypatch, 6)
  with pytest.raises(errors.StorageError, match="writing checkpoint 6 .* No space left on device") as info:
    trainer.train_and_evaluate(run_config(steps=6), workdir)
  assert info.value.exit_code == 7 and "The checkpoints on disk, [2, 4], are intact" in str(info.value)
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  assert sorted(names) == ["2", "4"] and not any(TMP_SUFFIX in n for n in names)
  assert_same_tree(checkpoint_state(workdir, 4), checkpoint_state(finished[0], 4))  # the one a rerun resumes from, intact


@pytest.mark.slow  # ~30 s: 50 steps until a 1 MiB file system is full
def test_full_disk(tmp_path):
  """A real full file system: a 1 MiB tmpfs (needs root; skipped elsewhere)."""
  mount = tmp_path / "small"
  os.makedirs(mount)
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                         capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    result = shrunken_cli(mount / "w", "--config.checkpoint.every_steps=1", "--config.eval.batches=0", steps=50)
    assert_clear(result, 7, "No space left on device")
    steps = sorted(int(s) for s in os.listdir(mount / "w" / "checkpoints") if s.isdigit())
    assert steps and not any(TMP_SUFFIX in n for n in os.listdir(mount / "w" / "checkpoints"))
    for step in steps:  # every checkpoint left behind reads back
      checkpoint_state(str(mount / "w"), step)
    message = [l for l in result.stderr.splitlines() if l.startswith("error: ")][0]
    assert f"The checkpoints on disk, {steps}, are intact" in message and f"from step {steps[-1]}" in message
    assert f"writing checkpoint {steps[-1] + 1} " in message, message
    with open(mount / "w" / "error.log", encoding="utf-8") as f:
      log = f.read()
    assert "RuntimeError: Event loop is closed" not in log
  finally:
    subprocess.run(["umount", str(mount)], check=False)


# ------------------------------------------------------------------------------------------- init_from

def _first_state(config, workdir):
  run = run_lib.setup(config, workdir, model_fn=trainer.build_model)
  try:
    state, step = run_lib.init_or_restore(run)
    return jax.tree.map(np.asarray, state), step
  finally:
    run.close()


@pytest.mark.slow
def test_init_from_takes_params_and_starts_fresh(finished, tmp_path):
  source = finished[0]
  config = run_config(steps=2, init_from=source, **{"optim.lr": 1e-3})
  state, step = _first_state(config, str(tmp_path / "new"))
  assert step == 0 and int(state["step"]) == 0 and int(state["nonfinite_total"]) == 0
  assert_same_tree(state["params"], checkpoint_state(source, 4)["params"])
  assert all(not x.any() for x in jax.tree.leaves(state["opt_state"]))  # fresh moments and counts
  summary = trainer.train_and_evaluate(config, str(tmp_path / "trained"))
  assert (summary["status"], summary["step"]) == ("done", 2)


def test_init_from_an_imported_run(tmp_path):
  config = run_config(steps=2)
  model_config = config_lib.resolve_model_config(config.model)
  params = jax.jit(LanguageModel(model_config).init)(jax.random.key(7), np.zeros((1, 8), np.int32))["params"]
  imported = str(tmp_path / "imported")
  runs.write_run(imported, runs.training_config(model_config, base=config), params)
  state, _ = _first_state(run_config(steps=2, init_from=imported), str(tmp_path / "new"))
  assert_same_tree(state["params"], jax.tree.map(np.asarray, flax.linen.unbox(params)))
  summary = trainer.train_and_evaluate(run_config(steps=2, init_from=imported), str(tmp_path / "trained"))
  assert (summary["status"], summary["step"]) == ("done", 2)


@pytest.mark.slow   # ~7 s idle, two training runs
def test_init_from_a_per_block_run_into_a_scanned_model(tmp_path):
  """An imported (per-block) checkpoint initializes a scan_blocks=True run: the blocks are stacked on restore."""
  layout = {"model.pattern": "M*-M*-M*-"}
  config = run_config(steps=2, **layout)
  model_config = config_lib.resolve_model_config(config.model)
  params = jax.jit(LanguageModel(model_config).init)(jax.random.key(7), np.zeros((1, 8), np.int32))["params"]
  imported = str(tmp_path / "imported")
  runs.write_run(imported, runs.training_config(model_config, base=config), params)
  scanned = run_config(steps=2, init_from=imported, **layout, **{"model.scan_blocks": True})
  state, _ = _first_state(scanned, str(tmp_path / "new"))
  expected = scanned_params(jax.tree.map(np.asarray, flax.linen.unbox(params)), model_config)
  assert set(expected) != set(flax.linen.unbox(params))   # the layouts differ: a group was stacked
  assert_same_tree(state["params"], expected)


def test_init_from_bad_sources(finished, tmp_path):
  with pytest.raises(errors.CheckpointError, match="no checkpoints directory"):
    trainer.train_and_evaluate(run_config(init_from=str(tmp_path / "nowhere")), str(tmp_path / "a"))
  with pytest.raises(errors.CheckpointError, match="incompatible with this config"):
    trainer.train_and_evaluate(run_config(init_from=finished[0], **{"model.d_model": 48}), str(tmp_path / "b"))


def test_failed_sync_save_names_its_step(finished, tmp_path, monkeypatch):
  workdir = copy_run(finished, tmp_path)
  _disk_full_at_step(monkeypatch, 6)
  with pytest.raises(errors.StorageError) as info:
    trainer.train_and_evaluate(run_config(steps=6, **{"checkpoint.async_save": False}), workdir)
  message = str(info.value)
  assert "writing checkpoint 6 " in message and "The checkpoints on disk, [2, 4], are intact" in message, message
  assert "resume from step 4." in message
