"""fp4jax.dot / dot_general: the spec §6 recipe as a custom_vjp (exactness, statistics, residuals)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import inputs
import fp4jax
from fp4jax import recipes
from fp4jax.numerics import hadamard, nvfp4
from fp4jax.api import quantize_rht_transposed, scaled_matmul
from fp4jax.dot import MISSING_KEY_MESSAGE

KEY = jax.random.key(7)
DENSE = (((1,), (0,)), ((), ()))


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return (scale * inputs.normal(jax.random.key(seed), shape)).astype(dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.partial(jax.jit, static_argnames="recipe")
def _value_and_grads(x, w, dy, key, recipe):
  """y, dx, dw of fp4jax.dot for the cotangent dy."""
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
  return (y, *vjp(dy))


def _exact_value_and_grads(x, w, dy):
  y, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, DENSE, preferred_element_type=jnp.float32), x, w)
  return (y, *vjp(dy))


# ---------------------------------------------------------------------------------------------------
# bf16 recipe, general dimension numbers, padding, dtypes
# ---------------------------------------------------------------------------------------------------

DIMENSION_NUMBERS = [  # (lhs shape, rhs shape, dimension numbers)
    ((6, 20), (20, 5), DENSE),
    ((2, 3, 20), (20, 5), (((2,), (0,)), ((), ()))),
    ((3, 4, 20), (5, 4, 3), (((1,), (1,)), ((0,), (2,)))),           # batch dims, permuted rhs
    ((2, 7, 4, 8), (4, 8, 3, 2), (((2, 3), (0, 1)), ((), ()))),       # two contracting dims
    ((7, 4, 2, 8), (2, 8, 4, 3), (((3, 1), (1, 2)), ((2,), (0,)))),   # both, out of order
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims",   # the last case has batch and two contracting dims
                         [pytest.param(*d, marks=pytest.mark.slow) if i in (2, 3) else d
                          for i, d in enumerate(DIMENSION_NUMBERS)])
def test_bf16_recipe_is_lax_dot_general(lhs_shape, rhs_shape, dims):
  lhs, rhs = _normal(0, lhs_shape, jnp.bfloat16), _normal(1, rhs_shape, jnp.bfloat16)
  ours = lambda a, b: fp4jax.dot_general(a, b, dims, recipe=recipes.bf16()).astype(jnp.float32)
  ref = lambda a, b: lax.dot_general(a, b, dims).astype(jnp.float32)
  np.testing.assert_array_equal(ours(lhs, rhs), ref(lhs, rhs))
  loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
  for g_ours, g_ref in zip(jax.grad(loss(ours), (0, 1))(lhs, rhs), jax.grad(loss(ref), (0, 1))(lhs, rhs)):
    assert g_ours.dtype == g_ref.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g_ours, np.float32), np.asarray(g_ref, np.float32))


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims",   # by default the first (batch dims, permuted rhs)
                         [DIMENSION_NUMBERS[2]]
                         + [pytest.param(*d, marks=pytest.mark.slow) for d in DIMENSION_NUMBERS[3:]])
def test_general_dimension_numbers_are_the_canonical_2d_dot(lhs_shape, rhs_shape, dims):
  """Transposing/reshaping to (tokens, K)·(K, N) by hand gives the same bits, values and gradients."""
  lhs, rhs = _normal(0, lhs_shape), _normal(1, rhs_shape)
  (lc, rc), (lb, rb) = dims
  lfree = [a for a in range(lhs.ndim) if a not in lc + lb]
  rfree = [a for a in range(rhs.ndim) if a not in rc + rb]
  recipe = recipes.nvfp4()

  @jax.jit
  def both(lhs, rhs):
    ours = fp4jax.dot_general(lhs, rhs, dims, recipe=recipe, key=KEY)
    b = int(np.prod([lhs.shape[a] for a in lb]))
    x = jnp.transpose(lhs, (*lb, *lfree, *lc)).reshape(b, -1, int(np.prod([lhs.shape[a] for a in lc])))
    w = jnp.transpose(rhs, (*rb, *rc, *rfree)).reshape(b, x.shape[-1], -1)
    keys = jax.random.split(KEY, b) if lb else KEY[None]
    by_hand = jax.vmap(lambda x, w, k: fp4jax.dot(x, w, recipe=recipe, key=k))(x, w, keys)
    return ours, by_hand.reshape(ours.shape)

  ours, by_hand = both(lhs, rhs)
  assert ours.shape == lax.dot_general(lhs, rhs, dims).shape
  np.testing.assert_array_equal(ours, by_hand)
  assert _rel(ours, lax.dot_general(lhs, rhs, dims)) < 0.3
  # Gradients too: the sum over both paths has each path's gradient; compare them one at a time.
  grads = [jax.jit(jax.grad(lambda a, b, i=i: jnp.sum(jnp.sin(both(a, b)[i])), (0, 1)))(lhs, rhs)
           for i in (0, 1)]
  for g_ours, g_hand in zip(*grads):
    np.testing.assert_array_equal(g_ours, g_hand)


# ~20 s on 2 loaded cores. By default tests/test_dot_golden.py pins y, dx, dw of unaligned ("pad") shapes.
@pytest.mark.slow
def test_unaligned_shapes_equal_explicit_zero_padding():
  """M, K, N not multiples of 16: same bits as padding with zeros by hand, then slicing."""
  m, k, n = 37, 40, 23
  x, w, dy = _normal(0, (m, k)), _normal(1, (k, n)), _normal(2, (m, n))
  y, dx, dw = _value_and_grads(x, w, dy, KEY, recipes.nvfp4())
  pad = lambda a, shape: jnp.pad(a, [(0, s - d) for s, d in zip(shape, a.shape)])
  yp, dxp, dwp = _value_and_grads(pad(x, (48, 48)), pad(w, (48, 32)), pad(dy, (48, 32)), KEY, recipes.nvfp4())
  assert (y.shape, dx.shape, dw.shape) == ((m, n), (m, k), (k, n))
  np.testing.assert_array_equal(y, yp[:m, :n])
  np.testing.assert_array_equal(dx, dxp[:m, :k])
  np.testing.assert_array_equal(dw, dwp[:k, :n])
  # Zeros leave amax and real blocks alone: y is the product of the quantized real data.
  @jax.jit
  def by_hand(x, w):
    qx = fp4jax.quantize(pad(x, (m, 48)), "nvfp4")
    qwt = fp4jax.quantize(pad(w, (48, 32)).T, "nvfp4", tile=(16, 16))
    return scaled_matmul(qx, qwt)[:, :n], qx.amax

  y_hand, amax = by_hand(x, w)
  np.testing.assert_array_equal(y, y_hand)
  assert float(amax) == float(jnp.max(jnp.abs(x)))


@pytest.mark.parametrize("recipe", ["mxfp4", "fp8"])
def test_other_formats_train_close_to_exact(recipe):
  x, w, dy = _normal(0, (48, 72)), _normal(1, (72, 40)), _normal(2, (48, 40))
  got = _value_and_grads(x, w, dy, KEY, recipes.get(recipe))
  bound = 0.08 if recipe == "fp8" else 0.35
  for a, b in zip(got, _exact_value_and_grads(x, w, dy)):
    assert a.shape == b.shape
    assert _rel(a, b) < bound


def test_dtypes():
  x, w = jax.ShapeDtypeStruct((32, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 16), jnp.float32)
  out = lambda f: jax.eval_shape(f, x, w).dtype
  assert out(lambda x, w: fp4jax.dot(x, w, recipe="nvfp4")) == jnp.float32   # lax's type of bf16 · f32
  assert out(lambda x, w: fp4jax.dot(x, w, recipe=recipes.nvfp4(out_dtype=jnp.bfloat16))) == jnp.bfloat16
  assert out(lambda x, w: fp4jax.dot(x, w, recipe="fp8", preferred_element_type=jnp.bfloat16)) == jnp.bfloat16
  # preferred_element_type wins over the recipe's out_dtype
  assert out(lambda x, w: fp4jax.dot(x, w, recipe=recipes.nvfp4(out_dtype=jnp.bfloat16),
                                     preferred_element_type=jnp.float32)) == jnp.float32
  dx, dw = jax.eval_shape(jax.grad(lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe="nvfp4", key=KEY)), (0, 1)),
                          x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------------
# The recipe's GEMMs one at a time
# ---------------------------------------------------------------------------------------------------

def _within_float32_summation(got, ref, a, b, err_msg):
  """|got - ref| <= 2 K u (|a| |b|): two float32 sums of the same K exact products in any order (u = 2^-24).
  The switched-off GEMM runs in another program than ``lax.dot_general``'s vjp, and XLA's CPU GEMM may sum
  it in another order there (seen on AMD EPYC: 77 of 1536 dw elements one ulp apart), so it is not pinned
  bit for bit."""
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  bound = 2 * a.shape[1] * 2.0 ** -24 * (a @ b)
  err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
  assert np.all(err <= bound), f"{err_msg}: {np.sum(err > bound)} elements past the float32 summation bound"


def test_switching_one_gemm_to_bf16_changes_exactly_that_gemm():
  x, w, dy = _normal(0, (64, 48)), _normal(1, (48, 32)), _normal(2, (64, 32))
  full = _value_and_grads(x, w, dy, KEY, recipes.nvfp4())
  exact = _exact_value_and_grads(x, w, dy)
  operands = ((x, w), (dy, w.T), (x.T, dy))     # each GEMM's (M, K) and (K, N) operands
  for i, gemm in enumerate(("fprop", "dgrad", "wgrad")):
    got = _value_and_grads(x, w, dy, KEY, recipes.nvfp4(**{gemm: "bf16"}))
    for j in range(3):
      if j == i:
        _within_float32_summation(got[j], exact[j], *operands[j], err_msg=f"{gemm} off, output {j}")
      else:
        np.testing.assert_array_equal(got[j], full[j], err_msg=f"{gemm} off, output {j}")
    assert _rel(full[i], exact[i]) > 0.01     # and quantization does change that GEMM when on


@pytest.mark.parametrize("size", [16, 32, 128])
def test_rht_cancels_in_the_weight_gradient(size):
  """RHT(xᵀ)·RHT(dyᵀ)ᵀ == xᵀ·dy without quantization (M·Mᵀ = I), to float32 rounding."""
  x, dy = _normal(0, (256, 24)), _normal(1, (256, 40))
  hi = jax.lax.Precision.HIGHEST

  @jax.jit
  def transformed_and_exact(x, dy):
    t = jnp.matmul(hadamard.rht(x.T, size=size), hadamard.rht(dy.T, size=size).T, precision=hi)
    return t, jnp.matmul(x.T, dy, precision=hi)

  transformed, exact = transformed_and_exact(x, dy)
  np.testing.assert_allclose(transformed, exact, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(exact))))


def test_rht_on_and_off_both_estimate_the_weight_gradient():
  x, w, dy = _normal(0, (128, 32)), _normal(1, (32, 32)), _normal(2, (128, 32))
  exact = _exact_value_and_grads(x, w, dy)[2]
  on = _value_and_grads(x, w, dy, KEY, recipes.nvfp4(stochastic_grad=False))[2]
  off = _value_and_grads(x, w, dy, KEY, recipes.nvfp4(stochastic_grad=False, rht=False))[2]
  assert _rel(on, exact) < 0.25 and _rel(off, exact) < 0.25
  assert not np.array_equal(on, off)


@pytest.mark.parametrize("preset, weight_2d", [("nvfp4", True), pytest.param("nvfp4", False, marks=pytest.mark.slow),
                                               ("fp8", True)])
def test_dgrad_weight_is_the_fprop_weight_transposed(preset, weight_2d):
  """x = I reads out the fprop weight; dy = I reads out the dgrad weight (both quantize exactly)."""
  k, n = 64, 48
  w = _normal(1, (k, n))
  recipe = recipes.get(preset).replace(weight_2d=weight_2d)
  w_fprop = jax.jit(lambda w: fp4jax.dot(jnp.eye(k), w, recipe=recipe))(w)            # (K, N)
  w_dgrad = _value_and_grads(jnp.zeros((n, k)), w, jnp.eye(n), KEY, recipe)[1].T       # (K, N)
  differ = float(jnp.mean(w_fprop != w_dgrad))
  if weight_2d:
    np.testing.assert_array_equal(w_dgrad, w_fprop)
  else:
    assert differ > 0.1, differ
  assert _rel(w_fprop, w) < 0.15 and _rel(w_dgrad, w) < 0.15


@pytest.mark.slow   # covered by test_dgrad_weight_is_the_fprop_weight_transposed[nvfp4-True]
@pytest.mark.parametrize("recipe, expected", [("nvfp4", True)] + [
    pytest.param(r, e, marks=pytest.mark.slow) for r, e in (
        ("fp8", True), ("nvfp4_bf16_fprop", False), (recipes.nvfp4(four_over_six="weights"), False))])
def test_weight_tiles_in_place_are_the_transposed_tiles(recipe, expected, monkeypatch):
  """w's tiles quantized in w's layout (K, N), fprop reading their transpose (``tiles_in_place``), against
  the twin that quantizes wᵀ for fprop and transposes the tiles for dgrad: the same residual bits and the
  same y, dx, dw. 4/6 tiles stay on the twin (their choice sums a tile's errors in its order)."""
  import sys
  dot_mod = sys.modules["fp4jax.dot"]
  recipe = recipes.get(recipe) if isinstance(recipe, str) else recipe
  in_place = dot_mod.tiles_in_place(recipe.roles)
  assert in_place == expected
  m, k, n = 128, 256, 128   # K != N: the two residual layouts differ in shape (fp8: whole 128-blocks)
  x, w, dy = _normal(0, (m, k)), _normal(1, (k, n), scale=3.0), _normal(2, (m, n))

  def value_and_grads():   # traced anew each time (``_value_and_grads`` would hit its jit cache)
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=KEY), x, w)
    return (y, *vjp(dy))

  res, out = dot_mod.residuals(recipe, x, w, KEY), jax.jit(value_and_grads)()
  asked = []
  monkeypatch.setattr(dot_mod, "tiles_in_place", lambda roles: asked.append(roles) or False)
  jax.clear_caches()   # the custom_vjp's traced passes are cached by function
  twin_res, twin = dot_mod.residuals(recipe, x, w, KEY), jax.jit(value_and_grads)()
  assert len(asked) >= 3 or not in_place   # the twin ran: residuals, the traced forward and backward passes
  as_bits = lambda a: np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize == 1 else np.asarray(a)
  if in_place:
    assert res.w_dgrad.shape == (k, n) and twin_res.w_dgrad.shape == (n, k)
    twin_w = fp4jax.transpose_tiles(twin_res.w_dgrad)
    for a, b in ((res.w_dgrad.data, twin_w.data), (res.w_dgrad.scale, twin_w.scale),
                 (res.w_dgrad.amax, twin_w.amax)):
      np.testing.assert_array_equal(as_bits(a), as_bits(b))
  for a, b in zip(out, twin):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding: unbiased gradients
