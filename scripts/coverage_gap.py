"""Which library lines only the slow tests reach: the default suite and the slow tests under coverage, compared.

    python scripts/coverage_gap.py                        # the default suite, then every slow test (hours on 2 cores)
    python scripts/coverage_gap.py --only default         # the default suite alone (about twice its usual time)
    python scripts/coverage_gap.py --only slow --parts 6 --part 2   # a sixth of the slow tests (by file), whenever
                                                          # the machine is free; the parts' data add up in --out
    python scripts/coverage_gap.py --report_only          # compare the data the runs left in --out
    python scripts/coverage_gap.py --default "tests/test_nan.py -k abs_max" --slow "tests/test_nan.py"
    python scripts/coverage_gap.py --only default --by_test      # also: the lines each default test alone reaches
    python scripts/coverage_gap.py --report_only --plan 0.4      # then: a candidate for tests/slow_tests.txt, the
                                                          # tests whose lines others run, costliest first, until
                                                          # 40% of the time is left

Each run is ``python -m coverage run -m pytest -n 2 <its arguments>`` over fp4jax/, models/ and training/ (and the
repository's other code, which only ``--plan`` reads), with subprocesses measured too (the xdist workers and the
training runs the tests start). The full suite's lines are the default suite's and the slow tests' together (what
``-m "slow or not slow"`` executes), so the slow tests can be measured in parts, each part a set of test files, and
the default suite need not run twice. The report lists, per file, the lines the full suite executes and the default
suite does not, and the two numbers docs/PERF.md records: the lines each suite reaches, and the default's share of
the full suite's lines. Exit status 1 if that share is below --min_share (97%).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import coverage_by_test  # noqa: E402  pylint: disable=wrong-import-position  (the plugin's context variable)
PACKAGES = ("fp4jax", "models", "training")
SUITES = {"default": "", "slow": "-m slow"}   # pyproject's addopts deselect the slow tests
OTHERS = ("bench", "configs", "experiments", "scripts", "tools", "tests")   # measured for --plan only
OMIT = ("tests/test_*.py", "tests/conftest.py", "tests/coverage_by_test.py", "tests/compile_report.py")
SLOW_TESTS = os.path.join(ROOT, "tests", "slow_tests.txt")
# Contracts the default suite checks whole, whatever lines other tests share with them: NaN kept (nothing silent),
# the recorded bits of every recipe's dot, one rounding per operation under each way of compiling, the
# specification's own test vectors.
KEEP = ("tests/test_nan.py", "tests/test_dot_golden.py", "tests/test_numerics_exact.py",
        "tests/test_numerics_spec.py")
REPRESENTED_BY = " represented by "   # tests/conftest.py reads the list
OMIT_LISTED = {"FP4JAX_SLOW_TESTS": "omit"}   # tests/conftest.py: the slow runs leave out tests/slow_tests.txt's
                                              # tests, which execute only lines the default suite executes


def _rcfile(out: str) -> str:
  """Coverage's configuration: every process the suite starts measured, and a subprocess's lines under the node id
  of the test that started it (its static context: tests/coverage_by_test.py writes it into the configuration
  that coverage hands each subprocess)."""
  path = os.path.join(out, "coveragerc")
  with open(path, "w") as f:
    f.write("[run]\nparallel = true\npatch = subprocess\n"
            f"context = ${{{coverage_by_test.CONTEXT_ENV}}}\n"
            "source_pkgs = " + ", ".join(PACKAGES) + "\n"
            "source = " + ", ".join(os.path.join(ROOT, d) for d in OTHERS) + "\n"
            "omit = " + ", ".join(os.path.join(ROOT, p) for p in OMIT) + "\n")
  return path


def slow_files(pytest_args: str) -> list[str]:
  """The test files that hold a test ``pytest_args`` selects, sorted."""
  p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *shlex.split(pytest_args)], cwd=ROOT,
                     capture_output=True, text=True, check=False, env=dict(os.environ, **OMIT_LISTED))
  files = sorted({line.split("::")[0] for line in p.stdout.splitlines() if "::" in line})
  if not files:
    raise SystemExit(f"pytest selects no test with {pytest_args!r}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
  return files


def part_of(files: list[str], part: int, parts: int) -> list[str]:
  """Part ``part`` (1-based) of ``parts``: every parts-th file, starting at the part-th."""
  return files[part - 1::parts]


def part_name(part: int, parts: int) -> str:
  return "slow" if parts == 1 else f"slow-{part}-of-{parts}"


def run_suite(name: str, pytest_args: str, out: str, workers: int, by_test: bool = False) -> str:
  """Run one suite under coverage; the path of its JSON report (executed lines per file, and with ``by_test``
  the tests (node ids) that executed each)."""
  data = os.path.join(out, name, ".coverage")
  os.makedirs(os.path.dirname(data), exist_ok=True)
  for stale in os.listdir(os.path.dirname(data)):
    if stale.startswith(".coverage"):
      os.remove(os.path.join(os.path.dirname(data), stale))
  env = dict(os.environ, COVERAGE_FILE=data, COVERAGE_RCFILE=_rcfile(out), **({} if name == "default" else OMIT_LISTED))
  if by_test:   # each test's lines under its node id, and its seconds (tests/coverage_by_test.py)
    env["FP4JAX_COVERAGE_BY_TEST"] = tests_dir = os.path.join(out, name, "tests")
    shutil.rmtree(tests_dir, ignore_errors=True)
  cmd = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-n", str(workers),
         *shlex.split(pytest_args)]
  print(f"{name}: {shlex.join(cmd)}", flush=True)
  status = subprocess.call(cmd, cwd=ROOT, env=env)
  if status not in (0, 1):   # 1: some test failed; its coverage still counts, and the report says so
    raise SystemExit(f"{name}: pytest exited with {status}; no coverage to compare")
  # --keep: each process's data stays beside the combined file, to see which process recorded what
  subprocess.check_call([sys.executable, "-m", "coverage", "combine", "-q", "--keep"], cwd=ROOT, env=env)
  report = os.path.join(out, f"{name}.json")
  subprocess.check_call([sys.executable, "-m", "coverage", "json", "-q", "-o", report,
                         *(["--show-contexts"] if by_test else [])], cwd=ROOT, env=env)
  write_lines(report, os.path.join(out, f"{name}.lines.json"))
  return report


def library_key() -> str:
  """The git trees of fp4jax/, models/ and training/ in the working tree: line numbers compare only between runs
  of the same library code ("+dirty" when it has uncommitted changes)."""
  trees = subprocess.run(["git", "rev-parse", *(f"HEAD:{p}" for p in PACKAGES)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
  dirty = subprocess.run(["git", "status", "--porcelain", "--", *PACKAGES], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
  return " ".join(trees) + (" +dirty" if dirty else "")


def write_lines(report: str, path: str) -> None:
  """The executed lines of fp4jax/, models/ and training/ (tens of KB, kept in results/coverage so that the parts
  of the slow tests add up across machines) with the library's key."""
  with open(path, "w") as f:
    json.dump({"library": library_key(), "files": {k: sorted(v) for k, v in sorted(executed(report).items())}}, f,
              separators=(",", ":"))


