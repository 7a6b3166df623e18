"""Two real train.py processes on the CPU (jax.distributed on 127.0.0.1) and its faults: kill -9
of one process before, during and after a checkpoint save, and SIGTERM to both. The survivor exits 10 with
one fp4jax line within a bound (the JAX/coordination output goes to error.log), both exit 143 on SIGTERM
after saving one step, and the restart of both processes continues bit-identically: every step's loss and
the final checkpoint's per-array checksums equal those of an uninterrupted two-process run.

Only the coordinator case runs in the default suite (one two-process start, about a minute on 2 busy
cores); the rest restart the run and compare it with the reference, ``-m slow``.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from configs import shrunken
from training import peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY = 24, 6
PEER_TIMEOUT_S = 20
START_TIMEOUT_S = 400      # a two-process start on 2 busy cores (set-up and compile: ~40 s when idle)
EXIT_BOUND_S = 2 * PEER_TIMEOUT_S + 10
NATIVE_NOISE = ("Check failure", "Fatal Python error", "coordination_service", "F1", "E1", "*** ")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Pair:
  """Two train.py processes (each a supervisor and its child) on one work directory."""

  def __init__(self, workdir, steps=STEPS, extra=()):
    self.workdir = str(workdir)
    port = _free_port()
    env = dict(os.environ, **shrunken.compilation_cache_env(), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("XLA_FLAGS", None)
    overrides = {"checkpoint.every_steps": EVERY, "peer_timeout_s": PEER_TIMEOUT_S, "eval.batches": 0}
    overrides.update(a[len("--config."):].split("=", 1) for a in extra if a.startswith("--config."))
    flags = shrunken.shrunken_flags(steps=steps, **overrides) + [
        f"--workdir={self.workdir}", f"--compilation_cache={shrunken.TEST_COMPILATION_CACHE}",
        *(a for a in extra if not a.startswith("--config."))]
    self.logs = [open(os.path.join(os.path.dirname(self.workdir), f"{os.path.basename(self.workdir)}.{i}.{kind}"),
                      "w+", encoding="utf-8") for i in (0, 1) for kind in ("out", "err")]
    self.procs = [subprocess.Popen(
        [sys.executable, "train.py", *flags, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
         f"--process_id={i}"], cwd=ROOT, env=env, stdout=self.logs[2 * i], stderr=self.logs[2 * i + 1])
        for i in (0, 1)]

  def out(self, i: int) -> str:
    return _read(self.logs[2 * i])

  def err(self, i: int) -> str:
    return _read(self.logs[2 * i + 1])

  def wait_until(self, condition, what: str, timeout=START_TIMEOUT_S, poll=0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
        self.kill()
        raise AssertionError(f"{what}: not reached\n" + self.report())
      time.sleep(poll)

  def wait(self, i: int, timeout: float) -> int:
    try:
      return self.procs[i].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise AssertionError(f"process {i} did not exit within {timeout} s\n" + self.report()) from None

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def report(self) -> str:
    return "\n".join(f"--- process {i} {k}:\n{(self.out(i) if k == 'out' else self.err(i))[-3000:]}"
                     for i in (0, 1) for k in ("out", "err"))

  def finish(self, timeout=START_TIMEOUT_S) -> None:
    for i in (0, 1):
      assert self.wait(i, timeout) == 0, self.report()


def _read(f) -> str:
  f.flush()
  with open(f.name, encoding="utf-8", errors="replace") as g:
    return g.read()


def _step_reached(pair: Pair, step: int):
  """Process 0's progress shows step ``step`` (``step   8/2000``, ``step  8/24``)."""
  return lambda: re.search(rf"^step +{step}/", pair.out(0), re.M) is not None


