"""A jitted program's outputs with every sum made exact, and how far the program itself may be from them.

XLA's CPU dots sum their products in an order the instruction set picks (AVX-512 and AVX2 machines, Intel and
AMD, differ), so the bits of a GEMM's float32 output are not a property of the program alone. ``evaluate``
runs the program's jaxpr with each ``dot_general`` (the GEMMs, and the GEMM inside fp4jax's
``fp4jax_scaled_matmul``, inlined as its XLA path) replaced by the exactly rounded result: every product in
float64 (exact for the operands' significands: bf16, float8 and float32 products have at most 48 bits), the
products summed by ``math.fsum``, rounded once to the output dtype; ``reduce_sum`` alike. Every other
operation is the program's own, so the result is a function of the program and its inputs only: the same
bits on every CPU. Nothing here changes what fp4jax computes; it only fixes the order of the sums.

``evaluate`` also returns, for each output, a bound on |program's value - exact-sum value| derived from
float32 accumulation: a dot contracting K terms is within gamma_K * sum_k |a_k b_k| of its exact sum (gamma_K =
K u / (1 - K u), u = 2^-24, whatever the order, with or without FMA), and each later operation carries the
bound forward (``_RULES``): linear and data-movement ops exactly, a rounding adds one unit in the last place of
its dtype. An operation whose result could jump when its input moves (a comparison, a quantizer reading a GEMM
output) makes the bound infinite, and so does anything not in the rules.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from fp4jax.primitives import matmul as matmul_primitive

_F32_U = 2.0 ** -24
_STRUCTURAL = {"reshape", "transpose", "broadcast_in_dim", "slice", "squeeze", "expand_dims", "rev", "copy",
               "copy_p", "reduce_max", "reduce_min", "neg", "abs", "real", "dynamic_slice"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}


def evaluate(fn, *args):
  """(outputs, bounds) of ``fn(*args)`` (a function of arrays returning a tuple of arrays), its sums exact:
  numpy arrays. bounds[i] is float64 of outputs[i]'s shape (inf where no bound is derived)."""
  closed = jax.make_jaxpr(fn)(*args)

  def run(*flat):
    outs = _eval(closed.jaxpr, closed.consts, [(a, None) for a in flat])
    return [v for v, _ in outs], [jnp.zeros(jnp.shape(v), jnp.float32) if e is None else e for v, e in outs]

  flat_args = jax.tree_util.tree_leaves(args)
  values, bounds = jax.jit(run)(*flat_args)
  return ([np.asarray(v) for v in values],
          [np.asarray(b, np.float64) * (1 + 2 ** -20) for b in bounds])   # the bound's own float32 roundings


# ---------------------------------------------------------------------------------------------------
# the interpreter: each equation re-bound, dots and sums replaced, bounds carried alongside
# ---------------------------------------------------------------------------------------------------

def _eval(jaxpr, consts, args):
  env = {}

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val, None
    return env[v]

  for var, c in zip(jaxpr.constvars, consts):
    env[var] = (c, None)
  for var, a in zip(jaxpr.invars, args):
    env[var] = a
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _eqn(eqn, ins)
    for var, out in zip(eqn.outvars, outs):
      env[var] = out
  return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, ins):
  name = str(eqn.primitive)
  vals, errs = [v for v, _ in ins], [e for _, e in ins]
  params = dict(eqn.params)
  if name in _CALLS and params.get(_CALLS[name]) is not None:
    sub = params[_CALLS[name]]
    closed = sub if hasattr(sub, "consts") else jex_core.ClosedJaxpr(sub, ())
    return _eval(closed.jaxpr, closed.consts, ins)
  if name == "fp4jax_scaled_matmul":   # its XLA path, inlined, so that its GEMM is a dot_general here
    local = dict(params, impl="xla")
    closed = jax.make_jaxpr(lambda *a: matmul_primitive._local(*a, platform="cpu", **local))(*vals)
    return _eval(closed.jaxpr, closed.consts, ins)
  if name == "dot_general":
    return [_dot(vals, errs, params)]
  if name == "reduce_sum":
    return [_reduce_sum(vals[0], errs[0], params)]
  outs = eqn.primitive.bind(*vals, **params)
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  if all(e is None for e in errs):
    return [(o, None) for o in outs]
  if any(_contains_sum(p) for p in params.values()):
    raise NotImplementedError(f"{name}: a sub-program with a dot or a sum that order_free does not enter")
  return list(zip(outs, _propagate(eqn, name, vals, errs, params, outs)))


