"""Table sources: the documents of a Parquet file, an Arrow file, or a Hugging Face ``datasets`` directory.

  ``*.parquet``         read with pyarrow, a row group at a time (``pip install 'fp4jax[arrow]'``)
  ``*.arrow``           an Arrow IPC file or stream (the files ``Dataset.save_to_disk`` writes), memory-mapped
  a saved dataset       a directory ``Dataset.save_to_disk`` wrote (``state.json``, ``dataset_info.json``),
                        read with ``datasets.load_from_disk`` (``pip install 'fp4jax[datasets]'``)

Each row is one document: the string in its ``config.data.text_column`` (default "text"). Rows are read in
their stored order; a document's name (for the train/validation split) is ``<path>:<row>``.
"""
from __future__ import annotations

import os
from typing import Iterator

from training.errors import ConfigError, DataError

TABLE_SUFFIXES = (".parquet", ".arrow")
_SAVED_DATASET = ("state.json", "dataset_info.json")   # what Dataset.save_to_disk writes beside its .arrow files
_SAVED_DATASET_DICT = "dataset_dict.json"              # DatasetDict.save_to_disk: one such directory per split
_ROWS_PER_READ = 1024


def is_saved_dataset(path: str) -> bool:
  """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
  return os.path.isdir(path) and (all(os.path.isfile(os.path.join(path, f)) for f in _SAVED_DATASET)
                                  or os.path.isfile(os.path.join(path, _SAVED_DATASET_DICT)))


def iter_documents(path: str, column: str) -> Iterator[tuple[str, bytes, str]]:
  """(name, UTF-8 bytes, where to point a user) for each row of the table source ``path``."""
  schema, arrays = _saved_dataset(path, column) if os.path.isdir(path) else _arrow_file(path, column)
  pa = _pyarrow(path)
  text_columns = [f.name for f in schema if _is_text(pa, f.type)]
  if column not in schema.names:
    raise DataError(f"config.data.sources: {path} has no column {column!r}; its columns are {schema.names}"
                    f"{f' (text: {text_columns})' if text_columns else ''}. Set config.data.text_column to the one "
                    "that holds the text")
  if column not in text_columns:
    raise DataError(f"config.data.sources: {path}: the column {column!r} holds {schema.field(column).type}, not "
                    f"text; set config.data.text_column to a text column (here: {text_columns or 'none'})")
  row = 0
  try:
    for array in arrays:
      for text in array.to_pylist():
        if text is None:
          raise DataError(f"config.data.sources: {path}, row {row}: the column {column!r} is null; drop or "
                          "fill the row")
        yield f"{path}:{row}", text.encode("utf-8"), f"{path}, row {row}"
        row += 1
  except (OSError, pa.ArrowException) as e:
    raise DataError(f"config.data.sources: cannot read {path} past row {row}: {e}; check that it is complete "
                    "and readable") from None


def _is_text(pa, kind) -> bool:
  return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _pyarrow(path: str):
  try:
    import pyarrow  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ConfigError(f"config.data.sources names {path}, a Parquet or Arrow source; reading it needs the "
                      "'pyarrow' package: pip install 'fp4jax[arrow]'") from None
  return pyarrow


def _arrow_file(path: str, column: str):
  """(schema, an iterator of the text column's arrays) of a Parquet or Arrow file."""
  pa = _pyarrow(path)
  try:
    if path.endswith(".parquet"):
      table = pa.parquet.ParquetFile(path)
      schema = table.schema_arrow
      batches = table.iter_batches(columns=[column], batch_size=_ROWS_PER_READ) if column in schema.names else ()
    else:
      source = pa.memory_map(path)
      try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      except pa.ArrowInvalid:   # not the IPC file format: the stream format (what save_to_disk writes)
        source.seek(0)
        reader = batches = pa.ipc.open_stream(source)
      schema = reader.schema
  except (OSError, pa.ArrowException) as e:
    kind = "a Parquet file" if path.endswith(".parquet") else "an Arrow IPC file or stream"
    raise DataError(f"config.data.sources: cannot read {path} as {kind}: {e}; check that the file is complete "
                    "and readable") from None
  return schema, (batch.column(column) for batch in batches)


def _saved_dataset(path: str, column: str):
  """(schema, an iterator of the text column's arrays) of a ``save_to_disk`` directory."""
  if os.path.isfile(os.path.join(path, _SAVED_DATASET_DICT)):
    splits = sorted(d for d in os.listdir(path) if is_saved_dataset(os.path.join(path, d)))
    raise DataError(f"config.data.sources: {path} is a saved DatasetDict with the splits {splits}; name the "
                    f"directory of one split, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f"config.data.sources names {path}, a directory written by datasets' save_to_disk; reading "
                      "it needs the 'datasets' package: pip install 'fp4jax[datasets]'") from None
  try:
    dataset = datasets.load_from_disk(path)
  except (OSError, ValueError) as e:
    raise DataError(f"config.data.sources: cannot read the saved dataset {path}: {e}; check that save_to_disk "
                    "finished and the directory is readable") from None
  schema = dataset.data.schema
  if column not in schema.names:
    return schema, ()
  arrow = dataset.select_columns([column]).with_format("arrow")
  return schema, (table.column(0) for table in arrow.iter(batch_size=_ROWS_PER_READ))
