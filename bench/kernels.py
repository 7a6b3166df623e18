"""Kernel benchmark: one table of quantize bandwidth and scaled-matmul throughput.

  python bench/kernels.py [--sizes 4096,8192] [--iters 20]

Quantize rows: bytes moved (input read + codes and scales written) per second, as a ratio to a
device-to-device copy of the input (read + write of the same tensor, XLA's ``-x``) — target >= 0.7.
"+amax" rows include the separate tensor-amax reduction pass; the others time the quantize pass with
the amax given. Matmul rows: TFLOP/s of the NVFP4/MXFP4 scaled matmul (pre-quantized operands, bf16
out) as a ratio to a bf16 ``jnp.dot`` of the same shape — target >= 0.9 for the emulated NVFP4 GEMM.
On GPU both impls are timed (impl="xla" is the default until ``VERIFIED_KERNELS`` lists a kernel). On
CPU only impl="xla" at small sizes: the Pallas kernels would run in the interpreter, which measures
nothing useful. ``scripts/gpu_check.py`` is the one-shot device check (exactness on the device, the
train step, the VERIFIED_KERNELS candidates); this table is the sweep over sizes.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax
from fp4jax import dispatch
from fp4jax.api import quantize_rht_transposed, scaled_matmul

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.timing import median_seconds, nbytes  # noqa: E402  (the repository root on the path when run as a script)


def quantize_rows(n: int, impls, iters: int):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.bfloat16)
  copy = jax.jit(lambda x: -x)
  t_copy = median_seconds(copy, x, iters=iters)
  copy_bw = 2 * nbytes(x) / t_copy
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint8)
  ops = {
      "nvfp4 1x16": lambda x, impl: fp4jax.quantize(x, "nvfp4", amax=amax, impl=impl),
      "nvfp4 1x16 +amax": lambda x, impl: fp4jax.quantize(x, "nvfp4", impl=impl),
      "nvfp4 1x16 SR": lambda x, impl: fp4jax.quantize(x, "nvfp4", amax=amax, rounding="stochastic",
                                                       bits=bits, impl=impl),
      "nvfp4 16x16": lambda x, impl: fp4jax.quantize(x, "nvfp4", tile=(16, 16), amax=amax, impl=impl),
      "mxfp4 1x32": lambda x, impl: fp4jax.quantize(x, "mxfp4", impl=impl),
      "nvfp4 RHT-T +amax": lambda x, impl: quantize_rht_transposed(x, "nvfp4", impl=impl),
  }
  rows = [("copy (-x)", "xla", f"{n}x{n}", t_copy, copy_bw / 1e9, "GB/s", 1.0)]
  for name, op in ops.items():
    for impl in impls:
      fn = jax.jit(lambda x, op=op, impl=impl: op(x, impl))
      t = median_seconds(fn, x, iters=iters)
      moved = nbytes(x) + nbytes(jax.eval_shape(fn, x))
      if "SR" in name:
        moved += nbytes(bits)
      bw = moved / t
      rows.append((f"quantize {name}", impl, f"{n}x{n}", t, bw / 1e9, "GB/s", bw / copy_bw))
  return rows


def matmul_rows(n: int, impls, iters: int):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
  flops = 2.0 * n ** 3
  t_ref = median_seconds(jax.jit(lambda x, w: jnp.dot(x, w.T)), x, w, iters=iters)
  ref_tflops = flops / t_ref / 1e12
  rows = [("bf16 jnp.dot", "xla", f"{n}^3", t_ref, ref_tflops, "TFLOP/s", 1.0)]
  for fmt, w_tile in (("nvfp4", (16, 16)), ("mxfp4", None)):
    a = fp4jax.quantize(x, fmt, impl="xla")
    b = fp4jax.quantize(w, fmt, tile=w_tile, impl="xla")
    for impl in impls:
      fn = jax.jit(lambda a, b, impl=impl: scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl))
      t = median_seconds(fn, a, b, iters=iters)
      tf = flops / t / 1e12
      rows.append((f"scaled_matmul {fmt}", impl, f"{n}^3", t, tf, "TFLOP/s", tf / ref_tflops))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default=None, help="comma-separated square sizes")
  parser.add_argument("--iters", type=int, default=None)
  args = parser.parse_args(argv)
  on_gpu = dispatch.can_use_pallas("nvfp4")
  sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
      [4096, 8192] if on_gpu else [256, 512])
  iters = args.iters or (20 if on_gpu else 3)
  impls = ("pallas", "xla") if on_gpu else ("xla",)
  dev = jax.devices()[0]
  print(f"# fp4jax kernel benchmark — jax {jax.__version__}, backend {jax.default_backend()}, "
        f"device {getattr(dev, 'device_kind', dev.platform)}")
  if not on_gpu:
    print("# no CUDA GPU: impl='xla' only, small sizes (Pallas kernels would run interpreted); "
          "these numbers say nothing about GPU performance")
  rows = []
  for n in sizes:
    rows += quantize_rows(n, impls, iters)
    rows += matmul_rows(n, impls, iters)
  print(f"{'op':28s} {'impl':7s} {'shape':11s} {'ms':>9s} {'rate':>9s} {'unit':8s} {'ratio':>6s}")
  for op, impl, shape, t, rate, unit, ratio in rows:
    print(f"{op:28s} {impl:7s} {shape:11s} {t * 1e3:9.3f} {rate:9.2f} {unit:8s} {ratio:6.2f}")
  print("# ratio: quantize GB/s over copy GB/s (target >= 0.70); matmul TFLOP/s over bf16 jnp.dot "
        "(target >= 0.90)")


if __name__ == "__main__":
  main()
