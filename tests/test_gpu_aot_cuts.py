"""The emulation-overhead cuts of issue 22 give the same bits on the CPU as the code they replace.

``kernels.quantize_rht_t.rht_amax(..., one_pass=True)`` (the NVFP4 tensor amax after the RHT, for
the kernel path) runs the butterfly as one strided pass instead of ``max |hadamard.rht(x, axis=0)|``
(a transpose and a materialized float32 tensor per butterfly stage on the GPU); the amax must be
equal bit for bit, NaN and ±inf included.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import hadamard
from fp4jax.kernels.quantize_rht_t import rht_amax


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
    assert np.asarray(new).tobytes() == np.asarray(old).tobytes(), (x.shape, n, seed, new, old)


def test_one_pass_rht_amax_on_bf16_extremes():
  """Every finite bf16 magnitude class at once: subnormals to the largest, mixed signs."""
  bits = np.arange(0, 1 << 16, 1, dtype=np.uint16)
  x = bits.view(jnp.bfloat16).astype(np.float32)
  x = x[np.isfinite(x)][: (np.isfinite(x).sum() // 256) * 256].reshape(-1, 16)
  xx = jnp.asarray(x, jnp.bfloat16)
  assert np.asarray(rht_amax(xx, one_pass=True)).tobytes() == np.asarray(_old_rht_amax(xx, 16, None)).tobytes()
