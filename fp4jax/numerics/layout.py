"""Blocked views: move the quantized axis last and cut it (or the last two axes) into blocks.

Every format's arithmetic (``fp4jax.nvfp4``, ``mxfp4``, ``fp8``) runs on a view x_blk of shape
(..., NB, B): one block per row. ``Layout`` records how to get there from the tensor and back.
  1D, block B along axis a:   (..., K, ...) -> moveaxis a to -1 -> (..., K/B, B)
  2D, tile (R, C):            (..., M, K) -> (..., M/R, R, K/C, C) -> (..., M/R, K/C, R·C)
  per tensor (fp8):           any shape -> (1, size)
Scales come out shaped like x_blk without its last axis, which is the layout ``QTensor.scale`` uses
for 2D tiles and per-tensor; 1D scales are moved back so the block axis sits where ``axis`` was.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fp4jax.numerics import e2m1


@dataclasses.dataclass(frozen=True)
class Layout:
  shape: tuple[int, ...]
  axis: int                         # non-negative quantized axis
  block: int | None                 # 1D block length; 0 = per tensor; None = 2D tiles
  tile: tuple[int, int] | None

  def to_blocks(self, x):
    if self.block == 0:
      return x.reshape(1, -1)
    if self.tile is not None:
      r, c = self.tile
      *lead, m, k = x.shape
      x = x.reshape(*lead, m // r, r, k // c, c)
      x = jnp.moveaxis(x, -3, -2)   # (..., M/R, K/C, R, C)
      return x.reshape(*lead, m // r, k // c, r * c)
    x = jnp.moveaxis(x, self.axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // self.block, self.block)

  def from_blocks(self, x_blk):
    if self.block == 0:
      return x_blk.reshape(self.shape)
    if self.tile is not None:
      r, c = self.tile
      *lead, m, k = self.shape
      x = x_blk.reshape(*lead, m // r, k // c, r, c)
      return jnp.moveaxis(x, -2, -3).reshape(self.shape)
    x = x_blk.reshape(*x_blk.shape[:-2], x_blk.shape[-2] * x_blk.shape[-1])
    return jnp.moveaxis(x, -1, self.axis)

  def scale_to_storage(self, s_blk):
    """Scales (..., NB) of the blocked view to the QTensor layout."""
    if self.block == 0:
      return s_blk.reshape(())
    if self.tile is not None:
      return s_blk
    return jnp.moveaxis(s_blk, -1, self.axis)

  def scale_from_storage(self, s):
    if self.block == 0:
      return s.reshape(1)
    if self.tile is not None:
      return s
    return jnp.moveaxis(s, self.axis, -1)


def pack_along(codes, axis):
  return jnp.moveaxis(e2m1.pack(jnp.moveaxis(codes, axis, -1)), -1, axis)


def unpack_along(packed, axis):
  return jnp.moveaxis(e2m1.unpack(jnp.moveaxis(packed, axis, -1)), -1, axis)


def pad_to_multiple(a, axis: int, multiple: int):
  """``a`` zero-padded at the end of ``axis`` to a length that is a multiple of ``multiple`` (no copy if it is)."""
  extra = -a.shape[axis] % multiple
  if not extra:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, extra)
  return jnp.pad(a, widths)
