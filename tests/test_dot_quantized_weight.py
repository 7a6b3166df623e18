"""fp4jax.QuantizedWeight: a weight quantized ahead of the dot (``fp4jax.quantize_weight``) gives the dot the
values and gradients of quantizing it there, bit for bit (the codes are the dot's own; w still receives dw),
with an activation as it is or pre-quantized; a recipe that reads the weight itself, another recipe's codes and
a batched layout are refused with an error that names the fix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax


def _operands(m=40, k=40, n=24, seed=0):   # none of them a multiple of the 16x16 tiles: the dot pads
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = (inputs.normal(kx, (2, m // 2, k)) * 3).astype(jnp.bfloat16)
  w = inputs.normal(kw, (k, n)) * 0.1
  dy = inputs.normal(kd, (2, m // 2, n)).astype(jnp.bfloat16)
  return x, w, dy


def _same(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def _ahead_equals_here(loss, *args):
  """loss(*args, ahead) -> (scalar, y): y and the gradients with the weight quantized ahead equal those with it
  quantized in the dot, bit for bit; the gradients."""
  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (_, y_ahead), grads_ahead = run(*args, True)
  (_, y_here), grads_here = run(*args, False)
  _same(y_ahead, y_here)
  _same(grads_ahead, grads_here)
  return grads_ahead


@pytest.mark.parametrize("recipe", ["nvfp4", pytest.param("quartet2", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_4over6", marks=pytest.mark.slow)])
@pytest.mark.parametrize("prequantized_x", [False, True])
def test_a_weight_quantized_ahead_gives_the_dots_values_and_gradients(recipe, prequantized_x):
  x, w, dy = _operands()
  key = jax.random.key(3)
  as_x = (lambda x: fp4jax.prequantize(x, recipe)) if prequantized_x else (lambda x: x)

  def loss(x, w, ahead):
    w_in = fp4jax.quantize_weight(w, recipe=recipe) if ahead else w
    y = fp4jax.dot(as_x(x), w_in, recipe=recipe, key=key)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  grads = _ahead_equals_here(loss, x, w)
  assert float(jnp.max(jnp.abs(grads[1]))) > 0   # w receives its gradient through the QuantizedWeight


def test_the_codes_are_the_dots_own():
  _, w, _ = _operands()
  q = fp4jax.quantize_weight(w, recipe="nvfp4")
  assert q.shape == w.shape and q.dtype == w.dtype and q.ndim == 2
  assert q.q.data.shape[0] % 16 == 0   # the dot's padding, made once
  assert fp4jax.can_quantize_weight("nvfp4") and not fp4jax.can_quantize_weight("mxfp4")


def test_mismatches_are_refused():
  x, w, _ = _operands()
  with pytest.raises(ValueError, match=r"reads the weight itself.*pass the weight to the dot as it is"):
    fp4jax.quantize_weight(w, recipe="mxfp4")
  q = fp4jax.quantize_weight(w, recipe="nvfp4")
  with pytest.raises(ValueError, match=r"quantized for recipe 'nvfp4', the dot runs 'nvfp4_4over6'.*quantize_weight"):
    fp4jax.dot(x, q, recipe="nvfp4_4over6")
  with pytest.raises(ValueError, match=r"QuantizedWeight is a weight w \[K, N\] contracted along K"):
    fp4jax.dot_general(x[0], q, (((0,), (1,)), ((), ())), recipe="nvfp4")
  with pytest.raises(ValueError, match=r"codes are not those 'nvfp4' makes for a float32 w \(40, 40\)"):
    fp4jax.dot(x, fp4jax.QuantizedWeight(jnp.zeros((40, 40)), q.q, q.recipe), recipe="nvfp4")
  with pytest.raises(ValueError, match="2-D weight"):
    fp4jax.quantize_weight(w[None], recipe="nvfp4")


@pytest.mark.parametrize("use_bias", [False, True])
def test_a_dense_layer_reads_its_codes_from_the_prequantized_collection(use_bias):
  import flax.linen as nn   # pylint: disable=import-outside-toplevel
  x, _, dy = _operands()
  layer = fp4jax.flax.Dense(24, use_bias=use_bias, dtype=jnp.bfloat16,
                            dot_general_cls=fp4jax.flax.dot_general_cls("nvfp4"))
  params = layer.init(jax.random.key(0), x)["params"]
  params = jax.tree.map(lambda p: p + 0.01, params)   # a bias that is not zero
  rngs = {"fp4": jax.random.key(5)}

  def loss(params, x, ahead):
    variables = {"params": params}
    if ahead:   # the kernel as the layer computes with it (bf16), quantized once
      variables[fp4jax.flax.PREQUANTIZED] = {"kernel": fp4jax.quantize_weight(
          params["kernel"].astype(jnp.bfloat16), recipe="nvfp4").q}
    y = layer.apply(variables, x, rngs=rngs)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  _ahead_equals_here(loss, params, x)
  bf16 = nn.Dense(24, use_bias=False)
  with pytest.raises(ValueError, match="whose dot is not quantized"):
    fp4jax.flax.Dense(24, use_bias=False).apply(
        {"params": bf16.init(jax.random.key(0), x)["params"],
         fp4jax.flax.PREQUANTIZED: {"kernel": fp4jax.quantize_weight(params["kernel"], recipe="nvfp4").q}}, x)
