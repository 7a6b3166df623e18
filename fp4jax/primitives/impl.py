"""The impl switch: which implementation a primitive lowers to, "pallas" (the kernels) or "xla" (the
reference / the XLA composition), for a user's ``impl=`` (None = the default, decided by evidence);
and which backend ``fp4jax.gemm.scaled_matmul`` (the quantized dot's GEMMs) runs by default, where
"native" (the block-scaled tensor cores, ``fp4jax.native``) is chosen on compute capability 10.x.
Each choice is made for the devices the program is compiled for (``fp4jax.target``: the mesh's,
or an explicit target), not for the process's default backend.

The default on a CUDA GPU is a kernel only where ``VERIFIED_KERNELS`` holds a recorded device run that
showed that kernel bit-exact with the reference *and* faster than the XLA path. Everywhere else the
XLA path runs: quantize as the reference, the scaled matmul as dequantize-to-bf16 then one bf16 GEMM
with float32 accumulation (exact: E2M1 x E4M3 products fit bf16). ``scripts/gpu_check.py`` prints the
rows that justify (or refute) an entry.

On the user's GPU, the device's own verdict (``verdicts``, proved by ``fp4jax.proof`` the first time a
process meets its device key) adds to that evidence: exact and faster there turns a kernel (or an
off-by-default native GEMM, MXFP8's) on, "differs", "error" or "slower" there turns it off (even a
VERIFIED_KERNELS entry) and revokes a NATIVE_DEFAULTS choice; no verdict (FP4JAX_PROOF=off, no GPU, budget spent) leaves the recorded evidence in charge.
FP4JAX_DEFAULT_IMPL still wins over both.
"""
from __future__ import annotations

import dataclasses
import os

from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax import target as target_lib
from fp4jax.primitives import verdicts

IMPLS = ("xla", "pallas")
FORCEABLE = IMPLS + ("native",)   # what FP4JAX_DEFAULT_IMPL takes; "native" is a GEMM backend only
DEFAULT_IMPL_ENV = "FP4JAX_DEFAULT_IMPL"
# The kernel-backed ops, as named in VERIFIED_KERNELS and in scripts/gpu_check.py's report.
# "scaled_matmul" is the pair (dequantize passes, then a bf16 GEMM: kernels.scaled_matmul), "mixed_matmul"
# the GEMM that decodes as it loads (kernels.mixed_matmul); impl=None tries "mixed_matmul" first.
KERNEL_OPS = ("quantize_1d", "quantize_2d", "quantize_rht_t", "scaled_matmul", "mixed_matmul", "rmsnorm_quantize",
              "relu2_quantize")


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


@dataclasses.dataclass(frozen=True)
class NativeChoice:
  """Why ``fp4jax.gemm.scaled_matmul``'s default is (or is not) the native GEMM for one format."""

  default: bool          # impl=None runs "native" on compute capability NATIVE_MAJOR.x
  basis: str             # what the choice rests on today
  missing: str           # the evidence a device run still has to give (scripts/gpu_check.py, native rows)


NATIVE_MAJOR = 10   # datacenter Blackwell (B200/GB200 sm_100, B300 sm_103); not 12.x (consumer Blackwell)
_NO_DEVICE_RUN = ("no device run yet: gpu_check.py's native rows on a B200 (result vs the XLA path, "
                  "expected equal up to float32 summation order; time vs the bf16 GEMM) confirm or revoke it")
