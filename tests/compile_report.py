"""Where the suite's time goes: XLA compiles per test, eager (op by op) or whole programs, and the library
entry points whose eager calls compile the most.

    FP4JAX_COMPILE_REPORT=/tmp/compiles python -m pytest -n 2 tests/test_dot.py   # tests/conftest.py loads it
    python tests/compile_report.py /tmp/compiles                                  # the summary

Each process (xdist worker) writes ``<dir>/<worker>.json``: per test its CPU seconds and the seconds and
count of its compiles, split into eager ones (a jax function compiled alone because it ran outside any jit:
``jit(multiply)``, ``jit(_where)``, ``jit(_normal)``, ...) and whole programs; per entry point (the first
frame of fp4jax/, models/, training/, tools/ or scripts/ that a test called, or the test's own line) the
seconds of the eager compiles under it. Compile seconds are wall time, so on a shared machine they include
waiting; compare runs made under the same load.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
import time
import traceback

_FINISHED = re.compile(r"Finished XLA compilation of (?:jit|pmap)\((.+?)\) in ([0-9.e-]+) sec")
_LIBRARY = ("fp4jax/", "models/", "training/", "tools/", "scripts/", "tests/")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _jax_function_names() -> set[str]:
  """Names of the functions jax's own modules define (what an eager call of jax compiles alone)."""
  names = set()
  for name, module in list(sys.modules.items()):
    if (name == "jax" or name.startswith("jax.")) and module is not None:
      names.update(k for k, v in vars(module).items() if callable(v))
  return names


class Recorder(logging.Handler):
  """A logging handler on jax's compile log: each finished compile charged to the running test."""

  def __init__(self, out_dir: str):
    super().__init__(logging.DEBUG)
    self.out_dir = out_dir
    self.test = None
    self.tests = collections.defaultdict(collections.Counter)
    self.entries = collections.Counter()
    self.jax_names = None

  def emit(self, record):
    m = _FINISHED.search(record.getMessage())
    if not m or self.test is None:
      return
    if self.jax_names is None:
      self.jax_names = _jax_function_names()
    name, seconds = m.group(1), float(m.group(2))
    kind = "eager" if name in self.jax_names else "program"
    counts = self.tests[self.test]
    counts[kind + "_s"] += seconds
    counts[kind + "_n"] += 1
    if kind == "eager":
      self.entries[_entry(traceback.extract_stack())] += seconds

  def write(self):
    os.makedirs(self.out_dir, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(self.out_dir, f"{worker}.json"), "w", encoding="utf-8") as f:
      json.dump({"tests": {k: dict(v) for k, v in self.tests.items()}, "entries": dict(self.entries)}, f)


def _entry(stack) -> str:
  """The first repository frame below the outermost test frame (the library function the test called), else
  the test's own innermost frame."""
  entry = "?"
  in_test = False
  for frame in stack:
    if not frame.filename.startswith(_ROOT):
      continue
    rel = frame.filename[len(_ROOT):]
    if not rel.startswith(_LIBRARY) or rel == "tests/compile_report.py":
      continue
    if rel.startswith("tests/"):
      in_test, entry = True, f"{rel}:{frame.name}"
    elif in_test:
      return f"{rel}:{frame.name}"
  return entry


def install(config, out_dir: str):
  """Registers the recorder with pytest and jax's compile log (tests/conftest.py, FP4JAX_COMPILE_REPORT)."""
  if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
    return   # the xdist controller runs no test: each worker records its own
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_log_compiles", True)
  recorder = Recorder(out_dir)
  logging.getLogger("jax").addHandler(recorder)
  config.pluginmanager.register(_Plugin(recorder), "fp4jax_compile_report")


class _Plugin:
  def __init__(self, recorder: Recorder):
    self.recorder = recorder

  def pytest_runtest_protocol(self, item):   # pylint: disable=unused-argument
    self.recorder.test = item.nodeid
    self.start = time.process_time()

  def pytest_runtest_logfinish(self, nodeid):
    self.recorder.tests[nodeid]["cpu_s"] += time.process_time() - self.start
    self.recorder.test = None

  def pytest_sessionfinish(self):
    self.recorder.write()


def summary(out_dir: str, top: int = 40) -> str:
  tests, entries = {}, collections.Counter()
  for name in sorted(os.listdir(out_dir)):
    if name.endswith(".json"):
      with open(os.path.join(out_dir, name), encoding="utf-8") as f:
        data = json.load(f)
      tests.update(data["tests"])
      entries.update(data["entries"])
  total = collections.Counter()
  for counts in tests.values():
    total.update(counts)
  lines = [f"{len(tests)} tests: CPU {total['cpu_s']:.0f} s in the test processes; compiles: eager "
           f"{total['eager_n']:.0f} ({total['eager_s']:.0f} s), whole programs {total['program_n']:.0f} "
           f"({total['program_s']:.0f} s)", "", "eager compile seconds by entry point:"]
  lines += [f"{s:8.1f}  {e}" for e, s in entries.most_common(top)]
  lines += ["", "tests by CPU seconds (eager s / program s):"]
  for nodeid, c in sorted(tests.items(), key=lambda kv: -kv[1].get("cpu_s", 0))[:top]:
    lines.append(f"{c.get('cpu_s', 0):7.1f}  ({c.get('eager_s', 0):.1f} / {c.get('program_s', 0):.1f})  {nodeid}")
  return "\n".join(lines)


if __name__ == "__main__":
  print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
