"""The stochastic-rounding bit streams (fp4jax.random_bits; spec §4): every element's 8 bits uniform on 0..255
and independent of every other element's, of the same tensor, of another step, device or layer (another key:
``jax.random.fold_in``), and stochastic rounding with them unbiased.

Each test draws a fixed sample (fixed seeds) and compares a statistic with a bound derived from its variance
under the hypothesis, at 6 standard deviations (a chance of about 1e-9 of failing a correct stream): a
chi-square statistic with d degrees of freedom has mean d and variance 2d; a correlation of n independent
pairs has variance 1/n; a mean of n draws variance var/n. A stream that repeats or reuses bits, takes the
same byte for two elements, or correlates neighbours fails them (``test_the_tests_see_a_bad_stream``).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import random_bits
from fp4jax.numerics import e2m1

SIGMAS = 6
ROWS, COLS = 256, 512                 # 131072 elements: 512 per byte value
STREAMS = list(random_bits.SR_BITS)   # philox (the default), packed, jax


def draw(key, layout, shape=(ROWS, COLS), axis=-1):
  return np.asarray(random_bits.rounding_bits(key, shape, axis, layout)).astype(np.int64)


def chi2_uniform(values, bins):
  counts = np.bincount(values.ravel(), minlength=bins)
  expected = values.size / bins
  return float(((counts - expected) ** 2 / expected).sum())


def chi2_bound(dof):
  return dof + SIGMAS * np.sqrt(2 * dof)


def check_uniform(r, what):
  stat = chi2_uniform(r, 256)
  assert stat <= chi2_bound(255), f"{what}: chi-square {stat:.0f} of 256 byte values (bound {chi2_bound(255):.0f})"


def check_independent(a, b, what):
  """a, b: draws at paired positions. Their joint high nibbles uniform on 16 x 16 cells (which independence
  and uniformity imply), and the bytes uncorrelated."""
  stat = chi2_uniform((a >> 4) * 16 + (b >> 4), 256)
  assert stat <= chi2_bound(255), f"{what}: joint chi-square {stat:.0f} (bound {chi2_bound(255):.0f})"
  corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
  assert abs(corr) <= SIGMAS / np.sqrt(a.size), f"{what}: correlation {corr:.4f} of {a.size} pairs"


@pytest.mark.parametrize("layout", STREAMS)
def test_every_byte_position_is_uniform(layout):
  r = draw(jax.random.key(11), layout)
  check_uniform(r, layout)
  n = max(random_bits.group(layout), random_bits.GROUP)
  for e in range(n):   # each element of a hash's group (byte e of its 64 or 128 bits)
    stat = chi2_uniform(r[:, e::n], 256)
    assert stat <= chi2_bound(255), f"{layout}: byte {e} of each group, chi-square {stat:.0f}"
  for bit in range(8):                 # every bit a fair coin
    ones = float((r >> bit & 1).mean())
    assert abs(ones - 0.5) <= SIGMAS * 0.5 / np.sqrt(r.size), f"{layout}: bit {bit} is 1 in {ones:.4f}"


@pytest.mark.parametrize("layout", STREAMS)
def test_elements_of_one_tensor_are_independent(layout):
  r = draw(jax.random.key(12), layout)
  for lag in range(1, max(random_bits.group(layout), random_bits.GROUP) + 1):   # inside a group, and across
    # the boundary to the next
    check_independent(r[:, :-lag], r[:, lag:], f"{layout}: elements {lag} apart along the quantized axis")
  check_independent(r[:-1], r[1:], f"{layout}: the same column of neighbouring rows")
  # the rows a device's shard holds against another shard's rows (the counters are global)
  check_independent(r[:ROWS // 2], r[ROWS // 2:], f"{layout}: two halves of the rows (two shards)")


@pytest.mark.parametrize("layout", STREAMS)
def test_keys_of_other_steps_and_layers_are_independent(layout):
  base = jax.random.key(13)
  step0, step1 = jax.random.fold_in(base, 0), jax.random.fold_in(base, 1)
  layer_a, layer_b = jax.random.split(step0)
  pairs = {"consecutive steps": (step0, step1), "two layers of a step": (layer_a, layer_b),
           "a layer and its step's key": (layer_a, step0)}
  for what, (k1, k2) in pairs.items():
    a, b = draw(k1, layout), draw(k2, layout)
    check_uniform(b, f"{layout}: {what}")
    check_independent(a, b, f"{layout}: {what}, the same element")
    check_independent(a[:, :-1], b[:, 1:], f"{layout}: {what}, neighbouring elements")


@pytest.mark.parametrize("layout", STREAMS)
def test_stochastic_rounding_with_the_stream_is_unbiased(layout):
  """Spec §4's arithmetic with the stream's bits: the mean of many elements' roundings of one value is the
  value (the E2M1 grid step times the fraction of bytes at or above the threshold)."""
  r = draw(jax.random.key(14), layout)
  for value, step in ((1.3, 0.5), (5.5, 2.0), (0.1, 0.5), (2.7, 1.0)):
    codes = e2m1.encode_stochastic(jnp.full(r.shape, value, jnp.float32), jnp.asarray(r, jnp.uint8))
    got = np.asarray(e2m1.decode(codes), np.float64)
    low = np.floor(value / step) * step
    p = (value - low) / step
    sd = step * np.sqrt(p * (1 - p) / r.size)
    assert set(np.unique(got)) <= {low, low + step}, (value, np.unique(got))
    assert abs(got.mean() - value) <= SIGMAS * sd + step / 256, (layout, value, got.mean())


def test_the_tests_see_a_bad_stream():
  """Each check fails a stream with the flaw it looks for."""
  good = draw(jax.random.key(15), random_bits.DEFAULT)
  with pytest.raises(AssertionError):   # one byte per pair of elements: neighbours equal
    check_independent(np.repeat(good[:, ::2], 2, axis=1)[:, :-1], np.repeat(good[:, ::2], 2, axis=1)[:, 1:], "pairs")
  with pytest.raises(AssertionError):   # another key giving the same bits
    check_independent(good, good, "reused")
  with pytest.raises(AssertionError):   # 7 random bits and a constant one
    check_uniform(good | 1, "low bit stuck")
  with pytest.raises(AssertionError):   # a weak correlation only: 1 element in 16 copied from its neighbour
    b = good[:, 1:].copy()
    b[:, ::16] = good[:, :-1][:, ::16]
    check_independent(good[:, :-1], b, "copied")
