"""The Mamba-2 block's mixer: in_proj -> causal depthwise conv -> SSD scan -> gated RMSNorm -> out_proj.

  z, x, B, C, dt = in_proj(u)                 one GEMM, G-major: each group's z, x, B, C, dt are adjacent
  x, B, C = silu(conv1d(x, B, C))             depthwise, causal, width W, over time
  dt = softplus(dt + dt_bias);  A = -exp(A_log)
  y = SSD(x, dt, A, B, C) + D x               ``models.ssd``; float32
  out = out_proj(rmsnorm_per_group(y * silu(z)))
Only in_proj and out_proj follow the precision policy; the conv, the scan and A_log, D, dt_bias and
the norm stay in high precision. With ``decode=True`` the last W-1 conv inputs (and their documents) and
the SSM state live in the "cache" collection; one token uses ``ssd_step``, several (a prompt) the chunked
scan. With segment ids (document masking, ``models.segments``) nothing crosses a document's start.

Axis legend: B batch, L sequence, D model width, G groups, R SSM heads per group, H SSM heads (G R),
P SSM head dim, N state size, E conv channels (G (R P + 2 N)), W conv width, I inner width (H P).
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import gated_norm, remat, scopes, segments, ssd, ssd_pallas
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


def _same_document(segment_ids_BxL, other_BxLp, shift):
  """bool BxLx1: ``other[:, shift + t]`` is of token t's document (``segment_ids[:, t]``)."""
  L = segment_ids_BxL.shape[1]
  return (other_BxLp[:, shift:shift + L] == segment_ids_BxL)[..., None]


def causal_conv1d(x_BxLxE, weight_WxE, bias_E=None, state_BxW1xE=None, *, segment_ids_BxL=None,
                  state_segment_ids_BxW1=None):
  """Depthwise causal conv: out[t] = sum_k w[k] x[t - (W-1) + k]; ``state`` holds the W-1 inputs
  before x (zeros when None). Returns ``(out_BxLxE, new_state_BxW1xE)``, the last W-1 inputs.
  ``segment_ids_BxL`` (document masking): a tap reads 0 for an input of another document (the state's
  inputs are of ``state_segment_ids_BxW1``'s documents; None: of the first token's), as the zero state
  a document alone starts from."""
  B, L, E = x_BxLxE.shape
  W = weight_WxE.shape[0]
  if state_BxW1xE is None:
    state_BxW1xE = jnp.zeros((B, W - 1, E), x_BxLxE.dtype)
  padded_BxL1xE = jnp.concatenate([state_BxW1xE.astype(x_BxLxE.dtype), x_BxLxE], axis=1)
  taps = [padded_BxL1xE[:, k:k + L] for k in range(W)]
  if segment_ids_BxL is not None:
    if state_segment_ids_BxW1 is None:
      state_segment_ids_BxW1 = jnp.repeat(segment_ids_BxL[:, :1], W - 1, axis=1)
    padded_BxL1 = jnp.concatenate([state_segment_ids_BxW1.astype(segment_ids_BxL.dtype), segment_ids_BxL], axis=1)
    taps = [jnp.where(_same_document(segment_ids_BxL, padded_BxL1, k), tap, 0.0) for k, tap in enumerate(taps)]
  out_BxLxE = sum(weight_WxE[k] * taps[k] for k in range(W))
  if bias_E is not None:
    out_BxLxE = out_BxLxE + bias_E
  return out_BxLxE, padded_BxL1xE[:, L:]


def conv1d_silu_reference(x_BxLxE, weight_WxE, bias_E=None, segment_ids_BxL=None):
  """silu(causal_conv1d(x)) in float32 from no cached inputs: the ops the mixer runs, differentiated by jax."""
  out_BxLxE, _ = causal_conv1d(x_BxLxE.astype(jnp.float32), weight_WxE.astype(jnp.float32),
                               None if bias_E is None else bias_E.astype(jnp.float32),
                               segment_ids_BxL=segment_ids_BxL)
  return jax.nn.silu(out_BxLxE)


@jax.custom_vjp
def _conv1d_silu(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL):
  return conv1d_silu_reference(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL)


def _conv1d_silu_fwd(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL):
  return (conv1d_silu_reference(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL),
          (x_BxLxE, weight_WxE, bias_E, segment_ids_BxL))


