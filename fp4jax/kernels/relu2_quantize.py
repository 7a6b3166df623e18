"""The squared-ReLU MLP activation and the 1D FP4 quantization of its output in one Pallas kernel.

Axis legend: R rows (tokens), F the activation's last axis (the down projection's K), NB = F/B blocks.

Each program loads a (rows, blocks·B) tile of u (the up projection's output, bf16), computes
h = bf16(relu(u)²) in registers, stores h, and quantizes the same registers with the 1D quantize
kernel's body (``quantize_1d.encode_rows``). relu(u)² of a bf16 u is exact in float32, so h is one RNE
rounding on both sides: the kernel, its XLA twin (``fp4jax.fused.relu2``) and the model's
``jnp.square(jax.nn.relu(u))`` agree bit for bit. NVFP4's tensor amax of h comes in from a read-only pass
before this one, as for ``rmsnorm_quantize``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4jax import _pallas_compat as plc
from fp4jax import formats
from fp4jax.kernels import _common as C
from fp4jax.kernels.quantize_1d import DEFAULT_TILES, encode_rows
from fp4jax.kernels.rmsnorm_quantize import bf16_value


def _relu2_quantize_kernel(u_ref, a_ref, h_ref, q_ref, s_ref, *, fmt, scale_rule, interpret):
  u = u_ref[...].astype(jnp.float32)
  r = jnp.where(u < 0, jnp.float32(0.0), u)   # relu that keeps NaN (Triton's float max is maxnum)
  h = (r * r).astype(jnp.bfloat16)
  h_ref[...] = h
  q_ref[...], s_ref[...] = encode_rows(bf16_value(h), a_ref[...], None, fmt=fmt, scale_rule=scale_rule,
                                       interpret=interpret)


def relu2_quantize(u, amax, *, fmt="nvfp4", scale_rule="rceil", tiles=DEFAULT_TILES, interpret=False):
  """(h, codes, scale bytes) of u (..., F) bf16: h = relu(u)² bf16, codes (..., F/2) and scale bytes
  (..., F/B) uint8 of h in 1D blocks along F. amax: NVFP4's tensor amax of h (ignored for MXFP4)."""
  *lead, f = u.shape
  b = formats.BLOCK[fmt]
  if f % b or u.dtype != jnp.bfloat16:
    raise ValueError(f"relu2_quantize takes bf16 u with F a multiple of {b}; got {u.dtype} F={f}")
  u_RxF = u.reshape(-1, f)
  r, nb = u_RxF.shape[0], f // b
  br, rp = C.fit(r, tiles.rows)
  bn, nbp = C.fit(nb, tiles.blocks)
  amax_1x1 = C.amax_operand(jnp.asarray(amax, jnp.float32).reshape(()) if fmt == "nvfp4" else 0.0, (), 1)
  kernel = functools.partial(_relu2_quantize_kernel, fmt=fmt, scale_rule=scale_rule, interpret=interpret)
  h, q, s = plc.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((rp, nbp * b), jnp.bfloat16),
                 jax.ShapeDtypeStruct((rp, nbp * b // 2), jnp.uint8), jax.ShapeDtypeStruct((rp, nbp), jnp.uint8)),
      grid=(rp // br, nbp // bn),
      in_specs=[plc.BlockSpec((br, bn * b), lambda i, j: (i, j)), C.amax_spec(amax_1x1, 1, None)],
      out_specs=(plc.BlockSpec((br, bn * b), lambda i, j: (i, j)),
                 plc.BlockSpec((br, bn * b // 2), lambda i, j: (i, j)), plc.BlockSpec((br, bn), lambda i, j: (i, j))),
      interpret=interpret, name=f"fp4jax_relu2_quantize_{fmt}_1x{b}",
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(
          C.pad_axis(C.pad_axis(u_RxF, 0, rp), 1, nbp * b), amax_1x1)
  return (h[:r, :f].reshape(*lead, f), q[:r, :f // 2].reshape(*lead, f // 2), s[:r, :nb].reshape(*lead, nb))


def relu2_reference(u):
  """The MLP's squared ReLU as the model computes it (``jnp.square(jax.nn.relu(u))``, u's dtype): the kernel's
  h, bit for bit."""
  return jnp.square(jax.nn.relu(u))
