"""Pretrain a language model with fp4jax: ``fp4jax-train --config configs/tiny.py`` (or ``python train.py``).

  python train.py                                             # configs/tiny.py, work dir ./runs/tiny
  python train.py --config configs/small.py --workdir /tmp/small
  python train.py --config.model.d_model=128 --config.recipe=mxfp4 --config.steps=500
  python train.py --config.data.sources='~/texts/*.txt,~/more.jsonl'
  python train.py --config configs/small.py --config.init_from=runs/imported --workdir runs/continued

Running again with the same work directory resumes from its latest intact checkpoint (a resume with another
recipe, model, optimizer or data config is refused unless --allow_config_change; a larger --config.steps
extends the run when its schedule allows, and says how). Ctrl-C or SIGTERM saves a checkpoint after the
current step (or, during set-up and the first compile, exits at once) within config.preemption_grace_s.
One run at a time holds a work directory (<workdir>/run.lock). Multi-host: pass --coordinator_address/
--num_processes/--process_id, or set JAX_COORDINATOR_ADDRESS, or FP4JAX_DISTRIBUTED=1 on a cluster JAX
detects (SLURM, MPI, ...).

A failure prints one paragraph and exits with a status that names its kind (training/errors.py,
docs/TRAINING.md): 2 config, 3 data, 4 work directory (also: another run holds it), 5 checkpoint, 6 config
changed on resume, 7 storage, 8 distributed set-up, 9 diverged, 10 a peer of a multi-process run stopped
answering (tools/supervise.py), 1 anything unexpected; stopped by a signal: 143 SIGTERM, 130 SIGINT (128 +
the signal number). The traceback goes to <workdir>/error.log (or to one fp4jax_error.log in the temp
directory when the work directory is unusable); --debug also prints it.
"""
import collections
import errno
import io
import os
import socket
import sys
import tempfile
import threading
import time
import traceback

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from tools import supervise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: configs/ lives there
EXIT_USAGE, EXIT_UNEXPECTED, EXIT_INTERRUPTED = 2, 1, 130
EXIT_DISTRIBUTED = 8  # training.errors.DistributedError.exit_code (not imported: see _initialize_distributed)
PEER_TIMEOUT_S = 300.0  # configs/base.py's config.peer_timeout_s, for the heartbeat (see _peer_timeout)
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


def _fail(message: str, code: int, *, log: str | None = None) -> int:
  """Prints ``error: <message>`` as one paragraph (and where the traceback is); returns ``code``."""
  print(f"error: {message}" + (f" (traceback: {log})" if log else ""), file=sys.stderr)
  return code


def _unknown_field(error) -> None:
  bad = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.")]
  while isinstance(error, Exception) and error.args:  # config_flags nests the KeyError's message
    error = error.args[0]
  detail = str(error).replace("\n", "; ")
  sys.exit(_fail(f"unknown config field {detail} (in {' '.join(bad)}); list the fields with "
                 "`python -c \"from configs import base; print(base.get_config())\"`", EXIT_USAGE))


sys.path.insert(0, ROOT)  # config files import `configs` and `training`
try:  # config_flags applies the --config.<field> overrides right here, when the flag is defined
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(ROOT, "configs", "tiny.py"),
      "Training config file (a configs/*.py); override fields with --config.<field>=<value>.", lock_config=True)
except (AttributeError, KeyError) as e:
  _unknown_field(e)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory for checkpoints and metrics; default "
                               "./runs/<config.name>.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume even if the recipe, model, optimizer or data config differs from the "
    "run's (the difference is printed and recorded in config_history.jsonl).")
_DEBUG = flags.DEFINE_bool("debug", False, "Print the traceback of a failure (it is always in <workdir>/error.log).")
_DISTRIBUTED_FLAGS = ("coordinator_address", "num_processes", "process_id", "distributed_timeout")


