"""What the one-rounding guards of ``fp4jax._exact`` cost: jitted ops with the guard as shipped, with the
NaN-test mask it replaced (issue 19), and with no guard at all (wrong numerics, the speed baseline).

  python bench/exact_guards.py            # ~2 min on a quiet 2-core CPU
  python bench/exact_guards.py --quick

The variants swap ``fp4jax._exact._opaque`` before each op is traced, so the same call sites are timed.
Per op and variant: the best of ``--rounds`` interleaved medians (``bench.timing.median_seconds``; the
rounds alternate the variants, so a load change on a shared machine hits them alike), and the number of
fusions and of instructions in the optimized HLO, which shows whether XLA still fuses the op as before.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4jax                                    # noqa: E402
from bench.timing import median_seconds          # noqa: E402
from fp4jax import _exact, osci_reset       # noqa: E402
from fp4jax.numerics import dbq       # noqa: E402

SHIPPED = _exact._opaque


def _isnan_mask(v_f32, key_f32):
  """The guard before issue 19: AND with -1 - isnan(key)."""
  mask = jnp.int32(-1) - jnp.isnan(key_f32).astype(jnp.int32)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(v_f32, jnp.int32) & mask, jnp.float32)


VARIANTS = {"payload (shipped)": SHIPPED, "isnan (before)": _isnan_mask, "none": lambda v, key: v}


def ops(rows: int, length: int, m: int, k: int):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((rows, length)).astype(np.float32))
  q = dbq.quantize(x)
  qa = dbq.quantize(jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
  qb = dbq.quantize(jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
  n4 = fp4jax.quantize(x, "nvfp4")
  cfg = osci_reset.OsciResetConfig(period=4, detect_steps=2, start=0, axis=1)
  st = osci_reset.init({"w": x}, None)
  return {
      f"dbq.dequantize {rows}x{length}": (lambda q: dbq.dequantize(q), (q,)),
      f"dbq.quantize {rows}x{length}": (lambda x: dbq.quantize(x), (x,)),
      f"fp4jax.dequantize nvfp4 {rows}x{length}": (lambda d, s, a: fp4jax.dequantize(
          fp4jax.QTensor(d, s, a, "nvfp4", -1, 16, None, jnp.float32)), (n4.data, n4.scale, n4.amax)),
      f"dbq.gemm {m}x{k} . {k}x{m}": (lambda a, b: dbq.gemm(a, b), (qa, qb)),
      f"osci_reset.update (tracking step) {rows}x{length}": (
          lambda p, s: osci_reset.update(p, s, 1, cfg), ({"w": x}, st)),
  }


def hlo_counts(fn, args):
  text = jax.jit(fn).lower(*args).compile().as_text()
  fusions = len(re.findall(r"\bfusion\(", text)) + len(re.findall(r"= \S+ fusion", text))
  instrs = sum(1 for line in text.splitlines() if " = " in line)
  return fusions, instrs


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  rows, length, m, k = (256, 1024, 128, 512) if args.quick else (1024, 4096, 512, 2048)
  iters = 5 if args.quick else 10
  table = {}
  for name, opaque in VARIANTS.items():
    _exact._opaque = opaque
    for op, (fn, fargs) in ops(rows, length, m, k).items():
      jitted = jax.jit(fn)
      jax.block_until_ready(jitted(*fargs))
      table.setdefault(op, {})[name] = [jitted, fargs, hlo_counts(fn, fargs), []]
  _exact._opaque = SHIPPED
  for _ in range(args.rounds):
    for op, by_variant in table.items():
      for name, entry in by_variant.items():
        entry[3].append(median_seconds(entry[0], *entry[1], iters=iters))
  print(f"# {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, jax {jax.__version__}, backend {jax.default_backend()}; "
        f"load average {os.getloadavg()[0]:.1f}")
  print("| op | " + " | ".join(f"{v}: ms (fusions / HLO instructions)" for v in VARIANTS) + " |")
  print("|---|" + "---|" * len(VARIANTS))
  for op, by_variant in table.items():
    cells = [f"{min(e[3]) * 1e3:.2f} ({e[2][0]} / {e[2][1]})" for e in by_variant.values()]
    print(f"| {op} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
