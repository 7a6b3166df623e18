"""The precision policy: which linear layers run the recipe's quantized dot, decided from the path.

One decision, ``layer_precision``: a linear layer named in ``QUANTIZABLE_LAYERS`` inside block i
runs the recipe unless block i is one of the config's first ``bf16_first_blocks`` or last
``bf16_last_blocks``; everything else (embedding, LM head, norms, SSM scan and its parameters,
attention score/value products) is never a quantized dot. ``dot_general_cls`` turns the decision
into the ``dot_general_cls`` of ``nn.Dense``; it is the only place that imports ``fp4jax.flax``.
``outcontrol_ratio`` says which layers TetraJet-v2's OutControl applies to (``config.outcontrol_ratio > 0``
and a quantized layer of a tetrajet2 recipe) and with what ratio.

A leaf of ``models``: it imports only ``models.config`` (and fp4jax's public API); the report that
lists every layer's decision, ``describe_linear_layers``, builds the model and lives in ``models.report``.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

from fp4jax import Recipe, recipes
from models.config import ModelConfig

# MoE blocks: experts/up, experts/down and shared_experts/up, /down end in "up"/"down"; the router never.
QUANTIZABLE_LAYERS = ("in_proj", "out_proj", "qkv", "out", "gate", "up", "down", "fc1_latent_proj",
                      "fc2_latent_proj")
_BLOCK = re.compile(r"blocks_(\d+)")


def _path_tuple(path: str | Sequence[str]) -> tuple[str, ...]:
  return tuple(path.split("/")) if isinstance(path, str) else tuple(str(p) for p in path)


def block_index(path: str | Sequence[str]) -> int | None:
  """The block a parameter/module path belongs to (``blocks_<i>`` element), or None."""
  for part in _path_tuple(path):
    match = _BLOCK.fullmatch(part)
    if match:
      return int(match.group(1))
  return None


def layer_precision(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> str:
  """``"bf16"`` for a layer kept in high precision, else the recipe's name (``"nvfp4"``, ...).

  ``path``: the module path of the linear layer, e.g. ``("blocks_3", "mixer", "in_proj")``.
  """
  recipe = recipes.get(recipe)
  parts = _path_tuple(path)
  index = block_index(parts)
  if (index is None or not parts or parts[-1] not in QUANTIZABLE_LAYERS
      or config.is_bf16_block(index) or not recipe.quantizes_anything):
    return "bf16"
  return recipe.name


def dot_general_cls(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> Any:
  """The ``dot_general_cls`` for ``nn.Dense`` at ``path``: None (plain ``lax.dot_general``) for bf16
  layers, else ``partial(fp4jax.flax.Fp4DotGeneral, recipe=recipe)``."""
  recipe = recipes.get(recipe)
  if layer_precision(config, recipe, path) == "bf16":
    return None
  from fp4jax.flax import Fp4DotGeneral  # pylint: disable=g-import-not-at-top  (only quantized runs need it)
  return functools.partial(Fp4DotGeneral, recipe=recipe)


def outcontrol_ratio(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> float:
  """The OutControl ratio of the linear layer at ``path``: ``config.outcontrol_ratio`` for a layer that runs
  a tetrajet2 recipe's quantized dot, else 0.0 (no OutControl). The layer then puts
  ``fp4jax.outcontrol.k8(in_features, ratio)`` input channels in MXFP8 (a multiple of 128; 0 below 128)."""
  recipe = recipes.get(recipe)
  if not config.outcontrol_ratio or recipe.scheme != "tetrajet2" or layer_precision(config, recipe, path) == "bf16":
    return 0.0
  return config.outcontrol_ratio
