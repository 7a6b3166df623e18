"""The report's compiled programs on disk: one deviceless compile per (row, variant), kept until the code
that makes the program changes.

The key is the git tree hashes of everything that shapes the compiled program (fp4jax/, models/,
training/, configs/, bench/predict/'s gpu_aot.py, deviceless.py, programs.py, regroup.py, summary.py and
pgle_profile.py, bench/scale.py, bench/predict/gpu_targets/) as they are in the working tree (``code_hash``:
uncommitted changes count, a commit of the same content does not), plus the row's bench/predict/gpu_aot.py
arguments and its environment. The cost model (bench/predict/hlo_cost.py and the tables it reads) is not in the
key: it is applied to the cached HLO at every run, so a change to the ruler re-prices every row without
recompiling it. A row whose config profiles its step (``config.pgle_steps``) is scheduled by the ruler's costs of
its first compile (bench/predict/pgle_profile.py): after a change to the ruler such a row keeps the schedule the
older ruler's profile gave it until it is compiled again (``--recompile``).

Each entry is ``<key>.json`` (bench/predict/gpu_aot.py's JSON: memory, parameters, tokens; or the failure) and
``<key>.hlo.gz`` (the optimized HLO text).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM_PATHS = ("fp4jax", "models", "training", "configs", "bench/predict/gpu_aot.py",
                 "bench/predict/deviceless.py", "bench/predict/programs.py", "bench/predict/regroup.py",
                 "bench/predict/summary.py", "bench/predict/pgle_profile.py",
                 "bench/scale.py", "bench/predict/gpu_targets")
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "fp4jax", "report")
DEVICELESS_ENV = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu,cuda"}
# The deviceless sm_100 compile of bf16 dots needs XLA's Triton GEMM emitter off (docs/PERF.md, 2026-12-01:
# "Couldn't find output tile sizes"); a GPU process would autotune instead. cuBLAS GEMMs on every B200 row.
TARGET_ENV = {"b200": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}}
# XLA's own estimate (bench/predict/xla_schedule.py): the latency-hiding scheduler's schedule, with its estimated
# start and end of every instruction, dumped during the same compile (the dump changes no program).
SCHEDULE_DUMP_FLAGS = ("--xla_dump_latency_hiding_schedule=true --xla_dump_hlo_module_re=.*train_step.* "
                       "--xla_dump_hlo_pass_re=^$ --xla_dump_hlo_as_text=false")


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def code_hash(paths=PROGRAM_PATHS) -> str:
  """The git tree (or blob) hash of each of ``paths`` as it is in the working tree (uncommitted and untracked
  files included, ignored ones not), joined: the committed tree hashes when the tree is clean, so a commit
  of the same content keeps the key. Written through a scratch index; the real index is untouched."""
  import shutil   # pylint: disable=import-outside-toplevel
  import tempfile   # pylint: disable=import-outside-toplevel
  git_dir = _git("rev-parse", "--git-dir").strip()
  index = os.path.join(git_dir if os.path.isabs(git_dir) else os.path.join(ROOT, git_dir), "index")
  with tempfile.TemporaryDirectory() as tmp:
    scratch = os.path.join(tmp, "index")
    shutil.copy(index, scratch)
    env = dict(os.environ, GIT_INDEX_FILE=scratch)
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, env=env, capture_output=True, text=True,
                                    check=True).stdout.strip()
    run("add", "-A", "--", *paths)
    tree = run("write-tree")
    return ",".join(f"{p}={run('rev-parse', f'{tree}:{p}')}" for p in paths)


def code_commit(paths=PROGRAM_PATHS) -> str:
  """The commit whose programs the cached rows are (short hash), "+ uncommitted changes" when ``paths`` differ
  from it: every row the report prices was compiled from this code (its key holds the code's hash)."""
  head = _git("rev-parse", "--short", "HEAD").strip()
  dirty = _git("status", "--porcelain", "--", *paths).strip()
  return head + (" + uncommitted changes" if dirty else "")


def entry_key(code: str, argv: list[str], env: dict) -> str:
  payload = json.dumps(dict(code=code, argv=argv, env=sorted(env.items())), sort_keys=True)
  return hashlib.sha256(payload.encode()).hexdigest()[:24]


class Cache:
  def __init__(self, directory: str = DEFAULT_DIR):
    self.dir = directory
    os.makedirs(directory, exist_ok=True)
    self._code = None

  @property
  def code(self) -> str:
    if self._code is None:
      self._code = code_hash()
    return self._code

  def key(self, argv: list[str], target: str) -> str:
    return entry_key(self.code, argv, TARGET_ENV.get(target, {}))

  def paths(self, key: str) -> tuple[str, str]:
    return os.path.join(self.dir, f"{key}.json"), os.path.join(self.dir, f"{key}.hlo.gz")

  def load(self, key: str):
    """``(result json, hlo text or None)``, or None when the entry is missing."""
    meta, hlo = self.paths(key)
    if not os.path.exists(meta):
      return None
    with open(meta, encoding="utf-8") as f:
      result = json.load(f)
    text = None
    if os.path.exists(hlo):
      with gzip.open(hlo, "rt", encoding="utf-8") as f:
        text = f.read()
    return result, text

  def compile(self, argv: list[str], target: str, timeout_s: float, log=print) -> str:
    """Runs bench/predict/gpu_aot.py with ``argv`` in a subprocess and stores what it left (a failure too:
    its last error line). Returns the key."""
    key = self.key(argv, target)
    meta, hlo = self.paths(key)
    tmp_json, tmp_hlo = meta + ".tmp", hlo[:-3] + ".tmp"
    # the program's XLA options are the target's (the key's), not whatever XLA_FLAGS the caller's shell holds
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(DEVICELESS_ENV, **TARGET_ENV.get(target, {}))
    dump = os.path.join(self.dir, f"{key}.dump")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} {SCHEDULE_DUMP_FLAGS}").strip()
    cmd = [sys.executable, os.path.join(ROOT, "bench", "predict", "gpu_aot.py"), *argv, "--json", tmp_json,
           "--hlo", tmp_hlo]
    log(f"  compiling: {' '.join(argv)}")
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
      rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
      rc, out = -1, f"timed out after {timeout_s:.0f} s " + str(e.stdout or "")[-2000:]
    result = None
    if os.path.exists(tmp_json):
      with open(tmp_json, encoding="utf-8") as f:
        result = json.load(f)
      os.remove(tmp_json)
    first = (result or {}).get("results", [{}])[0] if result else {}
    error = first.get("error") if result else None
    if result is None or error or not os.path.exists(tmp_hlo):
      result = dict(error=_short_reason(error or out), rc=rc, log_tail=out[-4000:])
    else:
      with open(tmp_hlo, "rb") as src, gzip.open(hlo, "wb") as dst:
        dst.write(src.read())
    if os.path.exists(tmp_hlo):
      os.remove(tmp_hlo)
    _keep_schedule(dump, self.paths(key)[0][:-5] + ".schedule.txt.gz")
    result["argv"], result["code"], result["wall_s"] = argv, self.code, round(time.time() - t0, 1)
    result["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    with open(meta, "w", encoding="utf-8") as f:
      json.dump(result, f)
    log(f"  done in {result['wall_s']:.0f} s" + (f": does not compile: {result['error']}" if result.get("error") else ""))
    return key


def _keep_schedule(dump: str, dest: str) -> None:
  """Keeps the latency-hiding scheduler's dumped schedule of the train step (gzipped at ``dest``, the
  schedules of every scheduled computation concatenated) and deletes the rest of the dump."""
  import shutil   # pylint: disable=import-outside-toplevel
  if not os.path.isdir(dump):
    return
  names = sorted(n for n in os.listdir(dump) if n.endswith(".schedule.txt"))
  if names:
    with gzip.open(dest, "wt", encoding="utf-8") as out:
      for n in names:
        with open(os.path.join(dump, n), encoding="utf-8") as f:
          out.write(f.read())
  shutil.rmtree(dump, ignore_errors=True)


def load_schedule(cache_dir: str, key: str) -> str | None:
  path = os.path.join(cache_dir, f"{key}.schedule.txt.gz")
  if not os.path.exists(path):
    return None
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return f.read()


def _short_reason(text: str) -> str:
  """The last line of a failure that names an error, trimmed to one line."""
  lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
  for l in reversed(lines):
    if "Error" in l or "error" in l or "exception" in l.lower():
      return l[:200]
  return (lines[-1] if lines else "no output")[:200]
