"""Quantize kernels (1x16/1x32, 16x16 tiles, fused RHT-transposed) against the reference, bit for bit.

Each kernel has one test class; the classes here run the kernels in the Pallas interpreter
(INTERPRET = True, CPU); tests/test_kernels_gpu.py subclasses them with INTERPRET = False.
Compared with ``==`` on raw bits: packed codes and scale bytes.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import random_bits
from fp4jax.numerics import e2m1
from fp4jax.kernels import _common as C
from fp4jax.kernels import quantize_1d as K1
from fp4jax.kernels import quantize_2d as K2
from fp4jax.kernels import quantize_rht_t as KR
from fp4jax.numerics.scales import e4m3_rne_satfinite, e8m0_exponent, e8m0_from_exponent

DTYPES = (jnp.float32, jnp.bfloat16)
GROUPED = tuple(random_bits.GROUPS)   # the layouts that hash once per group of elements


def make_input(shape, dtype, seed=0):
  """Magnitudes over many binades, plus an all-zero 32-block, an underflowing block and E2M1 ties."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))
  x = x.reshape(-1, shape[-1])
  x[0, :32 if shape[-1] >= 32 else shape[-1]] = 0.0
  if x.shape[0] > 1:
    x[1, :16] = rng.standard_normal(16) * 1e-9
  if x.shape[0] > 2:
    x[2, :16] = np.array([0, .25, -.75, 1.25, 1.75, -2.5, 3.5, 5, 6, -6, .5, 1, 2, 3, 4, -1.5])
  return jnp.asarray(x.reshape(shape), dtype)


def bf16_sweep(lo_exp, hi_exp, shuffle=False, subnormals=True):
  """Every finite bfloat16 value of the binades 2^lo_exp..2^hi_exp (both signs, every tie), with the
  subnormals if asked, as a (R, 256) float32 array padded with zeros; in bit order (neighbouring values
  share a block) or shuffled."""
  bits = np.arange(1 << 16, dtype=np.uint32)
  exp = (bits >> 7) & 0xFF
  keep = ((exp >= 127 + lo_exp) & (exp <= 127 + hi_exp) & (exp != 0xFF)) | ((exp == 0) & subnormals)
  v = (bits[keep] << 16).view(np.float32)
  if shuffle:
    v = np.random.default_rng(7).permutation(v)
  v = np.concatenate([v, np.zeros(-v.size % 4096, np.float32)])
  return jnp.asarray(v.reshape(-1, 256))


def make_bits(shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), jnp.uint8)


def assert_bits_equal(got, want):
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


SHAPES_NVFP4 = [(16, 16), (304, 304), (256, 1024)]
SHAPES_MXFP4 = [(16, 32), (304, 320), (256, 1024)]
SLOW_SHAPES = [(2, 48, 64), (1024, 256), (96, 4096), (512, 512)]
# Cases (CPU, interpreted): every shape with float32 + nearest and bfloat16 + stochastic; the default suite
# keeps an unaligned shape with bfloat16 + stochastic and the multi-block one with float32 + nearest (nvfp4),
# the unaligned one (mxfp4; float32 + nearest: test_mxfp4_floor_rule). The full cross product of shapes x
# dtypes x roundings is marked slow as well.
_PAIRS = [(jnp.float32, False), (jnp.bfloat16, True)]
_DEFAULT_CASES = {((304, 304), jnp.bfloat16, True), ((256, 1024), jnp.float32, False), ((304, 320), jnp.bfloat16, True)}


def _cases(cases):
  return [c if c in _DEFAULT_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in cases]


NVFP4_CASES = _cases([(s, d, r) for s in SHAPES_NVFP4 for d, r in _PAIRS])
MXFP4_CASES = _cases([(s, d, r) for s, (d, r) in zip(SHAPES_MXFP4, _PAIRS * 2)])
FULL = [(d, r) for d in DTYPES for r in (False, True)]


