"""The nemotron3_super preset (models.presets): its numbers against the released config.json, its parameter
counts (jax.eval_shape of init: no memory) against the release's totals, and its transformers config."""
import jax
import pytest

from models import hf, moe, presets
from models.lm import LanguageModel, abstract_variables

# config.json of nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 (the fields that shape the model).
RELEASE = {
    "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 88,
    "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "expand": 2, "use_conv_bias": True, "chunk_size": 128, "time_step_max": 0.1, "layer_norm_epsilon": 1e-5,
    "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 2688, "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 5.0, "mlp_hidden_act": "relu2", "intermediate_size": 2688,
    "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E", "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def counts():
  config = presets.get_model_config("nemotron3_super")
  params = abstract_variables(LanguageModel(config))["params"]
  size = lambda tree: sum(leaf.size for leaf in jax.tree_util.tree_leaves(tree))
  total = size(params)
  mtp = size({k: v for k, v in params.items() if k.startswith("mtp_")})
  return config, total, mtp


def test_pattern_is_40_mamba_40_moe_8_attention_and_an_attention_moe_mtp_module():
  c = presets.get_model_config("nemotron3_super")
  assert (c.n_blocks, c.pattern.count("M"), c.pattern.count("E"), c.pattern.count("*")) == (88, 40, 40, 8)
  assert (c.mtp_depths, c.mtp_modules, c.mtp_pattern) == (1, 1, "*E")
  assert (c.d_inner, c.ssm_n_heads, c.in_proj_dim) == (8192, 128, 2 * 8192 + 2 * 8 * 128 + 128)


def test_parameter_counts_are_the_releases(counts):
  """123,611,033,088 = the release's 123,611,012,096 BF16 weights + 41 x 512 float32 router biases; its MTP
  module 2,942,324,736 + 512; the idle experts of the 40 backbone MoE blocks 107,898,470,400."""
  config, total, mtp = counts
  assert total == 123_611_012_096 + 41 * 512
  assert mtp == 2_942_324_736 + 512
  idle_per_block = (512 - 22) * 2 * 1024 * 2688
  assert moe.inactive_params(config) == 41 * idle_per_block
  assert 40 * idle_per_block == 107_898_470_400
  active_backbone = total - mtp - 40 * idle_per_block
  assert abs(active_backbone / 12e9 - 1) < 0.07        # "A12B": 12.77B
  assert abs((total - mtp) / 120e9 - 1) < 0.01         # "120B": 120.67B
  assert total - moe.inactive_params(config) == active_backbone + mtp - idle_per_block   # 13.02B with MTP


def test_transformers_config_matches_the_release():
  config = hf.to_hf_config(presets.get_model_config("nemotron3_super"), dtype="bfloat16")
  assert {k: config[k] for k in RELEASE} == RELEASE
