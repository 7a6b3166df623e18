"""The public ops on tensors: quantize, dequantize, the RHT-transposed quantize, scaled matmul and
transpose_tiles. Validation at the boundary, then the primitive (FP4 formats) or the reference (fp8).
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp4jax import _exact, derivatives, dispatch, formats, native, primitives, random_bits
from fp4jax.numerics import hadamard, nvfp4
from fp4jax.kernels.quantize_rht_t import rht_amax
from fp4jax.qtensor import QTensor, validate
from fp4jax.reference import (dequantize_reference, quantize_reference,
                              scaled_matmul_reference)

ROUNDINGS = ("nearest", "stochastic")


FP4_OPERAND = "fp4jax_fp4_operand"   # the checkpoint_name of every quantized tensor's data, scales, amax


def _named_operand(data, scale, amax):
  """A quantized tensor's parts named ``FP4_OPERAND``, for remat policies that keep them
  (``jax.checkpoint_policies.save_only_these_names(FP4_OPERAND)``: a recomputed dot re-runs no
  quantize pass). The scales are named as their uint8 bits: jax.checkpoint passes every saved floating
  residual through ``reduce_precision(exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)`` (jax PR
  22244), whose IEEE reading of float8_e4m3fn's 4 exponent bits makes every scale above 240 infinite,
  a NaN in e4m3fn (whose top exponent holds finite values up to 448); integers are saved as they are.
  The bitcasts change no bit."""
  bits = checkpoint_name(lax.bitcast_convert_type(scale, jnp.uint8), FP4_OPERAND)
  scale = lax.bitcast_convert_type(bits, scale.dtype)
  return (checkpoint_name(data, FP4_OPERAND), scale,
          None if amax is None else checkpoint_name(amax, FP4_OPERAND))


def as_array(x, where: str, name: str = "x"):
  """jnp.asarray(x), with a one-sentence TypeError for things that are not arrays."""
  try:
    return jnp.asarray(x)
  except TypeError:
    raise TypeError(f"{where}: {name} must be an array (jax.Array, numpy array or Python number); "
                    f"got {type(x).__name__}") from None


def as_float_dtype(dtype, where: str, name: str = "dtype"):
  """jnp.dtype(dtype) of a floating type, else a one-sentence TypeError."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{where}: {name}={dtype!r} is not a floating dtype; use e.g. jnp.float32 or "
                    "jnp.bfloat16")
  return dt


def _available(dtype, where: str):
  """``dtype`` as JAX will compute it: float64 without ``jax_enable_x64`` becomes float32 with a warning, as
  ``jnp.astype`` does (a float64 result type would not match the float32 computation)."""
  canonical = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
  if canonical != dtype:
    warnings.warn(f"{where}: dtype {dtype.name} is not available with jax_enable_x64 off, so the result is "
                  f"{canonical.name} (as jnp.astype does); jax.config.update('jax_enable_x64', True) for "
                  f"{dtype.name}", UserWarning, stacklevel=3)
  return canonical


def check_key(key, where: str):
  """A single jax.random key: a typed key (jax.random.key) or a legacy uint32 key
  (jax.random.PRNGKey); None passes. Anything else is a TypeError that says how to make one."""
  if key is None:
    return
  how = "pass key=jax.random.key(seed) (or a legacy jax.random.PRNGKey(seed))"
  dtype = getattr(key, "dtype", None)
  if dtype is None or isinstance(key, (int, float, bool, np.generic)):
    raise TypeError(f"{where}: key must be a jax.random key; got {type(key).__name__} {key!r}; {how}")
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"{where}: key must be one key; got an array of keys of shape {key.shape}. "
                       "Pick one (keys[0]) or split per call yourself")
    return
  if dtype != jnp.uint32 or key.ndim != 1:
    raise TypeError(f"{where}: key has dtype {dtype} and shape {tuple(key.shape)}; a jax.random key "
                    f"is a typed key or a legacy uint32 key of shape (2,); {how}")


