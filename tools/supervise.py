"""The supervisor of one process of a multi-process run: ``train.py`` starts itself again as a child and
waits, so that a child that JAX's coordination service aborts still ends with one fp4jax line and exit 10.

JAX's client aborts its process (SIGABRT, from a C++ thread, uncatchable) when the coordinator dies or a
peer misses its heartbeats; the child cannot say anything then. The supervisor (this module, which imports
nothing of the project but ``training/peers.py``, loaded by its path, and never touches a device) can: it reads the child's work directory and step count
from a pipe (``training.peers``), the name of the lost process from the coordination service's output in
``<workdir>/error.log`` (where the child sends its native stderr), and the last complete checkpoint from
the disk. Every other exit status of the child is passed on unchanged.

The child runs in its own session, so a signal to the supervisor's process group reaches it once, through
the supervisor (SIGTERM and SIGINT are forwarded); the child gets SIGKILL when the supervisor dies (Linux's
``PR_SET_PDEATHSIG``), so ``kill -9`` of the supervisor ends the whole process.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading



def _load_peers():
  """``training/peers.py`` without the ``training`` package (whose import builds the library's constants on a
  device, before ``jax.distributed`` is set up); it imports the standard library only."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "peers.py")
  spec = importlib.util.spec_from_file_location("_fp4jax_peers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


peers = _load_peers()
SUPERVISOR_FD, EXIT_PEER_LOST = peers.SUPERVISOR_FD, peers.EXIT_PEER_LOST
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


def supervised() -> bool:
  """Whether this process is a supervised child."""
  return bool(os.environ.get(SUPERVISOR_FD))


def die_with_supervisor() -> None:
  """In the child: SIGKILL when the supervisor ends (Linux; elsewhere a no-op)."""
  os.set_blocking(int(os.environ[SUPERVISOR_FD]), False)  # a report never stalls the run
  if not sys.platform.startswith("linux"):
    return
  import ctypes  # pylint: disable=g-import-not-at-top
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
  except (OSError, AttributeError):
    return
  if os.getppid() == 1:  # the supervisor died before the prctl
    os._exit(EXIT_PEER_LOST)  # pylint: disable=protected-access


class _Child:
  """What the child has told through the pipe: its work directory and latest step count."""

  def __init__(self, read_fd: int):
    self.workdir: str | None = None
    self.step: int | None = None
    self.process: str | None = None     # "<index> <count>"
    self.exited_itself = False          # it printed its own line (exit 10)
    self._thread = threading.Thread(target=self._read, args=(read_fd,), name="fp4jax-supervisor", daemon=True)
    self._thread.start()

  def _read(self, fd: int) -> None:
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
      for line in f:
        kind, _, value = line.strip().partition(" ")
        if kind == "workdir":
          self.workdir = value
        elif kind == "step" and value.isdigit():
          self.step = int(value)
        elif kind == "process":
          self.process = value
        elif kind == "exit":
          self.exited_itself = True

  def join(self) -> None:
    self._thread.join(timeout=2.0)


def supervise(argv: list[str]) -> int:
  """Runs ``train.py`` with ``argv[1:]`` as the supervised child; its exit status, or 10 with the line."""
  read_fd, write_fd = os.pipe()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, **{SUPERVISOR_FD: str(write_fd)},
             PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  child = subprocess.Popen([sys.executable, "-c", "from tools.train import run; run()"] + argv[1:], env=env,
                           pass_fds=(write_fd,), start_new_session=True)
  os.close(write_fd)
  told = _Child(read_fd)
  forwarded = []

  def forward(signum, frame):  # pylint: disable=unused-argument
    forwarded.append(signum)
    try:
      child.send_signal(signum)
    except ProcessLookupError:
      pass

  for sig in _FORWARDED:
    signal.signal(sig, forward)
  while True:
    try:
      code = child.wait()
      break
    except InterruptedError:
      continue
  told.join()
  if code >= 0 and code != 128 + int(signal.SIGABRT):
    return code
  if -code in [int(s) for s in forwarded]:   # killed by the signal it was sent
    return 128 - code
  print(_line(told, code), file=sys.stderr, flush=True)
  return EXIT_PEER_LOST


def _line(told: _Child, code: int) -> str:
  """The line for a child that JAX aborted (or that died of another signal)."""
  log = os.path.join(told.workdir, "error.log") if told.workdir else None
  who, how = _who(log, told.process)
  if how is None:
    how = f"the process ended with {_signal_name(code)}"
  return peers.lost_line(who, told.step, told.workdir, how)


def _who(log: str | None, process: str | None) -> tuple[str, str | None]:
  """(which process stopped answering, how it was noticed) from the coordination service's words."""
  index, count = (int(x) for x in process.split()) if process else (None, None)
  text = ""
  if log:
    try:
      with open(log, "rb") as f:
        f.seek(max(os.path.getsize(log) - 200_000, 0))
        text = f.read().decode("utf-8", "replace")
      text = text[text.rfind(f"--- native stderr of process {index} ") if index is not None else 0:]
    except OSError:
      text = ""
  unhealthy = re.findall(r"Task (\d+) heartbeat timeout|stopped sending heartbeats\):\s*\n?\s*([\d, ]+)", text)
  tasks = sorted({int(t) for pair in unhealthy for group in pair for t in re.findall(r"\d+", group)} - {index})
  if tasks:
    return (", ".join(f"process {t}" for t in tasks), "the coordinator missed its heartbeats for "
            "config.peer_timeout_s")
  if index not in (None, 0) and re.search(r"PollForError|coordination_service.*(Socket closed|reset by peer)|"
                                          r"Failed to connect to coordination service", text):
    return "process 0 (the coordinator)", "the connection to the coordination service was lost"
  if count == 2:
    other = 1 - index
    return f"process {other}" + (" (the coordinator)" if other == 0 else ""), None
  return "a peer", None


def _signal_name(code: int) -> str:
  number = -code if code < 0 else code - 128
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"status {code}"
