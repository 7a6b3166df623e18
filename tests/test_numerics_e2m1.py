"""E2M1 rounding, stochastic rounding, codes and packing (spec §1, §4)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import e2m1

# Spec §1 table: (interval, code) with its closed/open ends, checked at the ends and inside.
TABLE = [  # (low, low_inclusive, high, high_inclusive, code)
    (0.0, True, 0.25, True, 0), (0.25, False, 0.75, False, 1), (0.75, True, 1.25, True, 2),
    (1.25, False, 1.75, False, 3), (1.75, True, 2.5, True, 4), (2.5, False, 3.5, False, 5),
    (3.5, True, 5.0, True, 6),
]


def _codes(x):
  return np.asarray(jax.jit(e2m1.encode_rne)(jnp.asarray(x, jnp.float32)))


def test_table_intervals_and_tie_points():
  for low, low_in, high, high_in, code in TABLE:
    lo = np.float32(low) if low_in else np.nextafter(np.float32(low), np.float32(np.inf))
    hi = np.float32(high) if high_in else np.nextafter(np.float32(high), np.float32(0))
    mid = np.float32((low + high) / 2)
    assert list(_codes([lo, mid, hi])) == [code] * 3, (low, high)
    assert list(_codes([-lo, -mid, -hi])) == [code | 8] * 3
  # above 5 saturates to 6 (code 7), including huge values and inf
  assert list(_codes([np.nextafter(np.float32(5), np.float32(9)), 6, 7, 1e30, np.inf])) == [7] * 5
  assert list(_codes([-7.0, -np.inf])) == [15, 15]


def test_rne_matches_float4_cast_on_dense_sweep():
  x = np.linspace(-7, 7, 200_001, dtype=np.float32)
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  x = np.concatenate([x, ties, -ties])
  ours = e2m1.decode(jnp.asarray(_codes(x)))
  cast = jnp.asarray(x).astype(jnp.float4_e2m1fn).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(cast))


def test_negative_values_rounding_to_zero_keep_sign_bit():
  assert list(_codes([-0.2, -0.0, 0.0, 0.1])) == [8, 8, 0, 0]


def test_decode_all_codes():
  np.testing.assert_array_equal(
      np.asarray(e2m1.decode(jnp.arange(16, dtype=jnp.uint8))),
      np.concatenate([e2m1.VALUES, -e2m1.VALUES]))


def test_pack_order_and_roundtrip():
  codes = jnp.array([[0x1, 0xA, 0x3, 0xF]], jnp.uint8)
  packed = e2m1.pack(codes)
  assert packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(packed), [[0xA1, 0xF3]])   # even element in the low nibble
  codes = jax.random.randint(jax.random.key(0), (3, 5, 64), 0, 16).astype(jnp.uint8)
  np.testing.assert_array_equal(np.asarray(e2m1.unpack(e2m1.pack(codes))), np.asarray(codes))


def _sr_all_bits(x):
  """Stochastic rounding of x under each of the 256 possible random bytes."""
  return np.asarray(e2m1.round_stochastic(jnp.full((256,), x, jnp.float32), jnp.arange(256, dtype=jnp.uint8)))


@pytest.mark.parametrize("x, up, down, threshold", [
    (1.3, 1.5, 1.0, 103), (5.5, 6.0, 4.0, 64), (0.1, 0.5, 0.0, 205)])
def test_sr_spec_vectors(x, up, down, threshold):
  expected = np.where(np.arange(256) >= threshold, up, down)
  np.testing.assert_array_equal(_sr_all_bits(x), expected)
  np.testing.assert_array_equal(_sr_all_bits(-x), -expected)


def test_sr_saturates_and_keeps_grid_values():
  np.testing.assert_array_equal(_sr_all_bits(7.0), np.full(256, 6.0))
  for v in e2m1.VALUES:
    np.testing.assert_array_equal(_sr_all_bits(float(v)), np.full(256, v))


def test_sr_uses_low_byte_of_wider_bits():
  x = jnp.full((256,), 1.3, jnp.float32)
  bits8 = jnp.arange(256, dtype=jnp.uint8)
  bits32 = bits8.astype(jnp.uint32) | jnp.uint32(0xABCD00)
  np.testing.assert_array_equal(np.asarray(e2m1.round_stochastic(x, bits8)),
                                np.asarray(e2m1.round_stochastic(x, bits32)))


def test_sr_statistics():
  """Mean over draws converges to x (bound from the per-element variance); always within one step."""
  n = 20_000
  xs = np.array([0.1, 0.3, 0.7, 1.3, 1.9, 2.2, 3.3, 4.9, 5.5, -2.7], np.float32)
  bits = jax.random.bits(jax.random.key(42), (n, xs.size), jnp.uint8)
  q = np.asarray(e2m1.round_stochastic(jnp.broadcast_to(jnp.asarray(xs), (n, xs.size)), bits))
  grid = np.concatenate([-e2m1.VALUES[::-1], e2m1.VALUES])
  for j, x in enumerate(xs):
    lo = grid[grid <= x].max()
    hi = grid[grid >= x].min()
    assert set(np.unique(q[:, j])) <= {lo, hi}
    # Bernoulli between lo and hi: exact mean x (up to the 1/256 resolution of u), variance (hi-x)(x-lo).
    sd = np.sqrt(max((hi - x) * (x - lo), 1e-12) / n)
    resolution = (hi - lo) / 256
    assert abs(q[:, j].mean() - x) <= 5 * sd + resolution, (x, q[:, j].mean())
  other = np.asarray(e2m1.round_stochastic(
      jnp.broadcast_to(jnp.asarray(xs), (n, xs.size)),
      jax.random.bits(jax.random.key(43), (n, xs.size), jnp.uint8)))
  assert (other != q).any()