# fmt -> the choice. default True: chosen without a device run, on the decision (the native FP4 GEMM is why
# FP4 training exists) and on recorded compiles: deviceless sm_100 compiles put every GEMM of these
# formats on __cudnn$blockScaledDot (tests/test_gpu_aot_native.py), and the cost model predicts it
# faster than the XLA path it replaces (docs/PERF.md, "Native FP4 GEMMs on Blackwell, by recipe"; still not faster than the bf16
# recipe at the dot or step level, because of the quantize passes); a device verdict of "differs",
# "error" or "slower" revokes it. default False: off until this device's proof (``fp4jax.proof``,
# "native_gemm/<fmt>") finds it exact and faster. sm_12x is excluded until a device run shows
# it exact (Transformer Engine reported all-zero gradients there).
NATIVE_DEFAULTS: dict[str, NativeChoice] = {
    "nvfp4": NativeChoice(True, "deviceless sm_100 compiles (every GEMM block-scaled); B200 cost model: "
                          "nvfp4 dot 8192^3 1.95 ms native vs 3.54 ms XLA path (bf16 recipe 1.84)",
                          _NO_DEVICE_RUN),
    "nvfp4_eden": NativeChoice(True, "deviceless sm_100 compiles; B200 cost model: quartet2 dot 8192^3 "
                               "5.05 ms native vs 6.65 ms XLA path", _NO_DEVICE_RUN),
    "nvfp4_dbq": NativeChoice(True, "one block-scaled GEMM per 128-chunk of K, each (M, N) float32 partial "
                              "rescaled and summed as dbq.gemm: tetrajet2 dot 8192^3 22.9 ms native vs "
                              "23.4 ms XLA path (both memory-bound on the partials; bf16 1.8 ms)",
                              _NO_DEVICE_RUN + "; a fused kernel rescaling its accumulator per K-chunk "
                              "would remove the partials"),
    "mxfp8": NativeChoice(False, "deviceless sm_100 compiles put every MXFP8 GEMM on __cudnn$blockScaledDot "
                          "(tests/test_gpu_aot_native.py); off until a device proves it",
                          "the on-device proof native_gemm/mxfp8 (python -m fp4jax.proof --op native_gemm "
                          "--fmt mxfp8 on a B200): exact against the XLA path and faster turns it on"),
}


def native_device(capability: tuple[int, int] | None = None, *,
                  target: target_lib.Target | None = None) -> bool:
  """Whether the program's devices (``target``, default ``fp4jax.target.current()``) are GPUs of compute
  capability NATIVE_MAJOR.x; ``capability`` overrides the target's, for tests."""
  cc = target_lib.resolve(target).capability if capability is None else capability
  return cc is not None and cc[0] == NATIVE_MAJOR


def _native(choice: NativeChoice | None, fmt: str, capability, target) -> str | None:
  """"native" or None for one table's ``choice``: FP4JAX_DEFAULT_IMPL=native forces it wherever a choice
  exists, =xla/=pallas never pick it; else on compute capability 10.x this device's verdict for
  native_gemm/<fmt> decides ("faster" on, anything else off), and without one the choice's default."""
  forced = _forced()
  if choice is None or (forced and forced != "native"):
    return None
  if forced == "native":
    return "native"
  if not native_device(capability, target=target):
    return None
  proved = _device_verdict(verdicts.NATIVE_OP, fmt, target)   # None: no verdict (a deviceless compile)
  return "native" if (choice.default if proved is None else proved) else None


def default_gemm_backend(fmt: str, *, capability: tuple[int, int] | None = None,
                         target: target_lib.Target | None = None) -> str | None:
  """What ``fp4jax.gemm.matmul(backend=None)`` runs for ``fmt``: "native" where the program's devices
  (``target``, default ``fp4jax.target.current()``) have compute capability 10.x and NATIVE_DEFAULTS
  chooses it (a default-on format unless this device's proof revokes it; a default-off one once this
  device's proof finds it exact and faster), or everywhere the native GEMM exists when
  FP4JAX_DEFAULT_IMPL=native; None otherwise (the primitives' default, ``default_impl``).
  FP4JAX_DEFAULT_IMPL=xla or =pallas never picks native."""
  return _native(NATIVE_DEFAULTS.get(fmt), fmt, capability, target)