def _check_amax_arg(amax, x):
  """The user's nvfp4 tensor amax: a float scalar; when concrete, finite and > 0 (0 only for an
  all-zero x), or non-finite only where x itself holds an inf or NaN. Under jit its value cannot be
  checked (see fp4jax.quantize)."""
  amax = as_array(amax, "fp4jax.quantize", "amax")
  if amax.size != 1 or not (jnp.issubdtype(amax.dtype, jnp.floating)
                            or jnp.issubdtype(amax.dtype, jnp.integer)):
    raise ValueError(f"fp4jax.quantize: amax= must be one real number (the tensor amax); got shape "
                     f"{amax.shape} dtype {amax.dtype}")
  if isinstance(amax, jax.core.Tracer):
    return
  value = float(np.asarray(amax, np.float32).reshape(()))
  if not np.isfinite(value) and not isinstance(x, jax.core.Tracer) and not bool(jnp.isfinite(x).all()):
    return   # the input's own inf/NaN (fp4jax.dot passes the amax it took of x): non-finite out, as amax=None
  if not np.isfinite(value) or value < 0:
    raise ValueError(f"fp4jax.quantize: amax={value} must be finite and > 0 (max|x| over the tensor, "
                     "or a global amax across shards); pass amax=None to use max|x|")
  if value == 0 and not isinstance(x, jax.core.Tracer) and bool(jnp.any(x != 0)):
    raise ValueError("fp4jax.quantize: amax=0 with a nonzero input would dequantize every element to "
                     "0; pass the tensor amax (>= max|x|), or amax=None to use max|x|")


