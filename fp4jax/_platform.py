"""Which JAX platforms this process starts, decided once, before any backend does.

fp4jax's dev set-up installs jax's CUDA plugin on every machine, GPU or not, so that the tests can
compile the GPU program without a GPU (``bench/predict/gpu_aot.py``). Two things would go wrong unattended:

- On a machine without an NVIDIA driver, JAX's first backend start tries the plugin, whose version
  check fails and prints a traceback (``Unable to load cuPTI``) before JAX falls back to the CPU.
  With no ``JAX_PLATFORMS`` set, ``configure`` sets jax's platforms to ``cpu`` there: jax stays on the
  CPU and prints nothing.
- A deviceless GPU compile (``JAX_PLATFORMS=cpu,cuda``) needs the plugin's version check skipped
  (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``), as that check asks the driver. ``configure`` sets the flag
  when the platforms include cuda and there is no driver; ``deviceless_env`` is the environment for a
  subprocess that compiles for a GPU target.

A machine with a driver is left alone: JAX finds the GPU as usual. An explicit ``JAX_PLATFORMS`` (or
``jax.config.update("jax_platforms", ...)``) always wins. ``configure`` runs on ``import fp4jax``;
if a backend has already started by then (jax used before fp4jax was imported), it changes nothing.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os

SKIP_CHECK_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
PLATFORMS_ENV = "JAX_PLATFORMS"
DEVICELESS_PLATFORMS = "cpu,cuda"
# jax's CUDA plugins, by the module name each registers under jax_plugins (CUDA 13 first).
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def cuda_plugin() -> str | None:
  """The importable CUDA plugin module's name (``jax_plugins.xla_cuda13``), or None."""
  for name in CUDA_PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return name
    except (ImportError, ValueError):   # pragma: no cover - a broken namespace package
      continue
  return None


def nvidia_driver_present() -> bool:
  """Whether this machine has an NVIDIA kernel driver (and its user-space libcuda)."""
  if os.path.exists("/proc/driver/nvidia/version"):
    return True
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge   # pylint: disable=import-outside-toplevel
  except ImportError:   # pragma: no cover
    return False
  started = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", None))


def _requested_platforms() -> str:
  import jax   # pylint: disable=import-outside-toplevel
  return (jax.config.jax_platforms or os.environ.get(PLATFORMS_ENV) or "").strip().lower()


def configure() -> str:
  """Applies the rules above; returns what it did ("cpu", "skip-check" or "none")."""
  if _backends_started():
    return "none"
  requested = _requested_platforms()
  if not requested:
    if cuda_plugin() is not None and not nvidia_driver_present():
      import jax   # pylint: disable=import-outside-toplevel
      jax.config.update("jax_platforms", "cpu")
      return "cpu"
    return "none"
  if "cuda" in requested.split(",") and not nvidia_driver_present():
    os.environ.setdefault(SKIP_CHECK_ENV, "1")
    return "skip-check"
  return "none"


def deviceless_env(base: dict | None = None) -> dict:
  """A copy of ``base`` (default ``os.environ``) for a process that compiles for a GPU target without a
  GPU: platforms cpu,cuda and the plugin's version check skipped."""
  env = dict(os.environ if base is None else base)
  env[PLATFORMS_ENV] = DEVICELESS_PLATFORMS
  env[SKIP_CHECK_ENV] = "1"
  return env


def enable_deviceless() -> None:
  """Makes this process compile for CUDA targets without a GPU (``bench/predict/gpu_aot.py``): platforms
  cpu,cuda and the plugin's version check skipped. Must run before any backend starts; raises
  RuntimeError after, or when no CUDA plugin is installed."""
  if _backends_started():
    raise RuntimeError("a JAX backend has already started; enable deviceless CUDA compiles before "
                       "anything touches a device (run it in a fresh process)")
  if cuda_plugin() is None:
    raise RuntimeError("no jax CUDA plugin is installed; pip install -e '.[gpu-compile]' (or "
                       "\"jax[cuda13]\" at the installed jax's version)")
  import jax   # pylint: disable=import-outside-toplevel
  os.environ[SKIP_CHECK_ENV] = "1"
  os.environ[PLATFORMS_ENV] = DEVICELESS_PLATFORMS
  jax.config.update("jax_platforms", DEVICELESS_PLATFORMS)