def _conv1d_silu_bwd(res, dy_BxLxE):
  """From the inputs alone: the pre-activation recomputed, d pre = dy · silu'(pre), then with the taps
  s_k[t] = d pre[t + W-1-k] (zero past the end, and with segment ids where t + W-1-k is of another
  document): dx = sum_k w[k] s_k, and dw[k] = sum over (b, t) of x s_k
  with db = sum d pre as one reduction over (B, L) of a (W+1, ...) stack (one pass over d pre and x).
  The taps shift d pre, not x: x's shifted slices are the forward conv's, and XLA would write them out once
  to share them between a rematerialized forward and this backward."""
  # behind a barrier, so that XLA does not share this recomputation with a rematerialized forward's conv
  # (it would write the shared pre-activation and taps out, in the layout the backward's GEMMs want)
  x_BxLxE, weight_WxE, bias_E, segment_ids_BxL = jax.lax.optimization_barrier(res)
  B, L, E = x_BxLxE.shape
  W = weight_WxE.shape[0]
  f32 = jnp.float32
  w_WxE = weight_WxE.astype(f32)
  pre_BxLxE, _ = causal_conv1d(x_BxLxE.astype(f32), w_WxE, None if bias_E is None else bias_E.astype(f32),
                               segment_ids_BxL=segment_ids_BxL)
  sig_BxLxE = jax.nn.sigmoid(pre_BxLxE)
  dpre_BxLxE = dy_BxLxE.astype(f32) * sig_BxLxE * (1 + pre_BxLxE * (1 - sig_BxLxE))
  dpre_BxLWxE = jnp.pad(dpre_BxLxE, [(0, 0), (0, W - 1), (0, 0)])
  taps = [dpre_BxLWxE[:, W - 1 - k:W - 1 - k + L] for k in range(W)]
  if segment_ids_BxL is not None:
    padded_BxLW = jnp.pad(segment_ids_BxL, [(0, 0), (0, W - 1)], mode="edge")
    taps = [jnp.where(_same_document(segment_ids_BxL, padded_BxLW, W - 1 - k), tap, 0.0)
            for k, tap in enumerate(taps)]
  dx_BxLxE = sum(w_WxE[k] * taps[k] for k in range(W))
  x_BxLxE32 = x_BxLxE.astype(f32)
  dwb_W1xE = jnp.sum(jnp.stack([x_BxLxE32 * t for t in taps] + [dpre_BxLxE]), axis=(1, 2))
  db_E = None if bias_E is None else dwb_W1xE[W].astype(bias_E.dtype)
  return dx_BxLxE.astype(x_BxLxE.dtype), dwb_W1xE[:W].astype(weight_WxE.dtype), db_E, None


_conv1d_silu.defvjp(_conv1d_silu_fwd, _conv1d_silu_bwd)

CONV_VJPS = ("autodiff", "recompute")


def conv1d_silu(x_BxLxE, weight_WxE, bias_E=None, *, vjp: str = "autodiff", segment_ids_BxL=None):
  """``silu(causal_conv1d(x, w, b))`` in float32 from no cached inputs (training, a prompt from an empty
  cache); x in any float dtype, its gradient in that dtype. The forward is ``conv1d_silu_reference``'s ops
  (the same bits). ``vjp``: "autodiff" (jax's gradient of those ops; it keeps or rematerializes the
  pre-activation and, in XLA's GPU program, writes the conv's partial sums and each tap's product), "recompute"
  (a custom_vjp that keeps only x, w, b and recomputes the pre-activation in the backward pass: three passes,
  d pre, dx, and (dw, db) together; its gradients differ from autodiff's in the last bits). "recompute" is
  opt-in: the 12B step on 8 H200 predicted it 17 ms slower than "autodiff" (docs/PERF.md, "The 12B step by part, and the conv's gradient").
  ``segment_ids_BxL`` (document masking): no tap reads an input of another document."""
  if vjp not in CONV_VJPS:
    raise ValueError(f"conv vjp={vjp!r}; use one of {CONV_VJPS}")
  if vjp == "autodiff":
    return conv1d_silu_reference(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL)
  return _conv1d_silu(x_BxLxE, weight_WxE, bias_E, segment_ids_BxL)