def _validate(x, fmt, axis, tile, rounding, key, bits, amax, scale_rule, scaling, sr_bits=random_bits.DEFAULT):
  if not isinstance(fmt, str) or fmt not in formats.NAMES:
    raise ValueError(f"unknown format fmt={fmt!r}; use one of {formats.NAMES}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"fp4jax.quantize needs a floating-point input (float32, bfloat16 or float16); "
                    f"got dtype {x.dtype}. Cast it first, e.g. x.astype(jnp.float32)")
  if x.ndim == 0:
    raise ValueError("fp4jax.quantize needs an array with at least one axis; got a scalar. "
                     "Reshape it, e.g. x.reshape(1, 1), and pad to the block")
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
    raise TypeError(f"axis={axis!r} must be an int")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for an input of shape {x.shape}")
  axis = axis % x.ndim
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding={rounding!r}; use one of {ROUNDINGS}")
  if rounding == "stochastic":
    if fmt == "fp8":
      raise ValueError("stochastic rounding is implemented for nvfp4 and mxfp4, not fp8; "
                       "use rounding='nearest'")
    if key is None and bits is None:
      raise ValueError("rounding='stochastic' needs random bits: pass key=jax.random.key(...) "
                       "(or bits=, uint8 of the input's shape)")
    if not isinstance(key, random_bits.Window):   # a Window: fp4jax.grouped's piece of an expert's draw
      check_key(key, "fp4jax.quantize")
    if bits is not None:
      if not _is_array(bits) or not jnp.issubdtype(bits.dtype, jnp.unsignedinteger):
        raise TypeError(f"bits= must be an unsigned integer array (uint8: 8 random bits per element); "
                        f"got {getattr(bits, 'dtype', type(bits).__name__)}. Use "
                        "jax.random.bits(key, x.shape, jnp.uint8)")
      if tuple(bits.shape) != tuple(x.shape):
        raise ValueError(f"bits has shape {bits.shape}; it must match the input's shape {x.shape}")
  elif bits is not None:
    raise ValueError("bits= is only used with rounding='stochastic'")
  random_bits.check_layout(sr_bits)
  if sr_bits != random_bits.DEFAULT and (rounding != "stochastic" or bits is not None):
    raise ValueError(f"sr_bits={sr_bits!r} chooses how the key makes the stochastic-rounding bits; it needs "
                     "rounding='stochastic' and key= (not bits=, which are the bits themselves)")
  if amax is not None:
    if fmt != "nvfp4":
      raise ValueError(f"amax= is the NVFP4 tensor amax; fmt={fmt!r} has no tensor-level scale")
    _check_amax_arg(amax, x)
  if scale_rule not in formats.SCALE_RULES:
    raise ValueError(f"scale_rule={scale_rule!r}; use 'rceil' (cuBLAS, the paper) or 'floor' (OCP)")
  if scaling not in ("block", "tensor"):
    raise ValueError(f"scaling={scaling!r}; use 'block' or 'tensor'")
  if scaling == "tensor":
    if fmt != "fp8":
      raise ValueError(f"scaling='tensor' is plain per-tensor FP8; fmt={fmt!r} is always block scaled")
    if tile is not None:
      raise ValueError("scaling='tensor' and tile= exclude each other")
    return axis
  if tile is not None:
    if (not isinstance(tile, (tuple, list)) or len(tile) != 2
        or not all(isinstance(t, (int, np.integer)) for t in tile)):
      raise TypeError(f"tile={tile!r} must be a pair of ints, e.g. tile={formats.TILE.get(fmt, (16, 16))}")
    tile = tuple(tile)
    if fmt not in formats.TILE:
      raise ValueError(f"fmt={fmt!r} has no 2D tiles; tile= is for "
                       + " and ".join(f"{f} {t}" for f, t in formats.TILE.items()))
    if tile != formats.TILE[fmt]:
      raise ValueError(f"tile={tile} is not supported for fmt={fmt!r}; use tile={formats.TILE[fmt]}")
    if x.ndim < 2:
      raise ValueError(f"tile={tile} quantizes the last two axes; got a 1-D input of shape {x.shape}")
    if axis < x.ndim - 2:
      raise ValueError(f"with tile= the packed axis must be one of the last two; got axis={axis}")
    for ax, t in zip((x.ndim - 2, x.ndim - 1), tile):
      if x.shape[ax] % t:
        raise ValueError(f"axis {ax} has length {x.shape[ax]}, not a multiple of the tile side {t} "
                         f"for fmt={fmt!r} tile={tile}; pad the input or use fp4jax.dot, which pads")
    if formats.TABLE[fmt].packed and x.shape[axis] % 2:
      raise ValueError(f"axis {axis} has odd length {x.shape[axis]}; two codes are packed per byte")
    return axis
  block = formats.BLOCK[fmt]
  if x.shape[axis] % block:
    raise ValueError(f"axis {axis} has length {x.shape[axis]}, not a multiple of the block {block} for "
                     f"fmt={fmt!r}; pad the input or use fp4jax.dot, which pads")
  return axis


def _is_array(v) -> bool:
  return hasattr(v, "shape") and hasattr(v, "dtype")


