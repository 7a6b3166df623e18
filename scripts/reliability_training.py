"""The training pipeline's fault matrix: runs the test files of ``TEST_FILES`` (each with its ``CASES`` table) and
prints the table (case -> verdict) with counts; ``--write`` also puts it into the "Training pipeline" section of
docs/RELIABILITY.md.

  python scripts/reliability_training.py            # about 10 minutes on 2 CPU cores
  python scripts/reliability_training.py --write -n 2

A case whose test passes has the verdict its test asserts (a clear error with its exit code, or the exactly
specified result); a failing test is listed as FAILED with its first error line.
"""
import argparse
import ast
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILE = os.path.join("tests", "test_train_reliability.py")
# The pipeline's cases: the fault matrix (the command line, operations), the checkpoint faults, then the focused
# files with a CASES table of their own (the run record, the optimizer's values, export folders and checkpoint
# files, the sampler's arguments).
TEST_FILES = (TEST_FILE, os.path.join("tests", "test_checkpoint_faults.py"), os.path.join("tests", "test_run_record.py"),
              os.path.join("tests", "test_optim_config.py"), os.path.join("tests", "test_train_data.py"),
              os.path.join("tests", "test_export_folders.py"), os.path.join("tests", "test_sample_args.py"))
DOC = os.path.join(ROOT, "docs", "RELIABILITY.md")
BEGIN, END = "<!-- training-matrix:begin -->", "<!-- training-matrix:end -->"


def run_tests(workers: int) -> dict[str, tuple[str, str]]:
  """{test name: (outcome "passed" | "failed" | "skipped", detail)} from one pytest run."""
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.xml")
    command = [sys.executable, "-m", "pytest", "-q", *TEST_FILES, f"--junitxml={report}", "--durations=5",
               "-m", "not gpu"]  # slow cases too
    if workers > 1:
      command += ["-n", str(workers)]
    subprocess.run(command, cwd=ROOT, check=False)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
      name = case.get("name").split("[")[0]
      if outcomes.get(name, ("",))[0] == "failed":   # a parametrized case fails when one of its params does
        continue
      problem = case.find("failure") if case.find("failure") is not None else case.find("error")
      if problem is not None:
        outcomes[name] = ("failed", (problem.get("message") or "").splitlines()[0][:120] if problem.get("message") else "")
      elif case.find("skipped") is not None:
        outcomes[name] = ("skipped", case.find("skipped").get("message") or "")
      else:
        outcomes[name] = ("passed", "")
  return outcomes


def load_cases() -> dict[str, tuple[str, str, int | None, str]]:
  """CASES of the test files, read without importing them (no JAX start-up): their dict literals, parsed."""
  cases = {}
  for test_file in TEST_FILES:
    with open(os.path.join(ROOT, test_file), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    node = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "CASES" for t in n.targets))
    for key, value in zip(node.keys, node.values):
      text, verdict, code = value.elts
      cases[ast.literal_eval(key)] = (ast.literal_eval(text),
                                      "clear error" if verdict.id == "CLEAR" else "correct result",
                                      ast.literal_eval(code), os.path.basename(test_file))
  return cases


def table(cases, outcomes) -> str:
  counts = {"clear error": 0, "correct result": 0, "skipped": 0, "FAILED": 0}
  rows = ["| # | case | verdict | exit code | test |", "|---|---|---|---|---|"]
  for i, (name, (text, verdict, code, test_file)) in enumerate(cases.items(), 1):
    outcome, detail = outcomes.get(name, ("failed", "not run"))
    shown = verdict if outcome == "passed" else ("skipped: " + detail if outcome == "skipped" else f"FAILED: {detail}")
    counts[verdict if outcome == "passed" else "skipped" if outcome == "skipped" else "FAILED"] += 1
    where = name if test_file == os.path.basename(TEST_FILE) else f"{test_file}::{name}"
    rows.append(f"| {i} | {text} | {shown} | {'' if code is None else code} | `{where}` |")
  head = (f"{len(cases)} cases: {counts['clear error']} clear errors, {counts['correct result']} correct results, "
          f"{counts['skipped']} skipped, {counts['FAILED']} failed; 0 silently wrong and 0 raw tracebacks unless "
          "a case failed. Run on "
          f"{datetime.date.today().isoformat()}, {platform.machine()} {platform.system()}, "
          f"`python scripts/reliability_training.py`.")
  return head + "\n\n" + "\n".join(rows)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="replace the matrix in docs/RELIABILITY.md")
  parser.add_argument("-n", type=int, default=1, help="pytest-xdist workers")
  args = parser.parse_args()
  cases = load_cases()
  text = table(cases, run_tests(args.n))
  print(text)
  if args.write:
    with open(DOC, encoding="utf-8") as f:
      doc = f.read()
    if BEGIN not in doc or END not in doc:
      raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers to replace")
    doc = doc[:doc.index(BEGIN) + len(BEGIN)] + "\n" + text + "\n" + doc[doc.index(END):]
    with open(DOC, "w", encoding="utf-8") as f:
      f.write(doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
