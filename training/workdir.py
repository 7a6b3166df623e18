"""The work directory's own files: a writability check, the config record and its history, the error log.

  config.json           the config of the latest start (or resume) of the run
  config_history.jsonl  one line per start: time, step, the config, and what changed since the last start
  error.log             the traceback of a failed start or run (``train.py`` points to it)

A resume must use the config the checkpoints were made with: ``config_changes`` lists every field that
differs from the last start, and ``check_resume`` refuses the ones that change the result (recipe, model,
optimizer, data, seed, batch, steps) unless ``config.allow_config_change`` says it is intended. An
unreadable config.json falls back to the last complete entry of config_history.jsonl (with a warning
naming the file); when neither can be read, a resume refuses (``RunRecordUnreadable``). Fields that
only change how the run is watched or stored (``FREE_FIELDS``) may change freely.
"""
from __future__ import annotations

import dataclasses
import copy
import datetime
import json
import os

from training import config as config_lib
from training import extend
from training.errors import ConfigChangedError, RunRecordUnreadable, WorkdirError

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.jsonl"
ERROR_LOG = "error.log"
# Fields added to the config after runs were made, with the value that reproduces those runs.
ADDED_FIELDS = {"sr_bits": "jax", "data.raw_bytes": False, "data.text_column": "text", "micro_batches": 1,
                "data.document_masking": False, "pgle_steps": 0}
# Prefixes of the fields a resume may change without --allow_config_change. Like the mesh, micro_batches changes
# how a step is computed (summation order, stochastic rounding's keys), not its data, schedule or batch.
FREE_FIELDS = ("name", "halt_after", "log_every", "profile_steps", "pgle_steps", "eval.", "checkpoint.", "health.",
               "mesh.", "micro_batches", "report.", "xla_options.", "data.read_threads", "data.prefetch", "init_from",
               "allow_config_change", "preemption_grace_s", "lock_stale_s", "peer_timeout_s",
               "model.release_dx_with_dw")


def prepare(workdir: str, process_index: int = 0) -> str:
  """Creates ``workdir`` if needed and checks it can be written; its absolute path. Raises WorkdirError."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"the work directory {path} is a file, not a directory; pass another --workdir or "
                       "move the file away")
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test.{process_index}")
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(f"the work directory {path} cannot be written ({e.strerror or e}); pass a --workdir "
                       "this user can write (a checkpoint and metrics go there), or fix its permissions") from None
  return path


def _flat(value, prefix="") -> dict:
  if isinstance(value, dict):
    out = {}
    for k, v in value.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: value}


@dataclasses.dataclass(frozen=True)
class Record:
  """The run's last recorded config, as read back: ``config`` (plain) or None when nothing readable is
  there; ``source`` the file it came from; ``problems`` one line per record file that exists but cannot be
  read (truncated, empty, not JSON, not a config)."""
  config: dict | None
  source: str | None = None
  problems: tuple = ()

  @property
  def unreadable(self) -> bool:
    """Something was recorded, yet no config could be read back from it."""
    return self.config is None and bool(self.problems)


def _read_config_file(path: str) -> dict:
  """The plain config in ``path``; OSError or ValueError (with the reason) when it cannot be read."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if not text.strip():
    raise ValueError("the file is empty")
  value = json.loads(text)
  if not isinstance(value, dict):
    raise ValueError(f"it holds a JSON {type(value).__name__}, not a config")
  return value


def _last_history_config(path: str) -> tuple[dict, int]:
  """(config, line number) of the last complete entry of config_history.jsonl; OSError or ValueError."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  for number in range(len(lines), 0, -1):
    try:
      entry = json.loads(lines[number - 1])
    except ValueError:
      continue   # a line cut short by a crash while appending: an earlier start's entry is the last one
    if isinstance(entry, dict) and isinstance(entry.get("config"), dict):
      return entry["config"], number
  raise ValueError("no line holds a complete entry" if lines else "the file is empty")


def _why(error: Exception) -> str:
  if isinstance(error, OSError):
    return error.strerror or str(error)
  return str(error) or type(error).__name__


def last_config(workdir: str) -> Record:
  """The config of the run's latest start: config.json, else (unreadable or missing) the last complete
  entry of config_history.jsonl, with a problem line for each record file that could not be read."""
  problems = []
  config_path, history_path = os.path.join(workdir, CONFIG_FILE), os.path.join(workdir, HISTORY_FILE)
  try:
    return Record(_read_config_file(config_path), config_path)
  except FileNotFoundError:
    pass
  except (OSError, ValueError) as e:
    problems.append(f"{config_path} cannot be read ({_why(e)})")
  try:
    config, line = _last_history_config(history_path)
  except FileNotFoundError:
    return Record(None, None, tuple(problems))
  except (OSError, ValueError) as e:
    return Record(None, None, (*problems, f"{history_path} cannot be read ({_why(e)})"))
  return Record(config, f"{history_path}, line {line}", tuple(problems))


def config_changes(before: dict, config) -> dict[str, tuple]:
  """{dotted field: (old, new)} for every field of ``config`` that differs from the plain config ``before``."""
  old, new = _flat(before), _flat(config_lib.to_plain(config))
  missing = object()
  # A field added since the run started is no change while it keeps the value the run had without it: a model
  # field's None (the preset's value) or a top-level field's default (``ADDED_FIELDS``).
  return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
          if old.get(k, missing) != new.get(k, missing)
          and not (k not in old and k.startswith("model.") and new.get(k) is None)
          and not (k not in old and k in ADDED_FIELDS and new.get(k) == ADDED_FIELDS[k])}


def changes_since(before: dict, config) -> dict[str, tuple]:
  """``config_changes`` of ``config`` against a run's record ``before``. What ``config`` leaves unchosen and the
  run chose when it started is the record's, as on a resume of the run: the stochastic-rounding stream
  (``sr_bits``) and the model's vocabulary (``config_lib.keep_recorded_vocab_size``)."""
  config = copy.deepcopy(config)
  if config.get("sr_bits") is None:
    config.sr_bits = before["sr_bits"] if "sr_bits" in before else ADDED_FIELDS["sr_bits"]
  config_lib.keep_recorded_vocab_size(config, before, tokens=0)   # with a record, the tokenizer's size is unused
  return config_changes(before, config)


