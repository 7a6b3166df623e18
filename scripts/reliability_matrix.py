"""Print the reliability matrix (docs/RELIABILITY.md): every case -> verdict, and the counts.

    python scripts/reliability_matrix.py              # fp4jax cases (tests/test_reliability_fp4jax.py)
    python scripts/reliability_matrix.py --write      # also put the table into docs/RELIABILITY.md
    python scripts/reliability_matrix.py --training   # then scripts/reliability_training.py (pipeline)

About 2 minutes on 2 CPU cores (the x64 cases run once in a subprocess with jax_enable_x64).

Verdicts: "clear error" (the expected exception type with its one-line message), "correct result"
(an exactly specified result that checks), "silently wrong" (a result where an error was expected,
or a result that fails its check), "raw traceback" (any other exception). Exit status 1 if any case
is silently wrong or a raw traceback.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(1, ROOT)   # this checkout's fp4jax, not whichever one is installed

import jax  # noqa: E402
import test_reliability_fp4jax as matrix  # noqa: E402  (the case table lives with its tests)

DOC = os.path.join(ROOT, "docs", "RELIABILITY.md")
BEGIN, END = "<!-- fp4jax-matrix:begin -->", "<!-- fp4jax-matrix:end -->"
ORDER = (matrix.CLEAR_ERROR, matrix.CORRECT, matrix.SILENT, matrix.RAW)


def markdown(rows, counts) -> str:
  lines = [f"Measured {datetime.date.today().isoformat()} ({platform.machine()}, jax {jax.__version__}, "
           f"{jax.default_backend()}): {sum(counts.values())} cases, "
           + ", ".join(f"{counts[k]} {k}" for k in ORDER) + ".", "",
           "| group | case | expected | verdict |", "|---|---|---|---|"]
  for group, name, expect, v, _ in rows:
    lines.append(f"| {group} | {name} | {expect.replace('|', '/')} | {v} |")
  return "\n".join(lines)


def write_doc(text: str):
  with open(DOC) as f:
    doc = f.read()
  if BEGIN not in doc or END not in doc:
    raise SystemExit(f"{DOC} has no {BEGIN} ... {END} section to fill")
  head, rest = doc.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  with open(DOC, "w") as f:
    f.write(head + BEGIN + "\n" + text + "\n" + END + tail)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--write", action="store_true", help="write the table into docs/RELIABILITY.md")
  ap.add_argument("--training", action="store_true", help="then run scripts/reliability_training.py")
  args = ap.parse_args(argv)

  counts = collections.Counter()
  rows = []
  for case in matrix.CASES:
    v, detail = matrix.verdict(case)
    counts[v] += 1
    rows.append((case.group, case.name, case.expect, v, detail))

  width = max(len(f"{g}: {n}") for g, n, *_ in rows)
  for group, name, expect, v, detail in rows:
    print(f"{group + ': ' + name:<{width}}  {v:<15}  {expect}")
    if v in (matrix.SILENT, matrix.RAW):
      print(f"{'':<{width}}  -> {detail}")
  print()
  print(f"fp4jax: {sum(counts.values())} cases: " + ", ".join(f"{counts[k]} {k}" for k in ORDER))
  if args.write:
    write_doc(markdown(rows, counts))
    print(f"wrote the table into {DOC}")
  bad = counts[matrix.SILENT] + counts[matrix.RAW]
  if args.training:
    script = os.path.join(ROOT, "scripts", "reliability_training.py")
    bad += subprocess.run([sys.executable, script], cwd=ROOT, check=False).returncode != 0
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
