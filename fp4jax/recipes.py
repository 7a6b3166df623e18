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
``nvfp4(weight_2d=False)``, ``nvfp4(row_scaled_activation=True)`` (one amax per token of the fprop
activation); ``mxfp8()`` is MXFP8 on all three GEMMs. Beyond the paper (docs/RECIPES.md): ``nvfp4(four_over_six="all")`` (Four
Over Six block scales), ``quartet2()`` (MS-EDEN backward), ``tetrajet2()`` (double-block scales). ``get(name)`` parses the names the training configs use (``NAMES``).
A recipe that rounds stochastically draws its rounding bits one philox4x32-10 per 16 elements
(``sr_bits="philox"``, the default), one threefry2x32 per 8 (``"packed"``) or, with ``sr_bits="jax"``, one per
element, as ``jax.random.bits`` does (``fp4jax.random_bits``; docs/NUMERICS.md): the same statistics, other bits.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax.numpy as jnp

from fp4jax import formats, random_bits
from fp4jax.numerics import eden, four_over_six as fos
from fp4jax.quantizers import TRANSPOSED, Quantizer, Roles

SCHEMES = ("nvidia", "quartet2", "tetrajet2")

GemmFormat = Literal["nvfp4", "mxfp4", "fp8", "mxfp8", "bf16"]   # a name of FORMATS
FORMATS = formats.NAMES + ("mxfp8", "bf16")   # "bf16": the GEMM is not quantized


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
  # The methods beyond the paper (docs/RECIPES.md): "nvidia" is the paper's recipe above; "quartet2"
  # (MS-EDEN backward with RHT-128) and "tetrajet2" (double-block scales, SR backward with RHT-16)
  # replace its backward pass and ignore weight_2d/stochastic_grad/rht/rht_size.
  scheme: Literal["nvidia", "quartet2", "tetrajet2"] = "nvidia"
  four_over_six: Literal["off", "weights", "activations", "all"] = "off"   # 4/6 block scales, per role
  four_over_six_metric: Literal["mse", "mae"] = "mse"
  four_over_six_bound: int = 256  # E4M3 bound B of the tensor scale (6·B); 448 is plain NVFP4's
  eden_group: int = 128           # Quartet II's EDEN correction per 128 values (16: per block)
  # NVFP4 fprop activations with one float32 amax per row (token) instead of one per tensor; the GEMM's
  # second-level factor is then per output row (docs/NUMERICS.md, "Row-scaled NVFP4 activations").
  row_scaled_activation: bool = False
  # The bits of stochastic rounding (random_bits.SR_BITS): "philox", the default, one philox4x32-10 per 16
  # elements, all 128 bits used; "packed", one threefry2x32 per 8, all 64 bits used; or "jax", the bytes of
  # jax.random.bits (one threefry2x32 per element); the last two for runs recorded with them. Spec §4: the stream is not part of the arithmetic (docs/NUMERICS.md has the cost of each).
  # Where no operand rounds stochastically it draws nothing, and either name is accepted.
  sr_bits: Literal["jax", "packed", "philox"] = random_bits.DEFAULT
  # The backward pass releases dx only together with dw (one optimization barrier: XLA's scheduler cannot run
  # the input gradients through the earlier layers first and keep each layer's weight-gradient operands live
  # until a deferred wgrad GEMM). False leaves them apart: the same values, and a layer's weight gradient,
  # reduced across the devices inside its GEMM, can then be sent during the next layer of a loop over layers
  # (XLA's collective pipeliner does not move a reduction that a barrier reads). docs/TRAINING.md, "Releasing
  # the weight gradients apart".
  release_dx_with_dw: bool = True
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
    for switch in ("weight_2d", "stochastic_grad", "rht", "row_scaled_activation", "release_dx_with_dw"):
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
    check_recipe(self)

  @property
  def quantizes_anything(self) -> bool:
    return any(f != "bf16" for f in (self.fprop, self.dgrad, self.wgrad))

  @property
  def needs_key(self) -> bool:
    """Whether the backward pass draws random bits: stochastic rounding of dy in an FP4 GEMM, or the
    signs and roundings of Quartet II and TetraJet-v2."""
    return roles(self).needs_key

  def replace(self, **changes) -> "Recipe":
    return dataclasses.replace(self, **changes)

  @property
  def roles(self) -> Roles:
    """The six quantizers ``fp4jax.dot`` runs for this recipe (``fp4jax.quantizers``)."""
    return roles(self)


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


