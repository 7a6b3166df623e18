"""Forward+backward time of ``fp4jax.dot`` per recipe, as tokens/s and as a ratio to nvfp4.

    python bench/dot_recipes.py                       # 2048 tokens, 512 -> 512, every newer recipe
    python bench/dot_recipes.py --recipes nvfp4,quartet2 --m 1024 --reps 7

One jitted function per recipe returns y, dx and dw for a fixed cotangent (bf16 operands, a key for the
backward pass's random bits); the recipes are timed round-robin (--rounds rounds of --reps calls each),
so that a machine shared with other jobs slows them alike, and each recipe's median call is reported.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import fp4jax

DEFAULT = "nvfp4,nvfp4_4over6,quartet2_rtn,quartet2,tetrajet2"


def _fn(recipe):
  def f(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))
  return jax.jit(f)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--recipes", default=DEFAULT)
  p.add_argument("--m", type=int, default=2048)
  p.add_argument("--k", type=int, default=512)
  p.add_argument("--n", type=int, default=512)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--rounds", type=int, default=3)
  args = p.parse_args()
  names = args.recipes.split(",")
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (args.m, args.k), jnp.bfloat16)
  w = (jax.random.normal(k2, (args.k, args.n)) * 0.05).astype(jnp.bfloat16)
  dy = jax.random.normal(k3, (args.m, args.n), jnp.bfloat16)
  key = jax.random.key(1)
  fns = {r: _fn(r) for r in names}
  for r in names:
    jax.block_until_ready(fns[r](x, w, dy, key))   # compile + warm up
  times = {r: [] for r in names}
  for _ in range(args.rounds):
    for r in names:
      for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fns[r](x, w, dy, key))
        times[r].append(time.perf_counter() - t0)
  base = statistics.median(times[names[0]])
  print(f"# fp4jax.dot fwd+bwd, x {args.m}x{args.k} . w {args.k}x{args.n} bf16, {jax.devices()[0].platform}, "
        f"median of {args.rounds * args.reps}")
  print(f"| recipe | ms | tokens/s | tokens/s vs {names[0]} |")
  print("|---|---|---|---|")
  for r in names:
    t = statistics.median(times[r])
    print(f"| {r} | {t * 1e3:.1f} | {args.m / t:,.0f} | {base / t:.2f}x |")


if __name__ == "__main__":
  main()
