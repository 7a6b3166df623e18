"""Recipes: the ``Recipe`` type (which format each GEMM of a linear layer uses, which techniques are
on) and the presets (the paper's NVFP4 recipe, its MXFP4 comparison, the FP8 baseline, plain bf16).

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

Presets and ablations are keywords: ``nvfp4(rht=False)``, ``nvfp4(stochastic_grad=False)``,
``nvfp4(weight_2d=False)``. ``get(name)`` parses the names the training configs use (``NAMES``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from fp4jax import formats

GemmFormat = Literal["nvfp4", "mxfp4", "fp8", "bf16"]   # a name of FORMATS
FORMATS = formats.NAMES + ("bf16",)   # "bf16": the GEMM is not quantized


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Formats and switches of the quantized dot. Hashable, so it can be a static jit argument."""

  fprop: GemmFormat = "nvfp4"
  dgrad: GemmFormat = "nvfp4"
  wgrad: GemmFormat = "nvfp4"
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
    if self.mxfp4_scale_rule not in formats.SCALE_RULES:
      raise ValueError(f"Recipe.mxfp4_scale_rule={self.mxfp4_scale_rule!r}; use 'rceil' or 'floor'")
    if self.out_dtype is not None:
      object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))

  @property
  def quantizes_anything(self) -> bool:
    return any(f != "bf16" for f in (self.fprop, self.dgrad, self.wgrad))

  @property
  def needs_key(self) -> bool:
    """Whether the backward pass draws random bits: stochastic rounding of dy in an FP4 GEMM."""
    return self.stochastic_grad and any(f in formats.FP4 for f in (self.dgrad, self.wgrad))

  def replace(self, **changes) -> "Recipe":
    return dataclasses.replace(self, **changes)


# -------------------------------------------------------------------------------------------------- presets

def nvfp4(**overrides) -> Recipe:
  """Spec §6: NVFP4 everywhere, 16x16 weight tiles, SR on gradients, RHT-16 on wgrad."""
  return Recipe(**{"name": "nvfp4", **overrides})


def mxfp4(**overrides) -> Recipe:
  """MXFP4 (E8M0 scales, blocks of 32, RCEIL) with RHT size 32, as in the paper's comparison."""
  base = dict(fprop="mxfp4", dgrad="mxfp4", wgrad="mxfp4", weight_2d=False, rht_size=32, name="mxfp4")
  return Recipe(**{**base, **overrides})


def fp8(**overrides) -> Recipe:
  """The paper's FP8 baseline: E4M3 with 1x128 blocks (activations, gradients), 128x128 (weights)."""
  base = dict(fprop="fp8", dgrad="fp8", wgrad="fp8", weight_2d=True, stochastic_grad=False, rht=False,
              name="fp8")
  return Recipe(**{**base, **overrides})


def bf16(**overrides) -> Recipe:
  """No quantization: exactly ``lax.dot_general``."""
  base = dict(fprop="bf16", dgrad="bf16", wgrad="bf16", weight_2d=False, stochastic_grad=False, rht=False,
              name="bf16")
  return Recipe(**{**base, **overrides})


_NAMED = {
    "nvfp4": nvfp4,
    "mxfp4": mxfp4,
    "fp8": fp8,
    "bf16": bf16,
    "nvfp4_no_sr": lambda: nvfp4(stochastic_grad=False, name="nvfp4_no_sr"),
    "nvfp4_no_rht": lambda: nvfp4(rht=False, name="nvfp4_no_rht"),
    "nvfp4_no_2d": lambda: nvfp4(weight_2d=False, name="nvfp4_no_2d"),
    # Precision switch variants (spec §6): forward in bf16, backward as the paper's recipe; or all bf16.
    "nvfp4_bf16_fprop": lambda: nvfp4(fprop="bf16", name="nvfp4_bf16_fprop"),
}
NAMES = tuple(_NAMED)


def get(name: str | Recipe) -> Recipe:
  """A recipe from its name (``nvfp4``, ``mxfp4``, ``fp8``, ``bf16``, ``nvfp4_no_sr``, ...)."""
  if isinstance(name, Recipe):
    return name
  try:
    return _NAMED[name]()
  except KeyError:
    raise ValueError(f"unknown recipe {name!r}; choose one of {NAMES}") from None
