"""Data: the default corpus, user sources, the split, packing, shuffling, per-process shards, iterator state."""
import json

import numpy as np
import pytest
from ml_collections import config_dict

from training import data
from training.config import ConfigError


CLEAR = "clear error"
# The fault matrix's data rows (scripts/reliability_training.py): test name -> (case, verdict, train.py's exit code).
CASES = {
    "test_a_nul_byte_in_a_text_file_is_refused_naming_the_file_and_raw_bytes_reads_it": (
        "a NUL byte inside a text source (it would end a document): the file, the count, the first offset and "
        "config.data.raw_bytes", CLEAR, 3),
    "test_a_binary_file_named_explicitly_is_refused_and_a_jsonl_nul_too": (
        "a PNG named explicitly as a source, a NUL in a JSONL document: refused as not UTF-8 text unless "
        "config.data.raw_bytes", CLEAR, 3),
}


def _data_config(sources="", seq_len=16, fraction=0.1, **kw):
  fields = dict(sources=sources, jsonl_field="text", token_dtype="uint16", tokenizer="byte", seq_len=seq_len,
                validation_fraction=fraction)
  return config_dict.ConfigDict({**fields, **kw})


def _texts(tmp_path, n=40):
  for i in range(n):
    (tmp_path / f"doc{i:02d}.txt").write_text(f"document number {i}: " + "the quick brown fox. " * (i + 3))
  return str(tmp_path / "*.txt")


def test_default_corpus_is_the_standard_library_in_a_fixed_order():
  files = data.stdlib_files()
  assert len(files) > 100 and files == data.stdlib_files()
  assert not any("site-packages" in f for f in files)
  assert all(f.endswith(".py") for f in files)


def test_split_is_by_document_and_stable():
  names = [f"/lib/mod{i}.py" for i in range(5000)]
  val = [n for n in names if data.is_validation(n, 0.1)]
  assert 400 < len(val) < 600
  assert val == [n for n in names if data.is_validation(n, 0.1)]
  assert not any(data.is_validation(n, 0.0) for n in names)


def test_text_files_pack_into_windows_with_document_ends(tmp_path):
  train, val, summary = data.load_splits(_data_config(_texts(tmp_path)), data.ByteTokenizer())
  assert summary["documents"] == 40 and summary["train_windows"] == train.num_windows > 0
  assert val.num_windows > 0
  window = train[0]
  assert window.shape == (17,) and window.dtype == np.int32
  stream = np.concatenate(train.segments + val.segments)
  documents = bytes(stream.astype(np.uint8)).split(b"\0")
  assert len(documents) == 41 and documents[-1] == b""  # 40 documents, each ended by NUL
  assert all(d.startswith(b"document number") for d in documents[:-1])
  assert val.tokens_per_byte == pytest.approx(1.0, abs=0.05)


def test_jsonl_documents(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("\n".join(json.dumps({"text": f"line {i} " * 20, "id": i}) for i in range(50)) + "\n")
  train, val, summary = data.load_splits(_data_config(str(path)), data.ByteTokenizer())
  assert summary["documents"] == 50 and train.num_windows and val.num_tokens
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"body": "x"}) + "\n")
  with pytest.raises(ConfigError, match="jsonl_field"):
    data.load_splits(_data_config(str(bad)), data.ByteTokenizer())


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_pretokenized_files(tmp_path, dtype, suffix):
  tokens = (np.arange(1000) % 251).astype(dtype)
  path = tmp_path / f"tokens{suffix}"
  if suffix == ".npy":
    np.save(path, tokens)
  else:
    tokens.tofile(path)
  config = _data_config(str(path), token_dtype=dtype)
  train, val, _ = data.load_splits(config, data.ByteTokenizer())
  assert train.num_tokens == 900 and val.num_tokens == 100
  np.testing.assert_array_equal(train[1], tokens[17:34])
  assert isinstance(train.segments[-1], np.memmap) or isinstance(train.segments[-1].base, np.memmap)
  assert val.tokens_per_byte is None


def test_token_ids_beyond_the_vocabulary(tmp_path):
  np.save(tmp_path / "t.npy", np.full(100, 300, np.uint16))
  train, _, _ = data.load_splits(_data_config(str(tmp_path / "t.npy")), data.ByteTokenizer())
  with pytest.raises(ConfigError, match="vocab_size"):
    data.check_vocab(train, 256)


def test_single_document_splits_by_position(tmp_path):
  (tmp_path / "one.txt").write_text("abcdefgh" * 200)
  train, val, _ = data.load_splits(_data_config(str(tmp_path / "one.txt")), data.ByteTokenizer())
  assert train.num_tokens + val.num_tokens == 1601 and 150 < val.num_tokens < 170


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ConfigError, match="neither 'byte' nor an existing file"):
    data.make_tokenizer(str(tmp_path / "missing.json"))
  (tmp_path / "vocab.txt").write_text("x")
  with pytest.raises(ConfigError, match="sentencepiece"):
    data.make_tokenizer(str(tmp_path / "vocab.txt"))


def _first_batches(split, n, **kw):
  it = data.batches(split, read_threads=0, prefetch=0, **kw)
  return [next(it) for _ in range(n)]


