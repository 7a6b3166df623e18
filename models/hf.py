"""Conversion between ``LanguageModel`` parameters and Hugging Face Nemotron-H checkpoints (pure functions).

transformers' ``NemotronHForCausalLM`` is the same architecture: pre-norm residual blocks chosen by a
pattern (``M`` Mamba-2, ``*`` attention without position encoding, ``-`` squared-ReLU MLP), RMSNorm,
untied LM head. The layouts differ, and every difference is a fixed permutation or a transpose:

  ours (Flax)                                       Nemotron-H (torch, ``backbone.`` prefix)
  Dense kernel  [in, out]                           Linear weight [out, in]
  in_proj out axis per group g: z_g x_g B_g C_g dt_g  [z | x | B | C | dt], each over all groups/heads
  conv channels per group g: x_g B_g C_g              [x | B | C];  conv weight [W, E] -> [E, 1, W]
  fused qkv, per KV head k: R queries, key, value     q_proj, k_proj, v_proj
  blocks_<i>/norm/scale, mixer/norm_scale             layers.<i>.norm.weight, mixer.norm.weight

transformers clamps softplus(dt + dt_bias) from below at ``time_step_min`` in its chunked scan; this model
does not clamp, so the exported config sets ``time_step_min = 0`` (a no-op clamp) and the math matches.

NVFP4 (``to_hf_nvfp4``): every linear layer the precision policy quantizes is written in NVIDIA ModelOpt's
layout (``weight`` uint8 [N, K/2], two E2M1 codes per byte, element 2j in the low nibble; ``weight_scale``
float8_e4m3fn [N, K/16]; ``weight_scale_2`` float32 = amax / (6 * 448); ``input_scale`` float32 =
activation amax / (6 * 448)). The codes and scales are those of the training forward pass: the weight cast
to the compute dtype, quantized by ``fp4jax.quantize(w.T, "nvfp4", tile=(16, 16))``; a 16x16 tile's scale
is the scale of each of its sixteen 1x16 row blocks, so it is only repeated, never recomputed.

No torch here: tensors are numpy arrays (bfloat16 / float8 through ml_dtypes) and safetensors files are
read and written by the small codec of ``models.hf_files``.

Legend: N output features, K input features, G SSM groups, R heads per group (SSM) or queries per KV head
(attention), P head dim, H heads, E conv channels, W conv width, D model width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp4jax
from models import ModelConfig, moe, policy
from models.config import BLOCK_KINDS
from models.hf_files import (ConversionError, load_hf_tensors, load_safetensors,  # noqa: F401  (re-exported)
                             save_hf_tensors, save_safetensors)

PREFIX = "backbone."                       # NVIDIA's checkpoints; transformers also reads "model."
HF_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MTP_BLOCKS = "*E"     # the MTP layer kinds vLLM's NemotronH MTP loader builds (attention, MoE)
GROUP = 16                                 # NVFP4 block: elements per E4M3 scale
_E4M3_X_E2M1_MAX = 6.0 * 448.0


# ------------------------------------------------------------------------------------------- layouts

def _in_proj_rows(c: ModelConfig) -> np.ndarray:
  """For each row of Nemotron-H's in_proj [z | x | B | C | dt], the row of ours (group-major)."""
  G, N, P, R = c.n_groups, c.d_state, c.ssm_head_dim, c.ssm_n_heads // c.n_groups
  F = 2 * R * P + 2 * N + R                      # one group's share of the projection
  part = lambda start, width: [g * F + start + j for g in range(G) for j in range(width)]
  return np.array(part(0, R * P) + part(R * P, R * P) + part(2 * R * P, N) + part(2 * R * P + N, N)
                  + part(2 * R * P + 2 * N, R), np.int64)


def _conv_channels(c: ModelConfig) -> np.ndarray:
  """For each conv channel of Nemotron-H [x | B | C], the channel of ours (group-major)."""
  G, N, P, R = c.n_groups, c.d_state, c.ssm_head_dim, c.ssm_n_heads // c.n_groups
  E = R * P + 2 * N
  part = lambda start, width: [g * E + start + j for g in range(G) for j in range(width)]
  return np.array(part(0, R * P) + part(R * P, N) + part(R * P + N, N), np.int64)


