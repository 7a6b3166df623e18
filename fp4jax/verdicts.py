"""On-device verdicts: what ``impl=None`` learns on *this* device, kept on disk, filled by a prover.

A verdict is the outcome of proving one candidate, named "<op>/<fmt>" with op one of ``KERNEL_OPS``,
"native_gemm" (the Blackwell block-scaled GEMM), "mosaic_gemm" (fp4jax's own one, on Mosaic GPU) or a kernel outside the library (fmt ``MODEL_FMT``: a
model's kernel, ``dispatch.model_kernel_default``), on one device key (device kind, driver,
jax, fp4jax): "faster" (bit-exact with its XLA twin, or for a model op within its stated tolerance,
and faster: use it), "slower" (exact, not faster),
"differs" (never use it), "error" (it did not compile or run), "undecided" (the time budget ran out
first). ``decide`` turns it into True (use) / False (do not) / None (no verdict: the recorded lab
evidence decides, ``VERIFIED_KERNELS`` / ``NATIVE_DEFAULTS``).

This module is plain data and one hook: it never runs a kernel. The harness ``tools.prove`` (above the
library and the models) ``register``s the prover in the processes that prove (the entry points, or a
program's own ``tools.prove.register()``); without it, and for processes with no device to prove (no
GPU), ``decide`` answers None. Files: ``<dir>/<digest of the key>.json``, written atomically; a file
that does not parse, has another schema or key, or holds a malformed entry is ignored (re-proved and
rewritten), never trusted. An "undecided" entry is retried by later processes, at most ``MAX_ATTEMPTS``.

Environment: FP4JAX_PROOF=off turns it all off (neither proves nor reads); FP4JAX_PROOF_BUDGET_S the
seconds one process may spend proving (default 20; checked between steps, so one compile may overrun
it); FP4JAX_PROOF_DIR the directory (default: beside JAX's compilation cache when one is set, else
~/.cache/fp4jax/kernel_verdicts).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Callable, Protocol

PROOF_ENV = "FP4JAX_PROOF"
BUDGET_ENV = "FP4JAX_PROOF_BUDGET_S"
DIR_ENV = "FP4JAX_PROOF_DIR"
DEFAULT_BUDGET_S = 20.0
SCHEMA = 1
VERDICTS = ("faster", "slower", "differs", "error", "undecided")
REFUSED = ("differs", "error")   # printed once per process, with the command that reproduces them
MAX_ATTEMPTS = 3
NATIVE_OP = "native_gemm"
MOSAIC_OP = "mosaic_gemm"   # fp4jax's tcgen05 GEMM on Mosaic GPU (kernels.mosaic_gemm), vs the XLA path
MODEL_FMT = "float32"     # the "fmt" of a model op's verdict ("ssd/float32"): its kernels compute in float32
_OFF = ("off", "0", "false", "no")
_ON = ("", "on", "1", "true", "yes")


class Prover(Protocol):
  """What ``tools.prove.register`` installs."""

  def key(self) -> dict | None:
    """This process's device key (JSON-able), or None where there is nothing to prove (no GPU)."""

  def prove(self, op: str, fmt: str, deadline: float) -> dict:
    """One entry: {"verdict": one of VERDICTS, "summary": str, "command": str, "evidence": dict},
    stopping with "undecided" once ``time.perf_counter()`` passes ``deadline``."""


_prover: Prover | None = None
_files: dict[str, dict] = {}       # path -> the file's contents, as this process knows them
_spent = {"s": 0.0}                # seconds this process has spent proving
_tried: set[tuple[str, str]] = set()   # (path, name) proved by this process (no second try)
_printed: set[tuple[str, str]] = set()
_busy = [False]                    # a proof is running: impl=None inside it means the lab default
_print: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)


def register(prover: Prover | None) -> Prover | None:
  """Install the prover (None removes it); returns the previous one."""
  global _prover
  previous, _prover = _prover, prover
  return previous


def enabled() -> bool:
  value = os.environ.get(PROOF_ENV, "").strip().lower()
  if value not in _OFF + _ON:
    raise ValueError(f"{PROOF_ENV}={value!r}; set it to 'off' (no on-device proof) or 'on' / leave it unset")
  return value not in _OFF


def budget_s() -> float:
  value = os.environ.get(BUDGET_ENV, "").strip()
  try:
    budget = DEFAULT_BUDGET_S if not value else float(value)
  except ValueError:
    budget = -1.0
  if not budget >= 0:
    raise ValueError(f"{BUDGET_ENV}={value!r}; set it to a number of seconds >= 0 (default {DEFAULT_BUDGET_S:g})")
  return budget


def directory() -> str:
  """FP4JAX_PROOF_DIR, else ``kernel_verdicts`` beside JAX's compilation cache directory, else
  ~/.cache/fp4jax/kernel_verdicts (training's compilation cache is ~/.cache/fp4jax/jax_compilation_cache)."""
  if os.environ.get(DIR_ENV):
    return os.path.expanduser(os.environ[DIR_ENV])
  cache = _compilation_cache_dir()
  if cache:
    return os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(cache))), "kernel_verdicts")
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(base), "fp4jax", "kernel_verdicts")


