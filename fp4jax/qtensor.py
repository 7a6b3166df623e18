"""QTensor: a quantized tensor as a pytree (data and scales are leaves, the layout is static).

Plain data: the values it represents come from ``fp4jax.dequantize(q)`` (a layer above).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import formats


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A tensor quantized along one axis (1D blocks) or over its last two axes (2D tiles).

  data:  uint8 for nvfp4/mxfp4, two E2M1 codes per byte along ``axis`` (even element in the low
         nibble), so that axis is half as long as in the original tensor; float8_e4m3fn for fp8.
  scale: one per block, blocks laid out like the tensor with the quantized axis divided by the block
         (1D) or the last two axes divided by the tile (2D). float8_e4m3fn (nvfp4), float8_e8m0fnu
         (mxfp4), float32 decode factors (fp8; per-tensor fp8 has shape ()).
  amax:  float32 scalar, the tensor amax the nvfp4 scales were computed with; None otherwise.
  axis:  the quantized axis, stored negative (counted from the end) so added leading dims (vmap)
         keep it valid.
  block: elements per 1D block (16, 32, 128), or None with ``tile`` set, or 0 for per-tensor fp8.
  """

  data: Any
  scale: Any
  amax: Any
  fmt: str
  axis: int
  block: int | None
  tile: tuple[int, int] | None
  dtype: Any
  scale_rule: str | None = None

  def tree_flatten(self):
    return (self.data, self.scale, self.amax), (self.fmt, self.axis, self.block, self.tile,
                                               self.dtype, self.scale_rule)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the original (dequantized) tensor."""
    shape = list(self.data.shape)
    if formats.TABLE[self.fmt].packed:
      shape[self.axis] *= 2
    return tuple(shape)

  @property
  def ndim(self) -> int:
    return len(self.data.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of data, scales and amax: what storing this tensor costs."""
    leaves = [x for x in (self.data, self.scale, self.amax) if x is not None]
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves)


def along_last(data, scale, amax, *, fmt: str, tiled: bool, dtype=jnp.float32) -> QTensor:
  """The QTensor of codes packed along the last axis, in 1D blocks or the format's 2D tiles, as the
  primitives pass them around (amax is dropped for formats without a tensor scale)."""
  spec = formats.TABLE[fmt]
  return QTensor(data, scale, amax if fmt == "nvfp4" else None, fmt, -1,
                 None if tiled else spec.block, spec.tile if tiled else None, dtype)
