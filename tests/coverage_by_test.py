"""Per-test coverage contexts for ``scripts/coverage_gap.py --by_test`` (a pytest plugin, installed by
tests/conftest.py when ``FP4JAX_COVERAGE_BY_TEST=<dir>`` is set and the process runs under coverage).

Each test's lines are recorded under its pytest node id (parametrization included; its fixtures' set-up is
charged to the first test that asks for them), and so are the lines of the subprocesses it starts: every
``subprocess.Popen`` while a test runs gets an environment (the test's own ``env=`` or the process's) whose
coverage configuration names the test as its static context (``named``), and ``CONTEXT_ENV`` holds its node id
(scripts/coverage_gap.py's configuration reads it in the processes coverage starts otherwise). The
plugin also writes, per test process, ``<dir>/tests.<pid>.json``: each test's seconds (set-up, call and
tear-down), whether it started a subprocess, and that its subprocesses' lines carry its name.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import time

import pytest

CONTEXT_ENV = "FP4JAX_COVERAGE_TEST"   # coverage's [run] context = ${FP4JAX_COVERAGE_TEST} in a subprocess


class _Recorder:
  def __init__(self, out: str):
    import coverage  # pylint: disable=import-outside-toplevel
    self.cov = coverage.Coverage.current()
    self.path = os.path.join(out, f"tests.{os.getpid()}.json")
    self.tests: dict[str, dict] = {}
    self.running: str | None = None   # the node id of the test under way
    popen_init = subprocess.Popen.__init__

    def init(popen, *args, **kwargs):
      if self.running is not None:
        self.tests[self.running]["subprocess"] = True
        kwargs["env"] = named(os.environ if kwargs.get("env") is None else kwargs["env"], self.running)
      popen_init(popen, *args, **kwargs)

    subprocess.Popen.__init__ = init

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):   # pylint: disable=unused-argument
    self.running = os.environ[CONTEXT_ENV] = item.nodeid
    self.tests[item.nodeid] = {"seconds": 0.0, "subprocess": False, "named_subprocesses": True}
    if self.cov is not None:
      self.cov.switch_context(item.nodeid)
    start = time.perf_counter()
    yield
    self.tests[item.nodeid]["seconds"] = time.perf_counter() - start
    if self.cov is not None:
      self.cov.switch_context("")
    self.running = None
    os.environ.pop(CONTEXT_ENV, None)
    with open(self.path, "w") as f:
      json.dump(self.tests, f)


def named(env, test: str) -> dict:
  """``env`` for a subprocess of ``test``: its lines recorded under the test's node id. Coverage hands a subprocess
  its configuration already read (``COVERAGE_PROCESS_CONFIG``, base64 JSON, written at the parent's start), so the
  context that configuration names is set here, not read from the environment in the subprocess."""
  env = dict(env, **{CONTEXT_ENV: test})
  if "COVERAGE_PROCESS_CONFIG" in env:
    config = json.loads(base64.b64decode(env["COVERAGE_PROCESS_CONFIG"]))
    config["context"] = test
    env["COVERAGE_PROCESS_CONFIG"] = base64.b64encode(json.dumps(config).encode()).decode()
  return env


def install(config, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  config.pluginmanager.register(_Recorder(out), "fp4jax_coverage_by_test")
