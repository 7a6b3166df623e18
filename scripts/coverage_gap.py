"""Which library lines only the slow tests reach: the default and the full suite under coverage, compared.

    python scripts/coverage_gap.py                   # both suites (the full one takes hours on 2 cores)
    python scripts/coverage_gap.py --report_only     # compare the data a previous run left in --out
    python scripts/coverage_gap.py --default "tests/test_nan.py -k abs_max" --full "tests/test_nan.py"

Each suite runs as ``python -m coverage run -m pytest -n 2 <its arguments>`` over fp4jax/, models/ and
training/, with subprocesses measured too (the xdist workers and the training runs the tests start). The
report lists, per file, the lines the full suite executes and the default suite does not, and the two
numbers docs/PERF.md records: the lines each suite reaches, and the default's share of the full suite's
lines. Exit status 1 if that share is below --min_share (97%).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fp4jax", "models", "training")
SUITES = {"default": "", "full": "-m 'slow or not slow'"}   # pyproject's addopts deselect the slow tests


def _rcfile(out: str) -> str:
  path = os.path.join(out, "coveragerc")
  with open(path, "w") as f:
    f.write("[run]\nparallel = true\npatch = subprocess\nsource_pkgs = " + ", ".join(PACKAGES) + "\n")
  return path


def run_suite(name: str, pytest_args: str, out: str, workers: int) -> str:
  """Run one suite under coverage; the path of its JSON report (executed lines per file)."""
  data = os.path.join(out, name, ".coverage")
  os.makedirs(os.path.dirname(data), exist_ok=True)
  for stale in os.listdir(os.path.dirname(data)):
    if stale.startswith(".coverage"):
      os.remove(os.path.join(os.path.dirname(data), stale))
  env = dict(os.environ, COVERAGE_FILE=data, COVERAGE_RCFILE=_rcfile(out))
  cmd = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-n", str(workers),
         *shlex.split(pytest_args)]
  print(f"{name}: {shlex.join(cmd)}", flush=True)
  status = subprocess.call(cmd, cwd=ROOT, env=env)
  if status not in (0, 1):   # 1: some test failed; its coverage still counts, and the report says so
    raise SystemExit(f"{name}: pytest exited with {status}; no coverage to compare")
  subprocess.check_call([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env)
  report = os.path.join(out, f"{name}.json")
  subprocess.check_call([sys.executable, "-m", "coverage", "json", "-q", "-o", report], cwd=ROOT, env=env)
  return report


def executed(report: str) -> dict[str, set[int]]:
  """{file relative to the repository: executed line numbers} of a coverage JSON report."""
  with open(report) as f:
    files = json.load(f)["files"]
  return {os.path.relpath(os.path.abspath(os.path.join(ROOT, p)), ROOT): set(v["executed_lines"])
          for p, v in files.items()}


def _ranges(lines: list[int]) -> str:
  """1-3, 7, 9-10 of sorted line numbers."""
  parts, start = [], None
  for i, n in enumerate(lines):
    start = n if start is None else start
    if i + 1 == len(lines) or lines[i + 1] != n + 1:
      parts.append(f"{start}" if start == n else f"{start}-{n}")
      start = None
  return ", ".join(parts)


def compare(default: dict[str, set[int]], full: dict[str, set[int]]) -> tuple[str, float]:
  """The report text and the default suite's share of the lines the full suite reaches."""
  only = {f: sorted(lines - default.get(f, set())) for f, lines in full.items()}
  only = {f: lines for f, lines in only.items() if lines}
  n_full = sum(len(v) for v in full.values())
  n_default = sum(len(default.get(f, set()) & v) for f, v in full.items())
  share = n_default / n_full if n_full else 1.0
  lines = [f"full suite: {n_full} lines of {', '.join(PACKAGES)} executed; default suite: {n_default} of them "
           f"({100 * share:.2f}%)", ""]
  if only:
    lines.append("lines only the full suite reaches:")
    lines += [f"  {f} ({len(v)}): {_ranges(v)}" for f, v in sorted(only.items(), key=lambda kv: -len(kv[1]))]
  return "\n".join(lines), share


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(ROOT, "results", "coverage"), help="coverage data and reports")
  ap.add_argument("--default", default=SUITES["default"], help="pytest arguments of the default suite")
  ap.add_argument("--full", default=SUITES["full"], help="pytest arguments of the full suite")
  ap.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers")
  ap.add_argument("--report_only", action="store_true", help="compare the JSON reports already in --out")
  ap.add_argument("--min_share", type=float, default=0.97, help="exit 1 below this share")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  reports = {name: os.path.join(args.out, f"{name}.json") for name in SUITES}
  if not args.report_only:
    reports = {name: run_suite(name, getattr(args, name), args.out, args.workers) for name in SUITES}
  missing = [p for p in reports.values() if not os.path.exists(p)]
  if missing:
    raise SystemExit(f"no coverage report at {', '.join(missing)}: run without --report_only first")
  text, share = compare(executed(reports["default"]), executed(reports["full"]))
  print(text)
  with open(os.path.join(args.out, "gap.txt"), "w") as f:
    f.write(text + "\n")
  return 0 if share >= args.min_share else 1


if __name__ == "__main__":
  sys.exit(main())
