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
``nvfp4(weight_2d=False)``. Beyond the paper (docs/RECIPES.md): ``nvfp4(four_over_six="all")`` (Four
Over Six block scales), ``quartet2()`` (MS-EDEN backward), ``tetrajet2()`` (double-block scales). ``get(name)`` parses the names the training configs use (``NAMES``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from fp4jax import formats, schemes

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
  # The methods beyond the paper (fp4jax.schemes): "nvidia" is the paper's recipe above; "quartet2"
  # (MS-EDEN backward with RHT-128) and "tetrajet2" (double-block scales, SR backward with RHT-16)
  # replace its backward pass and ignore weight_2d/stochastic_grad/rht/rht_size.
  scheme: Literal["nvidia", "quartet2", "tetrajet2"] = "nvidia"
  four_over_six: Literal["off", "weights", "activations", "all"] = "off"   # 4/6 block scales, per role
  four_over_six_metric: Literal["mse", "mae"] = "mse"
  four_over_six_bound: int = 256  # E4M3 bound B of the tensor scale (6·B); 448 is plain NVFP4's
  eden_group: int = 128           # Quartet II's EDEN correction per 128 values (16: per block)
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
    for switch in ("weight_2d", "stochastic_grad", "rht"):
      if not isinstance(getattr(self, switch), bool):
        raise TypeError(f"Recipe.{switch}={getattr(self, switch)!r} must be True or False")
    if self.rht_seed is not None and (isinstance(self.rht_seed, bool) or not isinstance(self.rht_seed, int)):
      raise TypeError(f"Recipe.rht_seed={self.rht_seed!r} must be an int or None (the spec's signs)")
    if self.out_dtype is not None:
      try:
        object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))
      except TypeError:
        raise TypeError(f"Recipe.out_dtype={self.out_dtype!r} is not a dtype; use None, jnp.float32 "
                        "or jnp.bfloat16") from None
    schemes.check_recipe(self)

  @property
  def quantizes_anything(self) -> bool:
    return any(f != "bf16" for f in (self.fprop, self.dgrad, self.wgrad))

  @property
  def needs_key(self) -> bool:
    """Whether the backward pass draws random bits: stochastic rounding of dy in an FP4 GEMM, or the
    signs and roundings of Quartet II and TetraJet-v2."""
    return schemes.needs_key(self) or (
        self.stochastic_grad and any(f in formats.FP4 for f in (self.dgrad, self.wgrad)))

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



def quartet2(**overrides) -> Recipe:
  """Quartet II: forward NVFP4 1x16 on x and w with 4/6 (MSE, B = 256; four_over_six="off" for the
  paper sweeps' nearest rounding), backward MS-EDEN after RHT-128 with fresh signs per GEMM on the
  forward-quantized x and w. Every linear layer in FP4."""
  base = dict(scheme="quartet2", four_over_six="all", weight_2d=False, stochastic_grad=False, rht_size=128,
              name="quartet2")
  return Recipe(**{**base, **overrides})


def tetrajet2(**overrides) -> Recipe:
  """TetraJet-v2's linear layer: double-block NVFP4 (FP32 per 1x128, E4M3 per 1x16) forward with
  nearest rounding, backward SR after RHT-16 with fresh signs per GEMM on all four operands, the
  forward-quantized x and w re-quantized. OsciReset and OutControl are separate (fp4jax.osci_reset,
  fp4jax.outcontrol): they need training state."""
  base = dict(scheme="tetrajet2", weight_2d=False, stochastic_grad=True, rht_size=16, name="tetrajet2")
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
    # Beyond the paper (fp4jax.schemes): Four Over Six, Quartet II, TetraJet-v2.
    "nvfp4_4over6": lambda: nvfp4(four_over_six="all", name="nvfp4_4over6"),
    "nvfp4_4over6_mae": lambda: nvfp4(four_over_six="all", four_over_six_metric="mae",
                                      name="nvfp4_4over6_mae"),
    "quartet2": quartet2,
    "quartet2_4over6": lambda: quartet2(name="quartet2_4over6"),
    "quartet2_rtn": lambda: quartet2(four_over_six="off", name="quartet2_rtn"),
    "tetrajet2": tetrajet2,
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
