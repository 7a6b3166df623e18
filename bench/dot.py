"""Forward+backward time and saved-residual bytes of fp4jax.dot, as ratios to the bf16 recipe.

    python bench/dot.py            # the two shapes of docs/DOT.md, on whatever backend JAX picks
    python bench/dot.py --quick    # small shapes, a smoke test

One table, measured in one run: for each shape, fp4jax.dot with the nvfp4 recipe (and mxfp4, fp8),
Qwix's NVFP4 quantized training (if qwix is importable) and ``jax.nn.scaled_dot_general`` (if it runs
on this backend), each as a ratio to its own unquantized baseline. Time: one jitted function that
returns y, dx and dw for a fixed cotangent dy (bf16 operands), median of --reps runs after a warm-up.
Residual bytes: the arrays the vjp keeps for the backward pass (traced with eval_shape, no run).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp4jax
from fp4jax import recipes

SHAPES = {  # name: (tokens M, K, N)
    "square 4096x4096 . 4096x4096": (4096, 4096, 4096),
    "MLP up: 4096 tokens, 1024->4096": (4096, 1024, 4096),
}
QUICK_SHAPES = {"quick 256x512 . 512x384": (256, 512, 384)}
DENSE = (((1,), (0,)), ((), ()))


def _residual_bytes(f, *args):
  vjp = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
  return sum(int(np.prod(l.shape)) * jnp.dtype(l.dtype).itemsize
             for l in jax.tree_util.tree_leaves(vjp) if not jnp.issubdtype(l.dtype, jax.dtypes.prng_key))


def _time(f, args, reps):
  """Median wall seconds of f(*args) (y, dx, dw), compiled and warmed up first."""
  def step(*a):
    y, vjp = jax.vjp(f, *a[:-1])
    return (y, *vjp(a[-1].astype(y.dtype)))
  step = jax.jit(step)
  jax.block_until_ready(step(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _operands(m, k, n):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n)) * k ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
  return x, w, dy


def _fp4jax_rows(m, k, n, reps):
  x, w, dy = _operands(m, k, n)
  key = jax.random.key(1)
  f = lambda r: (lambda x, w: fp4jax.dot(x, w, recipe=r, key=key))
  base_t = _time(f(recipes.bf16()), (x, w, dy), reps)
  base_b = _residual_bytes(f(recipes.bf16()), x, w)
  rows = [("fp4jax bf16 recipe (= lax.dot_general)", base_t, 1.0, 1.0)]
  for name in ("nvfp4", "mxfp4", "fp8"):
    t = _time(f(recipes.get(name)), (x, w, dy), reps)
    rows.append((f"fp4jax {name}", t, t / base_t, _residual_bytes(f(recipes.get(name)), x, w) / base_b))
  return rows


def _qwix_rows(m, k, n, reps):
  try:
    import flax.linen as nn
    import qwix
  except ImportError as e:
    return [("qwix nvfp4 QT", None, f"n/a (not installed: {e.name}; pip install qwix)", None)]
  try:
    x, _, dy = _operands(m, k, n)
    x, dy = x[None], dy[None]   # Qwix tells weights by their shape: keep x from looking like one
    dense = nn.Dense(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    rule = qwix.QtRule(module_path=".*", weight_qtype="nvfp4", act_qtype="nvfp4", bwd_qtype="nvfp4",
                       tile_size=16, bwd_weight_grad_tile_size=16, bwd_stochastic_rounding="uniform",
                       additional_qt_config={"dlhs_tile_size": 16, "drhs_tile_size": 16})
    qdense = qwix.quantize_model(dense, qwix.QtProvider([rule]))
    params = jax.jit(qdense.init)(jax.random.key(1), x)
    rngs = {"stochastic_rounding": jax.random.key(2)}
    fq = lambda p, x: qdense.apply(p, x, rngs=rngs)
    fb = lambda p, x: dense.apply(p, x)
    base_t = _time(fb, (params, x, dy), reps)
    t = _time(fq, (params, x, dy), reps)
    ratio_b = _residual_bytes(fq, params, x) / _residual_bytes(fb, params, x)
    return [(f"qwix {qwix.__version__} nvfp4 QT (SR, 1x16)", t, t / base_t, ratio_b)]
  except Exception as e:   # a bench reports what did not run rather than stopping
    return [("qwix nvfp4 QT", None, f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})", None)]


def _scaled_dot_general_rows(m, k, n, reps):
  if not hasattr(jax.nn, "scaled_dot_general"):
    return [("jax.nn.scaled_dot_general nvfp4", None, "n/a (not in this jax)", None)]
  try:
    x, w, dy = _operands(m, k, n)
    cfg = jax.nn.get_scaled_dot_general_config("nvfp4")
    dims = (((2,), (2,)), ((0,), (0,)))      # (1, M, K) · (1, N, K)
    f = lambda x, wt: jax.nn.scaled_dot_general(x, wt, dims, configs=[cfg, cfg, cfg])
    fb = lambda x, wt: lax.dot_general(x, wt, dims)
    args = (x[None], w.T[None], dy[None])
    base_t = _time(fb, args, reps)
    t = _time(f, args, reps)
    ratio_b = _residual_bytes(f, *args[:2]) / _residual_bytes(fb, *args[:2])
    return [("jax.nn.scaled_dot_general nvfp4", t, t / base_t, ratio_b)]
  except Exception as e:
    reason = str(e).splitlines()[0][:80]
    return [("jax.nn.scaled_dot_general nvfp4", None, f"n/a ({type(e).__name__}: {reason})", None)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  shapes = QUICK_SHAPES if args.quick else SHAPES
  print(f"backend: {jax.default_backend()}, {jax.device_count()} device(s): {jax.devices()[0].device_kind}; "
        f"jax {jax.__version__}; median of {args.reps} fwd+bwd runs, bf16 operands")
  header = f"| {'shape':32} | {'method':42} | {'fwd+bwd s':>9} | {'time / bf16':>11} | {'residual bytes / bf16':>21} |"
  print(header)
  print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
  for shape_name, (m, k, n) in shapes.items():
    rows = _fp4jax_rows(m, k, n, args.reps) + _qwix_rows(m, k, n, args.reps) + \
        _scaled_dot_general_rows(m, k, n, args.reps)
    for method, t, ratio, res in rows:
      t_s = "" if t is None else f"{t:9.3f}"
      ratio_s = ratio if isinstance(ratio, str) else f"{ratio:11.2f}"
      res_s = "" if res is None else f"{res:21.3f}"
      print(f"| {shape_name:32} | {method:42} | {t_s:>9} | {ratio_s:>11} | {res_s:>21} |", flush=True)


if __name__ == "__main__":
  main()
