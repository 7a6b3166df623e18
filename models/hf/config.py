"""The model config as a Hugging Face Nemotron-H ``config.json`` and back, and as the run record's JSON."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from models import ModelConfig
from models.config import BLOCK_KINDS
from models.hf.dequantize import nvfp4_checkpoint
from models.hf.files import ConversionError
from models.hf.layout import HF_LAYER_TYPES, check_exportable


def to_hf_config(c: ModelConfig, *, dtype: str = "float32", eos_token_id: int | None = None,
                 max_position_embeddings: int = 4096, extra: dict | None = None) -> dict:
  """transformers' ``config.json`` for ``c``; ``extra["fp4jax"]`` keeps our full ModelConfig for import."""
  check_exportable(c)
  config = {
      "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "torch_dtype": dtype,
      "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_blocks,
      "hybrid_override_pattern": c.pattern, "layers_block_type": [HF_LAYER_TYPES[ch] for ch in c.pattern],
      "tie_word_embeddings": False, "layer_norm_epsilon": c.norm_eps, "residual_in_fp32": False,
      "use_bias": False, "initializer_range": c.init_std, "rescale_prenorm_residual": False,
      # MLP blocks
      "intermediate_size": c.mlp_dim, "mlp_hidden_act": "relu2", "mlp_bias": False,
      # attention blocks
      "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
      "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": max_position_embeddings,
      # Mamba-2 blocks
      "mamba_num_heads": c.ssm_n_heads, "mamba_head_dim": c.ssm_head_dim, "ssm_state_size": c.d_state,
      "n_groups": c.n_groups, "conv_kernel": c.conv_width, "expand": c.expand, "use_conv_bias": c.conv_bias,
      "mamba_hidden_act": "silu", "mamba_proj_bias": False, "chunk_size": c.chunk_size,
      "time_step_min": 0.0,       # transformers clamps dt >= time_step_min; this model never clamps
      "time_step_max": c.dt_max, "time_step_floor": 1e-4, "mamba_ssm_cache_dtype": "float32",
      "use_cache": True, "num_logits_to_keep": 1,
      # MoE blocks (NemotronHMoE)
      "n_routed_experts": c.n_routed_experts, "num_experts_per_tok": c.num_experts_per_tok,
      "moe_intermediate_size": c.moe_intermediate_size,
      "moe_shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
      "moe_latent_size": c.moe_latent_size, "n_group": c.n_group, "topk_group": c.topk_group,
      "norm_topk_prob": c.norm_topk_prob, "routed_scaling_factor": c.routed_scaling_factor,
      "n_shared_experts": 1,
      # multi-token prediction: the MTP modules (vLLM's loader takes 1, applied for every draft token) and
      # their blocks, as vLLM (mtp_hybrid_override_pattern) and transformers (mtp_layers_block_type) name them
      "num_nextn_predict_layers": c.mtp_modules,
      **({"mtp_hybrid_override_pattern": c.mtp_pattern,
          "mtp_layers_block_type": [HF_LAYER_TYPES[ch] for ch in c.mtp_pattern]} if c.mtp_depths else {}),
      "bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
  }
  config["fp4jax"] = {"model": model_config_to_json(c), **(extra or {})}
  return config


def model_config_to_json(c: ModelConfig) -> dict:
  out = {}
  for field in dataclasses.fields(c):
    value = getattr(c, field.name)
    if field.name.endswith("dtype"):
      value = jnp.dtype(value).name
    out[field.name] = list(value) if isinstance(value, tuple) else value
  return out


def model_config_from_json(plain: dict) -> ModelConfig:
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in plain.items() if k in names}
  return ModelConfig(**kwargs)


def _moe_fields(hf: dict, pattern: str) -> dict:
  """The ModelConfig MoE fields of a Nemotron-H config.json (transformers' defaults where absent)."""
  if "E" not in pattern:
    return {}
  if hf.get("mlp_hidden_act", "relu2") != "relu2":
    raise ConversionError(f"mlp_hidden_act={hf.get('mlp_hidden_act')!r}; only relu2 experts import")
  n_shared = hf.get("n_shared_experts", 1)
  if n_shared != 1:
    raise ConversionError(f"n_shared_experts={n_shared}: transformers' NemotronHMoE builds one shared expert")
  return dict(n_routed_experts=hf.get("n_routed_experts", 8), num_experts_per_tok=hf.get("num_experts_per_tok", 2),
              moe_intermediate_size=hf.get("moe_intermediate_size", 7688),
              moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688),
              moe_latent_size=hf.get("moe_latent_size"), n_group=hf.get("n_group", 1),
              topk_group=hf.get("topk_group", 1), norm_topk_prob=hf.get("norm_topk_prob", True),
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))


def _mtp_fields(hf: dict) -> dict:
  """``mtp_depths`` (one depth per MTP module of the checkpoint) and ``mtp_pattern`` of a config.json:
  vLLM's ``mtp_hybrid_override_pattern``, else transformers' ``mtp_layers_block_type`` (its default
  ["full_attention", "moe"] when absent; the older names "attention", "mamba" too)."""
  n = int(hf.get("num_nextn_predict_layers") or 0)
  if n <= 0:
    return {}
  pattern = hf.get("mtp_hybrid_override_pattern")
  if isinstance(pattern, list):
    pattern = "".join(pattern)
  if not pattern:
    names = {"attention": "*", "moe": "E", "mamba": "M", "mlp": "-", **{v: k for k, v in HF_LAYER_TYPES.items()}}
    types = hf.get("mtp_layers_block_type") or ["full_attention", "moe"]
    try:
      pattern = "".join(names[t] for t in types)
    except KeyError as e:
      raise ConversionError(f"config.json mtp_layers_block_type has the unknown layer type {e}") from None
  return dict(mtp_depths=n, mtp_pattern=pattern)