def read_lines(paths: dict[str, str]) -> dict[str, dict[str, set[int]]]:
  """{run name: executed lines} of ``write_lines`` files, which must be of one library code."""
  runs, keys = {}, {}
  for name, path in paths.items():
    with open(path) as f:
      data = json.load(f)
    keys[name] = data["library"]
    runs[name] = {k: set(v) for k, v in data["files"].items()}
  if len(set(keys.values())) > 1 or any("+dirty" in k for k in keys.values()):
    raise SystemExit("the runs measured different library code (git trees of " + ", ".join(PACKAGES) + "): "
                     + "; ".join(f"{n}: {k}" for n, k in keys.items())
                     + ". Run every part on one commit (a git worktree pinned at it).")
  return runs


def executed(report: str) -> dict[str, set[int]]:
  """{file relative to the repository: executed line numbers} of a coverage JSON report."""
  with open(report) as f:
    files = json.load(f)["files"]
  rel = {os.path.relpath(os.path.abspath(os.path.join(ROOT, p)), ROOT): v for p, v in files.items()}
  return {p: set(v["executed_lines"]) for p, v in rel.items() if p.split(os.sep)[0] in PACKAGES}


NO_TEST = "(no test)"


def sole_lines(report: str) -> dict[str, int]:
  """{test (node id): how many lines of the report no other test executed} of a ``--by_test`` report,
  largest first; lines whose only context is empty (import time, a test's subprocess) count under NO_TEST, and a
  line that one test and an empty context both executed is nobody's alone."""
  with open(report) as f:
    files = json.load(f)["files"]
  counts: dict[str, int] = {}
  for f in files.values():
    for contexts in f.get("contexts", {}).values():
      tests = {c or NO_TEST for c in contexts}
      if len(tests) == 1:
        (test,) = tests
        counts[test] = counts.get(test, 0) + 1
  return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def test_records(tests_dir: str) -> dict[str, dict]:
  """{node id: {"seconds", "subprocess", "named_subprocesses"}} of the processes of a ``--by_test`` run
  (tests/coverage_by_test.py)."""
  out: dict[str, dict] = {}
  for name in sorted(os.listdir(tests_dir)):
    with open(os.path.join(tests_dir, name)) as f:
      out.update(json.load(f))
  return out


