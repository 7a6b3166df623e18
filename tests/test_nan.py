"""NaN in, NaN out, on every path: a NaN in any quantized input makes at least its block's output non-finite.

A float max reduction may drop NaN (XLA's vectorized CPU reduction returns a finite amax, or -inf for a NaN
in the last element; Triton's float max is maxnum). fp4jax takes every amax over the magnitudes' bits as
integers (``fp4jax.numerics.amax``), and its kernels use no NaN-dropping float max or min. Each test runs
one compiled program for the first, a middle and the last element.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax import fused, grouped, recipes
from fp4jax.api import quantize_rht_transposed
from fp4jax.numerics.amax import abs_max, abs_max_of

POSITIONS = ("first", "middle", "last")


def _with_nan(shape, where, dtype=jnp.float32, seed=0):
  """x ~ N(0, 1) with one NaN at the first, a middle or the last element; the NaN's flat index."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  i = {"first": 0, "middle": x.size // 2 + 7, "last": x.size - 1}[where] % x.size
  x.reshape(-1)[i] = np.nan
  return jnp.asarray(x, dtype), i


@pytest.mark.parametrize("shape", [(16,), (32, 128), (64, 128), (1000, 64), (3, 5, 7)])
def test_abs_max_keeps_nan_and_equals_the_float_max(shape):
  f = jax.jit(abs_max)
  for where in POSITIONS:
    x, _ = _with_nan(shape, where)
    assert np.isnan(f(x)), (shape, where)
  x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
  assert f(jnp.asarray(x)) == np.max(np.abs(x))
  rows = jax.jit(lambda a: abs_max(a, axis=-1))(jnp.asarray(x))
  np.testing.assert_array_equal(rows, np.max(np.abs(x), axis=-1))


def test_abs_max_orders_every_magnitude():
  v = jnp.asarray([-0.0, 1e-45, -1e-38, 3.0, -np.inf], jnp.float32)
  assert abs_max(v) == np.inf and abs_max(v[:4]) == 3.0
  assert np.asarray(abs_max(v[:3])).tobytes() == np.float32(1e-38).tobytes()   # a subnormal, compared as bits
  assert abs_max(jnp.zeros((0, 4))) == 0 and abs_max(jnp.asarray([-0.0])) == 0
  assert np.isnan(abs_max_of(v, v.at[2].set(jnp.nan))[2]) and abs_max_of(v, -2 * v)[3] == 6.0


QUANTIZE = [   # (fmt, kwargs, impl)
    ("nvfp4", {}, "xla"), ("nvfp4", {}, "pallas"), ("nvfp4", {"tile": (16, 16)}, "xla"),
    ("nvfp4", {"tile": (16, 16)}, "pallas"), ("mxfp4", {}, "xla"), ("mxfp4", {}, "pallas"),
    ("fp8", {}, None),
]


@pytest.mark.parametrize("fmt,kwargs,impl", QUANTIZE)
@pytest.mark.parametrize("shape", [(16, 128), (256, 1024)])   # one fp8 block, one tile row; 16,384 blocks
def test_quantize_keeps_the_nan_in_its_block(fmt, kwargs, impl, shape):
  impl_kw = {} if impl is None else {"impl": impl}
  f = jax.jit(lambda x: fp4jax.dequantize(fp4jax.quantize(x, fmt, **kwargs, **impl_kw)))
  for where in POSITIONS:
    x, i = _with_nan(shape, where, jnp.bfloat16)
    y = np.asarray(f(x))
    r, c = divmod(i, shape[1])
    assert not np.isfinite(y[r, c]), (where, i)
    if fmt == "nvfp4":   # one tensor amax: NaN everywhere, as docs/NUMERICS.md says
      assert np.isnan(y).all(), where


