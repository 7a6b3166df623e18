"""Chunked (online-softmax) attention against a plain softmax reference: GQA, ragged blocks, decode offsets;
document masking in every implementation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import packed
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


class TestDocuments:
  """Document masking: a query sees only the earlier keys of its own document (tests/packed.py's rows)."""

  @staticmethod
  def _case():
    seg = jnp.asarray(packed.segment_ids())
    L = seg.shape[1]
    return _qkv(2, L, L, 4, 2, 8, seed=3), seg, jnp.arange(L)

  @pytest.mark.parametrize("impl", ["chunked", "xla"])
  def test_each_document_equals_it_alone(self, impl):
    """Every document's outputs equal the document attended alone, within float32 rounding: its keys fall
    into other key blocks (chunked) or rows of another length (XLA's softmax), so only the summation order
    differs."""
    (q, k, v), seg, index = self._case()
    out = jax.jit(lambda q, k, v: attend(q, k, v, index, impl=impl, block=8, q_segment_ids_BxL=seg,
                                         k_segment_ids_BxS=seg))(q, k, v)
    alone_fn = jax.jit(lambda q, k, v: attend(q, k, v, jnp.arange(q.shape[1]), impl=impl, block=8))
    for doc in packed.documents():
      alone = alone_fn(*(packed.alone(t, doc) for t in (q, k, v)))
      np.testing.assert_allclose(packed.alone(out, doc), alone, rtol=1e-5, atol=1e-6, err_msg=str(doc))

  @pytest.mark.parametrize("impl", ["chunked", "xla"])
  def test_other_documents_change_no_bit(self, impl):
    (q, k, v), seg, index = self._case()
    fn = jax.jit(lambda q, k, v: attend(q, k, v, index, impl=impl, block=8, q_segment_ids_BxL=seg,
                                        k_segment_ids_BxS=seg))
    n = packed.LENGTHS[0][0]
    out, out2 = fn(q, k, v), fn(q.at[0, :n].set(30.0), k.at[0, :n].set(-20.0), v.at[0, :n].set(1e4))
    np.testing.assert_array_equal(out2[0, n:], out[0, n:])
    np.testing.assert_array_equal(out2[1], out[1])

  def test_gradients_of_chunked_and_xla_agree(self):
    (q, k, v), seg, index = self._case()
    do = inputs.normal(jax.random.key(4), q.shape)

    def grads(impl):
      f = lambda q, k, v: attend(q, k, v, index, impl=impl, block=8, q_segment_ids_BxL=seg, k_segment_ids_BxS=seg)
      return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](do))(q, k, v)

    for name, g, g_xla in zip("qkv", grads("chunked"), grads("xla")):
      np.testing.assert_allclose(g, g_xla, rtol=1e-4, atol=1e-5, err_msg=name)

  def test_segment_ids_come_in_pairs(self):
    (q, k, v), seg, index = self._case()
    with pytest.raises(ValueError, match="both"):
      attend(q, k, v, index, impl="chunked", block=8, q_segment_ids_BxL=seg)

  def test_cudnn_takes_the_document_mask_as_a_bias_and_stays_causal(self):
    """cuDNN's fused attention, lowered for CUDA on any machine: the document mask enters as a B x 1 x L x L
    bias of the inputs' dtype (its gradient written by the backward), the causal mask stays cuDNN's own."""
    from jax import export   # pylint: disable=import-outside-toplevel
    B, L, H, K, P = 2, 256, 8, 2, 64
    S = jax.ShapeDtypeStruct

    def fn(q, k, v, seg):
      f = lambda q, k, v: attend(q, k, v, jnp.arange(L), impl="cudnn", block=128, q_segment_ids_BxL=seg,
                                 k_segment_ids_BxS=seg)
      out, vjp = jax.vjp(f, q, k, v)
      return out, vjp(out)

    names = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
    text = export.export(jax.jit(fn), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(n) for n in names])(
        S((B, L, H, P), jnp.bfloat16), S((B, L, K, P), jnp.bfloat16), S((B, L, K, P), jnp.bfloat16),
        S((B, L), jnp.int32)).mlir_module()
    for name in names:
      calls = [line for line in text.splitlines() if f"@{name}(" in line]
      assert len(calls) == 1, name
      assert f"tensor<{B}x1x{L}x{L}xbf16>" in calls[0] and "CAUSAL" in calls[0], calls[0][:300]