def is_free(field: str) -> bool:
  return any(field == p or (p.endswith(".") and field.startswith(p)) for p in FREE_FIELDS)


@dataclasses.dataclass(frozen=True)
class Resume:
  """What ``check_resume`` found: the checkpoint step resumed from (None: a fresh start), every field changed
  since the last start (for config_history.jsonl), and the lines to print about them."""
  step: int | None
  changes: dict
  messages: tuple = ()


def check_resume(workdir: str, config, step: int | None) -> Resume:
  """The resume plan; ConfigChangedError when a field that changes the result differs and is not allowed.

  A different ``steps`` is allowed as an extension (or an earlier end) when it keeps the learning rate and
  recipe of every step done so far (``training.extend``); its schedule rule is printed.
  """
  record = last_config(workdir)
  allowed = config.get("allow_config_change", False)
  messages = [f"warning: {p}; the run's config is taken from {record.source} instead"
              for p in record.problems if record.config is not None]
  before = record.config
  if before is None:
    if step is not None and record.unreadable:
      problems = "; ".join(record.problems)
      if not allowed:
        raise RunRecordUnreadable(
            f"the work directory {workdir} holds a run at step {step}, but its config record cannot be read: "
            f"{problems}. Without it the resume cannot check that the config is the run's; pass "
            "--allow_config_change (or --config.allow_config_change=True) if the config given is the run's, "
            "or use a new --workdir")
      messages.append(f"warning: {problems}; resuming at step {step} without checking the config "
                      "(allowed by allow_config_change)")
    elif step is not None:
      messages.append(f"warning: the work directory {workdir} has checkpoints but no config record "
                      f"({CONFIG_FILE}, {HISTORY_FILE}); the resume cannot check the config")
    return Resume(step, {}, tuple(messages))
  changes = changes_since(before, config)
  if step is None:
    return Resume(None, changes, tuple(messages))
  guarded = {k: v for k, v in changes.items() if not is_free(k)}
  steps_refused = None
  if "steps" in guarded and "steps" in before:
    verdict = extend.plan(before, config, step)
    if verdict.accepted:
      del guarded["steps"]
      messages.append(verdict.message)
    else:
      steps_refused = verdict.message
  if guarded and not allowed:
    if steps_refused is not None and len(guarded) == 1:
      raise extend.refuse(steps_refused, workdir)
    diff = "; ".join(f"{k}: {old!r} -> {new!r}" + (f" ({steps_refused})" if k == "steps" and steps_refused else "")
                     for k, (old, new) in guarded.items())
    raise ConfigChangedError(
        f"the work directory {workdir} holds a run at step {step} made with another config; "
        f"{len(guarded)} field(s) differ from its record ({CONFIG_FILE}): {diff}. Resuming would continue it with "
        "different settings; pass --allow_config_change (or --config.allow_config_change=True) to accept "
        f"{'all of them' if len(guarded) > 1 else 'it'}, give the run's values, or use a new --workdir")
  if guarded:
    messages.append("config changed on resume (allowed by allow_config_change): "
                    + "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in guarded.items()))
    jump = extend.lr_jump(before, config, step)
    if jump:
      messages.append(f"warning: {jump}")
  return Resume(step, changes, tuple(messages))


def record_config(workdir: str, config, *, step: int, event: str, changes: dict | None = None) -> None:
  """Writes config.json and appends a line to config_history.jsonl."""
  plain = config_lib.to_plain(config)
  entry = dict(time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), event=event,
               step=step, changes={k: list(v) for k, v in (changes or {}).items()}, config=plain)
  with open(os.path.join(workdir, HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(entry) + "\n")
  tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(plain, f, indent=2)
  os.replace(tmp, os.path.join(workdir, CONFIG_FILE))
