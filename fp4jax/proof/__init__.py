"""On-device proof: each candidate kernel against its XLA twin on *this* device, bit for bit, and timed.

  python -m fp4jax.proof                                  # every candidate, printed (and cached on a GPU)
  python -m fp4jax.proof --op quantize_1d --fmt nvfp4     # one: the command a refusal prints

Candidates are named "<op>/<fmt>": the Pallas kernels (``dispatch.KERNEL_OPS`` x the kernel formats,
every variant the quantized dot runs: RNE and stochastic rounding, 1x and 16x16 tiles, MXFP4's scale
rules, the GEMM layouts; two Pallas GEMMs, "scaled_matmul" the dequantize passes and bf16 GEMM and
"mixed_matmul" the GEMM that decodes as it loads) and "native_gemm/<fmt>", the Blackwell block-scaled GEMM (``fp4jax.native``)
for each ``NATIVE_DEFAULTS`` format. For each variant:

1. Cases, on the device, at the timing size: random bf16 over many binades with E2M1 ties; the same
   scaled to tiny (2^-120) and huge (2^118) magnitudes; NaN and ±inf entries with a finite amax, with
   amax = inf and amax = NaN; all zeros. The GEMMs take exactly-summable operands (random codes,
   scales whose float32 partial sums are exact in any order, so every summation order gives the same
   bits), with a random, tiny (2^-100), huge (2^100) and NaN tensor amax, NaN scale bytes, and (MXFP4)
   scales 2^±50. Kernel and XLA outputs must be equal bit for bit, with two exceptions the formats
   make: a float NaN equals any NaN; the codes of a block whose scale byte is NaN are not compared
   (the block dequantizes to NaN whatever they are); and a block with a NaN input is not compared at
   all (no format defines it, and the XLA reference's own scale there, 0, -448 or NaN, depends on the
   order XLA reduces the block's max in). The evidence counts these bytes as ``dont_care``; ±inf
   inputs, inf and NaN tensor amaxes are compared bit for bit.
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

Model ops (``dispatch.MODEL_KERNEL_OPS``: the Mamba-2 SSD and gated-norm kernels of ``models``) are
proved by the function their module registers at import (``register_model``; fp4jax never imports
models): the kernel and its XLA twin on the same random inputs at a representative size, forward and
gradients, each output within ``tol`` x the largest magnitude of the twin's (their float32 sums run in
other orders, so bit-exactness is not the test), then timed as in 3. Their verdicts are "<op>/float32".

Verdict: "differs" at the first mismatch (for a model op: an output beyond its tolerance); "error"
if a side does not compile or run; else "faster" when every variant's kernel beats its XLA twin,
"slower" otherwise; "undecided" once the deadline passes (checked between steps). ``import fp4jax``
registers this prover with ``fp4jax.verdicts``, which keeps the verdicts on disk per device
key and lets ``impl=None`` use a kernel only where its verdict is "faster" (docs/KERNELS.md, "On-device proof").
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
import numpy as np

import fp4jax
from fp4jax import api, dispatch, formats, gemm, primitives, random_bits, verdicts
from fp4jax.numerics.hadamard import rht
from fp4jax.primitives import quantize as pquantize
from fp4jax.primitives import rht_t as prht
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import Quantizer

Array = jax.Array
U = 2.0 ** -24               # float32 unit roundoff
F32_TINY = 2.0 ** -149       # float32's smallest subnormal


@dataclasses.dataclass(frozen=True)
class Sizes:
  quantize: tuple[int, int]  # (R, C) of the quantize cases and timing (rht_t: (T, C))
  gemm: int                  # M = N = K of the GEMM cases and timing
  iters: int                 # calls per timed run
  tiny: bool = False         # model ops: the tiny case (interpreted kernels) instead of the model's shape


DEVICE_SIZES = Sizes((8192, 8192), 4096, 10)   # the sizes of scripts/gpu_check.py's rows, a GEMM of 4096^3
TINY_SIZES = Sizes((64, 128), 128, 1, tiny=True)   # off a GPU: interpreted kernels (tests, --rehearse)


@dataclasses.dataclass(frozen=True)
class Device:
  kind: str                  # jax's device_kind, e.g. "NVIDIA H200"
  driver: str                # the NVIDIA kernel driver and the CUDA driver API version


class Deadline(Exception):
  """The proof's time budget ran out between two steps."""


