"""The second level of each format: what multiplies a float32 GEMM of exact block products. Written once
here; fp4jax.gemm's xla path (dense and grouped) and fp4jax.native apply it to their accumulators.

  format            second level (QTensor field)   epilogue on acc = Σ (e2m1·s)_a (e2m1·s)_b
  nvfp4             amax, bound 448                reference.apply_tensor_factor: (amax_a·amax_b)·f32(1/(36·448²)),
                                                   split as powers of two for extreme amaxes; one amax per
                                                   row for a row-scaled a (the factor per output row)
  nvfp4, 4/6        amax, bound 256 on a side      four_over_six.gemm_factor(amax_a, amax_b, B_a, B_b)
  nvfp4_eden        scale2 = s_dec                 s_dec_a·s_dec_b
  nvfp4_dbq         scale2 = outer per 1x128       inside the GEMM: ``dbq.chunked_gemm`` (one rescale per
                                                   128-chunk of K; not a factor of acc)
  mxfp4 mxfp8 fp8   -                              none: the scales are in the products

Each inexact factor is applied with ``_exact.product`` (rounded before any sum the caller forms).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import formats, reference
from fp4jax._exact import product
from fp4jax.numerics import dbq, four_over_six as fos
from fp4jax.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class _Amax:
  """What ``reference.apply_tensor_factor`` reads of an operand: its format and amax (any shape)."""
  fmt: str
  amax: Any


def second(q: QTensor):
  """q's second level as the epilogue reads it (amax, s_dec), or None where there is no factor."""
  if q.fmt == "nvfp4":
    return q.amax
  if q.fmt == "nvfp4_eden":
    return q.scale2
  return None


def factor(acc, fmt: str, second_a, second_b, bound_a=formats.NVFP4_BOUND, bound_b=formats.NVFP4_BOUND):
  """acc (float32) times the second level of its operand pair; second_a / second_b broadcast to acc
  (a tensor's scalar, one per output row, or one per group of outputs)."""
  if fmt == "nvfp4" and bound_a == bound_b == formats.NVFP4_BOUND:
    return reference.apply_tensor_factor(acc, _Amax(fmt, second_a), _Amax(fmt, second_b))
  if fmt == "nvfp4":   # Four Over Six on one or both operands; not a power of two
    return product(acc, fos.gemm_factor(second_a, second_b, bound_a, bound_b))
  if fmt == "nvfp4_eden":
    return product(acc, second_a * second_b)
  if fmt == "nvfp4_dbq":
    raise ValueError("nvfp4_dbq rescales inside the GEMM (dbq.chunked_gemm), not its result")
  return acc


def nvfp4_factor_parts(amax_a, amax_b):
  """float32 (..., 4): ``reference.tensor_factor_parts`` of plain nvfp4 (bound 448) amaxes of one shape, one
  set of parts per element (each group's of a grouped GEMM: the Mosaic kernel's epilogue applies them)."""
  parts = reference.tensor_factor_parts(_Amax("nvfp4", amax_a), _Amax("nvfp4", amax_b))
  return jnp.moveaxis(parts, 0, -1)


def row_second(q: QTensor):
  """The second level of a (M, K) lhs broadcast over its outputs (M, N): (M, 1) for row-scaled nvfp4."""
  s = second(q)
  return s[:, None] if s is not None and jnp.ndim(s) == 1 else s


def apply(acc, a: QTensor, b: QTensor):
  """acc (M, N) float32 of a (M, K) · b (N, K)ᵀ times the pair's second level (the table above)."""
  return factor(acc, a.fmt, row_second(a), second(b), a.bound, b.bound)


def products(q: QTensor):
  """The exact GEMM inputs of q without its second level: e2m1·block scale in bfloat16 for the FP4
  formats (DBQ's inner level only), the float32 values for mxfp8 and fp8."""
  if q.fmt == "nvfp4_dbq":
    return dbq.scaled_values(dbq.Dbq(reference.codes_of(q), q.scale, q.scale2)).astype(jnp.bfloat16)
  if not formats.TABLE[q.fmt].packed:
    return reference.dequantize_reference(q)
  return reference.scaled_codes_bf16(q)


def batched_products(q_Gxx: QTensor):
  """``products`` of a QTensor with a leading group (or chunk) axis."""
  return jax.vmap(products)(q_Gxx)
