"""The training pipeline's bad-input and fault matrix: each case asserts a specific error (and exit code) or an
exactly specified result. ``CASES`` names every case and its expected verdict; ``scripts/reliability_training.py``
runs this file (slow cases included) and writes the table of docs/RELIABILITY.md from it.

The command line, the lock, signals, extending and shortening a run, start-up; the checkpoint faults, the run
record's fallbacks and init_from are tests/test_checkpoint_faults.py (its own CASES). Runs are the shrunken config
(tests/train_runs.py).
"""
import json
import os
import shutil
import subprocess
import sys

import flax.linen
import jax
import numpy as np
import pytest

from configs import shrunken
from training import config as config_lib
from training import errors
from training import trainer
from training import workdir as workdir_lib
from train_runs import (CLEAR, CORRECT, ROOT, assert_clear, assert_same_tree, checkpoint_state, read_metrics,
                        run_config, shrunken_cli, train_cli)

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


# ---------------------------------------------------------------------------------------- command line

def test_cli_config_file_missing(tmp_path):
  assert_clear(train_cli(tmp_path / "w", f"--config={tmp_path / 'nope.py'}"), 2, "nope.py", "no such file")


def test_cli_config_file_syntax_error(tmp_path):
  (tmp_path / "bad.py").write_text("def get_config(:\n")
  assert_clear(train_cli(tmp_path / "w", f"--config={tmp_path / 'bad.py'}"), 2, "SyntaxError at line 1")


def test_cli_config_file_raises(tmp_path):
  (tmp_path / "raises.py").write_text("def get_config():\n  raise RuntimeError('no such cluster')\n")
  assert_clear(train_cli(tmp_path / "w", f"--config={tmp_path / 'raises.py'}"), 2, "no such cluster")


def test_cli_config_file_not_a_config(tmp_path):
  (tmp_path / "three.py").write_text("def get_config():\n  return 3\n")
  assert_clear(train_cli(tmp_path / "w", f"--config={tmp_path / 'three.py'}"), 2, "did not return a training config")


def test_cli_bad_override_value(tmp_path):
  assert_clear(shrunken_cli(tmp_path / "w", "--config.batch_size=abc"), 2, "batch_size")


def test_cli_unknown_override(tmp_path):
  assert_clear(shrunken_cli(tmp_path / "w", "--config.model.d_modl=64"), 2, "unknown config field", "d_model")


def test_cli_workdir_is_a_file(tmp_path):
  (tmp_path / "afile").write_text("")
  assert_clear(shrunken_cli(tmp_path / "afile"), 4, "is a file")


def test_cli_workdir_not_writable(tmp_path):
  assert_clear(shrunken_cli("/proc/fp4jax_run"), 4, "cannot be written")


def test_cli_data_missing(tmp_path):
  assert_clear(shrunken_cli(tmp_path / "w", f"--config.data.sources={tmp_path / 'none.txt'}"), 3,
                "none.txt", "does not exist")


@pytest.mark.slow   # CLI subprocesses (~10 s each): test_cli_distributed_no_coordinator runs by default
def test_cli_distributed_bad_process_id(tmp_path):
  assert_clear(shrunken_cli(tmp_path / "w", "--num_processes=2", "--process_id=5",
                              "--coordinator_address=127.0.0.1:1"), 8, "multi-process set-up failed")


def test_cli_distributed_no_coordinator(tmp_path):
  assert_clear(shrunken_cli(tmp_path / "w", "--num_processes=2", "--process_id=1",
                              "--coordinator_address=127.0.0.1:9", "--distributed_timeout=2"), 8,
                "no coordinator answered")


@pytest.mark.slow  # ~35 s on 2 loaded cores (the in-process divergence test is in test_train_loop.py)
def test_cli_diverged(tmp_path):
  result = shrunken_cli(tmp_path / "w", "--config.optim.lr=1e30", "--config.optim.warmup_steps=0",
                         "--config.health.max_nonfinite_streak=2", "--config.eval.batches=0", steps=20)
  assert_clear(result, 9, "training diverged", "config.optim.lr")
  assert os.path.exists(tmp_path / "w" / "error.log")


@pytest.mark.slow
def test_cli_debug_shows_the_traceback(tmp_path):
  workdir = tmp_path / "w"
  os.makedirs(workdir)
  result = shrunken_cli(workdir, f"--config.data.sources={tmp_path / 'none.txt'}", "--debug")
  assert result.returncode == 3 and "Traceback" in result.stderr and "DataError" in result.stderr
  log = (workdir / "error.log").read_text()
  assert "Traceback" in log and "none.txt" in log


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
    message = assert_clear(shrunken_cli(workdir), 4, "is in use by another run", f"pid {holder.pid} on host")
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
  summary = trainer.train_and_evaluate(run_config(steps=2), str(workdir))
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
  trainer.train_and_evaluate(run_config(steps=4000, halt_after=saved, **{"eval.batches": 2}), straight)
  assert_same_tree(checkpoint_state(str(tmp_path / "w"), saved), checkpoint_state(straight, saved))