@jax.named_scope("fp4jax/quantize")   # the op, its amax and layout work, named in profiles
def quantize(x, fmt, *, axis=-1, tile=None, rounding="nearest", key=None, bits=None, amax=None,
             scale_rule="rceil", scaling="block", impl: str | None = None, stored: bool = False,
             sr_bits: str = random_bits.DEFAULT) -> QTensor:
  """Quantize ``x`` to ``fmt`` ("nvfp4" | "mxfp4" | "fp8").

  axis: the axis the 1D blocks run along (16 for nvfp4, 32 for mxfp4, 128 for fp8), and the axis two
    E2M1 codes are packed along. tile: (16, 16) for NVFP4 2D weight scaling (fp8: (128, 128)) over the
    last two axes. rounding: "nearest" (ties to even) or "stochastic" with ``key`` (or explicit 8-bit
    ``bits`` of the input's shape, for bit-exact comparisons; with the Pallas kernels the bits of ``key`` are
    hashed inside the kernel, ``random_bits.KeyedBits``: the same bits, none in HBM). sr_bits: how ``key``
    makes them (``random_bits.SR_BITS``): "philox", the default, one philox4x32-10 per 16 consecutive elements
    along the packed axis; "packed", one threefry2x32 per 8; or "jax", the bytes of ``jax.random.bits(key,
    x.shape, uint8)`` (docs/NUMERICS.md).
    amax: the NVFP4 tensor amax to use instead of max|x| (e.g. a global amax across shards). scale_rule:
    MXFP4 "rceil" or "floor".
    scaling: "tensor" for plain per-tensor FP8. impl: "pallas" (the Pallas kernels; interpreted on
    CPU), "xla" (the pure-JAX reference), or None = the kernel only where
    ``fp4jax.dispatch.VERIFIED_KERNELS`` records it exact and faster on a GPU, else "xla". FP4 formats run as the ``fp4jax_quantize`` primitive;
    fp8 runs the reference directly. stored: quantize x as its dtype stores it (``fp4jax._exact.stored``), even
    where XLA fuses x's float32 producer and would keep more precision (fp4jax.dot's quantizers set it): the
    amax and the XLA path read x through it, a compiled kernel reads x from memory, stored already.
  NaN: an NVFP4 tensor with a NaN has a NaN amax, so all its scales are NaN and it dequantizes to NaN;
    an MXFP4 block with a NaN gets the NaN scale byte 0xFF; fp8 stores NaN and ±inf as E4M3's NaN.
  amax=: checked (finite, > 0; 0 only for an all-zero x; inf or NaN only for an x holding one) when its
    value is known; under jit it is not, and a traced amax below max|x| saturates the larger elements
    at about ±amax.
  A zero-size input gives a zero-size QTensor (nvfp4 amax 0). docs/NUMERICS.md has the arithmetic.
  """
  x = as_array(x, "fp4jax.quantize")
  axis = _validate(x, fmt, axis, tile, rounding, key, bits, amax, scale_rule, scaling, sr_bits)
  x = derivatives.refuse_tangents(x, derivatives.QUANTIZE_MESSAGE.format(where="fp4jax.quantize"))
  kernel_path = fmt in formats.KERNEL_FORMATS and x.size > 0   # zero-size: no kernel launch
  op = "quantize_2d" if tile is not None else "quantize_1d"
  impl = dispatch.choose(op, fmt, impl) if kernel_path or impl is not None else "xla"   # none to prove
  # The primitive quantizes (and packs) along the last axis: move the axis there and back. For 16x16
  # tiles packed along axis -2 that is the tile quantization of the transpose, transposed back.
  last = x.ndim - 1
  src = axis if tile is None else (last - 1 if axis == last - 1 else last)
  keyed = None
  if rounding == "stochastic" and bits is None:
    if kernel_path and impl == "pallas":   # the kernel hashes its own bits: none in HBM
      keyed = random_bits.KeyedBits.of(key, x.shape, src, sr_bits)
    if keyed is None:
      bits = random_bits.rounding_bits(key, x.shape, src, sr_bits)
  if not kernel_path:
    return quantize_reference(_exact.stored(x) if stored else x, fmt, axis=axis, tile=tile, bits=bits,
                              amax=amax, scale_rule=scale_rule, scaling=scaling)
  amax_g = None
  if fmt == "nvfp4":
    amax_g = (nvfp4.tensor_amax(_exact.stored(x) if stored else x) if amax is None
              else jnp.asarray(amax, jnp.float32).reshape(()))
  prim_amax = jnp.zeros((), jnp.float32) if amax_g is None else amax_g
  x_l = jnp.moveaxis(x, src, -1)
  bits_l = keyed if bits is None else jnp.moveaxis(bits, src, -1)
  data, scale = primitives.quantize_last(x_l, prim_amax, bits_l, fmt=fmt, tiled=tile is not None,
                                         scale_rule=scale_rule, impl=impl, stored=stored)
  data, scale = jnp.moveaxis(data, -1, src), jnp.moveaxis(scale, -1, src)
  data, scale, amax_g = _named_operand(data, scale, amax_g)
  block = None if tile is not None else formats.BLOCK[fmt]
  return QTensor(data, scale, amax_g, fmt, axis - x.ndim, block,
                 None if tile is None else tuple(tile), x.dtype,
                 scale_rule if fmt == "mxfp4" else None)


