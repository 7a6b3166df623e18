"""Per-test coverage contexts for ``scripts/coverage_gap.py --by_test`` (a pytest plugin, installed by
tests/conftest.py when ``FP4JAX_COVERAGE_BY_TEST=<dir>`` is set and the process runs under coverage).

Each test's lines are recorded under its pytest node id (parametrization included; its fixtures' set-up is
charged to the first test that asks for them). Lines a test's subprocess runs carry no context, so the plugin
also writes, per test process, ``<dir>/tests.<pid>.json``: each test's seconds (set-up, call and tear-down) and
whether it started a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

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
      popen_init(popen, *args, **kwargs)

    subprocess.Popen.__init__ = init

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):   # pylint: disable=unused-argument
    self.running = item.nodeid
    self.tests[item.nodeid] = {"seconds": 0.0, "subprocess": False}
    if self.cov is not None:
      self.cov.switch_context(item.nodeid)
    start = time.perf_counter()
    yield
    self.tests[item.nodeid]["seconds"] = time.perf_counter() - start
    if self.cov is not None:
      self.cov.switch_context("")
    self.running = None
    with open(self.path, "w") as f:
      json.dump(self.tests, f)


def install(config, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  config.pluginmanager.register(_Recorder(out), "fp4jax_coverage_by_test")