def mxfp8(**overrides) -> Recipe:
  """MXFP8 (OCP MX v1.0 elements and blocks, TE's MXFP8 recipe): E4M3 elements with one E8M0 scale per 32
  along each GEMM's contraction, the scale amax_32/448 rounded up to a power of two (``numerics.mxfp8``'s
  "rceil"; its "floor" is OCP's conversion); every operand quantized in the orientation its GEMM reads (no
  transposed reuse), nearest even, no RHT (docs/NUMERICS.md, "MXFP8"). Its GEMMs, dense and grouped, run on
  Blackwell's block-scaled tensor cores with impl="native" (``fp4jax.native``; impl=None once this device's
  proof turns it on)."""
  base = dict(fprop="mxfp8", dgrad="mxfp8", wgrad="mxfp8", weight_2d=False, stochastic_grad=False, rht=False,
              name="mxfp8")
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
    "mxfp8": mxfp8,
    "bf16": bf16,
    "nvfp4_no_sr": lambda: nvfp4(stochastic_grad=False, name="nvfp4_no_sr"),
    "nvfp4_no_rht": lambda: nvfp4(rht=False, name="nvfp4_no_rht"),
    "nvfp4_no_2d": lambda: nvfp4(weight_2d=False, name="nvfp4_no_2d"),
    # Transformer Engine's row_scaled_activation: the fprop activation's amax per row (per token).
    "nvfp4_row_scaled": lambda: nvfp4(row_scaled_activation=True, name="nvfp4_row_scaled"),
    # Precision switch variants (spec §6): forward in bf16, backward as the paper's recipe; or all bf16.
    "nvfp4_bf16_fprop": lambda: nvfp4(fprop="bf16", name="nvfp4_bf16_fprop"),
    # Beyond the paper (docs/RECIPES.md): Four Over Six, Quartet II, TetraJet-v2.
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


# -------------------------------------------------------------------------------------------------- validation

def check_recipe(recipe):
  """Raise a ValueError, at recipe construction, for a combination the methods do not define."""
  if recipe.scheme not in SCHEMES:
    raise ValueError(f"Recipe.scheme={recipe.scheme!r}; use one of {SCHEMES}")
  if recipe.four_over_six not in fos.ROLES:
    raise ValueError(f"Recipe.four_over_six={recipe.four_over_six!r}; use one of {fos.ROLES}")
  fos.check_options(recipe.four_over_six_bound, recipe.four_over_six_metric)
  if recipe.eden_group not in eden.GROUPS:
    raise ValueError(f"Recipe.eden_group={recipe.eden_group!r}; use 128 (the Quartet II reference) or 16 "
                     "(its CUDA kernels)")
  name = recipe.name
  if recipe.row_scaled_activation:
    if recipe.scheme != "nvidia" or recipe.fprop != "nvfp4" or recipe.four_over_six in ("activations", "all"):
      raise ValueError(f"recipe {name!r}: row_scaled_activation=True is one amax per row of the NVFP4 fprop "
                       f"activation; it needs scheme='nvidia', fprop='nvfp4' and no 4/6 on activations (got "
                       f"scheme={recipe.scheme!r}, fprop={recipe.fprop!r}, four_over_six={recipe.four_over_six!r})")
  if recipe.four_over_six != "off":
    if recipe.scheme == "tetrajet2":
      raise ValueError(f"recipe {name!r}: four_over_six={recipe.four_over_six!r} with scheme='tetrajet2': "
                       "TetraJet-v2's double-block format (nvfp4_dbq) has no 4/6 rule; use "
                       "four_over_six='off', or fp4jax.recipes.nvfp4/quartet2 for 4/6")
    if recipe.fprop != "nvfp4":
      raise ValueError(f"recipe {name!r}: four_over_six={recipe.four_over_six!r} needs fprop='nvfp4' (got "
                       f"{recipe.fprop!r}): 4/6 chooses between two E4M3 block scales of NVFP4; MXFP4's "
                       "power-of-two scales and FP8 have no map-to-4 candidate")
    if recipe.scheme == "nvidia" and not {recipe.dgrad, recipe.wgrad} <= {"nvfp4", "bf16"}:
      raise ValueError(f"recipe {name!r}: NVFP4 with 4/6 runs dgrad and wgrad in 'nvfp4' or 'bf16'; got "
                       f"dgrad={recipe.dgrad!r}, wgrad={recipe.wgrad!r}")
  if recipe.scheme != "nvidia":
    method = {"quartet2": "Quartet II", "tetrajet2": "TetraJet-v2"}[recipe.scheme]
    if recipe.fprop not in ("nvfp4", "bf16"):
      raise ValueError(f"recipe {name!r}: {method} runs fprop in 'nvfp4' (or 'bf16'); got {recipe.fprop!r}")
    if recipe.dgrad != "nvfp4" or recipe.wgrad != "nvfp4":
      raise ValueError(f"recipe {name!r}: {method}'s backward pass is its own NVFP4 quantizer; set "
                       f"dgrad='nvfp4' and wgrad='nvfp4' (got {recipe.dgrad!r}, {recipe.wgrad!r})")
    if recipe.weight_2d:
      raise ValueError(f"recipe {name!r}: {method} quantizes the weight in 1x16 blocks along K; set "
                       "weight_2d=False")
  random_bits.check_layout(recipe.sr_bits)


