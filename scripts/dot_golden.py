"""Golden outputs of the quantized dot: y, dx and dw of ``fp4jax.dot`` / ``dot_general`` for every preset of
``fp4jax.recipes`` and of ``fp4jax.outcontrol.dot``, jitted and eager, on shapes that need padding, with
K > 128, with leading and batch axes, float32 and bfloat16.

    python scripts/dot_golden.py --out tests/data/dot_golden.npz     # record (from the code to freeze)
    python -m pytest tests/test_dot_golden.py                        # compare the tree against it

The file holds, per case, the SHA-256 of each result's bytes (dtype, shape and every bit), and the arrays
themselves for the smallest shape (so that a mismatch can be looked at). Recorded from commit 5b55ef4,
the last commit before the one-quantized-dot redesign (issue 21); the presets added since (mxfp8,
nvfp4_row_scaled: issue 24) with ``--add`` from the commit that named them.
"""
from __future__ import annotations

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp4jax
from fp4jax import outcontrol, recipes

# name: (x shape, w shape, dimension numbers or None for fp4jax.dot, dtype)
SHAPES = {
    "small": ((32, 64), (64, 48), None, jnp.float32),             # aligned to 16, pads for the 128-blocks
    "pad": ((40, 160), (160, 72), None, jnp.float32),             # pads M, N; K > 128 and not a multiple
    "lead": ((2, 24, 144), (144, 80), None, jnp.bfloat16),        # leading axes, bf16 operands
    "batch": ((2, 48, 136), (2, 136, 40), (((2,), (1,)), ((0,), (0,))), jnp.float32),   # dot_general B axis
}
MODES = ("jit", "eager")
KEEP_ARRAYS = ("small",)


def _inputs(shape_name):
  xs, ws, _, dtype = SHAPES[shape_name]
  k1, k2, k3 = jax.random.split(jax.random.key(list(SHAPES).index(shape_name)), 3)
  x = jax.random.normal(k1, xs) * jnp.exp2(jnp.arange(xs[-1], dtype=jnp.float32) % 7 - 3)
  w = jax.random.normal(k2, ws) * 0.05
  return x.astype(dtype), w.astype(dtype), k3


def _dot_fn(recipe, dims):
  if recipe == "outcontrol":
    def f(x, w, key):
      k_in = x.shape[-1]
      perm = jnp.argsort(-jnp.sum(jnp.abs(x.astype(jnp.float32)), axis=0), stable=True).astype(jnp.int32)
      return outcontrol.dot(x, w, perm, outcontrol.k8(k_in, 0.1) or 0, key=key)
    return f
  if dims is None:
    return lambda x, w, key: fp4jax.dot(x, w, recipe=recipe, key=key)
  return lambda x, w, key: fp4jax.dot_general(x, w, dims, recipe=recipe, key=key)


def _value_and_grads(recipe, shape_name, mode):
  x, w, k_dy = _inputs(shape_name)
  dims = SHAPES[shape_name][2]
  f = _dot_fn(recipe, dims)
  key = jax.random.key(7)

  def run(x, w, key):
    y, vjp = jax.vjp(lambda x, w: f(x, w, key), x, w)
    dy = jax.random.normal(k_dy, y.shape).astype(y.dtype)
    dx, dw = vjp(dy)
    return y, dx, dw

  if mode == "jit":
    return jax.jit(run)(x, w, key)
  return run(x, w, key)


def plain(shape_name):
  """y, dx, dw of ``lax.dot_general`` itself, jitted, on the inputs of ``shape_name``: what the bf16 recipe
  gives, bit for bit, computed without fp4jax (the summation-order canary of tests/test_dot_golden.py)."""
  x, w, k_dy = _inputs(shape_name)
  dims = SHAPES[shape_name][2] or (((x.ndim - 1,), (0,)), ((), ()))

  def run(x, w):
    y, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, dims), x, w)
    dy = jax.random.normal(k_dy, y.shape).astype(y.dtype)
    return (y, *vjp(dy))

  return tuple(np.asarray(t) for t in jax.jit(run)(x, w))


def cases():
  """(recipe, shape, mode) of every recorded case."""
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
  for recipe, shape_name, mode in cases():
    if recipe in recorded:
      continue
    name = case_name(recipe, shape_name, mode)
    y, dx, dw = compute(recipe, shape_name, mode)
    for tag, a in (("y", y), ("dx", dx), ("dw", dw)):
      store[f"{name}/{tag}/sha256"] = np.array(digest(a))
      if shape_name in KEEP_ARRAYS:
        store[f"{name}/{tag}"] = a.astype(np.float32) if a.dtype == jnp.bfloat16 else a
    print(name, float(np.sum(y.astype(np.float32))), flush=True)
  np.savez_compressed(args.out, **store)


if __name__ == "__main__":
  main()
