"""max |x| that keeps NaN on every backend: every amax and block maximum in fp4jax is taken here.

A float max reduction may drop NaN. XLA's vectorized CPU reduction returns a finite value for a NaN
in a large enough tensor (or -inf when the NaN is the last element), and Pallas's Triton lowering of a
float max is maxnum, which prefers the number. A dropped NaN would quantize the rest of the tensor as if
the element were absent: a finite result from a non-finite input.

So the maximum is taken over the magnitudes' float32 bit patterns, as int32. For non-negative floats the
integer order is the float order (0 < subnormals < normals < inf < NaN of any payload), so the integer
max is the float max, exact in any order, and NaN wins over every number. One pass over x, no separate
NaN check, integer arithmetic on every backend (XLA on CPU and GPU, Pallas kernels, interpret mode).
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax


def magnitude_bits(x):
  """int32 bit patterns of |x| as float32 (the sign bit cleared, so NaN has the largest patterns)."""
  return lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)


def from_bits(bits_i32):
  """float32 values of int32 bit patterns (the inverse of ``magnitude_bits`` on non-negative values)."""
  return lax.bitcast_convert_type(bits_i32, jnp.float32)


def abs_max(x, axis=None):
  """max |x| over ``axis`` (all axes for None), float32; NaN where any reduced element is NaN, 0 for an
  empty reduction. The bits are non-negative, so a non-empty reduction needs no initial 0 (which is a
  maximum after the reduce: an op of its own wherever the amax goes straight into a kernel)."""
  bits = magnitude_bits(x)
  axes = range(bits.ndim) if axis is None else [a % bits.ndim for a in ((axis,) if isinstance(axis, int) else axis)]
  empty = math.prod(bits.shape[a] for a in axes) == 0
  return from_bits(jnp.max(bits, axis=axis, initial=0 if empty else None))


def abs_max_of(*xs):
  """Elementwise max |x| over several arrays of one shape, float32; NaN where any of them is NaN."""
  return from_bits(functools.reduce(jnp.maximum, [magnitude_bits(x) for x in xs]))