def _define_distributed_flags(values: flags.FlagValues) -> None:
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-host runs.", flag_values=values)
  flags.DEFINE_integer("num_processes", None, "Number of processes, for multi-host runs.", flag_values=values)
  flags.DEFINE_integer("process_id", None, "This process's index, for multi-host runs.", flag_values=values)
  flags.DEFINE_integer("distributed_timeout", 300, "Seconds to wait for all processes to join.", flag_values=values)


_define_distributed_flags(flags.FLAGS)
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", os.path.join("~", ".cache", "fp4jax", "jax_compilation_cache"),
    "Directory of JAX's persistent compilation cache, so reruns and resumes skip compiling; '' turns it off.")


def _initialize_distributed(argv) -> None:
  """``jax.distributed.initialize`` when the flags or the environment ask for several processes.

  It must run before anything touches a device, and loading the config file imports the library (whose
  modules build constants), so it runs here, on flags read ahead of the others, with nothing of the
  project imported. Explicit flags win; else ``JAX_COORDINATOR_ADDRESS``, or a cluster JAX detects itself
  (SLURM, Open MPI, Kubernetes) when ``FP4JAX_DISTRIBUTED=1``.
  """
  values = flags.FlagValues()
  _define_distributed_flags(values)
  known = [argv[0]] + [a for a in argv[1:] if a.lstrip("-").split("=")[0] in _DISTRIBUTED_FLAGS]
  values(known)
  explicit = dict(coordinator_address=values.coordinator_address, num_processes=values.num_processes,
                  process_id=values.process_id)
  if not any(v is not None for v in explicit.values()) and not (
      os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("FP4JAX_DISTRIBUTED") == "1"):
    return
  kwargs = {k: v for k, v in explicit.items() if v is not None}
  if supervise.supervised():
    supervise.die_with_supervisor()
  try:
    if values.process_id is not None and not 0 <= values.process_id < (values.num_processes or 1):
      raise ValueError(f"--process_id={values.process_id} is not in [0, --num_processes={values.num_processes})")
    if values.coordinator_address and values.process_id:
      _wait_for_coordinator(values.coordinator_address, values.distributed_timeout)
    jax.distributed.initialize(**kwargs, initialization_timeout=values.distributed_timeout,
                               heartbeat_timeout_seconds=max(int(_peer_timeout(argv)), 1))
  except Exception as e:  # pylint: disable=broad-except  (jax raises RuntimeError, ValueError, XlaRuntimeError)
    sys.exit(_fail(
        f"the multi-process set-up failed: {str(e).strip().splitlines()[0][:300]} (coordinator "
        f"{values.coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')}, {values.num_processes} "
        f"processes, this one {values.process_id}); check that process 0 runs and is reachable at the "
        "coordinator address, that every process got the same --num_processes, and that --process_id is in "
        "[0, --num_processes)", EXIT_DISTRIBUTED))


def _wants_distributed(argv) -> bool:
  """Whether the flags or the environment ask for a multi-process run (read before the flags are parsed)."""
  return (any(a.lstrip("-").split("=")[0] in _DISTRIBUTED_FLAGS[:3] for a in argv[1:])
          or bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or os.environ.get("FP4JAX_DISTRIBUTED") == "1")


def _peer_timeout(argv) -> float:
  """``--config.peer_timeout_s`` from the command line, else the base config's default: JAX's heartbeat timeout
  is set before the config file can be loaded (a config file's own value bounds the step watchdog only)."""
  given = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config.peer_timeout_s=")]
  try:
    return float(given[-1]) if given else PEER_TIMEOUT_S
  except ValueError:
    return PEER_TIMEOUT_S  # the flag parser reports the bad value