@jax.named_scope("fp4jax/dequantize")   # the op, its amax and layout work, named in profiles
def dequantize(q: QTensor, dtype=jnp.float32, *, impl: str | None = None):
  """The values ``q`` represents, in the original shape, as ``dtype``.

  FP4 formats run as the ``fp4jax_dequantize`` primitive (both impls lower to the XLA reference,
  which fuses into its consumers); fp8 runs the reference directly.
  """
  validate(q, "fp4jax.dequantize")
  dtype = _available(as_float_dtype(dtype, "fp4jax.dequantize"), "fp4jax.dequantize")
  impl = dispatch.choose("dequantize", q.fmt, impl)
  if q.fmt not in formats.KERNEL_FORMATS or q.bound != formats.NVFP4_BOUND or q.data.size == 0:
    return dequantize_reference(q, dtype)
  nd = q.data.ndim
  axis = q.axis % nd
  src = axis if q.tile is None else (nd - 2 if axis == nd - 2 else nd - 1)
  data, scale = jnp.moveaxis(q.data, src, -1), jnp.moveaxis(q.scale, src, -1)
  out = primitives.dequantize_last(data, scale, q.amax, fmt=q.fmt, tiled=q.tile is not None,
                                   dtype=dtype, impl=impl)
  return jnp.moveaxis(out, -1, src)


def fake_quantize(x, fmt, *, dtype=None, **kwargs):
  """``dequantize(quantize(x, fmt, **kwargs), dtype)`` (dtype: x's by default), differentiable with the
  straight-through estimator: d fake_quantize(x)/dx = I, so the gradient dx is dy (cast to x's dtype),
  for every element, saturated ones included. The value is bit-identical to the round trip. ``kwargs``: those
  of ``quantize`` (axis, tile, rounding, key, bits, amax, scale_rule, scaling, impl, sr_bits). It is
  linear in its derivative, so every order and mode of differentiation is defined (the second is zero).
  (``quantize`` itself has no derivative: docs/NUMERICS.md, "Derivatives".)"""
  x = as_array(x, "fp4jax.fake_quantize")
  dtype = x.dtype if dtype is None else dtype
  y = dequantize(quantize(lax.stop_gradient(x), fmt, **kwargs), dtype)
  return derivatives.straight_through(x, y)


@jax.named_scope("fp4jax/quantize_rht_t")   # the op, its amax and layout work, named in profiles
def quantize_rht_transposed(x, fmt, *, rht_size=16, rht_seed=None, rounding="nearest", key=None,
                            bits=None, amax=None, scale_rule="rceil", impl: str | None = None,
                            stored: bool = False, sr_bits: str = random_bits.DEFAULT) -> QTensor:
  """The weight-gradient operand path: x (T, C) -> RHT(xᵀ) (C, T) quantized along T (the last axis).

  Reads x transposed, applies the random Hadamard transform of ``rht_size`` along the token axis T
  (in float32), and quantizes the result in 1D blocks along T. ``bits`` (stochastic rounding) have
  the output's shape (C, T). T must be a multiple of both ``rht_size`` and the format's block.
  Runs as the ``fp4jax_quantize_rht_t`` primitive (one fused kernel with impl="pallas"; with "xla" for
  nvfp4, ``kernels.quantize_rht_t.quantize_rht_t_rows``, the reference's bits in a form XLA fuses); the
  tensor amax after the transform is a separate one-pass reduction before it (``rht_amax``), unless
  ``amax`` (nvfp4) gives it: max |RHT(x)|, from a pass that reads x anyway (``rht_amaxes``: fp4jax.dot's
  fprop and dgrad quantizes), so that this pass reads x once. impl, stored, sr_bits: as for ``quantize`` (the
  grouped layouts' groups of 8 or 16 run along T, in the output's (C, T) orientation).
  """
  x = as_array(x, "fp4jax.api.quantize_rht_transposed")
  if x.ndim != 2:
    raise ValueError(f"quantize_rht_transposed takes a 2-D (tokens, channels) input; got shape {x.shape}")
  if fmt == "fp8":
    raise ValueError("the RHT weight-gradient path is for nvfp4 and mxfp4")
  if x.shape[0] % rht_size:
    raise ValueError(f"token axis length {x.shape[0]} is not a multiple of rht_size={rht_size}; pad it")
  _validate(x.T, fmt, -1, None, rounding, key, bits, amax, scale_rule, "block", sr_bits)
  x = derivatives.refuse_tangents(x, derivatives.QUANTIZE_MESSAGE.format(where="quantize_rht_transposed"))
  impl = dispatch.choose("quantize_rht_t", fmt, impl)
  if rounding == "stochastic" and bits is None:
    # With the kernel, its own bits (hashed from the key, none in HBM); else drawn here.
    bits = random_bits.KeyedBits.of(key, x.T.shape, -1, sr_bits) if impl == "pallas" else None
    if bits is None:
      bits = random_bits.rounding_bits(key, x.T.shape, -1, sr_bits)
  hadamard.signs(rht_size, rht_seed)   # validates rht_size
  if fmt == "nvfp4":
    amax = (jnp.asarray(amax, jnp.float32).reshape(()) if amax is not None else
            rht_amax(_exact.stored(x) if stored else x, rht_size=rht_size, rht_seed=rht_seed, one_pass=True))
  data, scale = primitives.quantize_rht_t(
      x, jnp.zeros((), jnp.float32) if amax is None else amax, bits, fmt=fmt, rht_size=rht_size,
      rht_seed=rht_seed, scale_rule=scale_rule, impl=impl, stored=stored)
  data, scale, amax = _named_operand(data, scale, amax)
  return QTensor(data, scale, amax, fmt, -1, formats.BLOCK[fmt], None, jnp.dtype(jnp.float32),
                 scale_rule if fmt == "mxfp4" else None)