# -------------------------------------------------------------------------------------------------- six quantizers

def _fos(recipe, role):
  """(bound, metric) where Four Over Six is on for ``role`` ("weights" or "activations"), else None."""
  on = recipe.four_over_six in ("all", role)
  return (recipe.four_over_six_bound, recipe.four_over_six_metric) if on else None


def _paper_roles(recipe) -> Roles:
  """The paper's recipe (spec §6), its ablations, MXFP4, FP8, and NVFP4 with 4/6 on some roles."""
  f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad

  def q(fmt, *, tiled=False, stochastic=False, four_over_six=None, rht=False, row_scaled=False):
    if fmt == "bf16":
      return None
    rht = rht and recipe.rht and fmt in formats.FP4
    return Quantizer(fmt, tiled=tiled and recipe.weight_2d and fmt in formats.TILE,
                     stochastic=stochastic and recipe.stochastic_grad and fmt in formats.FP4,
                     four_over_six=four_over_six if fmt == "nvfp4" else None,
                     rht_size=recipe.rht_size if rht else None, rht_seed=recipe.rht_seed if rht else None,
                     scale_rule=recipe.mxfp4_scale_rule if fmt == "mxfp4" else "rceil",
                     row_scaled=row_scaled and fmt == "nvfp4",
                     sr_bits=recipe.sr_bits if stochastic and recipe.stochastic_grad and fmt in formats.FP4
                     else random_bits.DEFAULT)

  fos_w, fos_x = _fos(recipe, "weights"), _fos(recipe, "activations")
  fprop_w = q(f, tiled=True, four_over_six=fos_w)
  shares = fprop_w is not None and fprop_w.tiled and f == d
  align = None
  if recipe.four_over_six != "off":   # 4/6 pads every GEMM as it always has (16, RHT size along M)
    align = (max(16, recipe.rht_size) if recipe.rht else 16, 16, 16)
  return Roles(
      fprop_x=q(f, four_over_six=fos_x, row_scaled=recipe.row_scaled_activation), fprop_w=fprop_w,
      dgrad_dy=q(d, stochastic=True),
      dgrad_w=TRANSPOSED if shares and d != "bf16" else q(d, tiled=True, four_over_six=fos_w),
      wgrad_x=q(g, four_over_six=fos_x, rht=True), wgrad_dy=q(g, stochastic=True, rht=True),
      key_reason="stochastic rounding" if recipe.four_over_six != "off" else None,
      align=align, release_dx_with_dw=recipe.release_dx_with_dw, name=recipe.name)


def _requantizing_roles(recipe) -> Roles:
  """Quartet II and TetraJet-v2: the backward pass re-quantizes the forward's x̂ and ŵ after a random
  Hadamard transform per GEMM (signs from the key), MS-EDEN or DBQ with stochastic rounding."""
  if recipe.scheme == "quartet2":
    def fwd(role):
      return Quantizer("nvfp4", four_over_six=_fos(recipe, role))
    bwd, size, align = Quantizer("nvfp4_eden", eden_group=recipe.eden_group), eden.RHT_SIZE, (128, 16, 128)
    reason = "RHT-128 signs and MS-EDEN scale rounding"
  else:
    def fwd(role):
      return Quantizer("nvfp4_dbq")
    bwd, size, align = Quantizer("nvfp4_dbq", stochastic=True, sr_bits=recipe.sr_bits), 16, (128, 128, 128)
    reason = "RHT-16 signs and stochastic rounding"
  bf16 = recipe.fprop == "bf16"
  return Roles(fprop_x=None if bf16 else fwd("activations"), fprop_w=None if bf16 else fwd("weights"),
               dgrad_dy=bwd, dgrad_w=bwd, wgrad_x=bwd, wgrad_dy=bwd, requantize=True, dgrad_rht=size,
               wgrad_rht=size, key_reason=reason, align=align, release_dx_with_dw=recipe.release_dx_with_dw,
               name=recipe.name)


@functools.lru_cache(maxsize=256)
def roles(recipe: Recipe) -> Roles:
  """The six role quantizers of ``recipe`` (a table, see fp4jax.quantizers)."""
  if recipe.scheme == "nvidia":
    return _paper_roles(recipe)
  return _requantizing_roles(recipe)


def as_recipe(recipe) -> Recipe | Roles:
  """A Recipe (or Roles) from a recipe, a preset's name or a Roles; TypeError for anything else."""
  if isinstance(recipe, str):
    return get(recipe)
  if not isinstance(recipe, (Recipe, Roles)):
    raise TypeError(f"recipe must be an fp4jax.Recipe or a preset name such as 'nvfp4' "
                    f"(one of {NAMES}); got {type(recipe).__name__}")
  return recipe