def _native_stderr_to_log(workdir: str) -> None:
  """A supervised process of a multi-process run: JAX's C++ and coordination output (file descriptor 2) goes
  to <workdir>/error.log from here on; Python's own stderr (fp4jax's lines, tracebacks) stays on the console."""
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    pass
  log = _error_log(path)
  try:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  except OSError:
    return
  sys.stderr.flush()
  console = os.dup(2)
  sys.stderr = os.fdopen(console, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
  os.write(fd, f"--- native stderr of process {jax.process_index()} (pid {os.getpid()}, "
               f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}) ---\n".encode())
  os.dup2(fd, 2)
  os.close(fd)
  supervise.peers.report_to_supervisor(f"workdir {path}")
  supervise.peers.report_to_supervisor(f"process {jax.process_index()} {jax.process_count()}")


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Waits until process 0's coordinator accepts connections; raises ConnectionError after ``timeout_s``.

  (JAX's client aborts the whole process, uncatchably, when it cannot reach the coordinator in time.)
  """
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"--coordinator_address={address!r} must be host:port")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return
    except OSError as e:
      if time.monotonic() > deadline:
        raise ConnectionError(f"no coordinator answered at {address} within {timeout_s} s ({e.strerror or e})") from None
      time.sleep(0.5)


def _parse_flags(argv):
  """absl's parser, with unknown --config keys and bad values reported as a one-line usage error.

  ``--help`` prints this module's docstring and the flags and exits 0 (absl's own exits 1). A relative
  ``--config`` path that does not exist here but does in the repository (``configs/tiny.py``) is taken from
  the repository, so the command works from any directory.
  """
  if any(a in ("-h", "--help", "-help", "--helpfull", "--helpshort") for a in argv[1:]):
    print(f"{__doc__}\nFlags:\n{flags.FLAGS.module_help(__name__)}")
    sys.exit(0)
  try:
    _initialize_distributed(argv)
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    _unknown_field(e)
  except flags.Error as e:
    sys.exit(_fail(f"{e}; see `fp4jax-train --help`", EXIT_USAGE))
  except Exception as e:  # pylint: disable=broad-except  (the config file runs while the flags are parsed)
    _config_file_failed(_config_path(argv), e)


def _in_repository(arg: str) -> str:
  """``--config=<path>``, with a relative path that is missing here resolved against the repository."""
  if not arg.startswith("--config="):
    return arg
  path = arg.split("=", 1)[1]
  if path and not os.path.isabs(path) and not os.path.exists(path) and os.path.exists(os.path.join(ROOT, path)):
    return "--config=" + os.path.join(ROOT, path)
  return arg


def _config_path(argv) -> str:
  given = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")]
  given += [b for a, b in zip(argv[1:], argv[2:]) if a == "--config"]
  return given[-1] if given else os.path.join(ROOT, "configs", "tiny.py")


def _config_file_failed(path: str, error: BaseException) -> None:
  """Exits with one paragraph on a config file that is missing, does not parse, or fails in get_config()."""
  cause = error
  while cause.__cause__ is not None or cause.__context__ is not None:
    cause = cause.__cause__ or cause.__context__
  lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
  if not os.path.exists(path):
    reason = "no such file"
  elif isinstance(cause, SyntaxError):
    reason = f"SyntaxError at line {cause.lineno}: {cause.msg}"
  else:
    reason = f"{type(cause).__name__}: {lines[-1] if lines else ''}"
  sys.exit(_fail(f"the config file {path!r} could not be loaded ({reason}); give a Python file whose get_config() "
                 "returns a training config, e.g. --config configs/tiny.py", EXIT_USAGE))


def _load_config():
  """The config with its overrides (exits with one paragraph when it cannot be had)."""
  path = _config_path(sys.argv)
  try:
    config = _CONFIG.value
    is_training_config = hasattr(config, "steps")  # config_flags defers a loading error to the first use
  except Exception as e:  # pylint: disable=broad-except  (config_flags wraps every loading error)
    _config_file_failed(path, e)
  if not is_training_config:
    sys.exit(_fail(f"the config file {path!r} did not return a training config from get_config(); start from "
                   "configs/base.py", EXIT_USAGE))
  from configs import base   # pylint: disable=import-outside-toplevel  (configs/ is on the path from here on)
  unknown = base.unknown_fields(config)
  if unknown:
    sys.exit(_fail(f"the config file {path!r} sets {len(unknown)} field(s) that fp4jax's config does not have: "
                   f"{', '.join('config.' + f for f in unknown)} (misspelt, or from another version?); nothing "
                   "would read them. List the fields with `python -c \"from configs import base; "
                   "print(base.get_config())\"`", EXIT_USAGE))
  return config


class _LogTail(io.TextIOBase):
  """The last lines absl logging writes (orbax, jax): kept out of the console, written to error.log on failure."""

  def __init__(self, max_lines: int = 400):
    self.lines = collections.deque(maxlen=max_lines)
    self.follow_ups = 0  # "Event loop is closed" errors of callbacks after a failed save (not logged)

  def write(self, text: str) -> int:
    self.lines.append(text)
    return len(text)


_LOG_TAIL = _LogTail()


def _quiet_background_errors() -> None:
  """An exception in a background thread (TensorBoard's writer, orbax) or at exit: one line on stderr, the
  traceback to the log (error.log on failure)."""
  def thread_hook(args):
    _LOG_TAIL.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
    name = args.thread.name if args.thread is not None else "?"
    print(f"warning: background thread {name} failed: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr)

  def unraisable_hook(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
      # tensorstore's write callbacks of a failed checkpoint save, arriving after orbax closed its event
      # loop: consequences of the failure already reported, counted instead of logged one traceback each
      _LOG_TAIL.follow_ups += 1
      return
    _LOG_TAIL.write("".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                       unraisable.exc_traceback)))

  threading.excepthook = thread_hook
  sys.unraisablehook = unraisable_hook


ERROR_LOG_MAX_BYTES = 1 << 20  # an error log past this is moved to <name>.1 (one older file is kept)


def _error_log(workdir: str) -> str:
  """Where the traceback goes: <workdir>/error.log when that directory can be written, else one shared
  file in the temp directory (``fp4jax_error.log``, rotated like error.log), never one file per failure."""
  if os.path.isdir(workdir) and os.access(workdir, os.W_OK):
    return os.path.join(workdir, "error.log")
  return os.path.join(tempfile.gettempdir(), "fp4jax_error.log")


def _write_log(path: str) -> str | None:
  try:
    if os.path.exists(path) and os.path.getsize(path) > ERROR_LOG_MAX_BYTES:
      os.replace(path, path + ".1")
    with open(path, "a", encoding="utf-8") as f:
      f.write(f"$ {' '.join(sys.argv)}  (pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S %z')})\n"
              f"--- log ---\n{''.join(_LOG_TAIL.lines)}"
              + (f"({_LOG_TAIL.follow_ups} 'Event loop is closed' errors of tensorstore callbacks that arrived "
                 "after the failed save's event loop was closed are left out)\n" if _LOG_TAIL.follow_ups else "")
              + f"--- traceback ---\n{traceback.format_exc()}\n")
    return path
  except OSError:
    return None


def main(argv):
  if len(argv) > 1:
    return _fail(f"unexpected arguments {argv[1:]}; use --config.<field>=<value>", EXIT_USAGE)
  if not flags.FLAGS["verbosity"].present and not _DEBUG.value:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    logging.get_absl_handler().python_handler.stream = _LOG_TAIL  # warnings and errors: to error.log on failure
  if not _DEBUG.value:
    _quiet_background_errors()
  config = _load_config()
  workdir = _WORKDIR.value or os.path.join("runs", config.name)
  if supervise.supervised() and jax.process_count() > 1:
    _native_stderr_to_log(workdir)
  import training  # pylint: disable=g-import-not-at-top  (after jax.distributed: see _initialize_distributed)
  from training import preempt  # pylint: disable=g-import-not-at-top
  from training import sharding  # pylint: disable=g-import-not-at-top
  from tools import prove  # pylint: disable=g-import-not-at-top
  prove.register()   # impl=None proves the kernels it meets on this GPU (nothing to prove elsewhere)
  try:
    if _COMPILATION_CACHE.value:
      sharding.use_compilation_cache(_COMPILATION_CACHE.value)
    if _ALLOW_CONFIG_CHANGE.value:
      config.allow_config_change = True
    summary = training.train_and_evaluate(config, workdir)
  except training.TrainingError as e:
    # Another run's work directory is not this run's to write an error log into.
    log = None if isinstance(e, training.WorkdirInUse) else _write_log(_error_log(workdir))
    if _DEBUG.value:
      traceback.print_exc()
    prefix = "training diverged: " if isinstance(e, training.TrainingDiverged) else ""
    return _fail(prefix + str(e), e.exit_code, log=log)
  except OSError as e:
    log = _write_log(_error_log(workdir))
    if _DEBUG.value:
      traceback.print_exc()
    if e.errno in _STORAGE_ERRNOS:
      return _fail(f"writing {e.filename or 'to the work directory'} failed: {e.strerror}; free space or fix the "
                   f"storage, then run the same command again to resume from the latest checkpoint",
                   training.StorageError.exit_code, log=log)
    return _fail(f"unexpected I/O error: {e}; check the paths in the config and the work directory",
                 EXIT_UNEXPECTED, log=log)
  except KeyboardInterrupt:  # only outside a run's signal handling (training.preempt handles Ctrl-C in a run)
    return _fail("interrupted by Ctrl-C; nothing was saved by this interruption (the checkpoints on disk are "
                 "as the run left them)", EXIT_INTERRUPTED)
  except Exception as e:  # pylint: disable=broad-except  (a bug: say so, keep the traceback)
    log = _write_log(_error_log(workdir))
    if _DEBUG.value:
      traceback.print_exc()
    return _fail(f"unexpected {type(e).__name__}: {str(e).strip()[:500]}. This is a bug in fp4jax or a "
                 "dependency; please report it with the traceback", EXIT_UNEXPECTED, log=log)
  if summary["status"] == "stopped":  # 143 SIGTERM, 130 SIGINT: never 0
    # Everything is written and closed; the interpreter's teardown (the data loader's threads, JAX's
    # clients) takes seconds a scheduler's grace period may not have, so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(preempt.exit_code(summary.get("signal") or "SIGTERM"))  # pylint: disable=protected-access
  return 0 if summary["status"] in ("done", "halted") else EXIT_UNEXPECTED


def run() -> None:
  """The ``fp4jax-train`` command (``python train.py`` and ``python -m tools.train`` call it too)."""
  repeated = _repeated_flag(_joined(sys.argv[1:]))
  if repeated:
    sys.exit(_fail(repeated, EXIT_USAGE))
  sys.argv = [sys.argv[0]] + [_in_repository(a) for a in _joined(sys.argv[1:])]
  if _wants_distributed(sys.argv) and not supervise.supervised() and not any(
      a in ("-h", "--help", "-help", "--helpfull", "--helpshort") for a in sys.argv[1:]):
    sys.exit(supervise.supervise(sys.argv))  # see tools/supervise.py: one line, even when JAX aborts
  app.run(main, flags_parser=_parse_flags)


def _repeated_flag(args: list[str]) -> str | None:
  """The error for a flag given twice (absl's parser keeps the last value without a word), else None."""
  seen: dict[str, str] = {}
  for i, arg in enumerate(args):
    if arg == "--":
      break
    name, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or not name:
      continue
    if not has_value:
      following = args[i + 1] if i + 1 < len(args) else ""
      value = following if following and not following.startswith("-") else "(no value)"
    if name in seen:
      return (f"--{name} is given twice, {seen[name]!r} and then {value!r}; give each flag once (the last would "
              "win without a word)")
    seen[name] = value
  return None


def _joined(args: list[str]) -> list[str]:
  """``--config PATH`` as ``--config=PATH`` (so that the path can be resolved like the ``=`` form)."""
  out, i = [], 0
  while i < len(args):
    if args[i] == "--config" and i + 1 < len(args):
      out.append("--config=" + args[i + 1])
      i += 2
    else:
      out.append(args[i])
      i += 1
  return out


if __name__ == "__main__":
  run()
