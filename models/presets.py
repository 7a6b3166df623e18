"""Named model configs: CPU toys and the paper's hybrids (spec §7).

``get_model_config("nemotron_h_12b")``; variants are ``dataclasses.replace(config, ...)``.
Parameter counts (``models.count_params``): tiny 0.72M, small 5.2M, hybrid_8b 8.08B,
nemotron_h_12b 12.31B (the paper: 12.3B), nemotron3_super 123.61B (120.67B without its MTP module; 12.77B active
per token without MTP, 13.02B with it).
"""
from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig


def _nemotron_pattern(n_mamba: int, attention_after: tuple[int, ...]) -> str:
  """``"M-"`` per Mamba block, with ``*`` between the Mamba block and its MLP at the given Mamba indices.

  Nemotron-H places each attention block between a Mamba block and the MLP that follows it,
  roughly evenly through the depth and never in the last few blocks.
  """
  return "".join("M*-" if i in attention_after else "M-" for i in range(n_mamba))


def tiny() -> ModelConfig:
  """Trains on CPU in well under a second per step; byte vocabulary (256)."""
  return ModelConfig(
      vocab_size=256, d_model=128, pattern="M-*-M-", mlp_dim=512, mlp_kind="relu2",
      n_heads=4, n_kv_heads=2, head_dim=32,
      n_groups=1, d_state=16, ssm_head_dim=32, expand=2, chunk_size=32,
      dtype=jnp.float32, bf16_first_blocks=0, bf16_last_blocks=1)


def small() -> ModelConfig:
  """A few million parameters (5.2M) for CPU runs; 12 blocks, last 2 in bf16 (4 of 24 linears)."""
  return ModelConfig(
      vocab_size=256, d_model=256, pattern="M-M*-M-M*-M-", mlp_dim=1024, mlp_kind="relu2",
      n_heads=8, n_kv_heads=2, head_dim=32,
      n_groups=1, d_state=64, ssm_head_dim=32, expand=2, chunk_size=64,
      dtype=jnp.float32, bf16_first_blocks=0, bf16_last_blocks=2)


def hybrid_8b() -> ModelConfig:
  """Spec §7 8B hybrid: 52 blocks = 24 M, 24 -, 4 *; d_model 4096, MLP 21504; last 8 blocks bf16."""
  return ModelConfig(
      vocab_size=131072, d_model=4096, pattern=_nemotron_pattern(24, (3, 8, 13, 18)),
      mlp_dim=21504, mlp_kind="relu2", n_heads=32, n_kv_heads=4, head_dim=128,
      n_groups=8, d_state=128, ssm_head_dim=64, expand=2, conv_width=4, chunk_size=256,
      dtype=jnp.bfloat16, bf16_first_blocks=0, bf16_last_blocks=8)


def nemotron_h_12b() -> ModelConfig:
  """Spec §7 12B: 62 blocks = 28 M, 28 -, 6 *; d_model 5120, MLP 20480, 40/8 heads of 128;
  Mamba-2 8 groups, state 128, head dim 64, expand 2 (160 SSM heads); first 2, last 8 blocks bf16."""
  return ModelConfig(
      vocab_size=131072, d_model=5120, pattern=_nemotron_pattern(28, (3, 7, 11, 15, 19, 23)),
      mlp_dim=20480, mlp_kind="relu2", n_heads=40, n_kv_heads=8, head_dim=128,
      n_groups=8, d_state=128, ssm_head_dim=64, expand=2, conv_width=4, chunk_size=256,
      dtype=jnp.bfloat16, bf16_first_blocks=2, bf16_last_blocks=8)


def moe_tiny() -> ModelConfig:
  """The mixture-of-experts toy for CPU runs: Mamba, MLP, attention and two ``E`` blocks (8 routed experts,
  2 per token, a shared expert, the latent projections to 64); byte vocabulary; last block bf16."""
  return ModelConfig(
      vocab_size=256, d_model=128, pattern="M-E*-ME", mlp_dim=256, mlp_kind="relu2",
      n_heads=4, n_kv_heads=2, head_dim=32,
      n_groups=1, d_state=16, ssm_head_dim=32, expand=2, chunk_size=32,
      n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
      moe_shared_expert_intermediate_size=128, moe_latent_size=64, n_group=2, topk_group=2,
      routed_scaling_factor=1.0, moe_bias_update_rate=1e-3,
      dtype=jnp.float32, bf16_first_blocks=0, bf16_last_blocks=1)


