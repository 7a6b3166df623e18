"""Which derivatives fp4jax defines, and a clear error everywhere else (docs/NUMERICS.md, "Derivatives").

  fp4jax.dot, dot_general   one derivative, in reverse mode (jax.grad, jax.vjp, jax.jacrev): the recipe's
  (and grouped, fused)      backward pass (spec §6). Forward mode (jax.jvp, jax.jacfwd) and second order
                            (jax.hessian, grad of grad, jvp of grad) raise ``DOT_MESSAGE``: the backward pass
                            rounds its operands, so its own derivative would be zero, not the curvature.
  fp4jax.quantize           no derivative (integer codes, rounded scales): ``QUANTIZE_MESSAGE``.
  fp4jax.fake_quantize      dequantize(quantize(x)) with the straight-through gradient: dx = dy.
A recipe that quantizes nothing ("bf16") is ``lax.dot_general``, with every derivative jax defines.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4jax._jax_compat import forward_tangent

DOT_MESSAGE = (
    "fp4jax.dot with recipe {name!r}: {what}. A quantized dot has one derivative, in reverse mode (jax.grad, "
    "jax.vjp, jax.value_and_grad, jax.jacrev): its backward pass, the quantized dgrad and wgrad GEMMs. That "
    "backward pass rounds its operands, so differentiating it again would give zero, not the curvature: forward "
    "mode (jax.jvp, jax.jacfwd) and second order (jax.hessian, grad of grad, jvp of grad) are not defined. Use "
    "jax.jacrev for a Jacobian; for Hessians or Hessian-vector products use recipe='bf16' (lax.dot_general, "
    "every derivative)")
FORWARD_MODE = "forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian)"
SECOND_ORDER = "a second derivative (grad of grad, jvp of grad) differentiates its backward pass"

QUANTIZE_MESSAGE = (
    "{where} has no derivative: its codes are integers and its scales are rounded, so the gradient would be "
    "zero almost everywhere. For quantization-aware training use fp4jax.fake_quantize(x, fmt, ...), "
    "dequantize(quantize(x)) with the straight-through gradient dx = dy, or fp4jax.dot, whose gradient is the "
    "recipe's backward pass; to quantize a value without differentiating it, pass jax.lax.stop_gradient(x)")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refuse_tangent(message, x):
  return x


@_refuse_tangent.defjvp
def _refuse_tangent_jvp(message, primals, tangents):
  del primals, tangents
  raise TypeError(message)


def refuse_tangents(tree, message: str):
  """``tree`` unchanged; differentiating any of its floating leaves raises ``TypeError(message)``. Free when
  nothing is differentiated (jax skips a custom_jvp rule whose tangents are all zero)."""
  def one(a):
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating):
      return _refuse_tangent(message, a)
    return a
  return jax.tree.map(one, tree)


def check_not_forward_mode(name: str, *xs):
  """TypeError(DOT_MESSAGE) when any of ``xs`` (a quantized dot's operands) carries a forward-mode tangent. The
  check runs where the dot is traced; a dot inside an already-traced ``jax.jit`` function differentiated in
  forward mode from outside gets jax's own "can't apply forward-mode autodiff (jvp) to a custom_vjp
  function", which means the same."""
  if forward_tangent(*xs):
    raise TypeError(DOT_MESSAGE.format(name=name, what=FORWARD_MODE))


@jax.custom_jvp
def straight_through(x, y):
  """``y`` (a function of ``x``'s value, computed without its gradient), differentiated as ``x``: d/dx = I."""
  del x
  return y


@straight_through.defjvp
def _straight_through_jvp(primals, tangents):
  x, y = primals
  tx, _ = tangents
  return y, tx.astype(y.dtype)
