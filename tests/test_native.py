"""The native block-scaled GEMM (fp4jax.native) on the CPU.

- The layout conversion, checked by an independent decode: the float4_e2m1fn values (decoded by
  ml_dtypes, not fp4jax's E2M1 table) times their E4M3 scales, then the format's second level written
  out here in numpy float32, equal ``fp4jax.dequantize`` bit for bit, for 1x16 blocks, 16x16 tiles and
  their transpose (dgrad), the RHT'd SR wgrad operands, 4/6 and MS-EDEN (and DBQ).
- The native result equals the XLA path bit for bit on the CPU, where the block-scaled GEMM runs as its
  twin (the same exact products, one bf16 GEMM with float32 accumulation), for every format, under jit,
  with group sizes, and through value_and_grad of fp4jax.dot for every NVFP4 recipe preset.
- jax.nn.scaled_matmul itself on the CPU, where this jax lowers it (0.10.2 does not: skipped).
- The default selection: native on compute capability 10.x only, FP4JAX_DEFAULT_IMPL overrides.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _native_compat as nc
from fp4jax import gemm, native
from fp4jax.primitives import impl
from fp4jax.quantizers import Quantizer

M, N, K = 48, 32, 256


def _x(seed, shape, scale=1.0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, shape, jnp.float32) * scale
  # a few large values so that blocks differ in scale and some scales are subnormal/large
  return x * jnp.where(jax.random.uniform(k2, shape) < 0.02, 30.0, 1.0)


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


@pytest.mark.parametrize("stochastic", [False, True])
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


def test_grouped_gemm_is_xla_only():
  """The grouped GEMM (traced group sizes) has no native form; impl='native' says so and names 'xla'."""
  a = jax.tree.map(lambda l: l[None], _q(Quantizer("nvfp4"), _x(14, (16, K))))
  b = jax.tree.map(lambda l: l[None], _q(Quantizer("nvfp4", tiled=True), _x(15, (N, K))))
  with pytest.raises(ValueError, match="impl='xla'"):
    gemm.grouped_matmul(a, b, gemm.groups(jnp.array([16]), 16, 16), impl="native")


def _formats(recipe):
  roles = fp4jax.recipes.get(recipe).roles
  return {q.fmt for q in (roles.fprop_x, roles.dgrad_dy, roles.wgrad_x) if q is not None}


NVFP4_PRESETS = [n for n in fp4jax.recipes.NAMES if _formats(n) and _formats(n) <= set(native.FORMATS)]


def test_every_nvfp4_preset_is_covered():
  assert set(NVFP4_PRESETS) == set(fp4jax.recipes.NAMES) - {"mxfp4", "mxfp8", "fp8", "bf16"}


# One preset per scheme and weight layout in the default suite (seconds each); the others under -m slow.
_FAST = ("nvfp4", "nvfp4_no_2d", "nvfp4_4over6", "quartet2", "tetrajet2")


@pytest.mark.parametrize("recipe", [r if r in _FAST else pytest.param(r, marks=pytest.mark.slow)
                                    for r in NVFP4_PRESETS])
def test_dot_value_and_grad_native_equals_xla(recipe, monkeypatch):
  """y, dx and dw of fp4jax.dot with every GEMM native (FP4JAX_DEFAULT_IMPL=native) are the XLA path's."""
  x, w, dy = _x(20, (128, 256)), _x(21, (256, 128), 0.05), _x(22, (128, 128))
  key = jax.random.key(3)

  def run():
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))

  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "xla")
  want = jax.jit(run)()
  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "native")
  got = jax.jit(run)()
  for g, w_ in zip(got, want):
    np.testing.assert_array_equal(g, w_)


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

def test_mxfp4_is_not_native():
  a = fp4jax.quantize(_x(40, (M, K)), "mxfp4")
  with pytest.raises(ValueError, match="fmt='mxfp4' has no native GEMM.*impl='xla'"):
    gemm.matmul(a, a, impl="native")


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
  monkeypatch.delenv(impl.DEFAULT_IMPL_ENV, raising=False)
  assert impl.default_gemm_backend("nvfp4", capability=cc) == want
  assert impl.default_gemm_backend("nvfp4_eden", capability=cc) == want
  assert impl.default_gemm_backend("mxfp4", capability=cc) is None
  assert impl.default_gemm_backend("fp8", capability=cc) is None
  assert impl.default_gemm_backend("nvfp4_dbq", capability=cc) == want


def test_env_overrides(monkeypatch):
  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "xla")
  assert impl.default_gemm_backend("nvfp4", capability=(10, 0)) is None
  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "pallas")
  assert impl.default_gemm_backend("nvfp4", capability=(10, 0)) is None
  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "native")
  for fmt in native.FORMATS:
    assert impl.default_gemm_backend(fmt, capability=None) == "native"
  assert impl.default_gemm_backend("mxfp4") is None
  # the primitives (quantize, the op-level scaled matmul) keep their evidence-based default
  assert impl.default_impl("quantize_1d", "nvfp4") == "xla"
  assert impl.resolve_impl(None, "nvfp4") is None
  monkeypatch.setenv(impl.DEFAULT_IMPL_ENV, "fast")
  with pytest.raises(ValueError, match="'xla', 'pallas', 'native'"):
    impl.default_gemm_backend("nvfp4")


def test_every_native_format_has_a_recorded_choice():
  assert set(impl.NATIVE_DEFAULTS) == set(native.FORMATS)
  for choice in impl.NATIVE_DEFAULTS.values():
    assert choice.basis and choice.missing


def test_this_cpu_is_not_a_native_device():
  assert not impl.native_device()
  assert nc.cuda_compute_capability() is None


def test_former_names_still_work():
  """gemm.scaled_matmul(backend=) and native.scaled_matmul are gemm.matmul(impl=) and native.matmul."""
  a, b = _q(Quantizer("nvfp4"), _x(43, (M, K))), _q(Quantizer("nvfp4", tiled=True), _x(44, (N, K)))
  np.testing.assert_array_equal(gemm.scaled_matmul(a, b, backend="native"), gemm.matmul(a, b, impl="native"))
  assert native.scaled_matmul is native.matmul
  with pytest.raises(ValueError, match="former name"):
    gemm.matmul(a, b, impl="xla", backend="native")