@pytest.mark.slow  # ~30 s
def test_sigterm_save_does_not_fit_the_grace(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  code, seconds, out = _signal_at(tmp_path, "step    4/4000", signal.SIGTERM, "--config.checkpoint.every_steps=1",
                                  "--config.checkpoint.async_save=False", "--config.preemption_grace_s=1",
                                  f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}")
  assert code == 143, out[-3000:]
  assert "SIGTERM: not saving step " in out and "are left of config.preemption_grace_s=1" in out, out[-3000:]
  assert "the latest intact checkpoint is step " in out and seconds < 3, (seconds, out[-2000:])


def _lr_at(config, steps):
  from training import optim  # pylint: disable=g-import-not-at-top
  fn = optim.schedule(config.optim, config.steps)
  return np.asarray([float(fn(t)) for t in steps])


def test_extend_before_the_decay(tmp_path, capsys):
  workdir = str(tmp_path / "w")
  trainer.train_and_evaluate(run_config(steps=20, halt_after=6), workdir)  # decay due at step 16
  capsys.readouterr()
  summary = trainer.train_and_evaluate(run_config(steps=30), workdir)   # without allow_config_change
  out = capsys.readouterr().out
  assert ("config.steps 20 -> 30: extending at step 6; the decay had not started (it was due at step 16), so the "
          "stable phase stretches: lr 0.003 until step 24, then the linear decay to 3e-05 over steps 24..30") in out, out
  assert summary["status"] == "done" and summary["step"] == 30
  lrs = {r["step"]: r["lr"] for r in read_metrics(workdir) if r["kind"] == "train"}
  old, new = _lr_at(run_config(steps=20), range(30)), _lr_at(run_config(steps=30), range(30))
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
    workdir_lib.check_resume(workdir, run_config(steps=12), 6)
  message = str(info.value)
  assert info.value.exit_code == 6
  assert "config.steps 6 -> 12 at step 6 cannot extend this run without a jump" in message, message
  assert "the run's decay started at step 5 and it is at step 6" in message, message
  assert "--config.init_from=" in message and "--allow_config_change" in message
  result = shrunken_cli(workdir, steps=12)
  assert_clear(result, 6, "cannot extend this run without a jump")
  config = run_config(steps=12)
  config.allow_config_change = True
  resume = workdir_lib.check_resume(workdir, config, 6)
  jump = [m for m in resume.messages if m.startswith("warning: the learning rate at step 6 jumps from ")]
  old, new = _lr_at(run_config(steps=6), [6])[0], _lr_at(config, [6])[0]
  assert jump and f"{old:.4g} (the run's plan) to {new:.4g}" in jump[0], resume.messages


def test_shorten_a_run(tmp_path):
  from training import extend  # pylint: disable=g-import-not-at-top
  before = config_lib.to_plain(run_config(steps=100))    # warmup 2, decay 80..100
  early = extend.plan(before, run_config(steps=60), 30)  # decay 48..60, after step 30
  assert early.accepted, early.message
  assert "config.steps 100 -> 60: ending early at step 30" in early.message and "steps 48..60" in early.message
  np.testing.assert_allclose(_lr_at(run_config(steps=100), range(31)), _lr_at(run_config(steps=60), range(31)))
  late = extend.plan(before, run_config(steps=60), 50)   # the new decay would have started at step 48
  assert not late.accepted
  assert "the new decay would start at step 48, before the resume step 50" in late.message, late.message
  cosine = dict(before, optim=dict(before["optim"], schedule="cosine"))
  new_cosine = run_config(steps=200, **{"optim.schedule": "cosine"})
  assert extend.plan(cosine, new_cosine, 1).accepted                      # in the warmup
  assert "cosine" in extend.plan(cosine, new_cosine, 10).message          # after it: refused
  assert not extend.plan(cosine, new_cosine, 10).accepted


@pytest.mark.slow
def test_startup_phases_and_timestamps(tmp_path):
  result = shrunken_cli(tmp_path / "w", "--config.log_every=2", "--config.eval.batches=0", steps=4)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  for phase in ("reading and tokenizing the data ... ", "building the model and its shardings ... ",
                "initializing the state ... ", "compiling the train step ... ", "step 1 (the first of this start) ... "):
    line = [l for l in out.splitlines() if l.startswith(phase)]
    assert line and line[0][len(phase):].split()[1] == "s", out
    float(line[0][len(phase):].split()[0])
  assert "compiled programs are cached in " in out
  records = [r for r in read_metrics(tmp_path / "w") if r["kind"] == "train"]
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
  assert set(scripts) == {"fp4jax-train", "fp4jax-sample", "fp4jax-hf", "fp4jax-profile"}
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
                           "--config", "configs/shrunken.py", "--config.steps=1", "--config.optim.warmup_steps=0",
                           "--config.eval.batches=0",
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
    assert_clear(result, 4, "is a file", f"(traceback: {temp / 'fp4jax_error.log'})")
  assert os.listdir(temp) == ["fp4jax_error.log"]
  assert (temp / "fp4jax_error.log").read_text().count("\n--- traceback ---\n") == 2


def test_a_stop_agreed_before_this_process_had_its_signal_exits_as_sigterm():
  # On several processes the stop is agreed collectively (training.loop: sharding.any_process), so a process can
  # save and exit on another one's signal before its own arrives: its exit status is SIGTERM's, not an error.
  from training import preempt   # pylint: disable=import-outside-toplevel
  assert preempt.exit_code(None) == preempt.exit_code("SIGTERM") == 143 and preempt.exit_code("SIGINT") == 130
