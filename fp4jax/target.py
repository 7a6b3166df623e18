"""The devices a program is compiled for, as every automatic choice sees them.

Each "auto" of fp4jax (a primitive's default impl, the quantized dot's GEMM backend) and of the models
built on it (attention's kernel) is decided at trace time from a ``Target``: the platform, device kind
and CUDA compute capability of the devices the program will run on, not those of the process. Which
target a trace sees (``current()``):

1. the innermost ``with fp4jax.target.use(t):``, t a Target, a Mesh, a Sharding, a device or devices;
2. else the devices of the mesh set by ``jax.set_mesh`` (training and bench/scale.py trace under it);
3. else this process's first device, ``jax.devices()[0]``.

So a deviceless GPU compile (a CPU process compiling over the GPU topology devices of
bench/predict/gpu_aot.py) traces what a GPU process would trace: cuDNN attention, the native GEMM on sm_100.

jit keys its trace cache on the argument shardings and on the ``jax.set_mesh`` mesh, which name the
devices; it does not key on ``use``. A function jitted once and traced under two ``use`` targets with
the same arguments keeps its first trace: enter ``use`` around a fresh ``jax.jit(...).lower`` (as
bench/predict/gpu_aot.py does) or pass ``target=`` to the decision itself (tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

from fp4jax import _jax_compat


@dataclasses.dataclass(frozen=True)
class Target:
  """What the automatic choices need to know of a program's devices.

  platform: jax's device platform ("gpu", "cpu", "tpu"); device_kind: e.g. "NVIDIA H200";
  capability: the CUDA compute capability (major, minor), None off CUDA (CPU, TPU, ROCm)."""

  platform: str
  device_kind: str = ""
  capability: tuple[int, int] | None = None

  @property
  def cuda(self) -> bool:
    """A CUDA GPU (the Pallas/Triton kernels, cuDNN, the block-scaled GEMMs can run)."""
    return self.platform == "gpu" and self.capability is not None

  def at_least(self, major: int, minor: int = 0) -> bool:
    """A CUDA GPU of compute capability >= (major, minor)."""
    return self.cuda and self.capability >= (major, minor)

  @classmethod
  def of(cls, where) -> "Target":
    """The target of ``where``: a Target (returned), a ``jax.sharding.Mesh``, a Sharding, one device,
    or devices. All devices must share platform and kind: a program runs on one kind of chip."""
    if isinstance(where, Target):
      return where
    devices = _devices(where)
    if not devices:
      raise ValueError(f"no devices in {where!r}; pass a Mesh, a Sharding, a device or devices")
    kinds = {(d.platform, str(getattr(d, "device_kind", ""))) for d in devices}
    if len(kinds) > 1:
      raise ValueError(f"devices of {len(kinds)} kinds {sorted(kinds)}: a program is compiled for one "
                       "kind; build the mesh from devices of one kind")
    d = devices[0]
    return cls(d.platform, str(getattr(d, "device_kind", "")), capability(d))

  @classmethod
  def here(cls) -> "Target":
    """This process's first device (the fallback when nothing names the program's devices)."""
    try:
      return cls.of(jax.devices()[0])
    except RuntimeError:   # pragma: no cover - no backend at all
      return cls("cpu")


def capability(device) -> tuple[int, int] | None:
  """(major, minor) of a CUDA device (a real one or a topology's), else None."""
  if device.platform not in ("gpu", "cuda"):
    return None
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return None
  parts = str(cc).split(".")
  try:
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
  except ValueError:   # not CUDA's "major.minor" (ROCm says e.g. "gfx90a")
    return None


def _devices(where) -> list:
  if isinstance(where, jax.sharding.Mesh):
    return list(where.devices.flat)
  if isinstance(where, jax.sharding.Sharding):
    return sorted(where.device_set, key=lambda d: d.id)
  if hasattr(where, "platform"):
    return [where]
  return list(where)


_LOCAL = threading.local()


@contextlib.contextmanager
def use(where):
  """Decides every automatic choice traced inside for ``where`` (anything ``Target.of`` takes; None
  leaves the current target)."""
  stack = _LOCAL.__dict__.setdefault("stack", [])
  if where is None:
    yield current()
    return
  stack.append(Target.of(where))
  try:
    yield stack[-1]
  finally:
    stack.pop()


def current() -> Target:
  """The target of the trace in progress: ``use``, else the ``jax.set_mesh`` mesh, else ``here()``."""
  stack = getattr(_LOCAL, "stack", None)
  if stack:
    return stack[-1]
  mesh = _jax_compat.ambient_mesh()
  if mesh is not None:
    return Target.of(mesh)
  return Target.here()


def resolve(target: Target | None) -> Target:
  """``target``, or ``current()`` when None (what the decisions take as their ``target=``)."""
  return current() if target is None else target
