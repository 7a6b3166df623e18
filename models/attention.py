"""The attention block's mixer: causal grouped-query attention with a fused QKV projection.

Scores and the value product are never quantized; only the ``qkv`` and ``out`` projections follow the
precision policy. ``config.attention_impl`` picks the kernel: ``"chunked"`` (``chunked_attention`` below:
flash-style online softmax over key blocks, memory O(L x block) instead of O(L x L), any backend),
``"cudnn"`` / ``"xla"`` (``jax.nn.dot_product_attention`` with that implementation; XLA's holds the L x L
scores), ``"auto"`` (cuDNN for training on an sm_80+ CUDA GPU in bf16/fp16 with head_dim <= 128, else chunked),
decided for the devices the program is compiled for (``fp4jax.target.current()``), not the process's.
The fused QKV weight is KV-group-major, ``D x (K, R + 2, P)``: each KV head's R query heads, its key
and its value are contiguous, so query head h = k R + r uses KV head k, as GQA expects. With segment ids
(document masking, ``models.segments``) every implementation masks each query to its own document.

Axis legend: B batch, L sequence (queries), S keys (the cache when decoding), D model width, H query heads,
K KV heads, R query heads per KV head (H = K R), P head dim, Q key blocks, C key block length.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

import fp4jax
from models import scopes, segments
from models.config import ModelConfig
from models.layers import linear, residual_std, rope


class Attention(nn.Module):
  """Causal GQA. With ``decode=True`` keys and values go to a "cache" collection sized at init."""

  config: ModelConfig
  recipe: Any = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    """``segment_ids_BxL`` (document masking, ``models.segments``): a query sees only the keys of its own
    document, and rotary positions count from each document's first token. Decoding, the cache keeps
    each cached key's document (``cached_segment_ids``); a call without segment ids continues the
    cache's last document."""
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
    index_L = start + jnp.arange(L, dtype=jnp.int32)   # the tokens' places in the sequence (or the cache)
    if segment_ids_BxL is not None:
      segment_ids_BxL = segments.check(segment_ids_BxL, (B, L))
    if use_cache:   # the cached keys' documents with this call's written in; positions within documents
      cached_segments = self.variable("cache", "cached_segment_ids", jnp.zeros, (B, L), jnp.int32)
      if segment_ids_BxL is None:
        last_B = lax.dynamic_index_in_dim(cached_segments.value, jnp.maximum(start - 1, 0), 1, keepdims=False)
        segment_ids_BxL = segments.continuing(last_B, L)
      k_segments_BxS = lax.dynamic_update_slice(cached_segments.value, segment_ids_BxL, (0, start))
      cached_segments.value = k_segments_BxS
      positions_BxL = lax.dynamic_slice_in_dim(segments.positions(k_segments_BxS), start, L, axis=1)
    else:
      if self.decode:   # init: the cache of each key's document, as long as the cache
        self.variable("cache", "cached_segment_ids", jnp.zeros, (B, L), jnp.int32)
      k_segments_BxS = segment_ids_BxL
      positions_BxL = (jnp.broadcast_to(index_L, (B, L)) if segment_ids_BxL is None
                       else segments.positions(segment_ids_BxL))
    if cfg.rope:
      q_BxLxHxP = rope(q_BxLxHxP, positions_BxL, cfg.rope_theta)
      k_BxLxKxP = rope(k_BxLxKxP, positions_BxL, cfg.rope_theta)

    impl = resolve_attention_impl(cfg, q_BxLxHxP.dtype)
    documents = dict(q_segment_ids_BxL=segment_ids_BxL, k_segment_ids_BxS=k_segments_BxS)
    if not self.decode:
      with scopes.part("attention_core"):
        o_BxLxHxP = attend(q_BxLxHxP, k_BxLxKxP, v_BxLxKxP, index_L, impl=impl, block=cfg.attention_block,
                           **documents)
    else:
      # At init the cache is created with the call's length as the maximum decode length.
      zeros = lambda: jnp.zeros((B, L, K, P), cfg.dtype)
      cached_key = self.variable("cache", "cached_key", zeros)
      cached_value = self.variable("cache", "cached_value", zeros)
      if not use_cache:
        o_BxLxHxP = attend(q_BxLxHxP, k_BxLxKxP, v_BxLxKxP, index_L, impl=impl, block=cfg.attention_block,
                           **documents)
      else:
        k_BxSxKxP = lax.dynamic_update_slice(cached_key.value, k_BxLxKxP.astype(cfg.dtype), (0, start, 0, 0))
        v_BxSxKxP = lax.dynamic_update_slice(cached_value.value, v_BxLxKxP.astype(cfg.dtype), (0, start, 0, 0))
        cached_key.value, cached_value.value = k_BxSxKxP, v_BxSxKxP
        cache_index.value = start + L
        # Keys past the written part of the cache sit at positions > every query's: the causal mask hides them.
        o_BxLxHxP = attend(q_BxLxHxP, k_BxSxKxP.astype(q_BxLxHxP.dtype), v_BxSxKxP.astype(q_BxLxHxP.dtype),
                           index_L, impl="chunked" if impl == "cudnn" else impl, block=cfg.attention_block,
                           **documents)
    o_BxLxHxP = nn.with_logical_constraint(
        o_BxLxHxP, ("activation_batch", "activation_seq", "activation_heads", "activation_head_dim"))
    return linear(self, "out", D, ("heads", "embed"), config=cfg, recipe=self.recipe,
                  std=residual_std(cfg))(o_BxLxHxP.reshape(B, L, H * P))


