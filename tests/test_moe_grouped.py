"""fp4jax.grouped_dot against its contract: per expert e, fp4jax.dot(X_e, w[e], key=fold_in(key, e)),
value, dx and dw bit for bit, for nvfp4, mxfp4, quartet2 and tetrajet2 (and the unquantized recipe)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import grouped, random_bits

RECIPES = ("nvfp4", "mxfp4", "quartet2", "tetrajet2")
PACKED = fp4jax.recipes.nvfp4(sr_bits="packed", name="nvfp4_packed")   # the packed SR bits (Recipe.sr_bits)


def _case(recipe, counts, k=64, n=48, seed=0):
  """Sorted rows with each expert's segment padded to the recipe's alignment, and the per-expert tokens."""
  a = grouped.alignment(recipe)
  rng = np.random.default_rng(seed)
  sizes = [-(-c // a) * a for c in counts]
  s = sum(sizes) + a            # one spare chunk past the groups
  x = np.zeros((s, k), np.float32)
  start, tokens = 0, []
  for c, size in zip(counts, sizes):
    block = rng.standard_normal((c, k)).astype(np.float32) * rng.uniform(0.5, 4)
    x[start:start + c] = block
    tokens.append((start, c))
    start += size
  w = (rng.standard_normal((len(counts), k, n)) * 0.1).astype(np.float32)
  dy = rng.standard_normal((s, n)).astype(np.float32)
  for (st, c), size in zip(tokens, sizes):
    dy[st + c:st + size] = 0.0     # padded rows get no cotangent (the model never reads them)
  dy[sum(sizes):] = 0.0
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), jnp.asarray(dy), tokens


# nvfp4 ~15 s (one compile per expert's fp4jax.dot); the others ~20-140 s each. The packed
# SR layout (Recipe.sr_bits) reads each expert's window of its own packed draw, as the default layout does.
@pytest.mark.slow   # covered by test_random_groups_and_rows_past_the_end[nvfp4]
@pytest.mark.parametrize("recipe", [r if r == "nvfp4" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES]
                         + [pytest.param(PACKED, marks=pytest.mark.slow, id="nvfp4_packed")])
def test_grouped_equals_per_expert_dots(recipe):
  small = recipe in ("nvfp4", PACKED)
  counts = (5, 0, 21) if small else (5, 0, 21, 16) if recipe == "mxfp4" else (5, 0, 130)
  x, w, sizes, dy, tokens = _case(recipe, counts, k=32 if small else 64)
  key = jax.random.key(7)

  def grouped_loss(x, w):
    return jnp.sum(grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key) * dy)

  y = jax.jit(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key))(x, w)
  dx, dw = jax.jit(jax.grad(grouped_loss, argnums=(0, 1)))(x, w)
  for e, (start, c) in enumerate(tokens):
    if c == 0:
      np.testing.assert_array_equal(dw[e], 0.0)
      continue
    x_e, dy_e = x[start:start + c], dy[start:start + c]
    key_e = jax.random.fold_in(key, e)
    f = lambda x_e, w_e: fp4jax.dot(x_e, w_e, recipe=recipe, key=key_e)
    y_e, vjp = jax.vjp(f, x_e, w[e])
    dx_e, dw_e = vjp(dy_e)
    np.testing.assert_array_equal(np.asarray(y[start:start + c]), np.asarray(y_e), err_msg=f"y of expert {e}")
    np.testing.assert_array_equal(np.asarray(dx[start:start + c]), np.asarray(dx_e), err_msg=f"dx of {e}")
    # dw sums the expert's c tokens in float32, the grouped GEMM over its padded window: the same products, but
    # the CPU's GEMM may block the sum differently (seen on AMD for quartet2, 136 of 3072 elements at 3.8e-6):
    # within c roundings of the largest element, far below what a wrong code or scale would move
    dw_e = np.asarray(dw_e)
    np.testing.assert_allclose(np.asarray(dw[e]), dw_e, rtol=0, atol=4 * c * np.finfo(np.float32).eps
                               * np.abs(dw_e).max(), err_msg=f"dw of expert {e}")


def test_unquantized_is_ragged_dot():
  x, w, sizes, _, tokens = _case("bf16", (3, 4, 0, 2))
  y = grouped.grouped_dot(x, w, sizes, recipe="bf16")
  for e, (start, c) in enumerate(tokens):
    np.testing.assert_allclose(y[start:start + c], x[start:start + c] @ w[e], rtol=1e-6, atol=1e-6)


def test_misaligned_groups_are_refused():
  with pytest.raises(ValueError, match="multiple of 16"):
    grouped.grouped_dot(jnp.zeros((20, 16)), jnp.zeros((2, 16, 16)), jnp.array([4, 16]), recipe="nvfp4")


def test_window_is_a_rectangle_of_the_full_draw():
  key = jax.random.key(3)
  for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
    full = jax.random.bits(key, (48, 40), dtype)
    window = random_bits.Window.of(key, (48, 40), (16, 8), (16, 24))
    np.testing.assert_array_equal(random_bits.bits(window, (16, 24), dtype), full[16:32, 8:32])
  scale_bits = jax.random.bits(key, (40, 3), jnp.uint16)     # one per 16 along the last axis
  window = random_bits.Window.of(key, (40, 48), (0, 16), (40, 16))
  np.testing.assert_array_equal(random_bits.bits(window, (40, 1), jnp.uint16), scale_bits[:, 1:2])


def _random_case(recipe, n_experts, seed, k=64, n=48):
  """Random group sizes (multiples of the alignment, some empty), so random group offsets, every row of a
  group non-zero, and large non-zero rows past the last group in x and in dy."""
  a = grouped.alignment(recipe)
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, 4, n_experts) * a
  sizes[rng.integers(n_experts)] = max(int(sizes.max()), a)   # at least one expert has rows
  past = int(rng.integers(1, 3)) * a
  s = int(sizes.sum()) + past
  x = rng.standard_normal((s, k)).astype(np.float32) * rng.uniform(0.5, 4)
  dy = rng.standard_normal((s, n)).astype(np.float32)
  x[s - past:] *= 100.0                     # past the groups: they must reach no expert's amax
  dy[s - past:] *= 100.0
  w = (rng.standard_normal((n_experts, k, n)) * 0.1).astype(np.float32)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), jnp.asarray(dy), starts, sizes, past


def _check_per_expert(recipe, x, w, sizes, dy, starts, sizes_np, past, key):
  def grouped_loss(x, w):
    return jnp.sum(grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key) * dy)

  y = jax.jit(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key))(x, w)
  dx, dw = jax.jit(jax.grad(grouped_loss, argnums=(0, 1)))(x, w)
  s = x.shape[0]
  np.testing.assert_array_equal(np.asarray(y[s - past:]), 0.0, err_msg="y past the last group")
  np.testing.assert_array_equal(np.asarray(dx[s - past:]), 0.0, err_msg="dx past the last group")
  for e, (start, size) in enumerate(zip(starts, sizes_np)):
    if size == 0:
      np.testing.assert_array_equal(dw[e], 0.0)
      continue
    rows = slice(int(start), int(start + size))
    key_e = jax.random.fold_in(key, e)
    y_e, vjp = jax.vjp(lambda x_e, w_e: fp4jax.dot(x_e, w_e, recipe=recipe, key=key_e), x[rows], w[e])
    dx_e, dw_e = vjp(dy[rows])
    np.testing.assert_array_equal(np.asarray(y[rows]), np.asarray(y_e), err_msg=f"y of expert {e}")
    np.testing.assert_array_equal(np.asarray(dx[rows]), np.asarray(dx_e), err_msg=f"dx of expert {e}")
    # dw sums the expert's c tokens in float32, the grouped GEMM over its padded window: the same products, but
    # the CPU's GEMM may block the sum differently (seen on AMD for quartet2, 136 of 3072 elements at 3.8e-6):
    # within c roundings of the largest element, far below what a wrong code or scale would move
    dw_e = np.asarray(dw_e)
    np.testing.assert_allclose(np.asarray(dw[e]), dw_e, rtol=0, atol=4 * c * np.finfo(np.float32).eps
                               * np.abs(dw_e).max(), err_msg=f"dw of expert {e}")


# Random sizes and offsets, rows past the groups in x and dy (rows past the last group once leaked into its amax): nvfp4 in the default
# suite, the other recipes under -m slow.
@pytest.mark.parametrize("recipe", [r if r == "nvfp4" else pytest.param(r, marks=pytest.mark.slow)
                                    for r in RECIPES])
def test_random_groups_and_rows_past_the_end(recipe):
  case = _random_case(recipe, 3, seed=31, k=32 if recipe == "nvfp4" else 128)
  _check_per_expert(recipe, *case, key=jax.random.key(11))


# The roles beyond FP4: fp8 (1x128 blocks, 128x128 weight tiles), mxfp8 and row-scaled nvfp4
# activations. Their quantization is each expert's, bit for bit; fp8's and mxfp8's products are float32 (not
# exact in bfloat16), so the grouped GEMM may sum them in another order than a dense float32 dot: compared
# to a bound of float32 summation error (a relative 1e-5 of the largest output), never pinned.
@pytest.mark.parametrize("recipe", [pytest.param("nvfp4_row_scaled", marks=pytest.mark.slow),
                                    pytest.param("fp8", marks=pytest.mark.slow),   # ~34 s idle; the per-expert dots run by default
                                    pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_every_role_of_dot(recipe):
  case = _random_case(recipe, 3, seed=7, k=128)
  if recipe == "nvfp4_row_scaled":
    _check_per_expert(recipe, *case, key=jax.random.key(2))
    return
  x, w, sizes, dy, starts, sizes_np, past = case
  f = lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe)
  y, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(dy)
  np.testing.assert_array_equal(np.asarray(y[x.shape[0] - past:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dx[x.shape[0] - past:]), 0.0)
  for e, (start, size) in enumerate(zip(starts, sizes_np)):
    if size == 0:
      np.testing.assert_array_equal(dw[e], 0.0)
      continue
    rows = slice(int(start), int(start + size))
    y_e, vjp_e = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe=recipe), x[rows], w[e])
    dx_e, dw_e = vjp_e(dy[rows])
    for name, got, want in (("y", y[rows], y_e), ("dx", dx[rows], dx_e), ("dw", dw[e], dw_e)):
      want = np.asarray(want)
      np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.max(np.abs(want)),
                                 err_msg=f"{name} of expert {e}")


def test_row_scaled_stochastic_roles_are_refused():
  q = fp4jax.quantizers.Quantizer("nvfp4", row_scaled=True, stochastic=True)
  roles = dataclasses.replace(fp4jax.recipes.get("nvfp4").roles, dgrad_dy=q)
  with pytest.raises(ValueError, match="row-scaled dgrad_dy with stochastic rounding"):
    grouped.grouped_dot(jnp.zeros((16, 16)), jnp.zeros((1, 16, 16)), jnp.array([16]), recipe=roles)


@pytest.mark.parametrize("recipe", ["nvfp4"] + [pytest.param(r, marks=pytest.mark.slow)
                                                for r in ("fp8", "quartet2", "tetrajet2")])
def test_experts_quantized_ahead_give_the_same_values_and_gradients(recipe):
  """``quantize_experts`` (what each device runs on its own experts before their gather) is bit for bit the
  weight quantization grouped_dot runs itself: y, dx and dw identical (dw goes to the weight, as without it)."""
  rng = np.random.default_rng(0)
  x_SxK = jnp.asarray(rng.standard_normal((512, 32)), jnp.bfloat16)
  w_ExKxN = jnp.asarray(rng.standard_normal((4, 32, 48)), jnp.bfloat16)
  sizes_E = jnp.array([128, 0, 256, 128], jnp.int32)
  key = jax.random.key(1)

  def loss(x, w, ahead):
    w = grouped.quantize_experts(w, recipe=recipe) if ahead else w
    y = grouped.grouped_dot(x, w, sizes_E, recipe=recipe, key=key)
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  (_, y), (dx, dw) = grad(x_SxK, w_ExKxN, False)
  (_, y_ahead), (dx_ahead, dw_ahead) = grad(x_SxK, w_ExKxN, True)
  for got, want in ((y_ahead, y), (dx_ahead, dx), (dw_ahead, dw)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp8", "bf16"])
def test_experts_are_not_quantized_ahead_for_a_recipe_that_reads_the_weight(recipe):
  """mxfp4 and mxfp8 quantize w again along N for dgrad (no 2D tiles), bf16 quantizes nothing: the weight itself
  must reach the dot, and quantize_experts says so."""
  assert not fp4jax.can_quantize_weight(recipe)
  with pytest.raises(ValueError, match="can_quantize_weight"):
    grouped.quantize_experts(jnp.zeros((2, 32, 32), jnp.bfloat16), recipe=recipe)


def test_experts_quantized_for_another_recipe_are_refused():
  q = grouped.quantize_experts(jnp.ones((2, 32, 32), jnp.bfloat16), recipe="nvfp4")
  with pytest.raises(ValueError, match="quantized for recipe 'nvfp4'"):
    grouped.grouped_dot(jnp.ones((128, 32), jnp.bfloat16), q, jnp.array([128, 0]), recipe="fp8")


def test_each_quantize_pass_is_one_op_over_all_experts():
  """The experts' quantizes are each one op over every chunk of every expert, with no loop: the wgrad's RHT-
  transposed quantize of x and of dy one fp4jax_quantize_rht_t each (a kernel's grid over the chunks, not one
  launch per chunk or expert), and each chunk's expert found without a search loop: the traced program has no
  loop (on a GPU a loop runs its body's kernels once per trip)."""
  x, w, sizes, dy, _ = _case("nvfp4", (5, 0, 21, 16), k=32)
  key = jax.random.key(7)

  def fn(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe="nvfp4", key=key), x, w)
    return (y, *vjp(dy.astype(y.dtype)))

  jaxpr = str(jax.make_jaxpr(fn)(x, w, dy))
  assert jaxpr.count("fp4jax_quantize_rht_t[") == 2
  assert "while[" not in jaxpr and "scan[" not in jaxpr