def _losses(workdir) -> dict[int, float]:
  """{step: loss} of metrics.jsonl's train records, the latest record of a step winning (a resume repeats)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return {r["step"]: r["last_loss"] for r in map(json.loads, f) if r["kind"] == "train"}


def _checksums(workdir, step: int) -> list[int]:
  with open(os.path.join(workdir, "checkpoints", str(step), "data", "metadata"), encoding="utf-8") as f:
    return json.load(f)["state_checksums"]


def _kill_and_time(pair: Pair, victim: int) -> float:
  """kill -9 of ``victim`` (its supervisor: the child follows); seconds until the survivor exits 10."""
  pair.procs[victim].kill()
  start = time.monotonic()
  survivor = 1 - victim
  code = pair.wait(survivor, EXIT_BOUND_S)
  seconds = time.monotonic() - start
  pair.procs[victim].wait()
  assert code == peers.EXIT_PEER_LOST, pair.report()
  return seconds


def _check_survivor_line(pair: Pair, survivor: int, victim: int, last_complete: int | None) -> str:
  """The survivor's console stderr is one fp4jax line naming the victim and the last complete checkpoint."""
  err = pair.err(survivor)
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, pair.report()
  line = lines[0]
  assert line.startswith(f"error: process {victim}") and "stopped answering at step" in line, line
  if last_complete is None:
    assert "no checkpoint is complete yet" in line, line
  else:
    assert f"the last complete checkpoint is step {last_complete} (" in line, line
    assert "restarting every process (the same command on each) resumes from it" in line, line
  assert "(exit 10;" in line and "error.log" in line, line
  assert not any(m in err for m in NATIVE_NOISE), err
  return line