def _contains_sum(p) -> bool:
  for sub in p if isinstance(p, (tuple, list)) else (p,):
    inner = getattr(sub, "jaxpr", sub)
    if hasattr(inner, "eqns"):
      for e in inner.eqns:
        if str(e.primitive) in ("dot_general", "reduce_sum") or any(_contains_sum(q) for q in e.params.values()):
          return True
  return False


# ---------------------------------------------------------------------------------------------------
# exact sums
# ---------------------------------------------------------------------------------------------------

def _np_dot(a, b, dims, out_dtype):
  (lc, rc), (lb, rb) = dims
  a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
  lf = [d for d in range(a64.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(b64.ndim) if d not in rc and d not in rb]
  shape = [a64.shape[d] for d in (*lb, *lf)] + [b64.shape[d] for d in rf]
  nb = math.prod(a64.shape[d] for d in lb)
  k = math.prod(a64.shape[d] for d in lc)
  am = a64.transpose(*lb, *lf, *lc).reshape(nb, -1, k)
  bm = b64.transpose(*rb, *rf, *rc).reshape(nb, -1, k)
  products = (am[:, :, None, :] * bm[:, None, :, :]).reshape(-1, k)   # exact in float64
  sums = np.array([math.fsum(row) for row in products], np.float64)
  return sums.reshape(shape).astype(out_dtype)


def _out_dtype(vals, params):
  return np.dtype(params.get("preferred_element_type") or jnp.result_type(*vals))


def _dot(vals, errs, params):
  a, b = vals
  dims = params["dimension_numbers"]
  out_dtype = _out_dtype(vals, params)
  shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=out_dtype), a, b)
  value = jax.pure_callback(lambda a, b: _np_dot(a, b, dims, out_dtype), shape, a, b)
  k = math.prod(a.shape[d] for d in dims[0][0])
  gamma = k * _F32_U / (1 - k * _F32_U)

  def absdot(x, y):
    return lax.dot_general(jnp.abs(x).astype(jnp.float32), jnp.abs(y).astype(jnp.float32), dims,
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

  err = gamma * absdot(a, b)
  ea, eb = errs
  if ea is not None:
    err = err + absdot(ea, jnp.abs(b.astype(jnp.float32)) + (0 if eb is None else eb))
  if eb is not None:
    err = err + absdot(a, eb)
  return value, _rounded(err, value, out_dtype)


def _reduce_sum(x, err, params):
  axes = tuple(params["axes"])
  out_dtype = np.dtype(x.dtype)
  if math.prod(x.shape[d] for d in axes) <= 1:   # one term (a broadcast's transpose): no rounding at all
    return jnp.sum(x, axis=axes), None if err is None else jnp.sum(err, axis=axes)

  def exact(x):
    x64 = np.moveaxis(np.asarray(x).astype(np.float64), axes, range(-len(axes), 0))
    lead = x64.shape[:x64.ndim - len(axes)]
    rows = x64.reshape(math.prod(lead), -1)
    return np.array([math.fsum(r) for r in rows], np.float64).reshape(lead).astype(out_dtype)

  shape = jax.eval_shape(lambda x: jnp.sum(x, axis=axes), x)
  value = jax.pure_callback(exact, shape, x)
  n = math.prod(x.shape[d] for d in axes)
  bound = n * _F32_U / (1 - n * _F32_U) * jnp.sum(jnp.abs(x.astype(jnp.float32)), axis=axes)
  if err is not None:
    bound = bound + jnp.sum(err, axis=axes)
  return value, _rounded(bound, value, out_dtype)


# ---------------------------------------------------------------------------------------------------
# the bound through the other operations
# ---------------------------------------------------------------------------------------------------

def _ulp(dtype) -> float:
  return float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else math.inf


def _rounded(err, value, dtype):
  """err widened by one rounding to ``dtype`` near ``value`` (round to nearest is monotone: two values err
  apart round to values at most err + one ulp apart)."""
  dtype = np.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    return jnp.where(err > 0, jnp.inf, 0.0).astype(jnp.float32)
  tiny = float(jnp.finfo(dtype).smallest_subnormal)
  return err + (jnp.abs(value.astype(jnp.float32)) + err) * _ulp(dtype) + tiny


def _inf_like(out):
  return jnp.full(jnp.shape(out), jnp.inf, jnp.float32)


def _zeros_like(v):
  return jnp.zeros(jnp.shape(v), jnp.float32)


def _propagate(eqn, name, vals, errs, params, outs):
  """The bounds of ``outs`` from those of the inputs (None: exact)."""
  full = [_zeros_like(v) if e is None else e for v, e in zip(vals, errs)]
  out = outs[0]
  if name in _STRUCTURAL and len(vals) == 1 or name == "dynamic_slice" and all(e is None for e in errs[1:]):
    return [eqn.primitive.bind(full[0], *vals[1:], **params)]
  if name == "gather" and errs[1] is None:   # exact indices: the same elements of the bound
    return [eqn.primitive.bind(full[0], vals[1], **params)]
  if name == "optimization_barrier":
    return list(full)
  if name == "concatenate":
    return [eqn.primitive.bind(*full, **params)]
  if name == "pad" and errs[1] is None:
    return [eqn.primitive.bind(full[0], jnp.float32(0), **params)]
  if name == "select_n" and errs[0] is None:
    return [eqn.primitive.bind(vals[0], *full[1:], **params)]
  if name in ("add", "sub"):
    return [_rounded(full[0] + full[1], out, out.dtype)]
  if name in ("max", "min"):
    return [jnp.maximum(full[0], full[1])]
  if name == "mul":
    a, b = (jnp.abs(v.astype(jnp.float32)) for v in vals)
    err = a * full[1] + full[0] * b + full[0] * full[1]
    return [_rounded(jnp.where(jnp.isnan(err), jnp.inf, err), out, out.dtype)]   # 0 * inf: no bound
  if name == "div" and errs[1] is None:
    return [_rounded(full[0] / jnp.abs(vals[1].astype(jnp.float32)), out, out.dtype)]
  if name == "convert_element_type":
    return [_rounded(full[0], out, out.dtype)]
  # fp4jax._exact's guard: a float's bits ANDed with a mask (-1, or -2 at one NaN) and cast back: the value
  # moves by at most its lowest bit, and the test for that NaN cannot flip between two finite values.
  if name == "bitcast_convert_type":
    return [full[0] if jnp.issubdtype(out.dtype, jnp.integer) else _rounded(full[0], out, out.dtype)]
  if name == "and" and jnp.issubdtype(out.dtype, jnp.integer):   # one operand exact (the mask): the other's
    return [jnp.where(full[1] == 0, full[0], jnp.where(full[0] == 0, full[1], jnp.inf))]
  if name in ("eq", "ne") and errs[1] is None and _is_nan_bits(vals[1]):
    return [jnp.where(jnp.isfinite(full[0]) & (vals[0] != vals[1]), 0.0, jnp.inf).astype(jnp.float32)]
  if name == "is_finite":   # cannot flip while the value and its bound stay below the largest finite value
    a = jnp.abs(vals[0].astype(jnp.float32))
    return [jnp.where(a + full[0] < float(jnp.finfo(vals[0].dtype).max), 0.0, jnp.inf).astype(jnp.float32)]
  return [_inf_like(o) for o in outs]


def _is_nan_bits(c) -> bool:
  """Whether c, a constant int32, is the bit pattern of a float32 NaN (with the sign bit cleared or not)."""
  try:
    c = np.asarray(c)
  except Exception:   # pylint: disable=broad-except  (a traced value: not a constant)
    return False
  return c.dtype == np.int32 and c.size == 1 and bool(np.isnan(c.reshape(()).view(np.float32)))
