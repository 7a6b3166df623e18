"""fp4jax.PreQuantized: a pre-quantized activation gives the quantized dot bit-identical values and
gradients to the unfused call (the quantization is order-free, so the bits are pinned), and mismatched
recipes or layouts are refused with an error that names the fix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import prequantized


def _operands(m=40, k=96, n=48, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = (inputs.normal(kx, (2, m // 2, k)) * 3).astype(jnp.bfloat16)
  w = (inputs.normal(kw, (k, n)) * 0.1).astype(jnp.bfloat16)
  return x, w


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("recipe", ["nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow),
                                    pytest.param("quartet2", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_4over6", marks=pytest.mark.slow)])
def test_values_and_gradients_are_bit_identical(recipe):
  x, w = _operands()
  key = jax.random.key(3)
  g = inputs.normal(jax.random.key(4), (2, 20, 48), jnp.float32).astype(jnp.bfloat16)

  def loss_plain(x, w):
    return jnp.sum(fp4jax.dot(x, w, recipe=recipe, key=key).astype(jnp.float32) * g)

  def loss_pre(x, w):
    return jnp.sum(fp4jax.dot(fp4jax.prequantize(x, recipe), w, recipe=recipe, key=key).astype(jnp.float32) * g)

  (y0, (dx0, dw0)) = jax.jit(jax.value_and_grad(loss_plain, (0, 1)))(x, w)
  (y1, (dx1, dw1)) = jax.jit(jax.value_and_grad(loss_pre, (0, 1)))(x, w)
  f0 = jax.jit(lambda x, w: fp4jax.dot(x, w, recipe=recipe))(x, w)
  f1 = jax.jit(lambda x, w: fp4jax.dot(fp4jax.prequantize(x, recipe), w, recipe=recipe))(x, w)
  np.testing.assert_array_equal(_bits(f0), _bits(f1))
  np.testing.assert_array_equal(_bits(dx0), _bits(dx1))
  np.testing.assert_array_equal(_bits(dw0), _bits(dw1))


def test_padded_rows_are_the_quantization_of_zero_rows():
  for recipe in ("nvfp4", "mxfp4"):
    x, _ = _operands(m=10, k=64)
    pre = fp4jax.prequantize(x, recipe)
    q = prequantized.pad_rows(pre.q, 16)
    x_pad = jnp.concatenate([x.reshape(-1, 64), jnp.zeros((6, 64), x.dtype)])
    want = fp4jax.recipes.get(recipe).roles.fprop_x(x_pad)
    np.testing.assert_array_equal(np.asarray(q.data), np.asarray(want.data))
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), np.asarray(want.scale).view(np.uint8))


def test_the_dot_quantizes_nothing_more():
  x, w = _operands(m=32)
  pre = fp4jax.prequantize(x, "nvfp4")
  text = jax.jit(lambda q, w: fp4jax.dot(q, w, recipe="nvfp4")).lower(pre, w).as_text()
  plain = jax.jit(lambda x, w: fp4jax.dot(x, w, recipe="nvfp4")).lower(x, w).as_text()
  # the forward pass quantizes w only: one abs-max reduction fewer than the plain dot's
  assert text.count("abs") < plain.count("abs")


def test_mismatched_recipe_and_layout_are_refused():
  x, w = _operands()
  pre = fp4jax.prequantize(x, "nvfp4")
  with pytest.raises(ValueError, match="quantizes its fprop input with"):
    fp4jax.dot(pre, w, recipe="mxfp4")
  with pytest.raises(ValueError, match="last axis"):
    fp4jax.dot_general(pre, w.T, (((1,), (1,)), ((), ())), recipe="nvfp4")
  with pytest.raises(ValueError, match="cannot pre-quantize"):
    fp4jax.prequantize(x, "fp8")
