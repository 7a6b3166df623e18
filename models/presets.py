"""Named model configs: CPU toys and the paper's hybrids (spec §7).

``get_model_config("nemotron_h_12b")``; variants are ``dataclasses.replace(config, ...)``.
Parameter counts (``models.count_params``): tiny 0.72M, small 5.2M, hybrid_8b 8.08B,
nemotron_h_12b 12.31B (the paper: 12.3B).
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


_PRESETS = {"tiny": tiny, "moe_tiny": moe_tiny, "small": small, "hybrid_8b": hybrid_8b, "nemotron_h_12b": nemotron_h_12b}
NAMES = tuple(_PRESETS)


def get_model_config(name: str, **overrides) -> ModelConfig:
  """A preset by name (``tiny``, ``moe_tiny``, ``small``, ``hybrid_8b``, ``nemotron_h_12b``), with field overrides."""
  try:
    config = _PRESETS[name]()
  except KeyError:
    raise ValueError(f"unknown model config {name!r}; choose one of {NAMES}") from None
  return config.replace(**overrides) if overrides else config
