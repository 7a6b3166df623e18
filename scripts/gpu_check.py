"""One-shot device check of fp4jax's GPU path: compile, exactness on the device, speed, a train step.

  python scripts/gpu_check.py               # on a CUDA GPU; refuses to run without one
  python scripts/gpu_check.py --rehearse    # the same flow on CPU (interpreted kernels, tiny shapes)

Needs only jax and numpy (plus flax and optax for the train-step rows; no pytest, grain or
jax-triton). Its first lines are the on-device proof (``tools.prove``): each
candidate kernel against its XLA twin, bit for bit on NaN/inf and extreme-amax cases, and timed; on a
GPU the verdicts are cached, so impl=None follows them. Then, for every kernel and every XLA composition it
  1. compiles it (an error is reported in its row and the check goes on),
  2. checks it bit for bit on the device: a kernel against the XLA path, an XLA path against the
     same reference run on the host CPU (the scaled matmuls on operands whose float32 sums are exact
     in any order; at the timing size they are compared by relative error),
  3. times it against the yardsticks: a copy of the input (quantize GB/s) and a bf16 GEMM (TFLOP/s),
then, on a Blackwell GPU (compute capability 10.x), the native block-scaled GEMM rows (fp4jax.native:
each NVFP4-family pair against the XLA path on the device, bit for bit on exactly summable operands and
by relative error at the timing size, timed against the bf16 GEMM; and value_and_grad of fp4jax.dot
native vs bf16), which print "skipped: not Blackwell" elsewhere; then times one train step of the small
config in bf16 and in nvfp4 (default impl, then every kernel forced); before those, the Mamba-2
SSD forward+backward and the gated RMSNorm forward+backward at the 12B mixer's shape, XLA path then the
Pallas kernels (models.ssd_pallas, models.gated_norm). Beside each measured time stands the cost model's
prediction for the same compiled
executable (bench/predict/hlo_cost.py on its HLO, the derated peaks of bench/predict/peaks.py for the device's
kind), so the first device run tests the model too. Each row is printed as it finishes, XLA rows first. A JSON and a Markdown report go to
$OUT (or --out, or a new temporary directory). Targets (printed as ratios): quantize >= 0.70 of copy
bandwidth (nvfp4 1x16 RNE, bf16 8192x8192), emulated NVFP4 GEMM >= 0.90 of bf16 at 8192^3, small nvfp4
step <= 1.25x the bf16 step. The last lines say which kernels a run justifies adding to
``fp4jax.dispatch.VERIFIED_KERNELS`` (exact and faster than the XLA path).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import statistics
import sys
import tempfile
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))   # gpu_check_report, beside this script

import fp4jax  # noqa: E402  (needs ROOT on the path when run as a script)
from fp4jax import dispatch, formats, gemm as fgemm, primitives, random_bits  # noqa: E402
from tools import prove  # noqa: E402
from fp4jax.quantizers import Quantizer  # noqa: E402
from fp4jax.numerics.hadamard import rht  # noqa: E402
from fp4jax.reference import scaled_matmul_reference  # noqa: E402
from bench.predict import hlo_cost, peaks  # noqa: E402  (stdlib only: the cost model of the compiled HLO)
from bench.timing import median_seconds, nbytes  # noqa: E402
import gpu_check_report  # noqa: E402
from gpu_check_report import HEADER, TARGETS, Report, Row  # noqa: E402




@dataclasses.dataclass(frozen=True)
class Sizes:
  quantize: int            # square bf16 input of the quantize rows
  gemm: int                # M = N = K of the GEMM rows
  check_quantize: tuple    # shape compared with the CPU reference (XLA rows)
  check_gemm: tuple        # (M, N, K) of the exactly-summable GEMM check
  iters: int               # calls per timed run (3 runs, median)
  step_config: str         # model preset of the train-step rows
  step_overrides: tuple    # (field, value) pairs applied to the preset
  step_batch: int
  step_seq: int
  step_iters: int


DEVICE_SIZES = Sizes(8192, 8192, (1024, 2048), (512, 512, 4096), 20, "small", (), 32, 256, 10)
# Rehearsal: the tiny model cut to one attention and one MLP block (compile time is what costs on CPU).
REHEARSE_SIZES = Sizes(256, 256, (64, 128), (64, 64, 256), 1, "tiny", (("pattern", "*-"), ("bf16_last_blocks", 0)),
                       2, 32, 2)


def _model_target() -> str:
  """The cost model's target for this device: h100 / h200 / b200 by device kind, else h200."""
  kind = str(getattr(jax.devices()[0], "device_kind", "")).upper()
  return next((t for t in ("b200", "h100", "h200") if t.upper() in kind), "h200")


