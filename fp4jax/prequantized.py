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
             (tests/test_prequantized.py pins them, forward and backward);
  amax_t     the tensor amax of the wgrad's quantize of x (RHT along the tokens) by ``wgrad_x``, read in the
             producer's amax pass together with q's (``amaxes``), or None: the dot's wgrad quantize of x
             then needs no read of x for its amax (docs/DESIGN.md, "The wgrad's RHT quantize reads its
             operand once"). The dot uses it only where its recipe's ``wgrad_x`` is ``wgrad_x``
             (``wgrad_amax``), and else reads the amax itself, as for a plain array.
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
from fp4jax.quantizers import Quantizer, shared_amaxes
from fp4jax.recipes import as_recipe


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreQuantized:
  """x (..., K) with its fprop quantization q (M, Kp) by ``quantizer``, and the amax ``amax_t`` of its wgrad
  quantize by ``wgrad_x`` (both None where the producer carries none; module docstring)."""

  x: Any
  q: QTensor
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))
  amax_t: Any = None
  wgrad_x: Quantizer | None = dataclasses.field(default=None, metadata=dict(static=True))

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


def carried_wgrad(roles) -> Quantizer | None:
  """``roles.wgrad_x`` where the dot quantizes x itself (not x̂: no ``Roles.requantize``) and its amax may
  come with a PreQuantized x; None where the dot's wgrad reads no tensor amax of x a producer could carry."""
  wgrad_x = roles.wgrad_x
  if roles.requantize or not isinstance(wgrad_x, Quantizer) or not wgrad_x.rht_size:
    return None
  return wgrad_x


def amaxes(x_MxK, quantizer, wgrad_x):
  """(amax of ``quantizer(x)``, amax of ``wgrad_x.quantize_t(x)``) from one read of x (M, K), each bit for bit
  what the quantizer takes itself, where the dot shares them for a plain x (``quantizers.shared_amaxes``);
  else (None, None). x's rows are zero-padded to whole RHT chunks, as the dot pads them (zero rows change
  neither amax). ``wgrad_x``: ``carried_wgrad(roles)``."""
  if wgrad_x is None:
    return None, None
  return shared_amaxes(quantizer, wgrad_x, pad_to_multiple(x_MxK, 0, wgrad_x.rht_size))


def handover(x, q, quantizer, amax_t, wgrad_x) -> PreQuantized:
  """The PreQuantized of a producer: ``wgrad_x`` kept only with an amax it made (``amaxes``)."""
  return PreQuantized(x, q, quantizer, amax_t, None if amax_t is None else wgrad_x)


def wgrad_amax(pre: PreQuantized, roles):
  """``pre.amax_t`` where ``roles``' wgrad quantizes x as the producer assumed (``carried_wgrad(roles)`` is
  ``pre.wgrad_x``), else None: the dot then reads x's wgrad amax itself."""
  if pre.amax_t is None or carried_wgrad(roles) != pre.wgrad_x:
    return None
  return pre.amax_t


def prequantize(x, recipe) -> PreQuantized:
  """x quantized for the fprop GEMM of ``recipe`` (a Recipe, preset name or Roles) as ``fp4jax.dot``
  would quantize it; hand the result to ``fp4jax.dot`` / ``dot_general`` / the Flax layers in place of
  x. The quantization runs here (XLA or the kernels, the impl switch decides), once, and its amax pass
  also reads the amax of the recipe's wgrad quantize of x where the dot would share it (``amaxes``)."""
  roles = as_recipe(recipe).roles
  quantizer = roles.fprop_x
  _check_quantizer(quantizer)
  x = jnp.asarray(x)
  # The gradient reaches x through PreQuantized.x (the dot's backward pass); the codes and amaxes have none.
  x_MxKp = lax.stop_gradient(pad_to_multiple(x.reshape(-1, x.shape[-1]), 1, roles.alignment()[1]))
  wgrad_x = carried_wgrad(roles)
  with jax.named_scope("fp4jax/quantize"):   # in place of the quantize's own amax reduction
    amax, amax_t = amaxes(x_MxKp, quantizer, wgrad_x)
  return handover(x, quantizer(x_MxKp, amax=amax), quantizer, amax_t, wgrad_x)


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
