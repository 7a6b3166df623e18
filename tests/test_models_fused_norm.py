"""The model's producers hand their quantized layers pre-quantized inputs (fp4jax.PreQuantized): each block's
norm quantizes for the mixer's input layer (MLP up (and gate), Mamba in_proj, attention qkv), the MLP's
activation for the down projection (``ModelConfig.fused_producers``, on by default).

Default path (no kernel chosen): the norm is the model's own and ``fp4jax.prequantize`` quantizes it, relu²
runs fp4jax.fused's XLA twin: loss and gradients equal the unfused model's (``fused_producers=False``) bit for
bit, and the fprop quantizes of those layers' inputs leave the dots. With the kernels chosen (here by patching
the impl switch, as a proved device verdict would), the norm and relu² run as kernels: a loss and gradients
within the norm's reduction order of the unfused model (the quantization itself is bit-identical:
tests/test_fused.py)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.shrunken import SHRUNKEN_MODEL
from fp4jax import dispatch, fused
from models import LanguageModel, get_model_config

SHRUNKEN = get_model_config("tiny", **dict(SHRUNKEN_MODEL, chunk_size=8))   # one Mamba, attention, MLP block
FPROP_X = "fprop/fp4jax/quantize/nvfp4_1x16"   # a dot quantizing its own input (its weight: nvfp4_16x16)


def _model_step(config, recipe="nvfp4", abstract=False):
  """The jitted loss-and-gradients step and its parameters (with ``abstract``, their shapes: enough to lower)."""
  model = LanguageModel(config, recipe=recipe)
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
  init = jax.eval_shape if abstract else lambda f, *a: jax.jit(f)(*a)
  params = init(model.init, {"params": jax.random.key(0)}, tokens)["params"]

  def loss(params):
    return model.apply({"params": params}, tokens[:, :-1], targets_BxL=tokens[:, 1:],
                       rngs={"fp4": jax.random.key(5)})
  step = jax.jit(jax.value_and_grad(loss))
  return step, params


def _lowered(config, recipe="nvfp4", abstract=True):
  """(the lowered step and its parameters, the layers whose dot quantizes its own input, the fused kernels'
  count)."""
  step, params = _model_step(config, recipe, abstract)
  lowered = step.lower(params)
  text = lowered.as_text(debug_info=True)
  kernels = len(re.findall("fp4jax_(?:rmsnorm|relu2)_quantize", text))
  layers = set(re.findall(rf"(blocks_\d+/mixer/[^\"]*?)/Fp4DotGeneral_0/fp4jax/dot/{FPROP_X}", text))
  return (lowered, params), layers, kernels


def _run(config, recipe="nvfp4"):
  """(loss and gradients, the layers whose dot quantizes its own input, the fused kernels' count)."""
  (lowered, params), layers, kernels = _lowered(config, recipe, abstract=False)
  return lowered.compile()(params), layers, kernels


def _equal(a, b) -> bool:
  return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _check_layers(config, fused_quantizes, plain_quantizes, kernels):
  # Mamba in_proj, attention qkv, MLP up (and gate) and down take their codes from the producer; Mamba's
  # out_proj (after the gated norm) and attention's output projection still quantize their own input.
  assert {re.sub(r"/.*/", "/", p) for p in fused_quantizes} == {"blocks_0/out_proj", "blocks_1/out"}, fused_quantizes
  assert len(plain_quantizes) == (7 if config.mlp_kind == "swiglu" else 6), plain_quantizes
  assert kernels == 0   # no kernel is chosen on the default path


def test_producers_hand_their_layers_the_codes():
  """The default suite's cheap form of the test below (the lowered programs only, nothing compiled): which
  layers still quantize their own input with the producers on and off."""
  _, fused_quantizes, kernels = _lowered(SHRUNKEN)
  _, plain_quantizes, _ = _lowered(dataclasses.replace(SHRUNKEN, fused_producers=False))
  _check_layers(SHRUNKEN, fused_quantizes, plain_quantizes, kernels)


# Slow: two compiles of the model's step (~70 s of CPU); by default test_producers_hand_their_layers_the_codes
# (the routing), tests/test_prequantized.py (the pre-quantized dot's values and gradients bit-identical) and
# tests/test_fused.py (the producers' twins equal the unfused path).
@pytest.mark.slow
@pytest.mark.parametrize("config", [
    pytest.param(SHRUNKEN, id="relu2_f32"),
    pytest.param(dataclasses.replace(SHRUNKEN, mlp_kind="swiglu", dtype=jnp.bfloat16), id="swiglu_bf16")])
def test_producers_pre_quantize_with_the_unfused_bits(config):
  fused_out, fused_quantizes, kernels = _run(config)
  plain_out, plain_quantizes, _ = _run(dataclasses.replace(config, fused_producers=False))
  assert _equal(fused_out, plain_out), "the pre-quantized model's loss or gradients differ from the unfused model's"
  _check_layers(config, fused_quantizes, plain_quantizes, kernels)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "quartet2"])
def test_recipes_that_cannot_pre_quantize_are_unchanged(recipe):
  # MXFP8 (no FP4) and Quartet II (RHT'd fprop input): their dots quantize their own inputs, as before
  out, quantizes, _ = _run(SHRUNKEN, recipe)
  plain, plain_quantizes, _ = _run(dataclasses.replace(SHRUNKEN, fused_producers=False), recipe)
  assert _equal(out, plain) and quantizes == plain_quantizes


@pytest.mark.slow   # ~2 min; tests/test_fused.py checks each kernel against the unfused path by default
def test_kernels_chosen_fuse_the_norms_and_activation(monkeypatch):
  config = get_model_config("tiny", chunk_size=8, dtype=jnp.bfloat16)   # the kernels take bf16 activations
  base, _, _ = _run(dataclasses.replace(config, fused_producers=False))
  real = dispatch.choose
  monkeypatch.setattr(dispatch, "choose", lambda op, fmt, impl=None, **kw: "pallas" if impl is None and op in (
      fused.OP, fused.RELU2_OP) else real(op, fmt, impl, **kw))
  (loss, grads), _, kernels = _run(config)
  assert kernels > 0
  np.testing.assert_allclose(float(loss), float(base[0]), rtol=2e-2)
  g = np.concatenate([np.ravel(a) for a in jax.tree.leaves(grads)])
  b = np.concatenate([np.ravel(a) for a in jax.tree.leaves(base[1])])
  assert np.isfinite(g).all()
  # FP4 codes of the last-bit-different norm (and SR bits) move individual elements; the whole stays close
  assert np.linalg.norm(g - b) <= 0.3 * np.linalg.norm(b), np.linalg.norm(g - b) / np.linalg.norm(b)
