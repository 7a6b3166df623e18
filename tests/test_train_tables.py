"""Table sources (training.tables): Parquet and Arrow files and datasets' save_to_disk directories give the
documents a JSONL file of the same texts gives, through the same windows and resumable grain iterator; the
errors name the columns there are and the package to install."""
import json
import sys

import numpy as np
import pytest
from ml_collections import config_dict

from training import data
from training.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(60)]


def _config(sources, fraction=0.0, **kw):
  return config_dict.ConfigDict(dict(dict(sources=sources, jsonl_field="text", text_column="text",
                                          token_dtype="uint16", tokenizer="byte", seq_len=16,
                                          validation_fraction=fraction), **kw))


def _write(tmp_path, kind, texts=TEXTS, column="body"):
  """The texts as a ``kind`` source with the text in ``column`` (and an int column ``id``); its path."""
  table = pa.table({"id": list(range(len(texts))), column: texts})
  if kind == "parquet":
    path = tmp_path / "docs.parquet"
    pq.write_table(table, path, row_group_size=7)     # several row groups
  elif kind == "arrow_file":
    path = tmp_path / "docs.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
      writer.write_table(table, max_chunksize=11)
  elif kind == "arrow_stream":
    path = tmp_path / "docs.arrow"
    with pa.ipc.new_stream(path, table.schema) as writer:
      writer.write_table(table, max_chunksize=11)
  else:
    path = tmp_path / "saved"
    datasets.Dataset(table).save_to_disk(str(path))
  return str(path)


@pytest.mark.parametrize("kind", ["parquet", "arrow_file", "arrow_stream", "saved_dataset"])
def test_a_table_source_reads_like_the_same_texts_in_jsonl(tmp_path, kind):
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  expected, _, expected_summary = data.load_splits(_config(str(jsonl)), data.ByteTokenizer())
  train, _, summary = data.load_splits(_config(_write(tmp_path, kind), text_column="body"), data.ByteTokenizer())
  assert summary["documents"] == len(TEXTS) and summary["train_tokens"] == expected_summary["train_tokens"]
  assert train.num_windows == expected.num_windows > 20
  assert all(np.array_equal(train[i], expected[i]) for i in range(train.num_windows))


def test_table_rows_split_by_name_and_resume_at_the_same_position(tmp_path):
  source = _write(tmp_path, "parquet")
  train, val, _ = data.load_splits(_config(source, fraction=0.2, text_column="body"), data.ByteTokenizer())
  held_out = [i for i in range(len(TEXTS)) if data.is_validation(f"{source}:{i}", 0.2)]
  assert 0 < len(held_out) < len(TEXTS)
  assert val.num_tokens == sum(len(TEXTS[i]) + 1 for i in held_out)   # each document and its end token
  kw = dict(global_batch=4, seed=0, process_index=0, process_count=1, read_threads=1, prefetch=4)
  it = data.batches(train, **kw)
  for _ in range(9):   # past an epoch of the small split
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(20)]
  resumed = data.batches(train, **kw)
  resumed.set_state(state)
  assert all(np.array_equal(x, next(resumed)) for x in expected)


def test_a_directory_holds_table_files_and_saved_datasets(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  parquet = _write(tmp_path / "a", "parquet")
  saved = _write(tmp_path / "b", "saved_dataset")
  assert data.expand_sources(str(tmp_path)) == [parquet, saved]   # the saved dataset's own .arrow files: once
  assert data.expand_sources(str(tmp_path / "b" / "*")) == [saved]


def test_a_missing_or_wrong_column_names_the_columns_there_are(tmp_path):
  source = _write(tmp_path, "parquet")
  with pytest.raises(DataError, match=r"no column 'text'; its columns are \['id', 'body'\] \(text: \['body'\]\)"
                                      ".*config.data.text_column"):
    data.load_splits(_config(source), data.ByteTokenizer())
  with pytest.raises(DataError, match=r"'id' holds int64, not text.*\(here: \['body'\]\)"):
    data.load_splits(_config(source, text_column="id"), data.ByteTokenizer())
  saved = _write(tmp_path, "saved_dataset")
  with pytest.raises(DataError, match=r"saved.* has no column 'text'; its columns are \['id', 'body'\]"):
    data.load_splits(_config(saved), data.ByteTokenizer())


def test_a_null_row_and_a_dataset_dict_are_refused(tmp_path):
  source = _write(tmp_path, "parquet", texts=TEXTS[:5] + [None] + TEXTS[5:])
  with pytest.raises(DataError, match=r"docs.parquet, row 5: the column 'body' is null"):
    data.load_splits(_config(source, text_column="body"), data.ByteTokenizer())
  splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                                 "test": datasets.Dataset.from_dict({"text": TEXTS[:3]})})
  splits.save_to_disk(str(tmp_path / "dict"))
  with pytest.raises(DataError, match=r"a saved DatasetDict with the splits \['test', 'train'\]; name the directory "
                                      r"of one split, e.g. .*dict/test"):
    data.load_splits(_config(str(tmp_path / "dict")), data.ByteTokenizer())
  train, _, _ = data.load_splits(_config(str(tmp_path / "dict" / "train")), data.ByteTokenizer())
  assert train.num_tokens == sum(len(t) + 1 for t in TEXTS)   # each document and its end token


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
  parquet, saved = _write(tmp_path, "parquet"), _write(tmp_path, "saved_dataset")
  monkeypatch.setitem(sys.modules, "datasets", None)
  with pytest.raises(ConfigError, match=r"save_to_disk.*pip install 'fp4jax\[datasets\]'"):
    data.load_splits(_config(saved), data.ByteTokenizer())
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  with pytest.raises(ConfigError, match=r"Parquet or Arrow.*pip install 'fp4jax\[arrow\]'"):
    data.load_splits(_config(parquet, text_column="body"), data.ByteTokenizer())
