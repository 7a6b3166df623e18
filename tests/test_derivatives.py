"""Which derivatives fp4jax defines (fp4jax.derivatives, docs/NUMERICS.md "Derivatives"): the quantized dot's one
reverse-mode derivative, a clear error for forward mode and second order, none for quantize, and fake_quantize's
straight-through gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax

KEY = jax.random.key(0)
X = inputs.normal(jax.random.key(1), (16, 32))
W = inputs.normal(jax.random.key(2), (32, 16))


def _loss(recipe):
  return lambda x: (fp4jax.dot(x, W, recipe=recipe, key=KEY) ** 2).sum()


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_no_sr", "fp8"])
def test_grad_of_grad_is_refused_not_zero(recipe):
  loss = _loss(recipe)
  with pytest.raises(TypeError, match=rf"fp4jax.dot with recipe '{recipe}': a second derivative.*recipe='bf16'"):
    jax.grad(lambda x: jax.grad(loss)(x).sum())(X)


def test_second_derivative_through_the_saved_operands_is_refused():
  """d(dw)/dx of a linear loss: the cotangent is constant, only the saved (quantized) x carries the tangent."""
  dw = lambda x: jax.grad(lambda w: fp4jax.dot(x, w, recipe="nvfp4_no_sr").sum())(W)
  with pytest.raises(TypeError, match="second derivative"):
    jax.grad(lambda x: dw(x).sum())(X)


@pytest.mark.parametrize("transform", [jax.hessian, jax.jacfwd, lambda f: jax.jit(jax.jacfwd(f))])
def test_forward_mode_names_fp4jax_and_reverse_mode(transform):
  with pytest.raises(TypeError, match=r"fp4jax.dot with recipe 'nvfp4': forward-mode.*jax.jacrev"):
    transform(_loss("nvfp4"))(X)


def test_jvp_of_grad_is_refused():
  with pytest.raises(TypeError, match="fp4jax.dot"):
    jax.jvp(jax.grad(_loss("nvfp4_no_sr")), (X,), (X,))


def test_first_order_still_works_and_bf16_keeps_every_derivative():
  g = jax.jit(jax.grad(_loss("nvfp4")))(X)
  assert g.shape == X.shape and bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
  x = X[:2, :16]
  w = W[:16, :4]
  f = lambda x: (fp4jax.dot(x, w, recipe="bf16") ** 2).sum()
  ref = lambda x: (jnp.dot(x, w) ** 2).sum()
  np.testing.assert_array_equal(jax.hessian(f)(x), jax.hessian(ref)(x))


@pytest.mark.parametrize("fmt,shape", [("nvfp4", (16, 32)), ("mxfp4", (16, 32)), ("fp8", (2, 128))])
def test_grad_through_quantize_is_refused_not_zero(fmt, shape):
  x = inputs.normal(jax.random.key(3), shape)
  with pytest.raises(TypeError, match=r"fp4jax.quantize has no derivative.*fp4jax.fake_quantize"):
    jax.grad(lambda x: fp4jax.dequantize(fp4jax.quantize(x, fmt), jnp.float32).sum())(x)
  # A quantization nobody differentiates is fine.
  jax.grad(lambda x: fp4jax.dequantize(fp4jax.quantize(jax.lax.stop_gradient(x), fmt)).sum() + x.sum())(x)


@pytest.mark.parametrize("fmt,shape,dtype", [("nvfp4", (16, 32), jnp.float32), ("nvfp4", (16, 32), jnp.bfloat16),
                                             ("mxfp4", (4, 64), jnp.float32), ("fp8", (2, 128), jnp.float32)])
def test_fake_quantize_is_the_round_trip_with_the_straight_through_gradient(fmt, shape, dtype):
  x = inputs.normal(jax.random.key(4), shape).astype(dtype)
  y, vjp = jax.vjp(lambda x: fp4jax.fake_quantize(x, fmt), x)
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(fp4jax.dequantize(fp4jax.quantize(x, fmt), dtype), np.float32))
  assert y.dtype == dtype
  dy = inputs.normal(jax.random.key(5), shape).astype(dtype)
  (dx,) = vjp(dy)
  assert dx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dy, np.float32))   # dx = dy
  _, tangent = jax.jvp(lambda x: fp4jax.fake_quantize(x, fmt), (x,), (dy,))   # forward mode: the same identity
  np.testing.assert_array_equal(np.asarray(tangent, np.float32), np.asarray(dy, np.float32))


def test_fake_quantize_stochastic_and_its_second_derivative():
  x = inputs.normal(jax.random.key(6), (4, 32))
  f = lambda x: fp4jax.fake_quantize(x, "nvfp4", rounding="stochastic", key=KEY, dtype=jnp.float32)
  np.testing.assert_array_equal(
      f(x), fp4jax.dequantize(fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=KEY)))
  np.testing.assert_array_equal(jax.grad(lambda x: f(x).sum())(x), jnp.ones_like(x))
  hess = jax.hessian(lambda x: f(x).sum())(x)   # the estimator is linear: its second derivative is zero
  assert float(jnp.abs(hess).max()) == 0.0