# fmt -> the grouped GEMM's choice (``fp4jax.gemm.grouped_matmul`` / ``grouped_matmul_t``, the MoE experts'
# GEMMs): the native work-item GEMM of ``fp4jax.native.grouped_rows`` / ``grouped_tokens``, decided as the
# dense GEMM's (the same device verdict, native_gemm/<fmt>). Chosen on deviceless sm_100 compiles
# (tests/test_gpu_aot_native.py: every expert GEMM of a moe_tiny step block-scaled) and the B200 cost model
# (docs/PERF.md, "The native grouped GEMM's tiling"); mxfp8 off until the device's proof turns it on.
NATIVE_GROUPED_DEFAULTS: dict[str, NativeChoice] = {
    **{fmt: NativeChoice(True, "deviceless sm_100 compiles of the grouped GEMM (fprop, dgrad, wgrad block-"
                         "scaled); B200 cost model in docs/PERF.md, 'The native grouped GEMM's tiling'", _NO_DEVICE_RUN)
       for fmt in ("nvfp4", "nvfp4_eden", "nvfp4_dbq")},
    "mxfp8": NativeChoice(False, "deviceless sm_100 compiles of the grouped GEMM (fprop, dgrad, wgrad "
                          "block-scaled MXFP8)", NATIVE_DEFAULTS["mxfp8"].missing),
}


def default_grouped_backend(fmt: str, *, capability: tuple[int, int] | None = None,
                            target: target_lib.Target | None = None) -> str | None:
  """What the grouped GEMM runs for impl=None: "native" where NATIVE_GROUPED_DEFAULTS chooses it for the
  program's devices, decided as ``default_gemm_backend`` decides (compute capability 10.x, the same device
  verdict, FP4JAX_DEFAULT_IMPL); None otherwise (the XLA path)."""
  return _native(NATIVE_GROUPED_DEFAULTS.get(fmt), fmt, capability, target)


def can_use_pallas(fmt: str = "nvfp4", *, platform: str | None = None,
                   target: target_lib.Target | None = None) -> bool:
  """Whether the Pallas kernels can run compiled on the program's devices: an FP4 format on a CUDA GPU
  with Triton. ``platform`` ("cuda" | "gpu" | "cpu"...) says it directly; else ``target`` (default
  ``fp4jax.target.current()``: the devices the trace is for, not the process's).

  Says nothing about whether they are the default (``default_impl``). On CPU this is False;
  impl="pallas" still works there, through the Pallas interpreter (slow, for tests).
  """
  if fmt not in formats.KERNEL_FORMATS or not plc.has_triton():
    return False
  if platform is None:
    return target_lib.resolve(target).cuda
  return platform in ("cuda", "gpu")


def default_impl(op: str, fmt: str, *, platform: str | None = None,
                 target: target_lib.Target | None = None) -> str:
  """What impl=None runs for ``op`` (one of KERNEL_OPS) and ``fmt``: "pallas" for a kernel that can run
  on the program's devices (``platform`` / ``target`` as in ``can_use_pallas``) and that this device
  proved exact and faster (``verdicts.decide``), or, without a device verdict, that VERIFIED_KERNELS
  records (or when FP4JAX_DEFAULT_IMPL=pallas forces it); else "xla"."""
  if op not in KERNEL_OPS:
    raise ValueError(f"unknown kernel op {op!r}; one of {KERNEL_OPS}")
  forced = _forced()   # "native" is a GEMM backend (default_gemm_backend): the primitives keep theirs
  if forced == "xla" or fmt not in formats.KERNEL_FORMATS:
    return "xla"
  if forced == "pallas":
    return "pallas"
  if not can_use_pallas(fmt, platform=platform, target=target):
    return "xla"
  proved = _device_verdict(op, fmt, target)   # None: no verdict; False revokes a VERIFIED entry
  return "pallas" if ((op, fmt) in VERIFIED_KERNELS if proved is None else proved) else "xla"


def _device_verdict(op: str, fmt: str, target: target_lib.Target | None) -> bool | None:
  """This process's on-device verdict (``verdicts.decide``) for a program compiled for this process's
  kind of device; None for a program compiled for other devices (a deviceless compile), which no
  device here has proved anything on."""
  return verdicts.decide(op, fmt, device_kind=target_lib.resolve(target).device_kind)


