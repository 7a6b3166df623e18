"""Flax glue: quantized ``dot_general`` modules for linen and NNX layers.

linen:
    dense = nn.Dense(features, dot_general_cls=fp4jax.flax.dot_general_cls("nvfp4"))
    y, grads = ..., model.apply(variables, x, rngs={"fp4": key})      # key for stochastic rounding
NNX:
    dense = nnx.Linear(d_in, d_out, dot_general=Fp4DotGeneralNNX("nvfp4", rngs=rngs), rngs=rngs)

Both hand the call on to ``fp4jax.dot_general`` with random bits from the rng stream "fp4", drawn
only when the recipe rounds gradients stochastically. Without the stream the forward pass still runs
(evaluation needs no random bits); taking the gradient then raises an error that says how to add it.
In linen each module instance (call site) derives its own key from the stream, and ``nn.scan``
over layers needs ``split_rngs={"fp4": True}`` to give each layer its own bits.

NNX keeps the key's state in the layer (an RNG count that each call advances): eagerly and under NNX
transforms (``nnx.jit``, ``nnx.grad``, ...) the count is written back, so every step draws new bits. A plain
JAX transform (``jax.jit`` of a function taking the model, or of ``nnx.merge``) traces the count and drops its
update unless the function returns the model's state: each call would draw the same bits. Where a gradient is
traced under such a transform, ``Fp4DotGeneralNNX`` warns once (``RngStateWarning``) naming the fix.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from fp4jax import _flax_compat
from fp4jax.dot import PREQUANTIZED, QuantizedWeight, dot_general, needs_key
from fp4jax.prequantized import PreQuantized
from fp4jax.recipes import Recipe, as_recipe

RNG_STREAM = "fp4"


class Fp4DotGeneral(nn.Module):
  """A linen ``dot_general`` with fp4jax quantization; use as ``dot_general_cls`` of Dense layers.

  recipe: an ``fp4jax.Recipe`` or a preset name ("nvfp4", "mxfp4", "fp8", "bf16", ...).
  rng_stream: the Flax rng collection random bits come from.
  """

  recipe: Recipe | str = "nvfp4"
  rng_stream: str = RNG_STREAM

  @nn.nowrap
  def _key(self, recipe):
    if needs_key(recipe) and self.has_rng(self.rng_stream):
      return self.make_rng(self.rng_stream)
    return None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None, rhs_codes=None):
    """``rhs_codes``: rhs's fprop QTensor made ahead (``fp4jax.quantize_weight(rhs, recipe).q``), or None."""
    recipe = as_recipe(self.recipe)
    if rhs_codes is not None:
      rhs = QuantizedWeight(rhs, rhs_codes, recipe)
    return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                       recipe=recipe, key=self._key(recipe), out_sharding=out_sharding)


class Dense(nn.Dense):
  """``nn.Dense`` that also takes an ``fp4jax.PreQuantized`` input (``fp4jax.fused``: a producer that
  quantized its output for this layer) and hands it to its ``Fp4DotGeneral`` unquantized-again. The same
  parameters, names and rng streams as ``nn.Dense``; a plain array input is exactly ``nn.Dense``.
  A PreQuantized input needs ``dot_general_cls`` an ``Fp4DotGeneral`` of the recipe it was quantized for
  (fp4jax.dot refuses another), no bias, and ``dtype`` that of its x.

  Where the ``PREQUANTIZED`` collection holds this layer's "kernel" (the fprop codes of its kernel as the layer
  computes with it, made ahead: ``fp4jax.quantize_weight``), the dot reads them instead of quantizing the
  kernel, bit for bit the same, and the kernel still receives its gradient."""

  @nn.compact
  def __call__(self, inputs):
    codes = self.get_variable(PREQUANTIZED, "kernel") if self.has_variable(PREQUANTIZED, "kernel") else None
    if not isinstance(inputs, PreQuantized):
      return super().__call__(inputs) if codes is None else self._with_codes(inputs, codes)
    if self.dot_general_cls is None or self.use_bias:
      raise ValueError("a PreQuantized input needs dot_general_cls=fp4jax.flax.dot_general_cls(recipe) "
                       "and use_bias=False; pass pre.x to this layer instead")
    if self.dtype is not None and inputs.dtype != self.dtype:
      raise ValueError(f"PreQuantized x is {inputs.dtype}, the layer computes in {self.dtype}; make the "
                       "producer return the layer's dtype or pass pre.x")
    kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype)
    kernel = kernel.astype(inputs.dtype)
    return self.dot_general_cls()(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                                  precision=self.precision, rhs_codes=codes)

  def _with_codes(self, inputs, codes):
    """``nn.Dense``'s computation with the kernel's codes made ahead (inside the compact ``__call__``)."""
    if self.dot_general_cls is None:
      raise ValueError(f"the {PREQUANTIZED!r} collection holds codes for {self.name!r}, whose dot is not "
                       "quantized; pass dot_general_cls=fp4jax.flax.dot_general_cls(recipe), or leave its codes out")
    kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = self.dot_general_cls()(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision,
                               rhs_codes=codes)
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def dot_general_cls(recipe: Recipe | str, rng_stream: str = RNG_STREAM):
  """``functools.partial(Fp4DotGeneral, recipe=...)`` for ``nn.Dense(..., dot_general_cls=...)``."""
  return functools.partial(Fp4DotGeneral, recipe=as_recipe(recipe), rng_stream=rng_stream)