@pytest.mark.parametrize("fmt,impl", [("nvfp4", "xla"), ("nvfp4", "pallas"), ("mxfp4", "pallas")])
def test_rht_transposed_quantize_keeps_nan(fmt, impl):
  f = jax.jit(lambda x: fp4jax.dequantize(quantize_rht_transposed(x, fmt, impl=impl)))
  for where in POSITIONS:
    x, i = _with_nan((128, 64), where, jnp.bfloat16)
    y = np.asarray(f(x))                        # (C, T): RHT-16 spreads the NaN over its 16 tokens
    t, c = divmod(i, 64)
    assert np.isnan(y[c, (t // 16) * 16:(t // 16 + 1) * 16]).all(), (where, i)


def test_eager_quantize_and_dot_name_no_amax():
  # eagerly, with the NaN last (where a float max returned -inf): NaN out, no refusal about an amax
  x, _ = _with_nan((64, 128), "last")
  assert np.isnan(fp4jax.dequantize(fp4jax.quantize(x, "nvfp4"))).all()
  y = fp4jax.dot(x, jnp.ones((128, 32)), recipe="nvfp4_no_sr")
  assert np.isnan(y).all()


# Every recipe's fprop, dgrad and wgrad: a NaN in x, in w or in dy reaches every output that reads it. The
# default suite runs one recipe per amax code path (NVFP4 1x16, 16x16 tiles, RHT and SR; MXFP4; FP8; MXFP8;
# Four Over Six; MS-EDEN; DBQ; one amax per row); the variants that reuse those paths run with -m slow.
_AMAX_PATHS = ("nvfp4", "mxfp4", "fp8", "mxfp8", "nvfp4_4over6", "quartet2", "tetrajet2", "nvfp4_row_scaled")


@pytest.mark.parametrize("name", [n if n in _AMAX_PATHS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in recipes.NAMES])
def test_every_recipe_keeps_nan_forward_and_backward(name):
  m, k, n = 64, 128, 64

  @jax.jit
  def f(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=name, key=key), x, w)
    return (y, *vjp(dy.astype(y.dtype)))

  key = jax.random.key(0)
  ones = lambda shape: jnp.asarray(np.random.default_rng(2).standard_normal(shape), jnp.float32)
  x, w, dy = ones((m, k)), ones((k, n)), ones((m, n))
  y, dx, dw = f(x, w, dy, key)
  assert all(np.isfinite(t).all() for t in (y, dx, dw))
  for where in POSITIONS:
    xn, _ = _with_nan((m, k), where)
    wn, _ = _with_nan((k, n), where)
    dyn, _ = _with_nan((m, n), where)
    y, _, dw = f(xn, w, dy, key)
    assert not np.isfinite(y).all() and not np.isfinite(dw).all(), ("x", where)
    y, dx, _ = f(x, wn, dy, key)
    assert not np.isfinite(y).all() and not np.isfinite(dx).all(), ("w", where)
    _, dx, dw = f(x, w, dyn, key)
    assert not np.isfinite(dx).all() and not np.isfinite(dw).all(), ("dy", where)


@pytest.mark.parametrize("name", ["nvfp4", "quartet2", "tetrajet2"])
def test_grouped_dot_keeps_nan_in_its_group(name):
  rows = grouped.alignment(recipes.get(name))     # rows per group
  e, s, k, n = 2, 2 * rows, 128, 32
  sizes = jnp.asarray([rows, rows], jnp.int32)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((e, k, n)), jnp.float32)

  @jax.jit
  def f(x, key):
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=name, key=key), x, w)
    return (y, *vjp(jnp.ones_like(y)))

  for where in POSITIONS:
    x, i = _with_nan((s, k), where)
    y, _, dw = f(x, jax.random.key(0))
    g = (i // k) // rows                             # the group holding the NaN's row
    assert not np.isfinite(y[g * rows:(g + 1) * rows]).all(), where
    assert not np.isfinite(dw[g]).all(), where


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fused_producers_keep_nan(impl):
  norm = jax.jit(lambda x: fused.rmsnorm_quantize(x, jnp.ones((128,), jnp.bfloat16), "nvfp4", eps=1e-6, impl=impl))
  relu2 = jax.jit(lambda u: fused.relu2_quantize(u, "nvfp4", impl=impl))
  for where in POSITIONS:
    x, i = _with_nan((32, 128), where, jnp.bfloat16)
    for pre in (norm(x), relu2(x)):
      assert np.isnan(np.asarray(pre.x, np.float32).reshape(-1)[i]), where   # the activation keeps it
      assert np.isnan(fp4jax.dequantize(pre.q)).all(), where                   # and so do its codes


S = jax.ShapeDtypeStruct


@pytest.mark.skipif(not plc.has_triton(), reason="jax without the Pallas Triton backend")
def test_kernels_on_the_gpu_use_no_nan_dropping_max():
  """What the GPU runs: each quantize kernel's Triton IR has no maxnumf/minnumf (the float max/min that
  return the number), so its block maxima (integer maxsi) and clips keep a NaN."""
  kernels = {
      "1d nvfp4": lambda x: fp4jax.quantize(x, "nvfp4", impl="pallas").data,
      "1d mxfp4": lambda x: fp4jax.quantize(x, "mxfp4", impl="pallas").data,
      "2d": lambda x: fp4jax.quantize(x, "nvfp4", tile=(16, 16), impl="pallas").data,
      "rht nvfp4": lambda x: quantize_rht_transposed(x, "nvfp4", impl="pallas").data,
      "rht mxfp4": lambda x: quantize_rht_transposed(x, "mxfp4", impl="pallas").data,
      "rmsnorm": lambda x: fused.rmsnorm_quantize(x, jnp.ones((256,), jnp.bfloat16), "nvfp4", eps=1e-6,
                                                  impl="pallas").q.data,
      "relu2": lambda x: fused.relu2_quantize(x, "nvfp4", impl="pallas").q.data,
  }
  for name, fn in kernels.items():
    with plc.triton_module_texts() as texts:
      plc.export_for_cuda(fn, S((256, 256), jnp.bfloat16))
    assert len(texts) == (2 if name == "rmsnorm" else 1), name   # the norm's factor has a kernel of its own
    ops = [set(re.findall(r"arith\.(max\w+|min\w+)", text)) for text in texts]
    assert "maxsi" in ops[-1] and not set().union(*ops) & {"maxnumf", "minnumf"}, (name, ops)
