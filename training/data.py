"""Data: text or token files -> windows of seq_len + 1 tokens -> shuffled, per-process grain batches.

Legend: B batch rows on this process, W = seq_len + 1 window length (inputs ``w[:-1]``, targets ``w[1:]``).

1. Sources (``config.data.sources``, comma-separated): empty means the default corpus, the Python standard
   library's own ``*.py`` files, which every Python install carries (no network). Otherwise paths, globs
   or directories of text files, JSONL files (one document per line, text under ``jsonl_field``), Parquet
   and Arrow files and ``datasets`` ``save_to_disk`` directories (one document per row, text in the column
   ``text_column``; ``training.tables``), and pre-tokenized ``.npy``/``.bin`` token files (uint16/uint32,
   memory-mapped). A document holding a NUL byte is refused, naming the file: text never holds one, a
   binary file (an image, an archive) or UTF-16 text nearly always does, and the byte tokenizer's
   end-of-document token is NUL.
   ``config.data.raw_bytes=True`` reads such files as the bytes they are (the count of NUL bytes is reported).
2. Split into train and validation by document, with a hash of the document's name (so adding files never
   moves other documents across the split). A token file is one long document: its tail is validation.
3. Tokenize (UTF-8 bytes by default; or a local ``tokenizers`` JSON / sentencepiece model), join the
   documents with an end-of-document token and cut the stream into non-overlapping windows of W tokens.
4. grain: shuffle the windows from the seed (a new order every epoch), take this process's share of every
   global batch, batch. The iterator's state (``get_state()``) is a small dict saved with each checkpoint.

Document masking (``config.data.document_masking``): each window also carries ``segment_ids`` (int32, W),
the index of each token's document within the window, 0, 1, 2, ...; a document ends with the tokenizer's
end-of-document token, which belongs to it, and the next starts after it. A batch is then
``{"tokens": tokens_BxW, "segment_ids": segment_ids_BxW}`` (``training.step``). Off, a batch is ``tokens_BxW``.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import sysconfig
from typing import Iterator

import grain
import numpy as np

from training import tables
from training.errors import ConfigError, DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text", ".tex", ".html", ".c", ".h")
TOKEN_SUFFIXES = (".npy", ".bin")
TOKEN_DTYPES = ("uint16", "uint32")
_VOCAB_SCAN_LIMIT = 1 << 24  # token files: check ids against the vocabulary over the first 16M tokens


# --------------------------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
  """UTF-8 bytes are the tokens (vocab 256); NUL, which text files never contain, ends a document."""
  name = "byte"
  vocab_size = 256
  eos_id = 0

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


class HFTokenizer:
  """A local Hugging Face ``tokenizers`` JSON file (``pip install tokenizers``)."""

  def __init__(self, path: str):
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ConfigError(f"config.data.tokenizer={path!r} needs the 'tokenizers' package: "
                        "pip install tokenizers") from None
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.name = os.path.basename(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = next((self._tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
                        if self._tok.token_to_id(t) is not None), None)

  def encode(self, data: bytes) -> np.ndarray:
    return np.asarray(self._tok.encode(data.decode("utf-8", errors="replace")).ids, np.uint32)


class SentencePieceTokenizer:
  """A local sentencepiece ``.model`` file (``pip install sentencepiece``)."""

  def __init__(self, path: str):
    try:
      import sentencepiece  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ConfigError(f"config.data.tokenizer={path!r} needs the 'sentencepiece' package: "
                        "pip install sentencepiece") from None
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.name = os.path.basename(path)
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode(self, data: bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(data.decode("utf-8", errors="replace")), np.uint32)


def make_tokenizer(spec: str):
  """``"byte"``, or a path to a ``tokenizers`` JSON (``*.json``) or a sentencepiece model (``*.model``)."""
  if spec == "byte":
    return ByteTokenizer()
  if not os.path.isfile(spec):
    raise DataError(f"config.data.tokenizer={spec!r} is neither 'byte' nor an existing file")
  if spec.endswith(".json"):
    return HFTokenizer(spec)
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec)
  raise ConfigError(f"config.data.tokenizer={spec!r}: use 'byte', a tokenizers '.json' file or a "
                    "sentencepiece '.model' file")


# ------------------------------------------------------------------------------------------------ sources

def stdlib_files() -> list[str]:
  """The standard library's ``*.py`` files in a fixed order (site-packages excluded)."""
  root = sysconfig.get_paths()["stdlib"]
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
    found.extend(os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))
  return found


