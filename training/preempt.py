"""SIGTERM and SIGINT during a run: say at once what will happen, stop by the deadline, exit with a signal's code.

``with Preemption(grace_s) as stop:`` wraps a whole run (set-up, compile, training, finishing). The handlers
wake a watcher thread through ``signal.set_wakeup_fd``, so the message is printed within milliseconds even
while the main thread is inside a long XLA compile (Python runs its own handlers only between bytecodes).
What happens depends on ``stop.phase``:

  set-up, compile   no step has finished since the latest checkpoint: the watcher exits at once
  training          the loop saves a checkpoint after the current step (``Loop``), unless the last save
                    took longer than the time left, then it exits without one; either way it says so
  finishing         the final checkpoint is being written: it is waited for

Whatever the phase, the process exits by ``grace_s`` after the signal (the watcher's deadline: a cluster
sends SIGKILL after its grace period), and a second signal exits at once. The exit status is 128 + the
signal number (``EXIT_CODES``: 143 SIGTERM, 130 SIGINT), never 0.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = {signal.Signals(s).name: 128 + int(s) for s in SIGNALS}   # SIGTERM 143, SIGINT 130
SET_UP, COMPILE, TRAINING, FINISHING = "set-up", "compile", "training", "finishing"


def exit_code(signal_name: str | None) -> int:
  """128 + the signal's number. None: a stop this process has not had a signal for yet (the processes agree on a
  stop, ``sharding.any_process``, and another one's signal came first): SIGTERM's, the stop's usual signal."""
  if signal_name is None:
    return EXIT_CODES["SIGTERM"]
  return EXIT_CODES.get(signal_name, 128 + int(getattr(signal, signal_name, 15)))


class Preemption:
  """The run's signal state: which signal came when, the phase and step it hit, and the watcher's deadline."""

  def __init__(self, grace_s: float = 30.0, *, stream=None):
    self.grace_s = float(grace_s)
    self.stream = stream or sys.stderr
    self.phase = SET_UP
    self.detail = ""                    # what the set-up is doing ("reading the data"), for the message
    self.step = 0                       # the step count the loop has reached
    self.signal_name: str | None = None
    self.signal_time: float | None = None
    self.checkpoints: Callable[[], list[int]] | None = None  # the intact checkpoints on disk, once known
    self.reporter = None                # the run's Reporter, once it exists
    self._cleanups: list[Callable[[], None]] = []
    self._installed = {}
    self._pipe = None
    self._previous_fd = -1
    self._done = threading.Event()

  # Installation ----------------------------------------------------------------------------------------

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is not threading.main_thread():
      return self  # signals reach the main thread only: a run in another thread leaves them alone
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    self._pipe = (read_fd, write_fd)
    for sig in SIGNALS:
      self._installed[sig] = signal.signal(sig, self._handle)
    self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=self._watch, name="fp4jax-preemption", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    if self._pipe is None:
      return
    signal.set_wakeup_fd(self._previous_fd)
    for sig, handler in self._installed.items():
      signal.signal(sig, handler)
    os.write(self._pipe[1], b"\0")  # wakes the watcher, which ends
    os.close(self._pipe[1])
    self._pipe = None

  def _handle(self, signum, frame) -> None:
    """The Python-level handler (main thread, between bytecodes): the watcher has done the work already."""

  def at_exit(self, cleanup: Callable[[], None]) -> None:
    """``cleanup`` runs before the watcher ends the process (e.g. releasing the work-directory lock)."""
    self._cleanups.append(cleanup)

  # What the loop asks --------------------------------------------------------------------------------

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def seconds_left(self) -> float:
    """Seconds until the deadline (inf without a signal)."""
    if self.signal_time is None:
      return float("inf")
    return self.signal_time + self.grace_s - time.monotonic()

  def say(self, text: str) -> None:
    if self.reporter is not None:
      self.reporter.end_line()  # an open "compiling ..." line on stdout ends before the message
    self.stream.write(text + "\n")
    self.stream.flush()

  def intact(self) -> str:
    """``the latest intact checkpoint is step 40`` (from the disk), or that none exists yet."""
    try:
      steps = self.checkpoints() if self.checkpoints is not None else None
    except OSError:
      steps = None
    if steps is None:
      return "no checkpoint was written in this start"
    return f"the latest intact checkpoint is step {steps[-1]}" if steps else "no checkpoint exists yet"

  # The watcher ---------------------------------------------------------------------------------------

  def _watch(self) -> None:
    read_fd, _ = self._pipe
    deadline_thread = None
    while True:
      try:
        data = os.read(read_fd, 64)
      except InterruptedError:
        continue
      if self._done.is_set() or not data:
        os.close(read_fd)
        return
      for signum in data:
        if signum not in {int(s) for s in SIGNALS}:
          continue
        name = signal.Signals(signum).name
        if self.signal_name is not None:
          self._exit_now(exit_code(self.signal_name), f"second signal ({name}): exiting now without saving; "
                         f"{self.intact()}")
        self.signal_name, self.signal_time = name, time.monotonic()
        code = exit_code(name)
        if self.phase in (SET_UP, COMPILE):
          doing = (f"during set-up ({self.detail})" if self.detail else "during set-up") if self.phase == SET_UP \
              else f"while compiling the train step (before step {self.step + 1})"
          self._exit_now(code, f"{name} {doing}: no step has finished in this start, so there is nothing to "
                         f"save; exiting now (exit {code}); {self.intact()}")
        if self.phase == TRAINING:
          self.say(f"{name} at step {self.step}: saving a checkpoint after this step, then exiting (exit {code}; "
                   f"within {self.grace_s:g} s, config.preemption_grace_s)")
        else:
          self.say(f"{name} while finishing: waiting for the final checkpoint write, then exiting (exit {code}; "
                   f"within {self.grace_s:g} s, config.preemption_grace_s)")
        deadline_thread = threading.Thread(target=self._deadline, name="fp4jax-preemption-deadline", daemon=True)
        deadline_thread.start()

  def _deadline(self) -> None:
    """Ends the process shortly before the grace period does, if the run has not stopped by then."""
    margin = min(1.0, 0.1 * self.grace_s)
    if self._done.wait(max(self.seconds_left() - margin, 0.0)):
      return
    self._exit_now(exit_code(self.signal_name),
                   f"{self.signal_name}: config.preemption_grace_s={self.grace_s:g} s is nearly over and the run "
                   f"has not stopped ({self.phase} at step {self.step}); exiting now without waiting further; "
                   f"{self.intact()}")

  def _exit_now(self, code: int, message: str) -> None:
    self.say(message)
    for cleanup in reversed(self._cleanups):
      try:
        cleanup()
      except Exception:  # pylint: disable=broad-except  (exiting regardless)
        pass
    try:
      sys.stdout.flush()
    finally:
      os._exit(code)  # pylint: disable=protected-access  (the main thread may be inside XLA: no unwinding)
