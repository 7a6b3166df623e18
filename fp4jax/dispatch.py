"""Which implementation each op of fp4jax runs: THE impl switch, one vocabulary for every op.

  impl = "xla"     the XLA composition (quantize as the reference; a GEMM of exact block products)
         "pallas"  the Pallas kernels (FP4 formats with kernels: ``formats.KERNEL_FORMATS``)
         "native"  the hardware's block-scaled GEMM (``fp4jax.native``; the GEMMs only)
         None      the default for the devices the program is compiled for (``fp4jax.target``: the mesh's,
                   or an explicit target, not the process's default backend) and the evidence on record

``OPS`` says which impls each op has; ``choose(op, fmt, impl)`` is the one decision: it validates an
explicit impl and resolves None. Every public entry point (``fp4jax.quantize``, ``dequantize``,
``quantize_rht_transposed``, ``scaled_matmul``, ``gemm.matmul``, the grouped GEMM, the fused producers)
asks it once; the layers below receive the answer.

The default (impl=None):
- a Pallas kernel only where ``VERIFIED_KERNELS`` holds a recorded device run that showed it bit-exact
  with the reference *and* faster than the XLA path (``scripts/gpu_check.py`` prints the rows that justify
  or refute an entry); of the two Pallas GEMMs, the one that decodes as it loads ("mixed_matmul") where it
  is proved, else the pair ("scaled_matmul": dequantize passes, then a bf16 GEMM);
- the native GEMM on compute capability 10.x for the formats ``NATIVE_DEFAULTS`` (dense) and
  ``NATIVE_GROUPED_DEFAULTS`` (the experts' grouped GEMM) choose;
- the XLA path everywhere else.
On the user's GPU, the device's own verdict (``verdicts``, proved by ``tools.prove`` the first time a
process meets its device key) adds to that evidence: exact and faster there turns a kernel (or an
off-by-default native GEMM, MXFP8's) on, "differs", "error" or "slower" there turns it off (even a
VERIFIED_KERNELS entry) and revokes a NATIVE_DEFAULTS choice; no verdict (FP4JAX_PROOF=off, no GPU, budget
spent) leaves the recorded evidence in charge. FP4JAX_DEFAULT_IMPL=xla|pallas|native wins over both.
"""
from __future__ import annotations

import dataclasses
import os

from fp4jax import _mosaic_compat as mc
from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax import target as target_lib
from fp4jax import verdicts

IMPLS = ("xla", "pallas", "native")
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


# (op, fmt) -> Evidence, op in KERNEL_OPS or MOSAIC_GEMM. Empty: no device run has yet shown a kernel exact and faster,
# so impl=None runs the XLA path everywhere. Fill it only from a gpu_check.py report (docs/PERF.md).
VERIFIED_KERNELS: dict[tuple[str, str], Evidence] = {}


@dataclasses.dataclass(frozen=True)
class NativeChoice:
  """Why ``fp4jax.gemm.matmul``'s default is (or is not) the native GEMM for one format."""

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
# "error" or "slower" revokes it. default False: off until this device's proof (``tools.prove``,
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
                          "the on-device proof native_gemm/mxfp8 (python -m tools.prove --op native_gemm "
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


