"""The model's vocabulary from the tokenizer: config.model.vocab_size left unset takes a tokenizer file's size
rounded up to a multiple of 128; a resume keeps the run's; an explicit vocabulary smaller than the tokenizer's
is refused, naming the rounded size."""
import json
import os

import pytest
from ml_collections import config_dict

import train_runs
from training import config as config_lib
from training import run as run_lib
from training import trainer
from training.errors import ConfigError

tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(297)]   # with [UNK], [PAD] and </s>: 300 tokens, not a multiple of 128


def _tokenizer(tmp_path) -> str:
  vocab = {t: i for i, t in enumerate(["[UNK]", "[PAD]", "</s>"] + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  return path


def _corpus(tmp_path) -> str:
  for d in range(8):
    (tmp_path / f"doc{d}.txt").write_text(" ".join(WORDS[(d * 37 + 5 * k) % len(WORDS)] for k in range(200)))
  return str(tmp_path / "doc*.txt")


def test_padded_vocab_size():
  assert [config_lib.padded_vocab_size(n) for n in (1, 128, 129, 300, 50257, 131072)] == [
      128, 128, 256, 384, 50304, 131072]


def test_a_tokenizer_file_sets_the_vocabulary_and_a_resume_keeps_the_recorded_one():
  def config(tokenizer="tok.json", vocab_size=None):
    return config_dict.ConfigDict(dict(model=dict(preset="tiny", vocab_size=vocab_size),
                                       data=dict(tokenizer=tokenizer)))
  cases = [   # (config, the run's record, the tokenizer's size) -> vocab_size
      ((config(), None, 300), 384),                                    # a new run: rounded up
      ((config(vocab_size=512), None, 300), 512),                      # chosen
      ((config(), {"model": {"vocab_size": 640}}, 300), 640),          # resumed: the record's
      ((config(), {"model": {"vocab_size": None}}, 300), None),        # recorded before the default: the preset's
      ((config(tokenizer="byte"), None, 256), None),                   # bytes (or token files): the preset's
  ]
  for (c, recorded, tokens), expected in cases:
    config_lib.keep_recorded_vocab_size(c, recorded, tokens)
    assert c.model.vocab_size == expected, (c, recorded, tokens)


def test_a_run_started_from_another_takes_its_vocabulary(tmp_path):
  (tmp_path / "source").mkdir()
  (tmp_path / "source" / "config.json").write_text(json.dumps({"model": {"vocab_size": 512}}))
  config = config_dict.ConfigDict(dict(model=dict(preset="tiny", vocab_size=None), data=dict(tokenizer="tok.json"),
                                       init_from=str(tmp_path / "source" / "checkpoints")))
  config_lib.keep_recorded_vocab_size(config, run_lib.vocab_record(config, None), 300)
  assert config.model.vocab_size == 512
  own = {"model": {"vocab_size": 640}}   # a resume keeps its own record, not init_from's
  assert run_lib.vocab_record(config, own) is own


def test_a_custom_tokenizer_trains_without_setting_vocab_size(tmp_path):
  workdir = str(tmp_path / "run")
  config = train_runs.run_config(steps=1, **{"data.sources": _corpus(tmp_path), "data.tokenizer": _tokenizer(tmp_path),
                                            "checkpoint.every_steps": 1, "data.validation_fraction": 0.0})
  summary = trainer.train_and_evaluate(config, workdir)
  assert summary["status"] == "done" and summary["step"] == 1
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["model"]["vocab_size"] == 384
  params = train_runs.checkpoint_state(workdir, 1)["params"]
  assert params["embed"]["embedding"].shape == (384, 32)


def test_an_explicit_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
  config = train_runs.run_config(steps=1, **{"data.sources": _corpus(tmp_path), "data.tokenizer": _tokenizer(tmp_path),
                                            "model.vocab_size": 256})
  with pytest.raises(ConfigError, match=r"the tokenizer has 300 tokens but config.model.vocab_size is 256.*"
                                        r"--config.model.vocab_size=384 \(the tokenizer's size rounded up"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
