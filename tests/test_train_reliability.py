"""The training pipeline's bad-input and fault matrix: each case asserts a specific error (and exit code) or an
exactly specified result. ``CASES`` names every case and its expected verdict; ``scripts/reliability_training.py``
runs this file (slow cases included) and writes the table of docs/RELIABILITY.md from it.

Runs are the shrunken config (a few steps, the shared compilation cache); a finished 4-step run with
checkpoints 2 and 4 is made once and copied into each checkpoint-fault case.
"""
import errno
import glob
import json
import os
import shutil
import subprocess
import sys

import flax.linen
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import shrunken
from models import LanguageModel
from models.lm import scanned_params
from tools import runs
from training import config as config_lib
from training import errors
from training import report as report_lib
from training import run as run_lib
from training import sharding
from training import trainer
from training import workdir as workdir_lib
from training.checkpoint import Checkpoints, TMP_SUFFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)

CLEAR = "clear error"
CORRECT = "correct result"
# test name -> (case, expected verdict, exit code of train.py or None)
CASES = {
    "test_cli_config_file_missing": ("--config names a file that does not exist", CLEAR, 2),
    "test_cli_config_file_syntax_error": ("--config file does not parse", CLEAR, 2),
    "test_cli_config_file_raises": ("--config file's get_config() raises", CLEAR, 2),
    "test_cli_config_file_not_a_config": ("--config file returns something else", CLEAR, 2),
    "test_cli_bad_override_value": ("--config.steps=abc", CLEAR, 2),
    "test_cli_unknown_override": ("--config.model.d_modl=64 (typo)", CLEAR, 2),
    "test_cli_workdir_is_a_file": ("--workdir is a file", CLEAR, 4),
    "test_cli_workdir_not_writable": ("--workdir on a read-only file system", CLEAR, 4),
    "test_cli_data_missing": ("config.data.sources names a missing file", CLEAR, 3),
    "test_cli_distributed_bad_process_id": ("--process_id >= --num_processes", CLEAR, 8),
    "test_cli_distributed_no_coordinator": ("no coordinator at --coordinator_address", CLEAR, 8),
    "test_cli_diverged": ("learning rate 1e30: every step non-finite", CLEAR, 9),
    "test_cli_debug_shows_the_traceback": ("--debug: the traceback on stderr, and error.log", CORRECT, 3),
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
    # operations
    "test_second_run_on_a_held_workdir": ("a second run on a work directory another process holds", CLEAR, 4),
    "test_killed_holder_lock_is_taken_over": ("the lock of a run killed with kill -9: taken over, reason printed",
                                              CORRECT, 0),
    "test_lock_of_another_host": ("lock file of another host: fresh heartbeat refused, stale one taken over",
                                  CORRECT, None),
    "test_sigint_during_setup": ("first Ctrl-C during set-up: says so, exits at once", CLEAR, 130),
    "test_sigterm_during_compile": ("SIGTERM during the first compile: says so within 1 s, exits at once", CLEAR,
                                    143),
    "test_sigterm_in_steady_state": ("SIGTERM in steady state: saves after the step, exits 143, resumes exactly",
                                     CORRECT, 143),
    "test_sigterm_save_does_not_fit_the_grace": ("SIGTERM when the save cannot finish in preemption_grace_s: "
                                                 "skipped, says so", CLEAR, 143),
    "test_failed_sync_save_names_its_step": ("checkpoint write fails, async_save=False: the failed step, the "
                                             "checkpoints on disk", CLEAR, 7),
    "test_extend_before_the_decay": ("larger config.steps before the WSD decay: extension, stable phase "
                                     "stretched, lr checked", CORRECT, 0),
    "test_extend_after_the_decay_started": ("larger config.steps after the decay started: refused (lr would "
                                            "jump); allowed with the jump printed", CLEAR, 6),
    "test_shorten_a_run": ("smaller config.steps: the decay re-planned when not started, else refused", CORRECT,
                           None),
    "test_startup_phases_and_timestamps": ("start-up phases with times; timestamps; console loss = metrics mean",
                                           CORRECT, 0),
    "test_error_log_of_an_unusable_workdir": ("work directory unusable, twice: one fp4jax_error.log in the temp "
                                              "directory, not one file per failure", CLEAR, 4),
    "test_tiny_docstring_states_its_parameter_count": ("configs/tiny.py's docstring: its true parameter count",
                                                       CORRECT, None),
    "test_entry_points_from_another_directory": ("fp4jax-train/-sample/-hf targets, --help from another "
                                                 "directory", CORRECT, 0),
}


# ------------------------------------------------------------------------------------------- helpers

def _config(steps=4, **overrides):
  return shrunken.shrunken_config(steps=steps, **{"eval.batches": 0, "checkpoint.every_steps": 2, **overrides})


