"""The reliability matrix of fp4jax's public entry points.

Every case feeds one bad, degenerate or extreme input to a public op and states what must happen:
either a specific error (exception type + a fragment of its one-line message) or an exactly specified
result (compared with ==, or by an exact property such as power-of-two scale invariance). A case
whose op raises something else counts as a raw traceback; one that returns a result where an error
was expected, or a result that fails its check, counts as silently wrong.

Re-run the table: ``python scripts/reliability_matrix.py`` (prints case -> verdict and the counts).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import inputs
import fp4jax
import fp4jax.flax
from fp4jax import QTensor, recipes
from fp4jax.dot import MISSING_KEY_MESSAGE

FLT_MAX = float(np.finfo(np.float32).max)
R = dataclasses.replace

CLEAR_ERROR, CORRECT, SILENT, RAW = "clear error", "correct result", "silently wrong", "raw traceback"


@dataclasses.dataclass(frozen=True)
class Case:
  group: str
  name: str
  run: Callable[[], Any]
  error: tuple[type, str] | None = None          # expected (exception type, message fragment)
  check: Callable[[Any], bool] | None = None     # exact check of the returned value
  expect: str = ""                               # the expectation, for the table


def verdict(case: Case) -> tuple[str, str]:
  """(verdict, detail) of one case."""
  try:
    out = case.run()
  except Exception as e:   # noqa: BLE001 -- the matrix classifies every failure
    msg = str(e)
    if case.error is not None and isinstance(e, case.error[0]) and case.error[1] in msg:
      if "\n" in msg.strip():
        return RAW, f"multi-line message: {type(e).__name__}: {msg[:120]!r}"
      return CLEAR_ERROR, f"{type(e).__name__}: {msg}"
    return RAW, f"{type(e).__name__}: {msg[:300]}"
  if case.error is not None:
    return SILENT, f"returned {type(out).__name__} instead of raising {case.error[0].__name__}"
  if case.check(out):
    return CORRECT, case.expect
  return SILENT, f"result failed: {case.expect}"


# ------------------------------------------------------------------------------------------ helpers

def _bytes(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def same_q(a: QTensor, b: QTensor) -> bool:
  """Bit-identical data, scales and amax."""
  if (a.fmt, a.axis, a.block, a.tile) != (b.fmt, b.axis, b.block, b.tile):
    return False
  leaves = [(a.data, b.data), (a.scale, b.scale)]
  if a.amax is not None or b.amax is not None:
    leaves.append((a.amax, b.amax))
  return all(np.asarray(x).shape == np.asarray(y).shape and np.array_equal(_bytes(x), _bytes(y))
             for x, y in leaves)


def eq(a, b) -> bool:
  """Exactly equal arrays, NaN == NaN, -0 != +0."""
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bytes(a), _bytes(b))


def roundtrip(x, fmt, **kw):
  return fp4jax.dequantize(fp4jax.quantize(x, fmt, **kw))


def _x(shape=(32, 64), seed=0, dtype=jnp.float32):
  return inputs.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


W = _x((64, 32), 1)
X = _x((8, 64), 2)


def _grad(recipe, key=None, x=X, w=W):
  return jax.grad(lambda x_, w_: fp4jax.dot(x_, w_, recipe=recipe, key=key).sum(), (0, 1))(x, w)


@functools.cache
def _q():
  return {"nv": fp4jax.quantize(_x(), "nvfp4"), "nv2d": fp4jax.quantize(_x(), "nvfp4", tile=(16, 16)),
          "mx": fp4jax.quantize(_x(), "mxfp4"), "fp8": fp4jax.quantize(_x((128, 256)), "fp8")}


def _with(x, idx, v):
  return jnp.asarray(x).at[idx].set(v)


# -------------------------------------------------------------------------------------- the x64 run

_X64_SCRIPT = r"""
import json, sys, jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, fp4jax
x64 = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32).astype(jnp.float64)
out = {}
def h(a):
  a = np.asarray(a); return a.dtype.name + ":" + a.tobytes().hex()
for fmt in ("nvfp4", "mxfp4", "fp8"):
  q = fp4jax.quantize(x64 if fmt != "fp8" else jnp.tile(x64, (4, 2)), fmt)
  out[fmt] = [h(q.data), h(q.scale), None if q.amax is None else h(q.amax), str(q.dtype)]
  out[fmt + "_deq"] = h(fp4jax.dequantize(q))
q = fp4jax.quantize(x64, "nvfp4", rounding="stochastic", key=jax.random.key(3))
out["sr"] = [h(q.data), h(q.scale)]
x = jax.random.normal(jax.random.key(2), (8, 64), jnp.float32).astype(jnp.float64)
w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32).astype(jnp.float64)
y, (dx, dw) = jax.value_and_grad(lambda a, b: fp4jax.dot(a, b, recipe="nvfp4", key=jax.random.key(5)).sum(), (0, 1))(x, w)
out["dot"] = [h(y), h(dx), h(dw)]
out["dot32"] = h(fp4jax.dot(x.astype(jnp.float32), w.astype(jnp.float32), recipe="nvfp4"))
out["dot64"] = h(fp4jax.dot(x, w, recipe="nvfp4").astype(jnp.float32))
out["amax64"] = h(fp4jax.quantize(x64, "nvfp4", amax=jnp.float64(4.0)).scale)
print(json.dumps(out))
"""


@functools.cache
def x64_results() -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", _X64_SCRIPT], capture_output=True, text=True, env=env,
                        timeout=600, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _h(a):
  a = np.asarray(a)
  return a.dtype.name + ":" + a.tobytes().hex()


def _x64_check(name):
  """The x64 run's result for ``name`` equals the float32 (x64 off) computation here."""
  got = x64_results()[name]
  x32 = _x()
  if name in ("nvfp4", "mxfp4", "fp8"):
    q = fp4jax.quantize(x32 if name != "fp8" else jnp.tile(x32, (4, 2)), name)
    return got[:3] == [_h(q.data), _h(q.scale), None if q.amax is None else _h(q.amax)] \
        and got[3] == "float64"
  if name.endswith("_deq"):
    fmt = name[:-4]
    return got == _h(roundtrip(x32 if fmt != "fp8" else jnp.tile(x32, (4, 2)), fmt))
  if name == "sr":
    q = fp4jax.quantize(x32, "nvfp4", rounding="stochastic", key=jax.random.key(3))
    return got == [_h(q.data), _h(q.scale)]
  if name == "dot":
    y, (dx, dw) = jax.value_and_grad(
        lambda a, b: fp4jax.dot(a, b, recipe="nvfp4", key=jax.random.key(5)).sum(), (0, 1))(X, W)
    return [g.split(":")[0] for g in got] == ["float64"] * 3 and \
        np.array_equal(np.frombuffer(bytes.fromhex(got[1].split(":")[1]), np.float64), np.asarray(dx, np.float64).ravel())
  if name == "dot64":
    return got == x64_results()["dot32"] == _h(fp4jax.dot(X, W, recipe="nvfp4"))
  if name == "amax64":
    return got == _h(fp4jax.quantize(x32, "nvfp4", amax=4.0).scale)
  raise KeyError(name)