def native_default(fmt: str, *, capability: tuple[int, int] | None = None,
                   target: target_lib.Target | None = None) -> str | None:
  """What ``fp4jax.gemm.matmul(impl=None)`` runs for ``fmt``: "native" where the program's devices
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


def native_grouped_default(fmt: str, *, capability: tuple[int, int] | None = None,
                           target: target_lib.Target | None = None) -> str | None:
  """What the grouped GEMM runs for impl=None: "native" where NATIVE_GROUPED_DEFAULTS chooses it for the
  program's devices, decided as ``native_default`` decides (compute capability 10.x, the same device
  verdict, FP4JAX_DEFAULT_IMPL); None otherwise (the XLA path)."""
  return _native(NATIVE_GROUPED_DEFAULTS.get(fmt), fmt, capability, target)


# fp4jax's own block-scaled GEMM on Mosaic GPU (``kernels.mosaic_gemm``: tcgen05, the epilogue inside), the
# alternative to cuDNN's behind impl="native" (the dense GEMMs, and the MoE experts' rows GEMMs in its grouped form,
# ``mosaic_grouped_gemm``). Off until a device proves it: impl=None runs the dense kernel where this device's
# verdict for "mosaic_gemm/<fmt>" is "faster" (``tools.prove``), or VERIFIED_KERNELS records a device run; the
# grouped form has a proof of its own to pass (its table reads and its reads of one expert's weights are code
# the dense kernel does not run) and ``tools.prove`` has no case for it yet, so only a VERIFIED_KERNELS entry
# for "mosaic_grouped_gemm" (and --what_if_proved) turns it on. FP4JAX_NATIVE_KERNEL=mosaic|cudnn forces both
# (the deviceless compiles use it).
MOSAIC_GEMM = verdicts.MOSAIC_OP
MOSAIC_GROUPED_GEMM = "mosaic_grouped_gemm"
MOSAIC_FORMATS = ("nvfp4",)
NATIVE_KERNEL_ENV = "FP4JAX_NATIVE_KERNEL"


def native_kernel(fmt: str, *, target: target_lib.Target | None = None, grouped: bool = False) -> str:
  """Which GEMM impl="native" runs for ``fmt`` (``fp4jax.native.matmul``'s kernel): "mosaic" (fp4jax's
  tcgen05 kernel) on the program's devices (``target``) when FP4JAX_NATIVE_KERNEL=mosaic, or where they
  have compute capability 10.x, this jax has the block-scaled Mosaic GPU MMA, and this device proved it
  exact and faster (without a device verdict: a VERIFIED_KERNELS entry), on one device or a mesh (an fp4jax
  op: each device runs it on its shards); else "cudnn". The native path takes
  the Mosaic kernel only for the pairs it computes (``native.mosaic_takes``), cuDNN's for the rest.
  grouped: the choice for the experts' grouped GEMM (``mosaic_grouped_gemm``), proved on its own (above)."""
  forced = os.environ.get(NATIVE_KERNEL_ENV, "").strip().lower()
  if forced not in ("", "mosaic", "cudnn"):
    raise ValueError(f"{NATIVE_KERNEL_ENV}={forced!r}; set it to 'mosaic', 'cudnn' or leave it unset")
  if forced:
    return forced if fmt in MOSAIC_FORMATS else "cudnn"
  if fmt not in MOSAIC_FORMATS or not native_device(target=target) or not mc.has_block_scaled_mma():
    return "cudnn"
  if grouped:
    return "mosaic" if (MOSAIC_GROUPED_GEMM, fmt) in VERIFIED_KERNELS else "cudnn"
  proved = _device_verdict(MOSAIC_GEMM, fmt, target)   # None: no verdict; False revokes a VERIFIED entry
  return "mosaic" if ((MOSAIC_GEMM, fmt) in VERIFIED_KERNELS if proved is None else proved) else "cudnn"


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
  forced = _forced()   # "native" reaches the GEMMs only (native_default): the quantize ops keep theirs
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
  if forced not in ("", *IMPLS):
    raise ValueError(f"{DEFAULT_IMPL_ENV}={forced!r}; set it to 'xla', 'pallas', 'native' or leave it unset")
  return forced


# op -> the impls it has, as plain data. "scaled_matmul" is the dense GEMM of any QTensor pair
# (``fp4jax.gemm.matmul``; ``fp4jax.scaled_matmul`` for the formats of the primitive), "grouped_matmul" the
# experts' grouped GEMM (``gemm.grouped_matmul`` / ``grouped_matmul_t``), "dequantize" lowers to the
# reference with either impl. The Pallas kernels exist for ``formats.KERNEL_FORMATS`` only, the native GEMM
# for ``native.FORMATS`` (checked where the operands are: ``native.check``).
OPS: dict[str, tuple[str, ...]] = {
    "quantize_1d": ("xla", "pallas"), "quantize_2d": ("xla", "pallas"), "quantize_rht_t": ("xla", "pallas"),
    "dequantize": ("xla", "pallas"), "rmsnorm_quantize": ("xla", "pallas"), "relu2_quantize": ("xla", "pallas"),
    "scaled_matmul": ("xla", "pallas", "native"), "grouped_matmul": ("xla", "native"),
}
_WHAT = {"grouped_matmul": "the grouped GEMM", "scaled_matmul": "the GEMM"}


