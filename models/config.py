"""ModelConfig: one frozen dataclass describes every model, from the CPU toy to the 12B hybrid.

The layer pattern is Nemotron-H's: one character per block, each block pre-norm with a residual.
  ``M`` Mamba-2 mixer, ``*`` attention (GQA), ``-`` MLP, ``E`` mixture of experts (``models.moe``).
Variants are ``dataclasses.replace(config, field=value)``; presets live in ``models.presets``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from models import remat as remat_lib
from models import rules

BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes, dtypes and the precision split of a hybrid Mamba-2 / attention language model."""

  vocab_size: int = 256
  d_model: int = 128
  pattern: str = "M-*-M-"
  # MLP blocks ("-").
  mlp_dim: int = 512
  mlp_kind: Literal["relu2", "swiglu"] = "relu2"
  # Attention blocks ("*").
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  rope: bool = False
  rope_theta: float = 10_000.0
  # "auto": cuDNN's fused kernel on a GPU in bf16/fp16 with head_dim <= 128, else "chunked" (online
  # softmax over key blocks of attention_block, no L x L scores); "cudnn" / "xla" force
  # jax.nn.dot_product_attention with that implementation (XLA's holds the L x L scores).
  attention_impl: str = "auto"
  attention_block: int = 256
  # Mamba-2 blocks ("M"): d_inner = expand * d_model, ssm_n_heads = d_inner // ssm_head_dim.
  n_groups: int = 1
  d_state: int = 16
  ssm_head_dim: int = 32
  expand: int = 2
  conv_width: int = 4
  conv_bias: bool = True          # Mamba-2 / Nemotron-H keep the depthwise conv bias; linears have none
  chunk_size: int = 64
  # The SSD scan: "xla" (models.ssd.ssd_chunked), "pallas" (models.ssd_pallas, the GPU kernels; the
  # Pallas interpreter on a CPU), "auto" (fp4jax.dispatch's recorded rule: "xla" until a device run).
  ssd_impl: str = "auto"
  # The gated RMSNorm after the scan: "xla" (models.gated_norm.gated_norm_reference), "pallas" (its forward
  # and backward kernels; the interpreter on a CPU), "auto" (the same recorded rule as ssd_impl's).
  gate_norm_impl: str = "auto"
  # The gradient of the conv + SiLU (models.mamba2.conv1d_silu): "autodiff" (jax's), "recompute" (a custom_vjp
  # that keeps only the conv's inputs; other last bits; opt-in: predicted slower for the 12B, docs/PERF.md).
  conv_vjp: str = "autodiff"
  # The producers of a quantized layer's input (the block's RMSNorm, the MLP's activation) quantize it for the
  # layer's fprop GEMM in their own pass and hand it over pre-quantized (models.layers.fused_norm_recipe; the
  # same bits as the layer quantizing it). False: every layer quantizes its own input.
  fused_producers: bool = True
  dt_min: float = 0.001           # dt_bias init: softplus(dt_bias) log-uniform in [dt_min, dt_max]
  dt_max: float = 0.1
  a_init_range: tuple[float, float] = (1.0, 16.0)  # A = -exp(A_log), A_log init log(uniform(range))
  # Mixture-of-experts blocks ("E"): transformers' NemotronHMoE fields, and the load balance (models.moe).
  n_routed_experts: int = 8
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 256         # each routed expert's hidden width
  moe_shared_expert_intermediate_size: int = 256   # the shared expert's; 0: none
  moe_latent_size: int | None = None       # fc1/fc2_latent_proj around the routed experts; None: off
  n_group: int = 1                         # group-limited routing: groups of experts ...
  topk_group: int = 1                      # ... of which each token may use this many
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  moe_bias_update_rate: float = 1e-3       # γ of the aux-loss-free bias update after each step; 0: off
  moe_aux_loss_weight: float = 0.0         # α of the sequence-wise balance loss; 0: off
  # Expert parallelism's receive buffer per device, in units of its average traffic (its tokens x
  # num_experts_per_tok); pairs past it are dropped, lowest-ranked choices first, and counted (the metric
  # moe/<block>/dropped; models.expert_parallel). None or 0: dropless (the worst case, P x the average
  # when num_experts_per_tok < E/P). No effect without an expert mesh axis.
  moe_receive_factor: float | None = None
  # Multi-token prediction (models.mtp; DeepSeek-V3, Nemotron 3 Super): mtp_depths extra depths, depth d
  # predicting token t+d+1 through one module of mtp_pattern blocks (eh_proj, then the blocks, its own final
  # norm, the shared embedding and LM head); loss = main + mtp_loss_weight * mean over depths. 0: off.
  mtp_depths: int = 0
  mtp_pattern: str = "*"                   # the blocks of one MTP module; Nemotron 3 Super's is "*E"
  mtp_loss_weight: float = 0.3             # DeepSeek-V3's λ for its first 10T tokens; Nemotron 3.5's 0.3
  mtp_share_depths: bool = False           # one module (mtp_0) for every depth: Megatron's repeated layer
  # Everything else.
  norm_eps: float = 1e-5
  init_std: float = 0.02          # residual-output projections use init_std / sqrt(2 * n_blocks)
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.bfloat16       # compute dtype of linears, attention and the residual stream
  # Precision policy (models.policy, models.rules): a preset name or ordered rules, first match wins, e.g.
  # [("blocks_*/mixer/out_proj", "mxfp8"), ("*/qkv", "bf16"), ("*", "recipe")]. The default preset
  # "nemotron_h" keeps the first bf16_first_blocks and last bf16_last_blocks blocks in bf16.
  precision: Any = "nemotron_h"
  bf16_first_blocks: int = 0
  bf16_last_blocks: int = 0
  # TetraJet-v2 OutControl: once calibrated, this fraction of the input channels of every FP4 layer of a
  # tetrajet2 recipe (rounded up to 128s, models.policy.outcontrol_fp8_channels) runs in MXFP8; 0: off. Set
  # by the trainer from config.outcontrol (it is not a config.model field).
  outcontrol_ratio: float = 0.0
  # What each block keeps for the backward pass (models.remat): "none", "full" (recompute the block),
  # "save_linear" (keep the linear layers' outputs), "save_linear_fp4" (and the FP4 operands fp4jax.dot
  # keeps); True / False mean "full" / "none".
  remat: Any = "none"
  # Whether each quantized linear layer's and expert GEMM's backward releases dx only together with dw
  # (fp4jax's Recipe.release_dx_with_dw: the schedule's memory) or leaves them apart, so that a scanned layer's
  # weight gradient, reduced across the devices, is sent during the next layer (docs/TRAINING.md, "Releasing
  # the weight gradients apart"). The same values either way.
  release_dx_with_dw: bool = True
  # lax.scan over repeated groups of blocks (models.lm.block_groups): fewer blocks to compile, but the
  # parameter tree changes (a group's blocks get a leading repeat axis), so it is opt-in.
  scan_blocks: bool = False
  # Cross entropy (``LanguageModel(..., targets_BxL=...)``): vocabulary columns per chunk of logits.
  loss_chunk: int = 8192

  def __post_init__(self):
    bad = sorted(set(self.pattern) - set(BLOCK_KINDS))
    if not self.pattern or bad:
      raise ValueError(f"pattern={self.pattern!r} has unknown block characters {bad}; "
                       f"use {''.join(BLOCK_KINDS)} (M mamba, * attention, - mlp, E moe)")
    if self.mlp_kind not in ("relu2", "swiglu"):
      raise ValueError(f"mlp_kind={self.mlp_kind!r}; use 'relu2' or 'swiglu'")
    if "*" in self.all_patterns and self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    if "*" in self.all_patterns and self.rope and self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rope=True")
    if "M" in self.all_patterns:
      if self.d_inner % self.ssm_head_dim:
        raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be a multiple of "
                         f"ssm_head_dim={self.ssm_head_dim}")
      if self.ssm_n_heads % self.n_groups:
        raise ValueError(f"ssm_n_heads={self.ssm_n_heads} must be a multiple of n_groups={self.n_groups}")
    if self.mtp_depths < 0 or (self.mtp_depths and (not self.mtp_pattern or set(self.mtp_pattern) - set(BLOCK_KINDS))):
      raise ValueError(f"mtp_depths={self.mtp_depths} must be >= 0 (0: no MTP) and mtp_pattern={self.mtp_pattern!r} "
                       f"a non-empty string of {''.join(BLOCK_KINDS)} (Nemotron 3 Super: '*E')")
    if self.mtp_loss_weight < 0:
      raise ValueError(f"mtp_loss_weight={self.mtp_loss_weight} must be >= 0 (DeepSeek-V3: 0.3, then 0.1)")
    if "E" in self.all_patterns:
      self._check_moe()
    if self.attention_impl not in ("auto", "chunked", "cudnn", "xla"):
      raise ValueError(f"attention_impl={self.attention_impl!r}; use 'auto', 'chunked', 'cudnn' or 'xla'")
    if self.ssd_impl not in ("auto", "xla", "pallas"):
      raise ValueError(f"ssd_impl={self.ssd_impl!r}; use 'auto', 'xla' or 'pallas'")
    if self.gate_norm_impl not in ("auto", "xla", "pallas"):
      raise ValueError(f"gate_norm_impl={self.gate_norm_impl!r}; use 'auto', 'xla' or 'pallas'")
    if not isinstance(self.fused_producers, bool):
      raise ValueError(f"fused_producers={self.fused_producers!r}; use True or False")
    if self.conv_vjp not in ("autodiff", "recompute"):
      raise ValueError(f"conv_vjp={self.conv_vjp!r}; use 'autodiff' or 'recompute'")
    if self.attention_block <= 0:
      raise ValueError(f"attention_block={self.attention_block} must be > 0 (keys per block)")
    if self.loss_chunk <= 0:
      raise ValueError(f"loss_chunk={self.loss_chunk} must be > 0 (vocabulary columns per chunk of logits)")
    object.__setattr__(self, "precision", rules.parse(self.precision))
    object.__setattr__(self, "remat", remat_lib.normalize(self.remat))
    if self.bf16_first_blocks < 0 or self.bf16_last_blocks < 0:
      raise ValueError(f"{self.bf16_first_blocks=} and {self.bf16_last_blocks=} must be >= 0")
    if not 0.0 <= self.outcontrol_ratio <= 1.0:
      raise ValueError(f"outcontrol_ratio={self.outcontrol_ratio} must be in [0, 1] (TetraJet-v2: 0.1; 0: off)")
    for name in ("param_dtype", "dtype"):
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)))

  def _check_moe(self):
    e, k = self.n_routed_experts, self.num_experts_per_tok
    if e < 2 or not 1 <= k <= e:
      raise ValueError(f"n_routed_experts={e} must be >= 2 and num_experts_per_tok={k} in [1, {e}]")
    if self.n_group < 1 or e % self.n_group or (self.n_group > 1 and e // self.n_group < 2):
      raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={e} into groups of >= 2 experts "
                       "(a group's score is the sum of its two best)")
    if not 1 <= self.topk_group <= self.n_group or k > self.topk_group * (e // self.n_group):
      raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}] and keep at least "
                       f"num_experts_per_tok={k} experts")
    if self.moe_intermediate_size <= 0 or self.moe_shared_expert_intermediate_size < 0:
      raise ValueError(f"{self.moe_intermediate_size=} must be > 0 and {self.moe_shared_expert_intermediate_size=}"
                       " >= 0 (0: no shared expert)")
    if self.moe_latent_size is not None and self.moe_latent_size <= 0:
      raise ValueError(f"moe_latent_size={self.moe_latent_size} must be > 0, or None (no latent projections)")
    if self.moe_bias_update_rate < 0 or self.moe_aux_loss_weight < 0:
      raise ValueError(f"{self.moe_bias_update_rate=} and {self.moe_aux_loss_weight=} must be >= 0 (0: off)")
    if self.moe_receive_factor is not None and not self.moe_receive_factor >= 0:
      raise ValueError(f"moe_receive_factor={self.moe_receive_factor} must be > 0 (a multiple of the average "
                       "rows a device receives, e.g. 1.5), or None or 0 (dropless)")

  @property
  def n_blocks(self) -> int:
    return len(self.pattern)

  @property
  def all_patterns(self) -> str:
    """The block characters of the model and, with MTP on, of its MTP module."""
    return self.pattern + (self.mtp_pattern if self.mtp_depths else "")

  @property
  def mtp_modules(self) -> int:
    """MTP modules with their own parameters (``mtp_0`` ...): 1 with ``mtp_share_depths``, else one per depth."""
    return min(self.mtp_depths, 1) if self.mtp_share_depths else self.mtp_depths

  @property
  def block_kinds(self) -> tuple[str, ...]:
    """``"mamba" | "attention" | "mlp" | "moe"`` for each block, in order."""
    return tuple(BLOCK_KINDS[c] for c in self.pattern)

  @property
  def d_inner(self) -> int:
    return self.expand * self.d_model

  @property
  def ssm_n_heads(self) -> int:
    return self.d_inner // self.ssm_head_dim

  @property
  def conv_dim(self) -> int:
    """Channels of the depthwise conv: x, B and C."""
    return self.d_inner + 2 * self.n_groups * self.d_state

  @property
  def in_proj_dim(self) -> int:
    """Width of the Mamba-2 input projection: z, x, B, C, dt."""
    return 2 * self.d_inner + 2 * self.n_groups * self.d_state + self.ssm_n_heads

  def is_bf16_block(self, index: int) -> bool:
    """Whether block ``index`` keeps its linear layers in bf16 (the first/last blocks)."""
    return index < self.bf16_first_blocks or index >= self.n_blocks - self.bf16_last_blocks

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
