"""The whole language model: shapes, causality, decoding vs the parallel forward, axis names, speed; document
masking."""
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import packed
from models import LanguageModel, get_model_config, init_cache

# Tiny config with several SSD chunks per sequence.
TINY = get_model_config("tiny", chunk_size=8)
L = 21


@functools.cache
def _setup(config, batch=2, length=L, seed=0):
  """Model, params, tokens and the jitted parallel forward's logits, shared by the tests."""
  model = LanguageModel(config)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, config.vocab_size)
  params = jax.jit(model.init)({"params": jax.random.key(seed)}, tokens)["params"]
  return model, params, tokens


@functools.cache
def _jitted_apply(config):
  return jax.jit(_setup(config)[0].apply)


@functools.cache
def _parallel_logits(config):
  _, params, tokens = _setup(config)
  return _jitted_apply(config)({"params": params}, tokens)


@pytest.fixture(scope="module")
def tiny():
  model, params, tokens = _setup(TINY)
  return model, params, tokens, _jitted_apply(TINY)


class TestForward:

  def test_shapes_and_dtypes(self, tiny):
    model, params, tokens, apply = tiny
    logits = _parallel_logits(TINY)
    assert logits.shape == (2, L, 256) and logits.dtype == jnp.float32
    assert np.isfinite(logits).all()
    names = set(params)
    assert names == {"embed", "final_norm", "lm_head"} | {f"blocks_{i}" for i in range(6)}

  def test_no_biases_in_linear_layers(self, tiny):
    _, params, _, _ = tiny
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
    paths = ["/".join(str(k.key) for k in path) for path, _ in flat]
    assert not [p for p in paths if p.endswith("/bias")]

  def test_causal(self, tiny):
    """Logits at t do not change when any token after t changes; they do when token t changes."""
    model, params, tokens, apply = tiny
    logits = _parallel_logits(TINY)
    for t in (0, 7, 8, 13, L - 2):
      future = jax.random.randint(jax.random.key(t), (2, L - t - 1), 0, 256)
      changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1 + future) % 256)
      logits2 = apply({"params": params}, changed)
      np.testing.assert_allclose(logits2[:, :t + 1], logits[:, :t + 1], rtol=1e-6, atol=1e-6)
      assert not np.allclose(logits2[:, t + 1:], logits[:, t + 1:])

  def test_bf16_compute_tracks_f32(self, tiny):
    model, params, tokens, apply = tiny
    logits = _parallel_logits(TINY)
    model16 = LanguageModel(TINY.replace(dtype=jnp.bfloat16))
    logits16 = jax.jit(model16.apply)({"params": params}, tokens)
    assert logits16.dtype == jnp.float32
    # Fresh init: logits ~0.2 std; bf16 keeps ~3 significant digits through 6 blocks.
    np.testing.assert_allclose(logits16, logits, atol=0.05 * float(jnp.abs(logits).max()))

  def test_remat_keeps_params_and_logits(self, tiny):
    _, params, tokens, _ = tiny
    remat = LanguageModel(TINY.replace(remat=True))
    assert (jax.tree_util.tree_structure(models.abstract_variables(remat))
            == jax.tree_util.tree_structure(models.abstract_variables(LanguageModel(TINY))))
    np.testing.assert_array_equal(jax.jit(remat.apply)({"params": params}, tokens), _parallel_logits(TINY))

  @pytest.mark.slow
  def test_remat_keeps_gradients(self):
    config = TINY.replace(pattern="M*-")
    model, params, tokens = _setup(config, length=9)
    loss = lambda m: lambda p: m.apply({"params": p}, tokens).std()
    g = jax.jit(jax.grad(loss(model)))(params)
    g_remat = jax.jit(jax.grad(loss(LanguageModel(config.replace(remat=True)))))(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, g_remat)

  def test_tiny_forward_backward_runs_in_seconds(self):
    config = get_model_config("tiny")
    model, params, tokens = _setup(config, batch=4, length=65)

    @jax.jit
    def loss_and_grad(params, tokens):
      def loss(params):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
      return jax.value_and_grad(loss)(params)

    start = time.perf_counter()
    value, grads = jax.block_until_ready(loss_and_grad(params, tokens))
    compiled = time.perf_counter()
    jax.block_until_ready(loss_and_grad(params, tokens))
    step = time.perf_counter() - compiled
    assert abs(float(value) - np.log(256)) < 0.1     # near-uniform predictions at init
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    assert compiled - start < 60 and step < 5, (compiled - start, step)


