"""Random Hadamard transform (spec §5): M = diag(s) · H_n / sqrt(n), applied as y = x · M.

H_n is the Sylvester Hadamard matrix in natural order. The transform runs as a fast Walsh-Hadamard
butterfly (log2 n stages of a+b, a-b) in float32 after the sign flip, then one multiply by
f32(1/sqrt n). That order is fixed so kernels can reproduce it bit for bit; for n = 16 the final
multiply by 1/4 is exact.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from fp4jax._exact import product

DEFAULT_SIZE = 16
# The spec's default sign vector (TE's bit pattern 0xD7E8).
DEFAULT_SIGNS_16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_DEFAULT_SEED_LARGE = 0xD7E8


def _check_size(size):
  if not (isinstance(size, (int, np.integer)) and 2 <= size <= 256 and size & (size - 1) == 0):
    raise ValueError(f"RHT size={size!r} must be a power of two between 2 and 256")


@functools.lru_cache(maxsize=None)
def signs(size: int = DEFAULT_SIZE, seed: int | None = None) -> tuple[int, ...]:
  """The ±1 sign vector s of the transform.

  seed None: the spec's vector for size 16 (its first ``size`` entries for smaller sizes; for larger
  sizes a fixed vector drawn with seed 0xD7E8). Otherwise ±1 drawn from ``numpy.random.default_rng(seed)``.
  """
  _check_size(size)
  if seed is None:
    if size <= 16:
      return DEFAULT_SIGNS_16[:size]
    seed = _DEFAULT_SEED_LARGE
  draws = np.random.default_rng(seed).integers(0, 2, size)
  return tuple(int(v) for v in (1 - 2 * draws))


def matrix(size: int = DEFAULT_SIZE, seed: int | None = None) -> np.ndarray:
  """M = diag(s) · H / sqrt(n) as a float64 numpy array (for tests and documentation)."""
  h = np.array([[1.0]])
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  return np.diag(np.array(signs(size, seed), np.float64)) @ h / np.sqrt(size)


def fwht_last(x_f32):
  """Unnormalized Walsh-Hadamard transform along the last axis (length n, a power of two), float32."""
  n = x_f32.shape[-1]
  lead = x_f32.shape[:-1]
  h = 1
  while h < n:
    pairs = x_f32.reshape(*lead, n // (2 * h), 2, h)
    a, b = pairs[..., 0, :], pairs[..., 1, :]
    x_f32 = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
    h *= 2
  return x_f32


def rht(x, *, axis: int = -1, size: int = DEFAULT_SIZE, seed: int | None = None):
  """y = x · M on consecutive ``size``-chunks along ``axis``; float32 result, shape of x.

  Because M·Mᵀ = I the transform cancels inside a GEMM whose reduction axis is ``axis`` when both
  operands are transformed; no inverse is applied.
  """
  _check_size(size)
  x = jnp.asarray(x)
  if x.ndim == 0 or not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"fp4jax.rht: axis={axis!r} is not an axis of an input of shape {x.shape}")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
    raise TypeError(f"fp4jax.rht: seed={seed!r} must be an int or None (the default signs)")
  axis = axis % x.ndim
  length = x.shape[axis]
  if length % size:
    raise ValueError(f"RHT along axis {axis} of length {length}: the length must be a multiple of "
                     f"size={size}; pad the tensor (fp4jax.dot pads for you)")
  x_f32 = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  lead = x_f32.shape[:-1]
  s = jnp.asarray(signs(size, seed), jnp.float32)
  chunks = x_f32.reshape(*lead, length // size, size) * s
  y = product(fwht_last(chunks), jnp.float32(1.0 / np.sqrt(size)))   # rounded before a caller's sum
  return jnp.moveaxis(y.reshape(*lead, length), -1, axis)
