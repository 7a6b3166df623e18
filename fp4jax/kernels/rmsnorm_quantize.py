"""RMSNorm and the 1D FP4 quantization of its output in one Pallas kernel: the norm's consumer's fprop codes
are made in the pass that makes its input.

Axis legend: R rows (tokens), D the normalized (and quantized) axis, P = D padded to a power of two,
NB = D/B blocks of B elements (B = 16 nvfp4, 32 mxfp4).

Each program loads (rows, P) of x and the (1, P) scale, the P - D columns past the row's end as zeros
under a mask (``_pallas_compat.load_columns``: no padded copy of x before the kernel), and in registers:
  h = bf16( (x · r) · scale ),   r = 1 / sqrt( ss / D + eps ),   ss = Σ x²  (``rms_inverse``)
then stores h and quantizes the same registers with the 1D quantize kernel's body
(``quantize_1d.encode_rows``): codes and scale bytes, each stored for the row's D columns only (h (R, D),
codes (R, D/2), scales (R, D/B): no slice after the kernel).
NVFP4's tensor amax is a reduction over the whole of h, which no program sees: it comes in from a
read-only pass before this one (``fp4jax.fused``: max|h| of the twin's h, each row's factor 1/sqrt(Σx²/D + eps)
from ``rms_inverse_rows``, this module's second kernel; a max is exact in any order), and each program
derives the tensor's factors from it. So the pair reads x twice and writes h and the codes once: two reads and
one write of D-wide rows, against three reads and one write for the norm, the amax and the quantize
as separate passes.

The sum of squares is summed in one fixed order, the same in the kernel and in its XLA twin
(``rms_inverse``): a pairwise tree over the row zero-padded to P, element i paired with i + P/2 at
every level. x is bf16 or fp16, so each x² is exact in float32 and a fused multiply-add of the first
level rounds exactly as the product-then-add does; the division and the square root are correctly
rounded on both sides (``precise_div``, ``precise_sqrt`` here; ``fp4jax._exact.div`` and XLA's sqrt in
the twin). The kernel is therefore bit-identical with the twin, not merely close.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax._exact import div
from fp4jax.kernels import _common as C
from fp4jax.kernels.quantize_1d import encode_rows
from fp4jax.numerics.layout import pad_to_multiple

INPUT_DTYPES = (jnp.bfloat16, jnp.float16)   # x² exact in float32 (module docstring)


@dataclasses.dataclass(frozen=True)
class RmsnormQuantizeTiles:
  elements: int = 4096     # rows per program = elements / P (power of two, at least 1, at most 32)
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_TILES = RmsnormQuantizeTiles()


def pow2(d: int) -> int:
  p = 1
  while p < d:
    p *= 2
  return p


def tree_sum(s_RxP, halve):
  """Σ over the last axis of a power-of-two width in the fixed pairwise order: ``halve(s)`` returns
  s[:, :w/2] + s[:, w/2:] (a reshape and a 2-element sum in the kernel, slices in XLA)."""
  while s_RxP.shape[-1] > 1:
    s_RxP = halve(s_RxP)
  return s_RxP


def rms_inverse(x_RxP, d, eps, *, halve, div, sqrt):
  """1 / sqrt(Σx²/d + eps) of each row (R, 1), float32, in the fixed order (module docstring)."""
  ss_Rx1 = tree_sum(x_RxP * x_RxP, halve)
  return div(1.0, sqrt(div(ss_Rx1, jnp.float32(d)) + jnp.float32(eps)))


def _halve_in_kernel(s):
  r, w = s.shape
  return jnp.sum(s.reshape(r, 2, w // 2), axis=1)


def _halve_slices(s):
  w = s.shape[-1] // 2
  return s[:, :w] + s[:, w:]


def _kernel_halve(interpret):
  """One level of the tree in a kernel: a reshape and a 2-element sum for Triton (which slices no register
  tensor); slices in the interpreter, whose XLA merges the chain of reshaped sums into one reduction of its
  own order (the last bit of some rows' sums)."""
  return _halve_slices if interpret else _halve_in_kernel


def _rmsnorm_quantize_kernel(x_ref, w_ref, a_ref, h_ref, q_ref, s_ref, *, d, eps, fmt, scale_rule, interpret):
  x_RxP = plc.load_columns(x_ref, d).astype(jnp.float32)
  div = functools.partial(plc.precise_div, interpret=interpret)
  sqrt = functools.partial(plc.precise_sqrt, interpret=interpret)
  r_Rx1 = rms_inverse(x_RxP, d, eps, halve=_kernel_halve(interpret), div=div, sqrt=sqrt)
  h_RxP = ((x_RxP * r_Rx1) * plc.load_columns(w_ref, d).astype(jnp.float32)).astype(jnp.bfloat16)
  plc.store_columns(h_ref, h_RxP, d)
  q, s = encode_rows(bf16_value(h_RxP), a_ref[...], None, fmt=fmt, scale_rule=scale_rule, interpret=interpret)
  plc.store_columns(q_ref, q, d // 2)
  plc.store_columns(s_ref, s, d // formats.BLOCK[fmt])


def bf16_value(h):
  """float32 of bf16 values from their bits (the upper half of the float32). Not ``h.astype(float32)``:
  XLA (xla_allow_excess_precision) removes a float32 -> bf16 -> float32 pair of converts, which would
  quantize the unrounded float32 instead of h."""
  bits = lax.bitcast_convert_type(h, jnp.uint16).astype(jnp.uint32) << 16
  return lax.bitcast_convert_type(bits, jnp.float32)


def rmsnorm_quantize(x, scale, amax, *, eps, fmt="nvfp4", scale_rule="rceil", tiles=DEFAULT_TILES,
                     interpret=False):
  """(h, codes, scale bytes) of x (..., D): h = RMSNorm(x)·scale in bf16 (..., D), and h quantized
  in 1D blocks along D: packed codes (..., D/2) uint8, scale bytes (..., D/B) uint8.

  amax: NVFP4's tensor amax of h (float32 scalar; ignored for MXFP4). x: bf16 or fp16; D a multiple of
  the block B.
  """
  *lead, d = x.shape
  b = formats.BLOCK[fmt]
  if d % b:
    raise ValueError(f"rmsnorm_quantize: D={d} must be a multiple of the block {b} for fmt={fmt!r}")
  if x.dtype not in INPUT_DTYPES:
    raise ValueError(f"rmsnorm_quantize takes bf16 or fp16 x (exact squares); got {x.dtype}. "
                     "Use fp4jax.fused with impl='xla' for other dtypes")
  x_RxD = x.reshape(-1, d)
  r = x_RxD.shape[0]
  p = pow2(d)
  br, rp = C.fit(r, max(1, min(32, tiles.elements // p)))
  amax_1x1 = C.amax_operand(jnp.asarray(amax, jnp.float32).reshape(()) if fmt == "nvfp4" else 0.0, (), 1)
  kernel = functools.partial(_rmsnorm_quantize_kernel, d=d, eps=eps, fmt=fmt, scale_rule=scale_rule,
                             interpret=interpret)
  h, q, s = plc.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((rp, d), jnp.bfloat16), jax.ShapeDtypeStruct((rp, d // 2), jnp.uint8),
                 jax.ShapeDtypeStruct((rp, d // b), jnp.uint8)),
      grid=(rp // br,),
      in_specs=[plc.BlockSpec((br, p), lambda i: (i, 0)), plc.BlockSpec((1, p), lambda i: (0, 0)),
                C.amax_spec(amax_1x1, 1, None)],
      out_specs=(plc.BlockSpec((br, p), lambda i: (i, 0)), plc.BlockSpec((br, p // 2), lambda i: (i, 0)),
                 plc.BlockSpec((br, p // b), lambda i: (i, 0))),
      interpret=interpret, name=f"fp4jax_rmsnorm_quantize_{fmt}_1x{b}",
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(
          C.pad_axis(x_RxD, 0, rp), scale.reshape(1, d), amax_1x1)   # blocks (br, P) over rows of D: masked
  return h[:r].reshape(*lead, d), q[:r].reshape(*lead, d // 2), s[:r].reshape(*lead, d // b)


def _rms_inverse_kernel(x_ref, r_ref, *, d, eps, interpret):
  x_RxP = plc.load_columns(x_ref, d).astype(jnp.float32)
  div = functools.partial(plc.precise_div, interpret=interpret)
  sqrt = functools.partial(plc.precise_sqrt, interpret=interpret)
  r_ref[...] = rms_inverse(x_RxP, d, eps, halve=_kernel_halve(interpret), div=div, sqrt=sqrt)


def rms_inverse_rows(x, *, eps, tiles=DEFAULT_TILES, interpret=False):
  """1 / sqrt(Σx²/D + eps) of each row of x (..., D), float32 (..., 1), in one pass that reads x once: the
  norm's factor as ``rmsnorm_quantize`` computes it (``rms_inverse_reference``, bit for bit). The producer's
  amax pass takes it from here instead of XLA's two fusions (the tree written at width 8, then the row
  finished and divided: two launches, the first reading x)."""
  *lead, d = x.shape
  if x.dtype not in INPUT_DTYPES:
    raise ValueError(f"rms_inverse_rows takes bf16 or fp16 x (exact squares); got {x.dtype}")
  x_RxD = x.reshape(-1, d)
  r = x_RxD.shape[0]
  p = pow2(d)
  br, rp = C.fit(r, max(1, min(32, tiles.elements // p)))
  r_Rx1 = plc.pallas_call(
      functools.partial(_rms_inverse_kernel, d=d, eps=eps, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((rp, 1), jnp.float32), grid=(rp // br,),
      in_specs=[plc.BlockSpec((br, p), lambda i: (i, 0))], out_specs=plc.BlockSpec((br, 1), lambda i: (i, 0)),
      interpret=interpret, name="fp4jax_rms_inverse",
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(C.pad_axis(x_RxD, 0, rp))
  return r_Rx1[:r].reshape(*lead, 1)


_MATERIALIZED_WIDTH = 8


def _halve(s):
  """One level of the tree in XLA. The level of width ``_MATERIALIZED_WIDTH`` is written out (an optimization
  barrier, no change of value): left to itself XLA splits the last levels into two fusions, each recomputing
  the whole tree from x (two reads of x and two launches where one does)."""
  w = s.shape[-1] // 2
  half = s[:, :w] + s[:, w:]
  return lax.optimization_barrier(half) if w == _MATERIALIZED_WIDTH else half


def rms_inverse_reference(x, *, eps):
  """``rms_inverse_rows``'s twin: 1 / sqrt(Σx²/D + eps) of each row of x (..., D), float32 (..., 1), the sum in
  the kernel's fixed order."""
  *lead, d = x.shape
  x_RxP = pad_to_multiple(x.reshape(-1, d).astype(jnp.float32), 1, pow2(d))
  return rms_inverse(x_RxP, d, eps, halve=_halve, div=div, sqrt=jnp.sqrt).reshape(*lead, 1)


def rmsnorm_reference(x, scale, *, eps, dtype, inverse=rms_inverse_reference):
  """RMSNorm(x)·scale over the last axis in ``dtype``, the sum of squares in the kernel's fixed order: the
  kernel's h, bit for bit (module docstring). ``inverse(x, eps=eps)``: the rows' factor (..., 1), this module's
  twin or the kernel (``fp4jax.primitives.producers.rms_inverse``, for values only: its derivatives are the
  twin's recomputed)."""
  *lead, d = x.shape
  r_Rx1 = inverse(x, eps=eps).reshape(-1, 1)
  h = (x.reshape(-1, d).astype(jnp.float32) * r_Rx1) * scale.astype(jnp.float32)
  return h.astype(dtype).reshape(*lead, d)
