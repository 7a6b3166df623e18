"""fp4jax's JAX primitives: quantize, RHT-transposed quantize, dequantize, scaled matmul.

Each operation is a pair of primitives:
  ``fp4jax_<op>``        what jaxprs and profiles show; abstract eval, batching rule, and a lowering
                         that wraps the per-shard op in ``custom_partitioning`` (Shardy rule +
                         partition callback from ``fp4jax.sharding``), so sharded inputs stay sharded;
  ``fp4jax_<op>_local``  the per-shard op; lowered to the Pallas kernel on CUDA (impl="pallas") or
                         to the pure-JAX reference (impl="xla", and every platform without kernels).
                         On CPU impl="pallas" runs the same kernels through the Pallas interpreter.
Static choices (format, tiles, scale rule, rounding by the presence of a bits operand, impl, output
dtype) are primitive params; random bits and the NVFP4 tensor amax are operands. The amax is reduced
by the caller before the quantize pass; it is a scalar, or one value per vmapped slice (its shape is
a prefix of the input's shape).

Axis legend: K the quantized (last) axis, B the block (16 nvfp4, 32 mxfp4), T tokens, C channels.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax import sharding as shd
from fp4jax.kernels import quantize_1d as _k1d
from fp4jax.kernels import quantize_2d as _k2d
from fp4jax.kernels import quantize_rht_t as _krht
from fp4jax.kernels import scaled_matmul as _kmm
from fp4jax.qtensor import QTensor, along_last
from fp4jax.reference import (dequantize_last_reference, quantize_last_reference,
                              quantize_rht_t_reference, scaled_matmul_reference, tensor_factor)

IMPLS = ("xla", "pallas")
KERNEL_FORMATS = formats.KERNEL_FORMATS
BLOCK = formats.BLOCK
SCALE_DTYPE = formats.SCALE_DTYPE
TILE = formats.NVFP4.tile[0]
_ShapedArray = getattr(jax.core, "ShapedArray", None)
if _ShapedArray is None:   # pragma: no cover - a jax that no longer re-exports it
  from jax._src.core import ShapedArray as _ShapedArray


# ------------------------------------------------------------------------------------- the switch

def can_use_pallas(fmt: str = "nvfp4", *, platform: str | None = None) -> bool:
  """Whether impl=None picks the compiled Pallas kernels: an FP4 format on a CUDA GPU with Triton.

  On CPU this is False (impl=None runs the XLA reference); impl="pallas" still works there, through
  the Pallas interpreter (slow, for tests).
  """
  if fmt not in KERNEL_FORMATS or not plc.has_triton():
    return False
  if platform is None:
    return plc.gpu_available()
  return platform in ("cuda", "gpu")


DEFAULT_IMPL_ENV = "FP4JAX_DEFAULT_IMPL"


def resolve_impl(impl: str | None, fmt: str) -> str:
  """"pallas" | "xla" for a user's ``impl`` (None = pallas where ``can_use_pallas``, else xla).

  The environment variable FP4JAX_DEFAULT_IMPL=xla makes None mean "xla" everywhere (a switch for
  runs that must not depend on the kernels); =pallas forces the kernels where they exist.
  """
  if impl is None:
    forced = os.environ.get(DEFAULT_IMPL_ENV, "").strip().lower()
    if forced == "xla" or fmt not in KERNEL_FORMATS:
      return "xla"
    if forced == "pallas":
      return "pallas"
    return "pallas" if can_use_pallas(fmt) else "xla"
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; use 'pallas', 'xla' or None (pallas where can_use_pallas())")
  if impl == "pallas" and fmt not in KERNEL_FORMATS:
    raise ValueError(f"there are no Pallas kernels for fmt={fmt!r}; use impl='xla'")
  return impl


# ------------------------------------------------------------------------------------- plumbing

def _bytes(s):
  return lax.bitcast_convert_type(s, jnp.uint8)


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params_items):
  params = dict(params_items)
  return jax.jit(lambda *args: prim.bind(*args, **params))


def _def_impl(prim):
  """Eager calls compile the primitive alone (like jax's own primitives)."""
  prim.def_impl(lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args))


def _requires_devices(prim):
  """The lowering of ``prim`` emits custom_partitioning, which needs the device assignment."""
  try:
    from jax._src import dispatch
    dispatch.prim_requires_devices_during_lowering.add(prim)
  except (ImportError, AttributeError):   # pragma: no cover - a jax without this registry
    pass


