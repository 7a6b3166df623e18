"""A multi-process run whose peer dies or hangs: every surviving process exits within ``config.peer_timeout_s``
with one line and exit status 10 (``EXIT_PEER_LOST``), never a hang or a C++ abort.

Three ways a lost peer shows, one line for each (``lost_line``):

  a collective fails    the CPU collectives (Gloo) raise at once when the peer's connection resets
                        (``is_peer_failure``); the loop calls ``PeerWatch.lost``
  a step never ends     a collective waits for a peer that hangs: the watcher thread of ``PeerWatch`` sees no
                        step finish for ``timeout_s`` (paused while a function compiles and runs its first
                        time: a slower peer's compile is not a hang) and ends the process
  the coordinator says  JAX's coordination service aborts the process (SIGABRT, uncatchably) when the
                        coordinator dies, or when a peer misses heartbeats for ``timeout_s``: the supervisor
                        of ``tools/supervise.py`` that started this process prints the line for it

The line names the process that stopped answering (the other one in a two-process run; ``a peer`` when
there are more and it is not known), the step count reached, the last complete checkpoint on disk and that
restarting every process resumes from it. This process tells its supervisor its work directory and step
count through the pipe whose descriptor is in ``$FP4JAX_SUPERVISOR_FD`` (lines ``workdir <path>``,
``step <n>``), so the supervisor's line has them too.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Callable

EXIT_PEER_LOST = 10
SUPERVISOR_FD = "FP4JAX_SUPERVISOR_FD"
# What the CPU (Gloo) and GPU (NCCL) collectives and the coordination client say when a peer is gone: the
# collectives' own names in any exception (orbax re-raises a failed save's collective as a ValueError), the
# connection's words only in JAX's runtime errors.
_COLLECTIVE_MARKS = ("Gloo", "NCCL", "heartbeat timeout", "stopped sending heartbeats")
_PEER_MARKS = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Socket closed",
               "Broken pipe", "UNAVAILABLE", "unhealthy")


def is_peer_failure(error: BaseException) -> bool:
  """Whether ``error`` (raised by a collective of a multi-process run) says that a peer is gone."""
  chain = _chain(error)
  text = " | ".join(str(e) for e in chain)
  if any(m in text for m in _COLLECTIVE_MARKS):
    return True
  return (any(type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") for e in chain)
          and any(m in text for m in _PEER_MARKS))


def _chain(error):
  seen = []
  while error is not None and len(seen) < 8:
    seen.append(error)
    error = error.__cause__ or error.__context__
  return seen


def complete_checkpoints(directory: str) -> list[int]:
  """The steps of ``directory`` whose checkpoint is complete (renamed from orbax's temporary name, both
  items present), read from the disk now; the same rule as ``training.checkpoint.Checkpoints.on_disk``."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and all(
      os.path.isdir(os.path.join(directory, n, item)) for item in ("state", "data")))


def lost_line(who: str, step: int | None, workdir: str | None, how: str) -> str:
  """The one line: ``error: process 1 stopped answering at step 37 (how); the last complete checkpoint ...``."""
  at = f" at step {step}" if step is not None else ""
  if workdir:
    directory = os.path.join(workdir, "checkpoints")
    steps = complete_checkpoints(directory)
    last = (f"the last complete checkpoint is step {steps[-1]} ({os.path.join(directory, str(steps[-1]))}); "
            "restarting every process (the same command on each) resumes from it" if steps else
            "no checkpoint is complete yet; restarting every process (the same command on each) starts the run "
            "again from step 0")
    log = f"; the JAX/coordination output is in {os.path.join(workdir, 'error.log')}"
  else:
    last, log = "restarting every process (the same command on each) resumes from the last complete checkpoint", ""
  return f"error: {who} stopped answering{at} ({how}); {last} (exit {EXIT_PEER_LOST}{log})"


def other_process(process_index: int, process_count: int) -> str:
  """``process 1`` (the only other one of two), else ``a peer``."""
  if process_count == 2:
    other = 1 - process_index
    return f"process {other}" + (" (the coordinator)" if other == 0 else "")
  return f"a peer of process {process_index}"