# ------------------------------------------------------------------------------------------ kernels

def resolve_attention_impl(config: ModelConfig, dtype, target: fp4jax.target.Target | None = None) -> str:
  """``config.attention_impl`` with ``"auto"`` decided: cuDNN's fused kernel where it applies (the
  program's devices, ``target`` or ``fp4jax.target.current()``, are CUDA GPUs of compute capability 8.0
  or later; bf16/fp16; head_dim <= 128), else the chunked online-softmax attention."""
  impl = config.attention_impl
  if impl != "auto":
    return impl
  fits_cudnn = (fp4jax.target.resolve(target).at_least(8, 0)
                and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and config.head_dim <= 128)
  return "cudnn" if fits_cudnn else "chunked"


def attend(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, *, impl: str, block: int, q_segment_ids_BxL=None,
           k_segment_ids_BxS=None):
  """Causal GQA: query i (at position ``q_positions_L[i]``) sees keys 0..q_positions_L[i]; with segment
  ids (document masking, both or neither) only those of its own document.

  ``"cudnn"`` and ``"xla"`` need L == S (training, prefill from an empty cache) or take an explicit mask;
  with segment ids they also take the mask of each query's document (cuDNN adds it as a bias, B x L x S
  in the inputs' dtype, and writes that bias's gradient in its backward pass).
  """
  L, S = q_BxLxHxP.shape[1], k_BxSxKxP.shape[1]
  if (q_segment_ids_BxL is None) != (k_segment_ids_BxS is None):
    raise ValueError("attend: give both q_segment_ids_BxL and k_segment_ids_BxS (document masking) or neither")
  if impl == "chunked":
    return chunked_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, block=block,
                             q_segment_ids_BxL=q_segment_ids_BxL, k_segment_ids_BxS=k_segment_ids_BxS)
  if impl not in ("cudnn", "xla"):
    raise ValueError(f"attention_impl={impl!r}; use 'auto', 'chunked', 'cudnn' or 'xla'")
  same_BxLxS = (None if q_segment_ids_BxL is None
                else q_segment_ids_BxL[:, :, None] == k_segment_ids_BxS[:, None, :])
  if L == S:   # causal by the kernel's own mask (cuDNN skips the blocks above the diagonal)
    return jax.nn.dot_product_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, is_causal=True, implementation=impl,
                                        mask=None if same_BxLxS is None else same_BxLxS[:, None])
  visible_BxLxS = (jnp.arange(S)[None, :] <= q_positions_L[:, None])[None]
  if same_BxLxS is not None:
    visible_BxLxS = visible_BxLxS & same_BxLxS
  return jax.nn.dot_product_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, mask=visible_BxLxS[:, None],
                                      implementation=impl)


def _key_blocks(t_BxSxKxP, block):
  """``t_QxBxCxKxP``: the keys (or values) in blocks of C, S zero-padded to a multiple of C."""
  B, S, K, P = t_BxSxKxP.shape
  t_BxSxKxP = jnp.pad(t_BxSxKxP, [(0, 0), (0, -S % block), (0, 0), (0, 0)])
  return jnp.moveaxis(t_BxSxKxP.reshape(B, -1, block, K, P), 1, 0)


def _scores(q_BxLxKxRxP, k_BxCxKxP, q_positions_L, kv_start, S, scale, documents=None):
  """float32 scores of one key block, ``-inf`` where a key is in the future or past the end (padding), or
  with ``documents`` (the queries' segment ids, the block's keys') of another document."""
  C = k_BxCxKxP.shape[1]
  s_BxKxRxLxC = jnp.einsum("blkrp,bckp->bkrlc", q_BxLxKxRxP, k_BxCxKxP, preferred_element_type=jnp.float32)
  key_pos_C = kv_start + jnp.arange(C)
  visible_LxC = (key_pos_C[None, :] <= q_positions_L[:, None]) & (key_pos_C < S)[None, :]
  if documents is None:
    return jnp.where(visible_LxC, s_BxKxRxLxC * scale, -jnp.inf)
  q_segment_ids_BxL, k_segment_ids_BxC = documents
  visible_BxLxC = visible_LxC[None] & (q_segment_ids_BxL[:, :, None] == k_segment_ids_BxC[:, None, :])
  return jnp.where(visible_BxLxC[:, None, None], s_BxKxRxLxC * scale, -jnp.inf)


