"""fp4jax.FP4_OPERAND: a remat policy that keeps the quantized operands gives fp4jax.dot's gradients
exactly, and re-runs no quantize pass.

The regression: jax.checkpoint rounds each saved floating residual with ``reduce_precision`` at its
dtype's finfo, which reads float8_e4m3fn as IEEE e4m3 (largest finite 240), so the weight tile holding
the tensor amax (scale 448) came back NaN. The scales are now saved as their uint8 bits.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax

KEY = jax.random.key(3)
POLICY = jax.checkpoint_policies.save_only_these_names(fp4jax.FP4_OPERAND)


def _loss(recipe):
  return lambda x, w: jnp.sum(jnp.sin(fp4jax.dot(x, w, recipe=recipe, key=KEY)))


@pytest.mark.parametrize("recipe", ["nvfp4", *[pytest.param(r, marks=pytest.mark.slow) for r in ("nvfp4_no_rht", "mxfp4")]])
def test_saved_fp4_operands_give_the_gradients(recipe):
  x = inputs.normal(jax.random.key(0), (48, 64))
  w = inputs.normal(jax.random.key(1), (64, 32)) * 0.1
  plain = jax.jit(jax.grad(_loss(recipe), (0, 1)))(x, w)
  kept = jax.jit(jax.grad(jax.checkpoint(_loss(recipe), policy=POLICY), (0, 1)))(x, w)
  for a, b in zip(plain, kept):
    assert np.isfinite(np.asarray(b)).all()
    # The same operations on the same values; only XLA's fusion of the backward may differ.
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


def test_no_quantize_pass_is_re_run():
  x = inputs.normal(jax.random.key(0), (48, 64))
  w = inputs.normal(jax.random.key(1), (64, 32)) * 0.1
  count = lambda f: str(jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)).count("fp4jax_quantize")
  plain, kept = _loss("nvfp4"), jax.checkpoint(_loss("nvfp4"), policy=POLICY)
  full = jax.checkpoint(_loss("nvfp4"))
  assert count(kept) == count(plain) < count(full)