# ------------------------------------------------------------------------------------------ candidates

@dataclasses.dataclass(frozen=True)
class Variant:
  """One way the quantized dot calls an op: what a verdict for (op, fmt) must cover."""
  op: str
  fmt: str
  name: str
  tiled: bool = False        # quantize: 16x16 tiles; scaled_matmul: (a tiled, b tiled) in ``layout``
  stochastic: bool = False
  sr_bits: str = random_bits.JAX   # stochastic: the layout of the bits the kernel hashes
  scale_rule: str = "rceil"
  layout: tuple[bool, bool] = (False, False)
  pair: tuple[Quantizer, Quantizer] | None = None   # native_gemm: the operands' quantizers


VARIANTS: dict[tuple[str, str], tuple[Variant, ...]] = {
    ("quantize_1d", "nvfp4"): (Variant("quantize_1d", "nvfp4", "1x16"),
                               Variant("quantize_1d", "nvfp4", "1x16 SR", stochastic=True),
                               Variant("quantize_1d", "nvfp4", "1x16 SR packed", stochastic=True, sr_bits="packed")),
    ("quantize_1d", "mxfp4"): (Variant("quantize_1d", "mxfp4", "1x32 rceil"),
                               Variant("quantize_1d", "mxfp4", "1x32 floor", scale_rule="floor"),
                               Variant("quantize_1d", "mxfp4", "1x32 SR", stochastic=True),
                               Variant("quantize_1d", "mxfp4", "1x32 SR packed", stochastic=True, sr_bits="packed")),
    ("quantize_2d", "nvfp4"): (Variant("quantize_2d", "nvfp4", "16x16", tiled=True),
                               Variant("quantize_2d", "nvfp4", "16x16 SR", tiled=True, stochastic=True),
                               Variant("quantize_2d", "nvfp4", "16x16 SR packed", tiled=True, stochastic=True,
                                       sr_bits="packed")),
    ("quantize_rht_t", "nvfp4"): (Variant("quantize_rht_t", "nvfp4", "rht16 1x16"),
                                  Variant("quantize_rht_t", "nvfp4", "rht16 1x16 SR", stochastic=True),
                                  Variant("quantize_rht_t", "nvfp4", "rht16 1x16 SR packed", stochastic=True,
                                          sr_bits="packed")),
    ("quantize_rht_t", "mxfp4"): (Variant("quantize_rht_t", "mxfp4", "rht16 1x32"),
                                  Variant("quantize_rht_t", "mxfp4", "rht16 1x32 SR", stochastic=True),
                                  Variant("quantize_rht_t", "mxfp4", "rht16 1x32 SR packed", stochastic=True,
                                          sr_bits="packed")),
    ("scaled_matmul", "nvfp4"): (Variant("scaled_matmul", "nvfp4", "1x16.16x16", layout=(False, True)),
                                 Variant("scaled_matmul", "nvfp4", "1x16.1x16")),
    ("scaled_matmul", "mxfp4"): (Variant("scaled_matmul", "mxfp4", "1x32.1x32"),),
    ("mixed_matmul", "nvfp4"): (Variant("mixed_matmul", "nvfp4", "1x16.16x16", layout=(False, True)),
                                Variant("mixed_matmul", "nvfp4", "1x16.1x16")),
    ("mixed_matmul", "mxfp4"): (Variant("mixed_matmul", "mxfp4", "1x32.1x32"),),
    ("rmsnorm_quantize", "nvfp4"): (Variant("rmsnorm_quantize", "nvfp4", "rmsnorm 1x16"),),
    ("rmsnorm_quantize", "mxfp4"): (Variant("rmsnorm_quantize", "mxfp4", "rmsnorm 1x32 rceil"),),
    ("relu2_quantize", "nvfp4"): (Variant("relu2_quantize", "nvfp4", "relu2 1x16"),),
    ("relu2_quantize", "mxfp4"): (Variant("relu2_quantize", "mxfp4", "relu2 1x32 rceil"),),
    ("native_gemm", "nvfp4"): (
        Variant("native_gemm", "nvfp4", "1x16.16x16", pair=(Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True))),
        Variant("native_gemm", "nvfp4", "1x16.1x16 SR RHT", pair=(
            Quantizer("nvfp4", rht_size=16), Quantizer("nvfp4", stochastic=True, rht_size=16))),
        Variant("native_gemm", "nvfp4", "4/6 1x16.16x16", pair=(
            Quantizer("nvfp4", four_over_six=(256, "mse")),
            Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse"))))),
    ("native_gemm", "nvfp4_eden"): (Variant("native_gemm", "nvfp4_eden", "1x16.1x16", pair=(
        Quantizer("nvfp4_eden"), Quantizer("nvfp4_eden"))),),
    ("native_gemm", "nvfp4_dbq"): (Variant("native_gemm", "nvfp4_dbq", "1x16.1x16", pair=(
        Quantizer("nvfp4_dbq"), Quantizer("nvfp4_dbq", stochastic=True))),),
    ("native_gemm", "mxfp8"): (Variant("native_gemm", "mxfp8", "1x32.1x32", pair=(
        Quantizer("mxfp8"), Quantizer("mxfp8"))),),
}


GEMM_OPS = ("scaled_matmul", "mixed_matmul", verdicts.NATIVE_OP)


def candidates(native: bool | None = None) -> list[tuple[str, str]]:
  """Every (op, fmt) with a verdict to prove; the native GEMM only where ``native`` (default: on a
  device of compute capability 10.x), for every ``NATIVE_DEFAULTS`` format (on by default, where the
  verdict can revoke it, or off, where it can turn it on)."""
  native = dispatch.native_device() if native is None else native
  return [k for k in VARIANTS if k[0] != verdicts.NATIVE_OP or (native and k[1] in dispatch.NATIVE_DEFAULTS)]


def command(op: str, fmt: str) -> str:
  load = f"--import {MODEL_PROOFS[op].module} " if op in MODEL_PROOFS else ""
  return f"python -m fp4jax.proof {load}--op {op} --fmt {fmt}"


# ------------------------------------------------------------------------------------------ model ops

@dataclasses.dataclass(frozen=True)
class ModelProof:
  """How to prove a model's kernel (registered by the module that holds it)."""
  module: str                # that module (the reproduction command imports it)
  case: Callable             # case(tiny) -> (fn_of, args, output names, shape label): fn_of("pallas" |
                             # "xla") a jitted function of ``args`` giving the outputs (forward and gradients)
  tol: float                 # each output within tol x the largest magnitude of the XLA twin's


MODEL_PROOFS: dict[str, ModelProof] = {}


def register_model(op: str, module: str, case: Callable, tol: float):
  """Called by ``models`` at import: ``op`` (one of ``dispatch.MODEL_KERNEL_OPS``) is proved by ``case``."""
  if op not in dispatch.MODEL_KERNEL_OPS:
    raise ValueError(f"unknown model kernel op {op!r}; add it to fp4jax.dispatch.MODEL_KERNEL_OPS")
  if not 0 < tol < 1:
    raise ValueError(f"tol={tol!r} for {op!r}; a fraction of the largest magnitude, in (0, 1)")
  MODEL_PROOFS[op] = ModelProof(module, case, tol)


def model_candidates() -> list[tuple[str, str]]:
  """The model ops whose proof is registered (their modules imported)."""
  return [(op, verdicts.MODEL_FMT) for op in MODEL_PROOFS]


def compare_within(got, want, names, tol: float) -> dict:
  """Each output's largest |kernel - XLA| / the XLA output's largest magnitude; a mismatch is an output
  beyond ``tol`` or not finite."""
  if len(got) != len(want) or any(np.shape(g) != np.shape(w) for g, w in zip(got, want)):
    return dict(mismatches=max(len(want), 1), compared=len(want), tolerance=tol, max_error=float("nan"),
                errors={}, worst="", first=f"outputs differ in number or shape: kernel "
                f"{[np.shape(g) for g in got]}, XLA {[np.shape(w) for w in want]}")
  errs = []
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    errs.append(float(np.max(np.abs(g - w), initial=0) / max(float(np.max(np.abs(w), initial=0)), 1e-30)))
  bad = [i for i, e in enumerate(errs) if not e <= tol]
  worst = max(range(len(errs)), key=lambda i: (not np.isfinite(errs[i]), np.nan_to_num(errs[i])))
  return dict(mismatches=len(bad), compared=len(errs), tolerance=tol, max_error=errs[worst],
              errors=dict(zip(names, errs)), worst=names[worst],
              first=f"{names[worst]} {errs[worst]:.1e} of its largest magnitude > tol {tol:.0e}" if bad else "")


def _prove_model(v: Variant, sizes: Sizes, deadline: float) -> dict:
  spec = MODEL_PROOFS[v.op]
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


# ------------------------------------------------------------------------------------------ inputs

def many_binades(shape, seed: int) -> Array:
  """bf16 values over many binades, the first row's first 16 E2M1 ties and grid points (on the device)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(jax.random.uniform(k2, shape, jnp.float32, -4, 4))
  ties = jnp.asarray([0, .25, -.75, 1.25, 1.75, -2.5, 3.5, 5, 6, -6, .5, 1, 2, 3, 4, -1.5], jnp.float32)
  return x.at[0, :16].set(ties[:min(16, shape[1])]).astype(jnp.bfloat16)


def _with_specials(x: Array) -> Array:
  """x with NaN, +inf and -inf in blocks of their own and one block of NaN, inf and finite values."""
  r, c = x.shape
  at = [(1, 3, jnp.nan), (2 % r, 20 % c, jnp.inf), (3 % r, 40 % c, -jnp.inf), (5 % r, 64 % c, jnp.nan),
        (5 % r, 65 % c, jnp.inf), (r - 1, c - 1, jnp.nan)]
  for i, j, v in at:
    x = x.at[i, j].set(v)
  return x


def _quantize_cases(v: Variant, shape) -> list[tuple[str, Array, Array]]:
  """(case, x, amax): the tensor amax as training computes it (of RHT(x) for rht_t), or extreme."""
  x = many_binades(shape, 11)
  special = _with_specials(x)

  def amax_of(t):
    t = t.astype(jnp.float32)
    t = rht(t.T, axis=-1) if v.op == "quantize_rht_t" else t
    return jnp.max(jnp.where(jnp.isfinite(t), jnp.abs(t), 0))

  cases = [("random", x, amax_of(x)),
           ("tiny 2^-120", (x.astype(jnp.float32) * 2.0 ** -120).astype(jnp.bfloat16), None),
           ("huge 2^118", (x.astype(jnp.float32) * 2.0 ** 118).astype(jnp.bfloat16), None),
           ("nan/inf, finite amax", special, amax_of(special)),
           ("nan/inf, amax inf", special, jnp.float32(jnp.inf)),
           ("amax nan", x, jnp.float32(jnp.nan)),
           ("zeros", jnp.zeros(shape, jnp.bfloat16), jnp.float32(0))]
  out = []
  for name, t, amax in cases:
    if v.fmt != "nvfp4":          # MXFP4 has no tensor amax: the amax cases are the same input
      if name.startswith("amax") or name.endswith("amax inf"):
        continue
      amax = jnp.float32(0)
    out.append((name, t, amax_of(t) if amax is None else jnp.asarray(amax, jnp.float32)))
  return out


def exact_operand(rows: int, k: int, fmt: str, tiled: bool, seed: int, *, scales=None, amax=None) -> QTensor:
  """QTensor of random codes with scales 0.5 or 1 (``scales``: other scale bytes): every float32
  partial sum of a GEMM of two of them is exact (products are multiples of 2^-4, |sum| <= 36·K), so any
  summation order gives the same bits. ``amax``: the nvfp4 tensor amax (default random in [1, 100))."""
  rng = np.random.default_rng(seed)
  data = jnp.asarray(rng.integers(0, 256, (rows, k // 2)), jnp.uint8)
  tile = formats.TILE[fmt] if tiled else None
  s_shape = (rows // tile[0], k // tile[1]) if tiled else (rows, k // formats.BLOCK[fmt])
  choices = np.array(scales if scales is not None else [0x30, 0x38] if fmt == "nvfp4" else [126, 127], np.uint8)
  scale = jax.lax.bitcast_convert_type(jnp.asarray(rng.choice(choices, s_shape)), formats.SCALE_DTYPE[fmt])
  if fmt == "nvfp4":
    amax = jnp.float32(rng.uniform(1, 100) if amax is None else amax)
  else:
    amax = None
  return QTensor(data, scale, amax, fmt, -1, None if tiled else formats.BLOCK[fmt], tile,
                 jnp.dtype(jnp.float32), "rceil" if fmt == "mxfp4" else None)


def exact_native_operand(rows: int, k: int, q: Quantizer, seed: int, *, amax=None, scales=None) -> QTensor:
  """``exact_operand`` in q's format: 4/6 as bound 256, MS-EDEN with s_dec 0.5, DBQ with power-of-two
  outer scales, so that every float32 partial sum stays exact and any order gives the same bits. MXFP8:
  E4M3 integers in [-4, 4] with scales 0.5 or 1 (``scales``: other E8M0 bytes): products are multiples of
  2^-2 times the scales, at most 16 in magnitude, so sums over K <= 2^20 are exact."""
  if q.fmt == "mxfp8":
    rng = np.random.default_rng(seed)
    data = jnp.asarray(rng.integers(-4, 5, (rows, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    raw = rng.choice(np.array(scales if scales is not None else [126, 127], np.uint8), (rows, k // 32))
    scale = jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e8m0fnu)
    return QTensor(data, scale, None, "mxfp8", -1, 32, None, jnp.dtype(jnp.float32))
  base = exact_operand(rows, k, "nvfp4", q.tiled, seed, amax=amax)
  if q.fmt == "nvfp4":
    return base if q.four_over_six is None else dataclasses.replace(base, bound=q.four_over_six[0])
  rng = np.random.default_rng(seed + 100)
  if q.fmt == "nvfp4_eden":
    return QTensor(base.data, base.scale, None, "nvfp4_eden", -1, 16, None, base.dtype, scale2=jnp.float32(0.5))
  outer = jnp.asarray(rng.choice([0.25, 0.5, 1.0, 2.0], (rows, k // 128)), jnp.float32)
  return QTensor(base.data, base.scale, None, "nvfp4_dbq", -1, 16, None, base.dtype, scale2=outer)


def _with_nan_scales(q: QTensor) -> QTensor:
  nan = 0x7F if q.scale.dtype == jnp.float8_e4m3fn else 0xFF
  raw = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
  raw = raw.at[0, 0].set(nan).at[-1, -1].set(nan)
  return dataclasses.replace(q, scale=jax.lax.bitcast_convert_type(raw, q.scale.dtype))


def _gemm_cases(v: Variant, n: int) -> list[tuple[str, QTensor, QTensor]]:
  if v.op == verdicts.NATIVE_OP:
    qa, qb = v.pair
    make = lambda seed, q, **kw: exact_native_operand(n, n, q, seed, **kw)
    nvfp4 = v.fmt == "nvfp4"
    extremes = [("amax tiny 2^-100", 2.0 ** -100), ("amax huge 2^100", 2.0 ** 100),
                ("amax nan", float("nan"))] if nvfp4 else []
    cases = [("exact", make(3, qa), make(4, qb))]
    cases += [(name, make(3, qa, amax=a), make(4, qb, amax=a)) for name, a in extremes]
    if v.fmt == "mxfp8":   # E8M0 scales 2^±50 and 2^±51: still exact, far from 1
      cases += [(name, make(3, qa, scales=s), make(4, qb, scales=s))
                for name, s in (("scales 2^-50", [77, 76]), ("scales 2^50", [177, 178]))]
    return cases + [("nan scales", _with_nan_scales(cases[0][1]), cases[0][2])]
  (ta, tb), fmt = v.layout, v.fmt
  make = lambda seed, tiled, **kw: exact_operand(n, n, fmt, tiled, seed, **kw)
  cases = [("exact", make(3, ta), make(4, tb))]
  if fmt == "nvfp4":
    cases += [(name, make(3, ta, amax=a), make(4, tb, amax=a)) for name, a in
              (("amax tiny 2^-100", 2.0 ** -100), ("amax huge 2^100", 2.0 ** 100), ("amax nan", float("nan")))]
  else:   # E8M0 scales 2^±50 and 2^±51: still exact, far from 1
    cases += [(name, make(3, ta, scales=s), make(4, tb, scales=s))
              for name, s in (("scales 2^-50", [77, 76]), ("scales 2^50", [177, 178]))]
  return cases + [("nan scales", _with_nan_scales(cases[0][1]), cases[0][2])]


# ------------------------------------------------------------------------------------------ compare

def _bytes(a) -> np.ndarray:
  a = np.asarray(a)
  return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + ((a.dtype.itemsize,) if a.dtype.itemsize > 1 else ()))


def _nan_scale(scale_bytes: np.ndarray, fmt: str) -> np.ndarray:
  return (scale_bytes & 0x7F) == 0x7F if fmt == "nvfp4" else scale_bytes == 0xFF


def nan_blocks(x, v: Variant) -> np.ndarray:
  """Which blocks (the scales' shape) hold a NaN input: after the RHT, every block its 16-row chunk
  reaches. Reduced on the device; only the block mask comes back."""
  nan = jnp.isnan(jnp.asarray(x))
  if v.op == "quantize_rht_t":     # (T, C) -> (C, T); the transform mixes each chunk of 16 along T
    nan = nan.T
    nan = jnp.repeat(nan.reshape(nan.shape[0], -1, 16).any(-1), 16, axis=-1)
  if v.op == "quantize_2d":
    r, c = nan.shape
    nan = nan.reshape(r // 16, 16, c // 16, 16).any(axis=(1, 3))
  else:
    nan = nan.reshape(nan.shape[0], -1, formats.BLOCK[v.fmt]).any(-1)
  return np.asarray(jax.device_get(nan))


def compare_quantized(got, want, v: Variant, x=None) -> dict:
  """Bytes of (codes, scales) that differ. Not compared (``dont_care``): the codes of a block whose
  scale byte is NaN on the XLA side (it dequantizes to NaN whatever they are), and both bytes of a
  block with a NaN input ``x`` (no format defines it, and the reference's own answer there depends on
  the order XLA reduces the block's max in: a scale of 0, -448 or NaN)."""
  (gc, gs), (wc, ws) = (_bytes(t) for t in got), (_bytes(t) for t in want)
  if gc.shape != wc.shape or gs.shape != ws.shape:
    return dict(mismatches=max(wc.size, 1), dont_care=0, compared=int(wc.size + ws.size),
                first=f"shapes differ: kernel {gc.shape}/{gs.shape}, XLA {wc.shape}/{ws.shape}")
  undefined = nan_blocks(x, v) if x is not None else np.zeros(ws.shape, bool)
  nan = _nan_scale(ws, v.fmt) | undefined
  if v.op == "quantize_2d":    # (R/16, C/16) tiles over codes (R, C/2): 16 rows x 8 bytes each
    r, c2 = wc.shape
    care = ~np.repeat(np.repeat(nan, 16, axis=0), 8, axis=1)[:r, :c2]
  else:                        # one scale per B elements along the last axis: B/2 code bytes
    care = ~np.repeat(nan, formats.BLOCK[v.fmt] // 2, axis=-1)
  bad_codes = (gc != wc) & care
  bad_scales = (gs != ws) & ~undefined
  first = ""
  if bad_scales.any():
    i = tuple(int(t) for t in np.argwhere(bad_scales)[0])
    first = f"scale byte {i}: kernel {gs[i]:#04x}, XLA {ws[i]:#04x}"
  elif bad_codes.any():
    i = tuple(int(t) for t in np.argwhere(bad_codes)[0])
    first = f"code byte {i}: kernel {gc[i]:#04x}, XLA {wc[i]:#04x}"
  return dict(mismatches=int(bad_codes.sum() + bad_scales.sum()),
              dont_care=int((~care).sum() + undefined.sum()),
              compared=int(care.sum() + (~undefined).sum()), first=first)


def compare_floats(got, want) -> dict:
  """Elements whose bits differ, a NaN matching any NaN."""
  g, w = np.asarray(got), np.asarray(want)
  if g.shape != w.shape or g.dtype != w.dtype:
    return dict(mismatches=max(w.size, 1), compared=int(w.size),
                first=f"kernel {g.dtype}{g.shape}, XLA {w.dtype}{w.shape}")
  gf, wf = g.astype(np.float32), w.astype(np.float32)
  bad = (_bytes(g) != _bytes(w)).reshape(g.shape + (-1,)).any(-1) & ~(np.isnan(gf) & np.isnan(wf))
  first = ""
  if bad.any():
    i = tuple(int(t) for t in np.argwhere(bad)[0])
    first = f"element {i}: kernel {gf[i]!r}, XLA {wf[i]!r}"
  return dict(mismatches=int(bad.sum()), compared=int(w.size), first=first)


@functools.partial(jax.jit, static_argnames="k")
def _bound_violations(got, want, abs_a, abs_b, *, k):
  """(elements beyond the summation-order bound, the relative Frobenius error) of a float32 GEMM output."""
  gamma = k * U / (1 - k * U)
  e = jax.lax.dot_general(abs_a, abs_b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  bound = 3 * gamma * e + 8 * U * jnp.abs(want) + F32_TINY
  ok = (jnp.abs(got - want) <= bound) | (got == want) | (jnp.isnan(got) & jnp.isnan(want))
  finite = jnp.isfinite(want) & jnp.isfinite(got)
  diff = jnp.where(finite, got - want, 0)
  rel = jnp.sqrt(jnp.sum(diff * diff)) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.where(finite, want * want, 0))), 1e-30)
  return jnp.sum(~ok), rel


BOUND = "|kernel - XLA| <= 3*gamma_K*(|A||B|^T) + 8u*|XLA| + 2^-149, float32 out, gamma_K = K*u/(1-K*u), u = 2^-24"


def bound_check(got, want, a: QTensor, b: QTensor) -> dict:
  """How many float32 outputs of a GEMM of (a, b) lie beyond the summation-order bound (docstring, 2)."""
  abs_a = jnp.abs(api.dequantize(a, jnp.float32, impl="xla"))
  abs_b = jnp.abs(api.dequantize(b, jnp.float32, impl="xla"))
  k = a.shape[-1]
  bad, rel = _bound_violations(jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32), abs_a, abs_b, k=k)
  return dict(bound=BOUND, k=k, gamma_k=k * U / (1 - k * U), violations=int(bad), rel_frobenius=float(rel))


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
    record["cases"].append(dict(case=case, **compare_quantized(got, want, v, x)))
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
  model = op in MODEL_PROOFS and fmt == verdicts.MODEL_FMT
  if op in dispatch.MODEL_KERNEL_OPS and not model:
    raise ValueError(f"nothing to prove for op={op!r}, fmt={fmt!r}: import the model module that registers "
                     f"its proof (python -m fp4jax.proof --import models.<module> ...) and use "
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
                 f"of {len(VARIANTS[(op, fmt)])} variants (FP4JAX_PROOF_BUDGET_S)")
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
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # fp4jax/
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
  parser.add_argument("--op", choices=sorted({o for o, _ in VARIANTS} | set(dispatch.MODEL_KERNEL_OPS)),
                      help="one op (with --fmt)")
  parser.add_argument("--fmt", help=f"its format (nvfp4, mxfp4, nvfp4_eden, nvfp4_dbq; {verdicts.MODEL_FMT} "
                      "for a model op)")
  parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (a model module that registers its kernels' proof, e.g. "
                      "models.ssd_pallas); with no --op, its ops are proved too")
  parser.add_argument("--budget_s", type=float, default=float("inf"), help="stop after this many seconds")
  parser.add_argument("--no_save", action="store_true", help="do not update the on-disk verdicts")
  parser.add_argument("--json", action="store_true", help="print each entry's evidence as JSON")
  args = parser.parse_args(argv)
  if (args.op is None) != (args.fmt is None):
    parser.error("give --op and --fmt together (or neither, for every candidate)")
  for module in args.imports:
    importlib.import_module(module)
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


verdicts.register(DeviceProver())