def _forced() -> str:
  forced = os.environ.get(DEFAULT_IMPL_ENV, "").strip().lower()
  if forced not in ("", *FORCEABLE):
    raise ValueError(f"{DEFAULT_IMPL_ENV}={forced!r}; set it to 'xla', 'pallas', 'native' or leave it unset")
  return forced


def resolve_impl(impl: str | None, fmt: str, op: str | None = None) -> str | None:
  """Validated ``impl``: "pallas" | "xla"; None is resolved per op by ``default_impl`` when ``op`` is
  given, else returned as None (the primitive's wrapper resolves it, knowing the op).

  FP4JAX_DEFAULT_IMPL=xla makes None mean "xla" everywhere (runs that must not depend on the kernels);
  =pallas forces the kernels wherever they exist, verified or not (for the device check); =native
  concerns ``fp4jax.gemm``'s backend only and leaves the primitives at their default.
  """
  if impl is None:
    if fmt not in formats.KERNEL_FORMATS:
      return "xla"
    if op is not None:
      return default_impl(op, fmt)
    forced = _forced()
    return forced if forced in IMPLS else None
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; use 'pallas', 'xla' or None (the verified default)")
  if impl == "pallas" and fmt not in formats.KERNEL_FORMATS:
    raise ValueError(f"there are no Pallas kernels for fmt={fmt!r}; use impl='xla'")
  return impl


# ---------------------------------------------------------------- kernels outside the library
# Model ops with a Pallas kernel (``models.ssd_pallas``: "ssd", the Mamba-2 SSD forward and backward;
# ``models.gated_norm``: "gated_norm", the mixer's gated RMSNorm forward and backward) follow the rule
# of the library's kernels, with a tolerance instead of bit-exactness (their float32 sums run in another
# order than the XLA twin's): on a GPU the kernel is impl=None's choice where this device's proof
# (``fp4jax.proof``, the proof function the model module registers: kernel vs twin, forward and
# gradients, each output within the stated tolerance of the twin's largest magnitude, and timed) finds
# it within tolerance and faster; "differs", "error" or "slower" there keeps (or turns) it off, even
# over an entry here. Without a device verdict (FP4JAX_PROOF=off, budget spent, a deviceless compile
# for another kind of device) this table decides: fill it only from a scripts/gpu_check.py report.
# Empty: the SSD and gated-norm kernels compile deviceless for sm_90 and sm_100 (docs/PERF.md, "The Pallas SSD kernels")
# but have no recorded device run. FP4JAX_DEFAULT_IMPL wins over both.
VERIFIED_MODEL_KERNELS: dict[str, Evidence] = {}
MODEL_KERNEL_OPS = ("ssd", "gated_norm")


def model_kernel_default(op: str, *, target: target_lib.Target | None = None) -> str:
  """What impl=None runs for the model op ``op`` (one of MODEL_KERNEL_OPS) on the program's devices
  (``target``, default ``fp4jax.target.current()``): "pallas" where this device proved the kernel
  within tolerance and faster (``verdicts.decide(op, verdicts.MODEL_FMT)``), or, without a device
  verdict, where VERIFIED_MODEL_KERNELS records a device run, or where FP4JAX_DEFAULT_IMPL=pallas forces
  the kernels; else "xla". Whether the kernel can run there (platform, shapes) is the caller's
  predicate: ask it first, so that no proof runs for a kernel that cannot."""
  if op not in MODEL_KERNEL_OPS:
    raise ValueError(f"unknown model kernel op {op!r}; one of {MODEL_KERNEL_OPS}")
  forced = _forced()
  if forced == "pallas":
    return "pallas"
  if forced == "xla":
    return "xla"
  proved = _device_verdict(op, verdicts.MODEL_FMT, target)   # None: no verdict; False revokes
  return "pallas" if (op in VERIFIED_MODEL_KERNELS if proved is None else proved) else "xla"
