"""One rounding per written operation where XLA CPU would contract or rewrite it, against numpy.

Every site that ``fp4jax._exact`` guards (docs/NUMERICS.md, "One rounding per operation") gets an input
on which the contracted or rewritten form and the written one differ: inexact scales, i.e. block and
tensor factors that are not powers of two, and a traced addend after the product, the way a caller uses
a dequantized tensor. Each case runs three ways: under ``jax.jit``, eagerly, and eagerly inside a
``lax.cond`` branch (compiled as one unit, as OsciReset's update is), and must equal numpy float32 with
one rounding per step (the oracle helpers of tests/test_numerics_oracle.py). Each test also checks that
its input separates the forms: the same formula without the guard, jitted, differs from numpy.

OsciReset (TetraJet-v2, §11.4): the two measured cases and trajectories with inexact scales against a
numpy transcription of the update. The subnormal boundary of XLA CPU (flush to zero) closes the file.
Axis legend: R rows, L the quantized axis, K a GEMM's contraction axis, M tokens, C channels.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import inputs
import fp4jax
from fp4jax import _exact, gemm, osci_reset, outcontrol, reference
from fp4jax.numerics import dbq, e2m1, eden, four_over_six, nvfp4
from fp4jax.quantizers import Quantizer
from fp4jax.reference import codes_of
from test_numerics_oracle import (F32, FLT_MIN, assert_bits_equal, e2m1_rne_codes, e2m1_values, e4m3_rne_sat,
                                  exact_sum, fp8_quantize_blocks, ftz, nvfp4_dequantize_blocks,
                                  nvfp4_quantize_blocks, rht_rows, wide_rows)

MODES = ("jit", "eager", "in_cond")


def run(mode, fn, *args):
  """fn(*args) under jit, eagerly, or eagerly as a lax.cond branch (one compiled unit)."""
  if mode == "jit":
    return jax.jit(fn)(*args)
  if mode == "eager":
    return fn(*args)
  return lax.cond(jnp.asarray(True), fn, fn, *args)


def addend(rng, shape):
  return rng.uniform(-4, 4, shape).astype(np.float32)


def assert_separates(plain, args, want, what):
  """The unguarded formula, jitted, differs from the written order on these inputs."""
  got = np.asarray(jax.jit(plain)(*args), np.float32)
  assert (got.view(np.uint32) != np.asarray(want, np.float32).view(np.uint32)).any(), (
      f"{what}: the input does not separate the contracted form from the rounded one; redesign it")


# ------------------------------------------------------------------------------ the guards themselves

def _codes(rng, n):
  return rng.integers(0, 16, n).astype(np.uint8)


# Operands of every provenance: converted from integers and constants are what LLVM proves not NaN.
PROVENANCE = {
    "codes_times_constant": (lambda c, u, f: e2m1.decode(c), lambda c, u, f: jnp.float32(0.1),
                             lambda c, u, f: e2m1_values(c), lambda c, u, f: F32(0.1)),
    "constant_times_codes": (lambda c, u, f: jnp.float32(0.1), lambda c, u, f: e2m1.decode(c),
                             lambda c, u, f: F32(0.1), lambda c, u, f: e2m1_values(c)),
    "integer_times_integer": (lambda c, u, f: u.astype(jnp.float32), lambda c, u, f: (u + 7).astype(jnp.float32),
                              lambda c, u, f: u.astype(np.float32), lambda c, u, f: (u + 7).astype(np.float32)),
    "codes_times_traced": (lambda c, u, f: e2m1.decode(c), lambda c, u, f: f,
                           lambda c, u, f: e2m1_values(c), lambda c, u, f: f),
    "traced_times_codes": (lambda c, u, f: f, lambda c, u, f: e2m1.decode(c),
                           lambda c, u, f: f, lambda c, u, f: e2m1_values(c)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provenance", list(PROVENANCE))
def test_product_is_rounded_before_the_sum_whatever_its_operands(provenance, mode):
  """product(a, b) - c: an earlier guard read a NaN test of ``a``, which LLVM folds away when
  ``a`` is provably not NaN (E2M1 codes, constants), and the FMA came back."""
  rng = np.random.default_rng(1)
  n = 4096
  codes, ints = _codes(rng, n), rng.integers(1000, 60000, n).astype(np.uint32)
  f, c = rng.uniform(0.1, 1, n).astype(np.float32), addend(rng, n)
  ja, jb, na, nb = PROVENANCE[provenance]
  want = (ftz(na(codes, ints, f) * nb(codes, ints, f)) - c).astype(np.float32)
  assert_separates(lambda cd, u, f, c: ja(cd, u, f) * jb(cd, u, f) - c, (codes, ints, f, c), want, provenance)
  got = run(mode, lambda cd, u, f, c: _exact.product(ja(cd, u, f), jb(cd, u, f)) - c, codes, ints, f, c)
  assert_bits_equal(np.asarray(got), want, f"product, {provenance}, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_div_is_one_rounding_whatever_its_operands(mode):
  """a / broadcast(b), (a / b) / c and an outer division a[:, None] / b[None, :], with a converted from
  integers: never a multiply by a reciprocal, never a / (b·c)."""
  rng = np.random.default_rng(2)
  ints = rng.integers(1, 2 ** 20, (64, 128)).astype(np.int32)
  b = rng.uniform(0.3, 3, (64, 1)).astype(np.float32)
  want1 = (ints.astype(np.float32) / b).astype(np.float32)
  want2 = ((ints.astype(np.float32) / F32(448)).astype(np.float32) / F32(6)).astype(np.float32)
  assert_separates(lambda u, b: u.astype(jnp.float32) / b, (ints, b), want1, "a / broadcast(b)")
  assert_separates(lambda u, b: (u.astype(jnp.float32) / 448.0) / 6.0, (ints, b), want2, "(a/b)/c")
  got1 = run(mode, lambda u, b: _exact.div(u.astype(jnp.float32), b), ints, b)
  got2 = run(mode, lambda u, b: _exact.div(_exact.div(u.astype(jnp.float32), 448.0), 6.0), ints, b)
  assert_bits_equal(np.asarray(got1), want1, f"div by a broadcast, {mode}")
  assert_bits_equal(np.asarray(got2), want2, f"div of a div, {mode}")
  col, row = ints[:, 0].astype(np.float32), b[:, 0].repeat(2)   # an outer division: both broadcast
  want3 = (col[:, None] / row[None, :]).astype(np.float32)
  assert_separates(lambda c, r: c[:, None] / r[None, :], (col, row), want3, "outer division")
  got3 = run(mode, lambda c, r: _exact.div(c[:, None], r[None, :]), col, row)
  assert_bits_equal(np.asarray(got3), want3, f"outer division, {mode}")


def test_guards_keep_values_and_nan():
  """Every float32 bit pattern class goes through unchanged; a NaN stays NaN."""
  v = np.array([0.0, -0.0, 1.5, -3.0, np.inf, -np.inf, FLT_MIN, 3.4e38], np.float32)
  nan_all = np.uint32(0x7FFFFFFF).view(np.float32)
  v = np.concatenate([v, [np.float32(np.nan), nan_all, -nan_all]]).astype(np.float32)
  got = np.asarray(jax.jit(lambda a: _exact.product(a, jnp.float32(1.0)))(v))
  assert_bits_equal(got[:8], v[:8], "product by 1")
  assert np.isnan(got[8:]).all()
  got = np.asarray(jax.jit(_exact.div)(v, np.float32(2.0)))
  assert_bits_equal(got[:8], ftz((v[:8] / F32(2)).astype(np.float32)), "div by 2")
  assert np.isnan(got[8:]).all()


# ------------------------------------------------------------------------------ numpy DBQ and OsciReset

def dbq_quantize_np(x_RxL):
  """(codes, float64 E4M3 scales (R, L/16), float32 outer scales (R, L/128)) of nearest DBQ."""
  r, length = x_RxL.shape
  xb = x_RxL.reshape(r, length // 128, 8, 16)
  amax_b = np.max(np.abs(xb), axis=-1)
  outer = ((np.max(amax_b, axis=-1) / F32(448)).astype(np.float32) / F32(6)).astype(np.float32)
  outer = np.where(outer == 0, F32(1), outer).astype(np.float32)
  inner = ((amax_b / outer[..., None]).astype(np.float32) / F32(6)).astype(np.float32)
  s_b = e4m3_rne_sat(np.where(inner == 0, F32(2.0 ** -9), inner))
  sp = (outer[..., None] * s_b.astype(np.float32)).astype(np.float32)
  inv = np.where(sp != 0, (F32(1) / np.where(sp != 0, sp, F32(1))).astype(np.float32), F32(0))
  t = np.clip((xb * inv[..., None]).astype(np.float32), -6, 6)
  return e2m1_rne_codes(t).reshape(r, length), s_b.reshape(r, length // 16), outer


def dbq_dequantize_np(codes, s_b, outer):
  factor = (np.repeat(outer, 8, axis=-1) * s_b.astype(np.float32)).astype(np.float32)
  return ftz(e2m1_values(codes) * np.repeat(factor, 16, axis=-1))


def quantized_weight_np(w_RxL):
  return dbq_dequantize_np(*dbq_quantize_np(w_RxL))


def osci_reset_np(weights, period, detect, start, threshold):
  """OsciReset of docs/RECIPES.md step by step (weights: the (R, L) weight after each step, axis 1):
  the weight each update returns and the state (w_prev, D_Q, D_FP) after it."""
  w_prev = d_q = d_fp = np.zeros_like(weights[0])
  out = []
  for k, w in enumerate(weights):
    w = np.asarray(w, np.float32)
    phase, active = k % period, k >= start
    if active and phase == 0:
      w_prev, d_q, d_fp = w, np.zeros_like(w), np.zeros_like(w)
    elif active and 1 <= phase <= detect:
      dist_q = np.abs((quantized_weight_np(w) - quantized_weight_np(w_prev)).astype(np.float32))
      d_q = (d_q + dist_q).astype(np.float32)
      d_fp = (d_fp + np.abs((w - w_prev).astype(np.float32))).astype(np.float32)
      w_prev = w
    elif active and phase == detect + 1:
      ratio = np.where(d_fp == 0, F32(0), (d_q / np.where(d_fp == 0, F32(1), d_fp)).astype(np.float32))
      w = np.where(ratio >= F32(threshold), quantized_weight_np(w), w).astype(np.float32)
      w_prev, d_q, d_fp = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    out.append((w, w_prev, d_q, d_fp))
  return out


def osci_reset_fp4jax(weights, config, mode):
  params = {"w": jnp.asarray(weights[0])}
  state = osci_reset.init(params, None)
  fn = lambda p, s, k: osci_reset.update(p, s, k, config)
  step = jax.jit(fn) if mode == "jit" else fn
  out = []
  for k, w in enumerate(weights):
    params, state = step({"w": jnp.asarray(w)}, state, k)
    st = state["w"]
    out.append(tuple(np.asarray(a) for a in (params["w"], st.w_prev, st.d_q, st.d_fp)))
  return out


def assert_same_trajectory(got, want, what):
  for k, (g, w) in enumerate(zip(got, want)):
    for name, a, b in zip(("w", "w_prev", "D_Q", "D_FP"), g, w):
      assert_bits_equal(a, b, f"{what}, step {k}, {name}")


def _bits(u):
  return np.uint32(u).view(np.float32)


def dbq_midpoint_rows(rng, r):
  """(r, 256) rows whose 16-block amaxes put (amax_16 / os) / 6 within 3 ulps of an E4M3 midpoint, kept
  where the contract's order and a rewritten one (amax_16 / (os·6), amax_16 · (1/os) / 6) give different
  scale bytes; the 128-block amax 2.875 makes os = (2.875/448)/6 inexact."""
  grid = np.unique(np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
  mids = (grid[:-1] + grid[1:]) / 2
  outer = F32(F32(F32(2.875) / F32(448)) / F32(6))
  base = (mids * 6.0 * float(outer)).astype(np.float32).view(np.int32)
  cand = (base[:, None] + np.arange(-3, 4, dtype=np.int32)).view(np.float32).ravel()
  cand = cand[cand < F32(2.875)]
  spec = e4m3_rne_sat(((cand / outer).astype(np.float32) / F32(6)).astype(np.float32))
  fused = e4m3_rne_sat((cand / F32(outer * F32(6))).astype(np.float32))
  recip = e4m3_rne_sat(((cand * F32(F32(1) / outer)).astype(np.float32) / F32(6)).astype(np.float32))
  decisive = cand[(spec != fused) | (spec != recip)]
  amax_b = rng.choice(decisive, (r, 16)).astype(np.float32)
  x = (rng.uniform(-1, 1, (r, 256)) * np.repeat(amax_b, 16, axis=1) * 0.999).astype(np.float32)
  x[:, ::16] = amax_b * rng.choice([-1, 1], (r, 16))
  x[:, 1], x[:, 129] = F32(2.875), F32(-2.875)
  return x


@pytest.mark.parametrize("mode", MODES)
def test_dbq_quantize_divisions_on_e4m3_midpoints(mode):
  """os = (amax_128/448)/6 and the inner scale (amax_16/os)/6: two divisions each, never fused into one
  and never a multiply by 1/os (either moves block scales across E4M3 midpoints on these rows)."""
  x = dbq_midpoint_rows(np.random.default_rng(10), 64)
  codes, s_b, outer = dbq_quantize_np(x)
  def plain(x):
    xb = x.reshape(64, 2, 8, 16)
    amax_b = jnp.max(jnp.abs(xb), axis=-1)
    os = (jnp.max(amax_b, axis=-1) / 448.0) / 6.0
    return (amax_b / os[..., None]) / 6.0
  inner = ((np.max(np.abs(x.reshape(64, 2, 8, 16)), axis=-1) / outer[..., None]).astype(np.float32)
           / F32(6)).astype(np.float32)
  assert_separates(plain, (x,), inner, "DBQ inner scale")
  q = run(mode, dbq.quantize, x)
  assert_bits_equal(np.asarray(q.outer), outer, f"DBQ outer scales, {mode}")
  assert_bits_equal(np.asarray(q.scale).view(np.uint8), s_b.astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
                    f"DBQ E4M3 scales, {mode}")
  assert_bits_equal(np.asarray(q.codes), codes, f"DBQ codes, {mode}")


# ------------------------------------------------------------------------------ OsciReset

@pytest.mark.parametrize("mode", ("jit", "eager"))
def test_osci_reset_constant_weight_has_no_quantized_distance(mode):
  """Measured case 1: w[0] = 1, w[1] = 0.5 constant; the block scale is 1/6 rounded, 3 times it is
  inexact. Q never changes, so D_Q = 0 (it was [5.96e-08, 2.98e-08]: |Q - Q_prev| as one FMA)."""
  row = np.zeros((1, 128), np.float32)
  row[0, 0], row[0, 1] = 1.0, 0.5
  config = osci_reset.OsciResetConfig(period=4, detect_steps=2, start=0, threshold=8, axis=1)
  got = osci_reset_fp4jax([row] * 3, config, mode)
  assert_same_trajectory(got, osci_reset_np([row] * 3, 4, 2, 0, 8), f"case 1, {mode}")
  assert not got[-1][2].any()


@pytest.mark.parametrize("mode", ("jit", "eager"))
def test_osci_reset_ratio_exactly_at_the_threshold_resets(mode):
  """Measured case 2: D_Q = 0.08375001, D_FP = 0.010468751, ratio exactly 8.0, so w[1] resets to
  0.25124997 (the FMA gave D_Q 0.083749995, a ratio of 7.9999986, and kept 0.28265625)."""
  w0 = np.zeros((1, 128), np.float32)
  w0[0, 0], w0[0, 1] = F32(0.5025), _bits(0x3E96147B)
  w1 = w0.copy()
  w1[0, 1] = _bits(0x3E90B852)
  config = osci_reset.OsciResetConfig(period=3, detect_steps=1, start=0, threshold=8, axis=1)
  got = osci_reset_fp4jax([w0, w1, w1], config, mode)
  assert_same_trajectory(got, osci_reset_np([w0, w1, w1], 3, 1, 0, 8), f"case 2, {mode}")
  assert got[1][2][0, 1] == F32(0.08375001) and got[1][3][0, 1] == F32(0.010468751)
  assert got[2][0][0, 1] == F32(0.25124997)


def oscillating_weights(seed, steps):
  """(2, 256) weights 'after step k' with inexact block scales (block amaxes 0.7, 0.3·u): elements
  flipping across an E2M1 boundary with small and large amplitudes (reset and kept), drifting ones and
  constant ones."""
  rng = np.random.default_rng(seed)
  base = (rng.standard_normal((2, 256)) * 0.1).astype(np.float32)
  base[:, ::16] = np.float32(0.3) * rng.uniform(0.8, 1.0, (2, 16)).astype(np.float32)
  base[:, 0], base[:, 128] = F32(0.7), F32(-0.7)
  _, s_b, outer = dbq_quantize_np(base)
  sp = (np.repeat(outer, 8, axis=-1) * s_b.astype(np.float32)).astype(np.float32)
  step_of = np.repeat(sp, 16, axis=-1)                         # the element's bin scale
  edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5], np.float32)
  kind = rng.integers(0, 4, (2, 256))
  kind[:, ::16] = 3
  at_edge = (edges[rng.integers(0, 6, (2, 256))] * step_of * rng.choice([-1, 1], (2, 256))).astype(np.float32)
  amp = np.where(kind == 0, 0.004, 0.06).astype(np.float32) * step_of
  weights = []
  for k in range(steps):
    sign = np.float32(1 if k % 2 else -1)
    w = np.where(kind <= 1, at_edge + sign * amp, np.where(kind == 2, base + F32(3e-4) * k, base))
    weights.append(w.astype(np.float32))
  return weights


@pytest.mark.parametrize("mode", ("jit", pytest.param("eager", marks=pytest.mark.slow)))
def test_osci_reset_trajectories_with_inexact_scales(mode):
  """Two windows (snapshot at steps 8 and 16, 6 tracking steps, reset at 15 and 23): every returned weight and every
  state element against numpy, bit for bit; some elements reset, some not."""
  weights = oscillating_weights(5, 24)
  config = osci_reset.OsciResetConfig(period=8, detect_steps=6, start=2, threshold=8.0, axis=1)
  want = osci_reset_np(weights, 8, 6, 2, 8.0)
  got = osci_reset_fp4jax(weights, config, mode)
  assert_same_trajectory(got, want, f"trajectory, {mode}")
  reset = sum(int((want[k][0] != weights[k]).sum()) for k in (15, 23))
  assert 20 < reset < 400, f"{reset} resets: redesign the trajectory"
  assert (want[14][2] > 0).mean() > 0.3   # many tracked elements moved in Q


# ------------------------------------------------------------------------------ dequantized values in a sum

def _moderate(seed, r=64, k=256):
  return wide_rows(np.random.default_rng(seed), r, k, emin=-3, emax=3)


@pytest.mark.parametrize("mode", MODES)
def test_dbq_dequantize_minus_a_traced_value(mode):
  x = _moderate(3)
  codes, s_b, outer = dbq_quantize_np(x)
  c = addend(np.random.default_rng(3), x.shape)
  want = (dbq_dequantize_np(codes, s_b, outer) - c).astype(np.float32)
  q = dbq.Dbq(jnp.asarray(codes), jnp.asarray(s_b.astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(outer))
  plain = lambda q, c: e2m1.decode(q.codes) * jnp.repeat(dbq.decode_factor(q.scale, q.outer), 16, axis=-1) - c
  assert_separates(plain, (q, c), want, "dbq")
  assert_bits_equal(np.asarray(run(mode, lambda q, c: dbq.dequantize(q) - c, q, c)), want, f"dbq, {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("amax", ["traced", "constant"])
def test_nvfp4_dequantize_minus_a_traced_value(amax, mode):
  """A constant amax (a QTensor closed over) folds the powers of two of the far-range path away, and
  the product e2m1 · factor meets the subtraction."""
  x = _moderate(4)
  q = fp4jax.quantize(jnp.asarray(x), "nvfp4")
  codes, s_b = nvfp4_quantize_blocks(x.reshape(64, 16, 16), np.max(np.abs(x)))
  c = addend(np.random.default_rng(4), x.shape)
  want = (nvfp4_dequantize_blocks(codes, s_b, np.max(np.abs(x))).reshape(x.shape) - c).astype(np.float32)
  if amax == "constant":
    fn = lambda d, s, c: fp4jax.dequantize(fp4jax.QTensor(d, s, q.amax, "nvfp4", -1, 16, None, jnp.float32)) - c
    args = (q.data, q.scale, c)
    plain = lambda d, s, c: (e2m1.decode(codes_of(fp4jax.QTensor(d, s, q.amax, "nvfp4", -1, 16, None,
                                                                           jnp.float32))).reshape(64, 16, 16)
                             * nvfp4.decode_factor(s, q.amax)[..., None]).reshape(x.shape) - c
  else:
    fn = lambda d, s, a, c: fp4jax.dequantize(fp4jax.QTensor(d, s, a, "nvfp4", -1, 16, None, jnp.float32)) - c
    args = (q.data, q.scale, q.amax, c)
    plain = None
  if plain is not None:
    assert_separates(plain, args, want, "nvfp4, constant amax")
  assert_bits_equal(np.asarray(run(mode, fn, *args)), want, f"nvfp4 {amax} amax, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_four_over_six_and_eden_dequantize_minus_a_traced_value(mode):
  x = _moderate(5)
  c = addend(np.random.default_rng(5), x.shape)
  codes, scale, amax = four_over_six.quantize(jnp.asarray(x))
  s = np.asarray(scale).astype(np.float32)
  factor = (ftz(s * np.asarray(amax)) * F32(1.0 / (6.0 * 256.0))).astype(np.float32)
  want = (ftz(e2m1_values(np.asarray(codes)) * np.repeat(factor, 16, axis=-1)) - c).astype(np.float32)
  plain = lambda cd, sc, a, c: e2m1.decode(cd) * jnp.repeat(four_over_six.decode_factor(sc, a), 16, axis=-1) - c
  assert_separates(plain, (codes, scale, amax, c), want, "4/6")
  got = run(mode, lambda cd, sc, a, c: four_over_six.dequantize(cd, sc, a) - c, codes, scale, amax, c)
  assert_bits_equal(np.asarray(got), want, f"4/6, {mode}")

  e = eden.quantize(jnp.asarray(x), eden.scale_bits(jax.random.key(0), x.shape))
  factor = (np.asarray(e.scale).astype(np.float32) * np.asarray(e.s_dec)).astype(np.float32)
  want = (ftz(e2m1_values(np.asarray(e.codes)) * np.repeat(factor, 16, axis=-1)) - c).astype(np.float32)
  plain = lambda cd, sc, sd, c: e2m1.decode(cd) * jnp.repeat(sc.astype(jnp.float32) * sd, 16, axis=-1) - c
  assert_separates(plain, (e.codes, e.scale, e.s_dec, c), want, "MS-EDEN")
  got = run(mode, lambda cd, sc, sd, c: eden.dequantize(cd, sc, sd) - c, e.codes, e.scale, e.s_dec, c)
  assert_bits_equal(np.asarray(got), want, f"MS-EDEN, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_fp8_dequantize_minus_a_traced_value(mode):
  """FP8's decode scale 1/enc = 1/(448/amax_b) is not a power of two."""
  x = _moderate(6, k=128)
  data, scale = fp8_quantize_blocks(x.reshape(64, 1, 128))
  c = addend(np.random.default_rng(6), x.shape)
  want = (ftz(data.astype(np.float32) * scale[..., None]).reshape(x.shape) - c).astype(np.float32)
  q = fp4jax.quantize(jnp.asarray(x), "fp8")
  plain = lambda d, s, c: d.astype(jnp.float32) * s - c
  assert_separates(plain, (q.data, q.scale, c), want, "fp8")
  fn = lambda d, s, c: fp4jax.dequantize(fp4jax.QTensor(d, s, None, "fp8", -1, 128, None, jnp.float32)) - c
  assert_bits_equal(np.asarray(run(mode, fn, q.data, q.scale, c)), want, f"fp8, {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [32, 128])
def test_rht_output_plus_a_traced_value(size, mode):
  """The RHT's last step, · f32(1/√n), is inexact for n = 32 and 128 (fp4jax.rht and MS-EDEN's RHT)."""
  x = _moderate(7, k=256)
  c = addend(np.random.default_rng(7), x.shape)
  signs = np.random.default_rng(size).choice(np.float32([-1, 1]), size)
  want = (rht_rows(x, size, signs) + c).astype(np.float32)
  plain = lambda x, s, c: eden.fwht_last(x.reshape(64, -1, size) * s).reshape(x.shape) * jnp.float32(
      1.0 / np.sqrt(size)) + c
  assert_separates(plain, (x, signs, c), want, f"RHT-{size}")
  got = run(mode, lambda x, s, c: eden.rht(x, s) + c, x, signs, c)
  assert_bits_equal(np.asarray(got), want, f"eden.rht-{size}, {mode}")
  if size == 32:
    hsigns = np.asarray(fp4jax.hadamard.signs(32), np.float32)
    want = (rht_rows(x, 32, hsigns) + c).astype(np.float32)
    got = run(mode, lambda x, c: fp4jax.rht(x, size=32) + c, x, c)
    assert_bits_equal(np.asarray(got), want, f"fp4jax.rht-32, {mode}")


# ------------------------------------------------------------------------------ GEMM factors and OutControl

def _operands(seed):
  rng = np.random.default_rng(seed)
  mag = rng.uniform(0, 6, (2, 64, 128)) * rng.choice([-1, 1], (2, 64, 128))
  mag[:, :, ::16] = 6 * rng.uniform(0.5, 1.0, (2, 64, 8))
  return [(m * 2.0 ** rng.integers(-3, 4, (64, 1))).astype(np.float32) for m in mag]


@pytest.mark.parametrize("mode", MODES)
def test_gemm_tensor_factors_plus_a_traced_value(mode):
  """acc · factor + c for NVFP4 through scaled_matmul and 4/6 and MS-EDEN operands of fp4jax.quantizers,
  on the outputs where every summation order of acc gives the same float32."""
  a, b = _operands(8)
  c = addend(np.random.default_rng(8), (64, 64))
  for kind in ("scaled_matmul", "fos", "eden"):
    if kind == "scaled_matmul":
      qa, qb = fp4jax.quantize(jnp.asarray(a), "nvfp4"), fp4jax.quantize(jnp.asarray(b), "nvfp4")
      fn = lambda qa, qb, c: fp4jax.scaled_matmul(qa, qb) + c
      factor = ftz(ftz(np.asarray(qa.amax) * np.asarray(qb.amax)) * F32(1.0 / (6.0 * 6.0 * 448.0 * 448.0)))
      va = np.asarray(reference.scaled_codes_bf16(qa), np.float32)
      vb = np.asarray(reference.scaled_codes_bf16(qb), np.float32)
    else:
      if kind == "fos":
        fos = Quantizer("nvfp4", four_over_six=(256, "mse"))
        qa, qb = fos(jnp.asarray(a)), fos(jnp.asarray(b))
        factor = ftz(ftz(np.asarray(qa.amax) * np.asarray(qb.amax)) * F32(1.0 / (36.0 * 256 * 256)))
      else:
        qa = Quantizer("nvfp4_eden")(jnp.asarray(a), jax.random.key(1))
        qb = Quantizer("nvfp4_eden")(jnp.asarray(b), jax.random.key(2))
        factor = ftz(np.asarray(qa.scale2) * np.asarray(qb.scale2))
      fn = lambda qa, qb, c: gemm.matmul(qa, qb) + c
      va = np.asarray(reference.scaled_codes_bf16(qa), np.float32)
      vb = np.asarray(reference.scaled_codes_bf16(qb), np.float32)
    acc, ok = exact_sum(va.astype(np.float64)[:, None, :] * vb.astype(np.float64)[None, :, :])
    want = (ftz(acc.astype(np.float32) * factor) + c).astype(np.float32)
    assert ok.mean() > 0.5, kind
    assert_separates(lambda acc, f, c: acc * f + c, (acc.astype(np.float32), factor, c), want, kind)
    got = np.asarray(run(mode, fn, qa, qb, c))
    assert_bits_equal(got[ok], want[ok], f"{kind} GEMM factor, {mode} ({ok.sum()} exactly summable)")
    if kind == "scaled_matmul":   # amaxes known at compile time: the powers of two of the factor fold away
      const = lambda da, sa, db, sb, c: fp4jax.scaled_matmul(
          fp4jax.QTensor(da, sa, qa.amax, "nvfp4", -1, 16, None, jnp.float32),
          fp4jax.QTensor(db, sb, qb.amax, "nvfp4", -1, 16, None, jnp.float32)) + c
      got = np.asarray(run(mode, const, qa.data, qa.scale, qb.data, qb.scale, c))
      assert_bits_equal(got[ok], want[ok], f"scaled_matmul, constant amaxes, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_outcontrol_calibration_squares_are_rounded(mode):
  """acc + ‖x[:, c]‖₂ over two tokens (a sum of two squares has one order): each square rounded first."""
  rng = np.random.default_rng(9)
  x = (rng.standard_normal((2, 512)) * 3).astype(np.float32)
  acc = rng.uniform(0, 10, 512).astype(np.float32)
  sq = (x * x).astype(np.float32)
  want = (acc + np.sqrt((sq[0] + sq[1]).astype(np.float32))).astype(np.float32)
  plain = lambda a, x: a + jnp.sqrt(jnp.sum(x * x, axis=0))
  assert_separates(plain, (acc, x), want, "calibration")
  got = run(mode, outcontrol.calibration_accumulate, acc, x)
  assert_bits_equal(np.asarray(got), want, f"calibration_accumulate, {mode}")


# ------------------------------------------------------------------------------ subnormals (XLA CPU)

def test_subnormal_boundary_on_cpu():
  """XLA CPU flushes float32 subnormal results to zero and reads subnormal operands as zero; numpy
  does neither (docs/NUMERICS.md, "Subnormals"). Results at 2^-126 and above are the oracle's."""
  if jax.default_backend() != "cpu":
    pytest.skip("the flush-to-zero policy is XLA CPU's")
  # A product that lands just below / at the smallest normal, then an add: rounded (and flushed) first.
  a = np.array([2.0 ** -63, 2.0 ** -63, 1.5 * 2.0 ** -64], np.float32)
  b = np.array([2.0 ** -64, 2.0 ** -63, 2.0 ** -63], np.float32)
  c = np.array([2.0 ** -126, 2.0 ** -126, 0.0], np.float32)
  got = np.asarray(jax.jit(lambda a, b, c: _exact.product(a, b) + c)(a, b, c))
  np.testing.assert_array_equal(got, np.float32([2.0 ** -126, 2.0 ** -125, 0.0]))   # numpy: 1.5·2^-126, ., 1.5·2^-127
  np.testing.assert_array_equal(got, ftz(ftz(a * b) + c))
  # A tensor whose amax is the smallest normal quantizes as numpy does; one of subnormals keeps its amax
  # (the maximum is taken on the bits, fp4jax.numerics.amax) but is all zero (x · 2^64 reads x as 0).
  for v in (2.0 ** -126, 2.0 ** -127):
    x = np.full((1, 16), v, np.float32)
    q = fp4jax.quantize(jnp.asarray(x), "nvfp4")
    assert float(q.amax) == v
    amax = v if v >= 2.0 ** -126 else 0.0
    if amax:
      codes, s_b = nvfp4_quantize_blocks(x.reshape(1, 1, 16), F32(amax))
      assert_bits_equal(codes_of(q), codes.reshape(1, 16), "codes at 2^-126")
      assert_bits_equal(np.asarray(fp4jax.dequantize(q)), nvfp4_dequantize_blocks(codes, s_b, F32(amax))
                        .reshape(1, 16), "values at 2^-126")
    else:
      assert not np.asarray(codes_of(q)).any() and not np.asarray(fp4jax.dequantize(q)).any()


def test_stored_keeps_the_bf16_rounding_of_a_fused_producer():
  """A bf16 tensor made in float32 and reduced in the same fusion: XLA drops the f32 -> bf16 -> f32 pair
  (excess precision) unless the value goes through ``_exact.stored``, which the quantizers apply."""
  a = inputs.normal(jax.random.key(0), (64, 128), jnp.float32) * 3
  rowmax = lambda pin: jax.jit(lambda a: jnp.max(pin((a * a).astype(jnp.bfloat16)).astype(jnp.float32), axis=1))
  want = (np.asarray(a) ** 2).astype(ml_dtypes.bfloat16).astype(np.float32).max(axis=1)
  np.testing.assert_array_equal(rowmax(_exact.stored)(a), want)
  if jax.default_backend() == "cpu":   # the hazard itself, as XLA CPU shows it (jax 0.10.2)
    assert np.any(np.asarray(rowmax(lambda x: x)(a)) != want)
  # eager, and on arrays read from memory, it is the identity (NaN and inf included)
  x = jnp.asarray([1.0, -0.0, np.inf, np.nan, 3.3895314e38, 1e-40], jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(_exact.stored(x)).view(np.uint16), np.asarray(x).view(np.uint16))
  assert _exact.stored(a) is a and _exact.stored(jnp.arange(3)).dtype == jnp.int32
