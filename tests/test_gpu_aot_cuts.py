"""The emulation-overhead cuts of the XLA composition give the same bits on the CPU as the code they replace.

``kernels.quantize_rht_t.rht_amax(..., one_pass=True)`` (the NVFP4 tensor amax after the RHT, which
``fp4jax.api`` now takes for both impls) runs the butterfly on strided row slices instead of
``max |hadamard.rht(x, axis=0)|`` (a transpose and a materialized float32 tensor per butterfly stage on
the GPU); ``quantize_rht_t_rows`` (the XLA composition of the nvfp4 wgrad operand) does the same for
the transposed quantize. Both must equal the reference bit for bit, ±inf included. With a NaN input
only NaN is asserted: ``_old_rht_amax`` below is the former float form, and on XLA CPU a float max
reduction loses a NaN for some shapes (a (128, 33) float32 tensor with one NaN: ``jnp.max(jnp.abs(x))`` is
finite), which is why fp4jax takes every amax on the magnitudes' bits (``fp4jax.numerics.amax``).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import hadamard
from fp4jax import reference
from fp4jax.kernels import quantize_rht_t
from fp4jax.kernels.quantize_rht_t import quantize_rht_t_rows, rht_amax, rht_amaxes
from fp4jax.numerics import nvfp4


def _old_rht_amax(x, rht_size, rht_seed):
  return jnp.max(jnp.abs(hadamard.rht(x, axis=0, size=rht_size, seed=rht_seed)))


def _cases():
  rng = np.random.default_rng(22)
  out = []
  for i, (t, c, n, seed) in enumerate([(64, 48, 16, None), (256, 40, 16, 5), (96, 7, 32, None),
                                        (128, 33, 16, 3), (64, 16, 32, 11), (16, 1, 16, 9)]):
    x = rng.standard_normal((t, c)) * np.exp(rng.uniform(-40, 40, (t, c)))
    if i == 1:
      x[rng.integers(0, t), rng.integers(0, c)] = np.nan
    if i == 2:
      x[rng.integers(0, t), rng.integers(0, c)] = -np.inf
    if i == 5:
      x[:] = -0.0
    out.append((x, n, seed))
  return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_pass_rht_amax_equals_the_materialized_one(dtype):
  cases = _cases()

  def both(*xs):   # one compile for all cases
    return [(rht_amax(x, rht_size=n, rht_seed=s, one_pass=True), _old_rht_amax(x, n, s))
            for x, (_, n, s) in zip(xs, cases)]
  got = jax.jit(both)(*[jnp.asarray(x, dtype) for x, _, _ in cases])
  for (x, n, seed), (new, old) in zip(cases, got):
    if np.isnan(x).any():   # the reference's reduction may lose it on the CPU (module docstring)
      assert np.isnan(np.asarray(new)), (x.shape, n, seed, new, old)
    else:
      assert np.asarray(new).tobytes() == np.asarray(old).tobytes(), (x.shape, n, seed, new, old)


def test_one_pass_rht_amax_on_bf16_extremes():
  """Every finite bf16 magnitude class at once: subnormals to the largest, mixed signs."""
  bits = np.arange(0, 1 << 16, 1, dtype=np.uint16)
  x = bits.view(jnp.bfloat16).astype(np.float32)
  x = x[np.isfinite(x)]
  small = x[np.abs(x) < 2.0 ** 120]     # no sum of 16 overflows: the transform stays finite
  small = small[: (small.size // 256) * 256].reshape(-1, 16)
  xx = jnp.asarray(small, jnp.bfloat16)
  assert np.asarray(rht_amax(xx, one_pass=True)).tobytes() == np.asarray(_old_rht_amax(xx, 16, None)).tobytes()
  # With the largest binades the butterfly meets inf - inf: the transformed tensor holds NaN, and the
  # one-pass amax says so (the reduction of the materialized transform may lose it on the CPU).
  big = jnp.asarray(x[: (x.size // 256) * 256].reshape(-1, 16), jnp.bfloat16)
  assert np.isnan(np.asarray(hadamard.rht(big, axis=0))).any()
  assert np.isnan(np.asarray(rht_amax(big, one_pass=True)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_rht_amaxes_are_the_two_amaxes_from_one_read(dtype):
  """``rht_amaxes`` (what fp4jax.dot gives the rows quantize and the wgrad) equals
  ``nvfp4.tensor_amax`` and the one-pass ``rht_amax`` bit for bit; a NaN input makes both NaN (where
  ``jnp.max(|x|)`` may lose it on the CPU: its value is not compared then), and it is one reduce op."""
  cases = _cases()

  def all_(*xs):
    return [(rht_amaxes(x, rht_size=n, rht_seed=s), nvfp4.tensor_amax(x), rht_amax(x, rht_size=n, rht_seed=s,
                                                                                 one_pass=True))
            for x, (_, n, s) in zip(xs, cases)]
  xs = [jnp.asarray(x, dtype) for x, _, _ in cases]
  for (x, n, seed), ((a, r), a0, r0) in zip(cases, jax.jit(all_)(*xs)):
    if np.isnan(x).any():
      assert np.isnan(np.asarray(a)) and np.isnan(np.asarray(r)), (x.shape, n, seed, a, r)
      continue
    assert np.asarray(a).tobytes() == np.asarray(a0).tobytes(), (x.shape, n, seed, a, a0)
    assert np.asarray(r).tobytes() == np.asarray(r0).tobytes(), (x.shape, n, seed, r, r0)
  text = jax.jit(lambda x: rht_amaxes(x)).lower(xs[0]).as_text()
  reduces = re.findall(r"stablehlo.reduce\(.* across dimensions = \[([\d, ]+)\]", text)
  assert reduces == ["2", "0, 1"], "both amaxes must come from one reduction of x (one read), then one of its partials"
  with pytest.raises(ValueError, match="multiple of rht_size"):
    rht_amaxes(jnp.ones((24, 8)), rht_size=16)


def test_rht_amaxes_partials_fit_one_launch():
  """The chunks' partials reduce rows of at most 16384 channels (XLA's GPU emitter splits a longer row into two
  launches), as many as one launch then finishes: the 12B's 4096 chunks (8 x 8192 tokens) in 4 pieces of its
  widths, 8192 chunks in 2 (the MLP's 20480 still cut in two), a width no small count divides in one."""
  pieces = quantize_rht_t._row_pieces
  assert [pieces(4096, c) for c in (5120, 20480, 22784, 64)] == [4, 4, 4, 4]
  assert [pieces(8192, c) for c in (5120, 20480, 16411)] == [2, 2, 1]
  assert [pieces(65536, c) for c in (5120, 20480, 16384)] == [1, 2, 1]
  assert pieces(4, 64) == 8
  x = jnp.asarray(np.random.default_rng(1).standard_normal((32, 2 * quantize_rht_t._ROW_MAX + 32)), jnp.bfloat16)
  a, r = jax.jit(rht_amaxes)(x)
  assert np.asarray(a).tobytes() == np.asarray(nvfp4.tensor_amax(x)).tobytes()
  assert np.asarray(r).tobytes() == np.asarray(rht_amax(x, one_pass=True)).tobytes()


def test_rht_amaxes_on_bf16_extremes():
  """Every finite bf16 value: equal to both passes while the transform is finite; with the largest binades
  the butterfly meets inf - inf, and the RHT amax is NaN while max |x| stays the largest bf16."""
  x = np.arange(0, 1 << 16, 1, dtype=np.uint16).view(jnp.bfloat16).astype(np.float32)
  x = x[np.isfinite(x)]
  for part in (x[np.abs(x) < 2.0 ** 120], x):
    xx = jnp.asarray(part[: (part.size // 256) * 256].reshape(-1, 16), jnp.bfloat16)
    a, r = rht_amaxes(xx)
    assert np.asarray(a).tobytes() == np.asarray(nvfp4.tensor_amax(xx)).tobytes()
    r0 = rht_amax(xx, one_pass=True)
    assert np.asarray(r).tobytes() == np.asarray(r0).tobytes() or (np.isnan(r) and np.isnan(r0))
  assert np.isnan(np.asarray(r)) and np.isfinite(np.asarray(a))


def _rows_cases():
  """(x, rht_size, seed, stochastic, amax override) covering RNE and SR, bf16 and f32 inputs, channels
  that are not a multiple of anything, RHT-32 (two blocks per unit), a tiny tensor amax (the 2^64
  shift), zeros, ±inf, and values from subnormal-adjacent to huge."""
  rng = np.random.default_rng(2212)
  out = []
  for i, (t, c, n, seed, sr) in enumerate([(64, 48, 16, None, False), (128, 33, 16, 3, True),
                                           (96, 20, 32, None, False), (64, 16, 32, 11, True),
                                           (48, 7, 16, None, True), (32, 40, 16, 5, False),
                                           (16, 1, 16, None, True)]):
    x = rng.standard_normal((t, c)) * np.exp(rng.uniform(-30, 30, (t, c)))
    amax = None
    if i == 2:
      x[rng.integers(0, t), rng.integers(0, c)] = np.inf
    if i == 4:
      x = x * 1e-25          # tensor amax below 2^-64: the power-of-two shift
    if i == 5:
      x[:, :3] = 0.0
      amax = 0.0             # an all-zero tensor's amax with nonzero elements elsewhere: NaN factors
    if i == 6:
      x[:] = -0.0
    out.append((x, n, seed, sr, amax))
  return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
@pytest.mark.slow   # ~55 s on 2 loaded cores; by default test_quantize_rht_t_rows_on_every_bf16_value and _keeps_a_nan
def test_quantize_rht_t_rows_equals_the_reference(dtype):
  cases = _rows_cases()
  rng = np.random.default_rng(7)
  bits = [jnp.asarray(rng.integers(0, 256, x.shape[::-1]), jnp.uint8) if sr else None
          for x, _, _, sr, _ in cases]

  def both(xs, bs):   # one compile for all cases
    out = []
    for x, b, (_, n, seed, _, a) in zip(xs, bs, cases):
      amax = rht_amax(x, rht_size=n, rht_seed=seed, one_pass=True) if a is None else jnp.float32(a)
      out.append((quantize_rht_t_rows(x, amax, b, rht_size=n, rht_seed=seed),
                  reference.quantize_rht_t_reference(x, amax, b, fmt="nvfp4", rht_size=n, rht_seed=seed)))
    return out
  got = jax.jit(both)([jnp.asarray(x, dtype) for x, *_ in cases], bits)
  for (x, n, seed, sr, _), ((d1, s1), (d0, s0)) in zip(cases, got):
    assert d1.shape == d0.shape and d1.dtype == d0.dtype and s1.dtype == s0.dtype, (x.shape, n)
    assert np.asarray(d1).tobytes() == np.asarray(d0).tobytes(), (x.shape, n, seed, sr)
    assert np.asarray(s1).view(np.uint8).tobytes() == np.asarray(s0).view(np.uint8).tobytes(), (x.shape, n)


def test_quantize_rht_t_rows_on_every_bf16_value():
  """Every finite bf16 value (subnormals to the largest, both signs), shuffled into (T, C) columns, SR."""
  v = np.arange(0, 1 << 16, dtype=np.uint16).view(jnp.bfloat16).astype(np.float32)
  v = v[np.isfinite(v)]
  v = np.random.default_rng(3).permutation(v)[: (v.size // 512) * 512].reshape(-1, 32)
  x = jnp.asarray(v, jnp.bfloat16)
  bits = jnp.asarray(np.random.default_rng(4).integers(0, 256, x.shape[::-1]), jnp.uint8)
  amax = rht_amax(x, one_pass=True)
  new = jax.jit(lambda x, a, b: quantize_rht_t_rows(x, a, b))(x, amax, bits)
  old = jax.jit(lambda x, a, b: reference.quantize_rht_t_reference(x, a, b, fmt="nvfp4"))(x, amax, bits)
  assert np.asarray(new[0]).tobytes() == np.asarray(old[0]).tobytes()
  assert np.asarray(new[1]).view(np.uint8).tobytes() == np.asarray(old[1]).view(np.uint8).tobytes()


def test_quantize_rht_t_rows_keeps_a_nan():
  """A NaN gives a NaN amax and NaN scales (the NaN policy), where the reference can lose it on the CPU."""
  x = np.random.default_rng(5).standard_normal((128, 33)).astype(np.float32)
  x[77, 20] = np.nan
  amax = rht_amax(jnp.asarray(x), one_pass=True)
  assert np.isnan(np.asarray(amax))
  _, scale = jax.jit(lambda x, a: quantize_rht_t_rows(x, a))(jnp.asarray(x), amax)
  assert np.isnan(np.asarray(scale).astype(np.float32)).all()


def test_narrow_scaled_matmul_equals_the_reference():
  """The GPU's unmasked epilogue (``kernels.scaled_matmul.scaled_matmul_narrow_xla``) gives the
  reference's bf16 / f16 results bit for bit, extreme amaxes (the split factor) included."""
  import fp4jax
  from fp4jax.kernels.scaled_matmul import scaled_matmul_narrow_xla
  rng = np.random.default_rng(9)
  pairs = []
  for scale_a, scale_b in [(1.0, 1.0), (1e20, 1e19), (1e-30, 1e-25), (3e-3, 7e4)]:
    a = jnp.asarray(rng.standard_normal((48, 64)) * scale_a, jnp.float32)
    b = jnp.asarray(rng.standard_normal((32, 64)) * scale_b, jnp.float32)
    pairs.append((fp4jax.quantize(a, "nvfp4"), fp4jax.quantize(b, "nvfp4", tile=(16, 16))))

  def both(ps):
    return [(scaled_matmul_narrow_xla(qa, qb, dt), reference.scaled_matmul_reference(qa, qb, dt))
            for qa, qb in ps for dt in (jnp.bfloat16, jnp.float16)]
  for new, old in jax.jit(both)(pairs):
    assert new.dtype == old.dtype
    assert np.asarray(new).tobytes() == np.asarray(old).tobytes()
