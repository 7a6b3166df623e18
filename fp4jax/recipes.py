"""Preset recipes: the paper's NVFP4 recipe, its MXFP4 comparison, the FP8 baseline, plain bf16.

Ablations are keywords: ``nvfp4(rht=False)``, ``nvfp4(stochastic_grad=False)``,
``nvfp4(weight_2d=False)``. ``get(name)`` parses the names the training configs use.
"""
from __future__ import annotations

from fp4jax.recipe import Recipe


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
