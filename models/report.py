"""Reports about a model that need the whole model: ``describe_linear_layers``.

It sits above ``lm`` (it builds the model to read its parameter tree), so ``policy`` stays a leaf that
``layers`` can import.

Counting convention: one linear layer per GEMM weight in a block, with attention's Q, K, V fused into
one ``qkv`` weight as Megatron does. Every block then has two (Mamba in/out, attention qkv/out, relu²
MLP up/down; SwiGLU MLP has three: gate, up, down), so the 12B model has 62 x 2 = 124 and its first 2 +
last 8 blocks keep 20 in bf16 (16.1%), the paper's "20 of 124". The LM head (always bf16) is not counted.
"""
from __future__ import annotations

import flax.linen as nn
from flax import traverse_util

from fp4jax import Recipe
from models.config import ModelConfig
from models.lm import LanguageModel, abstract_variables
from models.policy import block_index, layer_precision


def describe_linear_layers(config: ModelConfig, recipe: Recipe | str
                           ) -> list[tuple[str, str, int, int]]:
  """``[(path, precision, in_dim, out_dim)]`` for every linear layer of every block, by block (names sorted).

  Computed from ``jax.eval_shape`` of the model's init: nothing is allocated, any size works.
  """
  # The parameter tree does not depend on the recipe; shapes come from the always-available bf16 path.
  abstract = abstract_variables(LanguageModel(config, recipe="bf16"))
  rows = []
  for names, leaf in traverse_util.flatten_dict(nn.meta.unbox(abstract["params"])).items():
    if names[-1] != "kernel" or block_index(names) is None:
      continue
    layer = names[:-1]
    in_dim, out_dim = leaf.shape
    rows.append(("/".join(layer), layer_precision(config, recipe, layer), in_dim, out_dim))
  rows.sort(key=lambda row: (block_index(row[0]), row[0]))
  return rows