def _segment_blocks(segment_ids_BxS, block):
  """``segment_ids_QxBxC``: the keys' segment ids in blocks of C (the padding is masked by position)."""
  B, S = segment_ids_BxS.shape
  return jnp.moveaxis(jnp.pad(segment_ids_BxS, [(0, 0), (0, -S % block)]).reshape(B, -1, block), 1, 0)


def _blocks(k_BxSxKxP, v_BxSxKxP, k_segment_ids_BxS, block):
  """The scans' inputs: block indices, key and value blocks, and the keys' segment ids in blocks (or None)."""
  S = k_BxSxKxP.shape[1]
  segment_blocks = None if k_segment_ids_BxS is None else _segment_blocks(k_segment_ids_BxS, block)
  return (jnp.arange(-(-S // block)), _key_blocks(k_BxSxKxP, block), _key_blocks(v_BxSxKxP, block),
          segment_blocks)


def _attention_forward(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL, k_segment_ids_BxS,
                       block):
  """(o_BxLxHxP, lse_BxKxRxL): one pass over the key blocks with a running max and sum per query."""
  B, L, H, P = q_BxLxHxP.shape
  S, K = k_BxSxKxP.shape[1:3]
  R = H // K
  scale = 1.0 / math.sqrt(P)
  q_BxLxKxRxP = q_BxLxHxP.reshape(B, L, K, R, P)

  def body(carry, inputs):
    max_BxKxRxL, sum_BxKxRxL, acc_BxKxRxLxP = carry
    j, k_BxCxKxP, v_BxCxKxP, k_segment_ids_BxC = inputs
    documents = None if k_segment_ids_BxC is None else (q_segment_ids_BxL, k_segment_ids_BxC)
    s_BxKxRxLxC = _scores(q_BxLxKxRxP, k_BxCxKxP, q_positions_L, j * block, S, scale, documents)
    new_max = jnp.maximum(max_BxKxRxL, s_BxKxRxLxC.max(-1))
    finite_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)   # rows with nothing visible yet
    p_BxKxRxLxC = jnp.exp(s_BxKxRxLxC - finite_max[..., None])
    rescale = jnp.exp(max_BxKxRxL - finite_max)
    sum_BxKxRxL = sum_BxKxRxL * rescale + p_BxKxRxLxC.sum(-1)
    acc_BxKxRxLxP = acc_BxKxRxLxP * rescale[..., None] + jnp.einsum(
        "bkrlc,bckp->bkrlp", p_BxKxRxLxC.astype(v_BxCxKxP.dtype), v_BxCxKxP, preferred_element_type=jnp.float32)
    return (new_max, sum_BxKxRxL, acc_BxKxRxLxP), None

  init = (jnp.full((B, K, R, L), -jnp.inf, jnp.float32), jnp.zeros((B, K, R, L), jnp.float32),
          jnp.zeros((B, K, R, L, P), jnp.float32))
  (max_BxKxRxL, sum_BxKxRxL, acc_BxKxRxLxP), _ = lax.scan(
      body, init, _blocks(k_BxSxKxP, v_BxSxKxP, k_segment_ids_BxS, block))
  o_BxKxRxLxP = acc_BxKxRxLxP / sum_BxKxRxL[..., None]
  o_BxLxHxP = jnp.einsum("bkrlp->blkrp", o_BxKxRxLxP).reshape(B, L, H, P).astype(q_BxLxHxP.dtype)
  return o_BxLxHxP, max_BxKxRxL + jnp.log(sum_BxKxRxL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL, k_segment_ids_BxS,
                       block):
  return _attention_forward(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL,
                            k_segment_ids_BxS, block)[0]


def _chunked_attention_fwd(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL, k_segment_ids_BxS,
                           block):
  o_BxLxHxP, lse_BxKxRxL = _attention_forward(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL,
                                              k_segment_ids_BxS, block)
  return o_BxLxHxP, (q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL, k_segment_ids_BxS,
                     o_BxLxHxP, lse_BxKxRxL)


def _chunked_attention_bwd(block, res, do_BxLxHxP):
  """Per key block: recompute p = exp(s - lse), then dv = pᵀ do, ds = p (do vᵀ - rowsum(do o)),
  dk = dsᵀ q, and dq += ds k (a float32 carry); GQA sums dk, dv over the R query heads of each KV head."""
  q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, q_segment_ids_BxL, k_segment_ids_BxS, o_BxLxHxP, lse_BxKxRxL = res
  B, L, H, P = q_BxLxHxP.shape
  S, K = k_BxSxKxP.shape[1:3]
  R = H // K
  scale = 1.0 / math.sqrt(P)
  q_BxLxKxRxP = q_BxLxHxP.reshape(B, L, K, R, P)
  do_BxLxKxRxP = do_BxLxHxP.reshape(B, L, K, R, P)
  delta_BxKxRxL = jnp.einsum("blkrp,blkrp->bkrl", do_BxLxKxRxP.astype(jnp.float32),
                             o_BxLxHxP.reshape(B, L, K, R, P).astype(jnp.float32))

  def body(dq_BxLxKxRxP, inputs):
    j, k_BxCxKxP, v_BxCxKxP, k_segment_ids_BxC = inputs
    documents = None if k_segment_ids_BxC is None else (q_segment_ids_BxL, k_segment_ids_BxC)
    s_BxKxRxLxC = _scores(q_BxLxKxRxP, k_BxCxKxP, q_positions_L, j * block, S, scale, documents)
    p_BxKxRxLxC = jnp.exp(s_BxKxRxLxC - lse_BxKxRxL[..., None])
    dv_BxCxKxP = jnp.einsum("bkrlc,blkrp->bckp", p_BxKxRxLxC.astype(do_BxLxHxP.dtype), do_BxLxKxRxP,
                            preferred_element_type=jnp.float32)
    dp_BxKxRxLxC = jnp.einsum("blkrp,bckp->bkrlc", do_BxLxKxRxP, v_BxCxKxP, preferred_element_type=jnp.float32)
    ds_BxKxRxLxC = (p_BxKxRxLxC * (dp_BxKxRxLxC - delta_BxKxRxL[..., None]) * scale).astype(q_BxLxHxP.dtype)
    dq_BxLxKxRxP = dq_BxLxKxRxP + jnp.einsum("bkrlc,bckp->blkrp", ds_BxKxRxLxC, k_BxCxKxP,
                                             preferred_element_type=jnp.float32)
    dk_BxCxKxP = jnp.einsum("bkrlc,blkrp->bckp", ds_BxKxRxLxC, q_BxLxKxRxP, preferred_element_type=jnp.float32)
    return dq_BxLxKxRxP, (dk_BxCxKxP.astype(k_BxSxKxP.dtype), dv_BxCxKxP.astype(v_BxSxKxP.dtype))

  dq_BxLxKxRxP, (dk_QxBxCxKxP, dv_QxBxCxKxP) = lax.scan(
      body, jnp.zeros((B, L, K, R, P), jnp.float32), _blocks(k_BxSxKxP, v_BxSxKxP, k_segment_ids_BxS, block))
  unblock = lambda t_QxBxCxKxP: jnp.moveaxis(t_QxBxCxKxP, 0, 1).reshape(B, -1, K, P)[:, :S]
  dq_BxLxHxP = dq_BxLxKxRxP.reshape(B, L, H, P).astype(q_BxLxHxP.dtype)
  return dq_BxLxHxP, unblock(dk_QxBxCxKxP), unblock(dv_QxBxCxKxP), None, None, None


_chunked_attention.defvjp(_chunked_attention_fwd, _chunked_attention_bwd)


def chunked_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L, *, block: int = 256, q_segment_ids_BxL=None,
                      k_segment_ids_BxS=None):
  """Causal grouped-query attention without an L x S score matrix: keys in blocks of ``block``, a
  running (online) softmax in the forward pass, and a backward pass that recomputes each block's scores
  from the saved per-query logsumexp. Key s is at position s; query i at ``q_positions_L[i]`` sees keys at
  positions <= its own, and with segment ids (document masking) only those of its document. Softmax in
  float32; the two products take the inputs' dtype (probabilities cast to v's dtype, as
  ``jax.nn.dot_product_attention`` does) and accumulate in float32."""
  B, L, H = q_BxLxHxP.shape[:3]
  S, K = k_BxSxKxP.shape[1:3]
  if H % K:
    raise ValueError(f"query heads {H} must be a multiple of KV heads {K}")
  if (q_segment_ids_BxL is None) != (k_segment_ids_BxS is None):
    raise ValueError("chunked_attention: give both q_segment_ids_BxL and k_segment_ids_BxS or neither")
  if q_segment_ids_BxL is not None:
    q_segment_ids_BxL = segments.check(q_segment_ids_BxL, (B, L))
    k_segment_ids_BxS = segments.check(k_segment_ids_BxS, (B, S))
  block = min(block, S)
  return _chunked_attention(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, jnp.asarray(q_positions_L, jnp.int32),
                            q_segment_ids_BxL, k_segment_ids_BxS, block)
