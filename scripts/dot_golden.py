"""Golden outputs of the quantized dot: y, dx and dw of ``fp4jax.dot`` / ``dot_general`` for every preset of
``fp4jax.recipes`` and of ``fp4jax.outcontrol.dot``, on shapes that need padding, with K > 128, with leading
and batch axes, float32 and bfloat16.

    python scripts/dot_golden.py --out tests/data/dot_golden.npz     # record (from the code to freeze)
    python -m pytest tests/test_dot_golden.py                        # compare the tree against it

What is recorded is order-free: the program's outputs with every sum exact (``scripts/order_free.py``: each
GEMM's products summed exactly and rounded once, every other operation fp4jax's own), so the same bits on
every CPU, whatever order its XLA dots sum in. The file holds, per case, the SHA-256 of each such output's bytes
(dtype, shape and every bit), and the arrays themselves for the smallest shape (so that a mismatch can be
looked at). The program itself (jitted, XLA's sums) is compared with them within the bound float32
accumulation allows (tests/test_dot_golden.py). Each recipe with its default stochastic-rounding stream
(``fp4jax.random_bits.DEFAULT``). The values before the recording changed to order-free sums were the
programs' own outputs, recorded from the code before the one-quantized-dot redesign; the current code
reproduced them bit for bit on the recording machine with sr_bits="jax" before the re-recording (git log of
tests/data/dot_golden.npz).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp4jax
from fp4jax import outcontrol, recipes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import order_free  # noqa: E402  (scripts/: this directory)

# name: (x shape, w shape, dimension numbers or None for fp4jax.dot, dtype)
SHAPES = {
    "small": ((32, 64), (64, 48), None, jnp.float32),             # aligned to 16, pads for the 128-blocks
    "pad": ((40, 160), (160, 72), None, jnp.float32),             # pads M, N; K > 128 and not a multiple
    "lead": ((2, 24, 144), (144, 80), None, jnp.bfloat16),        # leading axes, bf16 operands
    "batch": ((2, 48, 136), (2, 136, 40), (((2,), (1,)), ((0,), (0,))), jnp.float32),   # dot_general B axis
}
MODES = ("jit", "eager")
KEEP_ARRAYS = ("small",)


def _out_shape(shape_name):
  xs, ws, dims, _ = SHAPES[shape_name]
  if dims is None:
    return xs[:-1] + ws[1:]
  return (xs[0],) + xs[1:-1] + ws[2:]   # batch, x's free axes, w's free axes


def _inputs(shape_name):
  """x, w and the cotangent dy of ``shape_name``, drawn with numpy (as float64, then rounded once to the
  dtype), so that they are the same on every CPU: jax.random.normal's float math is compiled code whose bits
  follow the instruction set (a fused multiply-add or not)."""
  xs, ws, _, dtype = SHAPES[shape_name]
  rng = np.random.default_rng(list(SHAPES).index(shape_name))
  x = rng.standard_normal(xs) * np.exp2(np.arange(xs[-1]) % 7 - 3)
  w = rng.standard_normal(ws) * 0.05
  dy = rng.standard_normal(_out_shape(shape_name))
  return tuple(jnp.asarray(np.asarray(a, np.float32)).astype(dtype) for a in (x, w, dy))


def _outcontrol_perm(x):
  """OutControl's channel order for x: by decreasing sum |x| over the rows, summed exactly (math.fsum), so
  that the order is the same on every machine."""
  sums = [math.fsum(col) for col in np.abs(np.asarray(x, np.float64)).reshape(-1, x.shape[-1]).T]
  return jnp.asarray(np.argsort(-np.asarray(sums), kind="stable"), jnp.int32)


def _dot_fn(recipe, dims):
  if recipe == "outcontrol":
    def f(x, w, key, perm):
      return outcontrol.dot(x, w, perm, outcontrol.k8(x.shape[-1], 0.1) or 0, key=key)
    return f
  if dims is None:
    return lambda x, w, key, perm: fp4jax.dot(x, w, recipe=recipe, key=key)
  return lambda x, w, key, perm: fp4jax.dot_general(x, w, dims, recipe=recipe, key=key)


def _program(recipe, shape_name):
  """(run, args): y, dx, dw of the case as a function of arrays, and its arguments."""
  x, w, dy = _inputs(shape_name)
  f = _dot_fn(recipe, SHAPES[shape_name][2])
  perm = _outcontrol_perm(x) if recipe == "outcontrol" else None

  def run(x, w, key, dy):
    y, vjp = jax.vjp(lambda x, w: f(x, w, key, perm), x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    return y, dx, dw

  return run, (x, w, jax.random.key(7), dy)


def _value_and_grads(recipe, shape_name, mode):
  run, args = _program(recipe, shape_name)
  return jax.jit(run)(*args) if mode == "jit" else run(*args)


def order_free_values(recipe, shape_name):
  """(outputs, bounds): y, dx, dw of the case with every sum exact (``order_free.evaluate``), and the bound on
  their distance from the program's own (jitted) outputs."""
  run, args = _program(recipe, shape_name)
  return order_free.evaluate(run, *args)


