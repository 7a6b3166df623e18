"""Numerics benchmark: quantization error per format and data kind, and quantize throughput on CPU.

  python bench/numerics.py [--size 4096] [--repeats 5]

Prints one table measured in one run: relative MSE and SQNR (dB) of nvfp4 (1x16, 16x16), mxfp4
(FLOOR, RCEIL) and fp8 (1x128 blocks, per tensor) on Gaussian, Student-t (3 dof) and outlier-channel
data; then the time of `fp4jax.quantize` on a size x size bf16 tensor as a ratio to a plain
`astype(bf16 -> f32)` pass over the same tensor (both jitted, same run, median of repeats).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax

VARIANTS = {
    "nvfp4 1x16": dict(fmt="nvfp4"),
    "nvfp4 16x16": dict(fmt="nvfp4", tile=(16, 16)),
    "mxfp4 FLOOR": dict(fmt="mxfp4", scale_rule="floor"),
    "mxfp4 RCEIL": dict(fmt="mxfp4", scale_rule="rceil"),
    "fp8 1x128": dict(fmt="fp8"),
    "fp8 tensor": dict(fmt="fp8", scaling="tensor"),
}


def datasets(n, seed=0):
  rng = np.random.default_rng(seed)
  gauss = rng.standard_normal((n, n)).astype(np.float32)
  student = rng.standard_t(3, (n, n)).astype(np.float32)
  outlier = rng.standard_normal((n, n)).astype(np.float32)
  cols = rng.choice(n, max(1, n // 128), replace=False)
  outlier[:, cols] *= 100.0   # a few channels carry outliers, as LLM activations do
  return {"gaussian": gauss, "student-t(3)": student, "outlier channels": outlier}


def error_row(x, kw):
  q = jax.jit(lambda v: fp4jax.quantize(v, **kw))(x)
  d = fp4jax.dequantize(q)
  rel = float(jnp.sum((d - x) ** 2) / jnp.sum(x ** 2))
  return rel, -10.0 * np.log10(rel) if rel > 0 else float("inf")


def timed(fn, x, repeats):
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--error-size", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  print(f"# fp4jax numerics benchmark  {datetime.date.today()}  {platform.machine()} "
        f"{jax.devices()[0].platform} x{jax.device_count()}  jax {jax.__version__}")
  data = datasets(args.error_size)
  print(f"\nQuantization error, {args.error_size}x{args.error_size} float32, quantized along the last axis")
  header = f"| {'format':<12} |" + "".join(f" {name} relMSE | SQNR dB |" for name in data)
  print(header)
  print("|" + "---|" * (1 + 2 * len(data)))
  for name, kw in VARIANTS.items():
    cells = []
    for x in data.values():
      rel, sqnr = error_row(jnp.asarray(x), kw)
      cells.append(f" {rel:.3e} | {sqnr:6.2f} |")
    print(f"| {name:<12} |" + "".join(cells))

  x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
  base = timed(jax.jit(lambda v: v.astype(jnp.float32)), x, args.repeats)
  print(f"\nQuantize throughput, {args.size}x{args.size} bfloat16 -> format (median of {args.repeats}); "
        f"baseline astype(bf16->f32) {base * 1e3:.1f} ms")
  print("| format | ms | time / astype | GB/s read |")
  print("|---|---|---|---|")
  for name in ("nvfp4 1x16", "nvfp4 16x16", "mxfp4 RCEIL", "fp8 1x128"):
    kw = VARIANTS[name]
    t = timed(jax.jit(lambda v, kw=kw: fp4jax.quantize(v, **kw)), x, args.repeats)
    print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x | {x.nbytes / t / 1e9:.2f} |")


if __name__ == "__main__":
  main()