# ---------------------------------------------------------------------------------------------------

def _unrounded(v_f32, q):
  """What q holds before E2M1 rounding (scaled and saturated, then decoded), and its SR variance.

  v_f32: the values quantized along the last axis; q: their nvfp4 QTensor (1x16 along the last axis).
  """
  s_b = q.scale.astype(jnp.float32)
  s_dec = 1.0 / nvfp4.global_encode_scale(q.amax)
  enc = jnp.repeat(jnp.minimum(1.0 / (s_b * s_dec), jnp.finfo(jnp.float32).max), 16, axis=-1)
  dec = jnp.repeat(nvfp4.decode_factor(q.scale, q.amax), 16, axis=-1)
  scaled = jnp.clip(v_f32 * enc, -6.0, 6.0)
  mag = jnp.abs(scaled)
  step = jnp.where(mag < 2, 0.5, jnp.where(mag < 4, 1.0, 2.0))
  p = (mag - jnp.floor(mag / step) * step) / step
  return scaled * dec, p * (1 - p) * (step * dec) ** 2


def _z_scores(samples_mean, ref, var, n):
  return np.asarray((samples_mean - ref) / jnp.sqrt(var / n + 1e-30))


@pytest.mark.slow   # covered by test_numerics_quantize.py::test_stochastic_rounding_unbiased_through_nvfp4
def test_stochastic_rounding_makes_dgrad_and_wgrad_unbiased():
  m, k, n_out, n_keys = 64, 32, 32, 512
  x, w, dy = _normal(0, (m, k)), _normal(1, (k, n_out)), _normal(2, (m, n_out))
  # 1. The operands the recipe uses, and dy's values scaled and saturated but not rounded.
  @jax.jit
  def references(x, w, dy):
    hi = jax.lax.Precision.HIGHEST
    w_q = fp4jax.dequantize(fp4jax.quantize(w.T, "nvfp4", tile=(16, 16))).T          # (K, N)
    dy_ref, dy_var = _unrounded(dy, fp4jax.quantize(dy, "nvfp4"))
    x_t = fp4jax.dequantize(quantize_rht_transposed(x, "nvfp4"))                     # (K, M), RNE
    dyt_ref, dyt_var = _unrounded(hadamard.rht(dy.T), quantize_rht_transposed(dy, "nvfp4"))   # (N, M)
    return (jnp.matmul(dy_ref, w_q.T, precision=hi), jnp.matmul(dy_var, (w_q ** 2).T, precision=hi),
            jnp.matmul(x_t, dyt_ref.T, precision=hi), jnp.matmul(x_t ** 2, dyt_var.T, precision=hi))

  dx_ref, dx_var, dw_ref, dw_var = references(x, w, dy)

  # 2. Mean gradients over many keys.
  def grads(recipe, key):
    return _value_and_grads(x, w, dy, key, recipe)[1:]
  keys = jax.random.split(jax.random.key(123), n_keys)
  dx_sr, dw_sr = jax.jit(jax.vmap(functools.partial(grads, recipes.nvfp4())))(keys)
  dx_mean, dw_mean = jnp.mean(dx_sr, 0), jnp.mean(dw_sr, 0)
  z_dx = _z_scores(dx_mean, dx_ref, dx_var, n_keys)
  z_dw = _z_scores(dw_mean, dw_ref, dw_var, n_keys)
  # 3. Unbiased: every element within 5 standard errors (2048 elements each: a false alarm has odds
  # ~1e-3), and the z-scores have unit scale. The 8-bit random numbers resolve the rounding
  # probability to 1/256, a bias below step/256 per element: ~sqrt(n_keys)/180 = 0.13 standard errors.
  assert np.max(np.abs(z_dx)) < 5.0, np.max(np.abs(z_dx))
  assert np.max(np.abs(z_dw)) < 5.0, np.max(np.abs(z_dw))
  assert 0.7 < np.mean(z_dx ** 2) < 1.3 and 0.7 < np.mean(z_dw ** 2) < 1.3
  # 4. Round-to-nearest is deterministic and biased: far outside the same bounds.
  dx_rne, dw_rne = grads(recipes.nvfp4(stochastic_grad=False), KEY)
  assert np.mean(_z_scores(dx_rne, dx_ref, dx_var, n_keys) ** 2) > 25
  assert np.mean(_z_scores(dw_rne, dw_ref, dw_var, n_keys) ** 2) > 25