def plain(shape_name):
  """y, dx, dw of ``lax.dot_general`` itself, jitted, on the inputs of ``shape_name``: what the bf16 recipe
  gives, bit for bit, computed without fp4jax (tests/test_dot_golden.py)."""
  x, w, dy = _inputs(shape_name)
  dims = SHAPES[shape_name][2] or (((x.ndim - 1,), (0,)), ((), ()))

  def run(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, dims), x, w)
    return (y, *vjp(dy.astype(y.dtype)))

  return tuple(np.asarray(t) for t in jax.jit(run)(x, w, dy))


def cases():
  """(recipe, shape, mode) of every case: "jit" cases are recorded (order-free), "eager" ones compared with
  them in the same process."""
  out = []
  for recipe in recipes.NAMES:
    for shape_name in SHAPES:
      for mode in MODES:
        out.append((recipe, shape_name, mode))
  for shape_name in ("small", "pad"):      # OutControl: 2-D x and w (K=160 has k8 = 128 channels in MXFP8)
    for mode in MODES:
      out.append(("outcontrol", shape_name, mode))
  return out


def digest(a) -> str:
  a = np.asarray(a)
  h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
  h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
  return h.hexdigest()


def case_name(recipe, shape_name, mode) -> str:
  return f"{recipe}/{shape_name}/{mode}"


def compute(recipe, shape_name, mode):
  return tuple(np.asarray(t) for t in _value_and_grads(recipe, shape_name, mode))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="tests/data/dot_golden.npz")
  parser.add_argument("--add", action="store_true", help="keep the file's cases and record only the presets "
                      "it lacks (a new preset joins the freeze without re-recording the others)")
  args = parser.parse_args()
  store = {}
  if args.add:
    with np.load(args.out) as old:
      store = {k: old[k] for k in old.files}
  recorded = {k.split("/")[0] for k in store}
  unbounded = []
  for recipe, shape_name, mode in cases():
    if recipe in recorded or mode != "jit":
      continue
    name = f"{recipe}/{shape_name}"
    outs, bounds = order_free_values(recipe, shape_name)
    for tag, a, bound in zip(("y", "dx", "dw"), outs, bounds):
      if not np.all(np.isfinite(bound)):
        unbounded.append(f"{name}/{tag}")
      store[f"{name}/{tag}/sha256"] = np.array(digest(a))
      if shape_name in KEEP_ARRAYS:
        store[f"{name}/{tag}"] = a.astype(np.float32) if a.dtype == jnp.bfloat16 else a
    print(name, float(np.sum(outs[0].astype(np.float32))), flush=True)
  np.savez_compressed(args.out, **store)
  if unbounded:   # the test needs a finite bound for every output
    raise SystemExit(f"no finite bound on the program's distance from the exact sums for {unbounded}; extend "
                     "scripts/order_free.py's rules to the operation that breaks it")


if __name__ == "__main__":
  main()
