"""Producers that quantize their output for the next quantized dot in their own pass (docs/DESIGN.md, "Quantize in the producer's pass").

Axis legend: R rows (tokens, every leading axis), D the normalized axis (the next dot's K), P = D padded to
a power of two.

``rmsnorm_quantize(x, scale, recipe, eps=..., dtype=...)`` is RMSNorm whose output comes back as an
``fp4jax.PreQuantized``: h = RMSNorm(x)·scale in ``dtype`` and h quantized as ``recipe``'s fprop_x
quantizes it, so ``fp4jax.dot(pre, w, recipe=recipe)`` quantizes nothing more and gives the bits the
unfused ``fp4jax.dot(h, w, recipe=recipe)`` gives. Two passes, because NVFP4's FP32 tensor scale needs
max|h| over the whole tensor before any block can be encoded:
  1. the amax: ``rmsnorm`` (XLA) reduced to max|h|, read-only, its rows' factor from a pass of their own (the
     kernel ``rmsnorm_quantize.rms_inverse_rows`` with the producer's kernel, else its twin); where
     the dot would share it with its wgrad quantize of h (``fp4jax.prequantized.amaxes``), the same
     reduction also gives the amax of RHT(h) along the tokens, carried in the PreQuantized for that quantize;
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

from fp4jax import _exact, dispatch, formats, prequantized
from fp4jax.kernels import relu2_quantize as relu2_kernel
from fp4jax.kernels import rmsnorm_quantize as kernel
from fp4jax.numerics.amax import abs_max
from fp4jax.primitives import producers
from fp4jax.prequantized import PreQuantized, _check_quantizer
from fp4jax.qtensor import QTensor
from fp4jax.recipes import as_recipe

OP = "rmsnorm_quantize"   # its name in fp4jax.dispatch.KERNEL_OPS (the impl switch, the proof)
RELU2_OP = "relu2_quantize"


# The XLA twin of each kernel: its ``_reference`` (the kernels' oracles, what impl "xla" computes).
rmsnorm = kernel.rmsnorm_reference
relu2 = relu2_kernel.relu2_reference


def kernel_ok(quantizer, x_shape, x_dtype, dtype) -> bool:
  """Whether the Pallas kernel covers this call: plain 1D NVFP4/MXFP4 nearest, bf16/fp16 x, a bf16 h, D a
  multiple of the block (the twin covers every pre-quantizable quantizer)."""
  return (quantizer.fmt in formats.KERNEL_FORMATS and quantizer.four_over_six is None
          and jnp.dtype(x_dtype) in kernel.INPUT_DTYPES and jnp.dtype(dtype) == jnp.bfloat16
          and x_shape[-1] % formats.BLOCK[quantizer.fmt] == 0)


def _amaxes(h_twin, quantizer, wgrad_x):
  """Pass 1, read-only (max is exact in any order): (max|h|, the carried wgrad amax) from one reduction where
  the dot would share them (``prequantized.amaxes``), else (None, None)."""
  return prequantized.amaxes(h_twin.reshape(-1, h_twin.shape[-1]), quantizer, wgrad_x)


def _kernel_amax(h_twin, amax):
  """The kernel's tensor amax: pass 1's, or max|h| of h as stored (the kernel reads its h's bf16 bits)."""
  return abs_max(_exact.stored(h_twin)) if amax is None else amax


def _inverse(impl):
  """The norm's factor of each row for the amax pass: the kernel with the producer's kernel (one pass reading
  x, ``producers.rms_inverse``), else the twin."""
  if impl == "pallas":
    return functools.partial(producers.rms_inverse, impl=impl)
  return kernel.rms_inverse_reference


def _forward(x, scale, eps, dtype, quantizer, wgrad_x, impl):
  d = x.shape[-1]
  h_twin = rmsnorm(x, scale, eps=eps, dtype=dtype, inverse=_inverse(impl))
  amax, amax_t = _amaxes(h_twin, quantizer, wgrad_x)
  if impl == "pallas":   # the kernel, on each device's rows (compiled for CUDA, interpreted elsewhere)
    amax = _kernel_amax(h_twin, amax)
    h, q, s = producers.rmsnorm_quantize(x, scale, amax, eps=eps, fmt=quantizer.fmt,
                                         scale_rule=quantizer.scale_rule, impl=impl)
    q_x = _qtensor(q.reshape(-1, d // 2), s.reshape(-1, d // formats.BLOCK[quantizer.fmt]), amax, quantizer,
                   dtype)
    return prequantized.handover(h, q_x, quantizer, amax_t, wgrad_x)
  q_x = quantizer(h_twin.reshape(-1, d), amax=amax)
  return prequantized.handover(h_twin, q_x, quantizer, amax_t, wgrad_x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _rmsnorm_quantize(x, scale, eps, dtype, quantizer, wgrad_x, impl):
  return _forward(x, scale, eps, dtype, quantizer, wgrad_x, impl)


def _fwd(x, scale, eps, dtype, quantizer, wgrad_x, impl):
  return _forward(x, scale, eps, dtype, quantizer, wgrad_x, impl), (x, scale)


def _bwd(eps, dtype, quantizer, wgrad_x, impl, res, ct):
  del quantizer, wgrad_x, impl
  x, scale = res
  _, vjp = jax.vjp(functools.partial(rmsnorm, eps=eps, dtype=dtype), x, scale)
  return vjp(ct.x)


_rmsnorm_quantize.defvjp(_fwd, _bwd)


def _fprop_quantizers(recipe, k: int, what: str, instead: str):
  """(``recipe``'s fprop input quantizer, checked: one that can pre-quantize, and K a multiple of its
  alignment; the wgrad quantizer whose amax the producer carries, ``prequantized.carried_wgrad``)."""
  roles = as_recipe(recipe).roles
  _check_quantizer(roles.fprop_x)
  if k % roles.alignment()[1]:
    raise ValueError(f"{what}={k} is not a multiple of recipe {roles.name!r}'s K alignment "
                     f"{roles.alignment()[1]}; {instead} and let the dot pad")
  return roles.fprop_x, prequantized.carried_wgrad(roles)


def rmsnorm_quantize(x, scale, recipe, *, eps, dtype=jnp.bfloat16, impl=None) -> PreQuantized:
  """RMSNorm(x)·scale in ``dtype``, pre-quantized for ``recipe``'s fprop GEMM (module docstring).

  impl: "pallas" (the kernel; interpreted off a GPU), "xla" (the twin), or None: the impl switch
  (``fp4jax.dispatch.default_impl("rmsnorm_quantize", fmt)``: a kernel only with evidence).
  """
  quantizer, wgrad_x = _fprop_quantizers(recipe, x.shape[-1], "rmsnorm_quantize: D", "use the plain norm")
  fits = kernel_ok(quantizer, x.shape, x.dtype, dtype)
  if impl == "pallas" and not fits:
    raise ValueError(f"impl='pallas': the rmsnorm_quantize kernel covers plain 1D nvfp4/mxfp4 of bf16/fp16 x into a bf16 h; "
                     f"got {quantizer!r} on {x.dtype} -> {jnp.dtype(dtype)}. Use impl='xla' or None")
  impl = dispatch.choose(OP, quantizer.fmt, impl) if fits else "xla"
  with jax.named_scope(f"fp4jax/{OP}"):   # one pass in profiles and in bench/predict/hlo_parts.py's "fp4jax passes"
    return _rmsnorm_quantize(x, scale, float(eps), jnp.dtype(dtype), quantizer, wgrad_x, impl)


# ------------------------------------------------------------------------------- relu² + quantize

def relu2_kernel_ok(quantizer, u_shape, u_dtype) -> bool:
  """Whether the relu² kernel covers this call: plain 1D NVFP4/MXFP4 nearest of a bf16 u, F a multiple of
  the block."""
  return (quantizer.fmt in formats.KERNEL_FORMATS and quantizer.four_over_six is None
          and jnp.dtype(u_dtype) == jnp.bfloat16 and u_shape[-1] % formats.BLOCK[quantizer.fmt] == 0)


def _relu2_forward(u, quantizer, wgrad_x, impl):
  f = u.shape[-1]
  h_twin = relu2(u)
  amax, amax_t = _amaxes(h_twin, quantizer, wgrad_x)
  if impl != "pallas":
    q_x = quantizer(h_twin.reshape(-1, f), amax=amax)
    return prequantized.handover(h_twin, q_x, quantizer, amax_t, wgrad_x)
  amax = _kernel_amax(h_twin, amax)
  h, q, s = producers.relu2_quantize(u, amax, fmt=quantizer.fmt, scale_rule=quantizer.scale_rule, impl=impl)
  q_x = _qtensor(q.reshape(-1, f // 2), s.reshape(-1, f // formats.BLOCK[quantizer.fmt]), amax, quantizer, u.dtype)
  return prequantized.handover(h, q_x, quantizer, amax_t, wgrad_x)


def _qtensor(q, s, amax, quantizer, dtype):
  fmt = quantizer.fmt
  return QTensor(q, s, amax if fmt == "nvfp4" else None,
                 fmt, -1, formats.BLOCK[fmt], None, jnp.dtype(dtype), quantizer.scale_rule if fmt == "mxfp4" else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _relu2_quantize(u, quantizer, wgrad_x, impl):
  return _relu2_forward(u, quantizer, wgrad_x, impl)


def _relu2_fwd(u, quantizer, wgrad_x, impl):
  return _relu2_forward(u, quantizer, wgrad_x, impl), u


def _relu2_bwd(quantizer, wgrad_x, impl, u, ct):
  del quantizer, wgrad_x, impl
  return jax.vjp(relu2, u)[1](ct.x)


_relu2_quantize.defvjp(_relu2_fwd, _relu2_bwd)


def relu2_quantize(u, recipe, *, impl=None) -> PreQuantized:
  """relu(u)² (u's dtype) pre-quantized for ``recipe``'s fprop GEMM (the MLP's down projection): the same
  two passes as ``rmsnorm_quantize`` (amax read-only, then one kernel writing h and its codes). Bit-identical
  to ``fp4jax.dot(relu2(u), w, recipe=recipe)`` whichever impl runs: relu(u)² of bf16 is exact in float32."""
  quantizer, wgrad_x = _fprop_quantizers(recipe, u.shape[-1], "relu2_quantize: F", "use relu2")
  fits = relu2_kernel_ok(quantizer, u.shape, u.dtype)
  if impl == "pallas" and not fits:
    raise ValueError(f"impl='pallas': the relu2_quantize kernel covers plain 1D nvfp4/mxfp4 of bf16 u; got "
                     f"{quantizer!r} on {u.dtype}. Use impl='xla' or None")
  impl = dispatch.choose(RELU2_OP, quantizer.fmt, impl) if fits else "xla"
  with jax.named_scope(f"fp4jax/{RELU2_OP}"):
    return _relu2_quantize(u, quantizer, wgrad_x, impl)
