"""SQNR of the quantizers of Four Over Six, Quartet II and TetraJet-v2 on real tensors of a checkpoint.

  python -m experiments.recipes_numerics --run runs/study_cpu/nvfp4/seed0
  (gradient cosines per recipe: python -m experiments.numerics_study --run ... --recipes nvfp4,quartet2,...)

Legend: M tokens, K a linear layer's input width, N its output width. For every quantized block linear
layer of the run (its input x_MxK, kernel w_KxN and output gradient dy_MxN from one validation batch,
captured by ``experiments.numerics_study.capture``), the SQNR 10·log10(|t|²/|t − t̂|²) in dB of each
operand under each method's quantizer, along the axis its GEMM contracts, zero-padded to whole blocks.
Transforms are orthogonal, so errors are measured in the rotated basis. Averages over the layers.
"""
from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.numerics_study import capture, load_run
import fp4jax
from fp4jax.numerics import eden, hadamard
from fp4jax.quantizers import Quantizer

_NV, _NV_TILES = Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True)
_FOS = {m: Quantizer("nvfp4", four_over_six=(256, m)) for m in ("mse", "mae")}
_FOS_TILES = Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse"))
_DBQ, _DBQ_SR, _EDEN = Quantizer("nvfp4_dbq"), Quantizer("nvfp4_dbq", stochastic=True), Quantizer("nvfp4_eden")


def _nvfp4_sr(t, bits):
  return fp4jax.quantize(t, "nvfp4", rounding="stochastic", bits=bits)


def _pad(t, axis_multiples):
  return jnp.pad(t, [(0, -t.shape[a] % axis_multiples.get(a, 1)) for a in range(t.ndim)])


def _sqnr(t, t_hat) -> float:
  t, t_hat = np.asarray(t, np.float64), np.asarray(t_hat, np.float64)
  return 10.0 * math.log10(np.sum(t ** 2) / np.sum((t - t_hat) ** 2))


def operand_sqnr(t_RxC, key) -> dict[str, float]:
  """SQNR of t quantized along its last axis C by each method's quantizer."""
  t = jnp.asarray(t_RxC, jnp.float32)
  t16 = _pad(t, {1: 16})
  t128 = _pad(t, {1: 128})
  k1, k2, k3, k4 = jax.random.split(key, 4)
  rht16 = hadamard.rht(t128, axis=-1, size=16)
  signs128 = eden.random_signs(k1)
  rot128 = eden.rht(t128, signs128)
  signs16 = eden.random_signs(k2, 16)
  rot16 = eden.rht(t128, signs16)
  return {
      "nvfp4 RTN": _sqnr(t16, fp4jax.dequantize(_NV(t16))),
      "4/6 mse": _sqnr(t16, fp4jax.dequantize(_FOS["mse"](t16))),
      "4/6 mae": _sqnr(t16, fp4jax.dequantize(_FOS["mae"](t16))),
      "dbq RTN": _sqnr(t128, fp4jax.dequantize(_DBQ(t128))),
      "nvfp4 SR": _sqnr(t16, fp4jax.dequantize(_nvfp4_sr(t16, jax.random.bits(k3, t16.shape, jnp.uint8)))),
      "nvfp4 RHT16 SR": _sqnr(rht16, fp4jax.dequantize(_nvfp4_sr(rht16, jax.random.bits(k3, rht16.shape, jnp.uint8)))),
      "MS-EDEN RHT128": _sqnr(rot128, fp4jax.dequantize(_EDEN(rot128, k4))),
      "dbq RHT16 SR": _sqnr(rot16, fp4jax.dequantize(_DBQ_SR(rot16, k4))),
  }


def weight_tile_sqnr(w_KxN) -> dict[str, float]:
  """The fprop weight in 16x16 tiles (the paper's and 4/6's nvidia-scheme layout), as wᵀ (N, K)."""
  wt = _pad(jnp.asarray(w_KxN, jnp.float32).T, {0: 16, 1: 16})
  return {"nvfp4 16x16": _sqnr(wt, fp4jax.dequantize(_NV_TILES(wt))),
          "4/6 mse 16x16": _sqnr(wt, fp4jax.dequantize(_FOS_TILES(wt)))}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--run", required=True, help="a run directory (config.json and checkpoints/)")
  parser.add_argument("--batch", type=int, default=16, help="validation sequences in the batch")
  args = parser.parse_args(argv)
  model_config, _, params, tokens, step = load_run(args.run, args.batch)
  key = jax.random.key(0)
  taps, _, _ = capture(model_config, params, tokens, key)
  rows = {}   # (operand, method) -> list over layers
  for i, (path, t) in enumerate(taps.items()):
    if t["precision"] == "bf16":
      continue
    k = jax.random.fold_in(key, i)
    operands = {"w (fprop, along K)": t["w"].T, "x (fprop, along K)": t["x"],
                "dy (dgrad, along N)": t["dy"], "xᵀ (wgrad, along M)": t["x"].T, "dyᵀ (wgrad, along M)": t["dy"].T}
    for name, value in operands.items():
      for method, db in operand_sqnr(value, k).items():
        rows.setdefault((name, method), []).append(db)
    for method, db in weight_tile_sqnr(t["w"]).items():
      rows.setdefault(("w (fprop, along K)", method), []).append(db)
  methods = list(dict.fromkeys(m for _, m in rows))
  names = list(dict.fromkeys(n for n, _ in rows))
  print(f"SQNR (dB), mean over the {len(rows[names[0], methods[0]])} quantized layers of {args.run} step {step}, "
        f"batch {tokens.shape}")
  print("| operand | " + " | ".join(methods) + " |")
  print("|---|" + "---|" * len(methods))
  for n in names:
    cells = [f"{np.mean(rows[n, m]):.2f}" if (n, m) in rows else "" for m in methods]
    print(f"| {n} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
