"""The hybrid language model: embedding -> blocks from the pattern string -> RMSNorm -> LM head.

Each block is ``x + mixer(rmsnorm(x))`` with the mixer chosen by the pattern character
(``M`` Mamba-2, ``*`` attention, ``-`` MLP); block i is the module ``blocks_<i>``, and its linear
layers get their dot_general from ``models.policy``. Embedding and LM head are untied and stay in
bf16 (the head accumulates in float32); logits are float32.

Quantized recipes draw stochastic-rounding randomness from the ``"fp4"`` rng stream:
``model.apply(variables, tokens, rngs={"fp4": key})`` (and ``init`` with ``{"params", "fp4"}``).
Decoding: ``cache = init_cache(model, batch, max_len)``, then repeatedly
``logits, mut = model.apply({"params": p, "cache": cache}, tokens_BxT, decode=True, mutable=["cache"])``
with ``cache = mut["cache"]``; a call may feed a whole prompt (T > 1) or one token.

Axis legend: B batch, L sequence, D model width, V vocabulary.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from models.attention import Attention
from models.config import ModelConfig
from models.layers import RMSNorm
from models.mamba2 import Mamba2
from models.mlp import MLP

_MIXERS = {"mamba": Mamba2, "attention": Attention, "mlp": MLP}
_RESIDUAL = ("activation_batch", "activation_seq", "activation_embed")


class Block(nn.Module):
  """Pre-norm residual block: ``x + mixer(norm(x))``."""

  config: ModelConfig
  kind: str
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    h_BxLxD = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="norm")(x_BxLxD)
    h_BxLxD = _MIXERS[self.kind](cfg, self.recipe, self.decode, name="mixer")(h_BxLxD)
    return nn.with_logical_constraint(x_BxLxD + h_BxLxD.astype(x_BxLxD.dtype), _RESIDUAL)


class LanguageModel(nn.Module):
  """``__call__(tokens_BxL int32, *, decode=False) -> logits_BxLxV float32``."""

  config: ModelConfig
  recipe: Any = "bf16"   # an fp4jax.Recipe or a name for fp4jax.recipes.get

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, *, decode: bool = False) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.init_std), ("vocab", "embed")), name="embed")
    x_BxLxD = nn.with_logical_constraint(embed(tokens_BxL).astype(cfg.dtype), _RESIDUAL)
    block_cls = nn.remat(Block) if cfg.remat else Block
    for i, kind in enumerate(cfg.block_kinds):
      x_BxLxD = block_cls(cfg, kind, self.recipe, decode, name=f"blocks_{i}")(x_BxLxD)
    x_BxLxD = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="final_norm")(x_BxLxD)
    logits_BxLxV = nn.Dense(
        cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("embed", "vocab")),
        dot_general=functools.partial(lax.dot_general, preferred_element_type=jnp.float32),
        name="lm_head")(x_BxLxD)
    return nn.with_logical_constraint(logits_BxLxV.astype(jnp.float32),
                                      ("activation_batch", "activation_seq", "activation_vocab"))


def abstract_variables(model: LanguageModel, batch_size: int = 1, length: int = 1, *, decode=False):
  """``jax.eval_shape`` of ``model.init``: the boxed (logically partitioned) variable tree, unallocated."""
  key = jax.random.key(0)
  tokens = jnp.zeros((batch_size, length), jnp.int32)
  return jax.eval_shape(lambda: model.init({"params": key, "fp4": key}, tokens, decode=decode))


def count_params(config: ModelConfig) -> int:
  """Number of parameters, without allocating them."""
  params = abstract_variables(LanguageModel(config))["params"]
  return sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))


def init_cache(model: LanguageModel, batch_size: int, max_len: int):
  """Zeroed decode cache (the "cache" collection) for sequences of up to ``max_len`` tokens."""
  abstract = abstract_variables(model, batch_size, max_len, decode=True)["cache"]
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
