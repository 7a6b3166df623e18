"""The optimizer's values are checked before anything runs: each field's allowed range, one ConfigError (exit 2)
naming the field and the value."""
import math
import os
import subprocess
import sys

import pytest

from configs import tiny
from training import config as config_lib
from training.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLEAR = "clear error"
# test name -> (case, expected verdict, exit code of train.py or None); in docs/RELIABILITY.md's training matrix
CASES = {
    "test_train_py_refuses_a_negative_lr_in_one_line_before_any_step": (
        "--config.optim.lr=-1 (gradient ascent): refused before any step, naming the field and value", CLEAR, 2),
    "test_out_of_range_value_is_refused_naming_the_field_and_value": (
        "config.optim lr, min_lr_ratio, decay_fraction, b1, b2, eps, weight_decay, grad_clip, warmup_steps out of "
        "range (0, negative, inf, NaN, b >= 1): the field, the value, the range", CLEAR, 2),
    "test_unknown_optimizer_field_is_refused": ("config.optim.learning_rate (not a field): the fields listed", CLEAR,
                                                2),
    "test_a_schedule_phase_the_run_cannot_reach_is_refused": (
        "warmup_steps >= steps, or a wsd warmup and decay longer than the run: the values and the fix", CLEAR, 2),
    "test_a_flag_given_twice_is_refused_naming_both_values": (
        "--config.steps=10 --config.steps=20 (a flag given twice): both values, before anything runs", CLEAR, 2),
}


def _checked(**optim):
  config = tiny.get_config()
  for name, value in optim.items():
    config.optim[name] = value
  config_lib.check_optim(config.optim)


BAD = [("lr", -1.0), ("lr", 0.0), ("lr", math.inf), ("lr", math.nan), ("min_lr_ratio", -0.1),
       ("min_lr_ratio", 1.5), ("decay_fraction", 1.2), ("b1", 1.0), ("b1", -0.1), ("b2", 1.0), ("b2", 1.5),
       ("eps", 0.0), ("eps", -1e-8), ("weight_decay", -0.1), ("grad_clip", 0.0), ("grad_clip", -1.0),
       ("warmup_steps", -1)]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_out_of_range_value_is_refused_naming_the_field_and_value(field, value):
  with pytest.raises(ConfigError, match=rf"config\.optim\.{field}={value!r} must be"):
    _checked(**{field: value})


@pytest.mark.parametrize("optim", [dict(lr=1e-4, b1=0.0, b2=0.0), dict(min_lr_ratio=0.0, weight_decay=0.0),
                                   dict(min_lr_ratio=1.0, decay_fraction=1.0, grad_clip=math.inf)])
def test_edge_values_that_make_sense_pass(optim):
  _checked(**optim)


def test_unknown_optimizer_field_is_refused():
  config = tiny.get_config()
  config.optim.learning_rate = 1e-3
  with pytest.raises(ConfigError, match=r"config\.optim\.learning_rate is not an optimizer field.*'lr'"):
    config_lib.validate(config)


def test_train_py_refuses_a_negative_lr_in_one_line_before_any_step(tmp_path):
  result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/tiny.py",
                           f"--workdir={tmp_path / 'run'}", "--config.optim.lr=-1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "config.optim.lr=-1.0 must be > 0" in result.stderr
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()


def _validated(steps, **optim):
  config = tiny.get_config()
  config.steps = steps
  for name, value in optim.items():
    config.optim[name] = value
  config_lib.validate(config)


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_a_schedule_phase_the_run_cannot_reach_is_refused(schedule):
  with pytest.raises(ConfigError, match=r"warmup_steps=30 >= config.steps=30: the warmup would never reach the peak "
                                        r"lr .* below 30"):
    _validated(30, warmup_steps=30, schedule=schedule)
  if schedule == "wsd":   # 30 warmup + round(0.2 * 35) = 7 decay steps > 35
    with pytest.raises(ConfigError, match=r"warmup_steps=30 and the wsd decay .* 7 steps\) need 37 steps.*"
                                          r"warmup_steps to at most 28, or --config.optim.decay_fraction to at most "
                                          r"0.143"):
      _validated(35, warmup_steps=30, schedule=schedule)
    _validated(35, warmup_steps=28, schedule=schedule)
    _validated(35, warmup_steps=30, decay_fraction=0.143, schedule=schedule)
  else:
    _validated(31, warmup_steps=30, schedule=schedule)
  _validated(1, warmup_steps=0, schedule=schedule)


def test_a_flag_given_twice_is_refused_naming_both_values(tmp_path):
  result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={tmp_path / 'run'}",
                           "--config.steps=10", "--config.recipe", "bf16", "--config.steps=20"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 2, result.stderr[-2000:]
  assert ("error: --config.steps is given twice, '10' and then '20'; give each flag once" in result.stderr)
  assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "run")
