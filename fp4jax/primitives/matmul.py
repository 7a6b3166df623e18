"""``fp4jax_scaled_matmul``: a (..., M, K) · b (N, K)ᵀ -> (..., M, N) from two FP4 operands packed
along K (1D blocks, or nvfp4 16x16 tiles per operand).

Operands: a_data, a_scale, a_amax, b_data, b_scale, b_amax (amax zeros for MXFP4). Params: fmt,
a_tiled, b_tiled, out_dtype, impl: "xla", "pallas" (the pair, ``kernels.scaled_matmul``: dequantize
passes, then a bf16 GEMM), "mixed" (``kernels.mixed_matmul``: one GEMM that decodes as it loads) or "mosaic"
(``kernels.mosaic_gemm``: Blackwell's block-scaled tensor cores, the tensor factor and the cast in its epilogue;
its twin, the XLA path's GEMM, off CUDA). A K-sharded contraction sums float32 partial products across the
shards: reduce-scattered where the result is wanted split over the same mesh axes (split along N: as the partials
of b · aᵀ along their first dimension, then the shard transposed; the Mosaic GEMM's partials with its padded
columns, param n_multiple, sliced as shards), else all-reduced (psum).
vmapped calls take the batch as leading axes of a when only a is batched, else loop over it.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp4jax import _native_compat as nc
from fp4jax import dispatch, formats, reference
from fp4jax.kernels import mixed_matmul as mixed_kernel
from fp4jax.kernels import mosaic_gemm as mosaic_kernel
from fp4jax.kernels import scaled_matmul as kernel
from fp4jax.primitives import pair
from fp4jax.primitives import sharding as shd
from fp4jax.primitives.quantize import variant
from fp4jax.qtensor import QTensor, along_last
from fp4jax.reference import scaled_matmul_reference, tensor_factor_parts


def _abstract(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, fmt, a_tiled, b_tiled,
              out_dtype, impl, n_multiple):
  return pair.ShapedArray(a_data.shape[:-1] + (mosaic_kernel.padded_columns(b_data.shape[0], n_multiple),), out_dtype)


def _bytes(s):
  return lax.bitcast_convert_type(s, jnp.uint8)


def _mosaic(a: QTensor, b: QTensor, out_dtype, n_multiple):
  """fp4jax's tcgen05 GEMM on a's rows (leading axes folded into M): the packed codes as float4_e2m1fn, the
  scales per 1x16 block, the tensor factor's parts to its epilogue (in the kernel's 32 words: one pass)."""
  rows = lambda x: x.reshape(-1, x.shape[-1])
  factor = tensor_factor_parts(a, b, words=mosaic_kernel.FACTOR_WORDS)
  out = mosaic_kernel.mosaic_gemm(nc.packed_float4(rows(a.data)), rows(reference.block_scales(a)),
                                  nc.packed_float4(b.data), reference.block_scales(b), factor,
                                  out_dtype=out_dtype, n_multiple=n_multiple)
  return out.reshape(a.data.shape[:-1] + out.shape[-1:])


def _local(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, fmt, a_tiled, b_tiled, out_dtype,
           impl, n_multiple, platform):
  a = along_last(a_data, a_scale, a_amax, fmt=fmt, tiled=a_tiled)
  b = along_last(b_data, b_scale, b_amax, fmt=fmt, tiled=b_tiled)
  if impl == "mosaic":   # the kernel on CUDA, its twin elsewhere (``mosaic_gemm`` chooses by platform)
    return (_mosaic(a, b, out_dtype, n_multiple),)
  if n_multiple != 1:
    raise ValueError(f"fp4jax_scaled_matmul pads its result's columns (n_multiple={n_multiple}) with impl "
                     f"'mosaic' only; got impl={impl!r}")
  if impl in ("pallas", "mixed") and platform in ("cuda", "cpu"):
    gemm = mixed_kernel.mixed_matmul if impl == "mixed" else kernel.pallas_matmul
    out = gemm(a_data, _bytes(a_scale), b_data, _bytes(b_scale), tensor_factor_parts(a, b), fmt=fmt,
               a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=out_dtype, interpret=platform != "cuda")
  elif platform == "cuda" and fmt == "nvfp4" and jnp.dtype(out_dtype).itemsize < 4:
    out = kernel.scaled_matmul_narrow_xla(a, b, out_dtype)   # the factor and cast fuse into the GEMM
  else:
    out = scaled_matmul_reference(a, b, out_dtype)
  return (out,)


def _shardings(mesh, arg_shapes, *, fmt, a_tiled, b_tiled, **_):
  a, b = arg_shapes[0], arg_shapes[3]
  a_shape = a.shape[:-1] + (a.shape[-1] * 2,)
  b_shape = (b.shape[0], b.shape[1] * 2)
  a_spec, b_spec, out_spec, k_axes = shd.matmul_specs(
      mesh, a_shape, a.sharding, b_shape, b.sharding, block=formats.BLOCK[fmt],
      a_tile=formats.tile_side(fmt, a_tiled), b_tile=formats.tile_side(fmt, b_tiled))
  return [a_spec, a_spec, [], b_spec, b_spec, []], out_spec, k_axes


def _rule(ndims, *, fmt, a_tiled, b_tiled, **_):
  return shd.scaled_matmul_rule(ndims[0], block=formats.BLOCK[fmt],
                                a_tile=formats.tile_side(fmt, a_tiled),
                                b_tile=formats.tile_side(fmt, b_tiled))


def _batch_leading(dims):
  """Only a (data, scale) batched: the batch becomes leading axes of a; otherwise loop."""
  return (True, True, False, False, False, False) if all(d is None for d in dims[2:]) else None


def _padded(ndims, *, impl, **params):
  """The Mosaic GEMM's partials with its own padded columns (a multiple of its tile's): a reduce-scatter of them
  along the rows, then the slice of the shard, instead of a slice of the whole partial."""
  if impl != "mosaic":
    return None
  return {**params, "impl": impl, "n_multiple": mosaic_kernel.DEFAULT_TILES.tn}


def _transposed(ndims, *, a_tiled, b_tiled, **params):
  """out(a, b)ᵀ = out(b, a): both operands are contracted along their last axes (2-D a only)."""
  if ndims[0] != 2:
    return None
  return (3, 4, 5, 0, 1, 2), {**params, "a_tiled": b_tiled, "b_tiled": a_tiled}


scaled_matmul_p = pair.define(pair.OpSpec(
    "scaled_matmul", _abstract, _local, _shardings, _rule, batch_leading=_batch_leading,
    multiple_results=False,
    partial_params=lambda params: {**params, "out_dtype": jnp.dtype(jnp.float32)}, transposed=_transposed,
    padded=_padded))


def fp4_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, impl: str):
  """a (..., M, K) · b (N, K)ᵀ from two FP4 QTensors quantized along K (validated by the caller).

  impl: "xla", or "pallas": the Pallas GEMM ``dispatch.pallas_gemm`` picks (the proved "mixed" one, else
  the pair). The caller resolves impl=None (``dispatch.choose("scaled_matmul", fmt)``)."""
  impl = dispatch.choose("scaled_matmul", a.fmt, impl)
  if impl == "native":
    raise ValueError("the fp4jax_scaled_matmul primitive has impl 'xla' or 'pallas'; the native GEMM is "
                     "fp4jax.scaled_matmul(impl='native')")
  return _bind(a, b, out_dtype, "xla" if impl == "xla" else dispatch.pallas_gemm(a.fmt))


def mixed_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32):
  """``fp4_matmul`` on the Pallas GEMM that decodes its operands as it loads them (``kernels.mixed_matmul``),
  whatever the default: what the proof and the kernel's tests compare against the XLA path."""
  dispatch.choose("scaled_matmul", a.fmt, "pallas")   # validates the format
  return _bind(a, b, out_dtype, "mixed")


