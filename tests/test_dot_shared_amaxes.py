"""The wgrad's RHT quantize reads its operand once: fp4jax.dot takes both tensor amaxes
of x (fprop 1x16, wgrad RHT) and of dy (dgrad 1x16, wgrad RHT) from one reduction each
(``quantizers.shared_amaxes``), and the values and gradients are bit for bit those of the dot that
reads each amax on its own (max is exact in any order, so the bits are pinned), on the XLA path and
with the Pallas kernels (interpreted here)."""
import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import quantizers, recipes

dot_lib = importlib.import_module("fp4jax.dot")   # the module (fp4jax.dot is also the function)


def _operands(case):
  kx, kw, kg = jax.random.split(jax.random.key(case), 3)
  x = inputs.normal(kx, (40, 96)) * jnp.exp2(jnp.arange(96, dtype=jnp.float32) % 9 - 4)
  if case == 1:      # +-inf, and a tensor whose amaxes are below 2^-64 (the 2^64 shift) in dy
    x = x.at[3, 5].set(jnp.inf).at[17, 40].set(-jnp.inf)
  w = inputs.normal(kw, (96, 48)) * 0.1
  g = inputs.normal(kg, (40, 48)) * (2.0 ** -80 if case == 1 else 1.0)
  return x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), g.astype(jnp.bfloat16)


def _value_and_grads(recipe, x, w, g):
  def loss(x, w):
    return jnp.sum(fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(7)).astype(jnp.float32) * g)
  return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)


def _unshared(monkeypatch):
  monkeypatch.setattr(dot_lib, "shared_amaxes", lambda *a: (None, None))


def _bits(tree):
  return [np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32) for a in jax.tree.leaves(tree)]


# All slow (~50 s on 2 loaded cores for nvfp4). By default the HLO shows the shared amaxes
# (test_the_wgrad_takes_its_amaxes_from_the_rows_quantizes) and tests/test_dot_golden.py pins nvfp4's y, dx, dw bits.
@pytest.mark.parametrize("recipe,impl", [
    pytest.param("nvfp4", "xla", marks=pytest.mark.slow),
    pytest.param("nvfp4", "pallas", marks=pytest.mark.slow),
    *[pytest.param(r, "xla", marks=pytest.mark.slow)
      for r in ("nvfp4_no_sr", "nvfp4_no_2d", "nvfp4_row_scaled", "nvfp4_bf16_fprop", "nvfp4_4over6")]])
def test_shared_amaxes_change_no_bit(recipe, impl, monkeypatch):
  monkeypatch.setenv("FP4JAX_DEFAULT_IMPL", impl)
  for case in (0, 1):
    x, w, g = _operands(case)
    shared = _value_and_grads(recipe, x, w, g)
    with monkeypatch.context() as m:
      _unshared(m)
      alone = _value_and_grads(recipe, x, w, g)
    for a, b in zip(_bits(shared), _bits(alone)):
      np.testing.assert_array_equal(a, b)


def _operand_reductions(text, elements):
  """The reduce ops of a lowered program whose (first) operand has at least ``elements`` elements."""
  shapes = re.findall(r"stablehlo\.reduce\(.* : \(tensor<((?:\d+x)*)\w+>", text)
  return sum(math.prod(int(d) for d in s.split("x") if d) >= elements for s in shapes)


def test_the_wgrad_takes_its_amaxes_from_the_rows_quantizes(monkeypatch):
  """The nvfp4 dot's value and gradient have two reductions of an operand fewer (one per operand of the wgrad:
  a shared pair reads its operand's chunk maxima once, then reduces their small partials), and only the
  recipes whose wgrad is the fused NVFP4 RHT quantize with a plain 1x16 partner share."""
  x, w, g = _operands(0)
  def text():
    f = lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(7)).astype(jnp.float32) * g)
    return jax.jit(jax.value_and_grad(f, (0, 1))).lower(x, w).as_text()
  big = min(x.size, g.size) // 16   # an operand's 16-token chunk maxima; the partials are far fewer
  shared = _operand_reductions(text(), big)
  with monkeypatch.context() as m:
    _unshared(m)
    alone = _operand_reductions(text(), big)
  assert shared == alone - 2, (shared, alone)
  sharing = {name: [quantizers.shared_amaxes(r.fprop_x, r.wgrad_x, x[:32])[0] is not None,
                    quantizers.shared_amaxes(r.dgrad_dy, r.wgrad_dy, g[:32])[0] is not None]
             for name in ("nvfp4", "nvfp4_row_scaled", "nvfp4_bf16_fprop", "nvfp4_4over6", "nvfp4_no_rht",
                          "mxfp4", "quartet2")
             for r in [recipes.get(name).roles]}
  assert sharing == {"nvfp4": [True, True], "nvfp4_row_scaled": [False, True], "nvfp4_bf16_fprop": [False, True],
                     "nvfp4_4over6": [False, True], "nvfp4_no_rht": [False, False], "mxfp4": [False, False],
                     "quartet2": [False, False]}
  assert quantizers.shared_amaxes(recipes.get("nvfp4").roles.fprop_x, recipes.get("nvfp4").roles.wgrad_x,
                                  x) == (None, None)   # 40 tokens: not whole RHT chunks (the dot pads to 48)
