"""The work directory's own files: a writability check, the config record and its history, the error log.

  config.json           the config of the latest start (or resume) of the run
  config_history.jsonl  one line per start: time, step, the config, and what changed since the last start
  error.log             the traceback of a failed start or run (``train.py`` points to it)

A resume must use the config the checkpoints were made with: ``config_changes`` lists every field that
differs from the last start, and ``check_resume`` refuses the ones that change the result (recipe, model,
optimizer, data, seed, batch, steps) unless ``config.allow_config_change`` says it is intended. Fields that
only change how the run is watched or stored (``FREE_FIELDS``) may change freely.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os

from training import config as config_lib
from training import extend
from training.errors import ConfigChangedError, WorkdirError

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.jsonl"
ERROR_LOG = "error.log"
# Prefixes of the fields a resume may change without --allow_config_change.
FREE_FIELDS = ("name", "halt_after", "log_every", "profile_steps", "eval.", "checkpoint.", "health.", "mesh.",
               "data.read_threads", "data.prefetch", "init_from", "allow_config_change", "preemption_grace_s",
               "lock_stale_s", "peer_timeout_s")


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


def last_config(workdir: str) -> dict | None:
  """The config (plain) of the run's latest start, or None when there is none (or it is unreadable)."""
  try:
    with open(os.path.join(workdir, CONFIG_FILE), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def config_changes(before: dict, config) -> dict[str, tuple]:
  """{dotted field: (old, new)} for every field of ``config`` that differs from the plain config ``before``."""
  old, new = _flat(before), _flat(config_lib.to_plain(config))
  missing = object()
  # A model field added since the run started (absent before, None now: the preset's value) is no change.
  return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
          if old.get(k, missing) != new.get(k, missing)
          and not (k not in old and k.startswith("model.") and new.get(k) is None)}


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
  before = last_config(workdir)
  if before is None:
    return Resume(step, {})
  changes = config_changes(before, config)
  if step is None:
    return Resume(None, changes)
  guarded = {k: v for k, v in changes.items() if not is_free(k)}
  allowed = config.get("allow_config_change", False)
  messages = []
  if "steps" in guarded and "steps" in before:
    verdict = extend.plan(before, config, step)
    if verdict.accepted:
      del guarded["steps"]
      messages.append(verdict.message)
    elif not allowed:
      raise extend.refuse(verdict.message, workdir)
  if guarded and not allowed:
    diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in guarded.items())
    raise ConfigChangedError(
        f"the work directory {workdir} holds a run at step {step} made with another config: {diff}. Resuming "
        "would continue it with different settings; pass --allow_config_change (or "
        "--config.allow_config_change=True) if that is intended, or use a new --workdir")
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
