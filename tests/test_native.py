"""The native block-scaled GEMM (fp4jax.native) on the CPU.

- The layout conversion, checked by an independent decode: the float4_e2m1fn values (decoded by
  ml_dtypes, not fp4jax's E2M1 table) times their E4M3 scales, then the format's second level written
  out here in numpy float32, equal ``fp4jax.dequantize`` bit for bit, for 1x16 blocks, 16x16 tiles and
  their transpose (dgrad), the RHT'd SR wgrad operands, 4/6 and MS-EDEN (and DBQ).
- The native result equals the XLA path bit for bit on the CPU, where the block-scaled GEMM runs as its
  twin (the same exact products, one bf16 GEMM with float32 accumulation), for every format, under jit,
  and through value_and_grad of fp4jax.dot for every NVFP4 recipe preset.
- The native grouped GEMM (work items of tiles x groups) equals the XLA grouped path (lax.ragged_dot)
  per group within float32 summation order (a batched dot against a ragged one; bit for bit on order-free
  dyadic data), for each tiling, with empty groups and rows past the last group, and through
  value_and_grad of fp4jax.grouped_dot.
- jax.nn.scaled_matmul itself on the CPU, where this jax lowers it (0.10.2 does not: skipped).
- The default selection: native on compute capability 10.x only, FP4JAX_DEFAULT_IMPL overrides.
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import _native_compat as nc
from fp4jax import gemm, grouped, native
from fp4jax import dispatch
from fp4jax.quantizers import Quantizer

M, N, K = 48, 32, 256


def _x(seed, shape, scale=1.0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = inputs.normal(k1, shape, jnp.float32) * scale
  # a few large values so that blocks differ in scale and some scales are subnormal/large
  return x * jnp.where(inputs.uniform(k2, shape) < 0.02, 30.0, 1.0)


def _q(quantizer, x, seed=7):
  if quantizer.needs_key:
    return jax.jit(quantizer)(x, jax.random.key(seed))
  return jax.jit(quantizer)(x)


# ------------------------------------------------------------------------------- independent decode

def _decoded_products(op: native.Operand):
  """e2m1 · s per element from the native operand, in numpy float32 (ml_dtypes decodes float4)."""
  vals = np.asarray(op.values).astype(np.float32)
  scales = np.asarray(op.scales).astype(np.float32)
  assert op.values.dtype == jnp.float4_e2m1fn and op.scales.dtype == jnp.float8_e4m3fn
  assert scales.shape == (vals.shape[0], vals.shape[1] // 16)
  return vals, np.repeat(scales, 16, axis=1)


def _independent(q, op: native.Operand):
  """The values the native operand represents with q's second level, in each format's arithmetic."""
  vals, s = _decoded_products(op)
  f32 = np.float32
  if q.fmt == "nvfp4":
    factor = (s * f32(q.amax)) * f32(1.0 / (6.0 * q.bound))
  elif q.fmt == "nvfp4_eden":
    factor = s * f32(q.scale2)
  elif q.fmt == "nvfp4_dbq":
    factor = np.repeat(np.asarray(q.scale2, np.float32), 128, axis=1) * s
  else:
    raise AssertionError(q.fmt)
  return vals * factor


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


LAYOUTS = {
    "nvfp4 1x16": Quantizer("nvfp4"),
    "nvfp4 1x16 SR": Quantizer("nvfp4", stochastic=True),
    "nvfp4 16x16": Quantizer("nvfp4", tiled=True),
    "4/6 1x16": Quantizer("nvfp4", four_over_six=(256, "mse")),
    "4/6 16x16": Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse")),
    "MS-EDEN": Quantizer("nvfp4_eden"),
    "DBQ SR": Quantizer("nvfp4_dbq", stochastic=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_operand_decodes_to_dequantize(name):
  q = _q(LAYOUTS[name], _x(1, (M, K)))
  op = native.operand(q)
  assert op.values.shape == (M, K)
  np.testing.assert_array_equal(_bits(_independent(q, op)), _bits(fp4jax.dequantize(q)))


@pytest.mark.parametrize("four_over_six", [None, (256, "mse")])
def test_transposed_tiles_decode_to_the_transpose(four_over_six):
  """dgrad's weight: the fprop 16x16 tiles transposed (codes and scales only), each tile's scale
  repeated over its 16 rows of the transpose."""
  q = _q(Quantizer("nvfp4", tiled=True, four_over_six=four_over_six), _x(2, (N, K)))   # wᵀ (N, K)
  qt = fp4jax.transpose_tiles(q)                                                      # w (K, N)
  op = native.operand(qt)
  assert op.values.shape == (K, N)
  np.testing.assert_array_equal(_bits(_independent(qt, op)), _bits(fp4jax.dequantize(q).T))


@pytest.mark.parametrize("stochastic", [False, pytest.param(True, marks=pytest.mark.slow)])   # SR x RHT: test_native_equals_xla_path_bit_for_bit
def test_rht_wgrad_operand_is_taken_as_it_is(stochastic):
  """The paper's wgrad operand: RHT-16 along the tokens of xᵀ, then 1x16 along the tokens (the GEMM's K)."""
  quant = Quantizer("nvfp4", stochastic=stochastic, rht_size=16)
  x = _x(3, (K, M))                                                  # (tokens, features)
  q = jax.jit(quant.quantize_t)(x, jax.random.key(4))                # (M, K) along K
  op = native.operand(q)
  assert op.values.shape == (M, K)
  np.testing.assert_array_equal(_bits(_independent(q, op)), _bits(fp4jax.dequantize(q)))


def test_eden_rht_operand_decodes_to_dequantize():
  """Quartet II's backward operand: RHT-128 then MS-EDEN; its correction lives in the E4M3 scales and
  s_dec, so the native operand is the codes and scales as they are."""
  signs = fp4jax.numerics.eden.random_signs(jax.random.key(5), 128)
  q = jax.jit(Quantizer("nvfp4_eden").quantize_t)(_x(5, (K, M)), jax.random.key(6), signs)
  op = native.operand(q)
  np.testing.assert_array_equal(_bits(_independent(q, op)), _bits(fp4jax.dequantize(q)))


# ------------------------------------------------------------------------------- native == XLA path

PAIRS = {
    "nvfp4": (Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True)),
    "nvfp4 SR x RHT": (Quantizer("nvfp4", rht_size=16), Quantizer("nvfp4", stochastic=True, rht_size=16)),
    "4/6": (Quantizer("nvfp4", four_over_six=(256, "mse")),
            Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse"))),
    "4/6 x plain": (Quantizer("nvfp4", four_over_six=(256, "mae")), Quantizer("nvfp4")),
    "row-scaled": (Quantizer("nvfp4", row_scaled=True), Quantizer("nvfp4")),
    "MS-EDEN": (Quantizer("nvfp4_eden"), Quantizer("nvfp4_eden")),
    "DBQ": (Quantizer("nvfp4_dbq"), Quantizer("nvfp4_dbq", stochastic=True)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_native_equals_xla_path_bit_for_bit(name):
  qa, qb = PAIRS[name]
  a, b = _q(qa, _x(10, (M, K))), _q(qb, _x(11, (N, K), 0.05), seed=8)

  def both(backend):
    return jax.jit(lambda a, b: [gemm.matmul(a, b, impl=backend, out_dtype=d)
                                 for d in (jnp.float32, jnp.bfloat16)])(a, b)

  for got, want in zip(both("native"), both("xla")):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_native_eagerly():
  a, b = _q(Quantizer("nvfp4"), _x(16, (M, K))), _q(Quantizer("nvfp4", tiled=True), _x(17, (N, K)))
  np.testing.assert_array_equal(gemm.matmul(a, b, impl="native"),
                                gemm.matmul(a, b, impl="xla"))


def test_extreme_amaxes_take_the_split_factor():
  """apply_tensor_factor's power-of-two split for amax products past float32's range, natively too."""
  a, b = _q(Quantizer("nvfp4"), _x(12, (M, K), 1e-17)), _q(Quantizer("nvfp4"), _x(13, (N, K), 1e-18))
  assert float(a.amax) * float(b.amax) < 2.0 ** -100                 # the spec's factor would flush to 0
  run = lambda backend: jax.jit(lambda a, b: gemm.matmul(a, b, impl=backend))(a, b)
  got = run("native")
  np.testing.assert_array_equal(got, run("xla"))
  assert np.isfinite(np.asarray(got)).all() and np.count_nonzero(np.asarray(got)) > M * N // 2


# ------------------------------------------------------------------------------- grouped native == XLA path
# The grouped GEMM (fp4jax.gemm.grouped_matmul / grouped_matmul_t) with impl="native" runs the work items of
# fp4jax.native (tiles of T rows x groups, one batched block-scaled GEMM, its twin on the CPU) and must equal
# the XLA path (lax.ragged_dot on the same exact products) within float32 summation order, per group, with
# empty groups, random offsets and non-zero rows past the last group, for each tiling: one tile of all S rows (every group padded
# to S) and tiles of one or two chunks (many items per group, groups split across tiles).

E_G, A_G = 5, 16
TILINGS = {"one tile": native.Tiling(one_tile_groups=1 << 30),
           "tiles of A": native.Tiling(one_tile_groups=0, rows=A_G),
           "tiles of 2A": native.Tiling(one_tile_groups=0, rows=2 * A_G)}


def _sizes(seed, rows=A_G):
  """Random group sizes (multiples of rows, some empty) and S with one or two chunks past the last group."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, 4, E_G) * rows
  sizes[rng.integers(E_G)] = 0
  sizes[rng.integers(E_G)] += rows
  return jnp.asarray(sizes, jnp.int32), int(sizes.sum()) + int(rng.integers(1, 3)) * rows