DECODE_CONFIGS = {
    "tiny": TINY,
    "rope_swiglu_groups": TINY.replace(rope=True, mlp_kind="swiglu", n_groups=2, pattern="*M-"),
}


class TestDecode:

  @pytest.mark.parametrize("name", list(DECODE_CONFIGS))
  def test_step_by_step_reproduces_parallel_logits(self, name):
    """One token per call from the start, and a 9-token prompt in one call followed by single tokens:
    both give the parallel forward's logits."""
    model, params, tokens = _setup(DECODE_CONFIGS[name])
    logits = _parallel_logits(DECODE_CONFIGS[name])
    apply = jax.jit(lambda p, cache, tok: model.apply({"params": p, "cache": cache}, tok, decode=True,
                                                      mutable=["cache"]))
    for prompt in (1, 9):
      cache = init_cache(model, batch_size=2, max_len=L)
      out, mutated = apply(params, cache, tokens[:, :prompt])
      outs = [out]
      for t in range(prompt, L):
        out, mutated = apply(params, mutated["cache"], tokens[:, t:t + 1])
        outs.append(out)
      np.testing.assert_allclose(jnp.concatenate(outs, axis=1), logits, rtol=2e-5, atol=2e-5,
                                 err_msg=f"{prompt=}")

  def test_cache_layout(self):
    model = LanguageModel(TINY)
    cache = init_cache(model, batch_size=3, max_len=10)
    mamba, attention = cache["blocks_0"]["mixer"], cache["blocks_2"]["mixer"]
    assert mamba["conv_state"].shape == (3, TINY.conv_width - 1, TINY.conv_dim)
    assert mamba["ssm_state"].shape == (3, TINY.ssm_n_heads, TINY.ssm_head_dim, TINY.d_state)
    assert attention["cached_key"].shape == (3, 10, TINY.n_kv_heads, TINY.head_dim)
    assert attention["cache_index"] == 0
    assert "blocks_1" not in cache   # MLP blocks keep no state
    # document masking's: the documents of the conv's cached inputs and of every cached key
    assert mamba["conv_segment_ids"].shape == (3, TINY.conv_width - 1)
    assert attention["cached_segment_ids"].shape == (3, 10)


