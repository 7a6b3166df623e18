"""OsciReset's decisions on a training-like weight trajectory, to compare two versions of fp4jax.

  PYTHONPATH=<tree A> python scripts/osci_reset_decisions.py --out a.npz
  PYTHONPATH=<tree B> python scripts/osci_reset_decisions.py --out b.npz
  python scripts/osci_reset_decisions.py --compare a.npz b.npz

The trajectory: 16 kernels shaped like the study model's linear layers (49,152 weights, rows = input
features, init N(0, 1/K)), 110 steps of w += 1e-3·N(0, 1) - 0.05·(w - w_0) (a random walk held near its
start, as late training is), OsciReset with P = 52, N = 50, threshold 8, start 0: two windows, resets at
steps 51 and 103. Saved: D_Q and D_FP at the last tracking step of each window and the weights after
each reset. ``--compare`` counts the elements whose D_Q, reset decision or weight differ.
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [(32, 128), (128, 32), (32, 96), (64, 32), (32, 160)] * 2 + [(32, 64), (64, 32)] * 3
STEPS, PERIOD, DETECT = 110, 52, 50


def run(out: str) -> None:
  import jax
  import jax.numpy as jnp
  from fp4jax import osci_reset
  rng = np.random.default_rng(0)
  w0 = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in SHAPES]
  cfg = osci_reset.OsciResetConfig(period=PERIOD, detect_steps=DETECT, start=0, threshold=8.0, axis=0)
  params = {f"k{i}": jnp.asarray(w) for i, w in enumerate(w0)}
  state = osci_reset.init(params, None)
  step = jax.jit(lambda p, s, k: osci_reset.update(p, s, k, cfg))
  w, saved = [x.copy() for x in w0], {}
  for k in range(STEPS):
    w = [(x + np.float32(1e-3) * rng.standard_normal(x.shape).astype(np.float32) - np.float32(0.05) * (x - a))
         .astype(np.float32) for x, a in zip(w, w0)]
    params, state = step({f"k{i}": jnp.asarray(x) for i, x in enumerate(w)}, state, k)
    w = [np.asarray(params[f"k{i}"]) for i in range(len(w))]
    for i in range(len(w)):
      if k in (DETECT, DETECT + PERIOD):
        saved[f"dq{k}_{i}"], saved[f"dfp{k}_{i}"] = np.asarray(state[f"k{i}"].d_q), np.asarray(state[f"k{i}"].d_fp)
      if k in (DETECT + 1, DETECT + 1 + PERIOD):
        saved[f"w{k}_{i}"] = w[i]
  np.savez(out, **saved)


def compare(path_a: str, path_b: str) -> None:
  a, b = np.load(path_a), np.load(path_b)
  n = len(SHAPES)
  for k in (DETECT, DETECT + PERIOD):
    dq_a, dq_b = [a[f"dq{k}_{i}"] for i in range(n)], [b[f"dq{k}_{i}"] for i in range(n)]
    dfp = [b[f"dfp{k}_{i}"] for i in range(n)]
    ratio = lambda dq: [np.where(f == 0, 0, q / np.where(f == 0, 1, f)) for q, f in zip(dq, dfp)]
    flips = sum(int(((ra >= 8) != (rb >= 8)).sum()) for ra, rb in zip(ratio(dq_a), ratio(dq_b)))
    near = sum(int((np.abs(r - 8) < 8e-5).sum()) for r in ratio(dq_b))
    total = sum(q.size for q in dq_a)
    print(f"window ending at step {k}: D_Q differs in {sum(int((x != y).sum()) for x, y in zip(dq_a, dq_b))} "
          f"of {total}; resets {sum(int((r >= 8).sum()) for r in ratio(dq_a))} / "
          f"{sum(int((r >= 8).sum()) for r in ratio(dq_b))}; decisions that differ {flips}; ratios within "
          f"1e-5 (relative) of the threshold {near}; weights after the reset that differ "
          f"{sum(int((a[f'w{k + 1}_{i}'] != b[f'w{k + 1}_{i}']).sum()) for i in range(n))}")


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--out")
  parser.add_argument("--compare", nargs=2)
  args = parser.parse_args()
  if args.compare:
    compare(*args.compare)
  else:
    run(args.out)
