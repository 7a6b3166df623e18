"""The precision policy: which linear layers run the recipe, and that the model wires it through."""
import importlib.util
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp4jax
import models
from models import LanguageModel, describe_linear_layers, get_model_config, policy

HAS_FP4_FLAX = importlib.util.find_spec("fp4jax.flax") is not None


class TestDescribe:

  def test_12b_keeps_20_of_124_linear_layers_in_bf16(self):
    rows = describe_linear_layers(get_model_config("nemotron_h_12b"), "nvfp4")
    bf16 = [r for r in rows if r[1] == "bf16"]
    assert len(rows) == 124 and len(bf16) == 20
    assert 0.15 < len(bf16) / len(rows) < 0.17
    assert {policy.block_index(r[0]) for r in bf16} == {0, 1, *range(54, 62)}
    assert {r[1] for r in rows} == {"bf16", "nvfp4"}

  def test_8b_keeps_its_last_8_blocks(self):
    rows = describe_linear_layers(get_model_config("hybrid_8b"), "nvfp4")
    bf16 = [r for r in rows if r[1] == "bf16"]
    assert len(rows) == 104 and len(bf16) == 16
    assert {policy.block_index(r[0]) for r in bf16} == set(range(44, 52))

  def test_rows_have_gemm_shapes(self):
    c = get_model_config("nemotron_h_12b")
    rows = {r[0]: r[2:] for r in describe_linear_layers(c, "nvfp4")}
    assert rows["blocks_0/mixer/in_proj"] == (5120, 2 * 10240 + 2 * 8 * 128 + 160)
    assert rows["blocks_0/mixer/out_proj"] == (10240, 5120)
    assert rows["blocks_7/mixer/qkv"] == (5120, (40 + 2 * 8) * 128)
    assert rows["blocks_7/mixer/out"] == (5120, 5120)
    assert rows["blocks_1/mixer/up"] == (5120, 20480) and rows["blocks_1/mixer/down"] == (20480, 5120)

  def test_swiglu_has_three_layers_per_mlp(self):
    rows = describe_linear_layers(get_model_config("tiny", mlp_kind="swiglu"), "nvfp4")
    assert [r[0].split("/")[-1] for r in rows if r[0].startswith("blocks_1/")] == ["down", "gate", "up"]

  @pytest.mark.parametrize("recipe", ["bf16", fp4jax.recipes.bf16()])
  def test_bf16_recipe_quantizes_nothing(self, recipe):
    rows = describe_linear_layers(get_model_config("small"), recipe)
    assert rows and all(r[1] == "bf16" for r in rows)


class TestLayerPrecision:

  C = get_model_config("nemotron_h_12b")

  @pytest.mark.parametrize("path", [
      ("embed",), ("lm_head",), ("final_norm",), ("blocks_5", "norm"), ("blocks_5", "mixer", "A_log"),
      ("blocks_5", "mixer", "conv_weight"), ("blocks_5", "mixer", "norm_scale"), ("blocks_5", "mixer"),
  ])
  def test_never_quantized(self, path):
    assert policy.layer_precision(self.C, "nvfp4", path) == "bf16"
    assert policy.dot_general_cls(self.C, "nvfp4", path) is None

  def test_paths_as_strings_or_tuples_and_recipe_names(self):
    assert policy.layer_precision(self.C, "nvfp4", "blocks_5/mixer/in_proj") == "nvfp4"
    assert policy.layer_precision(self.C, "mxfp4", ("blocks_5", "mixer", "in_proj")) == "mxfp4"
    assert policy.layer_precision(self.C, "nvfp4", "blocks_1/mixer/up") == "bf16"
    assert policy.layer_precision(self.C, "nvfp4", "blocks_54/mixer/in_proj") == "bf16"
    assert policy.layer_precision(self.C, "nvfp4", "blocks_53/mixer/down") == "nvfp4"
    assert policy.layer_precision(self.C, "nvfp4_bf16_fprop", "blocks_5/mixer/out") == "nvfp4_bf16_fprop"

  def test_bf16_layers_never_import_fp4jax_flax(self, monkeypatch):
    monkeypatch.setitem(sys.modules, "fp4jax.flax", None)   # any import of it now raises
    assert policy.dot_general_cls(self.C, "bf16", "blocks_5/mixer/in_proj") is None
    assert policy.dot_general_cls(self.C, "nvfp4", "blocks_0/mixer/in_proj") is None
    with pytest.raises(ImportError):
      policy.dot_general_cls(self.C, "nvfp4", "blocks_5/mixer/in_proj")
    jax.eval_shape(LanguageModel(get_model_config("tiny")).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


class _RecordingDotGeneral(nn.Module):
  """Stands in for fp4jax.flax.Fp4DotGeneral: a plain dot that records where it ran and draws fp4 rng."""

  recipe: fp4jax.Recipe
  recipes_seen = []   # class-level: filled while tracing

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None):
    _RecordingDotGeneral.recipes_seen.append(self.recipe)
    self.sow("intermediates", "quantized_dot", jax.random.key_data(self.make_rng("fp4")))
    if isinstance(lhs, fp4jax.PreQuantized):   # a producer's pre-quantized input, as the real one takes it
      lhs = lhs.x
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)