def _register_local_lowerings(prim, impl_fn, multiple_results=True):
  """CUDA: kernels when impl='pallas'; CPU: interpreted kernels when impl='pallas'; else reference."""
  for platform in ("cuda", "cpu", None):
    fn = functools.partial(impl_fn, platform=platform or "other")
    mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=multiple_results),
                           **({"platform": platform} if platform else {}))


def _register(prim, local_prim, *, abstract, lowering, local_impl, batch, reference_fn,
              multiple_results=True):
  """Everything a primitive pair needs: the outer ``prim`` (partitioned lowering, batching, JVP)
  and its per-shard twin ``local_prim`` (per-platform lowerings)."""
  for p in (prim, local_prim):
    p.def_abstract_eval(abstract)
    _def_impl(p)
  _requires_devices(prim)
  mlir.register_lowering(prim, lowering)
  _register_local_lowerings(local_prim, local_impl, multiple_results)
  batching.primitive_batchers[prim] = batch
  _def_reference_jvp(prim, reference_fn)


def _partitioned(local_fn, *, rule, partition, infer):
  """custom_partitioning-wrapped ``local_fn`` with a Shardy rule (and GSPMD callbacks)."""
  cp = custom_partitioning(local_fn)
  rule_str, sizes = rule
  cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=lambda mesh, vt, rt: (rule_str, sizes))
  return cp


def _def_reference_jvp(prim, reference_fn):
  """Differentiate like the pure-JAX reference: the primal output goes through ``prim``, tangents are
  the reference's (zero through the rounding, as for the reference; float0 for integer outputs)."""
  def jvp(primals, tangents, **params):
    out = prim.bind(*primals, **params)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    _, t_out = jax.jvp(lambda *a: reference_fn(*a, **params), tuple(primals), tangents)
    return out, (list(t_out) if prim.multiple_results else t_out)
  ad.primitive_jvps[prim] = jvp


def _to_front(x, d, size):
  if d is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, d, 0)


def _batch_size(args, dims):
  return next(a.shape[d] for a, d in zip(args, dims) if d is not None)


def _map_batch(prim):
  """Batching by a loop over the batch (lax.map) for ops whose operands have fixed ranks."""
  def rule(args, dims, **params):
    size = _batch_size(args, dims)
    ops = tuple(_to_front(a, d, size) for a, d in zip(args, dims))
    outs = lax.map(lambda o: tuple(prim.bind(*o, **params)), ops)
    return list(outs), [0] * len(outs)
  return rule


# ------------------------------------------------------------------------------------- quantize

quantize_p = Primitive("fp4jax_quantize")
quantize_p.multiple_results = True
quantize_local_p = Primitive("fp4jax_quantize_local")
quantize_local_p.multiple_results = True