def _chunks(quantizer, t_UxRxC, seed, method=None):
  """Each chunk (or group) of t quantized by itself (vmapped): rows past the groups keep their values."""
  f = quantizer if method is None else getattr(quantizer, method)
  if quantizer.needs_key:
    return jax.jit(jax.vmap(f))(t_UxRxC, jax.random.split(jax.random.key(seed), t_UxRxC.shape[0]))
  return jax.jit(jax.vmap(f))(t_UxRxC)


def _dyadic(seed, shape):
  """Values whose quantization and every sum of products are exact in float32 in any order: E2M1 grid
  values times 2^j per 16-block (j in 0..2), each block holding a ±6·2^j, so every block scale is
  112·2^j and each product a small multiple of 3136 (tests of the tiled wgrad, whose items are summed)."""
  rng = np.random.default_rng(seed)
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
  v = grid[rng.integers(0, 8, shape)] * rng.choice([-1.0, 1.0], shape)
  v.reshape(-1, 16)[:, 0] = 6.0
  j = rng.integers(0, 3, (*shape[:-1], shape[-1] // 16))
  v = v * np.repeat(2.0 ** j, 16, axis=-1)
  v.reshape(-1)[0] = 24.0      # the tensor amax: 24
  return jnp.asarray(v, jnp.float32)


ROWS_PAIRS = {   # (x's quantizer along K, the group operand's quantizer along K, K)
    "nvfp4 x tiles": (Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True), 64),
    "4/6": (Quantizer("nvfp4", four_over_six=(256, "mse")),
            Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse")), 64),
    "row-scaled": (Quantizer("nvfp4", row_scaled=True), Quantizer("nvfp4", tiled=True), 64),
    "SR x dgrad tiles": (Quantizer("nvfp4", stochastic=True), "transposed", 64),
    "MS-EDEN": (Quantizer("nvfp4_eden"), Quantizer("nvfp4_eden"), 128),
    "DBQ": (Quantizer("nvfp4_dbq", stochastic=True), Quantizer("nvfp4_dbq"), 256),
}


def _both(fn, *args):
  return [jax.jit(lambda *a: fn(*a, impl=i))(*args) for i in ("native", "xla")]


# By default nvfp4 and row-scaled on the tiling with the most items per group. Under -m slow: 4/6, MS-EDEN and
# DBQ (their tokens tests and test_native_equals_xla_path_bit_for_bit), the dgrad tiles and the other tilings
# (test_grouped_dot_value_and_grad_native_equals_xla[nvfp4] runs fprop and dgrad on the default tiling).
@pytest.mark.parametrize("name, tiling", [
    (n, t) if t == "tiles of A" and n in ("nvfp4 x tiles", "row-scaled")
    else pytest.param(n, t, marks=pytest.mark.slow)
    for n in ROWS_PAIRS for t in TILINGS])
def test_grouped_rows_native_equals_xla(name, tiling, monkeypatch):
  """fprop / dgrad: y (S, N), the rows ragged; rows past the last group give zeros on both paths. The same
  exact products, but a batched dot against a ragged one: XLA's CPU GEMMs may sum them in another order
  (seen: 1 element in 5120 one float32 ulp apart for MS-EDEN's K=128), so within float32 summation error
  (and one bfloat16 ulp for a bfloat16 output), never pinned."""
  monkeypatch.setattr(native, "TILING", TILINGS[tiling])
  qa, qb, k = ROWS_PAIRS[name]
  sizes, s = _sizes(zlib.crc32(name.encode()) % 1000)   # not hash(): Python salts it per process
  g = gemm.groups(sizes, s, A_G)
  a_U = _chunks(qa, _x(50, (s, k)).reshape(s // A_G, A_G, k), 51)
  if qb == "transposed":   # dgrad's weight: each group's fprop tiles (N, K) transposed to (K, N)
    b_E = jax.vmap(fp4jax.transpose_tiles)(_chunks(Quantizer("nvfp4", tiled=True), _x(52, (E_G, k, 32), .1), 53))
  else:
    b_E = _chunks(qb, _x(52, (E_G, 32, k), .1), 53)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    got, want = _both(lambda a, b, impl: gemm.grouped_matmul(a, b, g, out_dtype=out_dtype, impl=impl), a_U, b_E)
    assert got.dtype == want.dtype == out_dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    _summation_close(got, want, rtol=0.0 if out_dtype == jnp.float32 else 2.0 ** -8)
  assert np.count_nonzero(np.asarray(want)[:int(sizes.sum())]) > 0
  np.testing.assert_array_equal(np.asarray(got)[int(sizes.sum()):], 0.0)


TOKENS_PAIRS = {   # (x's quantizer along the tokens, dy's, dyadic data), both quantize_t of (A, C) chunks
    "nvfp4 RHT x SR RHT": (Quantizer("nvfp4", rht_size=16), Quantizer("nvfp4", stochastic=True, rht_size=16), False),
    "nvfp4 dyadic": (Quantizer("nvfp4"), Quantizer("nvfp4", stochastic=True), True),
    "nvfp4 SR dyadic": (Quantizer("nvfp4", stochastic=True), Quantizer("nvfp4", stochastic=True), True),
    "MS-EDEN": (Quantizer("nvfp4_eden"), Quantizer("nvfp4_eden"), False),
}


def _summation_close(got, want, rtol=0.0):
  """Equal within float32 summation error: a relative 1e-5 of the largest output (never pinned); ``rtol``
  adds an output rounding (a bfloat16 ulp, 2^-8)."""
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=1e-5 * np.max(np.abs(want)))


# By default the bit-exact nvfp4 case on every tiling and MS-EDEN on one; the others under -m slow (RHT and
# SR: test_native_equals_xla_path_bit_for_bit).
@pytest.mark.parametrize("name, tiling", [
    (n, t) if n == "nvfp4 dyadic" or (n == "MS-EDEN" and t == "tiles of 2A")
    else pytest.param(n, t, marks=pytest.mark.slow)
    for n in TOKENS_PAIRS for t in TILINGS])
def test_grouped_tokens_native_equals_xla(name, tiling, monkeypatch):
  """wgrad: dw (E, K, N), the contraction ragged; empty groups give 0. The native items contract their
  tile's rows with the others' block scales zeroed (and a group's items' partials summed), the XLA path
  one ragged dot: the same exact products summed in another order, so bit for bit on order-free (dyadic)
  data, within float32 summation error on any other."""
  qa, qb, dyadic = TOKENS_PAIRS[name]
  monkeypatch.setattr(native, "TILING", TILINGS[tiling])
  rows = 128 if qa.fmt == "nvfp4_eden" else A_G   # MS-EDEN: groups of 128 along the tokens
  sizes, s = _sizes(7, rows)
  g = gemm.groups(sizes, s, rows)
  data = _dyadic if dyadic else (lambda seed, shape: _x(seed, shape))
  a_U = _chunks(qa, data(60, (s, 48)).reshape(s // rows, rows, 48), 61, "quantize_t")    # (U, K, A)
  b_U = _chunks(qb, data(62, (s, 32)).reshape(s // rows, rows, 32), 63, "quantize_t")    # (U, N, A)
  got, want = _both(lambda a, b, impl: gemm.grouped_matmul_t(a, b, g, impl=impl), a_U, b_U)
  if dyadic:
    np.testing.assert_array_equal(got, want)
  else:
    _summation_close(got, want)
  assert np.count_nonzero(np.asarray(want)) > 0
  for e in np.flatnonzero(np.asarray(sizes) == 0):
    np.testing.assert_array_equal(np.asarray(got[e]), 0.0)


def test_grouped_tokens_dbq_native_equals_xla():
  """DBQ's wgrad: one block-scaled GEMM per 128-chunk of rows, added into its group's sum in order."""
  sizes, s = _sizes(9, rows=128)
  g = gemm.groups(sizes, s, 128)
  q = Quantizer("nvfp4_dbq", stochastic=True)
  a_U = _chunks(q, _x(70, (s, 32)).reshape(s // 128, 128, 32), 71, "quantize_t")
  b_U = _chunks(q, _x(72, (s, 48)).reshape(s // 128, 128, 48), 73, "quantize_t")
  got, want = _both(lambda a, b, impl: gemm.grouped_matmul_t(a, b, g, impl=impl), a_U, b_U)
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow   # covered by test_grouped_rows_native_equals_xla and test_grouped_tokens_native_equals_xla
def test_items_cover_every_row_once():
  """The work items: each row inside the groups in exactly one item of its group and its tile."""
  for seed in range(20):
    sizes, s = _sizes(seed)
    for tile in (16, 32, 48, s):
      s_pad = -(-s // tile) * tile
      it = jax.tree.map(np.asarray, native.items(sizes, s_pad, tile))
      assert it.lo.shape == (s_pad // tile + E_G - 1,)
      group_of = np.repeat(np.arange(E_G), np.asarray(sizes))
      owner = np.full(s_pad, -1)
      for lo, hi, t, e in zip(it.lo, it.hi, it.tile, it.group):
        if hi > lo:
          assert t * tile <= lo and hi <= (t + 1) * tile and (group_of[lo:hi] == e).all()
          assert (owner[lo:hi] == -1).all()
          owner[lo:hi] = e
      np.testing.assert_array_equal(owner[:len(group_of)], group_of)
      assert (owner[len(group_of):] == -1).all()


@pytest.mark.parametrize("recipe", ["nvfp4", pytest.param("nvfp4_4over6", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_row_scaled", marks=pytest.mark.slow),
                                    pytest.param("quartet2", marks=pytest.mark.slow),
                                    pytest.param("tetrajet2", marks=pytest.mark.slow)])
def test_grouped_dot_value_and_grad_native_equals_xla(recipe, monkeypatch):
  """y, dx and dw of fp4jax.grouped_dot with the grouped GEMMs native (FP4JAX_DEFAULT_IMPL=native, the
  default tiling: one tile for 5 experts) are the XLA path's within float32 summation error (test_grouped_tokens_native_equals_xla), with rows past the groups non-zero in x and dy."""
  a = grouped.alignment(recipe)
  sizes, s = _sizes(3, rows=a)
  x, w, dy = _x(80, (s, 64)), _x(81, (E_G, 64, 32), 0.1), _x(82, (s, 32))
  key = jax.random.key(5)

  def run():   # a new function per impl: jax reuses the trace of a function it has seen
    def f():
      y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key), x, w)
      return (y, *vjp(dy))
    return f

  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert "scaled_matmul" not in str(jax.make_jaxpr(run())())
  want = jax.jit(run())()
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  jaxpr = str(jax.make_jaxpr(run())())
  assert jaxpr.count("scaled_matmul") >= 3 and "ragged_dot" not in jaxpr   # fprop, dgrad, wgrad native
  got = jax.jit(run())()
  for g_, w_ in zip(got[:2], want[:2]):   # y, dx: test_grouped_rows_native_equals_xla's float32 order
    assert g_.dtype == w_.dtype
    _summation_close(np.asarray(g_, np.float32), np.asarray(w_, np.float32),
                     rtol=0.0 if g_.dtype == jnp.float32 else 2.0 ** -8)
  for e in range(E_G):
    _summation_close(got[2][e], want[2][e])


def test_grouped_pallas_and_mxfp4_are_refused():
  a = jax.tree.map(lambda l: l[None], _q(Quantizer("nvfp4"), _x(14, (16, K))))
  b = jax.tree.map(lambda l: l[None], _q(Quantizer("nvfp4", tiled=True), _x(15, (N, K))))
  g = gemm.groups(jnp.array([16]), 16, 16)
  with pytest.raises(ValueError, match="no Pallas grouped kernels: use impl='xla'"):
    gemm.grouped_matmul(a, b, g, impl="pallas")
  m = jax.tree.map(lambda l: l[None], fp4jax.quantize(_x(14, (16, K)), "mxfp4"))
  with pytest.raises(ValueError, match="fmt='mxfp4' has no native GEMM.*impl='xla'"):
    gemm.grouped_matmul(m, m, g, impl="native")
  with pytest.raises(ValueError, match="row-scaled nvfp4 lhs only"):
    r = jax.tree.map(lambda l: l[None], _q(Quantizer("nvfp4", row_scaled=True), _x(15, (N, K))))
    gemm.grouped_matmul(a, r, g, impl="native")


@pytest.mark.parametrize("cc,want", [((10, 0), "native"), ((12, 0), None), ((9, 0), None), (None, None)])
def test_grouped_default_is_native_on_cc_10_only(cc, want, monkeypatch):
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  for fmt in native.NVFP4_FORMATS:
    assert dispatch.native_grouped_default(fmt, capability=cc) == want
  assert dispatch.native_grouped_default("mxfp4", capability=cc) is None
  assert dispatch.native_grouped_default("mxfp8", capability=cc) is None   # until a device proof (test_mxfp8.py)
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert dispatch.native_grouped_default("nvfp4", capability=(10, 0)) is None
  assert set(dispatch.NATIVE_GROUPED_DEFAULTS) == set(native.FORMATS)


def _formats(recipe):
  roles = fp4jax.recipes.get(recipe).roles
  return {q.fmt for q in (roles.fprop_x, roles.dgrad_dy, roles.wgrad_x) if q is not None}


NVFP4_PRESETS = [n for n in fp4jax.recipes.NAMES if _formats(n) and _formats(n) <= set(native.NVFP4_FORMATS)]


def test_every_nvfp4_preset_is_covered():
  assert set(NVFP4_PRESETS) == set(fp4jax.recipes.NAMES) - {"mxfp4", "mxfp8", "fp8", "bf16"}


# nvfp4 in the default suite; the other presets (each scheme's GEMM: test_native_equals_xla_path_bit_for_bit) under -m slow.
_FAST = ("nvfp4",)


@pytest.mark.parametrize("recipe", [r if r in _FAST else pytest.param(r, marks=pytest.mark.slow)
                                    for r in NVFP4_PRESETS])
def test_dot_value_and_grad_native_equals_xla(recipe, monkeypatch):
  """y, dx and dw of fp4jax.dot with every GEMM native (FP4JAX_DEFAULT_IMPL=native) are the XLA path's,
  within float32 summation error: inside the whole jitted step XLA's CPU GEMMs of the two paths may sum
  in another order (measured: 1-2 of 16384 y elements differ by one ulp for nvfp4_no_2d,
  quartet2 and tetrajet2 at K=256, once each path is traced afresh; the GEMM alone is bit for bit,
  test_native_equals_xla_path_bit_for_bit)."""
  x, w, dy = _x(20, (128, 256)), _x(21, (256, 128), 0.05), _x(22, (128, 128))
  key = jax.random.key(3)

  def run():   # a new function per impl: jax reuses the trace of a function it has seen
    def f():
      y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
      return (y, *vjp(dy))
    return jax.jit(f)()

  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  want = run()
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  got = run()
  for g, w_ in zip(got, want):
    _summation_close(g, w_)


def test_native_runs_the_block_scaled_op_on_cuda_only():
  """The jaxpr holds jax's scaled_matmul (the CUDA branch) next to the twin; lowering for the CPU keeps
  only the twin."""
  a, b = _q(Quantizer("nvfp4"), _x(30, (M, K))), _q(Quantizer("nvfp4", tiled=True), _x(31, (N, K)))
  fn = lambda a, b: gemm.matmul(a, b, impl="native")
  assert "scaled_matmul" in str(jax.make_jaxpr(fn)(a, b))
  assert nc.BLOCK_SCALED_OP not in jax.jit(fn).lower(a, b).as_text()


@pytest.mark.skipif(not nc.cpu_lowering_exists(),
                    reason=f"jax {jax.__version__} registers no CPU lowering for jax.nn.scaled_matmul "
                           "(CUDA and ROCm only); the deviceless sm_100 compiles check it instead")
def test_jax_scaled_matmul_on_cpu_equals_xla_path():   # pragma: no cover - jax 0.11+
  a, b = _q(Quantizer("nvfp4"), _x(32, (M, K))), _q(Quantizer("nvfp4", tiled=True), _x(33, (N, K)))
  oa, ob = native.operand(a), native.operand(b)
  acc = nc.block_scaled_matmul(oa.values, ob.values, oa.scales, ob.scales)
  twin = native.block_scaled_matmul(oa, ob)
  np.testing.assert_allclose(acc, twin, rtol=1e-6, atol=1e-6 * float(jnp.abs(twin).max()))


# ------------------------------------------------------------------------------- errors

def test_mxfp4_and_fp8_are_not_native():
  a = fp4jax.quantize(_x(40, (M, K)), "mxfp4")
  with pytest.raises(ValueError, match="fmt='mxfp4' has no native GEMM.*impl='xla'"):
    gemm.matmul(a, a, impl="native")
  f = fp4jax.quantize(_x(40, (M, K)), "fp8")
  with pytest.raises(ValueError, match="fmt='fp8' has no native GEMM.*float32 per 128.*impl='xla'"):
    gemm.matmul(f, f, impl="native")


def test_row_scaled_rhs_is_refused():
  a = _q(Quantizer("nvfp4", row_scaled=True), _x(41, (M, K)))
  with pytest.raises(ValueError, match="row-scaled nvfp4 lhs only"):
    native.matmul(a, a)


def test_axis_must_be_the_contraction():
  q = fp4jax.quantize(_x(42, (K, M)), "nvfp4", axis=0)
  with pytest.raises(ValueError, match="quantized along axis -2"):
    gemm.matmul(q, q, impl="native")


# ------------------------------------------------------------------------------- selection

@pytest.mark.parametrize("cc,want", [((10, 0), "native"), ((10, 3), "native"), ((12, 0), None),
                                     ((9, 0), None), (None, None)])
def test_default_is_native_on_cc_10_only(cc, want, monkeypatch):
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  assert dispatch.native_default("nvfp4", capability=cc) == want
  assert dispatch.native_default("nvfp4_eden", capability=cc) == want
  assert dispatch.native_default("mxfp4", capability=cc) is None
  assert dispatch.native_default("fp8", capability=cc) is None
  assert dispatch.native_default("nvfp4_dbq", capability=cc) == want
  assert dispatch.native_default("mxfp8", capability=cc) is None   # until a device proof (test_mxfp8.py)


def test_env_overrides(monkeypatch):
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert dispatch.native_default("nvfp4", capability=(10, 0)) is None
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  assert dispatch.native_default("nvfp4", capability=(10, 0)) is None
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  for fmt in native.FORMATS:
    assert dispatch.native_default(fmt, capability=None) == "native"
  assert dispatch.native_default("mxfp4") is None
  # the quantize ops keep their evidence-based default; every GEMM runs native
  assert dispatch.default_impl("quantize_1d", "nvfp4") == "xla" and dispatch.choose("quantize_1d", "nvfp4") == "xla"
  assert dispatch.choose("scaled_matmul", "nvfp4") == dispatch.choose("grouped_matmul", "nvfp4") == "native"
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "fast")
  with pytest.raises(ValueError, match="'xla', 'pallas', 'native'"):
    dispatch.native_default("nvfp4")


def _impl_of_the_primitive(fn, *args):
  traced = lambda *a: fn(*a)   # a new function per trace: jax caches traces
  eqns = jax.make_jaxpr(traced)(*args).jaxpr.eqns
  return [e.params["impl"] for e in eqns if str(e.primitive) == "fp4jax_scaled_matmul"]


def test_public_scaled_matmul_defaults_to_native_only_for_two_d_operands(monkeypatch):
  """fp4jax.scaled_matmul(impl=None) runs the native GEMM where it is the default (forced here) for 2-D
  operands; a (..., M, K) lhs, which the native GEMM does not take, runs the primitive's default instead;
  an explicit impl="native" with it gets native.check's error."""
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  a, b = _q(Quantizer("nvfp4"), _x(45, (M, K))), _q(Quantizer("nvfp4", tiled=True), _x(46, (N, K)))
  assert _impl_of_the_primitive(fp4jax.scaled_matmul, a, b) == []            # native: no primitive
  np.testing.assert_array_equal(fp4jax.scaled_matmul(a, b), native.matmul(a, b))
  a3 = _q(Quantizer("nvfp4"), _x(47, (2, M, K)))
  assert _impl_of_the_primitive(fp4jax.scaled_matmul, a3, b) == ["xla"]
  np.testing.assert_array_equal(fp4jax.scaled_matmul(a3, b), fp4jax.scaled_matmul(a3, b, impl="xla"))
  with pytest.raises(ValueError, match="2-D operands"):
    fp4jax.scaled_matmul(a3, b, impl="native")


def test_every_native_format_has_a_recorded_choice():
  assert set(dispatch.NATIVE_DEFAULTS) == set(native.FORMATS)
  for fmt, choice in dispatch.NATIVE_DEFAULTS.items():
    assert choice.basis and choice.missing
    assert choice.default == (fmt in native.NVFP4_FORMATS)   # MXFP8: off until a device proves it


def test_this_cpu_is_not_a_native_device():
  assert not dispatch.native_device()
  assert nc.cuda_compute_capability() is None

