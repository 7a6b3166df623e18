"""Packed windows for the document-masking tests: documents of given lengths packed into rows, as the
packer numbers them (``training.data.segment_ids``), and each document's place, to run it alone.

LENGTHS: row 0 holds three documents (starts at 7 and 19: inside the 8- and 16-token chunks and blocks
the tests use, one chunk holding a start of each document), row 1 two (the second starting exactly at 16,
on a chunk's and a key block's boundary)."""
import numpy as np

LENGTHS = ((7, 12, 5), (16, 8))


def segment_ids(lengths=LENGTHS) -> np.ndarray:
  """int32 BxL: each token's document within its row, 0, 1, 2, ..."""
  rows = [np.concatenate([np.full(n, d, np.int32) for d, n in enumerate(row)]) for row in lengths]
  assert len({len(r) for r in rows}) == 1, "every row must hold the same number of tokens"
  return np.stack(rows)


def documents(lengths=LENGTHS) -> list[tuple[int, int, int]]:
  """(row, start, end) of every document."""
  out = []
  for row, ns in enumerate(lengths):
    starts = np.cumsum((0,) + tuple(ns))
    out += [(row, int(s), int(e)) for s, e in zip(starts[:-1], starts[1:])]
  return out


def alone(t, doc):
  """The rows ``doc`` = (row, start, end) of ``t`` (batch-major, then sequence): a batch of one document."""
  row, start, end = doc
  return t[row:row + 1, start:end]