def _predict(compiled) -> float | None:
  """Predicted ms of one call of a compiled executable (None when its HLO cannot be read)."""
  try:
    return hlo_cost.analyze(compiled.as_text(), peaks.peaks(_model_target()))["seconds"] * 1e3
  except Exception:  # pylint: disable=broad-except  (the prediction never costs a row)
    return None


def _run_row(report: Report, row: Row, work):
  """Runs ``work(row)`` (fills exact/ms/rate/ratio); an exception marks the row ERROR and moves on."""
  if report.elapsed() > report.budget_s:
    row.status, row.error = "skipped", f"time budget of {report.budget_s:.0f} s spent"
    return report.add(row)
  try:
    work(row)
  except Exception as e:  # pylint: disable=broad-except
    row.status = "ERROR"
    row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    row.error += "\n" + "".join(traceback.format_exception(e))[-1500:] if report.rehearse else ""
  return report.add(row)


# ------------------------------------------------------------------------------------------ timing

def _raw(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _same_bits(got, want) -> bool:
  return all(g.shape == w.shape and np.array_equal(_raw(g).view(np.uint8), _raw(w).view(np.uint8))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _on_cpu(fn, *args):
  """``fn`` compiled for and run on the host CPU (the reference of the XLA rows)."""
  cpu = jax.devices("cpu")[0]
  args = jax.device_put(args, cpu)
  with jax.default_device(cpu):
    return jax.device_get(jax.jit(fn)(*args))


# ------------------------------------------------------------------------------------------ inputs

def _input(shape, seed=0):
  """bf16 values over many binades, with E2M1 ties after scaling (like the kernel tests)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))
  x.reshape(-1, shape[-1])[0, :16] = [0, .25, -.75, 1.25, 1.75, -2.5, 3.5, 5, 6, -6, .5, 1, 2, 3, 4, -1.5]
  return jnp.asarray(x.astype(np.float32), jnp.bfloat16)


_exact_operand = prove.cases.exact_operand   # random codes, scales 0.5 or 1: float32 sums exact in any order


# ------------------------------------------------------------------------------------------ quantize

QUANTIZE_OPS = {   # name -> (kernel op, fmt, tiled, stochastic, rht)
    "quantize nvfp4_1x16": ("quantize_1d", "nvfp4", False, False, False),
    "quantize nvfp4_1x16_sr": ("quantize_1d", "nvfp4", False, True, False),
    "quantize nvfp4_16x16": ("quantize_2d", "nvfp4", True, False, False),
    "quantize mxfp4_1x32": ("quantize_1d", "mxfp4", False, False, False),
    "quantize_rht_t nvfp4_rht16_1x16_sr": ("quantize_rht_t", "nvfp4", False, True, True),
}


def _quantize_fn(name, impl):
  """(x, amax, key) -> (codes, scales): the per-pass primitive (tensor amax given, as in training). SR bits
  as the dot makes them (``random_bits.KeyedBits``): the kernel hashes them, the XLA path draws them,
  both inside the timed function."""
  _, fmt, tiled, stochastic, use_rht = QUANTIZE_OPS[name]

  def fn(x, amax, key):
    bits = random_bits.KeyedBits.of(key, x.T.shape if use_rht else x.shape) if stochastic else None
    if use_rht:
      return primitives.quantize_rht_t(x, amax, bits, fmt=fmt, impl=impl)
    return primitives.quantize_last(x, amax, bits, fmt=fmt, tiled=tiled, impl=impl)
  return jax.jit(fn)


def _quantize_args(x, name):
  _, fmt, _, _, use_rht = QUANTIZE_OPS[name]
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(rht(xf.T, axis=-1) if use_rht else xf)) if fmt == "nvfp4" else jnp.float32(0)
  return x, amax, jax.random.key(1)


def quantize_rows(report: Report, impl: str, copy_bw: float, xla_outputs: dict):
  s = report.sizes
  x = _input((s.quantize, s.quantize))
  x_check = _input(s.check_quantize, seed=2)
  for name in QUANTIZE_OPS:
    row = Row("quantize", name, impl, f"{s.quantize}x{s.quantize}")
    if name == "quantize nvfp4_1x16":
      row.target = f"ratio >= {TARGETS['quantize_bw']:.2f} of copy bw"

    def work(row, name=name):
      fn = _quantize_fn(name, impl)
      args = _quantize_args(x, name)
      row.predicted_ms = _predict(fn.lower(*args).compile())   # a compile error lands in this row
      out = fn(*args)
      if impl == "xla":
        xla_outputs[name] = out
        check = _quantize_args(x_check, name)
        exact = _same_bits(jax.device_get(fn(*check)), _on_cpu(_quantize_fn(name, "xla"), *check))
        row.exact = f"vs CPU ref {s.check_quantize[0]}x{s.check_quantize[1]}: {'==' if exact else '!='}"
      else:
        exact = _same_bits(out, xla_outputs[name]) if name in xla_outputs else False
        row.exact = "vs XLA on device: " + ("==" if exact else "!=" if name in xla_outputs else "no XLA row")
      if not exact:
        row.status = "MISMATCH"
      t = median_seconds(fn, *args, iters=s.iters)
      moved = nbytes(x) + nbytes(out)   # SR bits are hashed in the kernel (the XLA path's draw is extra)
      row.ms, row.rate, row.unit, row.ratio = t * 1e3, moved / t / 1e9, "GB/s", moved / t / copy_bw
    _run_row(report, row, work)


# ------------------------------------------------------------------------------------------ matmul

MATMUL_OPS = {   # name -> (fmt, a tiled, b tiled)
    "scaled_matmul nvfp4 1x16.16x16": ("nvfp4", False, True),     # fprop / dgrad
    "scaled_matmul nvfp4 1x16.1x16": ("nvfp4", False, False),     # wgrad
    "scaled_matmul mxfp4 1x32.1x32": ("mxfp4", False, False),
}


def _matmul_fn(impl):
  return jax.jit(lambda a, b: fp4jax.api.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl))


def matmul_rows(report: Report, impl: str, bf16_tflops: float, xla_outputs: dict):
  s = report.sizes
  n = s.gemm
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  cm, cn, ck = s.check_gemm
  for name, (fmt, a_tiled, b_tiled) in MATMUL_OPS.items():
    row = Row("matmul", name, impl, f"{n}^3")
    if name == "scaled_matmul nvfp4 1x16.16x16":
      row.target = f"ratio >= {TARGETS['gemm']:.2f} of bf16"

    def work(row, name=name, fmt=fmt, a_tiled=a_tiled, b_tiled=b_tiled):
      quant = jax.jit(lambda v, tiled: fp4jax.quantize(v, fmt, tile=formats.TILE[fmt] if tiled else None,
                                                       impl="xla"), static_argnums=1)
      a, b = quant(x, a_tiled), quant(w, b_tiled)
      fn = _matmul_fn(impl)
      row.predicted_ms = _predict(fn.lower(a, b).compile())
      out = fn(a, b)
      ea = _exact_operand(cm, ck, fmt, a_tiled, 3)
      eb = _exact_operand(cn, ck, fmt, b_tiled, 4)
      got = jax.device_get(fn(ea, eb))
      want = (_on_cpu(lambda a, b: scaled_matmul_reference(a, b, jnp.bfloat16), ea, eb) if impl == "xla"
              else jax.device_get(_matmul_fn("xla")(ea, eb)))
      exact = _same_bits(got, want)
      verdict = ("==" if exact else "!=") + (" CPU ref" if impl == "xla" else " XLA")
      if impl == "pallas" and name in xla_outputs:
        ref = np.asarray(xla_outputs[name], np.float32)
        err = np.linalg.norm(np.asarray(out, np.float32) - ref) / max(np.linalg.norm(ref), 1e-30)
        verdict += f", rel {err:.1e}"
        exact = exact and err <= 2 ** -8       # bf16 output: at most one rounding apart
      if impl == "xla":
        xla_outputs[name] = out
      row.exact = f"{cm}x{cn}x{ck}: {verdict}"
      if not exact:
        row.status = "MISMATCH"
      t = median_seconds(fn, a, b, iters=max(1, s.iters // 2))
      tflops = 2.0 * n ** 3 / t / 1e12
      row.ms, row.rate, row.unit, row.ratio = t * 1e3, tflops, "TFLOP/s", tflops / bf16_tflops
    _run_row(report, row, work)


# ------------------------------------------------------------------------------------------ native

# name -> (a quantizer, b quantizer); fmt and layout as the quantized dot uses them (tools.prove's table)
NATIVE_OPS = {f"native {v.fmt} {v.name}": v.pair for (op, _), vs in prove.VARIANTS.items() if op == "native_gemm"
              for v in vs}


def is_blackwell() -> bool:
  """A GPU of compute capability 10.x, where impl=None runs the native GEMM."""
  return dispatch.native_device()


_exact_native_operand = prove.cases.exact_native_operand   # the same in each NVFP4-family format


def _quantized(quantizer: Quantizer, x, seed):
  key = jax.random.key(seed)
  if quantizer.rht_size:   # the wgrad operand: (T, C) -> RHT along T, quantized along T
    return jax.jit(quantizer.quantize_t)(x.T, key if quantizer.needs_key else None)
  return jax.jit(quantizer)(x, key) if quantizer.needs_key else jax.jit(quantizer)(x)


def native_rows(report: Report, bf16_tflops: float, bf16_dot_ms: dict):
  """The native GEMM of every NVFP4-family pair and one native fp4jax.dot, on Blackwell (and in the
  CPU rehearsal, through the native path's CPU twin); "skipped: not Blackwell" elsewhere."""
  s = report.sizes
  n = s.gemm
  run = report.rehearse or is_blackwell()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, n)) * 0.05, jnp.bfloat16)
  cm, cn, ck = s.check_gemm
  fn = lambda backend: jax.jit(lambda a, b: fgemm.matmul(a, b, out_dtype=jnp.bfloat16, impl=backend))
  for name, (qa, qb) in NATIVE_OPS.items():
    row = Row("native", name, "native", f"{n}^3")
    if name == "native nvfp4 1x16.16x16":
      row.target = f"ratio >= {TARGETS['native_gemm']:.2f} of bf16"
    if not run:
      row.status, row.exact = "skipped", "skipped: not Blackwell"
      report.add(row)
      continue

    def work(row, qa=qa, qb=qb):
      a, b = _quantized(qa, x, 5), _quantized(qb, w, 6)
      f_native, f_xla = fn("native"), fn("xla")
      row.predicted_ms = _predict(f_native.lower(a, b).compile())
      out = f_native(a, b)
      ea, eb = _exact_native_operand(cm, ck, qa, 3), _exact_native_operand(cn, ck, qb, 4)
      exact = _same_bits(jax.device_get(f_native(ea, eb)), jax.device_get(f_xla(ea, eb)))
      ref = np.asarray(f_xla(a, b), np.float32)
      err = np.linalg.norm(np.asarray(out, np.float32) - ref) / max(np.linalg.norm(ref), 1e-30)
      row.exact = f"{cm}x{cn}x{ck}: {'==' if exact else '!='} XLA, rel {err:.1e}"
      if not exact or not err <= 2 ** -8:      # bf16 output: at most one rounding apart
        row.status = "MISMATCH"
      t = median_seconds(f_native, a, b, iters=max(1, s.iters // 2))
      tflops = 2.0 * n ** 3 / t / 1e12
      row.ms, row.rate, row.unit, row.ratio = t * 1e3, tflops, "TFLOP/s", tflops / bf16_tflops
    _run_row(report, row, work)
  for recipe in ("nvfp4", "bf16"):   # value_and_grad of fp4jax.dot: native (every GEMM) vs the bf16 recipe
    row = Row("native", f"dot {recipe} y,dx,dw" + (", native" if recipe != "bf16" else ""),
              "native" if recipe != "bf16" else "xla", f"{n}^3")
    if recipe == "nvfp4":
      row.target = f"ratio <= {TARGETS['native_dot']:.2f} of the bf16 dot"
    if not run:
      row.status, row.exact = "skipped", "skipped: not Blackwell"
      report.add(row)
      continue

    def work(row, recipe=recipe):
      dy = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)

      def dot(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(2)), x, w)
        return (y, *vjp(dy))

      outs = {}
      for impl in (("native", "xla") if recipe != "bf16" else ("xla",)):
        saved = os.environ.get(dispatch.DEFAULT_IMPL_ENV)
        os.environ[dispatch.DEFAULT_IMPL_ENV] = impl   # resolved while tracing: this compile only
        try:
          compiled = jax.jit(dot).lower(x, w, dy).compile()
        finally:
          if saved is None:
            os.environ.pop(dispatch.DEFAULT_IMPL_ENV, None)
          else:
            os.environ[dispatch.DEFAULT_IMPL_ENV] = saved
        outs[impl] = compiled
      main = outs["native" if recipe != "bf16" else "xla"]
      row.predicted_ms = _predict(main)
      got = main(x, w, dy)
      if recipe != "bf16":
        want = outs["xla"](x, w, dy)
        errs = [np.linalg.norm(np.asarray(g, np.float32) - np.asarray(r, np.float32))
                / max(np.linalg.norm(np.asarray(r, np.float32)), 1e-30) for g, r in zip(got, want)]
        row.exact = "vs XLA: rel " + "/".join(f"{e:.0e}" for e in errs)
        if not all(e <= 2 ** -8 for e in errs):
          row.status = "MISMATCH"
      t = median_seconds(main, x, w, dy, iters=max(1, s.iters // 4))
      row.ms = t * 1e3
      if recipe == "bf16":
        bf16_dot_ms["bf16"] = row.ms
        row.ratio = 1.0
    _run_row(report, row, work)
  for r in report.rows:   # the native dot's ratio, once the bf16 dot is timed
    if r.section == "native" and r.name.startswith("dot nvfp4") and r.ms and bf16_dot_ms.get("bf16"):
      r.ratio = r.ms / bf16_dot_ms["bf16"]


# ------------------------------------------------------------------------------------------ yardsticks

def yardstick_rows(report: Report):
  s = report.sizes
  out = {}
  x = _input((s.quantize, s.quantize))

  def copy(row):
    fn = jax.jit(lambda v: -v)
    row.predicted_ms = _predict(fn.lower(x).compile())
    t = median_seconds(fn, x, iters=s.iters)
    out["copy_bw"] = 2 * nbytes(x) / t
    row.ms, row.rate, row.unit, row.ratio = t * 1e3, out["copy_bw"] / 1e9, "GB/s", 1.0

  n = s.gemm
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)

  def gemm(row):
    fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    row.predicted_ms = _predict(fn.lower(a, b).compile())
    t = median_seconds(fn, a, b, iters=max(1, s.iters // 2))
    out["bf16_tflops"] = 2.0 * n ** 3 / t / 1e12
    row.ms, row.rate, row.unit, row.ratio = t * 1e3, out["bf16_tflops"], "TFLOP/s", 1.0

  _run_row(report, Row("yardstick", "copy (-x), bf16", "xla", f"{s.quantize}x{s.quantize}"), copy)
  _run_row(report, Row("yardstick", "bf16 GEMM, f32 accumulate", "xla", f"{n}^3"), gemm)
  return out.get("copy_bw", float("nan")), out.get("bf16_tflops", float("nan"))


# ------------------------------------------------------------------------------------------ train step

def _import_training():
  """(training.step, models). ``training/__init__`` imports the data pipeline (grain), which the device
  image may lack; the step needs only step/optim/sharding/config, so when that import fails the
  package is entered without its __init__."""
  try:
    step = importlib.import_module("training.step")
  except ImportError as e:
    print(f"# note: `import training` failed ({e}); importing training.step without training/__init__",
          flush=True)
    for name in [m for m in sys.modules if m == "training" or m.startswith("training.")]:
      del sys.modules[name]
    pkg = types.ModuleType("training")
    pkg.__path__ = [os.path.join(ROOT, "training")]
    sys.modules["training"] = pkg
    step = importlib.import_module("training.step")
  return step, importlib.import_module("models")


def _train_step_fn(report: Report, recipe: str, force_kernels: bool):
  """(compiled step, state, tokens, tokens per step) of the small (or rehearsal) model."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top  (optional: only these rows need flax)
  import optax  # pylint: disable=g-import-not-at-top
  s = report.sizes
  step_lib, models = _import_training()
  model_config = models.get_model_config(s.step_config, **dict(s.step_overrides))
  model = step_lib.build_model(model_config, fp4jax.recipes.get(recipe))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=0.1))   # lr 1: lr_fn scales
  lr_fn = optax.constant_schedule(1e-3)
  state = jax.jit(lambda: (lambda st: dict(st, params=nn.unbox(st["params"])))(
      step_lib.init_state(model, tx, 0, s.step_seq)))()
  tokens = jax.random.randint(jax.random.key(1), (s.step_batch, s.step_seq + 1), 0,
                              model_config.vocab_size, jnp.int32)
  fn = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, lr_fn=lr_fn))
  saved = os.environ.get(dispatch.DEFAULT_IMPL_ENV)
  if force_kernels:        # impl=None is resolved while tracing: force the kernels for this compile only
    os.environ[dispatch.DEFAULT_IMPL_ENV] = "pallas"
  try:
    compiled = fn.lower(state, tokens).compile()
  finally:
    if saved is None:
      os.environ.pop(dispatch.DEFAULT_IMPL_ENV, None)
    else:
      os.environ[dispatch.DEFAULT_IMPL_ENV] = saved
  return compiled, state, tokens, s.step_batch * s.step_seq


def train_rows(report: Report):
  s = report.sizes
  times = {}
  shape = f"{s.step_config}{'*' if s.step_overrides else ''} {s.step_batch}x{s.step_seq}"
  for label, recipe, force in (("train step bf16", "bf16", False), ("train step nvfp4", "nvfp4", False),
                               ("train step nvfp4, kernels forced", "nvfp4", True)):
    row = Row("train", label, "pallas" if force else "default", shape)
    if label == "train step nvfp4":
      row.target = f"ratio <= {TARGETS['step']:.2f} of bf16"

    def work(row, label=label, recipe=recipe, force=force):
      compiled, state, tokens, n_tokens = _train_step_fn(report, recipe, force)
      row.predicted_ms = _predict(compiled)
      state, metrics = compiled(state, tokens)
      loss = float(metrics["loss"])
      row.exact = f"loss {loss:.4f}" + ("" if np.isfinite(loss) else " NOT FINITE")
      if not np.isfinite(loss):
        row.status = "MISMATCH"
      runs = []
      for _ in range(s.step_iters):
        t0 = time.perf_counter()
        state, metrics = compiled(state, tokens)
        jax.block_until_ready(metrics)
        runs.append(time.perf_counter() - t0)
      t = statistics.median(runs)
      times[label] = t
      row.ms, row.rate, row.unit = t * 1e3, n_tokens / t / 1e3, "ktok/s"
      if "train step bf16" in times:
        row.ratio = t / times["train step bf16"]
    _run_row(report, row, work)


# ------------------------------------------------------------------------------------------ SSD

# The Mamba-2 SSD forward+backward (models.ssd_pallas.ssd: y = SSD + D x, then dx, ddt, dA, dB, dC, dD) and
# the mixer's gated RMSNorm forward+backward (models.gated_norm.gated_norm: out, then dy, dz, dscale): the
# cases and tolerances of their on-device proofs (``proof_case``, ``PROOF_TOL``: each output within the
# tolerance x the largest magnitude of the XLA path's), at the 12B mixer's shape, a tiny one in the rehearsal.

def ssd_rows(report: Report):
  from models import ssd_pallas   # pylint: disable=g-import-not-at-top  (flax-free, but models/ imports flax)
  fn_of, args, names, shape = ssd_pallas.proof_case(report.rehearse)
  _kernel_vs_xla_rows(report, "ssd", "ssd fwd+bwd (+D x)", shape, fn_of, args, names, ssd_pallas.PROOF_TOL,
                      report.sizes)


def gated_norm_rows(report: Report):
  from models import gated_norm   # pylint: disable=g-import-not-at-top
  fn_of, args, names, shape = gated_norm.proof_case(report.rehearse)
  _kernel_vs_xla_rows(report, "gated_norm", "gated norm fwd+bwd", shape, fn_of, args, names,
                      gated_norm.PROOF_TOL, report.sizes)


def _kernel_vs_xla_rows(report: Report, section, name, shape, fn_of, args, outputs_named, tol, s):
  """Two rows: ``fn_of("xla")`` (finite outputs), then ``fn_of("pallas")`` within ``tol`` x each output's
  largest magnitude on the XLA path, both timed; the kernel's ratio is the XLA time / its own."""
  outputs = {}
  for impl in ("xla", "pallas"):
    row = Row(section, name, impl, shape)
    row.target = "kernel within tol, faster" if impl == "pallas" else ""

    def work(row, impl=impl):
      fn = fn_of(impl)
      row.predicted_ms = _predict(fn.lower(*args).compile())
      out = jax.block_until_ready(fn(*args))
      outputs[impl] = out
      if impl == "pallas":
        if "xla" not in outputs:
          row.exact = "no XLA row"
        else:
          errs = [float(jnp.max(jnp.abs(o - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
                  for o, r in zip(out, outputs["xla"])]
          worst = int(np.argmax(errs))
          row.exact = f"vs XLA: {outputs_named[worst]} {errs[worst]:.1e} (tol {tol:.0e})"
          if not np.isfinite(errs[worst]) or errs[worst] > tol:
            row.status = "MISMATCH"
      else:
        finite = all(bool(jnp.isfinite(o).all()) for o in out)
        row.exact = "finite" if finite else "NOT FINITE"
        if not finite:
          row.status = "MISMATCH"
      t = median_seconds(fn, *args, iters=max(1, s.iters // 4))
      row.ms = t * 1e3
      if impl == "pallas" and report.rows and report.rows[-1].name == row.name and report.rows[-1].ms:
        row.ratio = report.rows[-1].ms / row.ms   # the XLA path's time / the kernel's
        row.unit = "x xla"
    _run_row(report, row, work)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rehearse", action="store_true",
                      help="run the identical flow on CPU: interpreted kernels, tiny shapes (< 2 minutes)")
  parser.add_argument("--out", default=None, help="report directory (default: $OUT, else a new temp dir)")
  parser.add_argument("--budget_s", type=float, default=None,
                      help="rows starting after this many seconds are skipped (default 270 on a GPU, "
                      "none in a rehearsal, which must exercise every row)")
  parser.add_argument("--proof_budget_s", type=float, default=None,
                      help="seconds for the on-device proof printed first (tools.prove; default 60 on a GPU, "
                      "none in a rehearsal)")
  args = parser.parse_args(argv)
  gpu = jax.default_backend() == "gpu" and any(d.platform == "gpu" for d in jax.devices())
  if not gpu and not args.rehearse:
    print("\n" + "=" * 78 + "\ngpu_check: jax sees NO GPU "
          f"(backend {jax.default_backend()!r}, devices {jax.devices()}).\n"
          "This check must run on a CUDA GPU: install a CUDA jax (pip install -e '.[gpu-cuda12]' or\n"
          "'.[gpu-cuda13]', see docs/KERNELS.md) and check `python -c \"import jax; print(jax.devices())\"`.\n"
          "To rehearse the flow on CPU, run: python scripts/gpu_check.py --rehearse\n" + "=" * 78,
          file=sys.stderr, flush=True)
    return 2
  if args.rehearse and gpu:
    print("# --rehearse on a GPU machine: the rows run on the GPU with rehearsal sizes", flush=True)
  sizes = REHEARSE_SIZES if args.rehearse else DEVICE_SIZES
  out_dir = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="fp4jax_gpu_check_")
  budget = args.budget_s if args.budget_s is not None else (float("inf") if args.rehearse else 270.0)
  report = Report(out_dir, sizes, args.rehearse, budget)
  # The proof first: every candidate proved on this device now (cached for impl=None on a GPU).
  if not (args.rehearse or is_blackwell()):
    print("proof native_gemm, mosaic_gemm: skipped: not Blackwell (compute capability 10.x)", flush=True)
  report.proof = prove.prove_all(prove.candidates(native=args.rehearse or is_blackwell()),
                                 budget_s=args.proof_budget_s if args.proof_budget_s is not None
                                 else (float("inf") if args.rehearse else 60.0),
                                 sizes=prove.TINY_SIZES if args.rehearse else None, save=not args.rehearse,
                                 echo=lambda line: print(line, flush=True))
  env = gpu_check_report.environment()
  print(f"# fp4jax gpu_check{' --rehearse' if args.rehearse else ''}: {env['device']} x{env['devices']}, "
        f"jax {env['jax']}, Triton backend {'yes' if env['triton'] else 'NO'}, "
        f"VERIFIED_KERNELS {sorted(env['verified_kernels']) or 'empty'}", flush=True)
  print(HEADER, flush=True)
  copy_bw, bf16_tflops = yardstick_rows(report)
  xla_quantize, xla_matmul = {}, {}
  quantize_rows(report, "xla", copy_bw, xla_quantize)       # XLA rows first: the baseline and the fallback
  matmul_rows(report, "xla", bf16_tflops, xla_matmul)
  quantize_rows(report, "pallas", copy_bw, xla_quantize)
  matmul_rows(report, "pallas", bf16_tflops, xla_matmul)
  native_rows(report, bf16_tflops, {})
  ssd_rows(report)
  gated_norm_rows(report)
  train_rows(report)
  gpu_check_report.write_report(report, env, QUANTIZE_OPS, MATMUL_OPS, NATIVE_OPS)
  failed = [r for r in report.rows if r.status in ("ERROR", "MISMATCH")]
  print(f"# {len(report.rows)} rows, {len(failed)} failed, {report.elapsed():.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
