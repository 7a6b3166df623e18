"""``fp4jax.dequantize`` to a dtype JAX does not compute in: float64 without x64 gives float32 and a warning,
as ``jnp.astype`` does, instead of an MLIR verifier error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_float64_without_x64_is_float32_with_a_warning(fmt):
  assert not jax.config.jax_enable_x64
  x = inputs.normal(jax.random.key(0), (4, 128), jnp.float32)
  q = fp4jax.quantize(x, fmt)
  with pytest.warns(UserWarning, match="dtype float64 is not available with jax_enable_x64 off, so the result "
                                       "is float32"):
    y = fp4jax.dequantize(q, jnp.float64)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(fp4jax.dequantize(q, jnp.float32)))
  with pytest.warns(UserWarning, match="float64 is not available"):
    z = jax.jit(lambda q: fp4jax.dequantize(q, np.float64))(q)
  assert z.dtype == jnp.float32
