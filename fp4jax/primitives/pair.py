"""One builder for every fp4jax primitive pair, from a small per-op spec (``OpSpec``).

  ``fp4jax_<op>``        what jaxprs and profiles show: abstract eval, batching rule, a JVP that
                         differentiates like the reference, and a lowering that wraps the per-shard op
                         in ``custom_partitioning`` (Shardy rule + partition callback), so sharded
                         inputs stay sharded;
  ``fp4jax_<op>_local``  the per-shard op, lowered per platform by the spec's ``local``: the Pallas
                         kernels on CUDA with impl="pallas", the same kernels through the Pallas
                         interpreter on CPU, else the pure-JAX reference.
Every op has the param ``impl``; the JVP runs ``local`` with impl="xla" on platform "other".

Names in profiles: each op's wrapper binds under ``scope(...)`` (e.g. ``nvfp4_1x16``, inside the public
op's ``fp4jax/quantize``), and every lowering of ``local`` runs under ``fp4jax_<op>_<impl>``, so each
HLO instruction of the kernel or the XLA path carries an op_name with ``fp4jax``, even where
custom_partitioning lowers the per-shard op on its own.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fp4jax import partition_cache
from fp4jax._jax_compat import named_or_replicated, per_shard_lowering
from fp4jax.primitives import sharding as shd

try:   # the registry of primitives whose lowering needs the device assignment
  from jax._src import dispatch as _dispatch
except ImportError:   # pragma: no cover - a jax without it
  _dispatch = None

ShapedArray = getattr(jax.core, "ShapedArray", None)
if ShapedArray is None:   # pragma: no cover - a jax that no longer re-exports it
  from jax._src.core import ShapedArray


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """What differs between the ops; params are passed to every function as keywords.

  abstract(*avals, **params): the output aval(s).
  local(*args, platform, **params): the per-shard outputs as a tuple; platform "cuda" | "cpu" | "other".
  shardings(mesh, arg_shapes, **params): (operand PartitionSpec entries, result entries, contracted
    mesh axes). A result is summed (float32 partials, psum) over the contracted axes when there are any.
  rule(ndims, **params): (Shardy rule string, factor sizes) for operands of these ranks.
  batch_leading(dims): per operand, whether it takes the vmapped axis as a new leading axis
    (unbatched ones are broadcast); None: loop over the batch with ``lax.map``.
  partial_params(params): params of the per-shard op that returns float32 partial sums.
  transposed(ndims, **params): (operand order, params) of the op whose result is this one's transposed, for
    2-D results; None where there is none. A result reduce-scattered along its last dimension is then summed
    as that op's partials along their first (a reduce-scatter wants its dimension major: no transpose of the
    whole partial), and only the shard is transposed back.
  padded(ndims, **params): params of the per-shard op whose float32 partials carry its kernel's padding along
    their last dimension (zeros), or None: a result reduce-scattered along another dimension is then summed
    padded and only the shard is sliced (a slice of the whole partial is a pass over it).
  """

  name: str
  abstract: Callable
  local: Callable
  shardings: Callable
  rule: Callable
  batch_leading: Callable
  multiple_results: bool = True
  partial_params: Callable | None = None
  transposed: Callable | None = None
  padded: Callable | None = None


def define(spec: OpSpec) -> Primitive:
  """Registers ``fp4jax_<name>`` and ``fp4jax_<name>_local``; returns the outer primitive."""
  prim = Primitive(f"fp4jax_{spec.name}")
  local_prim = Primitive(f"fp4jax_{spec.name}_local")
  for p in (prim, local_prim):
    p.multiple_results = spec.multiple_results
    p.def_abstract_eval(spec.abstract)
    p.def_impl(functools.partial(_eager, p))
  if _dispatch is not None:
    _dispatch.prim_requires_devices_during_lowering.add(prim)
  mlir.register_lowering(prim, functools.partial(_lower_partitioned, spec, local_prim))
  for platform in ("cuda", "cpu", None):
    fn = functools.partial(_local_outputs, spec, platform=platform or "other")
    mlir.register_lowering(local_prim, _per_shard(spec, mlir.lower_fun(fn, multiple_results=spec.multiple_results)),
                           **({"platform": platform} if platform else {}))
  batching.primitive_batchers[prim] = functools.partial(_batch, spec, prim)
  ad.primitive_jvps[prim] = functools.partial(_jvp, spec, prim)
  return prim


def _per_shard(spec, lowering):
  """The per-shard op's lowering, as a per-shard program (``_jax_compat.per_shard_lowering``: its operand and
  result types were checked where the program binds ``fp4jax_<op>``, in a shard_map body or not).

  A kernel that does not lower for this shard's layout (a shape or platform the on-device proof never ran)
  lowers as its XLA twin, which defines the kernel's output, with a warning naming the kernel and the mesh:
  the step runs the XLA path for that op instead of stopping at start-up."""
  def lower(ctx, *args, **params):
    with per_shard_lowering(ctx) as shard_ctx:
      if params.get("impl", "xla") == "xla":
        return lowering(shard_ctx, *args, **params)
      try:
        return lowering(shard_ctx, *args, **params)
      except Exception as e:   # pylint: disable=broad-except  # any failure: the twin is always correct
        warnings.warn(f"fp4jax: the {spec.name} kernel (impl={params['impl']!r}, fmt={params.get('fmt')!r}) "
                      f"did not lower on {_mesh_words(ctx)} ({type(e).__name__}: {str(e)[:300]}); this op runs "
                      f"the XLA path there. Please report it with this message.", RuntimeWarning, stacklevel=2)
        return lowering(shard_ctx, *args, **{**params, "impl": "xla"})
  return lower


def _mesh_words(ctx) -> str:
  """The mesh a lowering is for, in words: "mesh {'data': 2, 'expert': 2} (per shard)" or "one device"."""
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  shape = dict(getattr(mesh, "shape", {}) or {})
  return f"mesh {shape} (per shard)" if shape and any(v > 1 for v in shape.values()) else "one device"


def scope(name: str):
  """``jax.named_scope`` for one op's binding (the op's variant, e.g. "nvfp4_1x16_sr")."""
  return jax.named_scope(name)


def _local_outputs(spec, *args, **params):
  with jax.named_scope(f"fp4jax_{spec.name}_{params['impl']}"):
    outs = spec.local(*args, **params)
  return outs if spec.multiple_results else outs[0]


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params_items):
  params = dict(params_items)
  return jax.jit(lambda *args: prim.bind(*args, **params))


def _eager(prim, *args, **params):
  """Eager calls compile the primitive alone, like jax's own primitives. Under ``jax.disable_jit()``
  too: jit is switched back on for this one compiled call (as jax does for lax primitives), else the
  jitted bind would be an eager bind again and recurse forever."""
  with jax.disable_jit(False):
    return _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def _jvp(spec, prim, primals, tangents, **params):
  """The primal output goes through ``prim``; tangents are the reference's (zero through the rounding,
  float0 for integer outputs)."""
  out = prim.bind(*primals, **params)
  tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
  reference = functools.partial(_local_outputs, spec, platform="other", **{**params, "impl": "xla"})
  _, t_out = jax.jvp(reference, tuple(primals), tangents)
  return out, (list(t_out) if spec.multiple_results else t_out)


def _to_front(x, d, size):
  if d is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, d, 0)


def _batch(spec, prim, args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  leading = spec.batch_leading(dims)
  if leading is None:
    ops = tuple(_to_front(a, d, size) for a, d in zip(args, dims))
    if spec.multiple_results:
      outs = lax.map(lambda o: tuple(prim.bind(*o, **params)), ops)
      return list(outs), [0] * len(outs)
    return lax.map(lambda o: prim.bind(*o, **params), ops), 0
  ops = [_to_front(a, d, size) if lead else a for a, d, lead in zip(args, dims, leading)]
  out = prim.bind(*ops, **params)
  return out, ([0] * len(out) if spec.multiple_results else 0)


@functools.lru_cache(maxsize=None)
def _partitioned(spec, local_prim, ndims, params_items):
  """custom_partitioning-wrapped per-shard op for operands of ranks ``ndims`` and these params."""
  params = dict(params_items)

  def local(*ops):
    out = local_prim.bind(*ops, **params)
    return tuple(out) if spec.multiple_results else out

  def shardings(mesh, arg_shapes):
    arg_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=named_or_replicated(mesh, a.sharding, a.ndim))
                  for a in arg_shapes]
    args, outs, contracted = spec.shardings(mesh, arg_shapes, **params)
    outs = tuple(shd.named(mesh, s) for s in outs) if spec.multiple_results else shd.named(mesh, outs)
    return tuple(shd.named(mesh, s) for s in args), outs, contracted

  def partition(mesh, arg_shapes, result_shape):
    args, outs, contracted = shardings(mesh, arg_shapes)
    if not contracted:
      return mesh, local, outs, args
    # contraction sharded: float32 partial products summed across the shards; reduce-scattered where the result
    # is wanted split over the contracted axes (half the bytes of an all-reduce and no slice after it)
    ndim = len(result_shape.shape)
    out_spec = shd.spec_of(outs, ndim)
    wanted = shd.spec_of(named_or_replicated(mesh, result_shape.sharding, ndim), ndim)
    dim = shd.scatter_dim(mesh, out_spec, wanted, result_shape.shape, contracted)
    flip = spec.transposed(ndims, **params) if dim == 1 and ndim == 2 and spec.transposed else None

    def scattered(ops, op_params, scatter_dim):
      """The partials reduce-scattered along scatter_dim, padded partials where the op has them."""
      partial = spec.partial_params(op_params)
      padded = spec.padded(ndims, **partial) if spec.padded and scatter_dim != ndim - 1 else None
      part = local_prim.bind(*ops, **(padded or partial))
      shard = lax.psum_scatter(part, contracted, scatter_dimension=scatter_dim, tiled=True)
      return shard[..., :spec.abstract(*ops, **partial).shape[-1]] if padded else shard

    def local_sum(*ops):
      if flip is not None:
        order, flipped = flip
        return scattered([ops[i] for i in order], flipped, 0).astype(result_shape.dtype).T
      if dim is None:
        return lax.psum(local_prim.bind(*ops, **spec.partial_params(params)), contracted).astype(result_shape.dtype)
      return scattered(ops, params, dim).astype(result_shape.dtype)

    if dim is not None:
      out_spec[dim] = wanted[dim]
      outs = shd.named(mesh, out_spec)
    return mesh, local_sum, outs, args

  def infer(mesh, arg_shapes, result_shape):
    return shardings(mesh, arg_shapes)[1]

  rule, sizes = spec.rule(ndims, **params)

  def sharding_rule(mesh, value_types, result_types):   # fitted to the shapes (a one-block axis)
    shapes = [tuple(mlir.ir.RankedTensorType(t).shape) for t in (*value_types, *result_types)]
    return shd.fit_rule(rule, sizes, shapes)

  cp = custom_partitioning(local)
  cp.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule,
                   decode_shardings=False)   # decoded by ``shardings``, which also takes sub-axis shardings
  return cp


def _lower_partitioned(spec, local_prim, ctx, *ops, **params):
  ndims, params_items = tuple(a.ndim for a in ctx.avals_in), tuple(sorted(params.items()))
  fn = _partitioned(spec, local_prim, ndims, params_items)
  if spec.multiple_results:
    out = mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, *ops)
  else:
    out = mlir.lower_fun(lambda *a: [fn(*a)], multiple_results=True)(ctx, *ops)
  partition_cache.tag(out, local_prim.name, ndims, params_items)   # the cache key
  return out
