"""Test-session set-up: the platform rules of ``fp4jax._platform`` before any test touches jax, so a
machine with jax's CUDA plugin and no GPU runs the suite on the CPU without the plugin's traceback."""
from fp4jax import _platform

_platform.configure()


import pytest  # noqa: E402  (after the platform rules)


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
  """A 4-step run with checkpoints 2 and 4, and a 6-step run straight through (``train_runs.make_finished``),
  made once per test process for the training fault tests, which copy it."""
  import train_runs  # pylint: disable=import-outside-toplevel  (imports training: only for tests that ask)
  return train_runs.make_finished(tmp_path_factory.mktemp("finished"))
