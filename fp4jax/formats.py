"""The quantized formats, one row each: every block size, tile, dtype and list of format names in
fp4jax is read from this table (the bottom layer; it imports nothing of fp4jax).

  name    data                        scale (one per block)          block  2D tile     kernels
  nvfp4   uint8, 2 E2M1 codes a byte  float8_e4m3fn, + f32 amax      16     (16, 16)    Pallas
  mxfp4   uint8, 2 E2M1 codes a byte  float8_e8m0fnu                 32     -           Pallas
  fp8     float8_e4m3fn               float32 decode factor          128    (128, 128)  -

"bf16" is not a format here: it is what a recipe names for a GEMM that is not quantized.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  block: int                       # elements per 1D block
  tile: tuple[int, int] | None     # 2D tile (weights), None where the format has none
  data_dtype: Any                  # dtype of QTensor.data
  scale_dtype: Any                 # dtype of QTensor.scale
  packed: bool                     # two 4-bit E2M1 codes per byte along the quantized axis
  has_kernels: bool                # Pallas kernels exist (impl="pallas")


NVFP4 = Format("nvfp4", 16, (16, 16), jnp.uint8, jnp.float8_e4m3fn, packed=True, has_kernels=True)
MXFP4 = Format("mxfp4", 32, None, jnp.uint8, jnp.float8_e8m0fnu, packed=True, has_kernels=True)
FP8 = Format("fp8", 128, (128, 128), jnp.float8_e4m3fn, jnp.float32, packed=False, has_kernels=False)

TABLE = {f.name: f for f in (NVFP4, MXFP4, FP8)}
NAMES = tuple(TABLE)                                             # ("nvfp4", "mxfp4", "fp8")
FP4 = tuple(f.name for f in TABLE.values() if f.packed)          # ("nvfp4", "mxfp4")
KERNEL_FORMATS = tuple(f.name for f in TABLE.values() if f.has_kernels)
BLOCK = {f.name: f.block for f in TABLE.values()}
TILE = {f.name: f.tile for f in TABLE.values() if f.tile is not None}
SCALE_DTYPE = {f.name: f.scale_dtype for f in TABLE.values()}
SCALE_RULES = ("rceil", "floor")                                 # MXFP4 E8M0 scale rules


def tile_side(fmt: str, tiled: bool) -> int | None:
  """The side of ``fmt``'s square 2D tiles when ``tiled``, else None (1D blocks)."""
  return TILE[fmt][0] if tiled else None
