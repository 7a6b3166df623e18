"""The headline table: every row of bench/predict/report_rows.py compiled without a GPU and priced by the ruler.

  flock /tmp/fp4jax-heavy.lock nice -n 10 python bench/predict/report.py                    # every row, into docs/PERF.md
  flock /tmp/fp4jax-heavy.lock nice -n 10 python bench/predict/report.py --rows 12b_b200 --variants bf16,nvfp4
  python bench/predict/report.py --no_compile             # price what is cached; a missing row keeps its line
                                                           # of the table in docs/PERF.md, marked with its commit

Each (row, variant) is one deviceless compile (bench/predict/gpu_aot.py in a subprocess), cached on disk by the
code's git tree hashes and its arguments (bench/predict/report_cache.py): a rerun recompiles only what changed.
The cost model is applied at every run (bench/predict/hlo_cost.py with bench/predict/cluster.py's cluster and
bench/predict/gemm_rates.py's GEMM efficiencies). A row that does not compile is printed as
"does not compile: <reason>". The table, its date, versions and assumptions, replace the block between
the report markers at the top of docs/PERF.md (``--write``, on by default when every row is selected).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# pylint: disable=wrong-import-position
from bench.predict import report_cache
from bench.predict import report_rows


def compile_rows(cache: report_cache.Cache, rows, variants, timeout_s: float, recompile: bool = False) -> None:
  for row in rows:
    for v in row.variants:
      if variants and v not in variants:
        continue
      argv = row.argv(v)
      key = cache.key(argv, row.target)
      if cache.load(key) is not None and not recompile:
        continue
      print(f"{row.name} / {v}:", flush=True)
      cache.compile(argv, row.target, timeout_s, log=lambda s: print(s, flush=True))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", default="", help=f"comma-separated rows (default all): {', '.join(report_rows.ROWS)}")
  p.add_argument("--variants", default="", help=f"comma-separated variants (default all): "
                 f"{', '.join(report_rows.VARIANTS)}")
  p.add_argument("--cache", default=report_cache.DEFAULT_DIR, help="the compiled programs' directory")
  p.add_argument("--no_compile", action="store_true", help="price the cached rows only")
  p.add_argument("--compile_only", action="store_true", help="compile what is missing, print nothing else")
  p.add_argument("--recompile", action="store_true", help="compile the selected rows even when cached")
  p.add_argument("--timeout_s", type=float, default=3600, help="per compile")
  p.add_argument("--write", default=None, choices=("yes", "no"),
                 help="replace the table at the top of docs/PERF.md (default: yes when every row is selected)")
  a = p.parse_args(argv)
  names = [r for r in a.rows.split(",") if r] or list(report_rows.ROWS)
  unknown = [n for n in names if n not in report_rows.ROWS]
  if unknown:
    p.error(f"unknown rows {unknown}; rows are {list(report_rows.ROWS)}")
  variants = [v for v in a.variants.split(",") if v]
  bad = [v for v in variants if v not in report_rows.VARIANTS]
  if bad:
    p.error(f"unknown variants {bad}; variants are {list(report_rows.VARIANTS)}")
  rows = [report_rows.ROWS[n] for n in names]
  cache = report_cache.Cache(a.cache)
  if not a.no_compile:
    compile_rows(cache, rows, variants, a.timeout_s, a.recompile)
  if a.compile_only:
    return 0
  from bench.predict import report_table   # pylint: disable=import-outside-toplevel
  text = report_table.render(cache, rows, variants, previous=report_table.previous_table())
  print(text)
  write = a.write == "yes" or (a.write is None and not a.rows and not a.variants)
  if write:
    report_table.write_perf(text)
    print(f"written to {report_table.PERF_MD}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
