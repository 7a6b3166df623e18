"""The model and helpers that the Hugging Face export and import tests share: a small config with every block
kind, its parameters, the NVFP4 export of them (computed once per process), and independent decoders of
ModelOpt's E4M3 scales and packed E2M1 codes."""
import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import inputs
from models import LanguageModel, ModelConfig, hf
from tools import runs

# Every block kind, two SSM groups (the in_proj / conv permutations), GQA with 2 queries per KV head,
# sequences longer than the SSD chunk. in_proj has 2*64 + 2*2*8 + 8 = 168 outputs: not whole 16x16 tiles.
CONFIG = ModelConfig(vocab_size=96, d_model=32, pattern="M*-M-", mlp_dim=64, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_groups=2, d_state=8, ssm_head_dim=8, expand=2, chunk_size=4,
                     dtype=jnp.float32, bf16_last_blocks=1)


def params(config=CONFIG, seed=0):
  model = LanguageModel(config)
  params = nn.unbox(model.init({"params": jax.random.key(seed)}, jnp.zeros((1, 8), jnp.int32))["params"])
  # Weights larger than the init and non-trivial A_log/D/dt_bias/norms, so every tensor matters.
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [p * 4.0 if p.ndim == 2 else p + 0.3 * inputs.normal(k, p.shape) for p, k in zip(leaves, keys)]
  return model, jax.tree_util.tree_unflatten(tree, leaves)


def write_hf(directory, params, config=CONFIG):
  os.makedirs(directory, exist_ok=True)
  hf.save_safetensors(os.path.join(directory, "model.safetensors"), hf.to_hf(params, config), {"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf.to_hf_config(config, eos_token_id=0), f)


@functools.cache
def nvfp4_export():
  """(params, tensors, excluded) of CONFIG's parameters exported as NVFP4."""
  _, p = params()
  return p, *hf.to_hf_nvfp4(p, CONFIG, "nvfp4")


def write_run(workdir: str) -> str:
  """A training run directory holding CONFIG's parameters."""
  _, p = params()
  runs.write_run(workdir, runs.training_config(CONFIG, name="hf_test"), p)
  return workdir


def decode_e4m3(bits_u8):
  """Independent E4M3 decoder: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals at exponent 0."""
  bits = bits_u8.astype(np.int64)
  sign = np.where(bits & 0x80, -1.0, 1.0)
  exp, man = (bits >> 3) & 0xF, bits & 0x7
  value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
  assert not np.any((exp == 0xF) & (man == 0x7)), "NaN scale"
  return sign * value


def decode_e2m1_packed(packed_u8):
  """Independent E2M1 decoder of ModelOpt's packing: element 2j in the low nibble, 2j+1 in the high."""
  magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  codes = np.stack([packed_u8 & 0xF, packed_u8 >> 4], axis=-1).reshape(packed_u8.shape[0], -1)
  return np.where(codes & 8, -1.0, 1.0) * magnitudes[codes & 7]