def expand_sources(sources: str) -> list[str]:
  """Files named by a comma-separated list of paths, globs and directories, in a deterministic order."""
  if not sources.strip() or sources.strip() == "stdlib":
    files = stdlib_files()
    if not files:
      raise DataError(f"the default corpus is empty: no *.py files under {sysconfig.get_paths()['stdlib']}; "
                      "set config.data.sources to your text files")
    return files
  files = []
  for item in (s.strip() for s in sources.split(",")):
    if not item:
      continue
    item = os.path.expanduser(item)
    if any(c in item for c in "*?["):
      matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p) or tables.is_saved_dataset(p))
      if not matched:
        raise DataError(f"config.data.sources: the pattern {item!r} matches no files")
      files.extend(matched)
    elif os.path.isdir(item):
      matched = []
      for folder, dirs, names in os.walk(item):
        if tables.is_saved_dataset(folder):   # one source, read whole by datasets
          matched.append(folder)
          dirs[:] = []
          continue
        dirs.sort()
        matched.extend(os.path.join(folder, n) for n in sorted(names)
                       if n.endswith(TEXT_SUFFIXES + TOKEN_SUFFIXES + tables.TABLE_SUFFIXES + (".jsonl",)))
      if not matched:
        raise DataError(f"config.data.sources: the directory {item!r} holds no text, .jsonl, .parquet, .arrow, "
                        ".npy or .bin files, nor a saved dataset")
      files.extend(matched)
    elif os.path.isfile(item):
      files.append(item)
    else:
      raise DataError(f"config.data.sources: {item!r} does not exist; give existing files, globs or "
                      "directories (comma-separated), or leave it empty for the default corpus")
  return files


def is_validation(name: str, fraction: float) -> bool:
  """Whether the document ``name`` belongs to the validation split: a hash, stable across runs and machines."""
  digest = hashlib.sha256(name.encode("utf-8", errors="surrogateescape")).digest()
  return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


def _iter_documents(path: str, jsonl_field: str, text_column: str) -> Iterator[tuple[str, bytes, str]]:
  """(name, UTF-8 bytes, where to point a user) for each document in a text, JSONL or table source."""
  if path.endswith(tables.TABLE_SUFFIXES) or os.path.isdir(path):
    yield from tables.iter_documents(path, text_column)
  elif path.endswith(".jsonl"):
    with open(path, "rb") as f:
      for lineno, line in enumerate(f):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{lineno + 1}: not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get(jsonl_field), str):
          raise DataError(f"{path}:{lineno + 1}: no string field {jsonl_field!r}; set "
                          "config.data.jsonl_field to the field that holds the text")
        yield f"{path}:{lineno}", record[jsonl_field].encode("utf-8"), f"{path}:{lineno + 1}"
  else:
    with open(path, "rb") as f:
      yield path, f.read(), path


def check_text(name: str, data: bytes, raw_bytes: bool) -> int:
  """The number of NUL bytes in the document ``name``; a DataError when it holds any and ``raw_bytes`` is off."""
  count = data.count(b"\0")
  if count and not raw_bytes:
    first = data.index(b"\0")
    raise DataError(
        f"config.data.sources: {name} holds {count} NUL byte(s), the first at byte {first}, so it is "
        "not UTF-8 text (a binary file such as an image or an archive, or UTF-16 text); the byte tokenizer would "
        "read each NUL as an end of document. Remove it from config.data.sources, convert it to UTF-8 text, or "
        "set config.data.raw_bytes=True to train on its bytes as they are")
  return count


