"""Small shared pieces: RMSNorm, the policy-aware linear layer, rotary embeddings.

Axis legend: B batch, L sequence, D model width, H heads, P head dim.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import policy
from models.config import ModelConfig


class RMSNorm(nn.Module):
  """``x / rms(x) * scale`` over the last axis, computed in float32, returned in ``dtype``."""

  eps: float = 1e-5
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x_xD: jax.Array) -> jax.Array:
    scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                         (x_xD.shape[-1],), self.param_dtype)
    x_xD = x_xD.astype(jnp.float32)
    x_xD = x_xD * jax.lax.rsqrt(jnp.mean(jnp.square(x_xD), axis=-1, keepdims=True) + self.eps)
    return (x_xD * scale_D.astype(jnp.float32)).astype(self.dtype)


def residual_std(config: ModelConfig) -> float:
  """Init std of projections that write into the residual stream (GPT-2 / Megatron scaling)."""
  return config.init_std / math.sqrt(2 * config.n_blocks)


def linear(parent: nn.Module, name: str, features: int, kernel_axes: Sequence[str], *,
           config: ModelConfig, recipe: Any, std: float | None = None) -> nn.Dense:
  """A bias-free ``nn.Dense`` child of ``parent`` whose dot_general the precision policy picks.

  Call inside ``parent``'s compact method; the policy sees the layer's full module path.
  """
  return nn.Dense(
      features, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype,
      kernel_init=nn.with_logical_partitioning(
          nn.initializers.normal(config.init_std if std is None else std), tuple(kernel_axes)),
      dot_general_cls=policy.dot_general_cls(config, recipe, (*parent.path, name)),
      name=name)


def rope(x_BxLxHxP: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (rotate-half form), computed in float32."""
  P = x_BxLxHxP.shape[-1]
  inv_freq_P2 = theta ** (-jnp.arange(0, P, 2, dtype=jnp.float32) / P)
  angle_BxLxP2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_P2
  sin_BxLx1xP2, cos_BxLx1xP2 = jnp.sin(angle_BxLxP2)[:, :, None], jnp.cos(angle_BxLxP2)[:, :, None]
  x1, x2 = jnp.split(x_BxLxHxP.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos_BxLx1xP2 - x2 * sin_BxLx1xP2,
                             x2 * cos_BxLx1xP2 + x1 * sin_BxLx1xP2], axis=-1)
  return rotated.astype(x_BxLxHxP.dtype)