class _Quantize1dCases:
  INTERPRET = True

  @pytest.mark.parametrize("shape,dtype,stochastic", NVFP4_CASES)
  def test_nvfp4_matches_reference(self, shape, dtype, stochastic):
    self._check("nvfp4", shape, dtype, stochastic)

  @pytest.mark.parametrize("shape,dtype,stochastic", MXFP4_CASES)
  def test_mxfp4_matches_reference(self, shape, dtype, stochastic):
    self._check("mxfp4", shape, dtype, stochastic)

  @pytest.mark.parametrize("fmt,lo,hi,shuffle,stochastic", [
      pytest.param("mxfp4", -120, 127, False, False, marks=pytest.mark.slow),   # the shuffled one runs by default
      ("mxfp4", -120, 127, True, True),
      ("nvfp4", -14, 8, False, False), ("nvfp4", -14, 8, True, True),
      ("nvfp4", -90, -66, True, False)])     # tensor amax below 2^-64: the 2^64 rescaling
  def test_dense_sweep_of_bf16_values(self, fmt, lo, hi, shuffle, stochastic):
    """Every finite bf16 value of the binades one NVFP4 tensor amax spans (nvfp4, with subnormals), or
    down to 2^-120 (mxfp4: block amaxes near float32's subnormal range are flushed by CPU XLA, see
    KERNELS.md), == the reference."""
    x = bf16_sweep(lo, hi, shuffle, subnormals=fmt == "nvfp4")
    amax = jnp.max(jnp.abs(x))
    bits = make_bits(x.shape) if stochastic else None
    got = K1.quantize_1d(x, amax, bits, fmt=fmt, interpret=self.INTERPRET)
    assert_bits_equal(got, K1.quantize_1d_reference(x, amax, bits, fmt=fmt))

  def test_mxfp4_floor_rule(self):
    self._check("mxfp4", (64, 256), jnp.float32, False, scale_rule="floor")

  def test_batched_amax(self):
    x = make_input((3, 32, 64), jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=(1, 2)) * jnp.array([1.0, 2.0, 0.5])
    got = K1.quantize_1d(x, amax, interpret=self.INTERPRET)
    assert_bits_equal(got, K1.quantize_1d_reference(x, amax))

  @pytest.mark.slow
  @pytest.mark.parametrize("dtype,stochastic", FULL)
  @pytest.mark.parametrize("fmt,shape", [("nvfp4", s) for s in SHAPES_NVFP4 + SLOW_SHAPES]
                           + [("mxfp4", s) for s in SHAPES_MXFP4 + SLOW_SHAPES])
  def test_sweep(self, fmt, shape, dtype, stochastic):
    self._check(fmt, shape, dtype, stochastic)

  def _check(self, fmt, shape, dtype, stochastic, scale_rule="rceil"):
    x = make_input(shape, dtype)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    bits = make_bits(shape) if stochastic else None
    got = K1.quantize_1d(x, amax, bits, fmt=fmt, scale_rule=scale_rule, interpret=self.INTERPRET)
    assert_bits_equal(got, K1.quantize_1d_reference(x, amax, bits, fmt=fmt, scale_rule=scale_rule))


  @pytest.mark.slow   # the default representative: test_quantize_with_key_hashes_in_the_kernel
  @pytest.mark.parametrize("fmt,shape,axis", [("nvfp4", (2, 24, 48), -1), ("mxfp4", (64, 3, 16), 0)])
  def test_keyed_bits_match_reference(self, fmt, shape, axis):
    """SR bits hashed in the kernel from the key (random_bits.KeyedBits) == the twin with
    jax.random.bits drawn in x's own layout and moved to the quantized axis."""
    key = jax.random.key(12)
    x = jnp.moveaxis(make_input(shape, jnp.bfloat16), axis, -1)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    keyed = random_bits.KeyedBits.of(key, shape, axis)
    got = K1.quantize_1d(x, amax, keyed, fmt=fmt, interpret=self.INTERPRET)
    bits = jnp.moveaxis(jax.random.bits(key, shape, jnp.uint8), axis, -1)
    assert_bits_equal(got, K1.quantize_1d_reference(x, amax, bits, fmt=fmt))


  @pytest.mark.slow   # the default representative: test_quantize_with_packed_bits_hashes_them_in_the_kernel
  @pytest.mark.parametrize("layout", GROUPED)
  @pytest.mark.parametrize("fmt,shape,axis", [("nvfp4", (2, 24, 48), -1), ("mxfp4", (64, 3, 16), 0)])
  def test_packed_bits_match_twin(self, fmt, shape, axis, layout):
    """SR bits of the packed layout (one hash per 8 elements along the quantized axis) hashed in the kernel ==
    the twin with random_bits.rounding_bits drawn in XLA."""
    key = jax.random.key(16)
    x = jnp.moveaxis(make_input(shape, jnp.bfloat16), axis, -1)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    got = K1.quantize_1d(x, amax, random_bits.KeyedBits.of(key, shape, axis, layout), fmt=fmt,
                         interpret=self.INTERPRET)
    bits = jnp.moveaxis(random_bits.rounding_bits(key, shape, axis, layout), axis, -1)
    assert_bits_equal(got, K1.quantize_1d_reference(x, amax, bits, fmt=fmt))


