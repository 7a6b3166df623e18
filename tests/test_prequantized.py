"""fp4jax.PreQuantized: a pre-quantized activation gives the quantized dot bit-identical values and
gradients to the unfused call (the quantization is order-free, so the bits are pinned), and mismatched
recipes or layouts are refused with an error that names the fix. The producer's amax pass also reads the
amax of the wgrad's RHT quantize of x, so the compiled program reduces exactly what the unfused dot's does."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import fused, prequantized, recipes


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


def test_the_producer_carries_the_wgrad_amax():
  """prequantize reads both tensor amaxes of x: q's and the wgrad RHT quantize's of x with its rows padded as
  the dot pads them (40 -> 48 tokens), each bit for bit what the quantizer takes itself; a recipe whose dot
  shares no amax of x (mxfp4: none; 4/6: a fprop amax of its own) carries none."""
  x, _ = _operands(m=40)
  roles = recipes.get("nvfp4").roles
  pre = fp4jax.prequantize(x, "nvfp4")
  x_pad = jnp.concatenate([x.reshape(-1, 96), jnp.zeros((8, 96), x.dtype)])
  assert pre.wgrad_x == roles.wgrad_x
  np.testing.assert_array_equal(_bits(pre.amax_t), _bits(roles.wgrad_x.quantize_t(x_pad).amax))
  np.testing.assert_array_equal(_bits(pre.q.amax), _bits(roles.fprop_x(x.reshape(-1, 96)).amax))
  for recipe in ("mxfp4", "nvfp4_4over6"):
    other = fp4jax.prequantize(x, recipe)
    assert (other.amax_t, other.wgrad_x) == (None, None), recipe


def test_a_recipe_with_another_wgrad_reads_its_own_amax():
  """The carried amax goes only into a wgrad that quantizes x as the producer's recipe does: not into
  nvfp4_no_rht's (the same fprop codes, no RHT in its wgrad), which reads its own."""
  x, _ = _operands(m=32)
  pre = fp4jax.prequantize(x, "nvfp4")
  assert prequantized.wgrad_amax(pre, recipes.get("nvfp4_no_rht").roles) is None
  assert prequantized.wgrad_amax(pre, recipes.get("nvfp4_no_sr").roles) is pre.amax_t


def _reductions(f, *args):
  """The reduce instructions of ``f``'s compiled program as (result type, scope): the passes that read a
  whole tensor (or its blocks) for a maximum or a sum."""
  text = jax.jit(f).lower(*args).compile().as_text()
  found = [re.search(r"= (.+?) reduce\(.*op_name=\"([^\"]*)\"", line) for line in text.splitlines()]
  return [m.groups() for m in found if m]


PRODUCERS = {   # a producer of the dot's pre-quantized input, of an (M, K) input
    "prequantize": lambda x: fp4jax.prequantize(x, "nvfp4"),
    "relu2": lambda u: fused.relu2_quantize(u, "nvfp4", impl="xla"),
    "rmsnorm": lambda x: fused.rmsnorm_quantize(x, jnp.ones(x.shape[-1]), "nvfp4", eps=1e-5, impl="xla"),
}


@pytest.mark.parametrize("producer", ["prequantize", pytest.param("relu2", marks=pytest.mark.slow),
                                      pytest.param("rmsnorm", marks=pytest.mark.slow)])
def test_each_operand_is_reduced_once_for_its_amaxes(producer):
  """The compiled nvfp4 dot of a producer's PreQuantized output (value and gradients) reduces each operand
  once for its tensor amaxes: x one reduction for its fprop and wgrad amaxes (in the producer's pass), dy one
  for its dgrad and wgrad amaxes, w one for its tiles' amax; none is left in the wgrad's quantize of x, which
  read x once more for its own amax: the whole-tensor reductions a plain x gives the dot."""
  x, w = _operands(m=32, k=64, n=32)
  g = inputs.normal(jax.random.key(4), (32, 32)).astype(jnp.bfloat16)
  def loss(x, w, g):
    pre = PRODUCERS[producer](x.reshape(32, 64))
    return jnp.sum(fp4jax.dot(pre, w, recipe="nvfp4", key=jax.random.key(7)).astype(jnp.float32) * g)
  found = _reductions(jax.value_and_grad(loss, (0, 1)), x, w, g)
  assert not [name for _, name in found if "/wgrad/" in name], found
  whole = sorted(shape for shape, _ in found if shape in ("s32[]", "(s32[], s32[])"))
  assert whole == ["(s32[], s32[])", "(s32[], s32[])", "s32[]"], found
