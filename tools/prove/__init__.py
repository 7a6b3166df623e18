"""On-device proof: each candidate kernel against its XLA twin on *this* device, bit for bit, and timed.

  python -m tools.prove                                   # every candidate, printed (and cached on a GPU)
  python -m tools.prove --op quantize_1d --fmt nvfp4      # one: the command a refusal prints
  tools.prove.register()                                  # this process proves what impl=None meets

A harness above the library and the models: ``import fp4jax`` loads none of it. It fills
``fp4jax.verdicts`` (plain data, on disk per device key), which ``fp4jax.dispatch`` reads.

Candidates are named "<op>/<fmt>": the Pallas kernels (``dispatch.KERNEL_OPS`` x the kernel formats,
every variant the quantized dot runs: RNE and stochastic rounding, 1x and 16x16 tiles, MXFP4's scale
rules, the GEMM layouts; two Pallas GEMMs, "scaled_matmul" the dequantize passes and bf16 GEMM and
"mixed_matmul" the GEMM that decodes as it loads) and "native_gemm/<fmt>", the Blackwell block-scaled GEMM (``fp4jax.native``)
for each ``NATIVE_DEFAULTS`` format, and "mosaic_gemm/nvfp4", fp4jax's own tcgen05 GEMM with its epilogue
(``kernels.mosaic_gemm``), both only on compute capability 10.x. For each variant:

1. Cases, on the device, at the timing size: random bf16 over many binades with E2M1 ties; the same
   scaled to tiny (2^-120) and huge (2^118) magnitudes; NaN and ±inf entries with a finite amax, with
   amax = inf and amax = NaN; all zeros. The GEMMs take exactly-summable operands (random codes,
   scales whose float32 partial sums are exact in any order, so every summation order gives the same
   bits), with a random, tiny (2^-100), huge (2^100) and NaN tensor amax, NaN scale bytes, and (MXFP4)
   scales 2^±50. Kernel and XLA outputs must be equal bit for bit, with two exceptions the formats
   make: a float NaN equals any NaN; the codes of a block whose scale byte is NaN are not compared
   (the block dequantizes to NaN whatever they are; a block with a NaN input has that scale on both
   sides, since every block maximum keeps NaN). The evidence counts these bytes as ``dont_care``; ±inf
   inputs, inf and NaN tensor amaxes and the scales of NaN blocks are compared bit for bit.
2. The GEMMs also run on random bf16 operands quantized by the XLA path, where the float32 sums are not
   exact, with float32 outputs: each element must satisfy
   |kernel - XLA| <= 3·γ_K·(|A|·|B|ᵀ) + 8u·|XLA| + 2^-149,  γ_K = K·u/(1 - K·u),  u = 2^-24.
   Both sides sum the same exact products (E2M1 x E4M3/E8M0 fits bf16, bf16 x bf16 fits float32) in
   float32 in some order, so each is within γ_K·Σ|products| of the exact sum whatever the order;
   |A|·|B|ᵀ (the dequantized operands, second level included) computed in float32 is within (1 + γ_K)
   of Σ|products|; the second level (tensor factor, 4/6 factor, s_dec, DBQ's outer scales) adds a few
   roundings per side (8u·|XLA|, and ≤ u·E for DBQ's chunk terms, inside the third γ_K); 2^-149 is
   float32's smallest subnormal. A wrong product, block or scale exceeds it; a summation order cannot.
   (The bf16 outputs of the exact cases need no bound: exact sums round alike.)
3. Timing at that size: kernel and XLA calls interleaved, 3 runs of ``iters`` calls each, the median.

Model ops (``MODEL_MODULES``: the Mamba-2 SSD and gated-norm kernels of ``models``) are proved by the
``proof_case`` their module offers (imported here; fp4jax never imports models): the kernel and its XLA twin on the same random inputs at a representative size, forward and
gradients, each output within ``tol`` x the largest magnitude of the twin's (their float32 sums run in
other orders, so bit-exactness is not the test), then timed as in 3. Their verdicts are "<op>/float32".

Verdict: "differs" at the first mismatch (for a model op: an output beyond its tolerance); "error"
if a side does not compile or run; else "faster" when every variant's kernel beats its XLA twin,
"slower" otherwise; "undecided" once the deadline passes (checked between steps). ``register()`` hands
this prover to ``fp4jax.verdicts``, which keeps the verdicts on disk per device key and lets
``impl=None`` use a kernel only where its verdict is "faster" (docs/KERNELS.md, "On-device proof").
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import re
import statistics
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

import fp4jax
from fp4jax import api, dispatch, formats, gemm, native, primitives, random_bits, verdicts
from fp4jax.primitives import quantize as pquantize
from fp4jax.primitives import rht_t as prht
from fp4jax.qtensor import QTensor
from tools.prove.cases import (bound_check, compare_floats, compare_quantized, compare_within, many_binades,
                               _gemm_cases, _quantize_cases)
from tools.prove.variants import BLACKWELL_OPS, DEVICE_SIZES, GEMM_OPS, TINY_SIZES, VARIANTS, Sizes, Variant



@dataclasses.dataclass(frozen=True)
class Device:
  kind: str                  # jax's device_kind, e.g. "NVIDIA H200"
  driver: str                # the NVIDIA kernel driver and the CUDA driver API version


class Deadline(Exception):
  """The proof's time budget ran out between two steps."""


