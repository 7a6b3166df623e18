"""Segment ids: the document of a packed window that each token belongs to (document masking).

``segment_ids_BxL``: int32, non-decreasing along each row, a new value at each document's first token (the
packer numbers a window's documents 0, 1, 2, ...). With them a token attends only to the earlier tokens of
its own document, the Mamba-2 conv reads no input across a document's start and the SSD state restarts
there, and rotary positions count from each document's first token: every document computes as it would
alone. The first token of a window continues what came before it (a decode cache), as without segment ids.

Axis legend: B batch, L sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def starts(segment_ids_BxL: jax.Array) -> jax.Array:
  """bool BxL: True at the first token of every document after the window's first token."""
  changed_BxL1 = segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]
  return jnp.pad(changed_BxL1, [(0, 0), (1, 0)])


def positions(segment_ids_BxL: jax.Array) -> jax.Array:
  """int32 BxL: each token's index within its document (its rotary position)."""
  index_L = jnp.arange(segment_ids_BxL.shape[1], dtype=jnp.int32)
  first_BxL = lax.cummax(jnp.where(starts(segment_ids_BxL), index_L, 0), axis=1)
  return index_L - first_BxL


def check(segment_ids_BxL: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """``segment_ids_BxL`` as int32, refused unless it is an integer array of ``shape`` (B, L)."""
  segment_ids_BxL = jnp.asarray(segment_ids_BxL)
  if segment_ids_BxL.shape != tuple(shape) or not jnp.issubdtype(segment_ids_BxL.dtype, jnp.integer):
    raise ValueError(f"segment_ids_BxL {segment_ids_BxL.dtype}{segment_ids_BxL.shape} must be integers of the "
                     f"tokens' shape {tuple(shape)}: one document id per token, non-decreasing along each row")
  return segment_ids_BxL.astype(jnp.int32)


def continuing(last_B: jax.Array, length: int) -> jax.Array:
  """int32 BxL: ``length`` tokens that all continue the document ``last_B`` (a decode call without ids)."""
  return jnp.broadcast_to(last_B.astype(jnp.int32)[:, None], (last_B.shape[0], length))
