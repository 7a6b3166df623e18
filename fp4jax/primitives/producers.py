"""``fp4jax_rmsnorm_quantize`` and ``fp4jax_relu2_quantize``: the producers that quantize their own output
(``fp4jax.fused``) as primitive pairs, so that a sharded input stays sharded.

Axis legend: R rows (every leading axis), C the last axis (D for the norm, F for relu²), B the block.

  rmsnorm_quantize  x (..., D), scale (D,), amax () -> h (..., D) bf16, codes (..., D/2), scales (..., D/B)
  relu2_quantize    u (..., F), amax ()             -> h (..., F) bf16, codes (..., F/2), scales (..., F/B)

  rms_inverse       x (..., D)                     -> 1/sqrt(Σx²/D + eps) of each row (..., 1) float32

amax is NVFP4's tensor amax of h, reduced by the caller over the whole (global) tensor (MXFP4 has no tensor
scale: its quantize does not read it).
Params: fmt, scale_rule, impl, and the norm's eps (rms_inverse: eps and impl). impl "pallas" runs the kernels
(compiled on CUDA, interpreted on the CPU), else the kernels' XLA twins (``<kernel>_reference`` and the 1D quantize reference).
rms_inverse is the norm's factor for the producer's amax pass (``fp4jax.fused``), which is not differentiated.

Why primitives: a ``pallas_call`` has no partitioning rule, so under a mesh XLA's SPMD partitioner
replicated each kernel's operands: every device gathered the tokens of the whole batch, normalized and
quantized all of them, and the next GEMM contracted over the shard of K of the FSDP weight with the
gathered tokens, then summed float32 (tokens x N) partial products across the devices (docs/PERF.md,
"The contraction-partitioned GEMM"). Here the rows keep their sharding, each device runs the kernel on its
own rows, and the norm's D is whole on every device (the norm reduces over it; relu² may keep a sharded F
cut at block boundaries, as the 1D quantize does).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp4jax import _exact, formats
from fp4jax.kernels import relu2_quantize as relu2_kernel
from fp4jax.kernels import rmsnorm_quantize as norm_kernel
from fp4jax.primitives import pair
from fp4jax.primitives import sharding as shd
from fp4jax.reference import quantize_last_reference


def _abstract(x, *rest, fmt, **_):
  del rest
  *lead, c = x.shape
  return (pair.ShapedArray(x.shape, jnp.bfloat16), pair.ShapedArray(tuple(lead) + (c // 2,), jnp.uint8),
          pair.ShapedArray(tuple(lead) + (c // formats.BLOCK[fmt],), formats.SCALE_DTYPE[fmt]))


def _quantized(h, amax, fmt, scale_rule):
  """(h, codes, scales) with h quantized as the 1D quantize's XLA path quantizes it (read as stored)."""
  q, s = quantize_last_reference(_exact.stored(h), amax, fmt=fmt, scale_rule=scale_rule)
  return h, q, s


def _kernel_outputs(h, q, s, fmt):
  return h, q, lax.bitcast_convert_type(s, formats.SCALE_DTYPE[fmt])


def _norm_local(x, scale, amax, *, eps, fmt, scale_rule, impl, platform):
  if impl == "pallas" and platform in ("cuda", "cpu"):
    return _kernel_outputs(*norm_kernel.rmsnorm_quantize(x, scale, amax, eps=eps, fmt=fmt, scale_rule=scale_rule,
                                                         interpret=platform != "cuda"), fmt)
  h = norm_kernel.rmsnorm_reference(x, scale, eps=eps, dtype=jnp.bfloat16)
  return _quantized(h, amax, fmt, scale_rule)


def _relu2_local(u, amax, *, fmt, scale_rule, impl, platform):
  if impl == "pallas" and platform in ("cuda", "cpu"):
    return _kernel_outputs(*relu2_kernel.relu2_quantize(u, amax, fmt=fmt, scale_rule=scale_rule,
                                                        interpret=platform != "cuda"), fmt)
  return _quantized(relu2_kernel.relu2_reference(u), amax, fmt, scale_rule)


def _norm_shardings(mesh, arg_shapes, **_):
  """Rows as x has them, D whole (the norm reduces over it)."""
  x = arg_shapes[0]
  spec = shd.spec_of(x.sharding, x.ndim)[:-1] + [None]
  return [spec, [None], []], [spec, spec, spec], ()


def _relu2_shardings(mesh, arg_shapes, *, fmt, **_):
  """As the 1D quantize: rows as u has them, F cut only at block boundaries."""
  u = arg_shapes[0]
  spec = shd.quantize_specs(mesh, u.shape, u.sharding, block=formats.BLOCK[fmt], tile=None)
  return [spec, []], [spec, spec, spec], ()


def _norm_rule(ndims, *, fmt, **_):
  return shd.producer_rule(ndims[0], with_scale=True, block=formats.BLOCK[fmt])


def _relu2_rule(ndims, *, fmt, **_):
  return shd.producer_rule(ndims[0], with_scale=False, block=formats.BLOCK[fmt])


def _inverse_abstract(x, **_):
  return pair.ShapedArray(x.shape[:-1] + (1,), jnp.float32)


def _inverse_local(x, *, eps, impl, platform):
  if impl == "pallas" and platform in ("cuda", "cpu"):
    return (norm_kernel.rms_inverse_rows(x, eps=eps, interpret=platform != "cuda"),)
  return (norm_kernel.rms_inverse_reference(x, eps=eps),)


def _inverse_shardings(mesh, arg_shapes, **_):
  """Rows as x has them, D whole (the sum reduces over it)."""
  x = arg_shapes[0]
  spec = shd.spec_of(x.sharding, x.ndim)[:-1] + [None]
  return [spec], spec, ()


def _inverse_rule(ndims, **_):
  return shd.row_reduction_rule(ndims[0])


rms_inverse_p = pair.define(pair.OpSpec(
    "rms_inverse", _inverse_abstract, _inverse_local, _inverse_shardings, _inverse_rule,
    batch_leading=lambda dims: None, multiple_results=False))
rmsnorm_quantize_p = pair.define(pair.OpSpec(
    "rmsnorm_quantize", _abstract, _norm_local, _norm_shardings, _norm_rule, batch_leading=lambda dims: None))
relu2_quantize_p = pair.define(pair.OpSpec(
    "relu2_quantize", _abstract, _relu2_local, _relu2_shardings, _relu2_rule, batch_leading=lambda dims: None))


def rmsnorm_quantize(x, scale, amax, *, eps, fmt, scale_rule, impl):
  """(h bf16, packed codes, scales) of RMSNorm(x)·scale quantized along D (module docstring)."""
  return tuple(rmsnorm_quantize_p.bind(x, scale, jnp.asarray(amax, jnp.float32), eps=float(eps), fmt=fmt,
                                       scale_rule=scale_rule, impl=impl))


def relu2_quantize(u, amax, *, fmt, scale_rule, impl):
  """(h bf16, packed codes, scales) of relu(u)² quantized along F (module docstring)."""
  return tuple(relu2_quantize_p.bind(u, jnp.asarray(amax, jnp.float32), fmt=fmt, scale_rule=scale_rule,
                                     impl=impl))


def rms_inverse(x, *, eps, impl):
  """1 / sqrt(Σx²/D + eps) of each row of x (..., D), float32 (..., 1), in the norm's fixed order (module
  docstring)."""
  return rms_inverse_p.bind(x, eps=float(eps), impl=impl)