class _Quantize2dCases:
  INTERPRET = True

  @pytest.mark.slow   # the default representative: test_quantize_with_packed_bits_hashes_them_in_the_kernel
  @pytest.mark.parametrize("layout", GROUPED)
  def test_packed_bits_match_twin(self, layout):
    key = jax.random.key(17)
    x = make_input((48, 80), jnp.float32)
    amax = jnp.max(jnp.abs(x))
    got = K2.quantize_2d(x, amax, random_bits.KeyedBits.of(key, x.shape, -1, layout), interpret=self.INTERPRET)
    assert_bits_equal(got, K2.quantize_2d_reference(x, amax, random_bits.rounding_bits(key, x.shape, -1, layout)))

  @pytest.mark.slow
  def test_keyed_bits_match_reference(self):
    key = jax.random.key(13)
    x = make_input((48, 80), jnp.float32)
    amax = jnp.max(jnp.abs(x))
    got = K2.quantize_2d(x, amax, random_bits.KeyedBits.of(key, x.shape), interpret=self.INTERPRET)
    assert_bits_equal(got, K2.quantize_2d_reference(x, amax, jax.random.bits(key, x.shape, jnp.uint8)))

  @pytest.mark.parametrize("shape,dtype,stochastic", NVFP4_CASES)
  def test_matches_reference(self, shape, dtype, stochastic):
    self._check(shape, dtype, stochastic)

  @pytest.mark.slow
  @pytest.mark.parametrize("dtype,stochastic", FULL)
  @pytest.mark.parametrize("shape", SHAPES_NVFP4 + [(2, 48, 64), (1024, 256), (512, 512), (16, 4096)])
  def test_sweep(self, shape, dtype, stochastic):
    self._check(shape, dtype, stochastic)

  @pytest.mark.parametrize("shuffle,stochastic", [(False, False), (True, True)])
  @pytest.mark.parametrize("lo,hi", [(-14, 8), (-90, -66)])
  def test_dense_sweep_of_bf16_values(self, shuffle, stochastic, lo, hi):
    x = bf16_sweep(lo, hi, shuffle)
    amax = jnp.max(jnp.abs(x))
    bits = make_bits(x.shape) if stochastic else None
    assert_bits_equal(K2.quantize_2d(x, amax, bits, interpret=self.INTERPRET),
                      K2.quantize_2d_reference(x, amax, bits))

  def _check(self, shape, dtype, stochastic):
    x = make_input(shape, dtype)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    bits = make_bits(shape) if stochastic else None
    got = K2.quantize_2d(x, amax, bits, interpret=self.INTERPRET)
    assert_bits_equal(got, K2.quantize_2d_reference(x, amax, bits))