class TestDocuments:
  """Document masking in the whole hybrid (tests/packed.py's rows; rotary positions on, several SSD chunks
  and key blocks per row): each document computes as if alone, in the parallel forward and decoding."""

  CONFIGS = {"hybrid": TINY.replace(rope=True, attention_block=8, pattern="M*-"),
             "scanned_remat": TINY.replace(rope=True, attention_block=8, pattern="M*M*", scan_blocks=True,
                                           remat="full")}

  @staticmethod
  def _case(config):
    seg = jnp.asarray(packed.segment_ids())
    model, params, tokens = _setup(config, length=seg.shape[1], seed=4)
    return model, params, tokens, seg

  @pytest.mark.parametrize("name", ["hybrid", pytest.param("scanned_remat", marks=pytest.mark.slow)])
  def test_each_document_equals_it_alone(self, name):
    """Logits of every document equal its logits alone within float32 rounding (attention's and the SSD's
    sums fall into other blocks and chunks); the first document's other tokens change no bit of the rest.
    Alone: each document at the start of a row of its own, without segment ids, in one batch (what follows
    it reaches none of its logits: the model is causal)."""
    model, params, tokens, seg = self._case(self.CONFIGS[name])
    packed_apply = jax.jit(lambda p, t: model.apply({"params": p}, t, segment_ids_BxL=seg))
    logits = packed_apply(params, tokens)
    docs = packed.documents()
    rows = jnp.stack([jnp.pad(packed.alone(tokens, d)[0], (0, seg.shape[1] - (d[2] - d[1]))) for d in docs])
    alone = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, rows)
    for i, doc in enumerate(docs):
      np.testing.assert_allclose(packed.alone(logits, doc)[0], alone[i, :doc[2] - doc[1]], rtol=2e-5, atol=2e-5,
                                 err_msg=str(doc))
    n = packed.LENGTHS[0][0]
    other = packed_apply(params, tokens.at[0, :n].set((tokens[0, :n] + 101) % TINY.vocab_size))
    np.testing.assert_array_equal(other[0, n:], logits[0, n:])
    np.testing.assert_array_equal(other[1], logits[1])

  def test_decoding_restarts_at_each_document(self):
    """A 5-token prompt, then one token per call, each with its segment ids: the packed parallel forward's
    logits (the Mamba-2 state and conv inputs and the attention keys of a finished document left behind).
    A call without segment ids continues the cache's last document."""
    model, params, tokens, seg = self._case(self.CONFIGS["hybrid"])
    logits = jax.jit(lambda p, t: model.apply({"params": p}, t, segment_ids_BxL=seg))(params, tokens)
    apply = jax.jit(lambda p, cache, tok, s: model.apply({"params": p, "cache": cache}, tok, decode=True,
                                                         segment_ids_BxL=s, mutable=["cache"]))
    out, mutated = apply(params, init_cache(model, batch_size=2, max_len=seg.shape[1]), tokens[:, :5], seg[:, :5])
    outs = [out]
    for t in range(5, seg.shape[1]):
      out, mutated = apply(params, mutated["cache"], tokens[:, t:t + 1], seg[:, t:t + 1])
      outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), logits, rtol=2e-5, atol=2e-5)
    last = seg.shape[1] - 1
    without = jax.jit(lambda p, cache, tok: model.apply({"params": p, "cache": cache}, tok, decode=True,
                                                        mutable=["cache"]))
    cache = init_cache(model, batch_size=2, max_len=seg.shape[1])
    _, mutated = apply(params, cache, tokens[:, :last], seg[:, :last])
    out, _ = without(params, mutated["cache"], tokens[:, last:])
    np.testing.assert_allclose(out[:, 0], logits[:, last], rtol=2e-5, atol=2e-5)

  def test_segment_ids_of_another_shape_are_refused(self):
    model, params, tokens, seg = self._case(self.CONFIGS["hybrid"])
    with pytest.raises(ValueError, match="segment_ids_BxL"):
      model.apply({"params": params}, tokens, segment_ids_BxL=seg[:, :-1])


