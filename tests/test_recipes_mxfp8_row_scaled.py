"""MXFP8 as a recipe of fp4jax.dot and row-scaled NVFP4 activations, bit for bit against numpy transcriptions
of docs/NUMERICS.md ("MXFP8 recipe", "Row-scaled NVFP4 activations") written here from the contract, not
from fp4jax's code."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import gemm, recipes, reference
from fp4jax.dot import residuals
from fp4jax.numerics import e2m1, mxfp8
from fp4jax.quantizers import Quantizer
from test_moe_ep_trace import _walk

F32 = np.float32


# ------------------------------------------------------------------------------------ numpy transcriptions

def e4m3_rne(v):
  """Round float32 v to E4M3 (3 mantissa bits, min normal 2^-6, subnormal step 2^-9), ties to even,
  saturating at ±448."""
  v = np.asarray(v, np.float64)
  a = np.abs(v)
  e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  quantum = np.where(a >= 2.0 ** -6, 2.0 ** (e - 3), 2.0 ** -9)
  q = np.rint(a / quantum) * quantum          # np.rint: half to even
  return (np.sign(v) * np.minimum(q, 448.0)).astype(F32)


def mx_scale_byte(amax):
  """E8M0 byte of amax/448 (float32 quotient) rounded up to a power of two; 0 for amax 0; at most 254."""
  v = (np.asarray(amax, F32) / F32(448.0)).astype(np.float64)
  out = np.zeros(v.shape, np.int64)
  nz = v > 0
  out[nz] = np.clip(np.ceil(np.log2(v[nz])) + 127, 0, 254)
  return out


def mxfp8_quantize(t):
  """(E4M3 elements float32, scale bytes) of t (R, C) in blocks of 32 along C."""
  t = np.asarray(t, F32)
  blocks = t.reshape(t.shape[0], -1, 32)
  byte = mx_scale_byte(np.max(np.abs(blocks), axis=-1))
  scaled = blocks.astype(np.float64) * 2.0 ** (127 - byte)[..., None]
  return e4m3_rne(scaled.astype(F32)).reshape(t.shape), byte


def mxfp8_values(t):
  elems, byte = mxfp8_quantize(t)
  blocks = elems.reshape(elems.shape[0], -1, 32).astype(np.float64)
  return (blocks * 2.0 ** (byte.astype(np.float64) - 127)[..., None]).reshape(elems.shape)


E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_rne(v):
  """E2M1 values of v (already clipped to ±6), nearest with ties to the even code."""
  a = np.abs(np.asarray(v, np.float64))
  idx = np.abs(a[..., None] - E2M1_GRID).argmin(-1)          # nearest; on a tie the lower index...
  lower = np.searchsorted(E2M1_GRID, a, side="right") - 1
  lower = np.clip(lower, 0, 6)
  tie = np.isclose(a - E2M1_GRID[lower], E2M1_GRID[np.minimum(lower + 1, 7)] - a, rtol=0, atol=0) & (a < 6)
  idx = np.where(tie, np.where(lower % 2 == 0, lower, lower + 1), idx)   # ...unless the upper code is even
  return np.copysign(E2M1_GRID[idx], v)


def nvfp4_row(row, amax):
  """(E2M1 values, E4M3 block scales) of one row quantized in 1x16 blocks with second-level amax ``amax``
  (NVFP4 spec §2 order, float32 arithmetic)."""
  row = np.asarray(row, F32).reshape(-1, 16)
  amax = F32(amax)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s_enc = np.minimum(F32(2688.0) / amax, F32(np.finfo(F32).max))
    if amax == 0 or s_enc == 0:
      s_enc = F32(1.0)
    s_dec = F32(1.0) / s_enc
    amax_b = np.max(np.abs(row), axis=-1)
    s_b = e4m3_rne(np.minimum(amax_b * (s_enc * F32(1.0 / 6.0)), F32(np.finfo(F32).max)))
    enc = np.minimum(F32(1.0) / (s_b * s_dec), F32(np.finfo(F32).max)).astype(F32)
    scaled = np.clip((row * enc[:, None]).astype(F32), -6, 6)
  return e2m1_rne(scaled).reshape(-1), s_b


# ------------------------------------------------------------------------------------ MXFP8

def _exact_operands():
  """x (64, 96), w (96, 64), dy (64, 64) whose MXFP8 GEMMs are exact in float32 in any order: every 32-block
  (along either axis) holds a ±4, so each scale is 2^-6 and the elements are integers times 2^-6 up to 256,
  while E4M3 still rounds (17 -> 16, 19 -> 20, ...)."""
  def operand(key, shape):
    t = np.asarray(jax.random.randint(key, shape, -255, 256), np.float64) / 64
    i, j = np.indices(shape)
    return np.where((i - j) % 32 == 0, 4.0 * np.sign(t + 0.5), t).astype(F32)
  return operand(jax.random.key(2), (64, 96)), operand(jax.random.key(3), (96, 64)), operand(jax.random.key(4), (64, 64))


class TestMxfp8Recipe:

  def test_is_a_named_recipe_with_the_ocp_layout(self):
    r = recipes.get("mxfp8")
    assert (r.fprop, r.dgrad, r.wgrad) == ("mxfp8",) * 3 and r.name == "mxfp8"
    roles = r.roles
    for q in roles.quantizers:
      assert q == Quantizer("mxfp8")          # 1x32 blocks, nearest, no RHT, no tiles
    assert isinstance(roles.dgrad_w, Quantizer)   # w re-quantized along N for dgrad: no transposed reuse
    assert not r.needs_key

  def test_each_role_quantizes_in_its_gemms_orientation(self):
    x = inputs.normal(jax.random.key(0), (64, 96)) * 3
    x = x.at[3, :32].set(0.0).at[5, 40].set(1e4).at[7, 64:].multiply(1e-30)   # a zero, a huge, a tiny block
    w = inputs.normal(jax.random.key(1), (96, 64))
    roles = recipes.mxfp8().roles
    res = residuals("mxfp8", x, w)
    cases = [(roles.fprop_x(x), x), (roles.fprop_w(w.T), w.T),            # fprop: along K
             (res.w_dgrad, w),                                             # dgrad: w (K, N) along N
             (res.x_wgrad, x.T)]                                           # wgrad: xᵀ (K, M) along M
    for q, t in cases:
      elems, byte = mxfp8_quantize(np.asarray(t))
      np.testing.assert_array_equal(np.asarray(q.data, np.float32).view(np.uint32), elems.view(np.uint32))
      np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)), byte)

  def test_dot_and_its_gradients_equal_the_transcription(self):
    x, w, dy = _exact_operands()
    y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe="mxfp8"), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    want_y = mxfp8_values(x) @ mxfp8_values(w.T).T
    want_dx = mxfp8_values(dy) @ mxfp8_values(w).T
    want_dw = mxfp8_values(x.T) @ mxfp8_values(dy.T).T
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
      np.testing.assert_array_equal(np.asarray(got), want.astype(F32))
    assert np.any(mxfp8_values(x) != x)    # the test data does round

  def test_a_gpu_target_multiplies_in_bf16(self):
    """A GPU target's MXFP8 GEMMs take the dequantized values in bf16 (XLA:GPU runs a float32 GEMM at
    HIGHEST on its float32 units); the CPU keeps float32 (the twin). On the exact data above both give the
    same bits."""
    x, w, dy = map(jnp.asarray, _exact_operands())
    gpu = fp4jax.target.Target("gpu", "NVIDIA H200", (9, 0))

    def run(where):
      def grads(a, b, g):
        y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe="mxfp8"), a, b)
        return (y, *vjp(g))
      with fp4jax.target.use(where):
        jaxpr = jax.make_jaxpr(grads)(x, w, dy)
        out = jax.jit(grads)(x, w, dy)
      dots = [tuple(str(v.aval.dtype) for v in e.invars) for e in jaxpr.jaxpr.eqns for e in _walk(e)
              if e.primitive.name == "dot_general"]
      return dots, out

    cpu_dots, cpu_out = run(fp4jax.target.Target("cpu", "cpu"))
    gpu_dots, gpu_out = run(gpu)
    assert cpu_dots == [("float32", "float32")] * 3 and gpu_dots == [("bfloat16", "bfloat16")] * 3
    for got, want in zip(gpu_out, cpu_out):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_bf16_operands_are_the_values_for_scale_bytes_from_3(self):
    """mxfp8.gemm's bf16 operands equal its float32 ones for every block of scale byte >= 3 (the docstring's
    bound): every finite E4M3 code at every byte 3..246 (above 246 the largest codes overflow float32 too;
    a quantizer never writes them: its scale is rounded up from amax / 448)."""
    codes = np.concatenate([np.arange(127), np.arange(128, 255)]).astype(np.uint8)   # all but ±NaN, and -0
    data = jnp.asarray(np.pad(codes, (0, 2)).view(jnp.float8_e4m3fn))                 # 256: 8 blocks of 32
    bytes_ = jnp.arange(3, 247, dtype=jnp.uint8)
    vals = mxfp8.dequantize(mxfp8.Mxfp8(jnp.tile(data, (bytes_.size, 1)), jnp.repeat(bytes_[:, None], 8, 1)))
    assert np.all(np.isfinite(np.asarray(vals)))
    np.testing.assert_array_equal(np.asarray(vals.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(vals))


# ------------------------------------------------------------------------------------ row-scaled NVFP4

def _row_scaled_vectors():
  x = np.array(inputs.normal(jax.random.key(5), (6, 64)), F32)
  x[0] = 0.0                      # a row of zeros: amax 0, S_enc = 1, every scale 0
  x[1, 17] = 40.0                 # the row holding the tensor's max
  x[2] *= 1e-3                    # a row far below the tensor max: its own amax keeps its precision
  x[3, 5] = np.inf                # a row with an Inf: S_enc = 1, its block scale saturates at 448
  return x


class TestRowScaledNvfp4:

  def test_recipe_and_checks(self):
    r = recipes.nvfp4(row_scaled_activation=True)
    assert r.roles.fprop_x.row_scaled and not r.roles.wgrad_x.row_scaled and not r.roles.fprop_w.row_scaled
    assert recipes.get("nvfp4_row_scaled").roles.fprop_x == r.roles.fprop_x
    with pytest.raises(ValueError, match="row_scaled_activation=True is one amax per row"):
      recipes.mxfp4(row_scaled_activation=True)
    with pytest.raises(ValueError, match="row_scaled_activation=True"):
      recipes.quartet2(row_scaled_activation=True)

  def test_quantizer_equals_the_transcription_on_the_test_vectors(self):
    x = _row_scaled_vectors()
    q = recipes.nvfp4(row_scaled_activation=True).roles.fprop_x(jnp.asarray(x))
    codes = np.asarray(reference.codes_of(q))
    got_vals = np.asarray(e2m1.decode(codes), np.float64)
    np.testing.assert_array_equal(np.asarray(q.amax), np.max(np.abs(x), axis=1))
    for i, row in enumerate(x):
      vals, s_b = nvfp4_row(row, np.max(np.abs(row)))
      np.testing.assert_array_equal(got_vals[i], vals)
      np.testing.assert_array_equal(np.asarray(q.scale[i], np.float32), s_b)
    assert np.all(np.asarray(q.scale[0], np.float32) == 0) and np.all(codes[0] == 0)      # zeros
    assert np.asarray(q.scale[3, 0], np.float32) == 448 and got_vals[3, 5] == 6           # Inf saturates
    # The small row keeps its precision: its codes are those of the row scaled up by 1000.
    vals_up, _ = nvfp4_row(x[2] * F32(1000), np.max(np.abs(x[2] * F32(1000))))
    assert np.count_nonzero(got_vals[2]) > 32 and np.count_nonzero(vals_up) == np.count_nonzero(got_vals[2])

  def test_gemm_factor_per_output_row(self):
    # Rows whose every block holds the row's max (so all block scales are 448) and E2M1-grid values, with
    # a weight whose every 16x16 tile holds the tensor max: acc is exact, the factor is the contract's
    # f32(f32(amax_row · amax_w) · f32(1/(36·448²))) per row.
    rng = np.random.default_rng(0)
    amax_rows = np.array([1.0, 3.7, 1e-3, 250.0], F32)
    g = rng.choice(np.concatenate([-E2M1_GRID, E2M1_GRID]), size=(4, 64))
    g[:, ::16] = 6.0
    x = (g / 6.0 * amax_rows[:, None]).astype(F32)
    wg = rng.choice(np.concatenate([-E2M1_GRID, E2M1_GRID]), size=(32, 64))
    wg[::16, ::16] = 6.0
    w_t = (wg * F32(0.37)).astype(F32)                       # (N, K); tensor amax 2.22
    roles = recipes.nvfp4(row_scaled_activation=True).roles
    q_x, q_w = roles.fprop_x(jnp.asarray(x)), roles.fprop_w(jnp.asarray(w_t))
    got = np.asarray(gemm.matmul(q_x, q_w))
    vals_x = np.stack([nvfp4_row(r, np.max(np.abs(r)))[0] for r in x])
    np.testing.assert_array_equal(vals_x, g)                                   # codes g, scales 448
    np.testing.assert_array_equal(np.asarray(e2m1.decode(reference.codes_of(q_w))), wg)
    acc = (vals_x * 448) @ (wg * 448).T                                        # exact in float32
    amax_w = F32(np.max(np.abs(w_t)))
    factor = (np.max(np.abs(x), axis=1).astype(F32) * amax_w).astype(F32) * F32(1.0 / (36 * 448 * 448))
    np.testing.assert_array_equal(got, (acc.astype(F32) * factor[:, None].astype(F32)).astype(F32))

  def test_dot_forward_equals_the_transcription_and_backward_equals_nvfp4(self):
    x = _row_scaled_vectors()
    x[3, 5] = 7.0                                  # the Inf row's output is checked separately
    w = np.array(inputs.normal(jax.random.key(6), (64, 48)), F32)
    key = jax.random.key(7)
    row = recipes.nvfp4(row_scaled_activation=True)
    f = lambda r: jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe=r, key=key), jnp.asarray(x), jnp.asarray(w))
    y_row, vjp_row = f(row)
    y_nv, vjp_nv = f(recipes.nvfp4())
    dy = jnp.asarray(inputs.normal(jax.random.key(8), y_nv.shape))
    for a, b in zip(vjp_row(dy), vjp_nv(dy)):     # backward as the recipe: same roles, same key
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Forward: the same GEMM as a per-row loop of per-tensor NVFP4 GEMMs (one "tensor" per row).
    nv = recipes.nvfp4().roles
    q_w = nv.fprop_w(jnp.asarray(w.T))
    for i in range(x.shape[0]):
      want = gemm.matmul(nv.fprop_x(jnp.asarray(x[i:i + 1])), q_w)
      np.testing.assert_array_equal(np.asarray(y_row[i:i + 1]), np.asarray(want))
    assert not np.array_equal(np.asarray(y_row), np.asarray(y_nv))

  def test_an_inf_row_poisons_only_its_own_outputs(self):
    x = _row_scaled_vectors()
    w = np.array(inputs.normal(jax.random.key(6), (64, 48)), F32)
    y_row = np.asarray(fp4jax.dot(jnp.asarray(x), jnp.asarray(w), recipe="nvfp4_row_scaled"))
    y_nv = np.asarray(fp4jax.dot(jnp.asarray(x), jnp.asarray(w), recipe="nvfp4"))
    assert not np.all(np.isfinite(y_row[3])) and np.all(np.isfinite(np.delete(y_row, 3, axis=0)))
    assert not np.all(np.isfinite(y_nv[np.arange(6) != 3]))   # per tensor, the Inf reaches every row
    assert np.all(y_row[0] == 0)                               # the row of zeros


def test_the_documented_row_scaled_vectors():
  """docs/NUMERICS.md, "Row-scaled NVFP4 activations": the table's rows, bit for bit."""
  x = np.zeros((3, 32), F32)
  x[1, :16], x[1, 16:] = np.linspace(-1, 1, 16), np.linspace(0, 3, 16)
  x[1, 20] = 12.0
  x[2, :16], x[2, 16:] = np.linspace(-1, 1, 16), np.linspace(0, 3, 16)
  x[2, 3] = np.inf
  q = recipes.get("nvfp4_row_scaled").roles.fprop_x(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(q.amax), [0.0, 12.0, np.inf])
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)),
                                [[0x00, 0x00], [0x61, 0x7E], [0x7E, 0x30]])
  codes = np.asarray(reference.codes_of(q))
  assert codes[1, :16].tolist() == [15, 15, 14, 14, 13, 12, 10, 9, 1, 2, 4, 5, 6, 6, 7, 7]
  assert codes[2].tolist() == [8, 8, 8, 7, 8, 8, 8, 8] + [0] * 9 + [1, 2, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7, 7, 7]
  assert not codes[0].any()
  for i in range(3):
    vals, s_b = nvfp4_row(x[i], np.max(np.abs(x[i])))
    np.testing.assert_array_equal(np.asarray(e2m1.decode(codes[i]), np.float64), vals)
    np.testing.assert_array_equal(np.asarray(q.scale[i], np.float32), s_b)
  q_w = recipes.nvfp4().roles.fprop_w(jnp.asarray(np.eye(32, 16, dtype=F32).T))
  y = np.asarray(gemm.matmul(q, q_w))
  acc = F32(-6 * 36) * F32(6 * 448)                      # the identity weight: code 6, tile scale 448, amax 1
  assert y[1, 0] == (acc * (F32(12.0) * F32(1.0) * F32(1.0 / (36 * 448 * 448)))).astype(F32) == F32(-0.9642857)
  assert np.all(y[0] == 0) and not np.any(np.isfinite(y[2, :3])) and np.all(np.isfinite(y[:2]))
