"""``ModelConfig.remat``: which activations a block keeps for its backward pass, by name.

  "none"             keep everything the backward needs (no recomputation; the most memory)
  "full"             keep the block's input only; the backward re-runs the whole block forward
  "save_linear"      keep every linear layer's output (``LINEAR_OUT``): no GEMM of a linear layer is
                     re-run; the rest is: the quantize passes, norms, the conv, the SSD, attention and the
                     elementwise work
  "save_linear_fp4"  also keep the FP4 operands that fp4jax.dot keeps for its backward pass (every
                     quantized tensor's codes, scales and amax, ``fp4jax.FP4_OPERAND``): a recomputed
                     block re-runs neither a linear GEMM nor a quantize pass; the rest as save_linear

Every policy computes the same values in the same operations (a recomputation repeats the forward's), so
losses and gradients agree with "none" (tests/test_models_remat.py). ``True`` / ``False`` (the old
boolean field) mean "full" / "none".

The SSD scan (``ssd_chunked``) rematerializes each chunk by itself only where the block is not
rematerialized (``ssd_chunk_remat``): inside a remat'd block the block's policy decides, and the scan's
forward runs twice (forward, recomputation), not three times.

"save_linear_fp4" first gave NaN: jax.checkpoint rounds every saved floating residual with
``reduce_precision`` at its dtype's finfo, which reads float8_e4m3fn's scales as IEEE e4m3 (largest
finite 240): the tile holding the tensor's amax (scale 448) became NaN. fp4jax names the scales as their
uint8 bits (``fp4jax.api._named_operand``), which are saved unchanged.
"""
from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

import fp4jax

LINEAR_OUT = "linear_out"   # the checkpoint_name of each linear layer's output (models.layers.linear)

_cp = jax.checkpoint_policies
POLICIES = {
    "none": None,
    "full": _cp.nothing_saveable,   # what jax.checkpoint without a policy saves
    "save_linear": _cp.save_only_these_names(LINEAR_OUT),
    "save_linear_fp4": _cp.save_only_these_names(LINEAR_OUT, fp4jax.FP4_OPERAND),
}


def normalize(remat) -> str:
  """The policy's name: ``True`` -> "full", ``False`` -> "none", a name checked against POLICIES."""
  if remat is True or remat is False:
    return "full" if remat else "none"
  if remat not in POLICIES:
    raise ValueError(f"remat={remat!r} is not a remat policy; use one of {sorted(POLICIES)} "
                     "(or True / False for 'full' / 'none')")
  return remat


def block_class(block_cls, remat: str):
  """``block_cls`` rematerialized under the policy ``remat`` ("none": unchanged; "full": flax's plain
  ``nn.remat``, as the boolean field had it)."""
  if remat == "none":
    return block_cls
  if remat == "full":
    return nn.remat(block_cls)
  return nn.remat(block_cls, policy=POLICIES[remat])


def ssd_chunk_remat(remat: str) -> bool:
  """Whether ``ssd_chunked`` checkpoints its chunks itself: only in a block that is not rematerialized."""
  return remat == "none"


def tag_linear(y):
  """A linear layer's output, named for the policies that keep it (the identity otherwise)."""
  return checkpoint_name(y, LINEAR_OUT)