class PeerWatch:
  """Bounds the wait for the peers of a multi-process run; ``beat(step)`` after each finished step.

  ``with PeerWatch(...) as watch:`` starts the watcher thread (only when ``process_count > 1``); it is
  armed from the first ``beat`` on, and ``paused()`` while a function compiles. ``lost(step, how)`` ends the
  process with the line (also called by the loop when a collective fails).
  """

  def __init__(self, timeout_s: float, *, process_index: int, process_count: int, workdir: str,
               cleanups: list[Callable[[], None]] | None = None, stream=None):
    self.timeout_s = float(timeout_s)
    self.process_index, self.process_count, self.workdir = process_index, process_count, workdir
    self.stream = stream or sys.stderr
    self.step: int | None = None
    self._cleanups = cleanups if cleanups is not None else []
    self._last = None             # monotonic time of the latest beat; None: not armed
    self._paused = 0
    self._lost = False
    self._done = threading.Event()
    self._lock = threading.Lock()
    self._report_fd = _supervisor_fd()

  def __enter__(self) -> "PeerWatch":
    if self.process_count > 1:
      threading.Thread(target=self._watch, name="fp4jax-peer-watch", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()

  def beat(self, step: int) -> None:
    """``step`` steps are finished on this process (so every peer answered up to it)."""
    with self._lock:
      self.step, self._last = step, time.monotonic()
    self._report(f"step {step}")

  @contextlib.contextmanager
  def paused(self):
    """No bound while a function compiles and runs its first time (a peer may compile slower)."""
    with self._lock:
      self._paused += 1
    try:
      yield
    finally:
      with self._lock:
        self._paused -= 1
        if self._last is not None:
          self._last = time.monotonic()

  def _watch(self) -> None:
    while not self._done.wait(min(1.0, self.timeout_s / 4)):
      with self._lock:
        late = (self._last is not None and not self._paused
                and time.monotonic() - self._last > self.timeout_s)
      if late:
        self.lost(self.step, f"no step finished for config.peer_timeout_s={self.timeout_s:g} s: a collective "
                  "waits for it")

  def lost(self, step: int | None, how: str, error: BaseException | None = None) -> None:
    """Prints the line, appends ``error``'s traceback to error.log, runs the cleanups, exits 10 at once
    (``os._exit``: JAX's own shutdown would wait for the lost peer at a barrier, then abort)."""
    with self._lock:
      if self._lost or (self._done.is_set() and error is None):
        return  # another thread is ending the process already, or the run is over
      self._lost = True
    self._done.set()
    who = other_process(self.process_index, self.process_count)
    self.stream.write(lost_line(who, step, self.workdir, how) + "\n")
    self.stream.flush()
    if error is not None:
      try:
        with open(os.path.join(self.workdir, "error.log"), "a", encoding="utf-8") as f:
          f.write(f"--- process {self.process_index} (pid {os.getpid()}): {who} stopped answering at step "
                  f"{step} ---\n{''.join(traceback.format_exception(error))}\n")
      except OSError:
        pass
    for cleanup in reversed(self._cleanups):
      try:
        cleanup()
      except Exception:  # pylint: disable=broad-except  (exiting regardless)
        pass
    self._report(f"exit {EXIT_PEER_LOST}")
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)  # pylint: disable=protected-access

  def _report(self, line: str) -> None:
    if self._report_fd is not None:
      report(self._report_fd, line)


def _supervisor_fd() -> int | None:
  value = os.environ.get(SUPERVISOR_FD, "")
  return int(value) if value.isdigit() else None


def report(fd: int, line: str) -> None:
  """One line to the supervisor's pipe; never blocks or fails the run (a full or closed pipe drops it)."""
  try:
    os.write(fd, (line + "\n").encode())
  except OSError:
    pass


def report_to_supervisor(line: str) -> None:
  fd = _supervisor_fd()
  if fd is not None:
    report(fd, line)
