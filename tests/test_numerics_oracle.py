"""The jitted quantizers against an independent numpy oracle, bit for bit, on wide-range inputs.

The oracle below is written from docs/NUMERICS.md alone (it calls nothing of fp4jax): numpy float32
arithmetic, one correctly rounded operation per written step, E4M3 and E2M1 rounding by exact
float64 arithmetic. XLA may rewrite float32 arithmetic under ``jax.jit`` (a division by a broadcast
into a multiply by a reciprocal, (a/b)/c into a/(b·c), a·b + c into an FMA), which changes single
ulps and through them E4M3 ties and E2M1 decisions; these tests compare what ``jax.jit`` of the
public ops actually computes with the written order.

Inputs: rows with scales 2^-40..2^40, heavy tails, planted elements on and 1-2 ulps around the E2M1
decision points, block amaxes on and around E4M3 midpoints, zero rows and blocks, lone elements,
and whole tensors with tiny (< 2^-64) and huge (> 2^64) amax. No subnormal inputs: XLA on CPU
flushes float32 subnormals to zero (docs/NUMERICS.md, platform notes), so the oracle flushes results
below 2^-126 to (signed) zero the same way.

GEMMs: the float32 sum's order is not part of the contract, so the products are compared only where
every order gives the same float32 sum (all terms are multiples of a common power of two Q and their
absolute sum is below 2^24·Q); the tests assert that most outputs qualify.

Axis legend: R rows, K the quantized (contraction) axis, N the other GEMM operand's rows, T tokens,
C channels, B a block.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4jax
from fp4jax.numerics import dbq, four_over_six
from fp4jax.api import quantize_rht_transposed

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
FLT_MIN = F32(np.finfo(np.float32).tiny)   # 2^-126
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TD_SIGNS_16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


# ------------------------------------------------------------------------------ the oracle

def ftz(v):
  """Float32 results below 2^-126 in magnitude become (signed) zero, as XLA CPU computes them."""
  v = np.asarray(v, np.float32)
  return np.where(np.abs(v) < FLT_MIN, np.copysign(F32(0), v), v).astype(np.float32)


def e4m3_rne_sat(v32):
  """float64 values of E4M3 round-to-nearest-even of float32 ``v32``, saturated at ±448."""
  v = np.asarray(v32, np.float64)
  a = np.minimum(np.abs(v), 448.0)
  _, e = np.frexp(np.where(a > 0, a, 1.0))
  quantum = np.exp2(np.maximum(e - 1, -6) - 3.0)   # 3 mantissa bits; subnormal quantum 2^-9
  r = np.minimum(np.rint(a / quantum) * quantum, 448.0)
  return np.where(np.isnan(v), np.nan, np.copysign(r, v))


def e4m3_bytes(v64):
  """Bytes of exactly representable E4M3 values."""
  return np.asarray(v64).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e2m1_codes_of_grid(q):
  """Codes of values already on the E2M1 grid (sign bit from the sign, -0 included)."""
  mag = np.abs(np.asarray(q, np.float64))
  idx = np.argmin(np.abs(mag[..., None] - E2M1_GRID), axis=-1)
  return (idx + 8 * np.signbit(q)).astype(np.uint8)


def e2m1_rne_codes(v32):
  """Nearest E2M1 code of float32 values in [-6, 6], ties to the even code (by distance, float64)."""
  mag = np.abs(np.asarray(v32, np.float64))
  d = np.abs(mag[..., None] - E2M1_GRID)
  best = d == d.min(axis=-1, keepdims=True)
  even = (np.arange(8) % 2 == 0)
  idx = np.where(best.sum(-1) > 1, np.argmax(best & even, axis=-1), np.argmin(d, axis=-1))
  return (idx + 8 * np.signbit(v32)).astype(np.uint8)


def _sr_step(v):
  return np.where(v < 2, F32(0.5), np.where(v < 4, F32(1.0), F32(2.0))).astype(np.float32)


def e2m1_sr_codes(v32, bits):
  """Stochastic rounding of float32 values in [-6, 6] with 8 random bits each (docs/NUMERICS.md)."""
  u = ((np.asarray(bits).astype(np.uint32) & 0xFF).astype(np.float32) / F32(256)).astype(np.float32)
  mag = np.abs(v32).astype(np.float32)
  t = (mag + (u * _sr_step(mag)).astype(np.float32)).astype(np.float32)   # u·step is exact
  step_t = _sr_step(t)
  q = np.minimum(np.floor(t / step_t) * step_t, F32(6)).astype(np.float32)
  return e2m1_codes_of_grid(np.where(np.signbit(v32), -q, q))


def e2m1_values(codes):
  mag = E2M1_GRID[codes & 7]
  return np.where(codes & 8, -mag, mag).astype(np.float32)


def pack(codes_RxK):
  return (codes_RxK[..., 0::2] | (codes_RxK[..., 1::2] << 4)).astype(np.uint8)


def rows_to_tiles(x_MxK, side):
  m, k = x_MxK.shape
  return x_MxK.reshape(m // side, side, k // side, side).transpose(0, 2, 1, 3).reshape(
      m // side, k // side, side * side)


def tiles_to_rows(t, side):
  mt, kt, _ = t.shape
  return t.reshape(mt, kt, side, side).transpose(0, 2, 1, 3).reshape(mt * side, kt * side)


def nvfp4_encode(amax_b, amax_g):
  """(float64 E4M3 block scales s_b, float32 encode factors enc_b) for amax_b, amax_g already times p."""
  with np.errstate(divide="ignore", over="ignore"):
    s_enc = min(F32(F32(2688) / amax_g), FLT_MAX)
    if amax_g == 0 or s_enc == 0:
      s_enc = F32(1)
    s_dec = F32(F32(1) / s_enc)
    t = F32(s_enc * F32(1.0 / 6.0))
    s_b = e4m3_rne_sat(np.minimum((amax_b * t).astype(np.float32), FLT_MAX))
    enc = np.minimum((F32(1) / (s_b.astype(np.float32) * s_dec).astype(np.float32)), FLT_MAX)
  return s_b, enc.astype(np.float32)


def nvfp4_quantize_blocks(x_blk, amax_g, bits_blk=None):
  """Codes and float64 E4M3 scale values of float32 blocks (..., B), NVFP4's order of operations."""
  amax_g = F32(amax_g)
  p = F32(2.0 ** 64) if 0 < amax_g < F32(2.0 ** -64) else F32(1)
  x = (x_blk * p).astype(np.float32)
  s_b, enc = nvfp4_encode(np.max(np.abs(x), axis=-1), F32(amax_g * p))
  with np.errstate(over="ignore"):
    scaled = np.clip((x * enc[..., None]).astype(np.float32), -6, 6)
  codes = e2m1_rne_codes(scaled) if bits_blk is None else e2m1_sr_codes(scaled, bits_blk)
  return codes, s_b