class _QuantizeRhtTCases:
  INTERPRET = True

  @pytest.mark.parametrize("shape,dtype,stochastic",   # float32 + nearest by default: the nvfp4 -90..-66 sweep
                           [pytest.param((16, 16), jnp.float32, False, marks=pytest.mark.slow),
                            ((16, 16), jnp.bfloat16, True), ((304, 304), jnp.bfloat16, True),
                            pytest.param((256, 1024), jnp.float32, False, marks=pytest.mark.slow)])
  def test_nvfp4_matches_reference(self, shape, dtype, stochastic):
    self._check("nvfp4", shape, dtype, stochastic)

  @pytest.mark.slow   # mxfp4's transposed RHT quantize runs by default in test_dense_sweep_of_bf16_values[mxfp4-...]
  def test_mxfp4_matches_reference(self):
    self._check("mxfp4", (64, 48), jnp.bfloat16, True)

  # ~200 s interpreted on a loaded 2-core VM (16 unrolled hashes); its Triton lowering and sm_90 compile are
  # default tests (test_kernels_triton_lowering.py, test_gpu_aot.py)
  @pytest.mark.slow
  def test_keyed_bits_match_reference(self):
    """The bits (C, T) hashed in the kernel per channel row and token column == jax.random.bits (C, T)."""
    key = jax.random.key(14)
    x = make_input((48, 40), jnp.bfloat16)
    amax = KR.rht_amax(x)
    got = KR.quantize_rht_t(x, amax, random_bits.KeyedBits.of(key, (40, 48)), interpret=self.INTERPRET)
    assert_bits_equal(got, KR.quantize_rht_t_reference(x, amax, jax.random.bits(key, (40, 48), jnp.uint8)))

  @pytest.mark.slow   # the default representative: test_quantize_with_packed_bits_hashes_them_in_the_kernel
  @pytest.mark.parametrize("layout", GROUPED)
  @pytest.mark.parametrize("fmt,shape", [("nvfp4", (48, 40)), ("mxfp4", (64, 24))])
  def test_packed_bits_match_twin(self, fmt, shape, layout):
    """A grouped layout's bits (C, T), 8 or 16 tokens per hash, hashed row by row in the kernel == the twin's."""
    key = jax.random.key(18)
    x = make_input(shape, jnp.bfloat16)
    amax = KR.rht_amax(x)
    t, c = shape
    got = KR.quantize_rht_t(x, amax, random_bits.KeyedBits.of(key, (c, t), -1, layout), fmt=fmt,
                            interpret=self.INTERPRET)
    bits = random_bits.rounding_bits(key, (c, t), -1, layout)
    assert_bits_equal(got, KR.quantize_rht_t_reference(x, amax, bits, fmt=fmt))

  @pytest.mark.slow
  @pytest.mark.parametrize("dtype,stochastic", FULL)
  @pytest.mark.parametrize("fmt,shape", [("nvfp4", s) for s in SHAPES_NVFP4 + [(1024, 256)]]
                           + [("mxfp4", s) for s in [(32, 16), (320, 304), (256, 1024), (1024, 256)]])
  def test_sweep(self, fmt, shape, dtype, stochastic):
    self._check(fmt, shape, dtype, stochastic)

  @pytest.mark.slow
  @pytest.mark.parametrize("rht_size,seed", [(32, None), (64, 7), (8, None)])
  def test_other_rht_sizes(self, rht_size, seed):
    self._check("nvfp4", (128, 64), jnp.float32, False, rht_size=rht_size, rht_seed=seed)

  @pytest.mark.parametrize("fmt,lo,hi,stochastic", [("nvfp4", -14, 8, True), ("nvfp4", -90, -66, False),
                                                   ("mxfp4", -120, 127, True)])
  def test_dense_sweep_of_bf16_values(self, fmt, lo, hi, stochastic):
    """Every finite bf16 value of those binades, shuffled, as (T, C) (the RHT of the largest overflows
    to inf for mxfp4: inf blocks), == the reference."""
    x = bf16_sweep(lo, hi, shuffle=True, subnormals=fmt == "nvfp4")
    amax = KR.rht_amax(x)
    bits = make_bits(x.shape[::-1]) if stochastic else None
    got = KR.quantize_rht_t(x, amax, bits, fmt=fmt, interpret=self.INTERPRET)
    assert_bits_equal(got, KR.quantize_rht_t_reference(x, amax, bits, fmt=fmt))

  def _check(self, fmt, shape, dtype, stochastic, rht_size=16, rht_seed=None):
    x = make_input(shape, dtype)
    amax = KR.rht_amax(x, rht_size=rht_size, rht_seed=rht_seed)
    bits = make_bits(shape[::-1]) if stochastic else None
    kw = dict(fmt=fmt, rht_size=rht_size, rht_seed=rht_seed)
    got = KR.quantize_rht_t(x, amax, bits, interpret=self.INTERPRET, **kw)
    assert_bits_equal(got, KR.quantize_rht_t_reference(x, amax, bits, **kw))


