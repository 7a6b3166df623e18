"""The vocabulary-chunked cross entropy against the plain one (full logits, optax), values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import inputs
from configs.shrunken import SHRUNKEN_MODEL
from models import LanguageModel, get_model_config
from models.layers import chunked_cross_entropy
from training.step import cross_entropy, model_loss


def _plain(x_BxLxD, w_DxV, targets_BxL):
  logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV.astype(x_BxLxD.dtype), preferred_element_type=jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def _inputs(B=2, L=24, D=16, V=100, dtype=jnp.float32, seed=0):
  kx, kw, kt = jax.random.split(jax.random.key(seed), 3)
  x = inputs.normal(kx, (B, L, D), jnp.float32).astype(dtype)
  w = inputs.normal(kw, (D, V), jnp.float32) * 0.5
  targets = jax.random.randint(kt, (B, L), 0, V)
  return x, w, targets


@pytest.mark.parametrize("V,chunk", [(100, 100), (100, 10), (100, 7), (100, 1000), (96, 32)])
def test_matches_plain_cross_entropy_and_gradients(V, chunk):
  x, w, targets = _inputs(V=V)
  loss, (dx, dw) = jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, targets, chunk=chunk), (0, 1))(x, w)
  ref, (dx_ref, dw_ref) = jax.value_and_grad(lambda x, w: _plain(x, w, targets), (0, 1))(x, w)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-7)
  assert dw.dtype == w.dtype and dx.dtype == x.dtype


def test_bf16_activations_match_within_bf16_rounding():
  x, w, targets = _inputs(dtype=jnp.bfloat16, V=64)
  loss, (dx, dw) = jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, targets, chunk=16), (0, 1))(x, w)
  ref, (dx_ref, dw_ref) = jax.value_and_grad(lambda x, w: _plain(x, w, targets), (0, 1))(x, w)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)   # same bf16 GEMM inputs, float32 softmax
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=2e-2, atol=1e-4)
  np.testing.assert_allclose(dw, dw_ref, rtol=2e-2, atol=1e-4)


def test_never_holds_the_full_logits():
  B, L, D, V = 2, 256, 32, 4096
  x, w, targets = _inputs(B, L, D, V)
  full = B * L * V * 4
  grad = jax.jit(jax.grad(lambda x, w: chunked_cross_entropy(x, w, targets, chunk=256), (0, 1)))
  temp = grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes
  assert temp < full / 2, (temp, full)


def test_rejects_a_bad_chunk():
  x, w, targets = _inputs()
  with pytest.raises(ValueError, match="chunk"):
    chunked_cross_entropy(x, w, targets, chunk=0)


@pytest.mark.slow   # covered by the model's loss: test_mtp.py::test_loss_is_the_masked_cross_entropy_of_each_depths_logits
def test_language_model_loss_equals_cross_entropy_of_its_logits():
  # The shrunken model (one block of each kind), 4 strided chunks, 6 padded columns; both losses jitted
  # (op by op, the tiny model took ~90 s).
  config = get_model_config("tiny", vocab_size=250, loss_chunk=64, **SHRUNKEN_MODEL)
  model = LanguageModel(config)
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 250)
  params = model.init({"params": jax.random.key(0), "fp4": jax.random.key(0)}, tokens[:, :-1])["params"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  fused = lambda p: model_loss(model, p, inputs, targets, jax.random.key(2))
  plain = lambda p: cross_entropy(model.apply({"params": p}, inputs), targets)
  loss, grads = jax.jit(jax.value_and_grad(fused))(params)
  ref, grads_ref = jax.jit(jax.value_and_grad(plain))(params)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, grads_ref)
