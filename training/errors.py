"""What can go wrong in a training run, one class per kind, each with the exit code ``train.py`` returns.

Every message says what happened, where, and how to fix it, in one paragraph; ``train.py`` prints it
without a traceback (``--debug`` shows the traceback; it is also written to ``<workdir>/error.log``).

  exit  class               when
  0     -                   finished, or halted after ``halt_after`` steps
  1     (anything else)     an unexpected error: a bug; the traceback is in <workdir>/error.log
  2     ConfigError         the config file, an override, or a field value is wrong
  3     DataError           the data sources are missing, unreadable, empty or do not fit the config
  4     WorkdirError        the work directory cannot be created or written (a file, read-only, ...), or
                            another run holds it (WorkdirInUse)
  5     CheckpointError     no checkpoint of the work directory (or of ``init_from``) can be restored
  6     ConfigChangedError  resuming with another recipe, optimizer, data or model config than the run's,
                            or with a run record that cannot be read (RunRecordUnreadable)
  7     StorageError        a checkpoint could not be written (no space left, I/O error)
  8     DistributedError    the multi-process set-up failed (coordinator unreachable, wrong process count)
  9     TrainingDiverged    the loss or gradient norm was non-finite too many steps in a row
  10    -                   a peer of a multi-process run stopped answering (``training.peers``; the
                            process exits at once with one line, it raises nothing)
  130   -                   stopped by SIGINT (Ctrl-C), 128 + 2 (``training.preempt``)
  143   -                   stopped by SIGTERM (a scheduler's preemption), 128 + 15
"""
from __future__ import annotations


class TrainingError(Exception):
  """Base of the errors a run reports to its user (never a bug): ``exit_code`` is ``train.py``'s status."""
  exit_code = 1


class ConfigError(TrainingError, ValueError):
  """A bad config, found before any compute."""
  exit_code = 2


class DataError(ConfigError):
  """Bad or missing input data, found before any compute."""
  exit_code = 3


class WorkdirError(TrainingError):
  """The work directory cannot be used."""
  exit_code = 4


class WorkdirInUse(WorkdirError):
  """Another live run holds the work directory's lock (``training.lock``)."""


class CheckpointError(TrainingError):
  """No checkpoint could be restored."""
  exit_code = 5


class ConfigChangedError(TrainingError):
  """A resume whose config differs from the run's in a field that changes the result."""
  exit_code = 6


class RunRecordUnreadable(ConfigChangedError):
  """A resume whose run record (config.json and config_history.jsonl) cannot be read, so its config cannot
  be checked."""


class StorageError(TrainingError):
  """A checkpoint could not be written; the earlier ones are intact."""
  exit_code = 7


class DistributedError(TrainingError):
  """``jax.distributed`` could not be set up."""
  exit_code = 8


class TrainingDiverged(TrainingError, RuntimeError):
  """The loss or gradient norm was non-finite for ``config.health.max_nonfinite_streak`` steps in a row."""
  exit_code = 9


EXIT_CODES = {cls.__name__: cls.exit_code for cls in (
    ConfigError, DataError, WorkdirError, CheckpointError, ConfigChangedError, StorageError, DistributedError,
    TrainingDiverged)}