def _qkv_rows(c: ModelConfig) -> dict[str, np.ndarray]:
  """Rows of our fused qkv output (per KV head k: R queries, key, value) for q_proj, k_proj, v_proj."""
  K, P, R = c.n_kv_heads, c.head_dim, c.n_heads // c.n_kv_heads
  row = lambda k, slot: [(k * (R + 2) + slot) * P + p for p in range(P)]
  return {"q_proj": np.array([i for k in range(K) for r in range(R) for i in row(k, r)], np.int64),
          "k_proj": np.array([i for k in range(K) for i in row(k, R)], np.int64),
          "v_proj": np.array([i for k in range(K) for i in row(k, R + 1)], np.int64)}


@dataclasses.dataclass(frozen=True)
class Linear:
  """One Nemotron-H linear weight: rows ``rows`` (None: all, in order) of our kernel ``path``, transposed."""
  hf_name: str
  path: tuple[str, ...]
  rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Any other parameter: ``to_hf(ours) -> theirs`` and its inverse ``from_hf``."""
  hf_name: str
  path: tuple[str, ...]
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray], np.ndarray]


def _same(x):
  return x


def layout(c: ModelConfig) -> tuple[list[Linear], list[Tensor]]:
  """Every Nemotron-H tensor of ``c`` and where it comes from in our parameter tree."""
  check_exportable(c)
  linears: list[Linear] = []
  tensors = [Tensor(f"{PREFIX}embeddings.weight", ("embed", "embedding"), _same, _same),
             Tensor(f"{PREFIX}norm_f.weight", ("final_norm", "scale"), _same, _same)]
  for i, char in enumerate(c.pattern):
    _block_layout(c, char, f"{PREFIX}layers.{i}.", (f"blocks_{i}",), linears, tensors)
  _mtp_layout(c, linears, tensors)
  linears.append(Linear("lm_head.weight", ("lm_head",)))
  return linears, tensors


def _block_layout(c: ModelConfig, char: str, layer: str, block: tuple[str, ...], linears: list[Linear],
                  tensors: list[Tensor]) -> None:
  """Appends the tensors of one block (``char``) at our ``block`` path, named ``<layer>norm.weight`` etc."""
  tensors.append(Tensor(layer + "norm.weight", (*block, "norm", "scale"), _same, _same))
  mixer = (*block, "mixer")
  if char == "M":
    channels = _conv_channels(c)
    inverse = np.argsort(channels)
    linears += [Linear(layer + "mixer.in_proj.weight", (*mixer, "in_proj"), _in_proj_rows(c)),
                Linear(layer + "mixer.out_proj.weight", (*mixer, "out_proj"))]
    tensors += [
        Tensor(layer + "mixer.conv1d.weight", (*mixer, "conv_weight"),
               lambda w_WxE, ch=channels: w_WxE[:, ch].T[:, None, :],
               lambda w_Ex1xW, inv=inverse: w_Ex1xW[:, 0, :].T[:, inv])]
    if c.conv_bias:
      tensors.append(Tensor(layer + "mixer.conv1d.bias", (*mixer, "conv_bias"),
                            lambda b_E, ch=channels: b_E[ch], lambda b_E, inv=inverse: b_E[inv]))
    tensors += [Tensor(layer + f"mixer.{name}", (*mixer, name), _same, _same) for name in ("dt_bias", "A_log", "D")]
    tensors.append(Tensor(layer + "mixer.norm.weight", (*mixer, "norm_scale"), _same, _same))
  elif char == "*":
    linears += [Linear(layer + f"mixer.{name}.weight", (*mixer, "qkv"), rows)
                for name, rows in _qkv_rows(c).items()]
    linears.append(Linear(layer + "mixer.o_proj.weight", (*mixer, "out")))
  elif char == "E":
    linears += _moe_linears(c, layer, mixer)
    tensors += _moe_tensors(layer, mixer)
  else:
    linears += [Linear(layer + "mixer.up_proj.weight", (*mixer, "up")),
                Linear(layer + "mixer.down_proj.weight", (*mixer, "down"))]


# The MTP modules as vLLM's NemotronH MTP loader reads them (vllm/model_executor/models/nemotron_h_mtp.py):
# module m's blocks are the flat layers mtp.layers.<m * P + j> (P = len(mtp_pattern)); the first of a module
# also holds enorm, hnorm and eh_proj [D, 2D] (input: [enorm(embedding) | hnorm(hidden)]), the last its
# final_layernorm; the embedding and lm_head are the main model's. Routed experts are written one tensor per
# expert, mixer.experts.<e>.up_proj.weight [out, in], the names its expert mapping looks for.
MTP_ROUTED = re.compile(r"(mtp\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)")
_MTP_EXPERT = re.compile(r"(mtp\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def _mtp_layout(c: ModelConfig, linears: list[Linear], tensors: list[Tensor]) -> None:
  P = len(c.mtp_pattern)
  for m in range(c.mtp_modules):
    module = f"mtp_{m}"
    for j, char in enumerate(c.mtp_pattern):
      layer = f"mtp.layers.{m * P + j}."
      if j == 0:
        tensors += [Tensor(layer + f"{norm}.weight", (module, norm, "scale"), _same, _same) for norm in ("enorm", "hnorm")]
        linears.append(Linear(layer + "eh_proj.weight", (module, "eh_proj")))
      _block_layout(c, char, layer, (module, f"layers_{j}"), linears, tensors)
      if j == P - 1:
        tensors.append(Tensor(layer + "final_layernorm.weight", (module, "final_norm", "scale"), _same, _same))


def _split_mtp_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The MTP layers' stacked routed experts ``...experts.up_proj`` (E, out, in) as one tensor per expert."""
  out = {}
  for name, value in tensors.items():
    match = MTP_ROUTED.fullmatch(name)
    if match is None:
      out[name] = value
      continue
    out.update({f"{match.group(1)}.{e}.{match.group(2)}.weight": np.ascontiguousarray(value[e])
                for e in range(value.shape[0])})
  return out


