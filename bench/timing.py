"""Timing helpers shared by the benchmarks and scripts/gpu_check.py (jax only)."""
from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, iters: int) -> float:
  """Median seconds per call of a compiled ``fn`` over 3 runs of ``iters`` calls (after a warm-up call)."""
  jax.block_until_ready(fn(*args))
  runs = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    runs.append((time.perf_counter() - t0) / iters)
  return statistics.median(runs)


def nbytes(tree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))