def test_shuffle_is_deterministic_from_the_seed(tmp_path):
  train, _, _ = data.load_splits(_data_config(_texts(tmp_path)), data.ByteTokenizer())
  kw = dict(global_batch=4, process_index=0, process_count=1)
  a, b, c = (_first_batches(train, 3, seed=s, **kw) for s in (0, 0, 1))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_processes_share_each_global_batch(tmp_path):
  train, _, _ = data.load_splits(_data_config(_texts(tmp_path)), data.ByteTokenizer())
  one = _first_batches(train, 5, global_batch=4, seed=3, process_index=0, process_count=1)
  parts = [_first_batches(train, 5, global_batch=4, seed=3, process_index=p, process_count=2) for p in (0, 1)]
  for step in range(5):
    rows = sorted(map(bytes, np.concatenate([parts[0][step], parts[1][step]]).astype(np.int32)))
    assert rows == sorted(map(bytes, one[step])), step


def test_iterator_state_resumes_exactly(tmp_path):
  train, _, _ = data.load_splits(_data_config(_texts(tmp_path)), data.ByteTokenizer())
  kw = dict(global_batch=4, seed=0, process_index=0, process_count=1, read_threads=1, prefetch=4)
  it = data.batches(train, **kw)
  for _ in range(7):  # past an epoch boundary of the small split
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(30)]
  resumed = data.batches(train, **kw)
  resumed.set_state(state)
  assert all(np.array_equal(x, next(resumed)) for x in expected)


def test_bits_per_byte():
  assert data.bits_per_byte(np.log(2), 1.0) == pytest.approx(1.0)
  assert data.bits_per_byte(1.0, None) is None


def test_a_nul_byte_in_a_text_file_is_refused_naming_the_file_and_raw_bytes_reads_it(tmp_path):
  sources = _texts(tmp_path)
  (tmp_path / "doc05.txt").write_bytes(b"half a document\0and the rest " * 20)
  with pytest.raises(data.DataError, match=r"doc05\.txt holds 20 NUL byte\(s\), the first at byte 15.*"
                     r"config\.data\.raw_bytes=True"):
    data.load_splits(_data_config(sources), data.ByteTokenizer())
  _, _, summary = data.load_splits(_data_config(sources, raw_bytes=True), data.ByteTokenizer())
  assert summary["nul_bytes"] == 20 and "20 NUL bytes" in data.describe(summary)


def test_a_binary_file_named_explicitly_is_refused_and_a_jsonl_nul_too(tmp_path):
  png = tmp_path / "figure.png"
  png.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 4)
  with pytest.raises(data.DataError, match=r"figure\.png holds .* not UTF-8 text .*raw_bytes=True"):
    data.load_splits(_data_config(str(png)), data.ByteTokenizer())
  _, _, summary = data.load_splits(_data_config(str(png), raw_bytes=True, fraction=0.0), data.ByteTokenizer())
  assert summary["nul_bytes"] == 3 + 4 and summary["train_tokens"] == png.stat().st_size + 1
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("\n".join(json.dumps({"text": f"line {i} " * 20 + ("\0" if i == 7 else "")}) for i in range(9)))
  with pytest.raises(data.DataError, match=r"docs\.jsonl:8 holds 1 NUL byte"):
    data.load_splits(_data_config(str(jsonl)), data.ByteTokenizer())


class TestDocumentMasking:
  """config.data.document_masking: every window also carries its tokens' documents."""

  def test_segment_ids_count_the_ends_before_each_token(self):
    tokens = np.asarray([5, 6, 0, 7, 0, 0, 8, 9], np.int32)   # the end token belongs to the document it ends
    np.testing.assert_array_equal(data.segment_ids(tokens, 0), [0, 0, 0, 1, 1, 2, 3, 3])
    assert data.segment_ids(tokens, 0).dtype == np.int32

  def test_windows_and_batches_carry_segment_ids_only_when_on(self, tmp_path):
    sources = _texts(tmp_path)
    off, _, summary = data.load_splits(_data_config(sources), data.ByteTokenizer())
    assert isinstance(off[0], np.ndarray) and summary["document_end"] is None
    on, _, summary = data.load_splits(_data_config(sources, document_masking=True), data.ByteTokenizer())
    assert summary["document_end"] == 0 and "documents end at token 0" in data.describe(summary)
    kw = dict(global_batch=4, seed=0, process_index=0, process_count=1)
    for plain, batch in zip(_first_batches(off, 12, **kw), _first_batches(on, 12, **kw)):
      np.testing.assert_array_equal(batch["tokens"], plain)     # the same windows in the same order
      assert batch["segment_ids"].shape == (4, 17) and batch["segment_ids"].dtype == np.int32
      for tokens, ids in zip(batch["tokens"], batch["segment_ids"]):
        np.testing.assert_array_equal(ids, data.segment_ids(tokens, 0))
    stream = np.concatenate([np.asarray(on[i]["tokens"]) for i in range(on.num_windows)])
    assert (stream == 0).sum() > 1   # windows that cross document ends

  def test_a_tokenizer_without_an_end_token_is_refused(self):
    class NoEnd(data.ByteTokenizer):
      name, eos_id = "no-end", None
    with pytest.raises(ConfigError, match="document_masking.*end-of-document"):
      data.load_splits(_data_config(document_masking=True), NoEnd())

  def test_token_files_of_another_tokenizer_are_refused(self, tmp_path):
    np.save(tmp_path / "t.npy", np.full(100, 300, np.uint16))     # GPT-2-like ids under the byte tokenizer
    config = _data_config(str(tmp_path / "t.npy"), document_masking=True)
    with pytest.raises(ConfigError, match="config.data.tokenizer to the tokenizer the token files were made"):
      data.load_splits(config, data.ByteTokenizer())