def _load_token_file(path: str, bin_dtype: str) -> np.ndarray:
  if path.endswith(".npy"):
    tokens = np.load(path, mmap_mode="r")
    if tokens.dtype.name not in TOKEN_DTYPES or tokens.ndim != 1:
      raise DataError(f"{path}: a token file must be 1-D uint16 or uint32, not {tokens.dtype}{tokens.shape}")
    return tokens
  if bin_dtype not in TOKEN_DTYPES:
    raise ConfigError(f"config.data.token_dtype={bin_dtype!r}; use one of {TOKEN_DTYPES}")
  if os.path.getsize(path) % np.dtype(bin_dtype).itemsize:
    raise DataError(f"{path}: {os.path.getsize(path)} bytes is not a whole number of {bin_dtype} tokens; "
                    "check config.data.token_dtype")
  if os.path.getsize(path) == 0:
    return np.zeros((0,), bin_dtype)
  return np.memmap(path, dtype=bin_dtype, mode="r")


# ------------------------------------------------------------------------------------------ token storage

@dataclasses.dataclass
class Split:
  """One split: token segments (arrays or memmaps) cut into windows of W tokens, and its byte count. With
  ``document_end`` (document masking) an item is ``{"tokens": W, "segment_ids": W}``, else the W tokens."""
  segments: list[np.ndarray]
  window: int
  text_bytes: int = 0      # UTF-8 bytes of the text behind the tokens (0 for token files: unknown)
  document_end: int | None = None   # the end-of-document token id whose windows carry segment ids

  def __post_init__(self):
    counts = [len(s) // self.window for s in self.segments]
    self._starts = np.cumsum([0] + counts)

  @property
  def num_tokens(self) -> int:
    return sum(len(s) for s in self.segments)

  @property
  def num_windows(self) -> int:
    return int(self._starts[-1])

  @property
  def tokens_per_byte(self) -> float | None:
    return self.num_tokens / self.text_bytes if self.text_bytes else None

  def __len__(self) -> int:
    return self.num_windows

  def __getitem__(self, index: int) -> np.ndarray | dict[str, np.ndarray]:
    seg = int(np.searchsorted(self._starts, index, side="right")) - 1
    offset = (index - int(self._starts[seg])) * self.window
    tokens_W = np.asarray(self.segments[seg][offset:offset + self.window], np.int32)
    if self.document_end is None:
      return tokens_W
    return {"tokens": tokens_W, "segment_ids": segment_ids(tokens_W, self.document_end)}


def segment_ids(tokens_W: np.ndarray, document_end: int) -> np.ndarray:
  """int32 W: each token's document within the window, counting the end-of-document tokens before it (the
  end token belongs to the document it ends)."""
  ends_W = (tokens_W == document_end).astype(np.int32)
  return np.concatenate([[0], np.cumsum(ends_W[:-1], dtype=np.int32)]).astype(np.int32)


def _join(docs: list[np.ndarray], eos_id: int | None, dtype) -> np.ndarray:
  if not docs:
    return np.zeros((0,), dtype)
  if eos_id is not None:
    eos = np.asarray([eos_id], dtype)
    docs = [piece for doc in docs for piece in (doc.astype(dtype, copy=False), eos)]
  return np.concatenate(docs).astype(dtype, copy=False)


def document_end(data_config, tokenizer) -> int | None:
  """The end-of-document token whose windows carry segment ids with ``document_masking``, else None."""
  if not data_config.get("document_masking", False):
    return None
  if tokenizer.eos_id is None:
    raise ConfigError(f"config.data.document_masking finds each document's end at the tokenizer's end-of-document "
                      f"token, and the tokenizer {tokenizer.name!r} has none (<|endoftext|>, </s>, <eos> or "
                      "<|end_of_text|>); use a tokenizer that has one, or set config.data.document_masking=False")
  return int(tokenizer.eos_id)


def _check_token_file_ends(path: str, tokens: np.ndarray, tokenizer) -> None:
  """Document masking reads a token file's document ends as the tokenizer's end-of-document id: refused
  when the file holds ids past the tokenizer's vocabulary (made with another tokenizer)."""
  head = np.asarray(tokens[:_VOCAB_SCAN_LIMIT])
  if head.size and int(head.max()) >= tokenizer.vocab_size:
    raise ConfigError(
        f"config.data.document_masking: the token file {path} holds token id {int(head.max())}, past the "
        f"vocabulary of the tokenizer {tokenizer.name!r} ({tokenizer.vocab_size}), so its documents do not end "
        f"with that tokenizer's end-of-document id {tokenizer.eos_id}; set config.data.tokenizer to the "
        "tokenizer the token files were made with, or set config.data.document_masking=False")


def load_splits(data_config, tokenizer) -> tuple[Split, Split, dict]:
  """Reads every source once: (train split, validation split, summary)."""
  window = data_config.seq_len + 1
  fraction = data_config.validation_fraction
  end = document_end(data_config, tokenizer)
  files = expand_sources(data_config.sources)
  token_dtype = np.uint8 if tokenizer.vocab_size <= 256 else (
      np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
  docs = []             # (split, tokens, bytes) in reading order
  segments = {"train": [], "validation": []}
  raw_bytes = bool(data_config.get("raw_bytes", False))
  nul_bytes = 0
  for path in files:
    if path.endswith(TOKEN_SUFFIXES):
      try:
        tokens = _load_token_file(path, data_config.token_dtype)
      except ConfigError:
        raise
      except (OSError, ValueError) as e:  # unreadable, or not a .npy file
        raise DataError(f"config.data.sources: cannot read the token file {path!r}: {e}; check that it exists, "
                        "is readable, and is a 1-D .npy or raw .bin of config.data.token_dtype") from None
      if end is not None:
        _check_token_file_ends(path, tokens, tokenizer)
      cut = len(tokens) - int(round(fraction * len(tokens)))
      segments["train"].append(tokens[:cut])
      segments["validation"].append(tokens[cut:])
      continue
    try:
      for name, data, where in _iter_documents(path, data_config.jsonl_field,
                                               data_config.get("text_column", "text")):
        nul_bytes += check_text(where, data, raw_bytes)
        if data:
          split = "validation" if is_validation(name, fraction) else "train"
          docs.append((split, tokenizer.encode(data), len(data)))
    except OSError as e:
      raise DataError(f"config.data.sources: cannot read {path!r}: {e.strerror or e}; check that the file "
                      "exists and is readable by this user") from None
  if not docs and not any(len(s) for s in segments["train"] + segments["validation"]):
    raise DataError(f"the corpus is empty: {len(files)} file(s) from config.data.sources="
                    f"{data_config.sources!r} hold no text or tokens")
  splits = {s for s, _, _ in docs}
  if fraction > 0 and docs and len(splits) == 1:
    # Too few documents to split by document: the tail of the token stream is validation instead.
    stream = _join([t for _, t, _ in docs], tokenizer.eos_id, token_dtype)
    cut = len(stream) - int(round(fraction * len(stream)))
    total_bytes = sum(n for _, _, n in docs)
    joined = {"train": stream[:cut], "validation": stream[cut:]}
    text_bytes = {"train": round(total_bytes * cut / len(stream))}
    text_bytes["validation"] = total_bytes - text_bytes["train"]
  else:
    joined = {k: _join([t for s, t, _ in docs if s == k], tokenizer.eos_id, token_dtype)
              for k in ("train", "validation")}
    text_bytes = {k: sum(n for s, _, n in docs if s == k) for k in ("train", "validation")}
  num_docs = len(docs) + len(segments["train"])
  for k in text_bytes:  # bits per byte are only known for text: not when token files are mixed in
    if any(len(seg) for seg in segments[k]):
      text_bytes[k] = 0
  train = Split([joined["train"]] + segments["train"], window, text_bytes["train"], end)
  validation = Split([joined["validation"]] + segments["validation"], window, text_bytes["validation"], end)
  if train.num_windows == 0:
    raise DataError(f"config.data.seq_len={data_config.seq_len} is larger than the training data: "
                    f"{train.num_tokens} tokens make no window of seq_len + 1 = {window} tokens; lower "
                    "seq_len or add data")
  summary = dict(files=len(files), documents=num_docs, tokenizer=tokenizer.name,
                 vocab_size=tokenizer.vocab_size, train_tokens=train.num_tokens,
                 validation_tokens=validation.num_tokens, train_windows=train.num_windows,
                 validation_windows=validation.num_windows, nul_bytes=nul_bytes, document_end=end)
  return train, validation, summary


def check_vocab(split: Split, vocab_size: int) -> None:
  """Token ids must index the model's embedding (token files are checked over their first 16M tokens)."""
  for seg in split.segments:
    head = np.asarray(seg[:_VOCAB_SCAN_LIMIT])
    if head.size and int(head.max()) >= vocab_size:
      raise DataError(f"the data holds token id {int(head.max())} but the model's vocab_size is {vocab_size}; "
                      "set config.model.vocab_size (or use the tokenizer the token files were made with)")


# --------------------------------------------------------------------------------------------- pipelines

def batches(split: Split, *, global_batch: int, seed: int, process_index: int, process_count: int,
            read_threads: int = 1, prefetch: int = 4) -> grain.DatasetIterator:
  """An endless iterator of this process's int32 ``tokens_BxW`` batches (B = global_batch / processes); with
  document masking, ``{"tokens": tokens_BxW, "segment_ids": segment_ids_BxW}``.

  Global batch s is windows ``order[s*G : (s+1)*G]`` of a seeded shuffle (a new one each epoch); process p
  reads the rows ``p, p + P, ...`` of it, so the set of windows in a step does not depend on P.
  """
  local = global_batch // process_count
  ds = grain.MapDataset.source(split).shuffle(seed=seed).repeat()
  ds = ds[process_index::process_count].batch(local, drop_remainder=True)
  options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
  return iter(ds.to_iter_dataset(options))


def eval_batches(split: Split, *, global_batch: int, num_batches: int, seed: int, process_index: int,
                 process_count: int) -> list[np.ndarray]:
  """A fixed list of validation batches (a seeded sample of windows; windows repeat if the split is small)."""
  it = batches(split, global_batch=global_batch, seed=seed + 1, process_index=process_index,
               process_count=process_count, read_threads=0, prefetch=0)
  return [next(it) for _ in range(num_batches)]


def bits_per_byte(loss_nats: float, tokens_per_byte: float | None) -> float | None:
  """Validation loss in bits per UTF-8 byte of text (None when the bytes are unknown: token files)."""
  if tokens_per_byte is None or not math.isfinite(loss_nats):
    return None
  return loss_nats * tokens_per_byte / math.log(2)


def describe(summary: dict) -> str:
  return (f"{summary['documents']} documents in {summary['files']} files; tokenizer {summary['tokenizer']} "
          f"(vocab {summary['vocab_size']}); train {summary['train_tokens']:,} tokens "
          f"({summary['train_windows']:,} windows), validation {summary['validation_tokens']:,} tokens"
          + (f"; config.data.raw_bytes: {summary['nul_bytes']:,} NUL bytes in the text files" if summary.get(
              "nul_bytes") else "")
          + (f"; document masking: documents end at token {summary['document_end']}"
             if summary.get("document_end") is not None else ""))


__all__ = ["ByteTokenizer", "Split", "batches", "bits_per_byte", "check_text", "check_vocab", "document_end",
           "eval_batches", "expand_sources", "is_validation", "load_splits", "make_tokenizer", "segment_ids",
           "stdlib_files"]