class TestQuantize1dInterpret(_Quantize1dCases):
  INTERPRET = True


class TestQuantize2dInterpret(_Quantize2dCases):
  INTERPRET = True


class TestQuantizeRhtTInterpret(_QuantizeRhtTCases):
  INTERPRET = True


def test_quantize_with_key_hashes_in_the_kernel():
  """fp4jax.quantize(rounding="stochastic", key=...) with impl="pallas" hands the kernel the key (no
  bits array of x's size) and gives the XLA path's codes; here along axis 0 (the counters of x's own
  layout, moved)."""
  key = jax.random.key(15)
  x = make_input((64, 48), jnp.bfloat16)
  q = lambda impl: fp4jax.quantize(x, "nvfp4", axis=0, rounding="stochastic", key=key, impl=impl)
  eqn = [e for e in jax.make_jaxpr(lambda: q("pallas"))().eqns if str(e.primitive) == "fp4jax_quantize"][0]
  assert eqn.params["keyed"] and all(v.aval.size < x.size for v in eqn.invars[1:])
  got, want = q("pallas"), q("xla")
  assert_bits_equal((got.data, got.scale.view(jnp.uint8)), (want.data, want.scale.view(jnp.uint8)))


@pytest.mark.parametrize("layout", GROUPED)
def test_quantize_with_packed_bits_hashes_them_in_the_kernel(layout):
  """fp4jax.quantize(sr_bits=a grouped layout) hands the kernel that layout's KeyedBits (cols: one counter per
  8 or 16 columns reach the kernel) and gives the XLA path's codes, which differ from the "jax" layout's."""
  key = jax.random.key(19)
  x = make_input((64, 48), jnp.bfloat16)
  q = lambda impl, sr_bits: fp4jax.quantize(x, "nvfp4", axis=0, rounding="stochastic", key=key, impl=impl,
                                            sr_bits=sr_bits)
  eqn = [e for e in jax.make_jaxpr(lambda: q("pallas", layout))().eqns if str(e.primitive) == "fp4jax_quantize"][0]
  assert eqn.params["keyed"] == layout and all(v.aval.size < x.size for v in eqn.invars[1:])
  got, want = q("pallas", layout), q("xla", layout)
  assert_bits_equal((got.data, got.scale.view(jnp.uint8)), (want.data, want.scale.view(jnp.uint8)))
  default = q("xla", "jax")
  assert np.mean(np.asarray(default.data) != np.asarray(want.data)) > 0.2
  assert np.array_equal(np.asarray(default.scale.view(jnp.uint8)), np.asarray(want.scale.view(jnp.uint8)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", GROUPED)
def test_packed_bits_under_vmap_over_keys_and_of_a_window(layout):
  """The packed KeyedBits through the primitive's batching (a key per slice in the rows, the cols shared) and
  of a Window (fp4jax.grouped's piece of an expert's draw): kernel == XLA path."""
  keys = jax.random.split(jax.random.key(5), 3)
  x = make_input((3, 32, 48), jnp.float32)
  q = lambda impl: jax.vmap(lambda x, k: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=k, impl=impl,
                                                         sr_bits=layout).data)(x, keys)
  np.testing.assert_array_equal(np.asarray(q("pallas")), np.asarray(q("xla")))
  window = random_bits.Window.of(jax.random.key(9), (40, 96), (8, 16), (8, 32))
  x = make_input((8, 32), jnp.float32)
  q = lambda impl: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=window, impl=impl, sr_bits=layout).data
  np.testing.assert_array_equal(np.asarray(q("pallas")), np.asarray(q("xla")))


