"""Test-session set-up: the platform rules of ``fp4jax._platform`` before any test touches jax, so a
machine with jax's CUDA plugin and no GPU runs the suite on the CPU without the plugin's traceback; and one
persistent compilation cache (``configs.shrunken.TEST_COMPILATION_CACHE``) for every process of the suite,
both xdist workers and the runs they start: a program compiled once is read back wherever a later test
compiles the same HLO (the key is the program, the compile options and the jax version), and a rerun of
the suite skips most compiles."""
import os

import jax

from fp4jax import _platform

_platform.configure()

from configs import shrunken  # noqa: E402  (imports the models, so after the platform rules)

os.environ.update(shrunken.compilation_cache_env())   # the subprocesses
jax.config.update("jax_compilation_cache_dir", shrunken.TEST_COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


import pytest  # noqa: E402  (after the platform rules)


def pytest_configure(config):
  """``FP4JAX_COMPILE_REPORT=<dir>``: record where each test's compile time goes (tests/compile_report.py);
  ``FP4JAX_COVERAGE_BY_TEST=<dir>``: each test's lines under its node id (tests/coverage_by_test.py)."""
  if os.environ.get("FP4JAX_COMPILE_REPORT"):
    import compile_report  # pylint: disable=import-outside-toplevel
    compile_report.install(config, os.environ["FP4JAX_COMPILE_REPORT"])
  if os.environ.get("FP4JAX_COVERAGE_BY_TEST"):
    import coverage_by_test  # pylint: disable=import-outside-toplevel
    coverage_by_test.install(config, os.environ["FP4JAX_COVERAGE_BY_TEST"])


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
  """A 4-step run with checkpoints 2 and 4, and a 6-step run straight through (``train_runs.make_finished``),
  made once per test process for the training fault tests, which copy it."""
  import train_runs  # pylint: disable=import-outside-toplevel  (imports training: only for tests that ask)
  return train_runs.make_finished(tmp_path_factory.mktemp("finished"))
