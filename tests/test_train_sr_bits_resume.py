"""A run recorded with the former default stochastic-rounding stream ("jax"), or before ``config.sr_bits``
existed, resumes with that stream, end to end through ``train_and_evaluate``; a new run records the default."""
import json
import os

import pytest

from configs import shrunken
from training import sharding
from training import trainer

sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)


def _record(workdir):
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def _forget_the_field(workdir):
  """The run's record as a run made before ``sr_bits`` existed wrote it."""
  path = os.path.join(workdir, "config.json")
  record = _record(workdir)
  del record["sr_bits"]
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f)
  history = os.path.join(workdir, "config_history.jsonl")
  with open(history, encoding="utf-8") as f:
    entries = [json.loads(line) for line in f if line.strip()]
  for entry in entries:
    entry["config"].pop("sr_bits", None)
  with open(history, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(e) + "\n" for e in entries)


@pytest.mark.slow
def test_an_old_run_resumes_with_its_stream_and_a_new_one_records_the_default(tmp_path):
  old = str(tmp_path / "old")
  config = shrunken.shrunken_config(steps=3, recipe="nvfp4", halt_after=2, sr_bits="jax")
  assert trainer.train_and_evaluate(config, old)["step"] == 2
  _forget_the_field(old)
  resumed = shrunken.shrunken_config(steps=3, recipe="nvfp4")      # sr_bits not chosen
  assert trainer.train_and_evaluate(resumed, old)["step"] == 3      # no config change refused
  assert _record(old)["sr_bits"] == "jax"

  new = str(tmp_path / "new")
  assert trainer.train_and_evaluate(shrunken.shrunken_config(steps=1, recipe="nvfp4"), new)["step"] == 1
  assert _record(new)["sr_bits"] == "philox"
