"""Multi-token prediction (DeepSeek-V3 §2.2, Nemotron 3 Super): ``config.mtp_depths`` extra depths after
the main model, depth d (1-based) predicting token t+d+1 at position t.

Depth d takes the previous depth's hidden state ``h`` (depth 1: the main model's, after its final norm, as
vLLM hands it to the draft) and the shared embedding of token t+d, and runs
  1. ``x = eh_proj([enorm(embed(t+d)), hnorm(h)])``  (2D -> D; the embedding half first, as vLLM's loader)
  2. the blocks of ``config.mtp_pattern`` (``layers_<j>``: the main model's pre-norm residual blocks)
  3. its own ``final_norm``; that is the next depth's ``h``, and the shared LM head gives the logits.
Module ``mtp_<d-1>`` holds depth d's parameters (``mtp_0`` for every depth with ``mtp_share_depths``:
Megatron's repeated MTP layer, the one module vLLM applies for each speculative token), so the precision
policy's ``mtp_*`` rules reach all of them.

The loss: depth d's cross entropy is the mean over the positions t < L - d that have a target (the last d
positions of a window have none and are masked), and the objective is
``main + mtp_loss_weight * mean over depths`` (``objective``). The model sows each depth's loss into the
``LOSSES`` collection (``LanguageModel(..., targets_BxL=...)`` with that collection mutable); without it the
heads are dead code. Decoding and logits (sampling) never run them.

Axis legend: B batch, L sequence, D model width.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import BLOCK_KINDS, ModelConfig
from models.layers import RMSNorm, linear

LOSSES = "mtp_losses"   # the variable collection of the depths' losses: {"loss": (depth 1, ..., depth D)}


def shift_left(x_BxL: jax.Array, n: int, fill: int = 0) -> jax.Array:
  """``x[:, n:]`` padded back to length L with ``fill`` at the end (all ``fill`` for n >= L)."""
  n = min(n, x_BxL.shape[1])
  if n == 0:
    return x_BxL
  return jnp.concatenate([x_BxL[:, n:], jnp.full((x_BxL.shape[0], n), fill, x_BxL.dtype)], axis=1)


def depth_inputs(targets_BxL: jax.Array, depth: int, target_weights_BxL: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(tokens to embed, targets, 0/1 weights) of MTP depth ``depth`` >= 1 for a window whose next-token
  targets are ``targets_BxL`` (token t+1 at position t): position t embeds token t+depth (``targets[t+depth-1]``)
  and predicts token t+depth+1 (``targets[t+depth]``), which exists for t < L - depth. With the next-token
  targets' 0/1 weights (document masking: 0 where token t+1 starts a document), token t+depth+1 counts
  only where no document starts between t and it: every next-token weight from t to t+depth is 1."""
  L = targets_BxL.shape[1]
  weights_BxL = jnp.broadcast_to(jnp.arange(L) < L - depth, targets_BxL.shape).astype(jnp.float32)
  if target_weights_BxL is not None:
    for j in range(depth + 1):
      weights_BxL = weights_BxL * shift_left(target_weights_BxL.astype(jnp.float32), j)
  return shift_left(targets_BxL, depth - 1), shift_left(targets_BxL, depth), weights_BxL


def objective(config: ModelConfig, main_loss: jax.Array, depth_losses) -> jax.Array:
  """``main + mtp_loss_weight * mean(depth_losses)``; ``main`` alone without depth losses."""
  if not depth_losses:
    return main_loss
  return main_loss + config.mtp_loss_weight * jnp.mean(jnp.stack(list(depth_losses)))


def sown_losses(collections) -> tuple[jax.Array, ...]:
  """The depths' losses, in depth order, from the mutable collections a ``LanguageModel`` call returned."""
  return tuple((collections or {}).get(LOSSES, {}).get("loss", ()))


class MTPDepth(nn.Module):
  """One MTP module: ``__call__(h_BxLxD, e_BxLxD, segment_ids_BxL=None) -> h'_BxLxD`` (the embedding ``e``
  of token t+d; the segment ids of positions t, document masking)."""

  config: ModelConfig
  block: Any             # the block class (models.lm.Block, wrapped by the remat policy)
  recipe: Any = "bf16"

  @nn.compact
  def __call__(self, h_BxLxD: jax.Array, e_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None
               ) -> jax.Array:
    cfg = self.config
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name=name)
    eh_BxLx2D = jnp.concatenate([norm("enorm")(e_BxLxD), norm("hnorm")(h_BxLxD)], axis=-1)
    x_BxLxD = linear(self, "eh_proj", cfg.d_model, (None, "embed"), config=cfg, recipe=self.recipe)(eh_BxLx2D)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("activation_batch", "activation_seq", "activation_embed"))
    for j, char in enumerate(cfg.mtp_pattern):
      x_BxLxD = self.block(cfg, BLOCK_KINDS[char], self.recipe, False, name=f"layers_{j}")(x_BxLxD, segment_ids_BxL)
    return norm("final_norm")(x_BxLxD)
