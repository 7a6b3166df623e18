"""Test-session set-up: the platform rules of ``fp4jax._platform`` before any test touches jax, so a
machine with jax's CUDA plugin and no GPU runs the suite on the CPU without the plugin's traceback; and one
persistent compilation cache (``configs.shrunken.TEST_COMPILATION_CACHE``) for every process of the suite,
both xdist workers and the runs they start: a program compiled once is read back wherever a later test
compiles the same HLO (the key is the program, the compile options and the jax version), and a rerun of
the suite skips most compiles."""
import os
import sys

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


@pytest.hookimpl(tryfirst=True)   # before xdist tells the controller this worker is done
def pytest_sessionfinish(session):   # pylint: disable=unused-argument
  """Under coverage, an xdist worker saves what it recorded before it reports the end of its session: the
  controller then gives each worker 10 s to exit and kills the ones still busy (execnet), and coverage saves at
  exit, so a worker slow to shut down (jax's teardown on two busy cores) would lose every line it recorded."""
  coverage = sys.modules.get("coverage")   # imported only when this process runs under coverage
  current = coverage.Coverage.current() if coverage is not None and os.environ.get("PYTEST_XDIST_WORKER") else None
  if current is not None:
    current.save()


SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
REPRESENTED_BY = " represented by "


def slow_tests(path: str = SLOW_TESTS) -> dict[str, str]:
  """{node id: its default representative} of tests/slow_tests.txt: default tests left to ``-m slow`` because
  the default suite executes each of their lines in another test (``scripts/coverage_gap.py --plan``)."""
  out = {}
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      test, sep, representative = line.partition(REPRESENTED_BY)
      if not sep or not representative.strip():
        raise pytest.UsageError(f"{path}:{n}: '{line}' is not '<node id>{REPRESENTED_BY}<node id>'")
      out[test.strip()] = representative.strip()
  return out


# The files whose default tests take longest (a subprocess on 4 or 8 simulated devices, 20-35 s each, and their
# module fixtures): run first, so that the two xdist workers end on the suite's short tests together instead of
# one of them alone on a long one (xdist hands out tests in collection order).
COSTLY_FIRST = ("tests/test_mesh_nodes.py", "tests/test_sharding_mesh.py", "tests/test_mesh_primitives.py",
                "tests/test_train_micro_batches.py")


@pytest.hookimpl(tryfirst=True)   # before -m deselects
def pytest_collection_modifyitems(config, items):
  """The tests of tests/slow_tests.txt are slow (with ``FP4JAX_SLOW_TESTS=omit``, left out). A line naming a test
  that a collected file no longer has, or a representative that is itself slow or gone, stops the run (unless the
  run names node ids, whose files are collected in part): the list must not drift from the tests. The files of
  ``COSTLY_FIRST`` go first, each in its own order."""
  items.sort(key=lambda item: item.nodeid.split("::")[0] not in COSTLY_FIRST)   # stable: False (costly) first
  slow = slow_tests()
  ids = {item.nodeid for item in items}
  files = {i.split("::")[0] for i in ids}
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  if os.environ.get("FP4JAX_SLOW_TESTS") == "omit":   # scripts/coverage_gap.py's slow runs
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in slow])
    items[:] = [item for item in items if item.nodeid not in slow]
  marked = {item.nodeid for item in items if item.get_closest_marker("slow")}
  if any("::" in arg for arg in config.args):   # node ids named: their files are collected in part
    return
  gone = [t for t in slow if t.split("::")[0] in files and t not in ids]
  bad = [r for r in slow.values() if r in marked or (r.split("::")[0] in files and r not in ids)]
  if gone or bad:
    raise pytest.UsageError(f"{SLOW_TESTS}: {len(gone)} tests no longer exist ({gone[:3]}) and {len(bad)} "
                            f"representatives are slow or gone ({bad[:3]}); rename or remove those lines "
                            "(scripts/coverage_gap.py --plan writes the list anew)")


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
  """A 4-step run with checkpoints 2 and 4, and a 6-step run straight through (``train_runs.make_finished``),
  made once per test process for the training fault tests, which copy it."""
  import train_runs  # pylint: disable=import-outside-toplevel  (imports training: only for tests that ask)
  return train_runs.make_finished(tmp_path_factory.mktemp("finished"))