class TestLogicalAxes:

  def test_every_param_is_named_with_known_axes(self):
    abstract = models.abstract_variables(LanguageModel(get_model_config("small")))["params"]
    boxes = jax.tree_util.tree_leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    for box in boxes:
      assert len(box.names) == box.value.ndim
      assert set(box.names) <= set(models.LOGICAL_AXIS_NAMES), box.names

  def test_activation_constraints_use_known_axes(self, tiny, monkeypatch):
    model, params, tokens, _ = tiny
    seen = set()
    original = nn.with_logical_constraint

    def record(x, names, *args, **kwargs):
      assert len(names) == x.ndim, names
      seen.update(names)
      return original(x, names, *args, **kwargs)

    monkeypatch.setattr(nn, "with_logical_constraint", record)
    jax.jit(lambda v, t: model.apply(v, t))({"params": params}, tokens)   # a fresh trace, not a cached one
    assert seen and seen <= set(models.LOGICAL_AXIS_NAMES), seen - set(models.LOGICAL_AXIS_NAMES)

  def test_runs_under_a_mesh_with_rules(self, tiny):
    model, params, tokens, _ = tiny
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    rules = {name: None for name in models.LOGICAL_AXIS_NAMES}
    rules.update(activation_batch=("data", "fsdp"), embed="fsdp", mlp="tensor", heads="tensor",
                 qkv="tensor", vocab="tensor", ssm_in="tensor", ssm_inner="tensor")
    with jax.set_mesh(mesh), nn.logical_axis_rules(tuple(rules.items())):
      specs = nn.logical_to_mesh(nn.get_partition_spec(models.abstract_variables(model)["params"]))
      assert specs["blocks_0"]["mixer"]["in_proj"]["kernel"] == jax.sharding.PartitionSpec("fsdp", "tensor")
      logits = jax.jit(model.apply)({"params": params}, tokens)
    np.testing.assert_allclose(logits, _parallel_logits(TINY), rtol=1e-6, atol=1e-6)


class TestScanBlocks:

  def test_groups_of_the_presets(self):
    from models.lm import block_groups  # pylint: disable=g-import-not-at-top
    assert block_groups(get_model_config("nemotron_h_12b")) == [(0, 2, 1), (2, 9, 5), (47, 2, 2), (51, 3, 1),
                                                                 (54, 2, 4)]
    assert block_groups(get_model_config("hybrid_8b")) == [(0, 11, 4), (44, 2, 4)]
    for name in ("tiny", "small", "hybrid_8b", "nemotron_h_12b"):
      config = get_model_config(name)
      groups = block_groups(config)
      assert [g[0] for g in groups] == list(np.cumsum([0] + [u * n for _, u, n in groups])[:-1])
      assert sum(u * n for _, u, n in groups) == config.n_blocks
      for start, unit, repeats in groups:   # every repeat matches the first in kind and precision
        for r in range(repeats):
          for j in range(unit):
            i, first = start + r * unit + j, start + j
            assert config.pattern[i] == config.pattern[first]
            assert config.is_bf16_block(i) == config.is_bf16_block(first)

  @staticmethod
  def _stacked(config, params):
    """The unscanned parameter tree rearranged into the scanned model's (repeats stacked on axis 0)."""
    return models.lm.scanned_params(params, config)

  def test_unscanned_params_inverts_scanned_params(self):
    config = TINY.replace(pattern="M*-M*-M-", bf16_last_blocks=0)
    params = nn.unbox(_setup(config, length=5)[1])
    stacked = models.lm.scanned_params(params, config)
    assert set(stacked) != set(params)   # at least one group is stacked
    back = models.lm.unscanned_params(stacked, config)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back, params)

  @pytest.mark.parametrize("remat", [pytest.param(False, marks=pytest.mark.slow), True])   # remat adds to the scan
  def test_scan_matches_the_unrolled_model(self, remat):
    config = TINY.replace(pattern="M*-M*-", bf16_last_blocks=0, remat=remat)
    model, params, tokens = _setup(config, length=13)
    params = nn.unbox(params)
    scanned = LanguageModel(config.replace(scan_blocks=True))
    stacked = self._stacked(config, params)
    shapes = lambda tree: jax.tree.map(lambda x: x.shape, tree)
    assert shapes(stacked) == shapes(nn.unbox(models.abstract_variables(scanned)["params"]))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = lambda m: lambda p: m.apply({"params": p}, inputs, targets_BxL=targets)
    value, grads = jax.jit(jax.value_and_grad(loss(model)))(params)
    value_scan, grads_scan = jax.jit(jax.value_and_grad(loss(scanned)))(stacked)
    np.testing.assert_allclose(value_scan, value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_scan,
                 self._stacked(config, grads))
