"""Chunked (online-softmax) attention against a plain softmax reference: GQA, ragged blocks, decode offsets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
from models import LanguageModel, get_model_config
from models.attention import attend, chunked_attention, resolve_attention_impl


def _reference(q_BxLxHxP, k_BxSxKxP, v_BxSxKxP, q_positions_L):
  """Every score materialized: softmax(q kᵀ / sqrt(P) masked) v, in float32, KV heads repeated for GQA."""
  H, K, P = q_BxLxHxP.shape[2], k_BxSxKxP.shape[2], q_BxLxHxP.shape[3]
  f32 = lambda t: t.astype(jnp.float32)
  k_BxSxHxP = jnp.repeat(f32(k_BxSxKxP), H // K, axis=2)
  v_BxSxHxP = jnp.repeat(f32(v_BxSxKxP), H // K, axis=2)
  s_BxHxLxS = jnp.einsum("blhp,bshp->bhls", f32(q_BxLxHxP), k_BxSxHxP) / np.sqrt(P)
  visible_LxS = jnp.arange(k_BxSxKxP.shape[1])[None, :] <= q_positions_L[:, None]
  p_BxHxLxS = jax.nn.softmax(jnp.where(visible_LxS, s_BxHxLxS, -jnp.inf), axis=-1)
  return jnp.einsum("bhls,bshp->blhp", p_BxHxLxS, v_BxSxHxP).astype(q_BxLxHxP.dtype)


def _qkv(B, L, S, H, K, P, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (inputs.normal(kq, (B, L, H, P), jnp.float32).astype(dtype),
          inputs.normal(kk, (B, S, K, P), jnp.float32).astype(dtype),
          inputs.normal(kv, (B, S, K, P), jnp.float32).astype(dtype))


CASES = [  # (B, L, S, H, K, P, block, first query position)
    pytest.param(2, 16, 16, 4, 4, 8, 4, 0, marks=pytest.mark.slow),   # MHA, blocks divide L (GQA's case below)
    (2, 19, 19, 6, 2, 8, 8, 0),      # GQA (3 query heads per KV head), ragged last block
    pytest.param(1, 32, 32, 8, 1, 16, 32, 0, marks=pytest.mark.slow),    # MQA, one block
    pytest.param(2, 3, 24, 4, 2, 8, 8, 10, marks=pytest.mark.slow),   # decode: 3 new queries at positions 10..12
    # over a 24-key cache (decode offsets: test_attend_agrees_across_implementations_with_and_without_offsets)
    pytest.param(2, 1, 24, 4, 2, 8, 5, 23, marks=pytest.mark.slow),      # decode: the last position
]


@pytest.mark.parametrize("B,L,S,H,K,P,block,start", CASES)
def test_matches_reference_values_and_gradients(B, L, S, H, K, P, block, start):
  q, k, v = _qkv(B, L, S, H, K, P)
  positions = start + jnp.arange(L)
  fn = jax.jit(lambda q, k, v: chunked_attention(q, k, v, positions, block=block))   # jitted: op by op is slow
  ref = jax.jit(lambda q, k, v: _reference(q, k, v, positions))
  np.testing.assert_allclose(fn(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-6)
  do = inputs.normal(jax.random.key(1), (B, L, H, P))
  grads = jax.vjp(fn, q, k, v)[1](do)
  grads_ref = jax.vjp(ref, q, k, v)[1](do)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_match_xla_attention():
  q, k, v = _qkv(2, 64, 64, 4, 2, 16, dtype=jnp.bfloat16)
  out = chunked_attention(q, k, v, jnp.arange(64), block=16)
  xla = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla, np.float32), rtol=2e-2, atol=2e-2)


def test_attend_agrees_across_implementations_with_and_without_offsets():
  q, k, v = _qkv(1, 4, 12, 4, 2, 8)
  positions = 5 + jnp.arange(4)
  np.testing.assert_allclose(attend(q, k, v, positions, impl="xla", block=4),
                             attend(q, k, v, positions, impl="chunked", block=4), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="attention_impl"):
    attend(q, k, v, positions, impl="flash", block=4)


def test_never_holds_the_score_matrix():
  B, L, H, K, P = 1, 2048, 8, 2, 16
  q, k, v = _qkv(B, L, L, H, K, P)
  scores = B * H * L * L * 4
  loss = lambda q, k, v: chunked_attention(q, k, v, jnp.arange(L), block=64).sum()
  temp = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
  assert temp < scores / 4, (temp, scores)   # a few blocks of B x H x L x 64 scores, each 1/32 of L x L


@pytest.mark.slow   # covered by test_attend_agrees_across_implementations_with_and_without_offsets
def test_auto_is_chunked_off_gpu_and_model_impls_agree():
  config = get_model_config("tiny", pattern="*", attention_block=8)
  if jax.default_backend() != "gpu":
    assert resolve_attention_impl(config, jnp.bfloat16) == "chunked"
  tokens = jax.random.randint(jax.random.key(0), (2, 20), 0, 256)
  chunked, xla = LanguageModel(config.replace(attention_impl="chunked")), LanguageModel(config.replace(attention_impl="xla"))
  params = chunked.init({"params": jax.random.key(1), "fp4": jax.random.key(1)}, tokens)["params"]
  apply = lambda m: jax.jit(lambda p: m.apply({"params": p}, tokens))   # jitted: op by op took ~50 s
  np.testing.assert_allclose(apply(chunked)(params), apply(xla)(params), rtol=1e-5, atol=1e-5)
  loss = lambda m: lambda p: m.apply({"params": p}, tokens[:, :-1], targets_BxL=tokens[:, 1:])
  g_chunked, g_xla = jax.jit(jax.grad(loss(chunked)))(params), jax.jit(jax.grad(loss(xla)))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_chunked, g_xla)


def test_config_rejects_unknown_impl():
  with pytest.raises(ValueError, match="attention_impl"):
    get_model_config("tiny", attention_impl="flash")
