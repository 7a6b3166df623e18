"""The MLP block's mixer: squared ReLU (Nemotron-H) or SwiGLU, no biases.

Axis legend: B batch, L sequence, D model width, F MLP width.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax import fused, prequantized
from models import scopes
from models.config import ModelConfig
from models.layers import fused_activation_recipe, linear, residual_std

_ACT = ("activation_batch", "activation_seq", "activation_mlp")


class MLP(nn.Module):
  """relu2: ``down(relu(up(x))²)``; swiglu: ``down(silu(gate(x)) * up(x))``."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False   # unused; every mixer takes it

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    dense = lambda name, features, axes, **kw: linear(self, name, features, axes, config=cfg,
                                                      recipe=self.recipe, **kw)
    up_BxLxF = dense("up", cfg.mlp_dim, ("embed", "mlp"))(x_BxLxD)
    down_recipe = fused_activation_recipe(cfg, self.recipe, (*self.path, "down"))
    if down_recipe is not None and cfg.mlp_kind == "relu2":   # relu² and the down projection's fprop quantize
      h = fused.relu2_quantize(up_BxLxF, down_recipe)           # in one pass (the kernel or its XLA twin)
      h = dataclasses.replace(h, x=nn.with_logical_constraint(h.x, _ACT))
      return dense("down", cfg.d_model, ("mlp", "embed"), std=residual_std(cfg))(h)
    gate_BxLxF = dense("gate", cfg.mlp_dim, ("embed", "mlp"))(x_BxLxD) if cfg.mlp_kind == "swiglu" else None
    with scopes.part("mlp_act"):
      if cfg.mlp_kind == "relu2":
        h_BxLxF = jnp.square(jax.nn.relu(up_BxLxF))
      else:
        h_BxLxF = jax.nn.silu(gate_BxLxF) * up_BxLxF
      h_BxLxF = nn.with_logical_constraint(h_BxLxF, _ACT)
      if down_recipe is not None:   # SwiGLU quantized for the down projection where it is made
        h_BxLxF = prequantized.prequantize(h_BxLxF, down_recipe)
    return dense("down", cfg.d_model, ("mlp", "embed"), std=residual_std(cfg))(h_BxLxF)
