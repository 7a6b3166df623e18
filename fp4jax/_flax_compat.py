"""The flax internals fp4jax reads, in one place (written against flax's NNX graph-mode update contexts)."""
from __future__ import annotations

import jax

try:
  from flax.nnx import graphlib
except ImportError:   # pragma: no cover - a flax without NNX's graph module
  graphlib = None


def written_back(variable) -> bool:
  """Whether an update of ``variable`` reaches a Variable outside every JAX trace.

  Eagerly, yes; under NNX transforms in graph mode (flax's default) each transform maps the Variables it
  merged inside its trace to the outer ones, followed here to an untraced one. A Variable traced by a plain
  JAX transform has no such map: its update is lost unless the traced function returns it. Tree-mode NNX
  transforms (``graph=False``) write back without such a map, so they count as plain. On a flax without
  these internals the answer is yes (no warning)."""
  if graphlib is None:
    return True
  try:
    stacks = graphlib.GRAPH_CONTEXT.update_context_stacks
    while isinstance(variable.get_value(), jax.core.Tracer):
      outer = None
      for ctx in (c for stack in stacks.values() for c in reversed(stack)):
        inner = ctx.inner_ref_outer_index
        if inner is not None and variable in inner:
          outer = ctx.outer_index_outer_ref[inner[variable]]
          break
      if outer is None:
        return False
      variable = outer
    return True
  except (AttributeError, KeyError, TypeError):
    return True