# Nemotron 3 Super's 88 blocks (config.json "hybrid_override_pattern"): 40 M, 40 E, 8 *.
SUPER_PATTERN = ("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
                 "EMEMEMEME")


def nemotron3_super() -> ModelConfig:
  """Nemotron 3 Super (NVIDIA, 2026; "120B-A12B"): 88 blocks = 40 Mamba-2, 40 LatentMoE, 8 attention, and one
  MTP module of attention + LatentMoE; trained in NVFP4 with the Super precision rules (``models.policy``).

  Every number is the released ``config.json`` of ``nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16`` (the same
  in the -Base-BF16 and -NVFP4 repositories; read through public copies of it, e.g. the test fixtures of
  inference engines that parse it, since huggingface.co cannot be reached from here):
    hybrid_override_pattern   SUPER_PATTERN (88 characters)      hidden_size 4096, vocab_size 131072
    num_attention_heads 32, num_key_value_heads 2, head_dim 128  (no RoPE is applied by NemotronH attention;
                                                                  rope_theta 10000 is an unused field there)
    mamba_num_heads 128, mamba_head_dim 64 (d_inner 8192 = expand 2 x 4096), ssm_state_size 128,
    n_groups 8, conv_kernel 4, use_conv_bias true, chunk_size 128, time_step_min/max 0.001 / 0.1
    n_routed_experts 512, num_experts_per_tok 22, moe_intermediate_size 2688, moe_latent_size 1024,
    moe_shared_expert_intermediate_size 5376 (n_shared_experts 1), n_group 1, topk_group 1,
    norm_topk_prob true, routed_scaling_factor 5.0, mlp_hidden_act relu2
    num_nextn_predict_layers 1, mtp_hybrid_override_pattern "*E"    layer_norm_epsilon 1e-5
  ``mlp_dim`` is config.json's ``intermediate_size`` (2688); there is no ``-`` block, so it shapes nothing.

  Parameter counts of this preset (``jax.eval_shape`` of init; tests/test_presets_super.py): 123,611,033,088 in
  all, the release's 123,611,012,096 BF16 weights plus the 41 x 512 float32 ``e_score_correction_bias`` (a public
  count from the BF16 shards' headers: 123,611,012,096 weights, 2,942,324,736 of them in MTP, 107,898,470,400 in
  the backbone's idle experts); 120.67B without the MTP module. Active per token (``moe.inactive_params``):
  12.77B without MTP (the "A12B"), 13.02B with it; the MTP module runs once per depth in training, so the
  step's MFU counts it (docs/PERF.md).
  """
  return ModelConfig(
      vocab_size=131072, d_model=4096, pattern=SUPER_PATTERN, mlp_dim=2688, mlp_kind="relu2",
      n_heads=32, n_kv_heads=2, head_dim=128,
      n_groups=8, d_state=128, ssm_head_dim=64, expand=2, conv_width=4, chunk_size=128,
      dt_min=0.001, dt_max=0.1,
      n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
      moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, n_group=1, topk_group=1,
      norm_topk_prob=True, routed_scaling_factor=5.0,
      mtp_depths=1, mtp_pattern="*E",
      norm_eps=1e-5, dtype=jnp.bfloat16, precision="nemotron3_super")


_PRESETS = {"tiny": tiny, "moe_tiny": moe_tiny, "small": small, "hybrid_8b": hybrid_8b, "nemotron_h_12b": nemotron_h_12b,
            "nemotron3_super": nemotron3_super}
NAMES = tuple(_PRESETS)


def get_model_config(name: str, **overrides) -> ModelConfig:
  """A preset by name (``tiny``, ``moe_tiny``, ``small``, ``hybrid_8b``, ``nemotron_h_12b``,
  ``nemotron3_super``), with field overrides."""
  try:
    config = _PRESETS[name]()
  except KeyError:
    raise ValueError(f"unknown model config {name!r}; choose one of {NAMES}") from None
  return config.replace(**overrides) if overrides else config
