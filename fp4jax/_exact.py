"""Float32 operations rounded exactly once, whatever the compiler does around them.

Two rewrites break the "one rounding per written operation" contract of the recipes' arithmetic:
- XLA turns ``A / broadcast(B)`` (a tensor divided by a scalar or by per-block values, constant or
  not) into ``A * broadcast(1/B)``: two roundings instead of one.
- XLA rewrites ``(A / B) / C`` into ``A / (B * C)``: one rounding where two are written.
- LLVM (XLA CPU and GPU) and Triton may contract ``a*b + c`` into one fused multiply-add, so the
  product is not rounded before the add. (XLA CPU does: a plain ``x*x + y`` differs from numpy.)
``lax.optimization_barrier`` does not stop either on XLA CPU (the barrier is expanded away before
fusion). What does: passing the operand through its bit pattern ANDed with a mask the compiler cannot
evaluate, ``-1 - isnan(a)``, which is all ones unless ``a`` is NaN (then it clears the lowest mantissa
bit of a NaN, which stays NaN). The divisor is then no longer a broadcast, a dividend is no longer a
division, and the add's operand is no longer a multiply, so no rewrite applies; the values are unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _opaque(v_f32, guard_f32):
  """v unchanged, in a form the compiler cannot see through; guard: same shape, float32."""
  mask = jnp.int32(-1) - jnp.isnan(guard_f32).astype(jnp.int32)
  bits = lax.bitcast_convert_type(v_f32, jnp.int32) & mask
  return lax.bitcast_convert_type(bits, jnp.float32)


def div(a, b):
  """a / b in float32, correctly rounded (b is broadcast to the result's shape first)."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  shape = jnp.broadcast_shapes(a.shape, b.shape)
  a = jnp.broadcast_to(a, shape)
  return _opaque(a, a) / _opaque(jnp.broadcast_to(b, shape), a)


def product(a, b):
  """a · b rounded to float32, safe to add to something (never contracted into an FMA)."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  p = a * b
  return _opaque(p, jnp.broadcast_to(a, p.shape))