def from_hf_config(hf: dict, *, dtype: Any = jnp.bfloat16, bf16_first_blocks: int = 0,
                   bf16_last_blocks: int = 0) -> ModelConfig:
  """Our ModelConfig for a transformers Nemotron-H ``config.json`` (a dict). One that this package
  exported carries our exact config (``fp4jax.model``), which wins after the dimensions are checked."""
  kind = hf.get("model_type")
  if kind != "nemotron_h":
    raise ConversionError(f"config.json has model_type={kind!r}; only Nemotron-H checkpoints "
                          "(model_type 'nemotron_h') import")
  nvfp4_checkpoint(hf)   # a quantization other than ModelOpt NVFP4 is refused here, before anything is read
  pattern = hf.get("hybrid_override_pattern")
  if not pattern and hf.get("layers_block_type"):
    reverse = {v: k for k, v in HF_LAYER_TYPES.items()}
    legacy = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
    try:
      pattern = "".join(reverse.get(t) or legacy[t] for t in hf["layers_block_type"])
    except KeyError as e:
      raise ConversionError(f"config.json layers_block_type has the unknown layer type {e}") from None
  if not pattern:
    raise ConversionError("config.json has neither hybrid_override_pattern nor layers_block_type")
  unknown = sorted(set(pattern) - set(BLOCK_KINDS))
  if unknown:
    raise ConversionError(f"the pattern {pattern!r} has layer kinds {unknown} this model does not have")
  for flag in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
    if hf.get(flag):
      raise ConversionError(f"config.json sets {flag}=true; this model's linear layers have no biases")
  if "-" in pattern and hf.get("mlp_hidden_act", "relu2") != "relu2":
    raise ConversionError(f"mlp_hidden_act={hf.get('mlp_hidden_act')!r}; only relu2 MLPs import")
  # Older Nemotron-H configs spell some Mamba fields with a mamba_ prefix.
  for new, old in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"), ("expand", "mamba_expand"),
                   ("time_step_min", "mamba_dt_min"), ("time_step_max", "mamba_dt_max"),
                   ("use_conv_bias", "mamba_conv_bias"), ("chunk_size", "mamba_chunk_size")):
    if new not in hf and old in hf:
      hf = dict(hf, **{new: hf[old]})
  mtp = _mtp_fields(hf)
  d_model = hf["hidden_size"]
  n_heads_ssm, head_dim_ssm = hf.get("mamba_num_heads"), hf.get("mamba_head_dim")
  expand = hf.get("expand", 2)
  if "M" in pattern and n_heads_ssm and head_dim_ssm:
    if (n_heads_ssm * head_dim_ssm) % d_model:
      raise ConversionError(f"mamba_num_heads * mamba_head_dim = {n_heads_ssm * head_dim_ssm} is not a multiple "
                            f"of hidden_size={d_model}; this model needs d_inner = expand * d_model")
    expand = n_heads_ssm * head_dim_ssm // d_model
  try:
    config = ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d_model, pattern=pattern,
        mlp_dim=hf.get("intermediate_size", 4 * d_model), mlp_kind="relu2",
        n_heads=hf.get("num_attention_heads", 1), n_kv_heads=hf.get("num_key_value_heads") or
        hf.get("num_attention_heads", 1), head_dim=hf.get("head_dim") or d_model // hf.get("num_attention_heads", 1),
        rope=False, n_groups=hf.get("n_groups", 1), d_state=hf.get("ssm_state_size", 128),
        ssm_head_dim=head_dim_ssm or 64, expand=expand, conv_width=hf.get("conv_kernel", 4),
        conv_bias=hf.get("use_conv_bias", True), chunk_size=hf.get("chunk_size", 128),
        dt_min=hf.get("time_step_min") or 0.001, dt_max=hf.get("time_step_max", 0.1),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), init_std=hf.get("initializer_range", 0.02),
        **_moe_fields(hf, pattern + mtp.get("mtp_pattern", "")), **mtp,
        param_dtype=jnp.float32, dtype=dtype, bf16_first_blocks=bf16_first_blocks,
        bf16_last_blocks=bf16_last_blocks)
  except KeyError as e:
    raise ConversionError(f"config.json lacks {e}") from None
  except (TypeError, ValueError) as e:
    raise ConversionError(f"config.json does not describe a model this package builds: {e}") from None
  ours = (hf.get("fp4jax") or {}).get("model")
  if ours:
    exact = model_config_from_json(ours)
    dims = ("vocab_size", "d_model", "pattern", "n_heads", "n_kv_heads", "head_dim", "n_groups", "d_state",
            "ssm_head_dim", "expand", "conv_width", "conv_bias", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "moe_latent_size", "mtp_modules")
    if any(getattr(exact, d) != getattr(config, d) for d in dims) or (
        config.mtp_depths and exact.mtp_pattern != config.mtp_pattern):
      raise ConversionError("config.json's fp4jax.model disagrees with its Nemotron-H dimensions; remove the "
                            "'fp4jax' entry to import from the Nemotron-H fields alone")
    return exact
  return config