def _quantize_abstract(x, amax, *bits, fmt, tiled, scale_rule, impl):
  del scale_rule, impl, bits
  *lead, k = x.shape
  if tiled:
    s_shape = tuple(lead[:-1]) + (lead[-1] // TILE, k // TILE)
  else:
    s_shape = tuple(lead) + (k // BLOCK[fmt],)
  return (_ShapedArray(tuple(lead) + (k // 2,), jnp.uint8),
          _ShapedArray(s_shape, SCALE_DTYPE[fmt]))


def _quantize_local_impl(x, amax, *bits, fmt, tiled, scale_rule, impl, platform):
  bits = bits[0] if bits else None
  if impl == "pallas" and platform in ("cuda", "cpu"):
    interpret = platform != "cuda"
    if tiled:
      q, s = _k2d.quantize_2d(x, amax, bits, interpret=interpret)
    else:
      q, s = _k1d.quantize_1d(x, amax, bits, fmt=fmt, scale_rule=scale_rule, interpret=interpret)
    return q, lax.bitcast_convert_type(s, SCALE_DTYPE[fmt])
  return quantize_last_reference(x, amax, bits, fmt=fmt, tiled=tiled, scale_rule=scale_rule)


@functools.lru_cache(maxsize=None)
def _quantize_cp(x_ndim, amax_ndim, has_bits, params_items):
  params = dict(params_items)
  fmt, tiled = params["fmt"], params["tiled"]

  def local(x, amax, *bits):
    return tuple(quantize_local_p.bind(x, amax, *bits, **params))

  def specs(mesh, arg_shapes):
    spec = shd.quantize_specs(mesh, arg_shapes[0].shape, arg_shapes[0].sharding,
                              block=BLOCK[fmt], tiled=tiled)
    args = (shd.named(mesh, spec), shd.named(mesh, spec[:amax_ndim]))
    args += (shd.named(mesh, spec),) if has_bits else ()
    return args, (shd.named(mesh, spec), shd.named(mesh, spec))

  def partition(mesh, arg_shapes, result_shape):
    args, outs = specs(mesh, arg_shapes)
    return mesh, local, outs, args

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes)[1]

  rule = shd.quantize_rule(x_ndim, amax_ndim, has_bits, block=BLOCK[fmt], tiled=tiled)
  return _partitioned(local, rule=rule, partition=partition, infer=infer)


def _quantize_lowering(ctx, x, amax, *bits, **params):
  x_aval, amax_aval = ctx.avals_in[:2]
  fn = _quantize_cp(x_aval.ndim, amax_aval.ndim, bool(bits), tuple(sorted(params.items())))
  return mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, x, amax, *bits)


def _quantize_batch(args, dims, **params):
  size = _batch_size(args, dims)
  ops = [_to_front(a, d, size) for a, d in zip(args, dims)]
  return quantize_p.bind(*ops, **params), [0, 0]


_register(quantize_p, quantize_local_p, abstract=_quantize_abstract, lowering=_quantize_lowering,
          local_impl=_quantize_local_impl, batch=_quantize_batch,
          reference_fn=lambda x, amax, *bits, impl, **p: _quantize_local_impl(
              x, amax, *bits, impl="xla", platform="other", **p))


def quantize_last(x, amax, bits=None, *, fmt, tiled=False, scale_rule="rceil", impl="xla"):
  """(packed codes, scales) of x quantized along its last axis (1D blocks, or 16x16 tiles).

  amax: float32 of shape x.shape[:n] (ignored by MXFP4). bits: uint8 of x's shape or None.
  """
  ops = (x, jnp.asarray(amax, jnp.float32)) + (() if bits is None else (bits.astype(jnp.uint8),))
  data, scale = quantize_p.bind(*ops, fmt=fmt, tiled=bool(tiled), scale_rule=scale_rule, impl=impl)
  return data, scale


# ------------------------------------------------------------------------------------- dequantize

dequantize_p = Primitive("fp4jax_dequantize")
dequantize_p.multiple_results = True
dequantize_local_p = Primitive("fp4jax_dequantize_local")
dequantize_local_p.multiple_results = True


def _dequantize_abstract(data, scale, amax, *, fmt, tiled, dtype, impl):
  del scale, amax, fmt, tiled, impl
  return (_ShapedArray(data.shape[:-1] + (data.shape[-1] * 2,), dtype),)


def _dequantize_local_impl(data, scale, amax, *, fmt, tiled, dtype, impl, platform):
  """Both impls lower to the XLA reference: dequantization is elementwise and XLA fuses it."""
  del impl, platform
  return (dequantize_last_reference(data, scale, amax, fmt=fmt, tiled=tiled, dtype=dtype),)


@functools.lru_cache(maxsize=None)
def _dequantize_cp(ndim, amax_ndim, params_items):
  params = dict(params_items)
  fmt, tiled = params["fmt"], params["tiled"]

  def local(data, scale, amax):
    return tuple(dequantize_local_p.bind(data, scale, amax, **params))

  def specs(mesh, arg_shapes):
    d = arg_shapes[0]
    x_shape = d.shape[:-1] + (d.shape[-1] * 2,)
    spec = shd.quantize_specs(mesh, x_shape, d.sharding, block=BLOCK[fmt], tiled=tiled)
    args = (shd.named(mesh, spec), shd.named(mesh, spec), shd.named(mesh, spec[:amax_ndim]))
    return args, (shd.named(mesh, spec),)

  def partition(mesh, arg_shapes, result_shape):
    args, outs = specs(mesh, arg_shapes)
    return mesh, local, outs, args

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes)[1]

  rule = shd.dequantize_rule(ndim, amax_ndim, block=BLOCK[fmt], tiled=tiled)
  return _partitioned(local, rule=rule, partition=partition, infer=infer)


def _dequantize_lowering(ctx, data, scale, amax, **params):
  fn = _dequantize_cp(ctx.avals_in[0].ndim, ctx.avals_in[2].ndim, tuple(sorted(params.items())))
  return mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, data, scale, amax)


def _dequantize_batch(args, dims, **params):
  size = _batch_size(args, dims)
  ops = [_to_front(a, d, size) for a, d in zip(args, dims)]
  return dequantize_p.bind(*ops, **params), [0]


_register(dequantize_p, dequantize_local_p, abstract=_dequantize_abstract,
          lowering=_dequantize_lowering, local_impl=_dequantize_local_impl, batch=_dequantize_batch,
          reference_fn=lambda *a, **p: _dequantize_local_impl(*a, platform="other", **p))


