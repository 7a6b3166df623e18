"""The training recipe: which format each GEMM of a linear layer uses, and which techniques are on.

A linear layer y = x·W runs three GEMMs (spec §6):
  fprop  y  = x · W        operands x (1x16 along K) and W (16x16 tiles when ``weight_2d``)
  dgrad  dx = dy · Wᵀ      operands dy (1x16 along N, stochastic rounding when ``stochastic_grad``)
                           and the fprop-quantized W, transposed
  wgrad  dW = xᵀ · dy      operands xᵀ and dyᵀ along tokens, each after a random Hadamard transform
                           of size ``rht_size`` when ``rht``; dy with stochastic rounding
Each GEMM has its own format, so the ablations ("this GEMM in bf16") and the precision switch
("forward in bf16 for the last steps") are recipes too.

Where a switch applies: ``weight_2d`` to the formats with 2D tiles (nvfp4 16x16, fp8 128x128; mxfp4
weights are always 1x32 blocks); ``stochastic_grad`` and ``rht`` to the FP4 formats (fp8 GEMMs round
to nearest and skip the RHT, as the paper's FP8 baseline does). ``fp4jax.dot`` implements the recipe.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

Format = Literal["nvfp4", "mxfp4", "fp8", "bf16"]
FORMATS = ("nvfp4", "mxfp4", "fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Formats and switches of the quantized dot. Hashable, so it can be a static jit argument."""

  fprop: Format = "nvfp4"
  dgrad: Format = "nvfp4"
  wgrad: Format = "nvfp4"
  weight_2d: bool = True          # 16x16 weight tiles: fprop and dgrad see the same quantized W
  stochastic_grad: bool = True    # stochastic rounding of dy in dgrad and wgrad
  rht: bool = True                # random Hadamard transform on both wgrad operands
  rht_size: int = 16              # power of two, 2..256
  rht_seed: int | None = None     # None: the spec's fixed sign vector (size 16); else signs from this seed
  mxfp4_scale_rule: Literal["rceil", "floor"] = "rceil"
  out_dtype: Any = None           # None: the result dtype of the inputs (or preferred_element_type)
  name: str = "custom"

  def __post_init__(self):
    for gemm in ("fprop", "dgrad", "wgrad"):
      fmt = getattr(self, gemm)
      if fmt not in FORMATS:
        raise ValueError(f"Recipe.{gemm}={fmt!r} is not a format; use one of {FORMATS}")
    size = self.rht_size
    if not (isinstance(size, int) and 2 <= size <= 256 and size & (size - 1) == 0):
      raise ValueError(f"Recipe.rht_size={size!r} must be a power of two between 2 and 256")
    if self.mxfp4_scale_rule not in ("rceil", "floor"):
      raise ValueError(f"Recipe.mxfp4_scale_rule={self.mxfp4_scale_rule!r}; use 'rceil' or 'floor'")
    if self.out_dtype is not None:
      object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))

  @property
  def quantizes_anything(self) -> bool:
    return any(f != "bf16" for f in (self.fprop, self.dgrad, self.wgrad))

  @property
  def needs_key(self) -> bool:
    """Whether the backward pass draws random bits: stochastic rounding of dy in an FP4 GEMM."""
    return self.stochastic_grad and any(f in ("nvfp4", "mxfp4") for f in (self.dgrad, self.wgrad))

  def replace(self, **changes) -> "Recipe":
    return dataclasses.replace(self, **changes)
