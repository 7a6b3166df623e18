"""The Flax modules with the recipes beyond the paper (4/6, Quartet II, TetraJet-v2): linen nn.Dense and
NNX nnx.Linear with fp4jax's dot_general give exactly fp4jax.dot's output and gradients for the same
weights and the key the module drew from its "fp4" rng stream; bad recipes fail at construction; a
gradient without the stream is a clear error.

Axis legend: M tokens, K input features, N output features.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import inputs
import fp4jax
from fp4jax import recipes
from fp4jax.flax import Fp4DotGeneral, Fp4DotGeneralNNX, dot_general_cls

RECIPES = ["nvfp4_4over6", "quartet2", "quartet2_rtn", "tetrajet2"]
M, K, N = 32, 64, 48


class _Recording:
  """Namespace for a recording Fp4DotGeneral: the same class name, so linen gives it the same module
  path (Fp4DotGeneral_0) and make_rng the same key."""

  class Fp4DotGeneral(Fp4DotGeneral):
    """Sows the key it draws, so the test can hand the same key to fp4jax.dot."""

    def __call__(self, lhs, rhs, *args, **kw):
      recipe = recipes.get(self.recipe)
      key = self._key(recipe)
      self.sow("intermediates", "key", jax.random.key_data(key))
      return fp4jax.dot_general(lhs, rhs, *args, recipe=recipe, key=key, **kw)


def _data():
  kx, kw = jax.random.split(jax.random.key(0))
  return inputs.normal(kx, (M, K)), inputs.normal(kw, (K, N)) * 0.1


def assert_bit_equal(a, b):
  np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def _dot_value_and_grads(recipe, x, w, key):
  loss = lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe=recipe, key=key) ** 2)
  y = fp4jax.dot(x, w, recipe=recipe, key=key)
  return y, jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.slow   # covered by test_flax.py::test_linen_dense_general_is_fp4jax_dot_general
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r.startswith("quartet2") or r == "nvfp4_4over6"
                                    else r for r in RECIPES])   # Quartet II's dot: test_recipes_quartet2; 4/6: test_recipes_four_over_six
def test_linen_dense_equals_dot(recipe):
  x, w = _data()
  cls = dot_general_cls(recipe)
  model = nn.Dense(N, use_bias=False, dot_general_cls=cls)
  params = model.init(jax.random.key(1), x)   # init needs no "fp4" stream
  params = {"params": {"kernel": w}}
  stream = jax.random.key(2)
  assert params["params"]["kernel"].shape == (K, N)

  # The key the module draws: the same module with a recording dot_general, same path and stream.
  rec = nn.Dense(N, use_bias=False, dot_general_cls=lambda: _Recording.Fp4DotGeneral(recipe=recipe))
  _, sown = rec.apply(params, x, rngs={"fp4": stream}, mutable=["intermediates"])
  key = jax.random.wrap_key_data(jax.tree.leaves(sown)[0])

  @jax.jit
  def run(params, x):
    y = model.apply(params, x, rngs={"fp4": stream})
    loss = lambda p, x: jnp.sum(model.apply(p, x, rngs={"fp4": stream}) ** 2)
    return y, jax.grad(loss, argnums=(0, 1))(params, x)

  y, (g_params, g_x) = run(params, x)
  y_ref, (g_x_ref, g_w_ref) = jax.jit(lambda x, w: _dot_value_and_grads(recipe, x, w, key))(x, w)
  assert_bit_equal(y, y_ref)
  assert_bit_equal(g_x, g_x_ref)
  assert_bit_equal(g_params["params"]["kernel"], g_w_ref)
  # Another stream key changes the backward pass (fresh signs / bits), not the forward.
  other = jax.jit(lambda p: jax.grad(lambda p: jnp.sum(model.apply(p, x, rngs={"fp4": jax.random.key(3)})
                                                       ** 2))(p))(params)
  assert np.any(np.asarray(other["params"]["kernel"]) != np.asarray(g_w_ref))


# All slow (~35 s each): by default the linen test runs tetrajet2 and tests/test_flax.py the NNX layer (nvfp4).
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_nnx_linear_equals_dot(recipe):
  x, w = _data()
  rngs = nnx.Rngs(0, fp4=5)
  layer = nnx.Linear(K, N, use_bias=False, rngs=rngs,
                     dot_general=Fp4DotGeneralNNX(recipe, rngs=rngs))
  layer.kernel[...] = w
  key = nnx.clone(layer.dot_general.rngs)()   # the key the layer's next call draws

  def loss(layer, x):
    return jnp.sum(layer(x) ** 2)

  y = nnx.clone(layer)(x)
  _, (g_layer, g_x) = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
  y_ref, (g_x_ref, g_w_ref) = _dot_value_and_grads(recipe, x, w, key)
  assert_bit_equal(y, y_ref)
  assert_bit_equal(g_x, g_x_ref)
  assert_bit_equal(g_layer.kernel[...], g_w_ref)
  # The stream advanced: the next call draws a different key.
  assert not np.array_equal(jax.random.key_data(nnx.clone(layer.dot_general.rngs)()),
                            jax.random.key_data(key))


@pytest.mark.parametrize("make, match", [
    (lambda: dot_general_cls(recipes.tetrajet2(four_over_six="all")), "no 4/6 rule"),
    (lambda: dot_general_cls(recipes.nvfp4(four_over_six="all", fprop="mxfp4")), "fprop='nvfp4'"),
    (lambda: dot_general_cls(recipes.quartet2(weight_2d=True)), "weight_2d=False"),
    (lambda: dot_general_cls(recipes.quartet2(dgrad="bf16")), "dgrad='nvfp4'"),
    (lambda: Fp4DotGeneralNNX(recipes.nvfp4(four_over_six="sometimes")), "four_over_six"),
    (lambda: Fp4DotGeneralNNX("quartet3"), "quartet2"),
    (lambda: dot_general_cls("tetrajet2_4over6"), "tetrajet2"),
])
def test_bad_combinations_fail_at_construction(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_need_the_fp4_stream(recipe):
  x, w = _data()
  model = nn.Dense(N, use_bias=False, dot_general_cls=dot_general_cls(recipe))
  params = {"params": {"kernel": w}}
  y = model.apply(params, x)   # the forward pass needs no random bits
  assert_bit_equal(y, fp4jax.dot(x, w, recipe=recipe))
  with pytest.raises(ValueError, match="'fp4' rng stream"):
    jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)
  layer = nnx.Linear(K, N, use_bias=False, rngs=nnx.Rngs(0), dot_general=Fp4DotGeneralNNX(recipe))
  with pytest.raises(ValueError, match="no key was given"):
    nnx.grad(lambda layer: jnp.sum(layer(x) ** 2))(layer)
