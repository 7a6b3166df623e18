"""The train step quantizes the linear layers' weights once per step, ahead of the layers
(``models.lm.quantize_dense_ahead``, the ``prequantized`` collection): the loss and every gradient equal those of
the layers quantizing their own weights, bit for bit, in a scanned model with Mamba, attention and MLP blocks and
the fused norm producers; the codes cover exactly the layers whose recipe reads the weight through them."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from models import LanguageModel, ModelConfig
from models.lm import quantize_dense_ahead
from training import step as step_lib

CONFIG = dict(vocab_size=64, d_model=32, mlp_dim=48, n_heads=4, n_kv_heads=2, head_dim=8, d_state=8, ssm_head_dim=8,
              chunk_size=4, dtype=jnp.bfloat16, bf16_first_blocks=0, bf16_last_blocks=1)


# ~85 s (three compiles of a step); in the default suite every NVFP4 train step makes the codes ahead
# (tests/test_train_loop.py), and tests/test_dot_quantized_weight.py holds the layer's bits to the dot's
@pytest.mark.slow
def test_the_weights_codes_made_ahead_give_the_layers_losses_and_gradients():
  model = LanguageModel(ModelConfig(pattern="M*-M*-", **CONFIG), "nvfp4")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
  params = nn.unbox(model.init({"params": jax.random.key(0), "fp4": jax.random.key(0)}, tokens[:, :-1])["params"])
  codes = quantize_dense_ahead(model, params)
  kernels = [p for p in traverse_util.flatten_dict(params) if p[-1] == "kernel"]
  quantized = list(traverse_util.flatten_dict(codes))
  assert 0 < len(quantized) < len(kernels)   # the last block is bf16 (bf16_last_blocks=1)

  def loss(params, codes):
    return step_lib.model_loss_and_stats(model, params, tokens[:, :-1], tokens[:, 1:], jax.random.key(1),
                                         prequantized=codes)[0]

  grad = jax.jit(jax.value_and_grad(loss))
  ahead, here = grad(params, codes), grad(params, None)
  for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(here)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  zeros = jax.tree.map(jnp.zeros_like, codes)   # the layers read the codes given: zero codes, another loss
  assert float(jax.jit(loss)(params, zeros)) != float(ahead[0])