def candidates(native: bool | None = None) -> list[tuple[str, str]]:
  """Every (op, fmt) with a verdict to prove; the native GEMM only where ``native`` (default: on a
  device of compute capability 10.x), for every ``NATIVE_DEFAULTS`` format (on by default, where the
  verdict can revoke it, or off, where it can turn it on)."""
  native = dispatch.native_device() if native is None else native
  blackwell = lambda op, fmt: fmt in (dispatch.NATIVE_DEFAULTS if op == verdicts.NATIVE_OP else dispatch.MOSAIC_FORMATS)
  return [k for k in VARIANTS if k[0] not in BLACKWELL_OPS or (native and blackwell(*k))]


def command(op: str, fmt: str) -> str:
  return f"python -m tools.prove --op {op} --fmt {fmt}"


# ------------------------------------------------------------------------------------------ model ops

# The model kernels this harness proves: op -> the module that holds the kernel. Each offers
# ``proof_case(tiny)`` -> (fn_of, args, output names, shape label), fn_of("pallas" | "xla") a jitted function
# of ``args`` giving the outputs (forward and gradients), and ``PROOF_TOL``: each output within that
# fraction of the largest magnitude of the XLA twin's. The harness imports them; importing a model module
# registers nothing, and fp4jax names none of them.
MODEL_MODULES = {"ssd": "models.ssd_pallas", "gated_norm": "models.gated_norm"}


@dataclasses.dataclass(frozen=True)
class ModelProof:
  """How to prove a model's kernel: its module's ``proof_case`` and ``PROOF_TOL``."""
  module: str
  case: Callable
  tol: float


def model_proof(op: str) -> ModelProof:
  """The proof ``MODEL_MODULES[op]`` offers (the module imported here)."""
  if op not in MODEL_MODULES:
    raise ValueError(f"unknown model kernel op {op!r}; one of {tuple(MODEL_MODULES)}")
  module = importlib.import_module(MODEL_MODULES[op])
  tol = module.PROOF_TOL
  if not 0 < tol < 1:
    raise ValueError(f"{module.__name__}.PROOF_TOL={tol!r}; a fraction of the largest magnitude, in (0, 1)")
  return ModelProof(module.__name__, module.proof_case, tol)


def model_candidates() -> list[tuple[str, str]]:
  """The model ops this harness proves."""
  return [(op, verdicts.MODEL_FMT) for op in MODEL_MODULES]


