"""Eager calls compiled once: ``compiled_when_eager`` runs a function as one jitted program when it is
called eagerly (also under an eager ``jax.grad`` or ``jax.vmap``), and as it is, inlined, when the caller is
being traced.

An eager call of a quantized dot or a role quantizer would otherwise run op by op: jax compiles each of its
hundreds of small operations (tens of milliseconds each on a CPU) and runs them one at a time. Jitted, the
forward and the backward are one program each, compiled once per shape. Under a trace nothing changes: no
``jit(...)`` level is added to the program, so the op names in profiles stay the scopes' (docs/TRAINING.md,
"Profiles") and the compiled step is the same program. The values are the same either way: fp4jax's arithmetic is exact
under jit and eagerly (``fp4jax._exact``; tests/test_dot_golden.py checks both).
"""
from __future__ import annotations

import functools

import jax

from fp4jax import _jax_compat


def compiled_when_eager(*, static_argnums=()):
  """Decorator: ``fn`` jitted (with ``static_argnums``) when called eagerly, ``fn`` itself under a trace."""
  def wrap(fn):
    jitted = jax.jit(fn, static_argnums=static_argnums)

    @functools.wraps(fn)
    def call(*args, **kwargs):
      return fn(*args, **kwargs) if _jax_compat.under_jit() else jitted(*args, **kwargs)
    return call
  return wrap
