"""Random test inputs from few compiled programs.

``jax.random.normal(key, shape)`` compiles one program per shape (threefry and the inverse error function:
0.2 to 2 s each on the CPU), and the suite draws hundreds of shapes. With jax's partitionable threefry (its
default), element i of a draw depends only on the key and i, so a draw of n elements is the first n of any
longer draw from the same key. ``normal`` and ``uniform`` therefore draw a power-of-two size class, compiled
once per process (and kept in the suite's compilation cache), take the first n elements on the host and
reshape: the same values (and dtype: float is jax's default float, float64 under x64) as jax's draw of that
shape, bit for bit (tests/test_inputs.py). Under a trace (a key that is a tracer) they are jax's own functions.
"""
import jax
import jax.numpy as jnp
import numpy as np

_SMALLEST = 1024   # the smallest size class: one program serves every draw up to 1024 elements


def _size_class(n: int) -> int:
  return max(_SMALLEST, 1 << max(n - 1, 0).bit_length())


def _prefix(draw, key, shape, dtype, **kw):
  shape = tuple(shape)
  if isinstance(key, jax.core.Tracer) or not jax.config.jax_threefry_partitionable:
    return draw(key, shape, dtype, **kw)
  n = int(np.prod(shape, dtype=np.int64))
  flat = np.asarray(draw(key, (_size_class(n),), dtype, **kw))
  return jnp.asarray(flat[:n].reshape(shape))


def normal(key, shape=(), dtype=float):
  """``jax.random.normal(key, shape, dtype)``, bit for bit."""
  return _prefix(jax.random.normal, key, shape, dtype)


def uniform(key, shape=(), dtype=float, minval=0.0, maxval=1.0):
  """``jax.random.uniform(key, shape, dtype, minval, maxval)``, bit for bit."""
  return _prefix(jax.random.uniform, key, shape, dtype, minval=minval, maxval=maxval)