def _prove_model(v: Variant, sizes: Sizes, deadline: float) -> dict:
  spec = model_proof(v.op)
  fn_of, args, names, shape = spec.case(sizes.tiny)
  kernel, xla = fn_of("pallas"), fn_of("xla")
  record = dict(variant=v.name, shape=shape, cases=[])
  _check_time(deadline)
  want = jax.device_get(xla(*args))
  _check_time(deadline)
  got = jax.device_get(kernel(*args))
  record["cases"].append(dict(case=f"random, within {spec.tol:.0e} of the largest magnitude",
                              **compare_within(got, want, names, spec.tol)))
  if record["cases"][-1]["mismatches"]:
    return record
  t_k, t_x = time_pair(kernel, xla, args, args, max(1, sizes.iters // 4), deadline)
  record.update(kernel_ms=t_k * 1e3, xla_ms=t_x * 1e3, speedup=t_x / t_k)
  return record


# ------------------------------------------------------------------------------------------ run

def _check_time(deadline: float):
  if time.perf_counter() > deadline:
    raise Deadline()


def time_pair(kernel: Callable, xla: Callable, args_k, args_x, iters: int, deadline: float) -> tuple[float, float]:
  """Median seconds per call of each, their timed runs interleaved (3 runs of ``iters`` calls)."""
  runs = {"k": [], "x": []}
  for _ in range(3):
    for label, fn, args in (("k", kernel, args_k), ("x", xla, args_x)):
      _check_time(deadline)
      jax.block_until_ready(fn(*args))
      t0 = time.perf_counter()
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
      runs[label].append((time.perf_counter() - t0) / iters)
  return statistics.median(runs["k"]), statistics.median(runs["x"])


def _quantize_fn(v: Variant, impl: str):
  tiled = v.op == "quantize_2d"

  def fn(x, amax, bits):
    if v.op == "quantize_rht_t":
      return prht.quantize_rht_t(x, amax, bits, fmt=v.fmt, scale_rule=v.scale_rule, impl=impl)
    return pquantize.quantize_last(x, amax, bits, fmt=v.fmt, tiled=tiled, scale_rule=v.scale_rule, impl=impl)
  return jax.jit(fn)


def _prove_quantize(v: Variant, sizes: Sizes, deadline: float) -> dict:
  kernel, xla = _quantize_fn(v, "pallas"), _quantize_fn(v, "xla")
  shape = sizes.quantize
  bits_shape = shape[::-1] if v.op == "quantize_rht_t" else shape
  # SR as the quantized dot runs it: the kernel hashes its bits from the key (random_bits.KeyedBits), the
  # XLA side draws the same bits as an array (inside the timed function on both sides), in either layout.
  bits = random_bits.KeyedBits.of(jax.random.key(7), bits_shape, -1, v.sr_bits) if v.stochastic else None
  record = dict(variant=v.name, shape=list(shape), cases=[])
  for case, x, amax in _quantize_cases(v, shape):
    _check_time(deadline)
    got, want = jax.device_get(kernel(x, amax, bits)), jax.device_get(xla(x, amax, bits))
    record["cases"].append(dict(case=case, **compare_quantized(got, want, v)))
    if record["cases"][-1]["mismatches"]:
      return record
  x, amax = _quantize_cases(v, shape)[0][1:]
  t_k, t_x = time_pair(kernel, xla, (x, amax, bits), (x, amax, bits), sizes.iters, deadline)
  record.update(kernel_ms=t_k * 1e3, xla_ms=t_x * 1e3, speedup=t_x / t_k)
  return record


def _rmsnorm_fn(v: Variant, impl: str):
  """(h, codes, scale bytes) of fp4jax.fused.rmsnorm_quantize (or relu2_quantize, which ignores the
  scale) for the variant's format."""
  from fp4jax import fused   # pylint: disable=import-outside-toplevel

  def fn(x, scale):
    if v.op == "relu2_quantize":
      pre = fused.relu2_quantize(x, v.fmt, impl=impl)
    else:
      pre = fused.rmsnorm_quantize(x, scale, v.fmt, eps=1e-5, impl=impl)
    return pre.x, pre.q.data, pre.q.scale
  # Off a GPU the kernel side runs interpreted and eagerly: XLA CPU compiling an interpreted kernel body
  # whose quantize follows arithmetic in the same body rewrites its float ops (docs/DESIGN.md,
  # "Quantize in the producer's pass"), which says nothing about the Triton kernel.
  return fn if impl == "pallas" and jax.default_backend() != "gpu" else jax.jit(fn)


def _prove_rmsnorm(v: Variant, sizes: Sizes, deadline: float) -> dict:
  """The fused norm + quantize against its twin: h bit for bit (NaN = any NaN) and the codes and scales
  as ``compare_quantized``, on rows of many binades, tiny and huge rows, and zero rows (NaN inputs are
  not cases: the norm spreads one over its whole row, where no format defines the block)."""
  kernel, xla = _rmsnorm_fn(v, "pallas"), _rmsnorm_fn(v, "xla")
  r, d = sizes.quantize
  d = min(d, 8192)
  x = many_binades((r, d), 11)
  scale = 1 + 0.25 * jax.random.normal(jax.random.key(12), (d,), jnp.float32)
  cases = [("many binades", x), ("tiny 2^-120", (x.astype(jnp.float32) * 2.0 ** -120).astype(jnp.bfloat16)),
           ("huge 2^118", (x.astype(jnp.float32) * 2.0 ** 118).astype(jnp.bfloat16)),
           ("zero rows", x.at[::3].set(0))]
  record = dict(variant=v.name, shape=[r, d], cases=[])
  for case, xc in cases:
    _check_time(deadline)
    (gh, gq, gs), (wh, wq, ws) = jax.device_get(kernel(xc, scale)), jax.device_get(xla(xc, scale))
    h = compare_floats(gh, wh)
    qs = compare_quantized((gq, gs), (wq, ws), v)
    record["cases"].append(dict(case=case, mismatches=h["mismatches"] + qs["mismatches"],
                                compared=h["compared"] + qs["compared"], dont_care=qs["dont_care"],
                                first=h["first"] or qs["first"]))
    if record["cases"][-1]["mismatches"]:
      return record
  t_k, t_x = time_pair(kernel, xla, (x, scale), (x, scale), sizes.iters, deadline)
  record.update(kernel_ms=t_k * 1e3, xla_ms=t_x * 1e3, speedup=t_x / t_k)
  return record


def _gemm_fns(v: Variant, out_dtype=jnp.bfloat16):
  """(candidate, XLA path) GEMM functions of two QTensors."""
  if v.op == verdicts.NATIVE_OP:
    side = lambda backend: jax.jit(lambda a, b: gemm.matmul(a, b, out_dtype=out_dtype, impl=backend))
    return side("native"), side("xla")
  if v.op == verdicts.MOSAIC_OP:   # fp4jax's tcgen05 GEMM against the XLA path
    mosaic = jax.jit(lambda a, b: native.matmul(a, b, out_dtype=out_dtype, kernel="mosaic"))
    return mosaic, jax.jit(lambda a, b: gemm.matmul(a, b, out_dtype=out_dtype, impl="xla"))
  side = lambda impl: jax.jit(lambda a, b: api.scaled_matmul(a, b, out_dtype=out_dtype, impl=impl))
  if v.op == "mixed_matmul":   # the GEMM that decodes as it loads (kernels.mixed_matmul)
    mixed = jax.jit(lambda a, b: primitives.mixed_matmul(a, b, out_dtype=out_dtype))
    return mixed, side("xla")
  return side("pallas"), side("xla")


def _random_operands(v: Variant, n: int) -> tuple[QTensor, QTensor]:
  """Random bf16 (n, n) operands quantized by the XLA path, as the quantized dot quantizes them."""
  x = jax.random.normal(jax.random.key(5), (n, n), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(6), (n, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
  if v.pair is not None:
    out = []
    for q, t, seed in ((v.pair[0], x, 8), (v.pair[1], w, 9)):
      key = jax.random.key(seed) if q.needs_key else None
      out.append(jax.jit(q.quantize_t)(t.T, key) if q.rht_size else jax.jit(q)(t, key))
    return tuple(out)
  quant = jax.jit(lambda t, tiled: api.quantize(t, v.fmt, tile=formats.TILE[v.fmt] if tiled else None,
                                                impl="xla"), static_argnums=1)
  return quant(x, v.layout[0]), quant(w, v.layout[1])


def _prove_gemm(v: Variant, sizes: Sizes, deadline: float) -> dict:
  kernel, xla = _gemm_fns(v)
  n = sizes.gemm
  record = dict(variant=v.name, shape=[n, n, n], cases=[])
  for case, a, b in _gemm_cases(v, n):
    _check_time(deadline)
    got, want = jax.device_get(kernel(a, b)), jax.device_get(xla(a, b))
    record["cases"].append(dict(case=case, **compare_floats(got, want)))
    if record["cases"][-1]["mismatches"]:
      return record
  _check_time(deadline)
  a, b = _random_operands(v, n)
  kernel_f32, xla_f32 = _gemm_fns(v, jnp.float32)
  check = bound_check(kernel_f32(a, b), xla_f32(a, b), a, b)
  record["cases"].append(dict(case="random, summation-order bound", mismatches=check["violations"],
                              compared=n * n, first="" if not check["violations"] else
                              f"{check['violations']} elements beyond the bound (rel {check['rel_frobenius']:.1e})",
                              **check))
  if check["violations"]:
    return record
  t_k, t_x = time_pair(kernel, xla, (a, b), (a, b), max(1, sizes.iters // 2), deadline)
  record.update(kernel_ms=t_k * 1e3, xla_ms=t_x * 1e3, speedup=t_x / t_k)
  return record


def prove(op: str, fmt: str, *, sizes: Sizes | None = None, deadline: float = float("inf")) -> dict:
  """Prove (op, fmt) now: {"verdict", "summary", "command", "evidence"} (module docstring)."""
  model = op in MODEL_MODULES and fmt == verdicts.MODEL_FMT
  if op in MODEL_MODULES and not model:
    raise ValueError(f"nothing to prove for op={op!r}, fmt={fmt!r}: a model kernel's verdict has "
                     f"fmt={verdicts.MODEL_FMT!r}")
  if (op, fmt) not in VARIANTS and not model:
    raise ValueError(f"nothing to prove for op={op!r}, fmt={fmt!r}; one of "
                     + ", ".join(f"{o}/{f}" for o, f in [*VARIANTS, *model_candidates()]))
  variants = (Variant(op, fmt, "fwd+bwd"),) if model else VARIANTS[(op, fmt)]
  sizes = sizes or sizes_here()
  start = time.perf_counter()
  evidence = dict(compared="kernel vs its XLA twin on this device" if op != verdicts.NATIVE_OP
                  else "native block-scaled GEMM vs the XLA path on this device",
                  sizes=dataclasses.asdict(sizes), backend=jax.default_backend(), variants=[])
  entry = dict(verdict="undecided", summary="", command=command(op, fmt), evidence=evidence)
  try:
    for v in variants:
      run = (_prove_model if model else _prove_gemm if op in GEMM_OPS else
             _prove_rmsnorm if op in ("rmsnorm_quantize", "relu2_quantize") else _prove_quantize)
      record = run(v, sizes, deadline)
      evidence["variants"].append(record)
      bad = [c for c in record["cases"] if c["mismatches"]]
      if bad:
        c = bad[0]
        entry.update(verdict="differs", summary=f"{v.name}, case {c['case']!r} at {record['shape']}: "
                     f"{c['mismatches']} of {c['compared']} differ ({c['first']})")
        if model:
          entry.update(tolerance=c["tolerance"], max_error=c["max_error"])
        break
    else:
      speedup = min(r["speedup"] for r in evidence["variants"])
      worst = min(evidence["variants"], key=lambda r: r["speedup"])
      how = f"exact on {sum(len(r['cases']) for r in evidence['variants'])} cases"
      if model:
        c = evidence["variants"][0]["cases"][0]
        entry.update(tolerance=c["tolerance"], max_error=c["max_error"])
        how = (f"within tol {c['tolerance']:.0e} of the largest magnitude on {c['compared']} outputs "
               f"(worst {c['worst']} {c['max_error']:.1e})")
      entry.update(verdict="faster" if speedup > 1 else "slower", speedup=speedup,
                   summary=f"{how}; "
                   f"{speedup:.2f}x the XLA path ({worst['variant']}: {worst['kernel_ms']:.3f} ms vs "
                   f"{worst['xla_ms']:.3f} ms)")
  except Deadline:
    entry.update(verdict="undecided", summary=f"the time budget ran out after {len(evidence['variants'])} "
                 f"of {len(variants)} variants (FP4JAX_PROOF_BUDGET_S)")
  except Exception as e:  # pylint: disable=broad-except  (a kernel that fails here is refused, not raised)
    message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    entry.update(verdict="error", summary=f"{type(e).__name__}: {message}")
  evidence["seconds"] = round(time.perf_counter() - start, 3)
  return entry


# ------------------------------------------------------------------------------------------ the device

def this_device() -> Device | None:
  """This process's GPU (its default device), or None when it runs on something else."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:   # pragma: no cover - no backend at all
    return None
  if dev.platform != "gpu":
    return None
  return Device(str(dev.device_kind), driver_version())


def sizes_here() -> Sizes:
  return DEVICE_SIZES if jax.default_backend() == "gpu" else TINY_SIZES


@functools.lru_cache(maxsize=None)   # asked at every impl=None while tracing; fixed for a process
def driver_version() -> str:
  """"<kernel module> CUDA <major.minor>" from /proc and libcuda (no CUDA context needed)."""
  parts = []
  try:
    with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
      m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", f.read())
    if m:
      parts.append(m.group(1))
  except OSError:
    pass
  try:
    v = ctypes.c_int()
    if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
      parts.append(f"CUDA {v.value // 1000}.{v.value % 1000 // 10}")
  except (OSError, AttributeError):
    pass
  return " ".join(parts) or "unknown"


@functools.lru_cache(maxsize=None)
def fp4jax_version() -> str:
  """fp4jax's version and a digest of its sources: a changed kernel is proved again."""
  root = os.path.dirname(os.path.abspath(fp4jax.__file__))
  digest = hashlib.sha256()
  for path, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      digest.update(os.path.relpath(os.path.join(path, name), root).encode())
      with open(os.path.join(path, name), "rb") as f:
        digest.update(f.read())
  return f"{fp4jax.__version__}+{digest.hexdigest()[:12]}"


def device_key(device: Device | None = None) -> dict | None:
  device = device or this_device()
  if device is None:
    return None
  import jaxlib  # pylint: disable=import-outside-toplevel  (jaxlib's version, beside jax's)
  return dict(device=device.kind, driver=device.driver, jax=jax.__version__, jaxlib=jaxlib.__version__,
              fp4jax=fp4jax_version())


class DeviceProver:
  """The prover ``verdicts`` calls: this process's device key, and ``prove`` at this device's sizes."""

  def key(self) -> dict | None:
    return device_key()

  def prove(self, op: str, fmt: str, deadline: float) -> dict:
    return outside_traces(functools.partial(prove, op, fmt, deadline=deadline))


def outside_traces(fn: Callable):
  """``fn()`` on a fresh thread: impl=None asks while a program is being traced, and JAX's trace state
  (and its mesh and device contexts) are per thread, so the proof runs eagerly, on the default device."""
  out = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised on the caller's thread)
      out["error"] = e

  thread = threading.Thread(target=run, name="fp4jax-proof")
  thread.start()
  thread.join()
  if "error" in out:
    raise out["error"]
  return out["value"]


def describe(op: str, fmt: str, entry: dict) -> str:
  """One line: "proof quantize_1d/nvfp4: faster (exact on 14 cases; 1.52x the XLA path ...)"."""
  use = {"faster": "impl=None uses it", "undecided": "the recorded evidence decides"}.get(
      entry["verdict"], "impl=None will not use it")
  line = f"proof {verdicts.name_of(op, fmt)}: {entry['verdict']}: {entry['summary']} -> {use}"
  if entry["verdict"] in verdicts.REFUSED:
    line += f"; reproduce: {entry['command']}"
  return line


def prove_all(pairs=None, *, budget_s: float | None = None, sizes: Sizes | None = None, save: bool = True,
              echo: Callable[[str], None] | None = None) -> dict[str, dict]:
  """Prove every candidate now (ignoring the cache) within ``budget_s`` seconds (default
  FP4JAX_PROOF_BUDGET_S), recording each on disk when ``save`` and this process has a device key."""
  budget = verdicts.budget_s() if budget_s is None else budget_s
  deadline = time.perf_counter() + budget
  key = device_key() if save else None
  out = {}
  for op, fmt in (pairs or candidates()):
    entry = dict(prove(op, fmt, sizes=sizes, deadline=deadline), date=verdicts._now(), attempts=1)  # pylint: disable=protected-access
    out[verdicts.name_of(op, fmt)] = entry
    if key is not None:
      verdicts.record(key, verdicts.name_of(op, fmt), entry)
    if echo:
      echo(describe(op, fmt, entry))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--op", choices=sorted({o for o, _ in VARIANTS} | set(MODEL_MODULES)),
                      help="one op (with --fmt)")
  parser.add_argument("--fmt", help=f"its format (nvfp4, mxfp4, nvfp4_eden, nvfp4_dbq; {verdicts.MODEL_FMT} "
                      "for a model op)")
  parser.add_argument("--budget_s", type=float, default=float("inf"), help="stop after this many seconds")
  parser.add_argument("--no_save", action="store_true", help="do not update the on-disk verdicts")
  parser.add_argument("--json", action="store_true", help="print each entry's evidence as JSON")
  args = parser.parse_args(argv)
  if (args.op is None) != (args.fmt is None):
    parser.error("give --op and --fmt together (or neither, for every candidate)")
  pairs = [(args.op, args.fmt)] if args.op else candidates(native=dispatch.native_device()) + model_candidates()
  if jax.default_backend() != "gpu":
    print("# no GPU: the kernels run in the Pallas interpreter at tiny sizes; nothing is cached", flush=True)
  key = device_key()
  print(f"# device key: {json.dumps(key) if key else 'none (not a GPU)'}; verdicts in "
        f"{verdicts.path_for(key) if key else '-'}", flush=True)
  entries = prove_all(pairs, budget_s=args.budget_s, save=not args.no_save, echo=lambda s: print(s, flush=True))
  if args.json:
    print(json.dumps(entries, indent=1, sort_keys=True))
  return 1 if any(e["verdict"] in verdicts.REFUSED for e in entries.values()) else 0


def register() -> None:
  """Make this process prove on its device: ``impl=None`` then proves each candidate it meets without a
  verdict on record (within FP4JAX_PROOF_BUDGET_S) and uses a kernel only where its verdict is "faster".
  The entry points (``fp4jax-train``, ``fp4jax-sample``) call it; a program of one's own calls it once,
  before tracing. Without it, the recorded lab evidence decides (``dispatch.VERIFIED_KERNELS``)."""
  verdicts.register(DeviceProver())