# ---------------------------------------------------------------------------------------------------
# Residuals
# ---------------------------------------------------------------------------------------------------

def _residuals(recipe, x, w):
  vjp = jax.eval_shape(lambda x, w: jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=KEY),
                                            x, w)[1], x, w)
  return jax.tree_util.tree_leaves(vjp)


def _nbytes(leaves):
  return sum(int(np.prod(l.shape)) * jnp.dtype(l.dtype).itemsize for l in leaves
             if not jnp.issubdtype(l.dtype, jax.dtypes.prng_key))


def test_residuals_are_saved_quantized():
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
  bf16 = _nbytes(_residuals(recipes.bf16(), x, w))
  assert bf16 == 2 * (512 * 256 + 256 * 384)
  nv = _residuals(recipes.nvfp4(), x, w)
  assert _nbytes(nv) <= 0.35 * bf16, _nbytes(nv) / bf16
  # No unquantized copy of x or w (or their transposes) among the residuals (the two tensor amaxes: one (2,) array).
  big_floats = [l for l in nv if l.dtype in (jnp.bfloat16, jnp.float32) and np.prod(l.shape) > 2]
  assert not big_floats, big_floats
  # A GEMM left in bf16 keeps the operand it needs, and only that one.
  bf = jnp.dtype(jnp.bfloat16)
  saved = {(l.shape, l.dtype) for l in _residuals(recipes.nvfp4(wgrad="bf16"), x, w)}
  assert ((512, 256), bf) in saved and ((256, 384), bf) not in saved
  saved = {(l.shape, l.dtype) for l in _residuals(recipes.nvfp4(dgrad="bf16"), x, w)}
  assert ((256, 384), bf) in saved and ((512, 256), bf) not in saved
  assert _nbytes(_residuals(recipes.mxfp4(), x, w)) <= 0.35 * bf16


