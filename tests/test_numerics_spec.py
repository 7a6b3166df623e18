"""The test vectors of NVFP4_SPEC.md, bit for bit: §3 MXFP4 scales, §5 RHT, §8 NVFP4."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.numerics import hadamard, scales
from fp4jax.reference import codes_of

BLOCK = np.array([0, .1, -.2, .3, .5, -.7, 1, 1.3, -1.6, 2, 2.4, -3, 3.7, 4.4, -5.2, 6], np.float32)


def scale_bytes(q):
  return np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_spec8_block(dtype):
  x = jnp.asarray(BLOCK)
  if dtype != jnp.float32:   # the vector is not exactly representable in 16 bits; check it survives
    x = x.astype(dtype)
  q = jax.jit(lambda v: fp4jax.quantize(v, "nvfp4"))(x)
  assert q.data.dtype == jnp.uint8 and q.scale.dtype == jnp.float8_e4m3fn and q.amax.dtype == jnp.float32
  assert float(q.amax) == 6.0
  assert list(scale_bytes(q)) == [0x7E]
  assert [int(c) for c in np.asarray(codes_of(q))] == [0, 0, 8, 1, 1, 9, 2, 3, 0xB, 4, 4, 0xD, 6, 6, 0xF, 7]
  assert np.asarray(q.data).tobytes().hex() == "001891324bd4667f"


def test_spec8_scaled_blocks():
  x = jnp.asarray(np.concatenate([BLOCK, BLOCK / 128]))
  q = fp4jax.quantize(x, "nvfp4")
  assert list(scale_bytes(q)) == [0x7E, 0x46]
  codes = np.asarray(codes_of(q))
  np.testing.assert_array_equal(codes[16:], codes[:16])
  q = fp4jax.quantize(jnp.asarray(np.concatenate([BLOCK, BLOCK * np.float32(0.3)])), "nvfp4")
  assert list(scale_bytes(q)) == [0x7E, 0x70]


@pytest.mark.parametrize("tensor_amax, block_amax, byte", [(4.8125, 1.6328125, 0x72),
                                                           (2.875, 1.078125, 0x73)])
def test_spec8_e4m3_ties(tensor_amax, block_amax, byte):
  x = jnp.zeros(32, jnp.float32).at[0].set(block_amax).at[16].set(tensor_amax)
  assert scale_bytes(fp4jax.quantize(x, "nvfp4"))[0] == byte
  # The same through the amax= argument.
  assert scale_bytes(fp4jax.quantize(x[:16], "nvfp4", amax=tensor_amax))[0] == byte


def test_spec8_underflow():
  x = jnp.zeros(32, jnp.float32).at[16].set(1.0).at[:4].set(jnp.array([1e-6, -2e-6, 3e-7, 0]))
  q = fp4jax.quantize(x, "nvfp4")
  assert scale_bytes(q)[0] == 0
  assert list(np.asarray(codes_of(q))[:16]) == [7, 0xF, 7] + [0] * 13
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q))[:16], np.zeros(16))


MX_TABLE = [(0, 0, 0), (0.75, 124, 124), (3.0, 126, 126), (3.1, 126, 127), (4, 127, 127),
            (6, 127, 127), (6.0001, 127, 128), (7, 127, 128), (12, 128, 128), (448, 133, 134)]


@pytest.mark.parametrize("amax, floor_byte, rceil_byte", MX_TABLE)
def test_spec3_mxfp4_scale_table(amax, floor_byte, rceil_byte):
  x = jnp.zeros(32, jnp.float32).at[5].set(amax).at[7].set(-amax / 3)
  for rule, byte in (("floor", floor_byte), ("rceil", rceil_byte)):
    q = fp4jax.quantize(x, "mxfp4", scale_rule=rule)
    assert q.scale.dtype == jnp.float8_e8m0fnu and q.amax is None
    assert scale_bytes(q)[0] == byte, rule
    # and directly from the scale helper
    assert int(scales.e8m0_exponent(jnp.float32(amax), rule)) + 127 == byte


def test_spec5_rht_vectors():
  np.testing.assert_array_equal(np.asarray(fp4jax.rht(jnp.eye(16)[0])), np.full(16, 0.25))
  np.testing.assert_array_equal(np.asarray(fp4jax.rht(jnp.ones(16))),
                                [-1, 0, 1, 0, 1, 0, -1, 0, 1, 2, 1, 0, 1, 0, 1, -2])
  np.testing.assert_array_equal(
      np.asarray(fp4jax.rht(jnp.arange(16.0))),
      [-14.5, -7.5, 6.5, -0.5, 6.5, -0.5, -14.5, 8.5, 7.5, 14.5, 0.5, 1.5, 0.5, -2.5, 9.5, -15.5])
  assert hadamard.signs(16) == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@pytest.mark.parametrize("size", [pytest.param(s, marks=pytest.mark.slow) if s not in (16, 128) else s
                                  for s in (2, 4, 16, 32, 128, 256)])   # NVFP4 and Quartet II's sizes by default
@pytest.mark.parametrize("seed", [None, 7])
def test_rht_orthogonal_and_matches_matrix(size, seed):
  m = hadamard.matrix(size, seed)
  np.testing.assert_allclose(m @ m.T, np.eye(size), atol=1e-12)
  x = np.random.default_rng(0).standard_normal((3, 2 * size)).astype(np.float32)
  y = np.asarray(fp4jax.rht(jnp.asarray(x), size=size, seed=seed))
  np.testing.assert_allclose(y, (x.reshape(3, 2, size) @ m).reshape(3, -1), rtol=1e-5, atol=1e-5)
  # along another axis, and cancelling inside a GEMM over that axis
  a = np.random.default_rng(1).standard_normal((2 * size, 5)).astype(np.float32)
  ya = fp4jax.rht(jnp.asarray(a), axis=0, size=size, seed=seed)
  yb = fp4jax.rht(jnp.asarray(a[:, :3]), axis=0, size=size, seed=seed)
  np.testing.assert_allclose(np.asarray(ya.T @ yb), a.T @ a[:, :3], rtol=1e-4, atol=1e-4)


def test_rht_seeded_signs_differ_and_bad_size():
  assert hadamard.signs(16, 1) != hadamard.signs(16, 2)
  with pytest.raises(ValueError, match="power of two"):
    fp4jax.rht(jnp.ones(24), size=24)
  with pytest.raises(ValueError, match="multiple of size=16"):
    fp4jax.rht(jnp.ones(24))
