"""Under ``jax.disable_jit()`` (how users debug) every fp4jax op runs and gives the bits of ``jax.jit``.

fp4jax's primitives compile themselves alone when called eagerly; under disable_jit that compiled
call switches jit back on for itself (as jax does for its lax primitives), so it does not recurse.
Everything around the primitives (layouts, the recipes' custom_vjp and their pure-JAX quantizers,
which use fp4jax._exact for one rounding per operation) then runs op by op, and must still give the
jitted result bit for bit.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax.api import quantize_rht_transposed

RECIPES = ["nvfp4", "mxfp4", "fp8", "nvfp4_4over6", "quartet2", "tetrajet2"]
# 40-60 s each, op by op on a 2-core CPU; nvfp4 and fp8 15-40 s. The default suite runs mxfp4's dot, which
# takes the same custom_vjp with stochastic rounding and the RHT; nvfp4's pieces run by default below
# (2D tiles, stochastic rounding, the transposed RHT quantize).
SLOW = ("nvfp4", "fp8", "nvfp4_4over6", "quartet2", "tetrajet2")


def _inputs():
  k1, k2 = jax.random.split(jax.random.key(0))
  x = inputs.normal(k1, (32, 64)) * jnp.exp2(jnp.arange(32.0)[:, None] - 16)
  w = inputs.normal(k2, (64, 48))
  return x, w


def assert_trees_bit_equal(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for la, lb in zip(leaves_a, leaves_b):
    la, lb = np.asarray(la), np.asarray(lb)
    assert la.dtype == lb.dtype and la.shape == lb.shape
    if la.dtype.itemsize == 1:
      la, lb = la.view(np.uint8), lb.view(np.uint8)
    np.testing.assert_array_equal(la, lb)


def eager_and_jit(fn, *args):
  with jax.disable_jit():
    eager = fn(*args)
  return eager, jax.jit(fn)(*args)


@pytest.mark.parametrize("fmt, kw", [   # by default each format's plain quantize and scaled matmul
    ("nvfp4", {}), pytest.param("nvfp4", {"tile": (16, 16)}, marks=pytest.mark.slow),
    pytest.param("nvfp4", {"axis": 0}, marks=pytest.mark.slow), ("mxfp4", {}),
    pytest.param("mxfp4", {"scale_rule": "floor"}, marks=pytest.mark.slow), ("fp8", {}),
    pytest.param("fp8", {"scaling": "tensor"}, marks=pytest.mark.slow)])
def test_quantize_dequantize_scaled_matmul(fmt, kw):
  x, w = _inputs()
  if fmt == "fp8":   # blocks of 128 along K
    x, w = jnp.concatenate([x, -x], axis=1), jnp.concatenate([w, w], axis=0)

  def fn(x, w_t):
    q = fp4jax.quantize(x, fmt, **kw)
    out = (q, fp4jax.dequantize(q))
    if not kw:
      out += (fp4jax.scaled_matmul(q, fp4jax.quantize(w_t, fmt)),)
    return out

  eager, jitted = eager_and_jit(fn, x, w.T)
  assert isinstance(eager[0], fp4jax.QTensor)
  assert_trees_bit_equal(eager, jitted)


@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow)])  # mxfp4's: in its dot
def test_stochastic_and_rht_transposed(fmt):
  x, _ = _inputs()
  key = jax.random.key(3)

  def fn(x):
    return (fp4jax.quantize(x, fmt, rounding="stochastic", key=key),
            quantize_rht_transposed(x, fmt, rht_size=16, rounding="stochastic", key=key))

  eager, jitted = eager_and_jit(fn, x)
  assert_trees_bit_equal(eager, jitted)


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r in SLOW else r
                                    for r in RECIPES])
def test_dot_value_and_grad(recipe):
  x, w = _inputs()
  c = inputs.normal(jax.random.key(8), (32, 48))
  key = jax.random.key(7)

  def loss(x, w, c):   # dy = c exactly, and c is an argument: a constant would let XLA fold it
    return jnp.sum(fp4jax.dot(x, w, recipe=recipe, key=key) * c)

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  eager, jitted = eager_and_jit(fn, x, w, c)
  assert_trees_bit_equal(eager, jitted)
  assert np.isfinite(np.asarray(eager[0]))
  assert np.any(np.asarray(eager[1][1]) != 0)


def test_vmap_under_disable_jit():
  x, _ = _inputs()
  xs = jnp.stack([x, 2 * x, -x])
  fn = jax.vmap(lambda x: fp4jax.dequantize(fp4jax.quantize(x, "nvfp4")))
  eager, jitted = eager_and_jit(fn, xs)
  assert_trees_bit_equal(eager, jitted)
