"""training/report.py's start-up phase lines: XLA's C++ warnings (written straight to file descriptor 2) never
land inside a ``compiling ... 41.2 s`` line when that output and fd 2 go to one place (a terminal, 2>&1)."""
import io
import os

from training import report as report_lib


def _reporter(tmp_path, stream):
  return report_lib.Reporter(str(tmp_path), total_steps=1, tokens_per_step=1, log_every=1, stream=stream)


def test_an_xla_phase_ends_its_line_before_a_warning_on_the_same_file(tmp_path, capfd):
  with os.fdopen(os.dup(2), "w") as stream:   # writes where fd 2 does
    reporter = _reporter(tmp_path, stream)
    with reporter.phase("reading the data"):
      pass
    with reporter.phase("compiling the train step", xla=True, hint="cached"):
      os.write(2, b"W0000 spmd_partitioner.cc] [SPMD] a warning\n")
    reporter.close(draw=False)
  lines = capfd.readouterr().err.splitlines()
  assert lines[0].startswith("reading the data ... ") and lines[0].endswith(" s"), lines
  assert lines[1:3] == ["compiling the train step ...", "W0000 spmd_partitioner.cc] [SPMD] a warning"], lines
  assert lines[3].startswith("compiling the train step ... ") and lines[3].endswith(" s  (cached)"), lines
  float(lines[3].split()[-3])


def test_elsewhere_a_phase_stays_one_line(tmp_path):
  stream = io.StringIO()
  reporter = _reporter(tmp_path, stream)
  try:
    with reporter.phase("compiling the train step", xla=True):
      raise ValueError("no")
  except ValueError:
    pass
  reporter.close(draw=False)
  (line,) = stream.getvalue().splitlines()
  assert line.startswith("compiling the train step ... failed after ") and line.endswith(" s"), line