class Mamba2(nn.Module):
  """Mamba-2 mixer with grouped B/C, scalar A per head, D skip and gated group-wise RMSNorm."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, u_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    """``segment_ids_BxL`` (document masking, ``models.segments``): the conv reads no input of another
    document and the SSD state restarts at each document's first token. Decoding, the cache keeps the
    documents of the conv's cached inputs (``conv_segment_ids``); a call without segment ids continues
    the cache's last document."""
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
    with scopes.part("mamba2_split"):
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
      conv_segments = self.variable("cache", "conv_segment_ids", jnp.zeros, (B, W - 1), jnp.int32)
    if segment_ids_BxL is not None:
      segment_ids_BxL = segments.check(segment_ids_BxL, (B, L))
    if use_cache:   # the call's documents, and whether its first token continues the cached state's
      call_segments_BxL = (segments.continuing(conv_segments.value[:, -1], L) if segment_ids_BxL is None
                           else segment_ids_BxL)
      continues_B = call_segments_BxL[:, 0] == conv_segments.value[:, -1]
    with scopes.part("mamba2_conv_silu"):
      if use_cache:   # decoding: the conv continues from the cached inputs and updates them
        xbc_BxLxE, new_conv_state_BxW1xE = causal_conv1d(
            xbc_BxLxGxEg.reshape(B, L, E).astype(f32), conv_w_WxE.astype(f32),
            None if conv_b_E is None else conv_b_E.astype(f32), conv_state.value,
            segment_ids_BxL=call_segments_BxL, state_segment_ids_BxW1=conv_segments.value)
        xbc_BxLxE = jax.nn.silu(xbc_BxLxE)
      else:
        xbc_BxLxE = conv1d_silu(xbc_BxLxGxEg.reshape(B, L, E), conv_w_WxE, conv_b_E, vjp=cfg.conv_vjp,
                                segment_ids_BxL=segment_ids_BxL)
      xbc_BxLxGxEg = xbc_BxLxE.reshape(B, L, G, -1)
    with scopes.part("mamba2_split"):
      x_BxLxGxRP, b_BxLxGxN, c_BxLxGxN = jnp.split(xbc_BxLxGxEg, [R * P, R * P + N], axis=-1)
    x_BxLxHxP = nn.with_logical_constraint(
        x_BxLxGxRP.reshape(B, L, H, P),
        ("activation_batch", "activation_seq", "activation_ssm_heads", "activation_head_dim"))

    dt_bias_H = param("dt_bias", _dt_bias_init(cfg), (H,), ("ssm_heads",))
    a_log_H = param("A_log", _a_log_init(cfg), (H,), ("ssm_heads",))
    d_H = param("D", nn.initializers.ones, (H,), ("ssm_heads",))
    with scopes.part("mamba2_dt"):
      dt_BxLxH = jax.nn.softplus(dt_BxLxGxR.reshape(B, L, H).astype(f32) + dt_bias_H.astype(f32))
      a_H = -jnp.exp(a_log_H.astype(f32))

    with scopes.part("mamba2_ssd"):
      # decoding: the cached state enters the call's first document only if that is the cached one
      state_in = jnp.where(continues_B[:, None, None, None], ssm_state.value, 0.0) if use_cache else None
      if use_cache and L == 1:
        y_BxHxP, state_BxHxPxN = ssd.ssd_step(state_in, x_BxLxHxP[:, 0], dt_BxLxH[:, 0], a_H,
                                              b_BxLxGxN[:, 0], c_BxLxGxN[:, 0])
        y_BxLxHxP = y_BxHxP[:, None] + d_H.astype(f32)[:, None] * x_BxLxHxP
      else:   # the scan and the D skip: ssd_chunked, or the Pallas kernels (cfg.ssd_impl)
        y_BxLxHxP, state_BxHxPxN = ssd_pallas.ssd(
            x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, chunk_size=cfg.chunk_size,
            d_H=d_H.astype(f32), initial_state_BxHxPxN=state_in, impl=cfg.ssd_impl,
            remat_chunks=remat.ssd_chunk_remat(cfg.remat), segment_ids_BxL=segment_ids_BxL)
    if use_cache:
      conv_state.value, ssm_state.value = new_conv_state_BxW1xE, state_BxHxPxN
      conv_segments.value = jnp.concatenate([conv_segments.value, call_segments_BxL], axis=1)[:, L:]

    # Gated RMSNorm, normalized per group so tensor-parallel shards of whole groups need no reduction.
    norm_scale_GxRP = param("norm_scale", nn.initializers.ones, (H * P,), ("ssm_inner",)).reshape(G, R * P)
    with scopes.part("mamba2_gate_norm"):   # models.gated_norm: its twin, or the kernels (cfg.gate_norm_impl)
      g_BxLxI = gated_norm.gated_norm(y_BxLxHxP.reshape(B, L, G, R * P), z_BxLxGxRP, norm_scale_GxRP,
                                      eps=cfg.norm_eps, out_dtype=cfg.dtype,
                                      impl=cfg.gate_norm_impl).reshape(B, L, H * P)
    return linear(self, "out_proj", D, ("ssm_inner", "embed"), config=cfg, recipe=self.recipe,
                  std=residual_std(cfg))(g_BxLxI)
