"""Reports about a model that need the whole model: ``describe_linear_layers``, ``precision_summary``.

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
from models import policy
from models.config import ModelConfig
from models.lm import LanguageModel, abstract_variables
from models.policy import block_index


def _linear_kernels(params) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
  """(module path, kernel shape) of every eligible linear layer in a parameter tree (arrays or shapes)."""
  out = []
  for names, leaf in traverse_util.flatten_dict(nn.meta.unbox(params)).items():
    if names[-1] == "kernel" and policy.is_eligible(names[:-1]):
      out.append((names[:-1], tuple(leaf.shape)))
  return out


def describe_linear_layers(config: ModelConfig, recipe: Recipe | str
                           ) -> list[tuple[str, str, int, int]]:
  """``[(path, precision, in_dim, out_dim)]`` for every linear layer, by block (names sorted). precision:
  the layer's recipe name, "bf16", or per GEMM ("fprop bf16/dgrad nvfp4/wgrad nvfp4") where a rule
  overrides single GEMMs (``models.policy.Decision.label``).

  Computed from ``jax.eval_shape`` of the model's init: nothing is allocated, any size works.
  """
  # The parameter tree does not depend on the recipe; shapes come from the always-available bf16 path.
  abstract = abstract_variables(LanguageModel(config.replace(scan_blocks=False), recipe="bf16"))
  rows = []
  for layer, shape in _linear_kernels(abstract["params"]):
    in_dim, out_dim = shape[-2:]
    rows.append(("/".join(layer), policy.layer_precision(config, recipe, layer), in_dim, out_dim))
  rows.sort(key=lambda row: (block_index(row[0]) if block_index(row[0]) is not None else 1 << 30, row[0]))
  return rows


def precision_summary(config: ModelConfig, recipe: Recipe | str, params=None) -> str:
  """One line, e.g. "nvfp4 88 layers, mxfp8 22, bf16 60 (attention, latent, last 14 blocks)": linear layers
  per recipe (per GEMM where a rule splits them), from ``params`` (a scanned group's kernel counts once per
  repetition) or the model's abstract init."""
  if params is None:
    params = abstract_variables(LanguageModel(config.replace(scan_blocks=False), recipe="bf16"))["params"]
  decisions = []
  for layer, shape in _linear_kernels(params):
    repeats = shape[0] if len(shape) == 3 else 1
    decisions += [policy.decide(config, recipe, layer)] * repeats
  return policy.summarize(decisions)