# ----------------------------------------------------------------- kernel-friendly numerics

def _dense_floats():
  rng = np.random.default_rng(0)
  v = np.abs(rng.standard_normal(1 << 18)).astype(np.float32)
  v *= np.exp2(rng.integers(-24, 14, v.size)).astype(np.float32)
  grid = np.asarray(jax.lax.bitcast_convert_type(jnp.arange(127, dtype=jnp.uint8),
                                                 jnp.float8_e4m3fn).astype(jnp.float32))
  mids = (grid[1:] + grid[:-1]) / 2
  edges = np.array([0, 448, 449, 464, 465, 1e30, np.inf, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10],
                   np.float32)
  return jnp.asarray(np.concatenate([v, grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                                     edges]).astype(np.float32))


def test_e4m3_byte_matches_cast():
  v = _dense_floats()
  want = jax.lax.bitcast_convert_type(e4m3_rne_satfinite(v), jnp.uint8).astype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(C.e4m3_byte)(v)), np.asarray(want))


def test_e4m3_value_matches_cast():
  b = jnp.arange(256, dtype=jnp.int32)
  want = jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(C.e4m3_value(b)), np.asarray(want))


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_e8m0_bytes_match_reference(rule):
  v = jnp.concatenate([_dense_floats(), jnp.array([3.0, 3.1, 6.0, 6.0001, 7.0, 12.0], jnp.float32)])
  v = v[v > 1e-36]   # float32 subnormal block amaxes: CPU XLA flushes them (see KERNELS.md)
  e = e8m0_exponent(v, rule)
  want = jax.lax.bitcast_convert_type(e8m0_from_exponent(e, v), jnp.uint8).astype(jnp.int32)
  byte, inv, exp = jax.jit(lambda a: C.e8m0_block_encode(a, rule))(v)
  np.testing.assert_array_equal(np.asarray(exp), np.asarray(e))
  np.testing.assert_array_equal(np.asarray(byte), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(inv),
                                np.asarray(jnp.ldexp(jnp.float32(1), jnp.maximum(-e, -126))))


def _e2m1_sweep():
  """Every bfloat16 bit pattern as float32 (all binades, ±0, subnormals, ±inf, NaNs), 2^20 random float32
  bit patterns, each E2M1 grid point and rounding threshold with both float32 neighbours, and a dense
  grid over [-8, 8]."""
  bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
  rnd = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
  pts = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8], np.float32)
  near = np.concatenate([pts, np.nextafter(pts, np.float32(0)), np.nextafter(pts, np.float32(100))])
  dense = np.linspace(0, 8, 1 << 17, dtype=np.float32)
  return np.concatenate([bf16, rnd.view(np.float32), near, -near, dense, -dense]).astype(np.float32)