class RngStateWarning(UserWarning):
  """A stochastic-rounding key drawn from NNX RNG state that a plain JAX transform will not write back."""


RNG_STATE_MESSAGE = (
    "fp4jax.flax.Fp4DotGeneralNNX draws its stochastic-rounding key from the layer's RNG count, and a plain JAX "
    "transform (jax.jit of a function taking the model, or of nnx.merge) traces that count without writing it "
    "back: unless the function returns the model's state, every call draws the same key and stochastic rounding "
    "repeats its bits each step. Use nnx.jit (it writes the count back), or return nnx.state(model) from the "
    "jitted function and nnx.update(model, state) after each call; if you already do, silence this with "
    "warnings.filterwarnings('ignore', category=fp4jax.flax.RngStateWarning)")
_warned_rng_state = False


def _differentiated(*arrays) -> bool:
  """Whether a gradient is being traced through one of ``arrays`` (the key is only used by the backward pass)."""
  return any(isinstance(a, jax.core.Tracer) and type(a).__module__.endswith("interpreters.ad") for a in arrays)


def _warn_if_not_written_back(rngs: nnx.RngStream, lhs, rhs) -> None:
  global _warned_rng_state
  if not _warned_rng_state and _differentiated(lhs, rhs) and not _flax_compat.written_back(rngs.count):
    _warned_rng_state = True
    warnings.warn(RNG_STATE_MESSAGE, RngStateWarning, stacklevel=4)


class Fp4DotGeneralNNX(nnx.Module):
  """The NNX equivalent: pass an instance as ``nnx.Linear(..., dot_general=...)``.

  rngs: an ``nnx.Rngs`` (its "fp4" stream, else its default stream, is forked) or an
    ``nnx.RngStream``; None gives no random bits (fine for recipes without stochastic rounding).
  Each call draws a new key and advances the layer's RNG count: run it under NNX transforms, or return the
  model's state from a plain ``jax.jit`` (see the module docstring; ``RngStateWarning`` otherwise).
  """

  def __init__(self, recipe: Recipe | str = "nvfp4", *, rngs: nnx.Rngs | nnx.RngStream | None = None,
               rng_stream: str = RNG_STREAM):
    self.recipe = as_recipe(recipe)
    self.rng_stream = rng_stream
    if isinstance(rngs, nnx.Rngs):
      self.rngs = rngs[rng_stream].fork()
    elif isinstance(rngs, nnx.RngStream):
      self.rngs = rngs.fork()
    elif rngs is None:
      self.rngs = nnx.data(None)
    else:
      raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None; got {type(rngs).__name__}")

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None) -> Any:
    key = None
    if needs_key(self.recipe) and self.rngs is not None:
      _warn_if_not_written_back(self.rngs, lhs, rhs)
      key = self.rngs()
    return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                       recipe=self.recipe, key=key, out_sharding=out_sharding)