def mosaic_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.bfloat16):
  """a (..., M, K) · b (N, K)ᵀ on fp4jax's Mosaic GPU GEMM (``kernels.mosaic_gemm``) as an fp4jax op: on a
  mesh each device runs the kernel on its shards, as for the other kernels (a K-sharded contraction: float32
  partial products summed across the shards, then the cast). What ``fp4jax.native.matmul(kernel="mosaic")``
  runs for the pairs ``native.mosaic_takes`` (plain nvfp4, validated there)."""
  return _bind(a, b, out_dtype, "mosaic")


def _bind(a: QTensor, b: QTensor, out_dtype, kernel: str):
  a_tiled, b_tiled = a.tile is not None, b.tile is not None
  with pair.scope(f"{variant(a.fmt, a_tiled)}.{variant(b.fmt, b_tiled)}"):
    zero = jnp.zeros((), jnp.float32)
    a_amax = zero if a.amax is None else jnp.asarray(a.amax, jnp.float32)
    b_amax = zero if b.amax is None else jnp.asarray(b.amax, jnp.float32)
    return scaled_matmul_p.bind(a.data, a.scale, a_amax, b.data, b.scale, b_amax, fmt=a.fmt,
                                a_tiled=a_tiled, b_tiled=b_tiled, out_dtype=jnp.dtype(out_dtype),
                                impl=kernel, n_multiple=1)