def choose(op: str, fmt: str, impl: str | None = None, *, target: target_lib.Target | None = None,
           native_ok: bool = True) -> str:
  """The implementation ``op`` (one of ``OPS``) runs for ``fmt``: ``impl`` when given (validated), else the
  default for the program's devices (``target``, default ``fp4jax.target.current()``): the module
  docstring's rule. ``native_ok``: the caller's predicate, whether its operands are ones the native GEMM
  takes (False: the default is the best of the other impls)."""
  if op not in OPS:
    raise ValueError(f"unknown op {op!r}; one of {tuple(OPS)}")
  has = OPS[op]
  if impl is not None:
    if impl not in IMPLS:
      raise ValueError(f"impl={impl!r}; use one of {IMPLS} or None (the default for this program's devices)")
    if impl not in has:
      raise ValueError(f"{_WHAT.get(op, op)} has impl " + " or ".join(repr(i) for i in has) + f" (got {impl!r})"
                       + ("; there are no Pallas grouped kernels: use impl='xla'" if impl == "pallas" else
                          "; use impl='xla'"))
    if impl == "pallas" and fmt not in formats.KERNEL_FORMATS:
      raise ValueError(f"there are no Pallas kernels for fmt={fmt!r}; use impl='xla'")
    return impl
  if "native" in has and native_ok:
    table = NATIVE_DEFAULTS if op == "scaled_matmul" else NATIVE_GROUPED_DEFAULTS
    if _native(table.get(fmt), fmt, None, target):
      return "native"
  if "pallas" not in has or fmt not in formats.KERNEL_FORMATS:
    return "xla"
  if op == "scaled_matmul":   # either Pallas GEMM (``pallas_gemm`` picks which)
    picks = (default_impl("mixed_matmul", fmt, target=target), default_impl(op, fmt, target=target))
    return "pallas" if "pallas" in picks else "xla"
  if op == "dequantize":      # no kernel of its own: both impls lower to the reference
    return "pallas" if _forced() == "pallas" else "xla"
  return default_impl(op, fmt, target=target)


def pallas_gemm(fmt: str, *, target: target_lib.Target | None = None) -> str:
  """Which Pallas GEMM impl="pallas" runs, as the ``fp4jax_scaled_matmul`` primitive's impl param: "mixed"
  (``kernels.mixed_matmul``, decoding as it loads) where it can run compiled and this device proved it, or
  VERIFIED_KERNELS records it, without FP4JAX_DEFAULT_IMPL; else "pallas" (the pair,
  ``kernels.scaled_matmul``: dequantize passes, then a bf16 GEMM)."""
  if _forced() or not can_use_pallas(fmt, target=target):
    return "pallas"
  proved = _device_verdict("mixed_matmul", fmt, target)
  return "mixed" if (("mixed_matmul", fmt) in VERIFIED_KERNELS if proved is None else proved) else "pallas"


# ---------------------------------------------------------------- kernels outside the library

def model_kernel_default(op: str, recorded: Evidence | None, *, target: target_lib.Target | None = None) -> str:
  """What impl=None runs for a kernel outside the library (a model's: its own ``op`` name) on the program's
  devices (``target``, default ``fp4jax.target.current()``), by the rule of the library's kernels with a
  tolerance instead of bit-exactness (its float32 sums run in another order than its XLA twin's):
  "pallas" where this device proved it within its tolerance and faster (``verdicts.decide(op,
  verdicts.MODEL_FMT)``); without a device verdict (FP4JAX_PROOF=off, budget spent, a deviceless compile
  for another kind of device), where ``recorded`` (the caller's evidence table: a device run from a
  scripts/gpu_check.py report) says so; "differs", "error" or "slower" here turns it off even over
  ``recorded``. FP4JAX_DEFAULT_IMPL wins over both. Whether the kernel can run there (platform, shapes)
  is the caller's predicate: ask it first, so that no proof runs for a kernel that cannot."""
  forced = _forced()
  if forced == "pallas":
    return "pallas"
  if forced == "xla":
    return "xla"
  proved = _device_verdict(op, verdicts.MODEL_FMT, target)   # None: no verdict; False revokes
  return "pallas" if (recorded is not None if proved is None else proved) else "xla"
