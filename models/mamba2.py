"""The Mamba-2 block's mixer: in_proj -> causal depthwise conv -> SSD scan -> gated RMSNorm -> out_proj.

  z, x, B, C, dt = in_proj(u)                 one GEMM, G-major: each group's z, x, B, C, dt are adjacent
  x, B, C = silu(conv1d(x, B, C))             depthwise, causal, width W, over time
  dt = softplus(dt + dt_bias);  A = -exp(A_log)
  y = SSD(x, dt, A, B, C) + D x               ``models.ssd``; float32
  out = out_proj(rmsnorm_per_group(y * silu(z)))
Only in_proj and out_proj follow the precision policy; the conv, the scan and A_log, D, dt_bias and
the norm stay in high precision. With ``decode=True`` the last W-1 conv inputs and the SSM state live
in the "cache" collection; one token uses ``ssd_step``, several (a prompt) the chunked scan.

Axis legend: B batch, L sequence, D model width, G groups, R SSM heads per group, H SSM heads (G R),
P SSM head dim, N state size, E conv channels (G (R P + 2 N)), W conv width, I inner width (H P).
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import remat, ssd, ssd_pallas
from models.config import ModelConfig
from models.layers import linear, residual_std


def _dt_bias_init(config: ModelConfig):
  """softplus(dt_bias) log-uniform in [dt_min, dt_max], as Mamba-2 initializes it."""
  def init(key, shape, dtype):
    log_dt = jax.random.uniform(key, shape, jnp.float32, math.log(config.dt_min), math.log(config.dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)   # inverse softplus
  return init


def _a_log_init(config: ModelConfig):
  def init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, *config.a_init_range)).astype(dtype)
  return init


def causal_conv1d(x_BxLxE, weight_WxE, bias_E=None, state_BxW1xE=None):
  """Depthwise causal conv: out[t] = sum_k w[k] x[t - (W-1) + k]; ``state`` holds the W-1 inputs
  before x (zeros when None). Returns ``(out_BxLxE, new_state_BxW1xE)``, the last W-1 inputs."""
  B, L, E = x_BxLxE.shape
  W = weight_WxE.shape[0]
  if state_BxW1xE is None:
    state_BxW1xE = jnp.zeros((B, W - 1, E), x_BxLxE.dtype)
  padded_BxL1xE = jnp.concatenate([state_BxW1xE.astype(x_BxLxE.dtype), x_BxLxE], axis=1)
  out_BxLxE = sum(weight_WxE[k] * padded_BxL1xE[:, k:k + L] for k in range(W))
  if bias_E is not None:
    out_BxLxE = out_BxLxE + bias_E
  return out_BxLxE, padded_BxL1xE[:, L:]


class Mamba2(nn.Module):
  """Mamba-2 mixer with grouped B/C, scalar A per head, D skip and gated group-wise RMSNorm."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, u_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    B, L, D = u_BxLxD.shape
    G, N, P, W = cfg.n_groups, cfg.d_state, cfg.ssm_head_dim, cfg.conv_width
    H = cfg.ssm_n_heads
    R = H // G
    E = cfg.conv_dim
    f32 = jnp.float32
    param = lambda name, init, shape, axes: self.param(
        name, nn.with_logical_partitioning(init, axes), shape, cfg.param_dtype)

    zxbcdt_BxLxGxF = linear(self, "in_proj", cfg.in_proj_dim, ("embed", "ssm_in"), config=cfg,
                            recipe=self.recipe)(u_BxLxD).reshape(B, L, G, -1)
    z_BxLxGxRP, xbc_BxLxGxEg, dt_BxLxGxR = jnp.split(zxbcdt_BxLxGxF, [R * P, 2 * R * P + 2 * N], axis=-1)

    # Depthwise causal conv over x, B, C (float32), with the cached inputs when decoding.
    bound = 1.0 / math.sqrt(W)
    uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
    conv_w_WxE = param("conv_weight", uniform, (W, E), ("conv_width", "ssm_conv"))
    conv_b_E = param("conv_bias", uniform, (E,), ("ssm_conv",)) if cfg.conv_bias else None
    use_cache = self.decode and self.has_variable("cache", "ssm_state")
    if self.decode:
      conv_state = self.variable("cache", "conv_state", jnp.zeros, (B, W - 1, E), f32)
      ssm_state = self.variable("cache", "ssm_state", jnp.zeros, (B, H, P, N), f32)
    xbc_BxLxE, new_conv_state_BxW1xE = causal_conv1d(
        xbc_BxLxGxEg.reshape(B, L, E).astype(f32), conv_w_WxE.astype(f32),
        None if conv_b_E is None else conv_b_E.astype(f32), conv_state.value if use_cache else None)
    xbc_BxLxGxEg = jax.nn.silu(xbc_BxLxE).reshape(B, L, G, -1)
    x_BxLxGxRP, b_BxLxGxN, c_BxLxGxN = jnp.split(xbc_BxLxGxEg, [R * P, R * P + N], axis=-1)
    x_BxLxHxP = nn.with_logical_constraint(
        x_BxLxGxRP.reshape(B, L, H, P),
        ("activation_batch", "activation_seq", "activation_ssm_heads", "activation_head_dim"))

    dt_bias_H = param("dt_bias", _dt_bias_init(cfg), (H,), ("ssm_heads",))
    a_log_H = param("A_log", _a_log_init(cfg), (H,), ("ssm_heads",))
    d_H = param("D", nn.initializers.ones, (H,), ("ssm_heads",))
    dt_BxLxH = jax.nn.softplus(dt_BxLxGxR.reshape(B, L, H).astype(f32) + dt_bias_H.astype(f32))
    a_H = -jnp.exp(a_log_H.astype(f32))

    if use_cache and L == 1:
      y_BxHxP, state_BxHxPxN = ssd.ssd_step(ssm_state.value, x_BxLxHxP[:, 0], dt_BxLxH[:, 0], a_H,
                                            b_BxLxGxN[:, 0], c_BxLxGxN[:, 0])
      y_BxLxHxP = y_BxHxP[:, None] + d_H.astype(f32)[:, None] * x_BxLxHxP
    else:   # the scan and the D skip: ssd_chunked, or the Pallas kernels (cfg.ssd_impl)
      y_BxLxHxP, state_BxHxPxN = ssd_pallas.ssd(
          x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, chunk_size=cfg.chunk_size,
          d_H=d_H.astype(f32), initial_state_BxHxPxN=ssm_state.value if use_cache else None,
          impl=cfg.ssd_impl, remat_chunks=remat.ssd_chunk_remat(cfg.remat))
    if use_cache:
      conv_state.value, ssm_state.value = new_conv_state_BxW1xE, state_BxHxPxN

    # Gated RMSNorm, normalized per group so tensor-parallel shards of whole groups need no reduction.
    norm_scale_GxRP = param("norm_scale", nn.initializers.ones, (H * P,), ("ssm_inner",)).reshape(G, R * P)
    g_BxLxGxRP = y_BxLxHxP.reshape(B, L, G, R * P) * jax.nn.silu(z_BxLxGxRP.astype(f32))
    g_BxLxGxRP = g_BxLxGxRP * jax.lax.rsqrt(jnp.mean(jnp.square(g_BxLxGxRP), -1, keepdims=True) + cfg.norm_eps)
    g_BxLxI = (g_BxLxGxRP * norm_scale_GxRP.astype(f32)).reshape(B, L, H * P).astype(cfg.dtype)
    return linear(self, "out_proj", D, ("ssm_inner", "embed"), config=cfg, recipe=self.recipe,
                  std=residual_std(cfg))(g_BxLxI)
