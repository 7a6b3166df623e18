"""Float32 operations rounded exactly once, whatever the compiler does around them.

Three rewrites break the "one rounding per written operation" contract of the recipes' arithmetic:
- XLA turns ``A / broadcast(B)`` (a tensor divided by a scalar or by per-block values, constant or
  not) into ``A * broadcast(1/B)``: two roundings instead of one.
- XLA rewrites ``(A / B) / C`` into ``A / (B * C)``: one rounding where two are written.
- LLVM (XLA CPU and GPU) and Triton may contract ``a*b + c`` into one fused multiply-add, so the
  product is not rounded before the add. (XLA CPU does: a plain ``x*x + y`` differs from numpy, and
  so does a dequantized ``e2m1 · factor`` that the caller subtracts from something, eagerly too when
  the two sit in one compiled unit such as a ``lax.cond`` branch.)

``lax.optimization_barrier`` stops none of them on XLA CPU: the barrier is removed before fusion and
LLVM code generation (measured on jax 0.10.2: a barrier between ``e2m1 · factor`` and a subtraction
leaves the FMA in place). What does: passing the value through its bit pattern ANDed with a mask the
compiler cannot evaluate. The rewrites then see a bitwise AND where they look for a broadcast, a
division or a multiply, and do not apply; the value is unchanged.

The mask is ``-1``, or ``-2`` where the key's bits with the sign cleared are ``0x7FFFFFFF`` (a NaN
with every payload bit set; clearing the value's lowest bit there changes nothing that matters:
the key is the value itself, a NaN that stays NaN, or a NaN dividend whose quotient is NaN anyway).
Why this mask and not ``isnan(key)``: LLVM folds ``isnan`` to false wherever its floating-point class
analysis proves the key cannot be NaN, which it does for values converted from integers (E2M1 codes),
for constants, and for products and sums of such values; the mask then folds to ``-1``, the AND
disappears and the FMA comes back. A comparison of the integer bits with one NaN payload has no
floating-point class equivalent, and LLVM's known-bits analysis of a float's bits tracks only its
sign (or its whole value when it can only be ±0 or ±inf, where no rounding is at stake), so the
comparison folds only when the key is a compile-time constant. Where the guarded value is itself a
constant, XLA evaluates it (one rounding per operation) and there is no multiply left to contract.
tests/test_numerics_exact.py checks each guard on operands of every provenance against numpy.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_ALL_PAYLOAD = 0x7FFFFFFF   # |bits| of the one NaN at which the mask clears a bit


def _opaque(v_f32, key_f32):
  """v unchanged, in a form the compiler cannot see through; key: same shape, float32."""
  key_bits = lax.bitcast_convert_type(key_f32, jnp.int32)
  hit = (key_bits & jnp.int32(_ALL_PAYLOAD)) == jnp.int32(_ALL_PAYLOAD)
  mask = jnp.int32(-1) - hit.astype(jnp.int32)
  bits = lax.bitcast_convert_type(v_f32, jnp.int32) & mask
  return lax.bitcast_convert_type(bits, jnp.float32)


def div(a, b):
  """a / b in float32, correctly rounded, and never the divisor or the dividend of a rewritten division.

  Both are broadcast to the result's shape. The divisor's mask is keyed on an operand that has the
  result's shape without a broadcast (the dividend, else the divisor itself), so that XLA cannot sink
  the guard below the divisor's broadcast and turn the division into a multiply by a reciprocal.
  """
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  shape = jnp.broadcast_shapes(a.shape, b.shape)
  a_full, b_full = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
  if a.shape == shape:
    key = a_full
  elif b.shape == shape:
    key = b_full
  else:
    key = a_full + b_full   # an outer division: neither operand has the result's shape
  return _opaque(a_full, a_full) / _opaque(b_full, key)


def product(a, b):
  """a · b rounded to float32, safe to add to something (never contracted into an FMA), and never
  re-associated with a constant factor applied to it afterwards."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  p = a * b
  return _opaque(p, p)


def stored(x):
  """x as its dtype stores it, even where XLA would keep more precision (a float narrower than float32).

  With ``xla_allow_excess_precision`` (its default) XLA removes a float32 -> bf16 -> float32 pair of
  converts: when the producer of a bf16 tensor (relu(u)², a norm, computed in float32) fuses with a
  consumer that upcasts it again (a quantizer), the consumer reads the unrounded float32 value. The
  quantization of "the same" bf16 tensor then depends on fusion: eager and jit differ, and so do a fused
  kernel, which quantizes the bf16 it stores, and its XLA twin. ``reduce_precision`` to the dtype's own
  exponent and mantissa widths is the rounding XLA keeps: where no excess precision exists it is the
  identity (eager, or an input read from memory); where the converts were removed it rounds the float32
  value to nearest-even at that width, as the convert would have.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
    return x
  info = jnp.finfo(x.dtype)
  wide = lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)
  return wide.astype(x.dtype)