def _compilation_cache_dir() -> str | None:
  jax = sys.modules.get("jax")   # read, never imported here: a process without jax has no cache
  try:
    return jax.config.jax_compilation_cache_dir if jax is not None else None
  except AttributeError:   # pragma: no cover - a jax without the option
    return None


def path_for(key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(directory(), f"{digest}.json")


def name_of(op: str, fmt: str) -> str:
  return f"{op}/{fmt}"


def load(path: str, key: dict) -> dict | None:
  """The file's contents when it is a valid verdict file for ``key``, else None (with one line saying why)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    why = _invalid(data, key)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    why = f"{type(e).__name__}: {e}"
  if why:
    _print(f"fp4jax: ignoring the kernel verdict file {path} ({why}); proving again")
    return None
  return data


def _invalid(data, key) -> str | None:
  if not isinstance(data, dict) or data.get("schema") != SCHEMA:
    return f"not a schema-{SCHEMA} verdict file"
  if data.get("key") != key:
    return "written for another device key"
  entries = data.get("verdicts")
  if not isinstance(entries, dict):
    return "no verdicts table"
  for name, entry in entries.items():
    if not (isinstance(name, str) and name.count("/") == 1 and isinstance(entry, dict)
            and entry.get("verdict") in VERDICTS and isinstance(entry.get("evidence"), dict)
            and isinstance(entry.get("summary"), str) and isinstance(entry.get("command"), str)
            and isinstance(entry.get("attempts", 1), int)):
      return f"malformed entry {name!r}"
  return None


def save(path: str, data: dict):
  """Atomic write (a temporary file renamed over ``path``); an unwritable directory costs nothing but
  the cache (the verdicts stay in this process)."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:
    _print(f"fp4jax: could not write the kernel verdicts to {path} ({e}); they hold for this process only")


def record(key: dict, name: str, entry: dict) -> dict:
  """Store one entry for ``key`` (in this process and on disk); returns the file's contents."""
  path = path_for(key)
  data = _files.get(path) or load(path, key) or new_file(key)
  data["verdicts"][name] = entry
  _files[path] = data
  save(path, data)
  return data


def new_file(key: dict) -> dict:
  return {"schema": SCHEMA, "key": key, "created": _now(), "verdicts": {}}


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def entry_for(op: str, fmt: str, device_kind: str | None = None) -> dict | None:
  """The verdict entry for (op, fmt) on this device, proving it first when this process meets it
  without one (within the budget); None when off, with no prover, with no device to prove, or when
  ``device_kind`` (the kind the program is compiled for) is not this process's device."""
  if _busy[0] or _prover is None or not enabled():
    return None
  key = _prover.key()
  if key is None or (device_kind is not None and key.get("device") != device_kind):
    return None
  path, name = path_for(key), name_of(op, fmt)
  if path not in _files:
    _files[path] = load(path, key) or new_file(key)
  entry = _files[path]["verdicts"].get(name)
  retry = (entry is not None and entry["verdict"] == "undecided"
           and entry.get("attempts", 1) < MAX_ATTEMPTS and (path, name) not in _tried)
  if entry is None or retry:
    entry = _prove(key, op, fmt, attempts=1 + (entry.get("attempts", 1) if retry else 0))
    record(key, name, entry)
    _tried.add((path, name))
  if entry["verdict"] in REFUSED and (path, name) not in _printed:
    _printed.add((path, name))
    _print(f"fp4jax: {name} {entry['verdict']} on this device ({key.get('device')}): {entry['summary']}; "
           f"impl=None will not use it. Reproduce: {entry['command']}")
  return entry


def _prove(key: dict, op: str, fmt: str, attempts: int) -> dict:
  left = budget_s() - _spent["s"]
  start = time.perf_counter()
  _busy[0] = True
  try:
    entry = _prover.prove(op, fmt, start + left)
  finally:
    _busy[0] = False
    _spent["s"] += time.perf_counter() - start
  return dict(entry, attempts=attempts, date=_now())


def decide(op: str, fmt: str, device_kind: str | None = None) -> bool | None:
  """True: this device proved it exact and faster; False: it differs, failed or is not faster here;
  None: no verdict (off, no GPU, no prover, undecided, or a program for another ``device_kind`` than
  this process's, as a deviceless compile is): the lab evidence decides."""
  entry = entry_for(op, fmt, device_kind)
  if entry is None or entry["verdict"] == "undecided":
    return None
  return entry["verdict"] == "faster"


def forget():
  """Drop what this process knows (the files stay): the next ``decide`` reads the disk again."""
  _files.clear()
  _tried.clear()
  _printed.clear()
  _spent["s"] = 0.0