def check_dot_inputs(lhs, rhs, dimension_numbers, preferred_element_type, key, quantized: bool):
  """lhs, rhs as arrays, after the checks ``fp4jax.dot_general`` needs: arrays (floating when
  ``quantized``), dimension numbers that fit them, a floating output dtype, and a valid key."""
  where = "fp4jax.dot_general"
  lhs, rhs = as_array(lhs, where, "lhs"), as_array(rhs, where, "rhs")
  if quantized:
    for name, v in (("lhs", lhs), ("rhs", rhs)):
      if not jnp.issubdtype(v.dtype, jnp.floating):
        raise TypeError(f"{where}: {name} has dtype {v.dtype}; a quantized recipe needs floating "
                        f"inputs (float32, bfloat16, float16). Cast it, e.g. {name}.astype(jnp.float32)")
    if preferred_element_type is not None:
      as_float_dtype(preferred_element_type, where, "preferred_element_type")
  try:
    jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), lhs, rhs)
  except (TypeError, ValueError) as e:   # keep lax's exception type (TypeError for shapes)
    raise type(e)(f"{where}: dimension_numbers={dimension_numbers!r} do not fit lhs of shape "
                  f"{lhs.shape} and rhs of shape {rhs.shape} ({e})") from None
  check_key(key, where)
  return lhs, rhs


def check_operands(a: QTensor, b: QTensor):
  if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
    raise TypeError("scaled_matmul takes two QTensors from fp4jax.quantize; got "
                    f"{type(a).__name__} and {type(b).__name__}")
  validate(a, "fp4jax.scaled_matmul (lhs)", scalar_amax=True)
  validate(b, "fp4jax.scaled_matmul (rhs)", scalar_amax=True)
  if a.fmt != b.fmt:
    raise ValueError(f"scaled_matmul operands must share a format; got {a.fmt!r} and {b.fmt!r}")
  if a.axis != -1 or b.axis != -1:
    raise ValueError("scaled_matmul contracts the last axis of both operands; quantize them with axis=-1 "
                     f"(got axis {a.axis} and {b.axis})")
  if len(b.shape) != 2:
    raise ValueError(f"the right operand must be 2-D (N, K); got shape {b.shape}")
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f"contraction lengths differ: lhs K={a.shape[-1]}, rhs K={b.shape[-1]}")


