"""fp4jax.eager: an eager quantized dot (and its eager gradient) runs as one compiled program each, with the
values of the traced call; a traced call adds no jit level to the program (its op names are the scopes')."""
import jax
import jax.numpy as jnp
import numpy as np

import inputs
import fp4jax
from fp4jax import _jax_compat, eager


def test_under_jit_tells_eager_from_staged():
  seen = []
  f = lambda x: seen.append(_jax_compat.under_jit()) or x * 2
  f(1.0)
  jax.grad(f)(1.0)
  jax.vmap(f)(jnp.ones(2))
  jax.jit(f)(1.0)
  jax.jit(jax.grad(f))(1.0)
  assert seen == [False, False, False, True, True]


def test_eager_calls_are_one_program_and_traced_calls_are_inlined():
  traced = []

  @eager.compiled_when_eager(static_argnums=1)
  def scale(x, k):
    traced.append(type(x).__name__)
    return x * k
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(scale(x, 3), x * 3)
  np.testing.assert_array_equal(scale(x + 1, 3), (x + 1) * 3)
  assert len(traced) == 1   # the second eager call reused the compiled program
  hlo = jax.jit(lambda x: scale(x, 2)).lower(x).as_text()
  assert "jit(scale)" not in hlo and "call @" not in hlo


def test_eager_dot_and_gradient_equal_the_jitted_ones():
  x = inputs.normal(jax.random.key(0), (32, 64))
  w = inputs.normal(jax.random.key(1), (64, 48))
  key = jax.random.key(2)
  loss = lambda x, w: jnp.sum(jnp.sin(fp4jax.dot(x, w, recipe="nvfp4", key=key)))
  eager_value, eager_grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
  jit_value, jit_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
  np.testing.assert_array_equal(eager_value, jit_value)
  for got, want in zip(eager_grads, jit_grads):
    np.testing.assert_array_equal(got, want)