def _train_cli(workdir, *args, timeout=300):
  command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
             f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}", *args]
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _shrunken_cli(workdir, *args, steps=4):
  return _train_cli(workdir, "--config=configs/shrunken.py", f"--config.steps={steps}", *args)


def _assert_clear(result, exit_code, *phrases):
  assert result.returncode == exit_code, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
  message = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(message) == 1, result.stderr[-3000:]
  for phrase in phrases:
    assert phrase in message[0], message[0]
  return message[0]


def _records(workdir):
  """metrics.jsonl, parsed strictly (no NaN/Infinity tokens)."""
  def reject(token):
    raise AssertionError(f"not JSON: {token}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def _state(workdir, step):
  with ocp.StandardCheckpointer() as checkpointer:
    return jax.tree.map(np.asarray, checkpointer.restore(os.path.join(workdir, "checkpoints", str(step), "state")))


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A 4-step run with checkpoints 2 and 4, and a 6-step run straight through (the exact reference)."""
  base = tmp_path_factory.mktemp("finished")
  four, six = str(base / "four"), str(base / "six")
  trainer.train_and_evaluate(_config(steps=6, halt_after=4), four)
  trainer.train_and_evaluate(_config(steps=6), six)
  return four, six


def _copy(finished, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished[0], workdir)
  return workdir


def _largest_array_file(workdir, step):
  files = glob.glob(os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0", "d", "*"))
  return max(files, key=os.path.getsize)


def _resume_falls_back(workdir, capsys, reason):
  summary = trainer.train_and_evaluate(_config(steps=6), workdir)
  out = capsys.readouterr().out
  assert f"checkpoints/4 is {reason}" in out and "falling back to checkpoint 2" in out, out
  assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("checkpoints/2"), out
  assert os.path.isdir(os.path.join(workdir, run_lib.UNREADABLE_DIR, "4"))  # kept, not deleted
  assert (summary["status"], summary["step"], summary["steps_run"]) == ("done", 6, 4)
  return out


# ---------------------------------------------------------------------------------------- command line

def test_cli_config_file_missing(tmp_path):
  _assert_clear(_train_cli(tmp_path / "w", f"--config={tmp_path / 'nope.py'}"), 2, "nope.py", "no such file")


def test_cli_config_file_syntax_error(tmp_path):
  (tmp_path / "bad.py").write_text("def get_config(:\n")
  _assert_clear(_train_cli(tmp_path / "w", f"--config={tmp_path / 'bad.py'}"), 2, "SyntaxError at line 1")


def test_cli_config_file_raises(tmp_path):
  (tmp_path / "raises.py").write_text("def get_config():\n  raise RuntimeError('no such cluster')\n")
  _assert_clear(_train_cli(tmp_path / "w", f"--config={tmp_path / 'raises.py'}"), 2, "no such cluster")


def test_cli_config_file_not_a_config(tmp_path):
  (tmp_path / "three.py").write_text("def get_config():\n  return 3\n")
  _assert_clear(_train_cli(tmp_path / "w", f"--config={tmp_path / 'three.py'}"), 2, "did not return a training config")


def test_cli_bad_override_value(tmp_path):
  _assert_clear(_shrunken_cli(tmp_path / "w", "--config.batch_size=abc"), 2, "batch_size")


def test_cli_unknown_override(tmp_path):
  _assert_clear(_shrunken_cli(tmp_path / "w", "--config.model.d_modl=64"), 2, "unknown config field", "d_model")


def test_cli_workdir_is_a_file(tmp_path):
  (tmp_path / "afile").write_text("")
  _assert_clear(_shrunken_cli(tmp_path / "afile"), 4, "is a file")


def test_cli_workdir_not_writable(tmp_path):
  _assert_clear(_shrunken_cli("/proc/fp4jax_run"), 4, "cannot be written")


def test_cli_data_missing(tmp_path):
  _assert_clear(_shrunken_cli(tmp_path / "w", f"--config.data.sources={tmp_path / 'none.txt'}"), 3,
                "none.txt", "does not exist")


@pytest.mark.slow   # CLI subprocesses (~10 s each): test_cli_distributed_no_coordinator runs by default
def test_cli_distributed_bad_process_id(tmp_path):
  _assert_clear(_shrunken_cli(tmp_path / "w", "--num_processes=2", "--process_id=5",
                              "--coordinator_address=127.0.0.1:1"), 8, "multi-process set-up failed")


def test_cli_distributed_no_coordinator(tmp_path):
  _assert_clear(_shrunken_cli(tmp_path / "w", "--num_processes=2", "--process_id=1",
                              "--coordinator_address=127.0.0.1:9", "--distributed_timeout=2"), 8,
                "no coordinator answered")


@pytest.mark.slow  # ~35 s on 2 loaded cores (the in-process divergence test is in test_train_loop.py)
def test_cli_diverged(tmp_path):
  result = _shrunken_cli(tmp_path / "w", "--config.optim.lr=1e30", "--config.optim.warmup_steps=0",
                         "--config.health.max_nonfinite_streak=2", "--config.eval.batches=0", steps=20)
  _assert_clear(result, 9, "training diverged", "config.optim.lr")
  assert os.path.exists(tmp_path / "w" / "error.log")


@pytest.mark.slow
def test_cli_debug_shows_the_traceback(tmp_path):
  workdir = tmp_path / "w"
  os.makedirs(workdir)
  result = _shrunken_cli(workdir, f"--config.data.sources={tmp_path / 'none.txt'}", "--debug")
  assert result.returncode == 3 and "Traceback" in result.stderr and "DataError" in result.stderr
  log = (workdir / "error.log").read_text()
  assert "Traceback" in log and "none.txt" in log


# ------------------------------------------------------------------------------ resume and the records

def test_resume_of_a_finished_run(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  config = _config(steps=2, **{"eval.batches": 1})
  first = trainer.train_and_evaluate(config, workdir)
  capsys.readouterr()
  again = trainer.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert "nothing to do" in out and "nan" not in out, out
  assert again["steps_run"] == 0 and again["train_loss"] == first["train_loss"]
  assert again["validation_loss"] == first["validation_loss"]
  evals = [r["step"] for r in _records(workdir) if r["kind"] == "eval"]
  assert evals == [2]


@pytest.mark.slow
def test_metrics_after_a_resume(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(_config(steps=4, halt_after=2, **{"eval.batches": 1, "eval.every_steps": 1}), workdir)
  capsys.readouterr()
  trainer.train_and_evaluate(_config(steps=4, **{"eval.batches": 1, "eval.every_steps": 1}), workdir)
  out = capsys.readouterr().out
  assert "nan" not in out.lower(), out
  records = _records(workdir)
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
  train, evaluation = _records(str(tmp_path))
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
  workdir = _copy(finished, tmp_path)
  path = _largest_array_file(workdir, 4)
  data = bytearray(open(path, "rb").read())
  for i in range(len(data) // 3, len(data) // 3 + 64):
    data[i] ^= 0x5A
  open(path, "wb").write(bytes(data))
  _resume_falls_back(workdir, capsys, "corrupt")
  _assert_same(_state(workdir, 6), _state(finished[1], 6))  # the steps after 2 redone, bit for bit


def test_truncated_array_data_falls_back(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  path = _largest_array_file(workdir, 4)
  os.truncate(path, os.path.getsize(path) // 2)
  _resume_falls_back(workdir, capsys, "truncated")


def test_truncated_metadata_is_not_blamed_on_the_config(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  path = os.path.join(workdir, "checkpoints", "4", "state", "_METADATA")
  os.truncate(path, os.path.getsize(path) // 2)
  out = _resume_falls_back(workdir, capsys, "truncated")
  assert "another model" not in out and "incompatible" not in out


def test_truncated_iterator_state_falls_back(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  path = os.path.join(workdir, "checkpoints", "4", "data", "metadata")
  os.truncate(path, os.path.getsize(path) // 2)
  _resume_falls_back(workdir, capsys, "truncated")


def test_missing_state_item_falls_back(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4", "state"))
  _resume_falls_back(workdir, capsys, "truncated")


def test_fallback_disabled(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  os.truncate(_largest_array_file(workdir, 4), 10)
  with pytest.raises(errors.CheckpointError, match=r"checkpoints/4 is truncated.*fallback is False") as info:
    trainer.train_and_evaluate(_config(steps=6, **{"checkpoint.fallback": False}), workdir)
  assert info.value.exit_code == 5
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]  # nothing moved


def test_every_checkpoint_unreadable(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  for step in (2, 4):
    os.truncate(_largest_array_file(workdir, step), 10)
  with pytest.raises(errors.CheckpointError, match=r"none of the checkpoints \[2, 4\]"):
    trainer.train_and_evaluate(_config(steps=6), workdir)


def test_incompatible_checkpoint(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  config = _config(steps=6, allow_config_change=True, **{"model.d_model": 48})
  with pytest.raises(errors.CheckpointError, match="incompatible with this config") as info:
    trainer.train_and_evaluate(config, workdir)
  assert "differ in shape" in str(info.value) and "truncated" not in str(info.value)


def test_changed_recipe_is_refused(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'nvfp4'") as info:
    trainer.train_and_evaluate(_config(steps=6, recipe="nvfp4"), workdir)
  assert info.value.exit_code == 6 and "--allow_config_change" in str(info.value)


def test_changed_optimizer_and_data_are_refused(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  with pytest.raises(errors.ConfigChangedError) as info:
    trainer.train_and_evaluate(_config(steps=6, **{"optim.lr": 1e-2, "data.seq_len": 16}), workdir)
  assert "optim.lr: 0.003 -> 0.01" in str(info.value) and "data.seq_len: 32 -> 16" in str(info.value)
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    assert json.load(f)["optim"]["lr"] == 0.003  # the refused config was not recorded


def test_allowed_config_change_is_recorded(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  summary = trainer.train_and_evaluate(_config(steps=6, allow_config_change=True, **{"optim.lr": 1e-3}), workdir)
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
  workdir = _copy(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS[kind])
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'mxfp4'"):   # the guard still holds
    workdir_lib.check_resume(workdir, _config(steps=6, recipe="mxfp4"), 4)
  resume = workdir_lib.check_resume(workdir, _config(steps=6), 4)
  assert resume.changes == {"halt_after": (4, 0)}   # the recorded start halted after step 4
  [warning] = resume.messages
  assert warning.startswith(f"warning: {os.path.join(workdir, workdir_lib.CONFIG_FILE)} cannot be read ("), warning
  assert f"taken from {os.path.join(workdir, workdir_lib.HISTORY_FILE)}, line 1" in warning, warning


def test_history_line_cut_short_is_skipped(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, "")
  with open(os.path.join(workdir, workdir_lib.HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write('{"time": "2026-12-01T00:00:00+00:00", "event": "resume", "config": {"reci')   # a crash mid-append
  with pytest.raises(errors.ConfigChangedError, match=r"recipe: 'bf16' -> 'mxfp4'"):
    workdir_lib.check_resume(workdir, _config(steps=6, recipe="mxfp4"), 4)
  assert "line 1 instead" in workdir_lib.check_resume(workdir, _config(steps=6), 4).messages[0]


def test_resume_with_unreadable_config_json_trains_on(finished, tmp_path, capsys):
  workdir = _copy(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS["truncated"])
  summary = trainer.train_and_evaluate(_config(steps=6), workdir)
  out = capsys.readouterr().out
  assert f"{workdir_lib.CONFIG_FILE} cannot be read" in out and "instead" in out, out
  assert (summary["status"], summary["step"]) == ("done", 6)
  _assert_same(_state(workdir, 6), _state(finished[1], 6))   # resumed exactly
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
    assert json.load(f)["recipe"] == "bf16"   # the record is whole again


@pytest.mark.parametrize("kind", sorted(CORRUPT_RECORDS))
def test_unreadable_run_record_is_refused(finished, tmp_path, kind):
  workdir = _copy(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS[kind])
  _corrupt(workdir, workdir_lib.HISTORY_FILE, CORRUPT_RECORDS[kind])
  with pytest.raises(errors.RunRecordUnreadable) as info:
    workdir_lib.check_resume(workdir, _config(steps=6), 4)
  message = str(info.value)
  assert info.value.exit_code == 6
  for phrase in (workdir_lib.CONFIG_FILE, workdir_lib.HISTORY_FILE, "at step 4", "--allow_config_change",
                 "a new --workdir"):
    assert phrase in message, message
  allowed = _config(steps=6, allow_config_change=True)
  [warning] = workdir_lib.check_resume(workdir, allowed, 4).messages
  assert "without checking the config (allowed by allow_config_change)" in warning, warning
  assert workdir_lib.check_resume(workdir, _config(steps=6), None).step is None   # a fresh start needs no record


@pytest.mark.slow   # ~6 s idle; the run-record fallbacks are tested in-process above
def test_cli_unreadable_run_record(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  _corrupt(workdir, workdir_lib.CONFIG_FILE, CORRUPT_RECORDS["truncated"])
  _assert_clear(_shrunken_cli(workdir, "--config.recipe=mxfp4", steps=6), 6, "recipe: 'bf16' -> 'mxfp4'")
  _corrupt(workdir, workdir_lib.HISTORY_FILE, CORRUPT_RECORDS["truncated"])
  _assert_clear(_shrunken_cli(workdir, steps=6), 6, "config record cannot be read", "--allow_config_change")


def _disk_full_at_step(monkeypatch, step):
  """Makes the checkpoint save of ``step`` fail as a full disk does (ENOSPC); other saves go through."""
  real_save = ocp.JsonCheckpointHandler._save_fn  # pylint: disable=protected-access

  def disk_full(self, item, directory):
    if item.get("step") == step:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(self, item, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)


def test_failed_save_keeps_earlier_checkpoints(finished, tmp_path, monkeypatch):
  workdir = _copy(finished, tmp_path)
  _disk_full_at_step(monkeypatch, 6)
  with pytest.raises(errors.StorageError, match="writing checkpoint 6 .* No space left on device") as info:
    trainer.train_and_evaluate(_config(steps=6), workdir)
  assert info.value.exit_code == 7 and "The checkpoints on disk, [2, 4], are intact" in str(info.value)
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  assert sorted(names) == ["2", "4"] and not any(TMP_SUFFIX in n for n in names)
  _assert_same(_state(workdir, 4), _state(finished[0], 4))  # the one a rerun resumes from, intact


@pytest.mark.slow  # ~30 s: 50 steps until a 1 MiB file system is full
def test_full_disk(tmp_path):
  """A real full file system: a 1 MiB tmpfs (needs root; skipped elsewhere)."""
  mount = tmp_path / "small"
  os.makedirs(mount)
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                         capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    result = _shrunken_cli(mount / "w", "--config.checkpoint.every_steps=1", "--config.eval.batches=0", steps=50)
    _assert_clear(result, 7, "No space left on device")
    steps = sorted(int(s) for s in os.listdir(mount / "w" / "checkpoints") if s.isdigit())
    assert steps and not any(TMP_SUFFIX in n for n in os.listdir(mount / "w" / "checkpoints"))
    for step in steps:  # every checkpoint left behind reads back
      _state(str(mount / "w"), step)
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
  config = _config(steps=2, init_from=source, **{"optim.lr": 1e-3})
  state, step = _first_state(config, str(tmp_path / "new"))
  assert step == 0 and int(state["step"]) == 0 and int(state["nonfinite_total"]) == 0
  _assert_same(state["params"], _state(source, 4)["params"])
  assert all(not x.any() for x in jax.tree.leaves(state["opt_state"]))  # fresh moments and counts
  summary = trainer.train_and_evaluate(config, str(tmp_path / "trained"))
  assert (summary["status"], summary["step"]) == ("done", 2)


def test_init_from_an_imported_run(tmp_path):
  config = _config(steps=2)
  model_config = config_lib.resolve_model_config(config.model)
  params = jax.jit(LanguageModel(model_config).init)(jax.random.key(7), np.zeros((1, 8), np.int32))["params"]
  imported = str(tmp_path / "imported")
  runs.write_run(imported, runs.training_config(model_config, base=config), params)
  state, _ = _first_state(_config(steps=2, init_from=imported), str(tmp_path / "new"))
  _assert_same(state["params"], jax.tree.map(np.asarray, flax.linen.unbox(params)))
  summary = trainer.train_and_evaluate(_config(steps=2, init_from=imported), str(tmp_path / "trained"))
  assert (summary["status"], summary["step"]) == ("done", 2)


@pytest.mark.slow   # ~7 s idle, two training runs
def test_init_from_a_per_block_run_into_a_scanned_model(tmp_path):
  """An imported (per-block) checkpoint initializes a scan_blocks=True run: the blocks are stacked on restore."""
  layout = {"model.pattern": "M*-M*-M*-"}
  config = _config(steps=2, **layout)
  model_config = config_lib.resolve_model_config(config.model)
  params = jax.jit(LanguageModel(model_config).init)(jax.random.key(7), np.zeros((1, 8), np.int32))["params"]
  imported = str(tmp_path / "imported")
  runs.write_run(imported, runs.training_config(model_config, base=config), params)
  scanned = _config(steps=2, init_from=imported, **layout, **{"model.scan_blocks": True})
  state, _ = _first_state(scanned, str(tmp_path / "new"))
  expected = scanned_params(jax.tree.map(np.asarray, flax.linen.unbox(params)), model_config)
  assert set(expected) != set(flax.linen.unbox(params))   # the layouts differ: a group was stacked
  _assert_same(state["params"], expected)


def test_init_from_bad_sources(finished, tmp_path):
  with pytest.raises(errors.CheckpointError, match="no checkpoints directory"):
    trainer.train_and_evaluate(_config(init_from=str(tmp_path / "nowhere")), str(tmp_path / "a"))
  with pytest.raises(errors.CheckpointError, match="incompatible with this config"):
    trainer.train_and_evaluate(_config(init_from=finished[0], **{"model.d_model": 48}), str(tmp_path / "b"))


# ------------------------------------------------------------------------------------------- operations

_HOLDER = ("import sys, time\nfrom training import lock\nheld = lock.hold(sys.argv[1])\nprint('held', flush=True)\n"
           "time.sleep(600)\n")


def _hold(workdir):
  """A separate process holding ``workdir``'s lock (as a running train.py does); returns it once it holds it."""
  os.makedirs(workdir, exist_ok=True)
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(workdir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  return holder


def test_second_run_on_a_held_workdir(tmp_path):
  workdir = tmp_path / "w"
  holder = _hold(workdir)
  try:
    message = _assert_clear(_shrunken_cli(workdir), 4, "is in use by another run", f"pid {holder.pid} on host")
    assert "started 20" in message and "heartbeat" in message
    assert not os.path.exists(workdir / "checkpoints" / "4") and not os.path.exists(workdir / "error.log")
  finally:
    holder.kill()
    holder.wait()


@pytest.mark.slow   # ~9 s idle; the lock's other cases run by default
def test_killed_holder_lock_is_taken_over(tmp_path, capsys):
  workdir = tmp_path / "w"
  holder = _hold(workdir)
  holder.kill()  # SIGKILL: no clean-up, the lock file stays behind
  holder.wait()
  assert os.path.exists(workdir / "run.lock")
  summary = trainer.train_and_evaluate(_config(steps=2), str(workdir))
  out = capsys.readouterr().out
  assert f"warning: took over the stale lock {workdir / 'run.lock'} of pid {holder.pid}" in out, out
  assert "its process is gone" in out
  assert summary["status"] == "done" and not os.path.exists(workdir / "run.lock")  # released at the end


def test_lock_of_another_host(tmp_path):
  from training import lock  # pylint: disable=g-import-not-at-top
  path = tmp_path / lock.LOCK_FILE
  other = dict(host="elsewhere", pid=1, started="2026-01-01T00:00:00+00:00", command="train.py")
  path.write_text(json.dumps(dict(other, heartbeat=__import__("time").time() - 5)))
  with pytest.raises(errors.WorkdirInUse, match="in use by another run: pid 1 on host elsewhere.*heartbeat 5 s ago"):
    lock.hold(str(tmp_path), stale_after_s=60)
  path.write_text(json.dumps(dict(other, heartbeat=__import__("time").time() - 120)))
  held = lock.hold(str(tmp_path), stale_after_s=60)
  try:
    assert "host elsewhere has not written its heartbeat for 120 s (more than config.lock_stale_s=60)" in held.taken_over
    assert json.loads(path.read_text())["pid"] == os.getpid()
  finally:
    held.release()
  assert not path.exists()


def _signal_at(tmp_path, pattern, sig, *args, steps=4000):
  """Runs the shrunken train.py, sends ``sig`` once ``pattern`` is printed; (result, seconds to exit, output)."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={tmp_path / 'w'}",
             "--config=configs/shrunken.py", f"--config.steps={steps}", *args]
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  chunks = []
  reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
  reader.start()
  deadline = time.monotonic() + 300
  while pattern not in b"".join(chunks).decode(errors="replace"):
    assert proc.poll() is None and time.monotonic() < deadline, b"".join(chunks).decode(errors="replace")[-3000:]
    time.sleep(0.02)
  sent = time.monotonic()
  proc.send_signal(sig)
  code = proc.wait(timeout=120)
  seconds = time.monotonic() - sent
  reader.join(timeout=10)
  return code, seconds, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_sigint_during_setup(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  code, seconds, out = _signal_at(tmp_path, "initializing the state ...", signal.SIGINT, "--compilation_cache=")
  assert code == 130, out[-3000:]
  assert ("SIGINT during set-up (restoring or initializing the state): no step has finished in this start"
          in out), out[-3000:]
  assert "no checkpoint exists yet" in out and "second Ctrl-C" not in out and "Traceback" not in out
  assert seconds < 10, seconds
  assert not os.path.exists(tmp_path / "w" / "run.lock")


@pytest.mark.slow  # ~40 s: compiles without the cache, so that the signal lands inside the compile
def test_sigterm_during_compile(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  code, seconds, out = _signal_at(tmp_path, "compiling the train step ...", signal.SIGTERM, "--compilation_cache=")
  assert code == 143, out[-3000:]
  assert "SIGTERM while compiling the train step (before step 1): no step has finished in this start" in out, out
  assert seconds < 5, seconds  # the message comes within milliseconds; the rest is the process ending
  assert not os.path.exists(tmp_path / "w" / "checkpoints" / "1") and "Traceback" not in out


@pytest.mark.slow  # ~40 s (test_train_loop's SIGTERM test covers the resume in the default suite)
def test_sigterm_in_steady_state(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  code, seconds, out = _signal_at(tmp_path, "step    3/4000", signal.SIGTERM,
                                  f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}", steps=4000)
  assert code == 143, out[-3000:]
  assert "SIGTERM at step " in out and ": saving a checkpoint after this step, then exiting (exit 143" in out, out
  saved = int(out.split("SIGTERM: saved checkpoint ")[1].split()[0])
  assert os.listdir(tmp_path / "w" / "checkpoints") == [str(saved)] and seconds < 30, (seconds, out[-2000:])
  # The checkpoint resumes exactly: the state equals that of an uninterrupted run at the same step.
  straight = str(tmp_path / "straight")
  trainer.train_and_evaluate(_config(steps=4000, halt_after=saved, **{"eval.batches": 2}), straight)
  _assert_same(_state(str(tmp_path / "w"), saved), _state(straight, saved))


@pytest.mark.slow  # ~30 s
def test_sigterm_save_does_not_fit_the_grace(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  code, seconds, out = _signal_at(tmp_path, "step    4/4000", signal.SIGTERM, "--config.checkpoint.every_steps=1",
                                  "--config.checkpoint.async_save=False", "--config.preemption_grace_s=1",
                                  f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}")
  assert code == 143, out[-3000:]
  assert "SIGTERM: not saving step " in out and "are left of config.preemption_grace_s=1" in out, out[-3000:]
  assert "the latest intact checkpoint is step " in out and seconds < 3, (seconds, out[-2000:])


def test_failed_sync_save_names_its_step(finished, tmp_path, monkeypatch):
  workdir = _copy(finished, tmp_path)
  _disk_full_at_step(monkeypatch, 6)
  with pytest.raises(errors.StorageError) as info:
    trainer.train_and_evaluate(_config(steps=6, **{"checkpoint.async_save": False}), workdir)
  message = str(info.value)
  assert "writing checkpoint 6 " in message and "The checkpoints on disk, [2, 4], are intact" in message, message
  assert "resume from step 4." in message


def _lr_at(config, steps):
  from training import optim  # pylint: disable=g-import-not-at-top
  fn = optim.schedule(config.optim, config.steps)
  return np.asarray([float(fn(t)) for t in steps])


def test_extend_before_the_decay(tmp_path, capsys):
  workdir = str(tmp_path / "w")
  trainer.train_and_evaluate(_config(steps=20, halt_after=6), workdir)  # decay due at step 16
  capsys.readouterr()
  summary = trainer.train_and_evaluate(_config(steps=30), workdir)   # without allow_config_change
  out = capsys.readouterr().out
  assert ("config.steps 20 -> 30: extending at step 6; the decay had not started (it was due at step 16), so the "
          "stable phase stretches: lr 0.003 until step 24, then the linear decay to 3e-05 over steps 24..30") in out, out
  assert summary["status"] == "done" and summary["step"] == 30
  lrs = {r["step"]: r["lr"] for r in _records(workdir) if r["kind"] == "train"}
  old, new = _lr_at(_config(steps=20), range(30)), _lr_at(_config(steps=30), range(30))
  # (metrics hold the float32 the step computed; the plans here are evaluated eagerly: rtol 1e-5)
  np.testing.assert_allclose([lrs[s] for s in range(1, 7)], old[:6], rtol=1e-5)   # the first start: the old plan
  np.testing.assert_allclose([lrs[s] for s in range(7, 31)], new[6:], rtol=1e-5)  # the rest: the stretched one
  np.testing.assert_array_equal(old[:7], new[:7])                                # identical up to the resume
  assert all(lrs[s] == pytest.approx(3e-3, rel=1e-5) for s in range(3, 25))
  assert lrs[30] == pytest.approx(3e-5, rel=1e-5)  # the floor at the new end
  history = [json.loads(l) for l in open(os.path.join(workdir, workdir_lib.HISTORY_FILE), encoding="utf-8")]
  assert history[-1]["changes"]["steps"] == [20, 30]


def test_extend_after_the_decay_started(finished, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished[1], workdir)  # the finished 6-step run: its decay began at step 5
  with pytest.raises(errors.ConfigChangedError) as info:
    workdir_lib.check_resume(workdir, _config(steps=12), 6)
  message = str(info.value)
  assert info.value.exit_code == 6
  assert "config.steps 6 -> 12 at step 6 cannot extend this run without a jump" in message, message
  assert "the run's decay started at step 5 and it is at step 6" in message, message
  assert "--config.init_from=" in message and "--allow_config_change" in message
  result = _shrunken_cli(workdir, steps=12)
  _assert_clear(result, 6, "cannot extend this run without a jump")
  config = _config(steps=12)
  config.allow_config_change = True
  resume = workdir_lib.check_resume(workdir, config, 6)
  jump = [m for m in resume.messages if m.startswith("warning: the learning rate at step 6 jumps from ")]
  old, new = _lr_at(_config(steps=6), [6])[0], _lr_at(config, [6])[0]
  assert jump and f"{old:.4g} (the run's plan) to {new:.4g}" in jump[0], resume.messages


def test_shorten_a_run(tmp_path):
  from training import extend  # pylint: disable=g-import-not-at-top
  before = config_lib.to_plain(_config(steps=100))    # warmup 2, decay 80..100
  early = extend.plan(before, _config(steps=60), 30)  # decay 48..60, after step 30
  assert early.accepted, early.message
  assert "config.steps 100 -> 60: ending early at step 30" in early.message and "steps 48..60" in early.message
  np.testing.assert_allclose(_lr_at(_config(steps=100), range(31)), _lr_at(_config(steps=60), range(31)))
  late = extend.plan(before, _config(steps=60), 50)   # the new decay would have started at step 48
  assert not late.accepted
  assert "the new decay would start at step 48, before the resume step 50" in late.message, late.message
  cosine = dict(before, optim=dict(before["optim"], schedule="cosine"))
  new_cosine = _config(steps=200, **{"optim.schedule": "cosine"})
  assert extend.plan(cosine, new_cosine, 1).accepted                      # in the warmup
  assert "cosine" in extend.plan(cosine, new_cosine, 10).message          # after it: refused
  assert not extend.plan(cosine, new_cosine, 10).accepted


@pytest.mark.slow
def test_startup_phases_and_timestamps(tmp_path):
  result = _shrunken_cli(tmp_path / "w", "--config.log_every=2", "--config.eval.batches=0", steps=4)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  for phase in ("reading and tokenizing the data ... ", "building the model and its shardings ... ",
                "initializing the state ... ", "compiling the train step ... ", "step 1 (the first of this start) ... "):
    line = [l for l in out.splitlines() if l.startswith(phase)]
    assert line and line[0][len(phase):].split()[1] == "s", out
    float(line[0][len(phase):].split()[0])
  assert "compiled programs are cached in " in out
  records = [r for r in _records(tmp_path / "w") if r["kind"] == "train"]
  assert [r["step"] for r in records] == [2, 4]
  for record in records:
    assert record["time"].startswith("20") and record["time"].endswith("+00:00") and record["elapsed_s"] > 0
    line = [l for l in out.splitlines() if l.startswith(f"step {record['step']}/4 ")][0]
    assert f"loss {record['loss']:7.4f} (mean of last 2)" in line, (line, record)
    assert "+" in line.split("]")[-1] and line.split("]")[-1].strip()[2] == ":"  # "09:41:07 +83s"


@pytest.mark.slow   # ~30 s: train, sample, export from another directory
def test_entry_points_from_another_directory(tmp_path):
  import tomllib  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  scripts = project["project"]["scripts"]
  assert set(scripts) == {"fp4jax-train", "fp4jax-sample", "fp4jax-hf"}
  packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
  env = dict(os.environ, PYTHONPATH=ROOT)  # what the editable install puts on the path
  for name, target in scripts.items():
    module, function = target.split(":")
    assert f"{module.split('.')[0]}*" in packages, (name, packages)  # installed, so importable from anywhere
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}; {function}()"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, (name, result.stderr[-2000:])
    assert "usage" in result.stdout.lower() or "--workdir" in result.stdout, (name, result.stdout[:500])
  # The documented commands also run from elsewhere: a relative --config resolves against the repository.
  result = subprocess.run([sys.executable, "-m", "tools.train", f"--workdir={tmp_path / 'w'}",
                           "--config", "configs/shrunken.py", "--config.steps=1", "--config.eval.batches=0",
                           f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and "done at step 1" in result.stdout, result.stderr[-3000:]
  result = subprocess.run([sys.executable, "-m", "tools.hf", "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0 and "fp4jax-hf" in result.stdout, result.stderr[-2000:]


def test_tiny_docstring_states_its_parameter_count():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  model = trainer.build_model(config_lib.resolve_model_config(config.model), fp4jax_recipe(config.recipe))
  tokens = jax.ShapeDtypeStruct((1, config.data.seq_len), np.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(flax.linen.unbox(params)))
  assert f"A {count:,}-parameter hybrid" in tiny.__doc__, (count, tiny.__doc__)


def fp4jax_recipe(name):
  import fp4jax  # pylint: disable=g-import-not-at-top
  return fp4jax.recipes.get(name)


@pytest.mark.slow
def test_error_log_of_an_unusable_workdir(tmp_path):
  (tmp_path / "afile").write_text("")
  temp = tmp_path / "temp"
  os.makedirs(temp)
  command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={tmp_path / 'afile'}",
             "--config=configs/shrunken.py"]
  for _ in range(2):
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TMPDIR=str(temp)))
    _assert_clear(result, 4, "is a file", f"(traceback: {temp / 'fp4jax_error.log'})")
  assert os.listdir(temp) == ["fp4jax_error.log"]
  assert (temp / "fp4jax_error.log").read_text().count("\n--- traceback ---\n") == 2