# ------------------------------------------------------------------------------------------- cases

def _cases() -> list[Case]:
  c: list[Case] = []

  def err(group, name, run, etype, fragment):
    c.append(Case(group, name, run, error=(etype, fragment), expect=f"{etype.__name__} '{fragment}'"))

  def ok(group, name, run, check, expect):
    c.append(Case(group, name, run, check=check, expect=expect))

  q = _q
  x = _x()

  # dtypes ------------------------------------------------------------------------------------------
  g = "dtypes"
  err(g, "quantize int32 input", lambda: fp4jax.quantize(jnp.ones((2, 16), jnp.int32), "nvfp4"),
      TypeError, "needs a floating-point input")
  err(g, "quantize bool input", lambda: fp4jax.quantize(jnp.ones((2, 16), bool), "mxfp4"),
      TypeError, "needs a floating-point input")
  err(g, "quantize complex input", lambda: fp4jax.quantize(jnp.ones((2, 16), jnp.complex64), "nvfp4"),
      TypeError, "needs a floating-point input")
  err(g, "quantize a string", lambda: fp4jax.quantize("abc", "nvfp4"), TypeError, "x must be an array")
  for dt in (jnp.bfloat16, jnp.float16):
    ok(g, f"quantize {jnp.dtype(dt).name} == quantize of its float32 value",
       lambda dt=dt: (fp4jax.quantize(x.astype(dt), "nvfp4"), fp4jax.quantize(x.astype(dt).astype(jnp.float32), "nvfp4")),
       lambda r, dt=dt: same_q(*r) and r[0].dtype == jnp.dtype(dt), "bit-identical codes, scales, amax")
  ok(g, "quantize numpy float64 (x64 off) == float32", lambda: (fp4jax.quantize(np.asarray(x, np.float64), "nvfp4"), q()["nv"]),
     lambda r: same_q(*r), "bit-identical")
  ok(g, "quantize a nested list", lambda: fp4jax.quantize([[1.0] * 16], "nvfp4"),
     lambda r: r.shape == (1, 16) and eq(fp4jax.dequantize(r), jnp.ones((1, 16))), "exact ones")
  ok(g, "dequantize to bfloat16 == float32 result cast", lambda: (fp4jax.dequantize(q()["nv"], jnp.bfloat16), fp4jax.dequantize(q()["nv"]).astype(jnp.bfloat16)),
     lambda r: eq(*r), "bit-identical")
  err(g, "dequantize dtype=int32", lambda: fp4jax.dequantize(q()["nv"], jnp.int32), TypeError, "is not a floating dtype")
  err(g, "dequantize dtype='foo'", lambda: fp4jax.dequantize(q()["nv"], "foo"), TypeError, "is not a floating dtype")
  err(g, "scaled_matmul out_dtype=int8", lambda: fp4jax.scaled_matmul(q()["nv"], q()["nv2d"], out_dtype=jnp.int8),
      TypeError, "out_dtype")
  err(g, "dot int32 operands (nvfp4)", lambda: fp4jax.dot(jnp.ones((4, 32), jnp.int32), jnp.ones((32, 8), jnp.int32), recipe="nvfp4"),
      TypeError, "needs floating inputs")
  ok(g, "dot int32 operands (bf16 recipe) == lax.dot_general", lambda: fp4jax.dot(jnp.ones((4, 32), jnp.int32), jnp.ones((32, 8), jnp.int32), recipe="bf16"),
     lambda r: eq(r, jnp.full((4, 8), 32, jnp.int32)), "exact int32 32s")
  err(g, "dot preferred_element_type=int32 (nvfp4)", lambda: fp4jax.dot(X, W, recipe="nvfp4", preferred_element_type=jnp.int32),
      TypeError, "preferred_element_type")
  ok(g, "dot bfloat16 inputs: bfloat16 output, grads in input dtypes",
     lambda: (fp4jax.dot(X.astype(jnp.bfloat16), W.astype(jnp.bfloat16), recipe="nvfp4"),
              _grad("nvfp4", jax.random.key(0), X.astype(jnp.bfloat16), W)),
     lambda r: r[0].dtype == jnp.bfloat16 and r[1][0].dtype == jnp.bfloat16 and r[1][1].dtype == jnp.float32,
     "dtypes bf16 / bf16 / f32")

  # shapes ------------------------------------------------------------------------------------------
  g = "shapes"
  err(g, "quantize a scalar", lambda: fp4jax.quantize(jnp.float32(1), "nvfp4"), ValueError, "at least one axis")
  err(g, "quantize axis length 20 (not a multiple of 16)", lambda: fp4jax.quantize(jnp.ones((4, 20)), "nvfp4"),
      ValueError, "not a multiple of the block 16")
  err(g, "quantize mxfp4 axis length 16", lambda: fp4jax.quantize(jnp.ones((4, 16)), "mxfp4"),
      ValueError, "not a multiple of the block 32")
  err(g, "quantize tile 16x16 on a 1-D input", lambda: fp4jax.quantize(jnp.ones(32), "nvfp4", tile=(16, 16)),
      ValueError, "1-D input")
  err(g, "quantize tile on 24 rows", lambda: fp4jax.quantize(jnp.ones((24, 16)), "nvfp4", tile=(16, 16)),
      ValueError, "not a multiple of the tile side 16")
  err(g, "quantize axis=2 of a 2-D input", lambda: fp4jax.quantize(jnp.ones((16, 16)), "nvfp4", axis=2),
      ValueError, "out of range")
  err(g, "quantize axis=0.0", lambda: fp4jax.quantize(jnp.ones((16, 16)), "nvfp4", axis=0.0), TypeError, "must be an int")
  err(g, "quantize tile=16", lambda: fp4jax.quantize(jnp.ones((16, 16)), "nvfp4", tile=16), TypeError, "pair of ints")
  ok(g, "quantize tile=[16, 16] (a list) == tile=(16, 16)", lambda: (fp4jax.quantize(x, "nvfp4", tile=[16, 16]), q()["nv2d"]),
     lambda r: same_q(*r), "bit-identical")
  for fmt, k in (("nvfp4", 32), ("mxfp4", 32), ("fp8", 128)):
    ok(g, f"{fmt} zero-size (0, {k}) round trip", lambda fmt=fmt, k=k: fp4jax.dequantize(fp4jax.quantize(jnp.zeros((0, k)), fmt)),
       lambda r, k=k: r.shape == (0, k) and r.dtype == jnp.float32, "empty (0, K) float32")
  ok(g, "nvfp4 zero-size amax is 0", lambda: fp4jax.quantize(jnp.zeros((0, 32)), "nvfp4").amax,
     lambda r: eq(r, jnp.float32(0)), "amax == 0")
  ok(g, "fp8 per-tensor zero-size", lambda: fp4jax.dequantize(fp4jax.quantize(jnp.zeros((0, 5)), "fp8", scaling="tensor")),
     lambda r: r.shape == (0, 5), "empty")
  ok(g, "dot M=0", lambda: fp4jax.dot(jnp.zeros((0, 64)), W, recipe="nvfp4"), lambda r: r.shape == (0, 32), "shape (0, 32)")
  ok(g, "dot K=0 == zeros like lax", lambda: fp4jax.dot(jnp.zeros((4, 0)), jnp.zeros((0, 8)), recipe="nvfp4"),
     lambda r: eq(r, jnp.zeros((4, 8))), "exact zeros (4, 8)")
  ok(g, "dot N=0", lambda: fp4jax.dot(X, jnp.zeros((64, 0)), recipe="nvfp4"), lambda r: r.shape == (8, 0), "shape (8, 0)")
  ok(g, "dot (3,20)x(20,5) == explicitly zero-padded (16,32)x(32,16)",
     lambda: (fp4jax.dot(X[:3, :20], W[:20, :5], recipe="nvfp4"),
              fp4jax.dot(jnp.pad(X[:3, :20], ((0, 13), (0, 12))), jnp.pad(W[:20, :5], ((0, 12), (0, 11))), recipe="nvfp4")[:3, :5]),
     lambda r: eq(*r), "bit-identical")
  ok(g, "dot 1-D x == row of 2-D", lambda: (fp4jax.dot(X[0], W, recipe="nvfp4"), fp4jax.dot(X[:1], W, recipe="nvfp4")[0]),
     lambda r: eq(*r), "bit-identical")
  err(g, "dot scalar x", lambda: fp4jax.dot(jnp.float32(1), W, recipe="nvfp4"), TypeError, "do not fit lhs of shape ()")
  err(g, "dot 3-D weight", lambda: fp4jax.dot(X, jnp.ones((64, 2, 2)), recipe="nvfp4"), ValueError, "2-D weight")
  err(g, "dot K mismatch", lambda: fp4jax.dot(X, jnp.ones((60, 8)), recipe="nvfp4"), TypeError, "do not fit")
  err(g, "dot_general bad dimension numbers", lambda: fp4jax.dot_general(X, W, (((3,), (0,)), ((), ())), recipe="nvfp4"),
      TypeError, "do not fit")
  err(g, "scaled_matmul K mismatch", lambda: fp4jax.scaled_matmul(q()["nv"], fp4jax.quantize(jnp.ones((16, 32)), "nvfp4")),
      ValueError, "contraction lengths differ")
  err(g, "scaled_matmul 3-D rhs", lambda: fp4jax.scaled_matmul(q()["nv"], fp4jax.quantize(jnp.ones((2, 16, 64)), "nvfp4")),
      ValueError, "must be 2-D")
  err(g, "scaled_matmul operands along axis 0", lambda: fp4jax.scaled_matmul(fp4jax.quantize(x, "nvfp4", axis=0), q()["nv"]),
      ValueError, "axis=-1")
  err(g, "scaled_matmul nvfp4 x mxfp4", lambda: fp4jax.scaled_matmul(q()["nv"], q()["mx"]), ValueError, "share a format")
  err(g, "transpose_tiles of a 1x16 tensor", lambda: fp4jax.transpose_tiles(q()["nv"]), ValueError, "quantized with tile=")
  ok(g, "vmap(quantize) then dequantize outside == per slice",
     lambda: (fp4jax.dequantize(jax.vmap(lambda v: fp4jax.quantize(v, "nvfp4"))(x.reshape(4, 8, 64))),
              jnp.stack([roundtrip(v, "nvfp4") for v in x.reshape(4, 8, 64)])),
     lambda r: eq(*r), "bit-identical")
  ok(g, "jit(dequantize) == eager", lambda: (jax.jit(fp4jax.dequantize)(q()["nv2d"]), fp4jax.dequantize(q()["nv2d"])),
     lambda r: eq(*r), "bit-identical")

  # special values ----------------------------------------------------------------------------------
  g = "special values"
  blk = jnp.arange(64, dtype=jnp.float32).reshape(2, 32) / 7 - 4
  ok(g, "nvfp4 +inf: that element +inf, every other element non-finite",
     lambda: roundtrip(_with(blk, (0, 3), jnp.inf), "nvfp4"),
     lambda r: np.isposinf(r[0, 3]) and not np.isfinite(np.asarray(r)).any(), "inf at the inf, nothing finite")
  ok(g, "nvfp4 NaN: all NaN", lambda: roundtrip(_with(blk, (1, 5), jnp.nan), "nvfp4"),
     lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  ok(g, "mxfp4 -inf: -inf there, its block non-finite or 0, other block exact",
     lambda: (roundtrip(_with(blk, (0, 3), -jnp.inf), "mxfp4"), roundtrip(blk, "mxfp4")),
     lambda r: np.isneginf(r[0][0, 3]) and eq(r[0][1], r[1][1]), "-inf kept; row 1 bit-identical")
  ok(g, "mxfp4 NaN: its block NaN, other block exact",
     lambda: (roundtrip(_with(blk, (0, 3), jnp.nan), "mxfp4"), roundtrip(blk, "mxfp4")),
     lambda r: np.isnan(np.asarray(r[0][0])).all() and eq(r[0][1], r[1][1]), "row 0 NaN; row 1 bit-identical")
  big = jnp.tile(blk, (1, 4))   # (2, 128): one fp8 block per row
  for v in (jnp.inf, -jnp.inf, jnp.nan):
    ok(g, f"fp8 {v}: NaN there, the rest as if it were 0 (E4M3 has no inf; not saturated to 448)",
       lambda v=v: (roundtrip(_with(big, (0, 3), v), "fp8"), roundtrip(_with(big, (0, 3), 0.0), "fp8")),
       lambda r: np.isnan(r[0][0, 3]) and eq(_with(r[0], (0, 3), 0.0), r[1]), "NaN at [0,3]; others bit-identical")
  ok(g, "fp8 per-tensor inf", lambda: (roundtrip(_with(big, (1, 7), jnp.inf), "fp8", scaling="tensor"),
                                     roundtrip(_with(big, (1, 7), 0.0), "fp8", scaling="tensor")),
     lambda r: np.isnan(r[0][1, 7]) and eq(_with(r[0], (1, 7), 0.0), r[1]), "NaN there; others bit-identical")
  for fmt in ("nvfp4", "mxfp4", "fp8"):
    k = 128 if fmt == "fp8" else 32
    ok(g, f"{fmt} -0.0 keeps its sign", lambda fmt=fmt, k=k: roundtrip(jnp.full((1, k), -0.0), fmt),
       lambda r: eq(r, jnp.full(r.shape, -0.0)), "-0.0 everywhere")
    ok(g, f"{fmt} float32 subnormals (1e-40) are zero on CPU", lambda fmt=fmt, k=k: roundtrip(jnp.full((1, k), 1e-40), fmt),
       lambda r: not np.asarray(r).any() and np.isfinite(np.asarray(r)).all(), "all 0 (XLA CPU flushes subnormals)")
  sweep = jnp.asarray(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32))
  for amax, k_exp in ((FLT_MAX, -70), (1e36, -70), (1e-37, 100), (1e-20, 40)):
    ok(g, f"nvfp4 tensor amax {amax:.3g}: finite, == result at x*2^{k_exp} scaled back (exact)",
       lambda amax=amax, k_exp=k_exp: (roundtrip(sweep * np.float32(amax), "nvfp4"),
                                       roundtrip(sweep * np.float32(amax) * np.float32(2.0 ** k_exp), "nvfp4")
                                       * np.float32(2.0 ** -(k_exp // 2)) * np.float32(2.0 ** -(k_exp - k_exp // 2))),
       lambda r: np.isfinite(np.asarray(r[0])).all() and eq(r[0], r[1]), "finite and bit-identical")
  ok(g, "nvfp4 FLT_MAX element dequantizes to FLT_MAX (not inf)", lambda: roundtrip(jnp.full((1, 16), FLT_MAX), "nvfp4"),
     lambda r: eq(r, jnp.full((1, 16), FLT_MAX, jnp.float32)), "== FLT_MAX")
  for rule in ("rceil", "floor"):
    ok(g, f"mxfp4 {rule} near FLT_MAX saturates at 1.5*2^127 (not 2^128 = inf)",
       lambda rule=rule: roundtrip(jnp.asarray([[FLT_MAX, -3e38, 2.9 * 2.0 ** 126, 1e37] + [0.0] * 28], jnp.float32),
                                   "mxfp4", scale_rule=rule)[0, :4],
       lambda r: eq(r, jnp.asarray([3 * 2.0 ** 126, -3 * 2.0 ** 126, 3 * 2.0 ** 126, 0.0], jnp.float32)),
       "[2^127*1.5, -2^127*1.5, 2^127*1.5, 0]")
  ok(g, "mxfp4 finite neighbours of inf use the 2^127 scale (2^126 -> 2^126)",
     lambda: roundtrip(jnp.asarray([[jnp.inf, 2.0 ** 126] + [0.0] * 30], jnp.float32), "mxfp4")[0, :2],
     lambda r: eq(r, jnp.asarray([np.inf, 2.0 ** 126], jnp.float32)), "[inf, 2^126]")
  ok(g, "fp8 FLT_MAX round trip", lambda: roundtrip(jnp.asarray([[FLT_MAX, -FLT_MAX] + [1.0] * 126], jnp.float32), "fp8")[0, :2],
     lambda r: eq(r, jnp.asarray([FLT_MAX, -FLT_MAX], jnp.float32)), "[FLT_MAX, -FLT_MAX]")
  tiny = jnp.asarray([[1e-37, -3e-38, 5e-38] + [0.0] * 125], jnp.float32)
  ok(g, "fp8 block amax 1e-37: E4M3 at scale 2^-126, no NaN from 0*inf",
     lambda: roundtrip(tiny, "fp8"),
     lambda r: eq(r, jnp.asarray((np.asarray(tiny, np.float64) * 2.0 ** 126).astype(ml_dtypes.float8_e4m3fn)
                                 .astype(np.float32) * np.float32(2.0 ** -126))), "E4M3(x*2^126)*2^-126")
  a_big = _with(jnp.full((16, 64), 1e15), (0, 0), 1e20)
  b_big = _with(jnp.full((16, 64), 1e15), (3, 7), 1e20)
  ok(g, "scaled_matmul nvfp4 amax_a*amax_b = 1e40 > FLT_MAX: exact, not inf/NaN",
     lambda: (fp4jax.scaled_matmul(fp4jax.quantize(a_big, "nvfp4"), fp4jax.quantize(b_big, "nvfp4")),
              fp4jax.scaled_matmul(fp4jax.quantize(a_big * 2.0 ** -66, "nvfp4"),
                                   fp4jax.quantize(b_big * 2.0 ** -66, "nvfp4")) * 2.0 ** 66 * 2.0 ** 66),
     lambda r: np.isfinite(np.asarray(r[0])).all() and eq(r[0], r[1]), "finite; == operands scaled by 2^-66")
  ok(g, "dot fp8 with inf in x: that row NaN, other rows exact (bf16 gives inf)",
     lambda: (fp4jax.dot(_with(X, (2, 5), jnp.inf), W, recipe="fp8"), fp4jax.dot(_with(X, (2, 5), 0.0), W, recipe="fp8"),
              fp4jax.dot(_with(X, (2, 5), jnp.inf), W, recipe="bf16")),
     lambda r: np.isnan(r[0][2]).all() and eq(r[0][jnp.arange(8) != 2], r[1][jnp.arange(8) != 2])
     and not np.isfinite(np.asarray(r[2][2])).any(), "row 2 NaN; rows != 2 bit-identical")
  ok(g, "dot mxfp4 with inf in x: that row non-finite, other rows exact",
     lambda: (fp4jax.dot(_with(X, (2, 5), jnp.inf), W, recipe="mxfp4"), fp4jax.dot(_with(X, (2, 5), 0.0), W, recipe="mxfp4")),
     lambda r: not np.isfinite(np.asarray(r[0][2])).any() and eq(r[0][jnp.arange(8) != 2], r[1][jnp.arange(8) != 2]),
     "row 2 non-finite; others bit-identical")
  ok(g, "dot nvfp4 with NaN in x: whole output NaN (tensor amax NaN)",
     lambda: fp4jax.dot(_with(X, (2, 5), jnp.nan), W, recipe="nvfp4"), lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  big = _x((64, 128), 3)     # large enough for XLA CPU's vectorized float max, which drops NaN
  ok(g, "nvfp4 NaN in the last element of a (64, 128) x under jit: all NaN, not a finite or -inf amax",
     lambda: jax.jit(lambda x: roundtrip(x, "nvfp4"))(_with(big, (63, 127), jnp.nan)),
     lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  ok(g, "mxfp4 NaN in the middle of a (64, 128) x under jit: its block non-finite",
     lambda: jax.jit(lambda x: roundtrip(x, "mxfp4"))(_with(big, (31, 70), jnp.nan))[31, 64:96],
     lambda r: not np.isfinite(np.asarray(r)).any(), "block (31, 2) non-finite")
  ok(g, "dot nvfp4 eager with NaN in the last element of x: all NaN, no error about an amax",
     lambda: fp4jax.dot(_with(big, (63, 127), jnp.nan), _x((128, 16), 4), recipe="nvfp4_no_sr"),
     lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  ok(g, "grad of dot nvfp4 with NaN in x: dw non-finite, as the forward",
     lambda: _grad("nvfp4", jax.random.key(0), x=_with(X, (7, 63), jnp.nan))[1],
     lambda r: not np.isfinite(np.asarray(r)).all(), "dw non-finite")
  ok(g, "nvfp4 amax < max|x| saturates at about ±amax: == quantizing clip(x, -amax, amax)",
     lambda: (roundtrip(jnp.arange(1, 17, dtype=jnp.float32)[None], "nvfp4", amax=8.0),
              roundtrip(jnp.clip(jnp.arange(1, 17, dtype=jnp.float32), -8, 8)[None], "nvfp4")),
     lambda r: eq(*r), "bit-identical")

  # hand-built QTensors -----------------------------------------------------------------------------
  g = "hand-built QTensors"
  nv, nv2d, mx = (lambda: q()["nv"]), (lambda: q()["nv2d"]), (lambda: q()["mx"])
  err(g, "scale shape (1, 4), broadcastable to (32, 4)", lambda: fp4jax.dequantize(R(nv(), scale=nv().scale[:1])),
      ValueError, "needs scale shape (32, 4)")
  err(g, "2D-tiled tensor relabelled as 1x16", lambda: fp4jax.dequantize(R(nv2d(), tile=None, block=16)),
      ValueError, "needs scale shape (32, 4)")
  err(g, "1x16 tensor relabelled as 16x16 tiles", lambda: fp4jax.dequantize(R(nv(), tile=(16, 16), block=None)),
      ValueError, "needs scale shape (2, 4)")
  err(g, "amax=None (nvfp4)", lambda: fp4jax.dequantize(R(nv(), amax=None)), ValueError, "got amax=None")
  err(g, "amax=0 with nonzero scales", lambda: fp4jax.dequantize(R(nv(), amax=jnp.float32(0))), ValueError, "amax is 0")
  err(g, "amax=-1", lambda: fp4jax.dequantize(R(nv(), amax=jnp.float32(-1))), ValueError, "is negative")
  err(g, "amax a Python float", lambda: fp4jax.dequantize(R(nv(), amax=1.0)), TypeError, "must be a float32 array")
  err(g, "amax float64 array", lambda: fp4jax.dequantize(R(nv(), amax=np.float64(1.0))), TypeError, "must be float32")
  err(g, "amax shape (2,)", lambda: fp4jax.dequantize(R(nv(), amax=jnp.ones(2, jnp.float32))), ValueError, "QTensor.amax has shape (2,)")
  ok(g, "amax=0 with all-zero scales (an all-zero tensor)", lambda: fp4jax.dequantize(fp4jax.quantize(jnp.zeros((2, 16)), "nvfp4")),
     lambda r: eq(r, jnp.zeros((2, 16))), "exact zeros")
  ok(g, "amax=-1 under jit (value not checkable): NaN, not flipped signs",
     lambda: jax.jit(fp4jax.dequantize)(R(nv(), amax=jnp.float32(-1))), lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  ok(g, "amax=0 with nonzero scales under jit: NaN, not zeros",
     lambda: jax.jit(fp4jax.dequantize)(R(nv(), amax=jnp.float32(0))), lambda r: np.isnan(np.asarray(r)).all(), "all NaN")
  err(g, "mxfp4 with an amax", lambda: fp4jax.dequantize(R(mx(), amax=jnp.float32(1))), ValueError, "amax must be None")
  err(g, "data int8", lambda: fp4jax.dequantize(R(nv(), data=nv().data.astype(jnp.int8))), TypeError, "stores uint8")
  err(g, "scale float32", lambda: fp4jax.dequantize(R(nv(), scale=nv().scale.astype(jnp.float32))), TypeError, "float8_e4m3fn scales")
  err(g, "data None", lambda: fp4jax.dequantize(R(nv(), data=None)), TypeError, "QTensor.data must be an array")
  err(g, "data a list", lambda: fp4jax.dequantize(R(nv(), data=[1, 2])), TypeError, "QTensor.data must be an array")
  err(g, "fmt 'nvfp5'", lambda: R(nv(), fmt="nvfp5"), ValueError, "is not a format")
  err(g, "axis=1 (not negative)", lambda: R(nv(), axis=1), ValueError, "must be a negative int")
  err(g, "block=32 for nvfp4", lambda: R(nv(), block=32), ValueError, "use block=16")
  err(g, "tile=(8, 8)", lambda: R(nv2d(), tile=(8, 8)), ValueError, "is not a tile")
  err(g, "tile and block both set", lambda: R(nv2d(), block=16), ValueError, "both tile=")
  err(g, "dtype int32", lambda: R(nv(), dtype=jnp.int32), TypeError, "must be a floating dtype")
  err(g, "scale_rule 'up'", lambda: R(mx(), scale_rule="up"), ValueError, "scale_rule='up'")
  err(g, "axis=-3 of a 2-D tensor", lambda: fp4jax.dequantize(R(nv(), axis=-3)), ValueError, "too few axes")
  err(g, "scaled_matmul with a broadcastable rhs scale", lambda: fp4jax.scaled_matmul(nv(), R(nv2d(), scale=nv2d().scale[:1])),
      ValueError, "needs scale shape (2, 4)")
  err(g, "scaled_matmul with amax=None", lambda: fp4jax.scaled_matmul(R(nv(), amax=None), nv2d()), ValueError, "got amax=None")
  err(g, "scaled_matmul of arrays", lambda: fp4jax.scaled_matmul(X, W), TypeError, "takes two QTensors")
  err(g, "transpose_tiles with a wrong scale", lambda: fp4jax.transpose_tiles(R(nv2d(), scale=nv2d().scale[:, :1])),
      ValueError, "needs scale shape (2, 4)")
  err(g, "dequantize of an array", lambda: fp4jax.dequantize(X), TypeError, "takes a QTensor")
  ok(g, "jax.tree.map rebuilds QTensors with placeholder leaves", lambda: jax.tree.map(lambda _: None, nv()),
     lambda r: isinstance(r, QTensor) and r.data is None, "a QTensor of Nones")

  # keys --------------------------------------------------------------------------------------------
  g = "keys"
  err(g, "quantize stochastic without a key", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic"),
      ValueError, "needs random bits")
  err(g, "quantize key=0 (an int)", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=0),
      TypeError, "key must be a jax.random key")
  err(g, "quantize key of float32 data", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jnp.zeros(2)),
      TypeError, "legacy uint32 key")
  err(g, "quantize with 2 keys", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.split(jax.random.key(0))),
      ValueError, "must be one key")
  ok(g, "legacy PRNGKey(7) == key(7) (same bits)",
     lambda: (fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.PRNGKey(7)),
              fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(7))),
     lambda r: same_q(*r), "bit-identical")
  ok(g, "key=, sr_bits='jax' == bits=jax.random.bits(key)",
     lambda: (fp4jax.quantize(x, "mxfp4", rounding="stochastic", key=jax.random.key(7), sr_bits="jax"),
              fp4jax.quantize(x, "mxfp4", rounding="stochastic", bits=jax.random.bits(jax.random.key(7), x.shape, jnp.uint8))),
     lambda r: same_q(*r), "bit-identical")
  err(g, "bits float32", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic", bits=jnp.zeros(x.shape)),
      TypeError, "unsigned integer array")
  err(g, "bits wrong shape", lambda: fp4jax.quantize(x, "nvfp4", rounding="stochastic", bits=jnp.zeros((2, 2), jnp.uint8)),
      ValueError, "must match the input's shape")
  err(g, "bits with rounding='nearest'", lambda: fp4jax.quantize(x, "nvfp4", bits=jnp.zeros(x.shape, jnp.uint8)),
      ValueError, "only used with rounding='stochastic'")
  err(g, "stochastic fp8", lambda: fp4jax.quantize(x, "fp8", rounding="stochastic", key=jax.random.key(0)),
      ValueError, "not fp8")
  err(g, "dot grad (nvfp4, SR) without a key", lambda: _grad("nvfp4"), ValueError, MISSING_KEY_MESSAGE[:40])
  err(g, "dot key=0 (an int)", lambda: _grad("nvfp4", 0), TypeError, "key must be a jax.random key")
  ok(g, "dot grad: legacy PRNGKey(3) == key(3)", lambda: (_grad("nvfp4", jax.random.PRNGKey(3)), _grad("nvfp4", jax.random.key(3))),
     lambda r: eq(r[0][0], r[1][0]) and eq(r[0][1], r[1][1]), "bit-identical dx, dw")
  ok(g, "dot grad without SR ignores the key", lambda: (_grad("nvfp4_no_sr", jax.random.key(3)), _grad("nvfp4_no_sr")),
     lambda r: eq(r[0][0], r[1][0]) and eq(r[0][1], r[1][1]), "bit-identical dx, dw")
  ok(g, "dot forward needs no key", lambda: fp4jax.dot(X, W, recipe="nvfp4"), lambda r: r.shape == (8, 32), "runs")

  # recipes and options -----------------------------------------------------------------------------
  g = "recipes and options"
  err(g, "recipe 'nvfp5'", lambda: fp4jax.dot(X, W, recipe="nvfp5"), ValueError, "unknown recipe 'nvfp5'")
  err(g, "recipe 3", lambda: fp4jax.dot(X, W, recipe=3), TypeError, "recipe must be an fp4jax.Recipe")
  err(g, "Recipe(fprop='fp16')", lambda: fp4jax.Recipe(fprop="fp16"), ValueError, "is not a format")
  err(g, "Recipe(rht_size=3)", lambda: fp4jax.Recipe(rht_size=3), ValueError, "power of two")
  err(g, "Recipe(stochastic_grad='no')", lambda: fp4jax.Recipe(stochastic_grad="no"), TypeError, "must be True or False")
  err(g, "Recipe(rht_seed='x')", lambda: fp4jax.Recipe(rht_seed="x"), TypeError, "must be an int or None")
  err(g, "Recipe(out_dtype='foo')", lambda: fp4jax.Recipe(out_dtype="foo"), TypeError, "is not a dtype")
  err(g, "Recipe(mxfp4_scale_rule='up')", lambda: fp4jax.Recipe(mxfp4_scale_rule="up"), ValueError, "use 'rceil' or 'floor'")
  ok(g, "bf16 recipe == lax.dot_general (values and grads)",
     lambda: (fp4jax.dot(X, W, recipe="bf16"), X @ W, _grad("bf16"), jax.grad(lambda a, b: (a @ b).sum(), (0, 1))(X, W)),
     lambda r: eq(r[0], r[1]) and eq(r[2][0], r[3][0]) and eq(r[2][1], r[3][1]), "bit-identical")
  ok(g, "recipe by name == recipe object", lambda: (fp4jax.dot(X, W, recipe="mxfp4"), fp4jax.dot(X, W, recipe=recipes.mxfp4())),
     lambda r: eq(*r), "bit-identical")
  err(g, "quantize fmt 'nvfp5'", lambda: fp4jax.quantize(x, "nvfp5"), ValueError, "unknown format")
  err(g, "quantize fmt None", lambda: fp4jax.quantize(x, None), ValueError, "unknown format")
  err(g, "quantize rounding 'up'", lambda: fp4jax.quantize(x, "nvfp4", rounding="up"), ValueError, "rounding='up'")
  err(g, "quantize scale_rule 'up'", lambda: fp4jax.quantize(x, "mxfp4", scale_rule="up"), ValueError, "scale_rule='up'")
  err(g, "quantize scaling 'row'", lambda: fp4jax.quantize(x, "fp8", scaling="row"), ValueError, "scaling='row'")
  err(g, "quantize impl 'cuda'", lambda: fp4jax.quantize(x, "nvfp4", impl="cuda"), ValueError, "impl='cuda'")
  err(g, "mxfp4 with tile=", lambda: fp4jax.quantize(x, "mxfp4", tile=(16, 16)), ValueError, "has no 2D tiles")
  err(g, "nvfp4 tile=(128, 128)", lambda: fp4jax.quantize(x, "nvfp4", tile=(128, 128)), ValueError, "use tile=(16, 16)")
  err(g, "nvfp4 scaling='tensor'", lambda: fp4jax.quantize(x, "nvfp4", scaling="tensor"), ValueError, "always block scaled")
  err(g, "fp8 scaling='tensor' with tile=", lambda: fp4jax.quantize(x, "fp8", scaling="tensor", tile=(128, 128)),
      ValueError, "exclude each other")
  err(g, "amax= for mxfp4", lambda: fp4jax.quantize(x, "mxfp4", amax=1.0), ValueError, "no tensor-level scale")
  err(g, "amax=-1", lambda: fp4jax.quantize(x, "nvfp4", amax=-1.0), ValueError, "must be finite and > 0")
  err(g, "amax=NaN", lambda: fp4jax.quantize(x, "nvfp4", amax=float("nan")), ValueError, "must be finite and > 0")
  err(g, "amax=inf", lambda: fp4jax.quantize(x, "nvfp4", amax=float("inf")), ValueError, "must be finite and > 0")
  err(g, "amax=0 for a nonzero x", lambda: fp4jax.quantize(x, "nvfp4", amax=0.0), ValueError, "amax=0 with a nonzero input")
  err(g, "amax of shape (2,)", lambda: fp4jax.quantize(x, "nvfp4", amax=jnp.ones(2)), ValueError, "must be one real number")
  ok(g, "amax=0 for an all-zero x", lambda: roundtrip(jnp.zeros((2, 16)), "nvfp4", amax=0.0),
     lambda r: eq(r, jnp.zeros((2, 16))), "exact zeros")
  ok(g, "amax=max|x| passed explicitly == default", lambda: (fp4jax.quantize(x, "nvfp4", amax=jnp.max(jnp.abs(x))), q()["nv"]),
     lambda r: same_q(*r), "bit-identical")
  err(g, "quantize_rht_transposed rht_size=3", lambda: fp4jax.api.quantize_rht_transposed(jnp.ones((16, 16)), "nvfp4", rht_size=3),
      ValueError, "not a multiple of rht_size=3")
  err(g, "quantize_rht_transposed fp8", lambda: fp4jax.api.quantize_rht_transposed(jnp.ones((16, 16)), "fp8"),
      ValueError, "for nvfp4 and mxfp4")

  err(g, "rht of a scalar", lambda: fp4jax.rht(jnp.float32(1)), ValueError, "is not an axis")
  err(g, "rht axis=3 of a 1-D input", lambda: fp4jax.rht(jnp.ones(16), axis=3), ValueError, "is not an axis")
  err(g, "rht seed='a'", lambda: fp4jax.rht(jnp.ones(16), seed="a"), TypeError, "must be an int or None")
  err(g, "rht size=12", lambda: fp4jax.rht(jnp.ones(24), size=12), ValueError, "power of two")
  err(g, "rht length 12 with size 16", lambda: fp4jax.rht(jnp.ones(12)), ValueError, "must be a multiple of size=16")
  ok(g, "rht(ones(16)) == the spec vector", lambda: fp4jax.rht(jnp.ones(16)),
     lambda r: eq(r, jnp.asarray([-1, 0, 1, 0, 1, 0, -1, 0, 1, 2, 1, 0, 1, 0, 1, -2], jnp.float32)), "spec §5 vector")

  # Flax modules ------------------------------------------------------------------------------------
  g = "flax"
  dense = nn.Dense(32, dot_general_cls=fp4jax.flax.dot_general_cls("nvfp4"))
  params = dense.init(jax.random.key(0), X)

  def linen_grad(rngs):
    return jax.grad(lambda p: dense.apply(p, X, rngs=rngs).sum())(params)

  err(g, "linen grad without the 'fp4' rng stream", lambda: linen_grad(None), ValueError, "provide the 'fp4' rng stream")
  ok(g, "linen forward without the 'fp4' stream == with it", lambda: (dense.apply(params, X), dense.apply(params, X, rngs={"fp4": jax.random.key(1)})),
     lambda r: eq(*r), "bit-identical")
  ok(g, "linen grad with the 'fp4' stream", lambda: linen_grad({"fp4": jax.random.key(1)}),
     lambda r: np.isfinite(np.asarray(r["params"]["kernel"])).all(), "finite grads")
  err(g, "dot_general_cls('nvfp5')", lambda: fp4jax.flax.dot_general_cls("nvfp5"), ValueError, "unknown recipe")
  err(g, "Fp4DotGeneralNNX(rngs=0)", lambda: fp4jax.flax.Fp4DotGeneralNNX("nvfp4", rngs=0), TypeError, "rngs must be")

  # Derivatives (fp4jax.derivatives) ----------------------------------------------------------------
  g = "derivatives"
  x16, w16 = X[:16, :32], W[:32, :16]
  square = lambda recipe: lambda a: (fp4jax.dot(a, w16, recipe=recipe, key=jax.random.key(0)) ** 2).sum()
  for recipe in ("nvfp4", "nvfp4_no_sr", "fp8"):
    err(g, f"grad of grad through dot ({recipe})", lambda r=recipe: jax.grad(lambda a: jax.grad(square(r))(a).sum())(x16),
        TypeError, "a second derivative (grad of grad, jvp of grad) differentiates its backward pass")
  err(g, "jax.hessian through dot (nvfp4)", lambda: jax.hessian(square("nvfp4"))(x16), TypeError,
      "forward-mode differentiation")
  err(g, "jax.jacfwd of dot (nvfp4)", lambda: jax.jacfwd(square("nvfp4"))(x16), TypeError,
      "Use jax.jacrev for a Jacobian")
  ok(g, "jax.hessian through dot (bf16) == through a @ w",
     lambda: (jax.hessian(square("bf16"))(x16[:2]), jax.hessian(lambda a: ((a @ w16) ** 2).sum())(x16[:2])),
     lambda r: eq(*r), "bit-identical")
  err(g, "jax.grad through dequantize(quantize(x)) (nvfp4)",
      lambda: jax.grad(lambda a: fp4jax.dequantize(fp4jax.quantize(a, "nvfp4")).sum())(x16), TypeError,
      "fp4jax.quantize has no derivative")
  ok(g, "jax.grad through fake_quantize (nvfp4) == dy (straight-through)",
     lambda: jax.vjp(lambda a: fp4jax.fake_quantize(a, "nvfp4"), x16)[1](x16 * 3)[0],
     lambda r: eq(r, x16 * 3), "dx == dy exactly")

  # x64 ---------------------------------------------------------------------------------------------
  g = "x64 on (subprocess)"
  for name, what in (("nvfp4", "quantize float64 == quantize of its float32 value; q.dtype float64"),
                     ("mxfp4", "same for mxfp4"), ("fp8", "same for fp8"),
                     ("nvfp4_deq", "dequantize == x64-off result"), ("mxfp4_deq", "dequantize == x64-off result"),
                     ("fp8_deq", "dequantize == x64-off result"),
                     ("sr", "stochastic rounding with key(3) == x64-off"),
                     ("dot", "dot grads come back float64, dx == x64-off dx"),
                     ("dot64", "dot(float64) cast to float32 == dot(float32) == x64-off"),
                     ("amax64", "float64 amax= == float amax=")):
    ok(g, name, lambda name=name: _x64_check(name), bool, what)
  return c


CASES = _cases()


# The x64 group runs in a subprocess with jax_enable_x64 (~45 s): slow; scripts/reliability_matrix.py runs it.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.group.startswith("x64") else c
                                  for c in CASES], ids=[f"{c.group}: {c.name}" for c in CASES])
def test_case(case):
  v, detail = verdict(case)
  want = CLEAR_ERROR if case.error is not None else CORRECT
  assert v == want, f"{case.group}: {case.name}: {v} ({detail})"