@pytest.mark.parametrize("remat", [False, True])
def test_model_routes_exactly_the_policy_layers_through_the_quantized_dot(monkeypatch, remat):
  """With a stand-in fp4jax.flax: the layers that call it are exactly describe's quantized ones."""
  monkeypatch.setitem(sys.modules, "fp4jax.flax", types.SimpleNamespace(Fp4DotGeneral=_RecordingDotGeneral))
  # The remat variant on a 3-block model: the policy must see the same paths through nn.remat.
  config = get_model_config("tiny", pattern="M*-", remat=True) if remat else get_model_config("tiny")
  model = LanguageModel(config, recipe="nvfp4")
  tokens = jnp.arange(10, dtype=jnp.int32)[None] % 256
  params = jax.jit(LanguageModel(config).init)(jax.random.key(0), tokens)["params"]
  logits, state = jax.jit(lambda params, key: model.apply(
      {"params": params}, tokens, rngs={"fp4": key}, mutable=["intermediates"]))(params, jax.random.key(1))
  assert logits.shape == (1, 10, 256) and np.isfinite(logits).all()
  called = {"/".join(path[:-3]): leaf   # .../in_proj/_RecordingDotGeneral_0/quantized_dot
            for path, leaf in _flatten(state["intermediates"]) if path[-2] == "quantized_dot"}
  expected = {r[0] for r in describe_linear_layers(config, "nvfp4") if r[1] == "nvfp4"}
  assert set(called) == expected and len(expected) == (4 if remat else 10)
  assert {r.name for r in _RecordingDotGeneral.recipes_seen} == {"nvfp4"}
  keys = [tuple(np.asarray(k).ravel()) for k in called.values()]
  assert len(set(keys)) == len(keys)   # each layer draws its own stochastic-rounding key


def _flatten(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flatten(v, prefix + (k,))
  else:   # a sown tuple of values
    yield prefix + ("value",), tree[0]


@pytest.mark.skipif(not HAS_FP4_FLAX, reason="fp4jax.flax not landed")
class TestNvfp4Model:
  """The real quantized dot in the tiny model (start running once fp4jax.flax lands)."""

  @pytest.mark.slow   # ~15 s idle; the nvfp4 model trains in tests/test_train_loop.py by default
  def test_forward_backward_finite_and_close_to_bf16(self):
    # Every linear layer of a 2-block model in NVFP4 (the CPU reference path compiles slowly).
    config = get_model_config("tiny", pattern="M-", bf16_last_blocks=0)
    model, reference = LanguageModel(config, recipe="nvfp4"), LanguageModel(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    params = jax.jit(reference.init)(jax.random.key(0), tokens)["params"]

    def loss(params, model, key):
      logits = model.apply({"params": params}, tokens[:, :-1], rngs={"fp4": key})
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    value, grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, model, jax.random.key(2))
    value_ref, grads_ref = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, reference, jax.random.key(2))
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    assert abs(float(value) - float(value_ref)) < 0.02 * float(value_ref)
    # Gradients agree in direction with the unquantized ones.
    flat = lambda tree: jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(tree)])
    g, g_ref = flat(grads), flat(grads_ref)
    assert float(g @ g_ref / (jnp.linalg.norm(g) * jnp.linalg.norm(g_ref))) > 0.9

  def test_param_tree_does_not_depend_on_the_recipe(self):
    config = get_model_config("tiny")
    quantized = models.abstract_variables(LanguageModel(config, recipe="nvfp4"))
    plain = models.abstract_variables(LanguageModel(config))
    assert jax.tree_util.tree_structure(quantized) == jax.tree_util.tree_structure(plain)
