"""``PreQuantized``: an activation that arrives at the quantized dot already quantized for its fprop GEMM.

Axis legend: M tokens (every leading axis of x, flattened), K the contraction (x's last axis), Kp K padded
to the recipe's K alignment.

The producer of a layer's input (RMSNorm, the MLP activation: ``fp4jax.fused``) can compute the fprop
codes in the pass that makes the input, instead of the dot quantizing it again in a pass of its own. What
it hands over is both halves of what the dot reads of x:
  x          the activation itself, (..., K) in the dot's input dtype: the backward pass quantizes it
             again for wgrad (along the tokens, after the RHT; or x̂ with ``Roles.requantize``) and the
             gradient of the dot flows into it, exactly as for a plain array;
  q          ``quantizer(x (M, Kp))``, a QTensor along K: the fprop GEMM's operand, used as it is;
  quantizer  the ``fp4jax.Quantizer`` that made q. The dot refuses a PreQuantized whose quantizer is not
             its recipe's ``fprop_x`` (a clear error names both), so the codes always mean what the
             unfused dot would have computed; the numerics are then bit-identical by construction
             (tests/test_prequantized.py pins them, forward and backward).
Only the 1D FP4 fprop quantizers (nvfp4 with or without Four Over Six, mxfp4; nearest rounding, no
transform, one tensor amax) can be pre-quantized: their zero rows are zero bytes, so the dot pads q's
rows to its M alignment without quantizing anything.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import formats
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import Quantizer
from fp4jax.recipes import as_recipe


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreQuantized:
  """x (..., K) with its fprop quantization q (M, Kp) by ``quantizer`` (module docstring)."""

  x: Any
  q: QTensor
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    return self.x.shape

  @property
  def dtype(self):
    return self.x.dtype

  @property
  def ndim(self):
    return self.x.ndim


def supported(quantizer) -> bool:
  """Whether ``quantizer`` (a recipe's fprop_x) can be pre-quantized (module docstring)."""
  return (isinstance(quantizer, Quantizer) and quantizer.fmt in formats.FP4 and not quantizer.tiled
          and not quantizer.stochastic and not quantizer.rht_size and not quantizer.row_scaled)


def _check_quantizer(quantizer):
  if not supported(quantizer):
    raise ValueError(f"cannot pre-quantize for {quantizer!r}: only 1D FP4 fprop quantizers (nvfp4, mxfp4; "
                     "nearest rounding, no transform, one tensor amax) can; pass the plain array to "
                     "fp4jax.dot and let it quantize")


def prequantize(x, recipe) -> PreQuantized:
  """x quantized for the fprop GEMM of ``recipe`` (a Recipe, preset name or Roles) as ``fp4jax.dot``
  would quantize it; hand the result to ``fp4jax.dot`` / ``dot_general`` / the Flax layers in place of
  x. The quantization runs here (XLA or the kernels, the impl switch decides), once."""
  quantizer = as_recipe(recipe).roles.fprop_x
  _check_quantizer(quantizer)
  x = jnp.asarray(x)
  align_k = as_recipe(recipe).roles.alignment()[1]
  x_MxKp = pad_to_multiple(x.reshape(-1, x.shape[-1]), 1, align_k)
  # The gradient reaches x through PreQuantized.x (the dot's backward pass); the codes have none.
  return PreQuantized(x, quantizer(lax.stop_gradient(x_MxKp)), quantizer)


def check(pre: PreQuantized, roles, dimension_numbers, rhs):
  """ValueError unless ``roles`` would quantize ``pre.x`` for fprop exactly as ``pre.q`` is, and the dot
  contracts x's last axis with no batch axes (the layout q was made for)."""
  (lc, rc), (lb, rb) = dimension_numbers
  x = pre.x
  if lb or rb or tuple(int(a) % x.ndim for a in lc) != (x.ndim - 1,) or len(rc) != 1:
    raise ValueError(f"a PreQuantized lhs is quantized along its last axis: the dot must contract lhs "
                     f"axis {x.ndim - 1} with one rhs axis and have no batch axes; got dimension_numbers "
                     f"{dimension_numbers}. Pass pre.x for other layouts")
  if roles.fprop_x != pre.quantizer:
    raise ValueError(f"the PreQuantized input was quantized by {pre.quantizer!r}, but recipe "
                     f"{roles.name!r} quantizes its fprop input with {roles.fprop_x!r}; pre-quantize with "
                     "the dot's own recipe (fp4jax.prequantize(x, recipe)) or pass pre.x")
  m = x.size // x.shape[-1]
  kp = pad_to_multiple(jnp.zeros((1, x.shape[-1]), jnp.bool_), 1, roles.alignment()[1]).shape[1]
  if pre.q.shape != (m, kp) or pre.q.fmt != pre.quantizer.fmt or pre.q.axis != -1:
    raise ValueError(f"PreQuantized.q has shape {pre.q.shape} (fmt {pre.q.fmt!r}, axis {pre.q.axis}); x "
                     f"{x.shape} needs ({m}, {kp}) along the last axis in {pre.quantizer.fmt!r}. Build it "
                     "with fp4jax.prequantize or fp4jax.fused")
  if rhs.shape[int(rc[0]) % rhs.ndim] != x.shape[-1]:
    raise ValueError(f"contracting sizes differ: x {x.shape} vs rhs {rhs.shape} (axis {rc[0]})")


def pad_rows(q: QTensor, rows: int) -> QTensor:
  """q (M, Kp) with zero rows appended up to ``rows`` (the dot's M alignment): a zero row of a 1D FP4
  quantization is zero codes and zero scale bytes whatever the tensor amax, so this is the quantization
  of the zero-padded x."""
  pad = rows - q.data.shape[0]
  if pad == 0:
    return q
  def grow(a):   # zero *bytes* (an E8M0 scale has no 0.0 to convert from)
    zeros = jnp.zeros((pad,) + a.shape[1:], jnp.uint8 if a.dtype.itemsize == 1 else a.dtype)
    return jnp.concatenate([a, lax.bitcast_convert_type(zeros, a.dtype)], axis=0)
  return dataclasses.replace(q, data=grow(q.data), scale=grow(q.scale))
