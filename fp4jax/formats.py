"""The quantized formats, one row each: every block size, tile, dtype and list of format names in
fp4jax is read from this table (the bottom layer; it imports nothing of fp4jax).

  name        data                       block scale            second level            block tile   kernels
  nvfp4       uint8, 2 E2M1 codes a byte float8_e4m3fn          f32 tensor amax (amax)  16   16x16  Pallas
  nvfp4_eden  uint8, 2 E2M1 codes a byte float8_e4m3fn (SR)     f32 s_dec (scale2)      16   -      -
  nvfp4_dbq   uint8, 2 E2M1 codes a byte float8_e4m3fn          f32 per 1x128 (scale2)  16   -      -
  mxfp4       uint8, 2 E2M1 codes a byte float8_e8m0fnu         -                       32   -      Pallas
  mxfp8       float8_e4m3fn              float8_e8m0fnu         -                       32   -      -
  fp8         float8_e4m3fn              float32 decode factor  -                       128  128x128 -

NVFP4 with Four Over Six is the nvfp4 row with the tensor-scale bound B = 256 (``QTensor.bound``; the
amax maps to 6·B, 6·448 for plain NVFP4). MS-EDEN (Quartet II's backward) is NVFP4 whose block scales
carry the EDEN correction and whose tensor level is stored as the decode scale s_dec; DBQ (TetraJet-v2)
replaces the tensor amax by one float32 scale per 1x128 block. Row-scaled NVFP4 (the precision-policy
issue's activations) is the nvfp4 row with one amax per row, ``QTensor.amax`` of shape (R,).

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
  second: str | None = None        # the second-level scale: "amax" (QTensor.amax), "s_dec" or
                                   # "outer" (QTensor.scale2), None for one level of scales
  outer: int | None = None         # elements per second-level block ("outer")


NVFP4 = Format("nvfp4", 16, (16, 16), jnp.uint8, jnp.float8_e4m3fn, packed=True, has_kernels=True,
               second="amax")
NVFP4_EDEN = Format("nvfp4_eden", 16, None, jnp.uint8, jnp.float8_e4m3fn, packed=True, has_kernels=False,
                    second="s_dec")
NVFP4_DBQ = Format("nvfp4_dbq", 16, None, jnp.uint8, jnp.float8_e4m3fn, packed=True, has_kernels=False,
                   second="outer", outer=128)
MXFP4 = Format("mxfp4", 32, None, jnp.uint8, jnp.float8_e8m0fnu, packed=True, has_kernels=True)
MXFP8 = Format("mxfp8", 32, None, jnp.float8_e4m3fn, jnp.float8_e8m0fnu, packed=False, has_kernels=False)
FP8 = Format("fp8", 128, (128, 128), jnp.float8_e4m3fn, jnp.float32, packed=False, has_kernels=False)

TABLE = {f.name: f for f in (NVFP4, MXFP4, FP8, NVFP4_EDEN, NVFP4_DBQ, MXFP8)}
ALL = tuple(TABLE)
NAMES = ("nvfp4", "mxfp4", "fp8")      # what fp4jax.quantize takes and a Recipe's GEMMs name
FP4 = tuple(f for f in NAMES if TABLE[f].packed)                  # ("nvfp4", "mxfp4")
KERNEL_FORMATS = tuple(f.name for f in TABLE.values() if f.has_kernels)
BLOCK = {f.name: f.block for f in TABLE.values()}
TILE = {f.name: f.tile for f in TABLE.values() if f.tile is not None}
SCALE_DTYPE = {f.name: f.scale_dtype for f in TABLE.values()}
SCALE_RULES = ("rceil", "floor")                                 # MXFP4 E8M0 scale rules
NVFP4_BOUND = 448                                                # plain NVFP4: amax maps to 6·448
BOUNDS = (256, 448)                                              # with Four Over Six: 256


def tile_side(fmt: str, tiled: bool) -> int | None:
  """The side of ``fmt``'s square 2D tiles when ``tiled``, else None (1D blocks)."""
  return TILE[fmt][0] if tiled else None
