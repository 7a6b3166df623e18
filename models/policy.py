"""The precision policy: which linear layers run the recipe's quantized dot, decided from the path.

One decision, ``layer_precision``: a linear layer named in ``QUANTIZABLE_LAYERS`` inside block i
runs the recipe unless block i is one of the config's first ``bf16_first_blocks`` or last
``bf16_last_blocks``; everything else (embedding, LM head, norms, SSM scan and its parameters,
attention score/value products) is never a quantized dot. ``dot_general_cls`` turns the decision
into the ``dot_general_cls`` of ``nn.Dense``; it is the only place that imports ``fp4jax.flax``.

A leaf of ``models``: it imports only ``models.config`` (and fp4jax's public API); the report that
lists every layer's decision, ``describe_linear_layers``, builds the model and lives in ``models.report``.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

from fp4jax import Recipe, recipes
from models.config import ModelConfig

QUANTIZABLE_LAYERS = ("in_proj", "out_proj", "qkv", "out", "gate", "up", "down")
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

