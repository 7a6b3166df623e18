"""scripts/coverage_gap.py: the lines only the full suite reaches, and the default suite's share."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import coverage_gap  # noqa: E402  pylint: disable=wrong-import-position
import coverage_by_test  # noqa: E402  pylint: disable=wrong-import-position


def test_compare_lists_the_lines_only_the_full_suite_reaches():
  default = {"fp4jax/a.py": {1, 2, 3}, "models/b.py": {10}}
  full = {"fp4jax/a.py": {1, 2, 3, 4, 5, 9}, "models/b.py": {10}, "training/c.py": {7, 8}}
  text, share = coverage_gap.compare(default, full)
  assert share == pytest.approx(4 / 9)
  assert "default suite: 4 of them (44.44%)" in text
  assert "fp4jax/a.py (3): 4-5, 9" in text and "training/c.py (2): 7-8" in text and "models/b.py" not in text
  assert coverage_gap.compare(full, full)[1] == 1.0


def test_the_slow_parts_split_the_files_and_add_up():
  files = [f"tests/test_{c}.py" for c in "abcdefg"]
  parts = [coverage_gap.part_of(files, k, 3) for k in (1, 2, 3)]
  assert sorted(sum(parts, [])) == files and all(parts)
  assert coverage_gap.part_name(2, 3) == "slow-2-of-3" and coverage_gap.part_name(1, 1) == "slow"
  assert coverage_gap.union({"a.py": {1}}, {"a.py": {2}, "b.py": {3}}) == {"a.py": {1, 2}, "b.py": {3}}


@pytest.mark.slow
def test_two_selections_under_coverage(tmp_path):
  """The whole flow (coverage run with subprocesses, combine, json, compare) on two small selections."""
  one = "tests/test_nan.py::test_abs_max_orders_every_magnitude"
  status = coverage_gap.main(["--out", str(tmp_path), "-n", "1", "--default", one,
                              "--slow", "tests/test_nan.py::test_fused_producers_keep_nan"])
  text = (tmp_path / "gap.txt").read_text()
  assert status == 1 and "fp4jax/fused.py" in text and "fp4jax/numerics/amax.py" not in text


def test_a_subprocess_records_its_lines_under_the_test_that_started_it():
  """Coverage hands a subprocess its configuration already read (``COVERAGE_PROCESS_CONFIG``, with the context
  the parent's environment gave at its start: none), so the plugin writes the test's node id into it."""
  from coverage.config import CoverageConfig   # pylint: disable=import-outside-toplevel
  config = CoverageConfig()
  config.config_file = os.devnull
  env = {"COVERAGE_PROCESS_CONFIG": config.serialize(), "PATH": "/bin"}
  named = coverage_by_test.named(env, "tests/test_x.py::test_y[1]")
  assert CoverageConfig.deserialize(named["COVERAGE_PROCESS_CONFIG"]).context == "tests/test_x.py::test_y[1]"
  assert named[coverage_by_test.CONTEXT_ENV] == "tests/test_x.py::test_y[1]" and named["PATH"] == "/bin"
  assert "COVERAGE_PROCESS_CONFIG" not in coverage_by_test.named({"PATH": "/bin"}, "t")   # not under coverage


def test_sole_lines_counts_what_one_test_function_alone_reaches(tmp_path):
  report = tmp_path / "r.json"
  report.write_text(json.dumps({"files": {
      "fp4jax/a.py": {"executed_lines": [1, 2, 3, 4], "contexts": {
          "1": ["test_a.test_one"], "2": ["test_a.test_one", "test_b.test_two"], "3": ["test_b.test_two"],
          "4": [""]}},
      "models/b.py": {"executed_lines": [7, 8], "contexts": {"7": ["test_a.test_one"], "8": ["", "test_a.test_one"]}}}}))
  assert coverage_gap.sole_lines(str(report)) == {"test_a.test_one": 2, "test_b.test_two": 1, coverage_gap.NO_TEST: 1}


def test_slow_plan_moves_only_tests_whose_lines_stay_executed(tmp_path):
  """a's lines are all b's too, so a moves (costliest first) with b as its representative; b then holds line 1
  alone and stays; c holds line 3 alone; e is in a contract file kept whole. f and g start subprocesses: g's
  subprocess lines carry its name, so g moves like any test; f's run did not name them, so f stays."""
  report = tmp_path / "r.json"
  report.write_text(json.dumps({"files": {"fp4jax/a.py": {"executed_lines": [1, 2, 3, 4, 5], "contexts": {
      "1": ["t.py::a", "t.py::b"], "2": ["t.py::a", "t.py::b", ""], "3": ["t.py::c"],
      "4": ["t.py::d", "t.py::b", coverage_gap.KEEP[0] + "::e"], "5": ["t.py::f", "t.py::g", "t.py::b"]}}}}))
  records = {"t.py::a": {"seconds": 9.0, "subprocess": False}, "t.py::b": {"seconds": 5.0, "subprocess": False},
             "t.py::c": {"seconds": 7.0, "subprocess": False}, "t.py::d": {"seconds": 1.0, "subprocess": False},
             coverage_gap.KEEP[0] + "::e": {"seconds": 8.0, "subprocess": False},
             "t.py::f": {"seconds": 6.0, "subprocess": True},
             "t.py::g": {"seconds": 6.5, "subprocess": True, "named_subprocesses": True}}
  moved, left = coverage_gap.slow_plan(str(report), records, budget_s=0.0)
  assert moved == [("t.py::a", 9.0, "t.py::b"), ("t.py::g", 6.5, "t.py::b"), ("t.py::d", 1.0, "t.py::b")]
  assert left == 26.0
  assert coverage_gap.slow_plan(str(report), records, budget_s=30.0)[0] == [("t.py::a", 9.0, "t.py::b"),
                                                                           ("t.py::g", 6.5, "t.py::b")]


def test_runs_of_different_library_code_are_not_compared(tmp_path):
  paths = {}
  for name, key in (("default", "t1 t2 t3"), ("slow", "t1 t2 t4")):
    paths[name] = tmp_path / f"{name}.lines.json"
    paths[name].write_text(json.dumps({"library": key, "files": {"fp4jax/a.py": [1]}}))
  with pytest.raises(SystemExit, match="different library code"):
    coverage_gap.read_lines({n: str(p) for n, p in paths.items()})
  assert coverage_gap.read_lines({"default": str(paths["default"])}) == {"default": {"fp4jax/a.py": {1}}}