def slow_plan(report: str, records: dict[str, dict], budget_s: float) -> tuple[list[tuple[str, float, str]], float]:
  """Which default tests can move to the slow set with the default suite still executing every line it executes
  now: ([(node id, seconds, its representative)], the seconds left), costliest first, until the tests left take
  at most ``budget_s``.

  A test moves when each line it executes, its subprocesses' included, is also executed by a test that stays, or
  outside any test (import time). Tests that started a subprocess in a run whose subprocess lines carry no test's
  name (records without "named_subprocesses", from before tests/coverage_by_test.py named them) stay, and so do
  tests that execute no measured line (OTHERS widens the measure to the repository's other code) and the files of
  KEEP. The representative is the staying test that executes most of the moved test's lines."""
  with open(report) as f:
    files = json.load(f)["files"]
  lines_of: dict[str, list[tuple[str, str]]] = {t: [] for t in records}
  holders: dict[tuple[str, str], set[str]] = {}
  for path, data in files.items():
    for line, contexts in data.get("contexts", {}).items():
      if "" in contexts:
        continue
      key = (path, line)
      holders[key] = set(contexts)
      for t in contexts:
        lines_of.setdefault(t, []).append(key)
  left = sum(r["seconds"] for r in records.values())
  moved = []
  for test in sorted(records, key=lambda t: -records[t]["seconds"]):
    if left <= budget_s:
      break
    unnamed = records[test]["subprocess"] and not records[test].get("named_subprocesses")
    if (unnamed or test.startswith(KEEP) or not lines_of[test]
        or any(len(holders[k]) < 2 for k in lines_of[test])):
      continue
    for k in lines_of[test]:
      holders[k].discard(test)
    moved.append(test)
    left -= records[test]["seconds"]
  plan = []
  for test in moved:   # the holders left are the tests that stay
    shared: dict[str, int] = {}
    for k in lines_of[test]:
      for t in holders[k]:
        shared[t] = shared.get(t, 0) + 1
    plan.append((test, records[test]["seconds"], max(sorted(shared), key=shared.get)))
  return plan, left


