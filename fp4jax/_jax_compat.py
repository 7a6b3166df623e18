"""The one piece of ``fp4jax.target`` that reads a private jax API, in one place.

``jax.sharding.get_mesh()`` (public) refuses to run inside a trace, which is where the automatic
choices are made; the concrete mesh that ``jax.set_mesh`` sets is jax's ``device_context`` config state
(part of jit's cache key), read here through ``jax._src.mesh.get_concrete_mesh`` (jax 0.10.2; the same
function in the GPU image's 0.11.2). Where that function is missing, the ambient mesh is not consulted
and ``fp4jax.target.current()`` falls back to the process's devices (or an explicit ``use``).
"""
from __future__ import annotations

try:   # pragma: no cover - the import succeeds on every supported jax
  from jax._src.mesh import get_concrete_mesh as _get_concrete_mesh
except ImportError:   # pragma: no cover
  _get_concrete_mesh = None


def ambient_mesh():
  """The ``jax.sharding.Mesh`` set by ``jax.set_mesh`` (also inside a trace), or None."""
  if _get_concrete_mesh is None:
    return None
  mesh = _get_concrete_mesh()
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return mesh