def nvfp4_dequantize_blocks(codes, s_b, amax_g):
  """float32 values of blocked codes; outside amax in [2^-64, 2^64] through frexp (docs/NUMERICS.md)."""
  amax_g = F32(amax_g)
  s = np.asarray(s_b, np.float32)
  inv = F32(1.0 / 2688.0)
  far = (0 < amax_g < F32(2.0 ** -64)) or (F32(2.0 ** 64) < amax_g < np.inf)
  with np.errstate(over="ignore"):
    if not far:
      factor = ftz(ftz(s * amax_g) * inv)
      return ftz(e2m1_values(codes) * factor[..., None])
    m, e = np.frexp(amax_g)
    factor = ftz(ftz(s * F32(m)) * inv)
    vals = ftz(e2m1_values(codes) * factor[..., None])
    vals = ftz(ftz(vals * F32(2.0 ** (e // 2))) * F32(2.0 ** (e - e // 2)))
    return np.clip(vals, -FLT_MAX, FLT_MAX)


def mxfp4_quantize_blocks(x_blk, rule, bits_blk=None):
  """Codes and E8M0 exponents (int) of float32 blocks (..., 32)."""
  amax_b = np.max(np.abs(x_blk), axis=-1)
  if rule == "floor":
    _, e = np.frexp(np.where(amax_b > 0, amax_b, 1))
    exp = e - 1 - 2
  else:
    y = (amax_b * F32(1.0 / 6.0)).astype(np.float32)
    m, e = np.frexp(np.where(y > 0, y, 1))
    exp = np.where(m == 0.5, e - 1, e)
  exp = np.where(amax_b == 0, -127, np.clip(exp, -127, 127)).astype(np.int64)
  limit = np.where(exp >= 127, 1.5, np.where(exp == 126, 3.0, 6.0))[..., None]
  scaled = np.clip(x_blk.astype(np.float64) * np.exp2(-exp.astype(np.float64))[..., None],
                   -limit, limit).astype(np.float32)   # exact: a power of two, no subnormals here
  codes = e2m1_rne_codes(scaled) if bits_blk is None else e2m1_sr_codes(scaled, bits_blk)
  return codes, exp


def fp8_quantize_blocks(x_blk):
  """float64 E4M3 values and float32 decode scales of float32 blocks (..., B) (all finite)."""
  amax_b = np.max(np.abs(x_blk), axis=-1)
  with np.errstate(divide="ignore"):
    enc = np.where(amax_b > 0, (F32(448) / np.where(amax_b > 0, amax_b, F32(1))), F32(1))
  enc = np.minimum(enc.astype(np.float32), F32(2.0 ** 126))
  data = e4m3_rne_sat((x_blk * enc[..., None]).astype(np.float32))
  return data, (F32(1) / enc).astype(np.float32)


def rht_rows(x_RxT, size, signs):
  """RHT along the last axis: sign flip, butterfly (a+b, a-b) in float32 stage by stage, · 1/sqrt n."""
  r, t = x_RxT.shape
  y = (x_RxT.reshape(r, t // size, size) * np.asarray(signs, np.float32)).astype(np.float32)
  h = 1
  while h < size:
    y = y.reshape(r, t // size, size // (2 * h), 2, h)
    a, b = y[..., 0, :], y[..., 1, :]
    y = np.stack([(a + b).astype(np.float32), (a - b).astype(np.float32)], axis=-2)
    h *= 2
  return (y.reshape(r, t) * F32(1.0 / np.sqrt(size))).astype(np.float32)


def rht_signs(size):
  if size <= 16:
    return TD_SIGNS_16[:size]
  return tuple(1 - 2 * np.random.default_rng(0xD7E8).integers(0, 2, size))


def exact_sum(terms_xK):
  """(float64 sums, whether every order of float32 additions gives exactly that sum)."""
  t = np.asarray(terms_xK, np.float64)
  m, e = np.frexp(np.abs(t))
  mant = (m * 2.0 ** 53).astype(np.int64)
  lsb = np.where(t != 0, (mant & -mant).astype(np.float64) * np.exp2(e - 53.0), np.inf)
  q = lsb.min(axis=-1)
  total = np.abs(t).sum(axis=-1)
  ok = (total == 0) | ((total < 2.0 ** 24 * q) & (total < 2.0 ** 127))
  return t.sum(axis=-1), ok


# ------------------------------------------------------------------------------ inputs

def wide_rows(rng, r, k, *, block=16, emin=-40, emax=40):
  """float32 (r, k): per-row scales 2^emin..2^emax of several kinds of rows (module docstring)."""
  kinds = rng.integers(0, 6, r)
  x = np.zeros((r, k), np.float64)
  for i, kind in enumerate(kinds):
    s = 2.0 ** rng.integers(emin, emax + 1)
    if kind == 0:     # Gaussian
      x[i] = rng.standard_normal(k) * s
    elif kind == 1:   # heavy tails
      x[i] = rng.standard_t(2, k) * s
    elif kind == 2:   # E2M1 decision points of a block whose amax is 6·2^j, and 1-2 ulps around them
      pts = np.array(E2M1_THRESHOLDS + (6.0,))[rng.integers(0, 8, k)]
      ulps = rng.integers(-2, 3, k)
      v = np.nextafter(F32(1), F32(2)) - F32(1)
      x[i] = pts * (1.0 + ulps * float(v)) * s * rng.choice([-1, 1], k)
      x[i, ::block] = 6.0 * s
    elif kind == 3:   # per-block amaxes spread over 2^-20..2^0 of the row scale
      x[i] = (rng.standard_normal(k) * np.repeat(2.0 ** rng.uniform(-20, 0, k // block), block)) * s
    elif kind == 4:   # zero blocks and lone elements
      x[i] = rng.standard_normal(k) * s
      x[i, rng.random(k) < 0.7] = 0.0
    # kind 5: a zero row
  x = x.astype(np.float32)
  return np.where(np.abs(x) < FLT_MIN, F32(0), x)


def _other_orders_bytes(amax_b, amax_g):
  """E4M3 bytes of amax_b·S_enc/6 in two orders the contract excludes: (amax_b·S_enc)/6 and
  amax_b·f32(448/amax_g)."""
  s_enc = F32(F32(2688) / F32(amax_g))
  a = ((amax_b * s_enc).astype(np.float32) / F32(6)).astype(np.float32)
  b = (amax_b * F32(F32(448) / F32(amax_g))).astype(np.float32)
  return e4m3_bytes(e4m3_rne_sat(a)), e4m3_bytes(e4m3_rne_sat(b))


def e4m3_midpoint_rows(rng, r, k, amax_g):
  """Rows whose 16-block amaxes sit within 3 ulps of E4M3 midpoints of amax_b·S_enc/6, chosen where
  the contract's order and another order of the same formula give different scale bytes."""
  grid = np.unique(np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
  mids = (grid[:-1] + grid[1:]) / 2
  mids = mids[mids >= 2.0 ** -6]
  base = (mids * float(amax_g) / 448.0).astype(np.float32).view(np.int32)
  cand = (base[:, None] + np.arange(-3, 4, dtype=np.int32)).view(np.float32).ravel()
  t = F32(F32(F32(2688) / F32(amax_g)) * F32(1.0 / 6.0))
  spec = e4m3_bytes(e4m3_rne_sat((cand * t).astype(np.float32)))
  other_a, other_b = _other_orders_bytes(cand, amax_g)
  decisive = cand[(spec != other_a) | (spec != other_b)]
  amax_b = np.where(rng.random((r, k // 16)) < 0.5, rng.choice(decisive, (r, k // 16)),
                    rng.choice(cand, (r, k // 16))).astype(np.float32)
  x = (rng.uniform(-1, 1, (r, k)) * np.repeat(amax_b, 16, axis=1) * 0.999).astype(np.float32)
  x[:, ::16] = amax_b * rng.choice([-1, 1], (r, k // 16))
  x[0, 1] = amax_g
  return x.astype(np.float32)


def e2m1_threshold_rows(rng, r, k):
  """Rows (scales 2^-8..2^8) whose elements, times their block's encode factor enc_b, land on and
  1-2 ulps around the E2M1 decision points (enc_b from the oracle's own arithmetic)."""
  amax_b = (rng.uniform(0.5, 1.0, (r, k // 16)) * np.exp2(rng.integers(-8, 9, (r, 1)))).astype(
      np.float32)
  amax_b[0, 0] = F32(300.0)
  _, enc = nvfp4_encode(amax_b, F32(300.0))
  pts = np.array(E2M1_THRESHOLDS, np.float32)[rng.integers(0, 7, (r, k // 16, 16))]
  v = (pts / enc[..., None]).astype(np.float32)
  v = (v.view(np.int32) + rng.integers(-2, 3, v.shape).astype(np.int32)).view(np.float32)
  v = np.minimum(v, amax_b[..., None]) * rng.choice(np.float32([-1, 1]), v.shape)
  v[..., 0] = amax_b
  return v.reshape(r, k).astype(np.float32)


def _inputs_nvfp4():
  rng = np.random.default_rng(20261130)
  wide = wide_rows(rng, 256, 256)
  mids = e4m3_midpoint_rows(rng, 64, 256, F32(2.875))   # S_enc·(1/6) != 448/amax_g here
  small = wide_rows(rng, 64, 256, emin=-4, emax=4)
  return {
      "wide": wide,
      "e4m3_midpoints": mids,
      "moderate": small,
      "e2m1_thresholds": e2m1_threshold_rows(rng, 64, 256),
      "tiny_amax": (small * F32(2.0 ** -90)).astype(np.float32),
      "huge_amax": (small * F32(2.0 ** 90)).astype(np.float32),
      "near_flt_max": np.concatenate([small[:-1], np.full((1, 256), F32(3.0e38))]).astype(np.float32),
      "zeros": np.zeros((32, 256), np.float32),
  }


NVFP4_INPUTS = _inputs_nvfp4()


def bytes_of(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


# ------------------------------------------------------------------------------ NVFP4

_quantize_jit = jax.jit(fp4jax.quantize, static_argnames=("fmt", "axis", "tile", "rounding",
                                                          "scale_rule", "scaling"))
_dequantize_jit = jax.jit(fp4jax.dequantize)


def oracle_nvfp4(x_RxK, tiled, bits=None):
  amax_g = np.max(np.abs(x_RxK))
  if tiled:
    codes, s_b = nvfp4_quantize_blocks(rows_to_tiles(x_RxK, 16), amax_g,
                                       None if bits is None else rows_to_tiles(bits, 16))
    codes_RxK = tiles_to_rows(codes, 16)
    vals = tiles_to_rows(nvfp4_dequantize_blocks(codes, s_b, amax_g), 16)
    return pack(codes_RxK), e4m3_bytes(s_b), F32(amax_g), vals
  r, k = x_RxK.shape
  codes, s_b = nvfp4_quantize_blocks(x_RxK.reshape(r, k // 16, 16), amax_g,
                                     None if bits is None else bits.reshape(r, k // 16, 16))
  vals = nvfp4_dequantize_blocks(codes, s_b, amax_g).reshape(r, k)
  return pack(codes.reshape(r, k)), e4m3_bytes(s_b), F32(amax_g), vals


def assert_bits_equal(got, want, what):
  got, want = bytes_of(got), bytes_of(want)
  bad = np.argwhere(got != want)
  assert bad.size == 0, (f"{what}: {len(bad)} of {got.size} differ, first at {tuple(bad[0])}: "
                         f"jit {got[tuple(bad[0])]:#x}, oracle {want[tuple(bad[0])]:#x}")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("tiled", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("name", list(NVFP4_INPUTS))
def test_nvfp4_quantize_dequantize_jit_equals_oracle(name, tiled, rounding):
  x = NVFP4_INPUTS[name]
  bits = None
  if rounding == "stochastic":
    bits = np.random.default_rng(len(name)).integers(0, 256, x.shape, dtype=np.uint8)
  data, scale, amax, vals = oracle_nvfp4(x, tiled, bits)
  q = _quantize_jit(jnp.asarray(x), "nvfp4", tile=(16, 16) if tiled else None, rounding=rounding,
                    bits=None if bits is None else jnp.asarray(bits))
  assert_bits_equal(q.data, data, f"{name} codes")
  assert_bits_equal(q.scale, scale, f"{name} scale bytes")
  assert_bits_equal(np.asarray(q.amax, np.float32), amax, f"{name} amax")
  assert_bits_equal(np.asarray(_dequantize_jit(q), np.float32), vals, f"{name} dequantized")


def test_nvfp4_inputs_reach_the_interesting_cases():
  """The inputs contain what they are meant to, and the oracle tells apart orders of operations that
  are equal in exact arithmetic: underflowing block scales and most other bytes, E4M3 ties decided by the
  order of S_enc·(1/6), and E2M1 decisions that flip with enc_b computed as S_enc / s_b."""
  _, scale, _, _ = oracle_nvfp4(NVFP4_INPUTS["wide"], False)
  assert (scale == 0).mean() > 0.1
  _, scale, _, _ = oracle_nvfp4(NVFP4_INPUTS["moderate"], False)
  assert len(np.unique(scale)) > 60   # most of E4M3's range
  x = NVFP4_INPUTS["e4m3_midpoints"]
  _, scale, _, _ = oracle_nvfp4(x, False)
  amax_b = np.max(np.abs(x.reshape(64, 16, 16)), -1)
  other_a, other_b = _other_orders_bytes(amax_b, np.max(np.abs(x)))
  assert (other_a != scale).sum() > 20 and (other_b != scale).sum() > 20
  x = NVFP4_INPUTS["e2m1_thresholds"]
  codes, s_b = nvfp4_quantize_blocks(x.reshape(64, 16, 16), np.max(np.abs(x)))
  s_enc = F32(F32(2688) / np.max(np.abs(x)))
  with np.errstate(divide="ignore", over="ignore"):
    enc = np.minimum((s_enc / s_b.astype(np.float32)).astype(np.float32), FLT_MAX)
    other = e2m1_rne_codes(np.clip((x.reshape(64, 16, 16) * enc[..., None]).astype(np.float32), -6, 6))
  assert (other != codes).sum() > 20


# ------------------------------------------------------------------------------ RHT then quantize

@pytest.mark.parametrize("fmt, size", [("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_rht_transposed_quantize_jit_equals_oracle(fmt, size, rounding):
  rng = np.random.default_rng(3)
  x_CxT = wide_rows(rng, 128, 256, block=32)
  x_TxC = np.ascontiguousarray(x_CxT.T)
  bits = rng.integers(0, 256, x_CxT.shape, dtype=np.uint8) if rounding == "stochastic" else None
  y = ftz(rht_rows(x_CxT, size, rht_signs(size)))
  f = jax.jit(lambda x, b: quantize_rht_transposed(x, fmt, rht_size=size, rounding=rounding,
                                                   bits=b))
  q = f(jnp.asarray(x_TxC), None if bits is None else jnp.asarray(bits))
  if fmt == "nvfp4":
    data, scale, amax, _ = oracle_nvfp4(y, False, bits)
    assert_bits_equal(np.asarray(q.amax, np.float32), amax, "amax after the RHT")
  else:
    codes, exp = mxfp4_quantize_blocks(y.reshape(128, 8, 32), "rceil",
                                       None if bits is None else bits.reshape(128, 8, 32))
    data, scale = pack(codes.reshape(128, 256)), (exp + 127).astype(np.uint8)
  assert_bits_equal(q.data, data, "codes")
  assert_bits_equal(q.scale, scale, "scale bytes")


# ------------------------------------------------------------------------------ MXFP4

@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp4_quantize_dequantize_jit_equals_oracle(rule, rounding):
  rng = np.random.default_rng(5)
  x = np.concatenate([wide_rows(rng, 256, 256, block=32),
                      wide_rows(rng, 32, 256, block=32, emin=100, emax=120)]).astype(np.float32)
  bits = rng.integers(0, 256, x.shape, dtype=np.uint8) if rounding == "stochastic" else None
  codes, exp = mxfp4_quantize_blocks(x.reshape(-1, 8, 32), rule,
                                     None if bits is None else bits.reshape(-1, 8, 32))
  q = _quantize_jit(jnp.asarray(x), "mxfp4", scale_rule=rule, rounding=rounding,
                    bits=None if bits is None else jnp.asarray(bits))
  assert_bits_equal(q.data, pack(codes.reshape(x.shape)), "codes")
  assert_bits_equal(q.scale, (exp + 127).astype(np.uint8), "scale bytes")
  vals = ftz(e2m1_values(codes).astype(np.float64) * np.exp2(exp)[..., None]).reshape(x.shape)
  assert_bits_equal(np.asarray(_dequantize_jit(q), np.float32), vals, "dequantized")


# ------------------------------------------------------------------------------ FP8

@pytest.mark.parametrize("layout", ["1x128", "128x128", "tensor"])
def test_fp8_quantize_dequantize_jit_equals_oracle(layout):
  rng = np.random.default_rng(9)
  x = wide_rows(rng, 256, 256, block=128)
  if layout == "1x128":
    data, scale = fp8_quantize_blocks(x.reshape(256, 2, 128))
    kw = {}
  elif layout == "128x128":
    data, scale = fp8_quantize_blocks(rows_to_tiles(x, 128))
    data = tiles_to_rows(data, 128)
    kw = {"tile": (128, 128)}
  else:
    data, scale = fp8_quantize_blocks(x.reshape(1, -1))
    kw = {"scaling": "tensor"}
  data = data.reshape(x.shape)
  q = _quantize_jit(jnp.asarray(x), "fp8", **kw)
  assert_bits_equal(q.data, e4m3_bytes(data), "E4M3 data")
  assert_bits_equal(np.asarray(q.scale, np.float32), scale.reshape(np.shape(q.scale)), "scales")
  if layout == "1x128":
    vals = ftz(data.reshape(256, 2, 128).astype(np.float32) * scale[..., None])
  elif layout == "128x128":
    vals = tiles_to_rows(ftz(rows_to_tiles(data, 128).astype(np.float32) * scale[..., None]), 128)
  else:
    vals = ftz(data.astype(np.float32) * scale.reshape(()))
  assert_bits_equal(np.asarray(_dequantize_jit(q), np.float32), vals.reshape(x.shape), "dequantized")


# ------------------------------------------------------------------------------ scaled matmul

def _row_blocks(rng, r, k, lo, hi, *, exact_amax=False, emax=40):
  """Rows with per-row scales 2^-emax..2^emax whose 16-block amaxes stay within a factor 2 (so many GEMM
  outputs are exactly summable); exact_amax: every block amax is hi (FP8: power-of-two scales)."""
  mag = rng.uniform(lo, hi, (r, k)) * rng.choice([-1, 1], (r, k))
  mag[:, ::16] = hi if exact_amax else hi * rng.uniform(0.5, 1.0, (r, k // 16))
  s = np.exp2(rng.integers(-emax, emax + 1, (r, 1)).astype(np.float64))
  return (mag * s).astype(np.float32)


@pytest.mark.parametrize("fmt, shift", [("nvfp4", 0), ("nvfp4", 70), ("nvfp4", -70), ("mxfp4", 0),
                                         ("fp8", 0)])
def test_scaled_matmul_jit_equals_oracle_where_exactly_summable(fmt, shift):
  """shift ±70: rows 2^-10..2^10 times 2^±70, so amax_a·amax_b leaves float32's range (the tensor factor
  is then applied as (acc·((m_a·m_b)·f32(1/(6·6·448·448))))·2^(e_a+e_b))."""
  rng = np.random.default_rng(11)
  k = {"nvfp4": 64, "mxfp4": 64, "fp8": 128}[fmt]
  lo = 16.0 if fmt == "fp8" else 0.0
  hi = 448.0 if fmt == "fp8" else 6.0
  emax = 10 if shift else 40
  a = _row_blocks(rng, 128, k, lo, hi, exact_amax=fmt == "fp8", emax=emax) * F32(2.0 ** shift)
  b = _row_blocks(rng, 96, k, lo, hi, exact_amax=fmt == "fp8", emax=emax) * F32(2.0 ** shift)
  if fmt == "nvfp4":
    ca, sa = nvfp4_quantize_blocks(a.reshape(128, k // 16, 16), np.max(np.abs(a)))
    cb, sb = nvfp4_quantize_blocks(b.reshape(96, k // 16, 16), np.max(np.abs(b)))
    va = (e2m1_values(ca) * sa.astype(np.float32)[..., None]).reshape(128, k)
    vb = (e2m1_values(cb) * sb.astype(np.float32)[..., None]).reshape(96, k)
  elif fmt == "mxfp4":
    ca, ea = mxfp4_quantize_blocks(a.reshape(128, k // 32, 32), "rceil")
    cb, eb = mxfp4_quantize_blocks(b.reshape(96, k // 32, 32), "rceil")
    va = (e2m1_values(ca) * np.exp2(ea)[..., None]).reshape(128, k)
    vb = (e2m1_values(cb) * np.exp2(eb)[..., None]).reshape(96, k)
  else:
    da, sa = fp8_quantize_blocks(a.reshape(128, 1, k))
    db, sb = fp8_quantize_blocks(b.reshape(96, 1, k))
    va = ftz(da.astype(np.float32) * sa[..., None]).reshape(128, k)
    vb = ftz(db.astype(np.float32) * sb[..., None]).reshape(96, k)
  acc, ok = exact_sum(va.astype(np.float64)[:, None, :] * vb.astype(np.float64)[None, :, :])
  acc = acc.astype(np.float32)
  if fmt == "nvfp4":
    amax_a, amax_b = np.max(np.abs(a)), np.max(np.abs(b))
    inv = F32(1.0 / (6.0 * 6.0 * 448.0 * 448.0))
    with np.errstate(over="ignore"):
      prod = F32(amax_a * amax_b)
      if np.isfinite(prod) and prod >= F32(2.0 ** -100):
        want = ftz(acc * F32(prod * inv))
      else:
        (m_a, e_a), (m_b, e_b) = np.frexp(amax_a), np.frexp(amax_b)
        want = ftz((ftz(acc * F32(F32(m_a * m_b) * inv)).astype(np.float64)
                    * 2.0 ** (int(e_a) + int(e_b))).astype(np.float32))
      assert (shift == 0) == (np.isfinite(prod) and prod >= F32(2.0 ** -100))
  else:
    want = ftz(acc)
  f = jax.jit(lambda a, b: fp4jax.scaled_matmul(fp4jax.quantize(a, fmt), fp4jax.quantize(b, fmt)))
  got = np.asarray(f(jnp.asarray(a), jnp.asarray(b)), np.float32)
  assert ok.mean() > 0.5, f"only {ok.mean():.0%} of outputs are exactly summable; redesign the inputs"
  assert_bits_equal(got[ok], want[ok], f"{fmt} scaled_matmul ({ok.sum()} exactly summable outputs)")


# ------------------------------------------------------------------------------ DBQ GEMM, constant amaxes

def test_dbq_gemm_jit_equals_written_order():
  """TetraJet-v2's GEMM, C = Σ_chunks (os_A·os_B)·part_chunk over 128-chunks of K: each term rounded
  before the add. (Before fp4jax._exact.product guarded it, XLA CPU fused out + o·part into an FMA
  and 5194 of 12288 outputs differed by an ulp at K = 512.) Operands from fp4jax.numerics.dbq.quantize; the
  arithmetic under test is the GEMM's."""
  rng = np.random.default_rng(13)
  a = dbq.quantize(jnp.asarray(wide_rows(rng, 128, 512, emin=-3, emax=3)))
  b = dbq.quantize(jnp.asarray(wide_rows(rng, 96, 512, emin=-3, emax=3)))
  got = np.asarray(jax.jit(dbq.gemm)(a, b))

  def values(q):
    codes = np.asarray(q.codes)
    s = np.repeat(np.asarray(q.scale).astype(np.float32), 16, axis=-1)
    return e2m1_values(codes) * s

  va, vb = values(a), values(b)
  oa, ob = np.asarray(a.outer), np.asarray(b.outer)
  want, all_ok = None, np.ones(got.shape, bool)
  for c in range(4):
    k = slice(128 * c, 128 * (c + 1))
    part, ok = exact_sum(va[:, None, k].astype(np.float64) * vb[None, :, k].astype(np.float64))
    all_ok &= ok
    term = ((oa[:, c][:, None] * ob[:, c][None, :]).astype(np.float32) * part.astype(np.float32))
    want = term.astype(np.float32) if want is None else (want + term).astype(np.float32)
  assert all_ok.mean() > 0.5
  assert_bits_equal(got[all_ok], ftz(want)[all_ok], f"dbq.gemm ({all_ok.sum()} exactly summable)")


def test_dequantize_with_a_compile_time_constant_amax():
  """A tensor amax known at compile time (a QTensor closed over by the jitted function) must not be
  folded into the constant 1/2688 (XLA rewrites (s_b·amax)·c into s_b·(amax·c): 19815 of 65536 values
  differed by an ulp before fp4jax._exact.product guarded nvfp4.decode_factor)."""
  x = NVFP4_INPUTS["moderate"]
  data, scale, amax, vals = oracle_nvfp4(x, False)
  q = fp4jax.quantize(jnp.asarray(x), "nvfp4")
  f = jax.jit(lambda d, s: fp4jax.dequantize(fp4jax.QTensor(d, s, q.amax, "nvfp4", -1, 16, None,
                                                             jnp.float32)))
  assert_bits_equal(np.asarray(f(q.data, q.scale)), vals, "dequantized, constant amax")
  codes, scale46, amax46 = four_over_six.quantize(jnp.asarray(x))
  g = lambda c, s: four_over_six.dequantize(c, s, amax46)
  with jax.disable_jit():
    eager = g(codes, scale46)
  assert_bits_equal(np.asarray(jax.jit(g)(codes, scale46)), np.asarray(eager), "4/6, constant amax")
