"""Importing the library must not start an XLA backend.

``jax.distributed.initialize`` must run before any backend exists, and configs import fp4jax and models
before ``train.py`` sets up a multi-process run; a module-level ``jnp`` constant would break that.
"""
import subprocess
import sys

_PROBE = """
import jax._src.xla_bridge as xb
import fp4jax, fp4jax.flax, models, training.trainer
print("backends started:", bool(xb._backends))
"""


def test_import_starts_no_backend():
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
  assert "backends started: False" in out.stdout, out.stdout + out.stderr
