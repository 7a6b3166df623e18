"""Test-session set-up: the platform rules of ``fp4jax._platform`` before any test touches jax, so a
machine with jax's CUDA plugin and no GPU runs the suite on the CPU without the plugin's traceback."""
from fp4jax import _platform

_platform.configure()
