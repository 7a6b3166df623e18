"""The attention block's mixer: causal grouped-query attention with a fused QKV projection.

Scores and the value product run through ``jax.nn.dot_product_attention`` (float32 softmax) and are
never quantized; only the ``qkv`` and ``out`` projections follow the precision policy.
The fused QKV weight is KV-group-major, ``D x (K, R + 2, P)``: each KV head's R query heads, its key
and its value are contiguous, so query head h = k R + r uses KV head k, as GQA expects.

Axis legend: B batch, L sequence (queries), S cached keys, D model width, H query heads,
K KV heads, R query heads per KV head (H = K R), P head dim.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from models.config import ModelConfig
from models.layers import linear, residual_std, rope


class Attention(nn.Module):
  """Causal GQA. With ``decode=True`` keys and values go to a "cache" collection sized at init."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    B, L, D = x_BxLxD.shape
    H, K, P = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    R = H // K
    qkv_BxLxKxR2xP = linear(self, "qkv", K * (R + 2) * P, ("embed", "qkv"), config=cfg,
                            recipe=self.recipe)(x_BxLxD).reshape(B, L, K, R + 2, P)
    q_BxLxHxP = qkv_BxLxKxR2xP[:, :, :, :R].reshape(B, L, H, P)
    k_BxLxKxP = qkv_BxLxKxR2xP[:, :, :, R]
    v_BxLxKxP = qkv_BxLxKxR2xP[:, :, :, R + 1]
    q_BxLxHxP = nn.with_logical_constraint(
        q_BxLxHxP, ("activation_batch", "activation_seq", "activation_heads", "activation_head_dim"))
    kv_axes = ("activation_batch", "activation_seq", "activation_kv_heads", "activation_head_dim")
    k_BxLxKxP = nn.with_logical_constraint(k_BxLxKxP, kv_axes)
    v_BxLxKxP = nn.with_logical_constraint(v_BxLxKxP, kv_axes)

    use_cache = self.decode and self.has_variable("cache", "cache_index")
    cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32)) if self.decode else None
    start = cache_index.value if use_cache else 0
    positions_BxL = jnp.broadcast_to(start + jnp.arange(L, dtype=jnp.int32), (B, L))
    if cfg.rope:
      q_BxLxHxP = rope(q_BxLxHxP, positions_BxL, cfg.rope_theta)
      k_BxLxKxP = rope(k_BxLxKxP, positions_BxL, cfg.rope_theta)

    attend = lambda q, k, v, **kw: jax.nn.dot_product_attention(
        q, k, v, implementation=cfg.attention_impl, **kw)
    if not self.decode:
      o_BxLxHxP = attend(q_BxLxHxP, k_BxLxKxP, v_BxLxKxP, is_causal=True)
    else:
      # At init the cache is created with the call's length as the maximum decode length.
      zeros = lambda: jnp.zeros((B, L, K, P), cfg.dtype)
      cached_key = self.variable("cache", "cached_key", zeros)
      cached_value = self.variable("cache", "cached_value", zeros)
      if not use_cache:
        o_BxLxHxP = attend(q_BxLxHxP, k_BxLxKxP, v_BxLxKxP, is_causal=True)
      else:
        S = cached_key.value.shape[1]
        k_BxSxKxP = lax.dynamic_update_slice(cached_key.value, k_BxLxKxP.astype(cfg.dtype), (0, start, 0, 0))
        v_BxSxKxP = lax.dynamic_update_slice(cached_value.value, v_BxLxKxP.astype(cfg.dtype), (0, start, 0, 0))
        cached_key.value, cached_value.value = k_BxSxKxP, v_BxSxKxP
        cache_index.value = start + L
        visible_LxS = jnp.arange(S)[None, :] <= positions_BxL[0][:, None]
        o_BxLxHxP = attend(q_BxLxHxP, k_BxSxKxP.astype(q_BxLxHxP.dtype), v_BxSxKxP.astype(q_BxLxHxP.dtype),
                           mask=visible_LxS[None, None])
    o_BxLxHxP = nn.with_logical_constraint(
        o_BxLxHxP, ("activation_batch", "activation_seq", "activation_heads", "activation_head_dim"))
    return linear(self, "out", D, ("heads", "embed"), config=cfg, recipe=self.recipe,
                  std=residual_std(cfg))(o_BxLxHxP.reshape(B, L, H * P))
