"""The impl switch: which implementation a primitive lowers to, "pallas" (the kernels) or "xla" (the
reference / the XLA composition), for a user's ``impl=`` (None = the default, decided by evidence).

The default on a CUDA GPU is a kernel only where ``VERIFIED_KERNELS`` holds a recorded device run that
showed that kernel bit-exact with the reference *and* faster than the XLA path. Everywhere else the
XLA path runs: quantize as the reference, the scaled matmul as dequantize-to-bf16 then one bf16 GEMM
with float32 accumulation (exact: E2M1 x E4M3 products fit bf16). ``scripts/gpu_check.py`` prints the
rows that justify (or refute) an entry.
"""
from __future__ import annotations

import dataclasses
import os

from fp4jax import _pallas_compat as plc
from fp4jax import formats

IMPLS = ("xla", "pallas")
DEFAULT_IMPL_ENV = "FP4JAX_DEFAULT_IMPL"
# The kernel-backed ops, as named in VERIFIED_KERNELS and in scripts/gpu_check.py's report.
KERNEL_OPS = ("quantize_1d", "quantize_2d", "quantize_rht_t", "scaled_matmul")


@dataclasses.dataclass(frozen=True)
class Evidence:
  """The device run that put a kernel into the default: when, where, which jax, how much faster."""

  date: str              # "YYYY-MM-DD"
  device: str            # e.g. "NVIDIA H200"
  jax_version: str       # e.g. "0.10.2"
  speedup: float         # XLA-path time / kernel time at the sizes of scripts/gpu_check.py (> 1)


# (op, fmt) -> Evidence, op in KERNEL_OPS. Empty: no device run has yet shown a kernel exact and faster,
# so impl=None runs the XLA path everywhere. Fill it only from a gpu_check.py report (docs/PERF.md).
VERIFIED_KERNELS: dict[tuple[str, str], Evidence] = {}


def can_use_pallas(fmt: str = "nvfp4", *, platform: str | None = None) -> bool:
  """Whether the Pallas kernels can run compiled here: an FP4 format on a CUDA GPU with Triton.

  Says nothing about whether they are the default (``default_impl``). On CPU this is False;
  impl="pallas" still works there, through the Pallas interpreter (slow, for tests).
  """
  if fmt not in formats.KERNEL_FORMATS or not plc.has_triton():
    return False
  if platform is None:
    return plc.gpu_available()
  return platform in ("cuda", "gpu")


def default_impl(op: str, fmt: str, *, platform: str | None = None) -> str:
  """What impl=None runs for ``op`` (one of KERNEL_OPS) and ``fmt``: "pallas" only for a verified
  kernel that can run here (or when FP4JAX_DEFAULT_IMPL=pallas forces it), else "xla"."""
  if op not in KERNEL_OPS:
    raise ValueError(f"unknown kernel op {op!r}; one of {KERNEL_OPS}")
  forced = _forced()
  if forced == "xla" or fmt not in formats.KERNEL_FORMATS:
    return "xla"
  if forced == "pallas":
    return "pallas"
  return "pallas" if (op, fmt) in VERIFIED_KERNELS and can_use_pallas(fmt, platform=platform) else "xla"


def _forced() -> str:
  forced = os.environ.get(DEFAULT_IMPL_ENV, "").strip().lower()
  if forced not in ("", *IMPLS):
    raise ValueError(f"{DEFAULT_IMPL_ENV}={forced!r}; set it to 'xla', 'pallas' or leave it unset")
  return forced


def resolve_impl(impl: str | None, fmt: str, op: str | None = None) -> str | None:
  """Validated ``impl``: "pallas" | "xla"; None is resolved per op by ``default_impl`` when ``op`` is
  given, else returned as None (the primitive's wrapper resolves it, knowing the op).

  FP4JAX_DEFAULT_IMPL=xla makes None mean "xla" everywhere (runs that must not depend on the kernels);
  =pallas forces the kernels wherever they exist, verified or not (for the device check).
  """
  if impl is None:
    if fmt not in formats.KERNEL_FORMATS:
      return "xla"
    if op is not None:
      return default_impl(op, fmt)
    forced = _forced()
    return forced or None
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; use 'pallas', 'xla' or None (the verified default)")
  if impl == "pallas" and fmt not in formats.KERNEL_FORMATS:
    raise ValueError(f"there are no Pallas kernels for fmt={fmt!r}; use impl='xla'")
  return impl