# ---------------------------------------------------------------------------------------------------
# Transformations and errors
# ---------------------------------------------------------------------------------------------------

# ~35 s on 2 loaded cores. By default fp4 dot layers are scanned over remat in tests/test_flax.py
# (test_linen_scan_over_remat_layers) and tests/test_models_lm.py (TestScanBlocks, remat=True).
@pytest.mark.slow
def test_scan_checkpoint_vmap_compose():
  layers, d = 3, 32
  ws = _normal(1, (layers, d, d), scale=d ** -0.5)
  x = _normal(0, (4, 16, d))
  recipe = recipes.nvfp4()

  def loss(ws, x, key, remat):
    def layer(h, w_and_key):
      w, k = w_and_key
      return jnp.tanh(fp4jax.dot(h, w, recipe=recipe, key=k)), None
    layer = jax.checkpoint(layer) if remat else layer
    h, _ = lax.scan(layer, x, (ws, jax.random.split(key, layers)))
    return jnp.mean(h ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=3)
  g_plain, g_remat = grad(ws, x, KEY, False), grad(ws, x, KEY, True)
  np.testing.assert_allclose(g_remat, g_plain, rtol=1e-5, atol=1e-7)
  assert not np.array_equal(g_plain, grad(ws, x, jax.random.key(8), False))   # the key matters
  # vmap over examples: each example is its own GEMM (its own amax), as a Python loop would do; the
  # batched float32 accumulation may differ from the unbatched one in the last bit.
  per_example = jax.jit(jax.vmap(lambda x, k: fp4jax.dot(x, ws[0], recipe=recipe, key=k)))
  one = jax.jit(lambda x, k: fp4jax.dot(x, ws[0], recipe=recipe, key=k))
  keys = jax.random.split(KEY, x.shape[0])
  got = per_example(x, keys)
  for i in range(x.shape[0]):
    np.testing.assert_allclose(got[i], one(x[i], keys[i]), rtol=1e-6, atol=1e-6)


def test_errors():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
  fp4jax.dot(x, w, recipe="nvfp4")             # the forward pass needs no key
  with pytest.raises(ValueError, match="needs random bits"):
    jax.grad(lambda w: jnp.sum(fp4jax.dot(x, w, recipe="nvfp4")))(w)
  assert "rngs={'fp4': key}" in MISSING_KEY_MESSAGE
  jax.grad(lambda w: jnp.sum(fp4jax.dot(x, w, recipe=recipes.nvfp4(stochastic_grad=False))))(w)
  with pytest.raises(ValueError, match="unknown recipe"):
    fp4jax.dot(x, w, recipe="nvfp5")
  with pytest.raises(TypeError, match="recipe must be an fp4jax.Recipe"):
    fp4jax.dot(x, w, recipe=None)
  with pytest.raises(ValueError, match="2-D weight"):
    fp4jax.dot(x, w[None], recipe="nvfp4")
  with pytest.raises(TypeError):
    fp4jax.dot_general(x, w[:16], DENSE, recipe="nvfp4")
