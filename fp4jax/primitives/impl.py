"""The impl switch: which implementation a primitive lowers to, "pallas" (the kernels) or "xla" (the
reference), for a user's ``impl=`` (None = the default)."""
from __future__ import annotations

import os

from fp4jax import _pallas_compat as plc
from fp4jax import formats

IMPLS = ("xla", "pallas")
DEFAULT_IMPL_ENV = "FP4JAX_DEFAULT_IMPL"

# Kernels a recorded device run showed bit-exact with the reference and faster than the XLA path:
# (op, fmt) -> the evidence (date, device, jax version of the run). Not consulted yet: impl=None picks
# every kernel where ``can_use_pallas`` holds; making the default follow this table is issue 12's.
VERIFIED_KERNELS: dict[tuple[str, str], str] = {}


def can_use_pallas(fmt: str = "nvfp4", *, platform: str | None = None) -> bool:
  """Whether impl=None picks the compiled Pallas kernels: an FP4 format on a CUDA GPU with Triton.

  On CPU this is False (impl=None runs the XLA reference); impl="pallas" still works there, through
  the Pallas interpreter (slow, for tests).
  """
  if fmt not in formats.KERNEL_FORMATS or not plc.has_triton():
    return False
  if platform is None:
    return plc.gpu_available()
  return platform in ("cuda", "gpu")


def resolve_impl(impl: str | None, fmt: str) -> str:
  """"pallas" | "xla" for a user's ``impl`` (None = pallas where ``can_use_pallas``, else xla).

  The environment variable FP4JAX_DEFAULT_IMPL=xla makes None mean "xla" everywhere (a switch for
  runs that must not depend on the kernels); =pallas forces the kernels where they exist.
  """
  if impl is None:
    forced = os.environ.get(DEFAULT_IMPL_ENV, "").strip().lower()
    if forced == "xla" or fmt not in formats.KERNEL_FORMATS:
      return "xla"
    if forced == "pallas":
      return "pallas"
    return "pallas" if can_use_pallas(fmt) else "xla"
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; use 'pallas', 'xla' or None (pallas where can_use_pallas())")
  if impl == "pallas" and fmt not in formats.KERNEL_FORMATS:
    raise ValueError(f"there are no Pallas kernels for fmt={fmt!r}; use impl='xla'")
  return impl