def _restart_and_compare(tmp_path, workdir, reference, resumed_from: int | None, extra=()) -> None:
  again = Pair(workdir, extra=extra)
  again.finish()
  out = again.out(0)
  if resumed_from is None:
    assert "resumed from" not in out, out
  else:
    assert f"resumed from {workdir}/checkpoints/{resumed_from}\n" in out or \
        f"resumed from {workdir}/checkpoints/{resumed_from} " in out, out
  got, expected = _losses(workdir), _losses(reference)
  assert set(range((resumed_from or 0) + 1, STEPS + 1)) <= set(got), sorted(got)  # every step after the resume
  assert {step: expected[step] for step in got} == got  # (a fault run that logs every 2nd step has fewer)
  assert _checksums(workdir, STEPS) == _checksums(reference, STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted two-process run."""
  workdir = str(tmp_path_factory.mktemp("peers") / "reference")
  Pair(workdir).finish()
  assert sorted(_losses(workdir)) == list(range(1, STEPS + 1))
  return workdir


@pytest.mark.slow   # ~45 s, two processes; tests/test_train_distributed.py runs two processes by default
def test_kill_the_coordinator_after_a_save(tmp_path):
  """The default suite's case: process 0 (the coordinator) killed after checkpoint 6; process 1 exits 10 at once
  with the line (whether its collective fails first or JAX's client aborts it: then its supervisor says it)."""
  pair = Pair(tmp_path / "w", steps=2000)
  try:
    pair.wait_until(lambda: 6 in peers.complete_checkpoints(str(tmp_path / "w" / "checkpoints")), "checkpoint 6")
    pair.wait_until(_step_reached(pair, 8), "step 8")
    seconds = _kill_and_time(pair, victim=0)
  finally:
    pair.kill()
  last = peers.complete_checkpoints(str(tmp_path / "w" / "checkpoints"))[-1]
  _check_survivor_line(pair, survivor=1, victim=0, last_complete=last)
  assert seconds < EXIT_BOUND_S
  with open(tmp_path / "w" / "error.log", encoding="utf-8") as f:
    log = f.read()
  assert "--- native stderr of process 1" in log, log
  print(f"time to exit: {seconds:.2f} s")


@pytest.mark.slow
def test_kill_before_the_first_save_restarts_from_step_0(tmp_path, reference):
  victim = 1
  workdir = str(tmp_path / "w")
  late = ["--config.checkpoint.every_steps=100"]  # (a free field) the first save would come at the end
  pair = Pair(workdir, extra=late)
  try:
    pair.wait_until(_step_reached(pair, 3), "step 3")
    seconds = _kill_and_time(pair, victim)
  finally:
    pair.kill()
  assert peers.complete_checkpoints(os.path.join(workdir, "checkpoints")) == []
  _check_survivor_line(pair, 1 - victim, victim, None)
  print(f"time to exit: {seconds:.2f} s")
  _restart_and_compare(tmp_path, workdir, reference, None, extra=late)


@pytest.mark.slow
def test_kill_during_a_save_resumes_from_the_one_before(tmp_path, reference):
  """kill -9 of process 1 while checkpoint 12 is being written (its temporary directory exists, the final one
  not): orbax renames only a finished save, so the restart resumes from checkpoint 6."""
  workdir = str(tmp_path / "w")
  directory = os.path.join(workdir, "checkpoints")
  pair = Pair(workdir)

  def writing_12():
    try:
      return any(n.startswith("12.") for n in os.listdir(directory))
    except OSError:
      return False

  try:
    pair.wait_until(writing_12, "the save of step 12", poll=0.002)
    pair.procs[1].kill()
    start = time.monotonic()
    finished_first = 12 in peers.complete_checkpoints(directory)  # (the kill can come after the rename)
    code = pair.wait(0, EXIT_BOUND_S)
    seconds = time.monotonic() - start
  finally:
    pair.kill()
  assert code == peers.EXIT_PEER_LOST, pair.report()
  steps = peers.complete_checkpoints(directory)
  assert steps == ([6, 12] if finished_first else [6]), steps
  _check_survivor_line(pair, 0, 1, steps[-1])
  print(f"time to exit: {seconds:.2f} s; complete checkpoints {steps}; left over {sorted(os.listdir(directory))}")
  _restart_and_compare(tmp_path, workdir, reference, steps[-1])


@pytest.mark.slow
def test_kill_after_a_save_resumes_from_it(tmp_path, reference):
  workdir = str(tmp_path / "w")
  pair = Pair(workdir)
  try:
    pair.wait_until(lambda: 12 in peers.complete_checkpoints(os.path.join(workdir, "checkpoints")), "checkpoint 12")
    pair.wait_until(_step_reached(pair, 14), "step 14")
    seconds = _kill_and_time(pair, victim=1)
  finally:
    pair.kill()
  _check_survivor_line(pair, 0, 1, 12)
  print(f"time to exit: {seconds:.2f} s")
  _restart_and_compare(tmp_path, workdir, reference, 12)


@pytest.mark.slow
def test_a_hung_peer_ends_the_survivor_within_the_timeout(tmp_path):
  """SIGSTOP of process 1's training process (its supervisor's child): process 0's collective waits; within
  about config.peer_timeout_s the watchdog (or JAX's heartbeat, through the supervisor) ends it with the line."""
  workdir = str(tmp_path / "w")
  pair = Pair(workdir, steps=2000)
  child = None
  try:
    pair.wait_until(lambda: 6 in peers.complete_checkpoints(os.path.join(workdir, "checkpoints")), "checkpoint 6")
    pair.wait_until(_step_reached(pair, 8), "step 8")
    child = int(subprocess.run(["pgrep", "-P", str(pair.procs[1].pid)], capture_output=True, text=True,
                               check=True).stdout.split()[0])
    os.kill(child, signal.SIGSTOP)
    start = time.monotonic()
    code = pair.wait(0, EXIT_BOUND_S)
    seconds = time.monotonic() - start
  finally:
    if child is not None:
      os.kill(child, signal.SIGKILL)
    pair.kill()
  assert code == peers.EXIT_PEER_LOST, pair.report()
  line = _check_survivor_line(pair, 0, 1, peers.complete_checkpoints(os.path.join(workdir, "checkpoints"))[-1])
  # JAX's coordinator counts its heartbeat timeout from the stopped peer's last heartbeat, sent before the
  # SIGSTOP, so it can end the survivor a few seconds before config.peer_timeout_s has passed.
  assert PEER_TIMEOUT_S / 2 < seconds < EXIT_BOUND_S, (seconds, line)
  print(f"time to exit: {seconds:.2f} s; {line}")


@pytest.mark.slow
def test_sigterm_to_both_saves_one_step_and_resumes(tmp_path, reference):
  """SIGTERM to both supervisors, 0.3 s apart: both exit 143 after saving the same step (the loop's stop check
  is a collective at fixed steps, so every process stops after the same one)."""
  workdir = str(tmp_path / "w")
  directory = os.path.join(workdir, "checkpoints")
  pair = Pair(workdir, extra=["--config.log_every=2"])
  try:
    pair.wait_until(_step_reached(pair, 8), "step 8")
    pair.procs[0].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    pair.procs[1].send_signal(signal.SIGTERM)
    start = time.monotonic()
    codes = [pair.wait(i, 60) for i in (0, 1)]
    seconds = time.monotonic() - start
  finally:
    pair.kill()
  assert codes == [143, 143], pair.report()
  steps = peers.complete_checkpoints(directory)
  saved = [int(line.split("saved checkpoint ")[1].split()[0]) for line in pair.out(0).splitlines()
           if "saved checkpoint" in line]
  assert len(saved) == 1 and steps[-1] == saved[0] and saved[0] % 2 == 0 and saved[0] < STEPS, (saved, steps)
  for i in (0, 1):
    assert "SIGTERM at step" in pair.err(i), pair.report()
  print(f"time to exit: {seconds:.2f} s; saved step {saved[0]}")
  _restart_and_compare(tmp_path, workdir, reference, saved[0])


def test_lost_line_without_a_checkpoint_and_with_one(tmp_path):
  """The line's facts come from the disk: a temporary (unfinished) save is not a complete checkpoint."""
  directory = tmp_path / "checkpoints"
  (directory / "6" / "state").mkdir(parents=True)
  (directory / "6" / "data").mkdir()
  (directory / "12.orbax-checkpoint-tmp-3" / "state").mkdir(parents=True)
  assert peers.complete_checkpoints(str(directory)) == [6]
  line = peers.lost_line("process 1", 13, str(tmp_path), "how")
  assert line.startswith("error: process 1 stopped answering at step 13 (how); the last complete checkpoint is "
                         f"step 6 ({directory}/6); restarting every process")
  assert "no checkpoint is complete yet" in peers.lost_line("a peer", 2, str(tmp_path / "none"), "how")
  assert peers.other_process(0, 2) == "process 1" and peers.other_process(1, 2) == "process 0 (the coordinator)"


def test_peer_failures_are_told_from_other_errors():
  import jax  # pylint: disable=g-import-not-at-top
  gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
                                    "Read error [127.0.0.1]:6036: Connection reset by peer")
  assert peers.is_peer_failure(gloo)
  assert not peers.is_peer_failure(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: the shapes differ"))
  assert not peers.is_peer_failure(ValueError("Connection reset by peer"))  # not from a collective
  assert peers.is_peer_failure(ValueError(str(gloo)))  # orbax re-raises a save's failed collective so
  assert not peers.is_peer_failure(OSError(28, "No space left on device"))


def test_supervisor_names_the_process_from_the_coordination_output(tmp_path):
  """What JAX's coordination service writes when it aborts a process (lines as jax 0.10.2 prints them)."""
  from tools import supervise  # pylint: disable=g-import-not-at-top
  log = tmp_path / "error.log"
  log.write_text(
      "--- native stderr of process 0 (pid 1, now) ---\n"
      "E1201 coordination_service.cc:1549] Use error polling to propagate the following error to all tasks: "
      "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.\n"
      "F1201 client.h:80] Terminating process because the JAX distributed service detected fatal errors.\n")
  assert supervise._who(str(log), "0 2")[0] == "process 1"
  log.write_text(
      "--- native stderr of process 1 (pid 2, now) ---\n"
      "Additional GRPC error information from remote target coordination_service while calling "
      "/xla.coordination.CoordinationService/PollForError:\n:UNKNOWN:Error received from peer "
      "{grpc_message:\"Socket closed\", grpc_status:14}\n")
  assert supervise._who(str(log), "1 2") == ("process 0 (the coordinator)",
                                              "the connection to the coordination service was lost")
  assert supervise._who(None, "1 3")[0] == "a peer"