def dequantize_last(data, scale, amax, *, fmt, tiled=False, dtype=jnp.float32, impl="xla"):
  """Values of codes packed along the last axis (1D blocks or 16x16 tiles), as ``dtype``."""
  amax = jnp.zeros((), jnp.float32) if amax is None else jnp.asarray(amax, jnp.float32)
  (out,) = dequantize_p.bind(data, scale, amax, fmt=fmt, tiled=bool(tiled),
                             dtype=jnp.dtype(dtype), impl=impl)
  return out


# ------------------------------------------------------------------------------------- RHT-transposed

quantize_rht_t_p = Primitive("fp4jax_quantize_rht_t")
quantize_rht_t_p.multiple_results = True
quantize_rht_t_local_p = Primitive("fp4jax_quantize_rht_t_local")
quantize_rht_t_local_p.multiple_results = True


def _rht_rows(fmt, rht_size):
  return max(BLOCK[fmt], rht_size)


def _rht_t_abstract(x, amax, *bits, fmt, rht_size, rht_seed, scale_rule, impl):
  t, c = x.shape
  return (_ShapedArray((c, t // 2), jnp.uint8),
          _ShapedArray((c, t // BLOCK[fmt]), SCALE_DTYPE[fmt]))


def _rht_t_local_impl(x, amax, *bits, fmt, rht_size, rht_seed, scale_rule, impl, platform):
  bits = bits[0] if bits else None
  if impl == "pallas" and platform in ("cuda", "cpu"):
    q, s = _krht.quantize_rht_t(x, amax, bits, fmt=fmt, rht_size=rht_size, rht_seed=rht_seed,
                                scale_rule=scale_rule, interpret=platform != "cuda")
    return q, lax.bitcast_convert_type(s, SCALE_DTYPE[fmt])
  return quantize_rht_t_reference(x, amax, bits, fmt=fmt, rht_size=rht_size, rht_seed=rht_seed,
                                  scale_rule=scale_rule)


@functools.lru_cache(maxsize=None)
def _rht_t_cp(has_bits, params_items):
  params = dict(params_items)
  fmt = params["fmt"]
  rows = _rht_rows(fmt, params["rht_size"])

  def local(x, amax, *bits):
    return tuple(quantize_rht_t_local_p.bind(x, amax, *bits, **params))

  def specs(mesh, arg_shapes):
    x = arg_shapes[0]
    t_e, c_e = shd.spec_of(x.sharding, 2)
    t_e = shd.keep_if_divides(mesh, t_e, x.shape[0], rows)
    if set(shd.axes_of(t_e)) & set(shd.axes_of(c_e)):
      c_e = None
    args = (shd.named(mesh, [t_e, c_e]), shd.named(mesh, []))
    args += (shd.named(mesh, [c_e, t_e]),) if has_bits else ()
    return args, (shd.named(mesh, [c_e, t_e]), shd.named(mesh, [c_e, t_e]))

  def partition(mesh, arg_shapes, result_shape):
    args, outs = specs(mesh, arg_shapes)
    return mesh, local, outs, args

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes)[1]

  rule = shd.quantize_rht_t_rule(has_bits, rows=rows, block=BLOCK[fmt])
  return _partitioned(local, rule=rule, partition=partition, infer=infer)


def _rht_t_lowering(ctx, x, amax, *bits, **params):
  fn = _rht_t_cp(bool(bits), tuple(sorted(params.items())))
  return mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, x, amax, *bits)


_register(quantize_rht_t_p, quantize_rht_t_local_p, abstract=_rht_t_abstract,
          lowering=_rht_t_lowering, local_impl=_rht_t_local_impl,
          batch=_map_batch(quantize_rht_t_p),
          reference_fn=lambda *a, impl, **p: _rht_t_local_impl(*a, impl="xla", platform="other", **p))


def quantize_rht_t(x, amax, bits=None, *, fmt, rht_size=16, rht_seed=None, scale_rule="rceil",
                   impl="xla"):
  """(packed codes (C, T/2), scales (C, T/B)) of RHT(x)ᵀ quantized along T; x of shape (T, C)."""
  ops = (x, jnp.asarray(amax, jnp.float32)) + (() if bits is None else (bits.astype(jnp.uint8),))
  data, scale = quantize_rht_t_p.bind(*ops, fmt=fmt, rht_size=int(rht_size), rht_seed=rht_seed,
                                      scale_rule=scale_rule, impl=impl)
  return data, scale


# ------------------------------------------------------------------------------------- scaled matmul

scaled_matmul_p = Primitive("fp4jax_scaled_matmul")
scaled_matmul_local_p = Primitive("fp4jax_scaled_matmul_local")


def _mm_abstract(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, fmt, a_tiled, b_tiled,
                 out_dtype, impl):
  return _ShapedArray(a_data.shape[:-1] + (b_data.shape[0],), out_dtype)


def _mm_local_impl(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, fmt, a_tiled, b_tiled,
                   out_dtype, impl, platform):
  a = along_last(a_data, a_scale, a_amax, fmt=fmt, tiled=a_tiled)
  b = along_last(b_data, b_scale, b_amax, fmt=fmt, tiled=b_tiled)
  if impl == "pallas" and platform in ("cuda", "cpu"):
    out = _kmm.scaled_matmul(a_data, _bytes(a_scale), b_data, _bytes(b_scale), tensor_factor(a, b),
                             fmt=fmt, a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=out_dtype,
                             interpret=platform != "cuda")
  else:
    out = scaled_matmul_reference(a, b, out_dtype)
  return (out,)


@functools.lru_cache(maxsize=None)
def _mm_cp(a_ndim, params_items):
  params = dict(params_items)
  fmt, a_tiled, b_tiled = params["fmt"], params["a_tiled"], params["b_tiled"]

  def local(*ops):
    return scaled_matmul_local_p.bind(*ops, **params)

  def specs(mesh, arg_shapes):
    a, b = arg_shapes[0], arg_shapes[3]
    a_shape = a.shape[:-1] + (a.shape[-1] * 2,)
    b_shape = (b.shape[0], b.shape[1] * 2)
    a_spec, b_spec, out_spec, k_axes = shd.matmul_specs(
        mesh, a_shape, a.sharding, b_shape, b.sharding, block=BLOCK[fmt], a_tiled=a_tiled,
        b_tiled=b_tiled)
    n = lambda s: shd.named(mesh, s)
    args = (n(a_spec), n(a_spec), n([]), n(b_spec), n(b_spec), n([]))
    return args, n(out_spec), k_axes

  def partition(mesh, arg_shapes, result_shape):
    args, out, k_axes = specs(mesh, arg_shapes)
    if not k_axes:
      return mesh, local, out, args

    def local_psum(*ops):   # K sharded: float32 partial products, summed across the K shards
      part = scaled_matmul_local_p.bind(*ops, **{**params, "out_dtype": jnp.dtype(jnp.float32)})
      return lax.psum(part, k_axes).astype(params["out_dtype"])

    return mesh, local_psum, out, args

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes)[1]

  rule_str, sizes = shd.scaled_matmul_rule(a_ndim, block=BLOCK[fmt], a_tiled=a_tiled,
                                           b_tiled=b_tiled)
  return _partitioned(local, rule=(rule_str, sizes), partition=partition, infer=infer)


def _mm_lowering(ctx, *ops, **params):
  fn = _mm_cp(ctx.avals_in[0].ndim, tuple(sorted(params.items())))
  return mlir.lower_fun(lambda *a: [fn(*a)], multiple_results=True)(ctx, *ops)


def _mm_batch(args, dims, **params):
  a_data, a_scale, a_amax, b_data, b_scale, b_amax = args
  da, das, daa, db, dbs, dba = dims
  if daa is None and db is None and dbs is None and dba is None:
    size = _batch_size(args, dims)
    a_data, a_scale = _to_front(a_data, da, size), _to_front(a_scale, das, size)
    return scaled_matmul_p.bind(a_data, a_scale, a_amax, b_data, b_scale, b_amax, **params), 0
  size = _batch_size(args, dims)
  ops = tuple(_to_front(a, d, size) for a, d in zip(args, dims))
  return lax.map(lambda o: scaled_matmul_p.bind(*o, **params), ops), 0


_register(scaled_matmul_p, scaled_matmul_local_p, abstract=_mm_abstract, lowering=_mm_lowering,
          local_impl=lambda *a, **p: _mm_local_impl(*a, **p)[0], batch=_mm_batch,
          reference_fn=lambda *a, impl, **p: _mm_local_impl(*a, impl="xla", platform="other", **p)[0],
          multiple_results=False)


def scaled_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, impl="xla"):
  """a (..., M, K) · b (N, K)ᵀ from two FP4 QTensors quantized along K (validated by the caller)."""
  zero = jnp.zeros((), jnp.float32)
  a_amax = zero if a.amax is None else jnp.asarray(a.amax, jnp.float32)
  b_amax = zero if b.amax is None else jnp.asarray(b.amax, jnp.float32)
  return scaled_matmul_p.bind(a.data, a.scale, a_amax, b.data, b.scale, b_amax, fmt=a.fmt,
                              a_tiled=a.tile is not None, b_tiled=b.tile is not None,
                              out_dtype=jnp.dtype(out_dtype), impl=impl)
