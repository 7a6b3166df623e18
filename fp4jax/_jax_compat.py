"""Every private jax API that fp4jax reads, in one place (jax 0.10.2; each with a fallback where it is missing).

- ``ambient_mesh``: ``jax.sharding.get_mesh()`` (public) refuses to run inside a trace, which is where the
  automatic choices are made; the concrete mesh that ``jax.set_mesh`` sets is jax's ``device_context`` config
  state (part of jit's cache key), read here through ``jax._src.mesh.get_concrete_mesh`` (jax 0.10.2; the same
  function in the GPU image's 0.11.2). Where that function is missing, the ambient mesh is not consulted and
  ``fp4jax.target.current()`` falls back to the process's devices (or an explicit ``use``).
- ``named_or_replicated``: a custom_partitioning callback's operand sharding as a NamedSharding.
- ``vma_checked`` / ``per_shard_lowering``: shard_map's check of varying manual axes.
- ``forward_tangent``: whether a value is being differentiated in forward mode (``fp4jax.derivatives``).
- ``under_jit``: whether the caller is being staged into a jaxpr (``fp4jax.eager``).
- ``custom_partitioning_ids_out_of_cache_key``: jax's config state of that name (``fp4jax.partition_cache``).
"""
from __future__ import annotations

import contextlib

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


# ------------------------------------------------------------------ custom_partitioning's shardings
# A custom_partitioning callback may get an operand sharded on part of a mesh axis (Shardy's sub-axes, e.g.
# after a reshape that splits a sharded axis into blocks); jax's own decoding into a NamedSharding then raises.
# ``named_or_replicated`` decodes with the same function (private: jax._src.sharding_impls, jax 0.10.2) and
# reads such a sharding as replicated, which the callbacks then ask for (XLA gathers the operand).
try:   # pragma: no cover - the import succeeds on every supported jax
  from jax._src.sharding_impls import parse_flatten_op_sharding as _parse_hlo_sharding
except ImportError:   # pragma: no cover
  _parse_hlo_sharding = None


def named_or_replicated(mesh, sharding, ndim: int):
  """``sharding`` (a NamedSharding, or the partitioner's GSPMDSharding) as a NamedSharding of ``mesh``;
  replicated where the mesh's whole axes cannot express it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  if isinstance(sharding, NamedSharding) or sharding is None:
    return sharding
  try:
    spec = _parse_hlo_sharding(sharding._to_xla_hlo_sharding(ndim), mesh)[0]
  except Exception:   # IndivisibleError (sub-axes), or a jax without the parser
    spec = P()
  return NamedSharding(mesh, P(*spec, *((None,) * (ndim - len(spec)))))


# ------------------------------------------------------------------ the varying-manual-axes check
try:   # pragma: no cover - present on every supported jax
  from jax._src.config import _check_vma as _check_vma_state
except ImportError:   # pragma: no cover
  _check_vma_state = None
try:   # pragma: no cover
  from jax._src.core import empty_mat as _EMPTY_MAT   # jax 0.10: the manual-axis type of an unvarying value
except ImportError:   # pragma: no cover - earlier releases type it as aval.vma
  _EMPTY_MAT = None


def vma_checked() -> bool:
  """Whether the trace in progress checks varying manual axes (inside ``shard_map(check_vma=True)``)."""
  return bool(_check_vma_state.value) if _check_vma_state is not None else False


def _unvarying(aval):
  if _EMPTY_MAT is not None and hasattr(aval, "mat"):
    return aval.update(manual_axis_type=_EMPTY_MAT)
  return aval.update(vma=frozenset()) if getattr(aval, "vma", None) else aval


@contextlib.contextmanager
def per_shard_lowering(ctx):
  """``ctx`` of a lowering rule as a per-shard program: operand and result types without manual axes, and
  shard_map's varying-axes check off. For lowering a per-shard op (``fp4jax.primitives.pair``) whose types
  the traced program already checked, inside ``shard_map(check_vma=True)``: what its lowering traces is
  per shard, and jax 0.10.2's Pallas interpreter (a kernel on CPU) carries the operands' types through its
  grid loop while its body's values vary over no axis, which the loop's type check refuses."""
  ctx = ctx.replace(avals_in=[_unvarying(a) for a in ctx.avals_in],
                    avals_out=[_unvarying(a) for a in ctx.avals_out])
  if _check_vma_state is None:   # pragma: no cover
    yield ctx
    return
  with _check_vma_state(False):
    yield ctx


def under_jit() -> bool:
  """Whether the current trace stack stages into a jaxpr (jit, scan, shard_map, ...), as opposed to eager
  execution, possibly under an eager ``jax.grad`` or ``jax.vmap``: ``jax._src.core.unsafe_am_i_under_a_jit``
  (jax 0.10.2 and 0.11.2). Where it is missing, True (the caller then never adds a jit of its own)."""
  check = getattr(_core, "unsafe_am_i_under_a_jit", None) if _core is not None else None
  return True if check is None else bool(check())


# ------------------------------------------------------------------ the persistent cache's key
def custom_partitioning_ids_out_of_cache_key():
  """A context in which jax's persistent compilation cache keys a program without its custom_partitioning
  calls' ids (``jax_remove_custom_partitioning_ptr_from_cache_key``, jax's ``State`` as a context manager)."""
  from jax._src import config   # pylint: disable=import-outside-toplevel
  return config.remove_custom_partitioning_ptr_from_cache_key(True)