@jax.named_scope("fp4jax/scaled_matmul")   # the op, its amax and layout work, named in profiles
def scaled_matmul(a: QTensor, b: QTensor, *, out_dtype=jnp.float32, impl: str | None = None):
  """a (..., M, K) · b (N, K)ᵀ -> (..., M, N) in ``out_dtype``, from quantized operands.

  FP4 operands run as the ``fp4jax_scaled_matmul`` primitive. impl (``fp4jax.dispatch``): "pallas" (a
  Pallas GEMM; interpreted on CPU), "xla" (the exact dequantize-then-bf16-GEMM), "native" (the block-scaled
  GEMM of ``fp4jax.native``: nvfp4), or None: ``dispatch.choose("scaled_matmul", fmt)``, the native GEMM on
  compute capability 10.x, a kernel only with evidence, else "xla". fp8 operands run the reference.
  """
  check_operands(a, b)
  out_dtype = as_float_dtype(out_dtype, "fp4jax.scaled_matmul", "out_dtype")
  # the native GEMM takes 2-D operands: a (..., M, K) lhs defaults to the primitive (an explicit "native"
  # gets native.check's error)
  impl = dispatch.choose("scaled_matmul", a.fmt, impl, native_ok=a.ndim == b.ndim == 2)
  if impl == "native":
    return native.matmul(a, b, out_dtype=out_dtype)
  if a.fmt not in formats.KERNEL_FORMATS:
    return scaled_matmul_reference(a, b, out_dtype)
  return primitives.fp4_matmul(a, b, out_dtype=out_dtype, impl=impl)


def transpose_packed(data_RxC2):
  """The E2M1 codes of a (R, C) matrix packed along C (``e2m1.pack``: (R, C/2) bytes) -> those of its transpose
  packed along R ((C, R/2)), ``e2m1.pack(e2m1.unpack(data).T)`` from the packed bytes in one pass: row 2j of the
  result takes the low nibbles of byte column j (columns 2j of the input), row 2j + 1 the high ones, two rows of
  the input to a byte. The bytes are transposed first and everything after is computed in the result's own
  order, so XLA fuses it into one pass that reads the input transposed and writes the result row-major, the
  layout the GEMM reads (a transpose left last, XLA makes it a layout change and the GEMM's operand pays a
  transpose pass of its own)."""
  r, c2 = data_RxC2.shape
  if r % 2:
    raise ValueError(f"transpose_packed: {r} rows; packing the transpose along them needs an even count")
  t = data_RxC2.T.reshape(c2, r // 2, 2)                     # byte column j, rows 2i and 2i + 1
  pair = lambda n: n[..., 0] | (n[..., 1] << 4)              # two rows' nibbles, the even row low
  low, high = pair(t & 0xF), pair(t >> 4)                    # result rows 2j and 2j + 1: (C/2, R/2)
  return jnp.stack([low, high], axis=1).reshape(2 * c2, r // 2)


def transpose_tiles(q: QTensor) -> QTensor:
  """The 2D-tiled QTensor of the transposed matrix, from codes and scales alone (no requantization).

  With square tiles (nvfp4 16x16, fp8 128x128) the quantization of Wᵀ is exactly the transpose of W's
  codes and scales (spec §2), so the dgrad GEMM reuses the fprop weight. The result is packed (nvfp4)
  along its last axis.
  """
  validate(q, "fp4jax.transpose_tiles", scalar_amax=True)
  if q.tile is None or len(q.shape) != 2:
    raise ValueError("transpose_tiles needs a 2-D QTensor quantized with tile= (nvfp4 (16, 16) or "
                     "fp8 (128, 128))")
  if q.fmt == "nvfp4":
    data = transpose_packed(q.data)
  elif q.fmt == "fp8":
    data = q.data.T
  else:
    raise ValueError(f"transpose_tiles supports nvfp4 and fp8 tiles; got fmt={q.fmt!r}")
  return dataclasses.replace(q, data=data, scale=q.scale.T, axis=-1)