def test_e2m1_bit_encode_rne_matches_reference():
  v = jnp.asarray(_e2m1_sweep())
  want = jax.jit(e2m1.encode_rne)(v).astype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(C.encode_rne_bits)(v)), np.asarray(want))


def test_e2m1_bit_encode_stochastic_matches_reference():
  """Every 8-bit random value against each of 8192 inputs (grid points, thresholds and neighbours, a
  dense grid, specials), and random bits for the rest of the sweep."""
  v = _e2m1_sweep()
  head = np.concatenate([v[-(1 << 18):][::64], v[:1 << 16][::16]])        # dense grid + bf16 patterns
  x = jnp.asarray(np.repeat(head[:, None], 256, axis=1))
  bits = jnp.asarray(np.broadcast_to(np.arange(256, dtype=np.uint8), x.shape))
  x = jnp.concatenate([x.ravel(), jnp.asarray(v)])
  bits = jnp.concatenate([bits.ravel(), make_bits(v.shape)])
  want = jax.jit(e2m1.encode_stochastic)(x, bits).astype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(C.encode_sr_bits)(x, bits)), np.asarray(want))


@pytest.mark.parametrize("dim,pref,want", [(16, 32, (16, 16)), (304, 32, (16, 304)),
                                           (19, 8, (4, 20)), (1024, 32, (32, 1024)), (1, 8, (1, 1))])
def test_fit(dim, pref, want):
  block, padded = C.fit(dim, pref)
  assert (block, padded) == want and block & (block - 1) == 0 and padded % block == 0


def _kernel_operand_shapes(fn):
  """The operand shapes of the pallas_call in fn's jaxpr."""
  eqn = next(e for e in jax.make_jaxpr(fn)().eqns if str(e.primitive) == "pallas_call")
  return [tuple(v.aval.shape) for v in eqn.invars]


@pytest.mark.parametrize("layout", (random_bits.JAX,) + GROUPED)
def test_kernels_count_the_rows_from_the_first(layout):
  """KeyedBits along the last axis count their rows by a stride (``row_stride``), so the 1D and the RHT
  kernels read the first row (1, 4) and count the others themselves: no (R, 4) operand (the XLA pass that wrote
  it was a launch per SR quantize, docs/PERF.md "The SR key rows counted in the kernels"). Several row blocks,
  a run of rows cut out (a shard's), and the same bits as the twin's."""
  key = jax.random.key(21)
  x = make_input((320, 64), jnp.bfloat16)
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  keyed = random_bits.KeyedBits.of(key, x.shape, -1, layout)
  assert keyed.row_stride == 64 // random_bits.group(layout)
  drawn = keyed.make()
  for lo, hi in ((0, 320), (96, 224)):   # the whole, and a run of rows with its own first row
    part = dataclasses.replace(keyed, rows=keyed.rows[lo:hi])
    call = lambda: K1.quantize_1d(x[lo:hi], amax, part, interpret=True)
    assert (hi - lo, 4) not in _kernel_operand_shapes(call) and (1, 4) in _kernel_operand_shapes(call)
    assert_bits_equal(call(), K1.quantize_1d_reference(x[lo:hi], amax, drawn[lo:hi]))
  xt = make_input((64, 320), jnp.bfloat16, seed=1)   # (T, C): rows are the C channels
  amax_t = KR.rht_amax(xt)
  keyed_t = random_bits.KeyedBits.of(key, (320, 64), -1, layout)
  call = lambda: KR.quantize_rht_t(xt, amax_t, keyed_t, interpret=True)
  assert (320, 4) not in _kernel_operand_shapes(call) and (1, 4) in _kernel_operand_shapes(call)
  assert_bits_equal(call(), KR.quantize_rht_t_reference(xt, amax_t, keyed_t.make()))
  # along another axis the rows do not count by one stride: each row's counter is read
  assert random_bits.KeyedBits.of(key, (64, 320), 0, random_bits.JAX).row_stride is None
