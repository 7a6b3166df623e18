"""One GEMM for any pair of QTensors: ``scaled_matmul(a, b)``, a (M, K) · b (N, K)ᵀ, both quantized
along K, with one switch of backends and an optional group axis.

Backends (``backend=``):
  "xla"     dequantize the block products e2m1·scale to bf16 (exact), one bf16 GEMM with float32
            accumulation, then the format's second level on the float32 result:
              nvfp4       (amax_a·amax_b)·f32(1/(36·448·448)), split as powers of two for extreme amaxes
                          (``reference.apply_tensor_factor``); with 4/6 operands (bound 256)
                          (amax_a·amax_b)·f32(1/(36·B_a·B_b)) (``four_over_six.gemm_factor``)
              nvfp4_eden  s_dec_a·s_dec_b
              nvfp4_dbq   one float32 rescale per 128-chunk of K, the chunks summed in order (``dbq.gemm``)
              mxfp8       the float32 GEMM of the exact dequantized values (``mxfp8.gemm``)
              mxfp4, fp8  as ``fp4jax.scaled_matmul``
  "pallas"  the Triton kernels (nvfp4 with bound 448, mxfp4: ``formats.KERNEL_FORMATS``)
  "native"  the hardware's block-scaled GEMM (``fp4jax.native``: nvfp4, 4/6, MS-EDEN, DBQ; on CUDA
            ``jax.nn.scaled_matmul``, cuDNN on sm_100; its exact twin elsewhere)
  None      the default: "native" for those formats on a GPU of compute capability 10.x
            (``primitives.impl.default_gemm_backend``); else the verified default of
            ``fp4jax.primitives.default_impl``: "xla" unless a device run put the kernel in
            ``VERIFIED_KERNELS``. FP4JAX_DEFAULT_IMPL=xla|pallas|native overrides.

group_sizes: a static tuple of row counts (G groups, summing to M) for grouped GEMMs (MoE experts).
a then has a leading group axis on its second level (nvfp4: amax of shape (G,); a tensor per group)
and b has a leading group axis (G, N, K); group g multiplies rows [sum(sizes[:g]), sum(sizes[:g+1]))
of a with b[g]. The result equals one ``scaled_matmul`` per group, bit for bit (it is one per group).

Row-scaled nvfp4 a (``Quantizer(row_scaled=True)``: amax of shape (M,), one per row) times a
per-tensor b: the tensor factor (amax_row·amax_b)·f32(1/(36·448·448)) per output row, "xla" only.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import api, formats, native, reference
from fp4jax._exact import product
from fp4jax.numerics import dbq, four_over_six as fos, mxfp8
from fp4jax.primitives.impl import default_gemm_backend
from fp4jax.qtensor import QTensor, validate

BACKENDS = ("xla", "pallas", "native")


def _bf16_products(q: QTensor):
  return reference._scaled_codes_bf16(q)   # noqa: SLF001 (the reference's own exact products)


def _contract(a_bf16, b_bf16):
  return lax.dot_general(a_bf16, b_bf16, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)


def _xla_only(a: QTensor, b: QTensor):
  """float32 (M, N) for the pairs ``fp4jax.scaled_matmul`` does not take (see the module docstring)."""
  fmt = a.fmt
  if fmt == "nvfp4":                       # Four Over Six on one or both operands
    acc = _contract(_bf16_products(a), _bf16_products(b))
    # The factor is not a power of two: the result is rounded before any sum the caller forms with it.
    return product(acc, fos.gemm_factor(a.amax, b.amax, a.bound, b.bound))
  if fmt == "nvfp4_eden":
    acc = _contract(_bf16_products(a), _bf16_products(b))
    return product(acc, a.scale2 * b.scale2)
  if fmt == "nvfp4_dbq":
    codes = lambda q: reference.codes_of(q)
    return dbq.gemm(dbq.Dbq(codes(a), a.scale, a.scale2), dbq.Dbq(codes(b), b.scale, b.scale2))
  if fmt == "mxfp8":
    as_mx = lambda q: mxfp8.Mxfp8(q.data, lax.bitcast_convert_type(q.scale, jnp.uint8))
    return mxfp8.gemm(as_mx(a), as_mx(b))
  raise ValueError(f"no GEMM for fmt={fmt!r}")


def _check(a, b, backend):
  if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
    raise TypeError("fp4jax.gemm.scaled_matmul takes two QTensors; got "
                    f"{type(a).__name__} and {type(b).__name__}")
  if a.fmt != b.fmt:
    raise ValueError(f"scaled_matmul operands must share a format; got {a.fmt!r} and {b.fmt!r}")
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}; use one of {BACKENDS} or None (the verified default)")


def _row_scaled(q: QTensor) -> bool:
  return q.fmt == "nvfp4" and q.amax is not None and q.amax.ndim == 1 and q.tile is None


def _dense(a: QTensor, b: QTensor, out_dtype, backend):
  if backend == "native":
    return native.scaled_matmul(a, b, out_dtype=out_dtype)
  if _row_scaled(a) and not _row_scaled(b):   # row-scaled activations: the factor per output row
    if backend == "pallas":
      raise ValueError("there are no Pallas kernels for row-scaled nvfp4; use backend='xla'")
    validate(a, "fp4jax.gemm.scaled_matmul (lhs)")
    validate(b, "fp4jax.gemm.scaled_matmul (rhs)", scalar_amax=True)
    acc = _contract(_bf16_products(a), _bf16_products(b))
    rows = dataclasses.replace(a, amax=a.amax[:, None])
    return reference.apply_tensor_factor(acc, rows, b).astype(out_dtype)
  if a.fmt in formats.NAMES and a.bound == b.bound == formats.NVFP4_BOUND:
    return api.scaled_matmul(a, b, out_dtype=out_dtype, impl=backend)
  if backend == "pallas":
    raise ValueError(f"there are no Pallas kernels for fmt={a.fmt!r}"
                     + (" with the 4/6 bound" if a.fmt == "nvfp4" else "") + "; use backend='xla'")
  validate(a, "fp4jax.gemm.scaled_matmul (lhs)", scalar_amax=True)
  validate(b, "fp4jax.gemm.scaled_matmul (rhs)", scalar_amax=True)
  if a.axis != -1 or b.axis != -1 or a.ndim != 2 or b.ndim != 2 or a.shape[-1] != b.shape[-1]:
    raise ValueError(f"scaled_matmul contracts the last axis of two 2-D operands; got shapes {a.shape}, "
                     f"{b.shape} quantized along axes {a.axis}, {b.axis}")
  return _xla_only(a, b).astype(out_dtype)


def _rows(q: QTensor, start: int, stop: int, g: int) -> QTensor:
  """Rows [start, stop) of a (M, K) QTensor whose second level has a leading group axis."""
  tile = q.tile[0] if q.tile is not None else 1
  if start % tile or stop % tile:
    raise ValueError(f"group boundaries {start}, {stop} must be multiples of the tile side {tile}")
  return dataclasses.replace(
      q, data=q.data[start:stop], scale=q.scale[start // tile:stop // tile],
      amax=None if q.amax is None else q.amax[g],
      scale2=None if q.scale2 is None else (q.scale2[g] if q.fmt == "nvfp4_eden" else q.scale2[start:stop]))


def _group(b: QTensor, g: int) -> QTensor:
  return jax.tree.map(lambda leaf: leaf[g], b)


def scaled_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, backend: str | None = None,
                  group_sizes: tuple[int, ...] | None = None):
  """a (M, K) · b (N, K)ᵀ -> (M, N) in ``out_dtype`` for any pair of QTensors of one format quantized
  along K (the module docstring has the backends and the group axis)."""
  _check(a, b, backend)
  out_dtype = api.as_float_dtype(out_dtype, "fp4jax.gemm.scaled_matmul", "out_dtype")
  backend = default_gemm_backend(a.fmt) if backend is None else backend
  if group_sizes is None:
    return _dense(a, b, out_dtype, backend)
  sizes = tuple(int(s) for s in group_sizes)
  if sum(sizes) != a.shape[0] or len(sizes) != b.data.shape[0]:
    raise ValueError(f"group_sizes={sizes} must sum to the {a.shape[0]} rows of a and have one entry per "
                     f"group of b ({b.data.shape[0]})")
  outs, start = [], 0
  for g, size in enumerate(sizes):
    outs.append(_dense(_rows(a, start, start + size, g), _group(b, g), out_dtype, backend))
    start += size
  return jnp.concatenate(outs, axis=0)
