"""Producers that quantize their output for the next quantized dot in their own pass (issue 30, item 2).

Axis legend: R rows (tokens, every leading axis), D the normalized axis (the next dot's K), P = D padded to
a power of two.

``rmsnorm_quantize(x, scale, recipe, eps=..., dtype=...)`` is RMSNorm whose output comes back as an
``fp4jax.PreQuantized``: h = RMSNorm(x)·scale in ``dtype`` and h quantized as ``recipe``'s fprop_x
quantizes it, so ``fp4jax.dot(pre, w, recipe=recipe)`` quantizes nothing more and gives the bits the
unfused ``fp4jax.dot(h, w, recipe=recipe)`` gives. Two passes, because NVFP4's FP32 tensor scale needs
max|h| over the whole tensor before any block can be encoded:
  1. the amax: ``rmsnorm`` (XLA) reduced to max|h|, read-only (XLA fuses it into one pass over x);
  2. the norm again and the quantization, in registers: the Pallas kernel
     (``fp4jax.kernels.rmsnorm_quantize``, impl "pallas") or its XLA twin (impl "xla"), which writes h
     and quantizes it with the quantizer itself (so it covers every pre-quantizable quantizer).
The norm sums its squares in one fixed pairwise order (``rms_inverse``), so the kernel and the twin
agree bit for bit; this order is not ``jnp.mean``'s, so h may differ from ``models.layers.RMSNorm``'s
in the last bit of some rows (the model uses it only where the impl switch picks the kernel).
The gradient is RMSNorm's, through the twin (``jax.vjp`` of ``rmsnorm``); the codes have none.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import formats
from fp4jax._exact import div
from fp4jax.kernels import rmsnorm_quantize as kernel
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.prequantized import PreQuantized, _check_quantizer
from fp4jax.primitives.impl import resolve_impl
from fp4jax.qtensor import QTensor

OP = "rmsnorm_quantize"   # its name in fp4jax.primitives.impl.KERNEL_OPS (the impl switch, the proof)


def _halve(s):
  w = s.shape[-1] // 2
  return s[:, :w] + s[:, w:]


def rmsnorm(x, scale, *, eps, dtype):
  """RMSNorm(x)·scale over the last axis in ``dtype``, the sum of squares in the kernel's fixed order."""
  *lead, d = x.shape
  x_RxP = pad_to_multiple(x.reshape(-1, d).astype(jnp.float32), 1, kernel.pow2(d))
  r_Rx1 = kernel.rms_inverse(x_RxP, d, eps, halve=_halve, div=div, sqrt=jnp.sqrt)
  h = (x.reshape(-1, d).astype(jnp.float32) * r_Rx1) * scale.astype(jnp.float32)
  return h.astype(dtype).reshape(*lead, d)


def kernel_ok(quantizer, x_shape, x_dtype, dtype) -> bool:
  """Whether the Pallas kernel covers this call: plain 1D NVFP4/MXFP4 nearest, bf16/fp16 x, a bf16 h, D a
  multiple of the block (the twin covers every pre-quantizable quantizer)."""
  return (quantizer.fmt in formats.KERNEL_FORMATS and quantizer.four_over_six is None
          and jnp.dtype(x_dtype) in kernel.INPUT_DTYPES and jnp.dtype(dtype) == jnp.bfloat16
          and x_shape[-1] % formats.BLOCK[quantizer.fmt] == 0)


def _forward(x, scale, eps, dtype, quantizer, impl):
  d = x.shape[-1]
  h_twin = rmsnorm(x, scale, eps=eps, dtype=dtype)
  amax = jnp.max(jnp.abs(h_twin.astype(jnp.float32)))      # pass 1 (exact in any order)
  if impl == "pallas":
    call = lambda interpret: lambda x, scale, amax: kernel.rmsnorm_quantize(
        x, scale, amax, eps=eps, fmt=quantizer.fmt, scale_rule=quantizer.scale_rule,
        interpret=interpret)
    # compiled for CUDA, interpreted elsewhere: decided when lowering, for the platform lowered for
    h, q, s = lax.platform_dependent(x, scale, amax, cuda=call(False), default=call(True))
    q_x = QTensor(q.reshape(-1, d // 2), lax.bitcast_convert_type(s.reshape(-1, d // formats.BLOCK[quantizer.fmt]),
                                                                formats.SCALE_DTYPE[quantizer.fmt]),
                  amax if quantizer.fmt == "nvfp4" else None, quantizer.fmt, -1, formats.BLOCK[quantizer.fmt],
                  None, jnp.dtype(dtype), quantizer.scale_rule if quantizer.fmt == "mxfp4" else None)
    return PreQuantized(h, q_x, quantizer)
  return PreQuantized(h_twin, quantizer(h_twin.reshape(-1, d)), quantizer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _rmsnorm_quantize(x, scale, eps, dtype, quantizer, impl):
  return _forward(x, scale, eps, dtype, quantizer, impl)


def _fwd(x, scale, eps, dtype, quantizer, impl):
  return _forward(x, scale, eps, dtype, quantizer, impl), (x, scale)


def _bwd(eps, dtype, quantizer, impl, res, ct):
  del quantizer, impl
  x, scale = res
  _, vjp = jax.vjp(functools.partial(rmsnorm, eps=eps, dtype=dtype), x, scale)
  return vjp(ct.x)


_rmsnorm_quantize.defvjp(_fwd, _bwd)


def rmsnorm_quantize(x, scale, recipe, *, eps, dtype=jnp.bfloat16, impl=None) -> PreQuantized:
  """RMSNorm(x)·scale in ``dtype``, pre-quantized for ``recipe``'s fprop GEMM (module docstring).

  impl: "pallas" (the kernel; interpreted off a GPU), "xla" (the twin), or None: the impl switch
  (``fp4jax.primitives.impl.default_impl("rmsnorm_quantize", fmt)``: a kernel only with evidence).
  """
  from fp4jax.dot import as_recipe   # pylint: disable=import-outside-toplevel
  roles = as_recipe(recipe).roles
  quantizer = roles.fprop_x
  _check_quantizer(quantizer)
  if x.shape[-1] % roles.alignment()[1]:
    raise ValueError(f"rmsnorm_quantize: D={x.shape[-1]} is not a multiple of recipe {roles.name!r}'s K "
                     f"alignment {roles.alignment()[1]}; use the plain norm and let the dot pad")
  fits = kernel_ok(quantizer, x.shape, x.dtype, dtype)
  if impl == "pallas" and not fits:
    raise ValueError(f"impl='pallas': the rmsnorm_quantize kernel covers plain 1D nvfp4/mxfp4 of bf16/fp16 x into a bf16 h; "
                     f"got {quantizer!r} on {x.dtype} -> {jnp.dtype(dtype)}. Use impl='xla' or None")
  impl = resolve_impl(impl, quantizer.fmt, OP) if fits else "xla"
  with jax.named_scope(f"fp4jax/{OP}"):   # one pass in profiles and in bench/hlo_cost.py's "fp4jax passes"
    return _rmsnorm_quantize(x, scale, float(eps), jnp.dtype(dtype), quantizer, impl)
