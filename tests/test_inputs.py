"""tests/inputs.py draws jax's values: the size-class prefix equals jax.random's draw of the shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs


@pytest.mark.parametrize("shape", [(), (1,), (7, 4, 2, 8), (33, 17), (1025,), (3, 0, 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_normal_is_jax_random_normal(shape, dtype):
  key = jax.random.key(11)
  got = inputs.normal(key, shape, dtype)
  want = jax.random.normal(key, shape, dtype)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got).reshape(-1).view(np.uint8),
                                np.asarray(want).reshape(-1).view(np.uint8))


def test_uniform_and_raw_keys_are_jax_random():
  key = jax.random.PRNGKey(5)
  np.testing.assert_array_equal(inputs.uniform(key, (9, 13), minval=-2.0, maxval=3.0),
                                jax.random.uniform(key, (9, 13), minval=-2.0, maxval=3.0))
  np.testing.assert_array_equal(inputs.normal(key, (40,)), jax.random.normal(key, (40,)))


def test_a_traced_key_draws_with_jax():
  f = jax.jit(lambda k: inputs.normal(k, (5, 3)))
  np.testing.assert_array_equal(f(jax.random.key(2)), jax.random.normal(jax.random.key(2), (5, 3)))


def test_the_default_dtype_is_jax_random_s():
  with jax.enable_x64(True):
    assert inputs.normal(jax.random.key(1), (3,)).dtype == jax.random.normal(jax.random.key(1), (3,)).dtype
    assert inputs.uniform(jax.random.key(1), (3,)).dtype == jnp.float64