def _join_mtp_experts(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The inverse of ``_split_mtp_experts``: per-expert MTP tensors stacked back in expert order."""
  out, groups = {}, {}
  for name, value in named.items():
    match = _MTP_EXPERT.fullmatch(name)
    if match is None:
      out[name] = value
    else:
      groups.setdefault(f"{match.group(1)}.{match.group(3)}", {})[int(match.group(2))] = value
  for name, experts in groups.items():
    if sorted(experts) != list(range(len(experts))):
      raise ConversionError(f"{name}: the checkpoint has experts {sorted(experts)[:8]}..., not 0 .. E-1")
    out[name] = np.stack([experts[e] for e in range(len(experts))])
  return out


def _moe_linears(c: ModelConfig, layer: str, mixer: tuple[str, ...]) -> list[Linear]:
  """An ``E`` block's dense linears: the shared expert and the latent projections."""
  out = [Linear(layer + "mixer.shared_experts.up_proj.weight", (*mixer, "shared_experts", "up")),
         Linear(layer + "mixer.shared_experts.down_proj.weight", (*mixer, "shared_experts", "down"))]
  if c.moe_latent_size:
    out += [Linear(layer + "mixer.fc1_latent_proj.weight", (*mixer, "fc1_latent_proj")),
            Linear(layer + "mixer.fc2_latent_proj.weight", (*mixer, "fc2_latent_proj"))]
  return out


def _swap_last(x):
  return np.swapaxes(x, -1, -2)


def _moe_tensors(layer: str, mixer: tuple[str, ...]) -> list[Tensor]:
  """An ``E`` block's router (transformers' ``gate``: weight [E, D], float32, and the bias buffer) and the
  routed experts, stored as transformers stores them, (E, out, in): ours are (E, in, out)."""
  return [Tensor(layer + "mixer.gate.weight", (*mixer, "router", "kernel"), _swap_last, _swap_last),
          Tensor(layer + "mixer.gate.e_score_correction_bias", (*mixer, "router", "e_score_correction_bias"),
                 _same, _same),
          Tensor(layer + "mixer.experts.up_proj", (*mixer, "experts", "up", "kernel"), _swap_last, _swap_last),
          Tensor(layer + "mixer.experts.down_proj", (*mixer, "experts", "down", "kernel"), _swap_last, _swap_last)]


ROUTER_TENSORS = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")   # float32 in any export


def check_exportable(c: ModelConfig) -> None:
  if getattr(c, "scan_blocks", False):
    raise ConversionError("scan_blocks=True stacks the blocks' parameters; the conversion reads the per-block "
                          "tree (blocks_<i>): convert with models.lm.unscanned_params and scan_blocks=False "
                          "(python -m tools.hf export does this)")
  if c.rope:
    raise ConversionError("rope=True: Nemotron-H attention has no position encoding; only rope=False models "
                          "export")
  if "E" in c.pattern and not c.moe_shared_expert_intermediate_size:
    raise ConversionError("moe_shared_expert_intermediate_size=0: transformers' NemotronHMoE always has a shared "
                          "expert; only MoE models with one export")
  bad_mtp = sorted(set(c.mtp_pattern) - set(MTP_BLOCKS)) if c.mtp_depths else []
  if bad_mtp:
    raise ConversionError(f"mtp_pattern={c.mtp_pattern!r} has blocks {bad_mtp}: vLLM's NemotronH MTP loader builds "
                          "only attention ('*') and MoE ('E') MTP layers; use an mtp_pattern of those (Super: '*E')")
  if "-" in c.all_patterns and c.mlp_kind != "relu2":
    raise ConversionError(f"mlp_kind={c.mlp_kind!r}: Nemotron-H MLPs are squared ReLU without a gate; only "
                          "mlp_kind='relu2' models export")


# ------------------------------------------------------------------------------------------- configs

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
  if hf.get("quantization_config"):
    raise ConversionError("the checkpoint is quantized (quantization_config in config.json); import its "
                          "bf16/fp32 original instead")
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


# ------------------------------------------------------------------------------------------- weights

def _get(params, path):
  for key in path:
    params = params[key]
  return params


def _numpy(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def to_hf(params, c: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
  """Nemotron-H tensors (``dtype``: float32 or bfloat16) of our unboxed parameter tree."""
  linears, tensors = layout(c)
  out = {}
  for lin in linears:
    w_NxK = _numpy(_get(params, lin.path)["kernel"]).T
    out[lin.hf_name] = np.ascontiguousarray(w_NxK if lin.rows is None else w_NxK[lin.rows]).astype(dtype)
  for t in tensors:
    keep = np.float32 if t.hf_name.endswith(ROUTER_TENSORS) else dtype
    out[t.hf_name] = np.ascontiguousarray(t.to_hf(_numpy(_get(params, t.path)))).astype(keep)
  return _split_mtp_experts(out)


def from_hf(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict:
  """Our parameter tree (float32 numpy) from Nemotron-H tensors (``backbone.`` or ``model.`` prefix)."""
  named = {}
  for name, value in tensors.items():
    if name.startswith("mtp.") and not c.mtp_depths:
      continue                       # multi-token-prediction heads: not part of this model
    if name.startswith("model."):
      name = PREFIX + name[len("model."):]
    named[name] = value
  named = _join_mtp_experts(named)
  quantized = sorted(n for n in named if n.endswith(("weight_scale", "weight_scale_2", "input_scale")))
  if quantized:
    raise ConversionError(f"the checkpoint holds quantized tensors ({quantized[0]}, ...); import the bf16/fp32 "
                          "checkpoint it was made from")
  linears, others = layout(c)
  used, params = set(), {}

  def take(name):
    if name not in named:
      raise ConversionError(f"the checkpoint lacks {name!r}; is it a Nemotron-H checkpoint of this config?")
    used.add(name)
    return np.asarray(named[name]).astype(np.float32)

  def put(path, value):
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value

  by_path: dict[tuple, list[Linear]] = {}
  for lin in linears:
    by_path.setdefault(lin.path, []).append(lin)
  for path, pieces in by_path.items():
    K = take(pieces[0].hf_name).shape[-1]
    N = sum(take(p.hf_name).shape[0] if p.rows is None else len(p.rows) for p in pieces)
    w_NxK = np.zeros((N, K), np.float32)
    filled = np.zeros(N, bool)
    for p in pieces:
      part = take(p.hf_name)
      rows = np.arange(N) if p.rows is None else p.rows
      if part.shape != (len(rows), K):
        raise ConversionError(f"{p.hf_name} has shape {part.shape}; the config implies {(len(rows), K)}")
      w_NxK[rows] = part
      filled[rows] = True
    assert filled.all(), path
    put((*path, "kernel"), w_NxK.T.copy())
  for t in others:
    value = take(t.hf_name)
    try:
      put(t.path, np.ascontiguousarray(t.from_hf(value)))
    except (IndexError, ValueError):
      raise ConversionError(f"{t.hf_name} has shape {value.shape}, which does not fit the config") from None
  leftover = sorted(set(named) - used)
  if leftover:
    raise ConversionError(f"the checkpoint has tensors this model has no place for: {leftover[:4]}")
  return params


def check_params(params, abstract) -> None:
  """Raises ConversionError when ``params`` and the model's ``abstract`` tree differ in keys or shapes."""
  flat_p = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  flat_a = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  bad = [k for k in sorted(set(flat_p) | set(flat_a)) if flat_p.get(k) != flat_a.get(k)]
  if bad:
    raise ConversionError(f"converted parameters do not fit the model: {[(k, flat_p.get(k), flat_a.get(k)) for k in bad[:3]]}")


# ----------------------------------------------------------------------------------------------- NVFP4

def fprop_weight(kernel_KxN, c: ModelConfig) -> fp4jax.QTensor:
  """The weight as the training forward pass quantizes it: cast to the compute dtype, transposed to
  (N, K), zero-padded to whole 16x16 tiles (zeros change no amax), ``quantize(..., tile=(16, 16))``."""
  w_NxK = jnp.asarray(kernel_KxN).astype(c.dtype).T
  N, K = w_NxK.shape
  w_NxK = jnp.pad(w_NxK, ((0, -N % 16), (0, -K % 16)))
  return fp4jax.quantize(w_NxK, "nvfp4", tile=(16, 16))


def modelopt_tensors(q: fp4jax.QTensor, n: int, k: int) -> dict[str, np.ndarray]:
  """``weight`` [n, k/2] uint8, ``weight_scale`` [n, k/16] float8_e4m3fn, ``weight_scale_2`` float32 of a
  16x16-tiled QTensor of an (n, k) weight: each tile scale repeated for the tile's 16 rows."""
  if k % GROUP:
    raise ConversionError(f"a quantized layer has K={k} inputs, not a multiple of {GROUP}: ModelOpt's NVFP4 "
                          "layout needs whole 1x16 blocks along K")
  data = np.asarray(q.data)[:n, :k // 2]
  scale = np.repeat(np.asarray(q.scale), 16, axis=0)[:n, :k // GROUP]
  scale_2 = np.float32(np.asarray(q.amax, np.float32)) / np.float32(_E4M3_X_E2M1_MAX)
  return {"weight": np.ascontiguousarray(data), "weight_scale": np.ascontiguousarray(scale),
          "weight_scale_2": np.asarray(scale_2, np.float32)}


def quantized_paths(c: ModelConfig, recipe) -> set[tuple[str, ...]]:
  """Module paths of the linear layers whose forward pass the precision policy runs in NVFP4 (a layer that a
  rule gives another format, e.g. the MXFP8 ``out_proj`` of ``precision="nemotron3_super"``, is exported
  unquantized with the excluded modules)."""
  recipe = fp4jax.recipes.get(recipe)
  if recipe.fprop != "nvfp4":
    raise ConversionError(f"recipe {recipe.name!r} runs its forward pass in {recipe.fprop}; the NVFP4 export "
                          "writes the weights an nvfp4 forward pass uses (pass --recipe nvfp4)")
  linears, tensors = layout(c)
  experts = {t.path[:-1] for t in tensors if _expert_path(t.path)}
  return ({lin.path for lin in linears if _nvfp4_forward(c, recipe, lin.path)}
          | {path for path in experts if _nvfp4_forward(c, recipe, path)})


def _nvfp4_forward(c: ModelConfig, recipe, path) -> bool:
  """Whether the policy runs the forward pass of the layer at ``path`` with NVFP4 weights."""
  layer = policy.decide(c, recipe, path).recipe
  return layer is not None and layer.roles.fprop_w is not None and layer.roles.fprop_w.fmt == "nvfp4"


def to_hf_nvfp4(params, c: ModelConfig, recipe="nvfp4", *, input_amax: dict[tuple, float] | None = None,
                dtype=ml_dtypes.bfloat16) -> tuple[dict[str, np.ndarray], list[str]]:
  """(tensors, excluded module names): the policy's FP4 layers in ModelOpt's NVFP4 layout, every other
  tensor in ``dtype``. ``input_amax[path]``: calibrated max |input| of a quantized layer -> input_scale."""
  quantized = quantized_paths(c, recipe)
  linears, tensors = layout(c)
  out, excluded, fprop = {}, [], {}
  for lin in linears:
    module = lin.hf_name[:-len(".weight")]
    kernel = _get(params, lin.path)["kernel"]
    if lin.path not in quantized:
      w_NxK = _numpy(kernel).T
      out[lin.hf_name] = np.ascontiguousarray(w_NxK if lin.rows is None else w_NxK[lin.rows]).astype(dtype)
      excluded.append(module)
      continue
    if lin.path not in fprop:
      fprop[lin.path] = modelopt_tensors(fprop_weight(kernel, c), kernel.shape[1], kernel.shape[0])
    full = fprop[lin.path]
    rows = slice(None) if lin.rows is None else lin.rows
    out[module + ".weight"] = np.ascontiguousarray(full["weight"][rows])
    out[module + ".weight_scale"] = np.ascontiguousarray(full["weight_scale"][rows])
    out[module + ".weight_scale_2"] = full["weight_scale_2"]
    if input_amax is not None:
      amax = np.float32(input_amax[lin.path])
      out[module + ".input_scale"] = np.asarray(amax / np.float32(_E4M3_X_E2M1_MAX), np.float32)
  for t in tensors:
    if _expert_path(t.path) and t.path[:-1] in quantized:
      out.update(_nvfp4_experts(t, _get(params, t.path), c, input_amax))
      continue
    keep = np.float32 if t.hf_name.endswith(ROUTER_TENSORS) else dtype
    out[t.hf_name] = np.ascontiguousarray(t.to_hf(_numpy(_get(params, t.path)))).astype(keep)
  return _split_mtp_experts(out), excluded


def _expert_path(path) -> bool:
  return len(path) >= 2 and path[-1] == "kernel" and "experts" in path and path[-2] in ("up", "down")


def _nvfp4_experts(t: Tensor, kernel_ExKxN, c: ModelConfig, input_amax) -> dict[str, np.ndarray]:
  """The routed experts of one GEMM in ModelOpt's per-expert layout, ``...experts.<e>.up_proj.weight`` etc.:
  each expert quantized as its own tensor, as the training forward pass does (``fp4jax.grouped``: its own
  amax and 16x16 tiles). ``input_scale`` (with ``input_amax``) is the amax over all experts' inputs, the
  same for each: the calibration sees the experts' rows together."""
  out = {}
  base = t.hf_name[:-len("_proj")].rsplit(".", 1)[0]   # ...mixer.experts
  proj = t.hf_name.rsplit(".", 1)[1]                   # up_proj / down_proj
  n_e, k, n = kernel_ExKxN.shape
  for e in range(n_e):
    tensors = modelopt_tensors(fprop_weight(kernel_ExKxN[e], c), n, k)
    for suffix, value in tensors.items():
      out[f"{base}.{e}.{proj}.{suffix}"] = value
    if input_amax is not None:
      amax = np.float32(input_amax[t.path[:-1]])
      out[f"{base}.{e}.{proj}.input_scale"] = np.asarray(amax / np.float32(_E4M3_X_E2M1_MAX), np.float32)
  return out


def nvfp4_quant_configs(excluded: Iterable[str], *, producer_version: str) -> tuple[dict, dict]:
  """(``hf_quant_config.json``, config.json's ``quantization_config``) in ModelOpt's format."""
  excluded = sorted(set(excluded))
  producer = {"name": "fp4jax", "version": producer_version}
  hf_quant = {"producer": producer,
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                               "exclude_modules": excluded}}
  fmt = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP}
  quantization_config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                         "kv_cache_quant_algo": None, "exclude_modules": excluded, "ignore": excluded,
                         "config_groups": {"group_0": {"weights": dict(fmt), "input_activations": dict(fmt),
                                                       "targets": ["Linear"]}},
                         "producer": producer}
  return hf_quant, quantization_config


def calibration_amax(model, params, tokens_BxL, paths: set[tuple[str, ...]]) -> dict[tuple, float]:
  """max |input| of each linear layer in ``paths`` over a forward pass of ``tokens_BxL`` (the input_scale
  of a static-activation NVFP4 checkpoint; training itself used each batch's own amax)."""
  seen: dict[tuple, float] = {}

  def see(path, x):
    seen[path] = max(seen.get(path, 0.0), float(jnp.max(jnp.abs(x.astype(jnp.float32)))))

  def record(next_fun, args, kwargs, context):
    path = tuple(context.module.path)
    if context.method_name != "__call__" or path not in paths:
      return next_fun(*args, **kwargs)
    if isinstance(context.module, moe.ExpertLinear):   # it returns the GEMM; the rows reach that (zero padding rows)
      return dataclasses.replace(next_fun(*args, **kwargs), observe=functools.partial(see, path))
    see(path, args[0])
    return next_fun(*args, **kwargs)

  mtp = {"mtp_logits": True} if model.config.mtp_depths else {}   # the MTP layers see their inputs too
  with nn.intercept_methods(record):
    model.apply({"params": params}, jnp.asarray(tokens_BxL, jnp.int32), **mtp)
  missing = sorted(paths - set(seen))
  if missing:
    raise ConversionError(f"calibration saw no input for {missing[:3]}")
  return seen