def write_plan(report: str, tests_dir: str, share: float, out: str) -> None:
  """``slow_plan``'s tests, in tests/slow_tests.txt's form, to ``<out>/slow_plan.txt``: a candidate only. What a
  test executes can depend on what ran before it in its process (traced and compiled programs are cached), so a
  plan joins tests/slow_tests.txt only once the default suite with it, run under coverage, executes every line the
  default suite without it executes (docs/PERF.md, "The test suite's time")."""
  records = test_records(tests_dir)
  total = sum(r["seconds"] for r in records.values())
  moved, left = slow_plan(report, records, share * total)
  path = os.path.join(out, "slow_plan.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.write("".join(f"{test}{REPRESENTED_BY}{rep}\n" for test, _, rep in moved))
  print(f"plan: {len(moved)} of {len(records)} default tests to the slow set, {total - left:.0f} of {total:.0f} s "
        f"(the rest: {left:.0f} s), in {path}: verify it before it joins {SLOW_TESTS}")


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


def union(*runs: dict[str, set[int]]) -> dict[str, set[int]]:
  out: dict[str, set[int]] = {}
  for run in runs:
    for f, lines in run.items():
      out.setdefault(f, set()).update(lines)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(ROOT, "results", "coverage"), help="coverage data and reports")
  ap.add_argument("--default", default=SUITES["default"], help="pytest arguments of the default suite")
  ap.add_argument("--slow", default=SUITES["slow"], help="pytest arguments of the slow tests")
  ap.add_argument("--only", choices=("default", "slow"), help="run one of the two (then report if all data is in)")
  ap.add_argument("--parts", type=int, default=1, help="the slow tests' files split into this many parts")
  ap.add_argument("--part", type=int, default=0, help="run only this part of the slow tests (1-based; 0: all)")
  ap.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers")
  ap.add_argument("--report_only", action="store_true", help="compare the JSON reports already in --out")
  ap.add_argument("--by_test", action="store_true",
                  help="record the tests (node ids) that execute each line; write <suite>.sole.txt (the lines each "
                       "test alone reaches)")
  ap.add_argument("--min_share", type=float, default=0.97, help="exit 1 below this share")
  ap.add_argument("--plan", type=float, default=None, metavar="SHARE",
                  help="after a --by_test default run: write <out>/slow_plan.txt, the costliest default tests whose "
                       "every line another default test executes, until the rest take SHARE of the run's seconds "
                       "(a candidate for tests/slow_tests.txt, to verify under coverage first)")
  args = ap.parse_args(argv)
  if not 0 <= args.part <= args.parts:
    ap.error(f"--part={args.part} is not a part of --parts={args.parts}: give 1..{args.parts} (0: every part)")
  os.makedirs(args.out, exist_ok=True)
  parts = {k: part_name(k, args.parts) for k in range(1, args.parts + 1)}
  if not args.report_only:
    if args.only in (None, "default"):
      report = run_suite("default", args.default, args.out, args.workers, args.by_test)
      if args.by_test:
        with open(os.path.join(args.out, "default.sole.txt"), "w") as f:
          f.write("".join(f"{n:6d}  {test}\n" for test, n in sole_lines(report).items()))
    if args.only in (None, "slow"):
      files = slow_files(args.slow) if args.parts > 1 else []
      for k, name in parts.items():
        if args.part in (0, k):
          run_suite(name, args.slow + " " + shlex.join(part_of(files, k, args.parts)), args.out, args.workers)
  if args.plan is not None:
    write_plan(os.path.join(args.out, "default.json"), os.path.join(args.out, "default", "tests"), args.plan,
               args.out)
  reports = {name: os.path.join(args.out, f"{name}.lines.json") for name in ["default", *parts.values()]}
  missing = [p for p in reports.values() if not os.path.exists(p)]
  if missing:
    print(f"not yet compared: no coverage report at {', '.join(missing)} (run those parts; --parts must match)")
    return 0 if args.only else 1
  runs = read_lines(reports)
  default = runs["default"]
  text, share = compare(default, union(default, *(runs[n] for n in parts.values())))
  print(text)
  with open(os.path.join(args.out, "gap.txt"), "w") as f:
    f.write(text + "\n")
  return 0 if share >= args.min_share else 1


if __name__ == "__main__":
  sys.exit(main())
