"""The pieces of fp4jax that read private jax APIs, in one place: the ambient mesh (``fp4jax.target``) and
forward-mode tangents (``fp4jax.derivatives``).

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


# --------------------------------------------------------------------------------- forward-mode tangents
# ``forward_tangent`` reads jax's trace stack (jax._src.core.trace_ctx, jax._src.interpreters.ad /
# batching; jax 0.10.2): public jax has no way to ask whether a value is being differentiated in forward mode.
try:   # pragma: no cover - the imports succeed on every supported jax
  from jax._src import core as _core
  from jax._src.interpreters import ad as _ad
  from jax._src.interpreters import batching as _batching
except ImportError:   # pragma: no cover
  _core = None


def forward_tangent(*xs) -> bool:
  """Whether any of ``xs`` carries a nonzero forward-mode tangent (``jax.jvp``, ``jax.jacfwd``, the outer
  half of ``jax.hessian``): walks the traces from the current one to the bottom, unwrapping each value to
  its primal (linearize, jvp) or per-example value (vmap). Values of traces it does not know stay as they
  are, so the answer errs towards False (jax's own error then follows)."""
  if _core is None:
    return False
  trace = _core.trace_ctx.trace
  vals = list(xs)
  while trace is not None:
    if isinstance(trace, _ad.JVPTrace):
      pairs = [trace.to_primal_tangent_pair(v) for v in vals]
      if any(type(t) is not _ad.Zero for _, t in pairs):
        return True
      vals = [p for p, _ in pairs]
    elif isinstance(trace, _ad.LinearizeTrace):
      vals = [trace.to_primal_tangent_pair(v)[0] for v in vals]
    elif isinstance(trace, _batching.BatchTrace):
      vals = [trace.to_batch_info(v)[0] for v in vals]
    trace = getattr(trace, "parent_trace", None)
  return False
