"""One writer per work directory: ``hold(workdir) -> WorkdirLock``, held by a run (process 0) for its lifetime.

``<workdir>/run.lock`` names the holder in JSON (host, pid, start time, command, heartbeat); the file is also
locked with ``fcntl.flock`` where the file system supports it, so a holder that dies (even by ``kill -9``)
releases the OS lock at once. A second run on the same directory raises ``WorkdirError`` naming the holder.

A lock file whose holder is gone is stale and is taken over, with the reason returned for the log:
- the OS lock is free (the holder's process ended), or
- the holder's host is this host and its pid is not running, or
- the holder is on another host (a shared file system, where flock may be per host) and its heartbeat is
  older than ``stale_after_s``.
The holder rewrites its heartbeat every ``stale_after_s / 4`` seconds (at most every 30 s) from a thread.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import threading
import time

from training.errors import WorkdirError, WorkdirInUse

try:
  import fcntl
except ImportError:  # not POSIX: the lock file alone
  fcntl = None

LOCK_FILE = "run.lock"
_NO_OS_LOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def describe(holder: dict) -> str:
  """``pid 123 on host h, started 2026-12-01T09:40:02+00:00 (`train.py ...`), heartbeat 4 s ago``."""
  beat = holder.get("heartbeat")
  ago = f", heartbeat {time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else ""
  command = f" (`{holder['command'][:120]}`)" if holder.get("command") else ""
  who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
  return f"{who}, started {holder.get('started', '?')}{command}{ago}"


class WorkdirLock:
  """The held lock of one work directory; ``release()`` (idempotent) removes it."""

  def __init__(self, workdir: str, *, stale_after_s: float = 300.0):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.stale_after_s = stale_after_s
    self.taken_over: str | None = None   # why an earlier lock file was stale, when one was taken over
    self.os_lock = False
    self._fd = None
    self._stop = threading.Event()
    self._thread = None
    self._info = dict(host=socket.gethostname(), pid=os.getpid(),
                      started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command=" ".join(sys.argv))

  # Acquire ------------------------------------------------------------------------------------------

  def acquire(self) -> "WorkdirLock":
    """Takes the lock, or raises WorkdirError naming the live holder."""
    fd = self._open_locked()
    try:
      holder = _read(fd)
      if holder and (holder.get("pid"), holder.get("host")) != (os.getpid(), self._info["host"]):
        reason = self._stale_reason(holder)
        if reason is None:
          raise WorkdirInUse(
              f"the work directory {os.path.dirname(self.path)} is in use by another run: {describe(holder)}. "
              f"Stop that run, wait for it to end, or pass another --workdir; if it is gone (its host "
              f"stopped), delete {self.path} or wait {self.stale_after_s:.0f} s (config.lock_stale_s) for "
              "its heartbeat to go stale")
        self.taken_over = f"took over the stale lock {self.path} of {describe(holder)}: {reason}"
      self._fd = fd
      self._write()
    except BaseException:
      os.close(fd)
      raise
    self._thread = threading.Thread(target=self._beat, name="fp4jax-workdir-heartbeat", daemon=True)
    self._thread.start()
    return self

  def _open_locked(self) -> int:
    """The lock file, opened and flock'ed; reopened when a holder removed it between our open and flock."""
    for _ in range(5):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        self.os_lock = self._flock(fd)
        if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
          return fd
      except FileNotFoundError:
        pass
      except BaseException:
        os.close(fd)
        raise
      os.close(fd)
    raise WorkdirError(f"could not take the lock {self.path}: other runs keep replacing it; pass another --workdir")

  def _flock(self, fd: int) -> bool:
    """True when the OS lock is held; False when the file system has none; WorkdirError when it is taken."""
    if fcntl is None:
      return False
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        holder = _read(fd)
        raise WorkdirInUse(
            f"the work directory {os.path.dirname(self.path)} is in use by another run: "
            f"{describe(holder) if holder else 'its lock file ' + self.path + ' is locked by a live process'}. "
            "Stop that run, wait for it to end, or pass another --workdir") from None
      if e.errno in _NO_OS_LOCK:
        return False
      raise

  def _stale_reason(self, holder: dict) -> str | None:
    """Why ``holder`` no longer holds the directory, or None when it may still be running."""
    if self.os_lock and holder.get("host") == self._info["host"]:
      return "its process is gone (the OS lock was free)"
    if holder.get("host") == self._info["host"]:
      pid = holder.get("pid")
      if not isinstance(pid, int) or not _pid_alive(pid):
        return f"no process {pid} runs on this host"
      return None
    beat = holder.get("heartbeat")
    if not isinstance(beat, (int, float)):
      return "its lock file has no heartbeat"
    if time.time() - beat > self.stale_after_s:
      return (f"host {holder.get('host')} has not written its heartbeat for {time.time() - beat:.0f} s "
              f"(more than config.lock_stale_s={self.stale_after_s:.0f})")
    return None

  # Hold, release ------------------------------------------------------------------------------------

  def _write(self) -> None:
    data = json.dumps(dict(self._info, heartbeat=time.time())).encode()
    os.lseek(self._fd, 0, os.SEEK_SET)
    os.ftruncate(self._fd, 0)
    os.write(self._fd, data)
    os.fsync(self._fd)

  def _beat(self) -> None:
    period = min(30.0, max(self.stale_after_s / 4, 0.05))
    while not self._stop.wait(period):
      try:
        self._write()
      except (OSError, TypeError):  # a full disk or a closed descriptor: the next beat tries again
        pass

  def release(self) -> None:
    """Stops the heartbeat and removes the lock file (when it is still this run's). Idempotent."""
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=5)
    fd, self._fd = self._fd, None
    if fd is None:
      return
    try:
      holder = _read(fd)
      if holder.get("pid") == os.getpid() and holder.get("host") == self._info["host"]:
        os.remove(self.path)
    except OSError:
      pass
    finally:
      os.close(fd)  # drops the OS lock


def _read(fd: int) -> dict:
  """The holder recorded in the open lock file (``{}`` when empty or not JSON)."""
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      chunks.append(chunk)
    value = json.loads(b"".join(chunks) or b"{}")
    return value if isinstance(value, dict) else {}
  except (OSError, ValueError):
    return {}


def hold(workdir: str, *, stale_after_s: float = 300.0) -> WorkdirLock:
  """The lock of ``workdir`` (an existing directory), held until ``release()``; WorkdirError when taken."""
  return WorkdirLock(workdir, stale_after_s=stale_after_s).acquire()
