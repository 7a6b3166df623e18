"""``ModelConfig.remat``: which activations a block keeps for its backward pass, by name.

  "none"             keep everything the backward needs (no recomputation; the most memory)
  "full"             keep the block's input only; the backward re-runs the whole block forward
  "save_linear"      keep every linear layer's output (``LINEAR_OUT``): no GEMM of a linear layer is
                     re-run; the rest is: the quantize passes, norms, the conv, the SSD, attention and the
                     elementwise work

Every policy computes the same values in the same operations (a recomputation repeats the forward's), so
losses and gradients agree with "none" (tests/test_models_remat.py). ``True`` / ``False`` (the old
boolean field) mean "full" / "none".

Not offered: also keeping the FP4 operands (a policy saving the outputs of fp4jax's quantize primitives,
so that a recomputed dot re-runs no quantize pass either). Tried with
``save_from_both_policies(save_only_these_names(LINEAR_OUT), lambda prim, *_, **__: prim in (quantize_p,
quantize_rht_t_p))``: the loss and gradients came out NaN on the CPU (fp4jax.dot, nvfp4 and
nvfp4_no_rht), so the primitives' partial evaluation under a saving policy needs a look first.
"""
from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

LINEAR_OUT = "linear_out"   # the checkpoint_name of each linear layer's output (models.layers.linear)

_cp = jax.checkpoint_policies
POLICIES = {
    "none": None,
    "full": _cp.nothing_saveable,   # what jax.checkpoint without a policy saves
    "save_linear": _cp.save_only_these_names(LINEAR_OUT),
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


def tag_linear(y):
  """A linear layer's output, named for the policies that keep it (the identity otherwise)."""
  return checkpoint_name(y, LINEAR_OUT)
