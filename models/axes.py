"""Logical axis names used by the models; the training rules table maps each one to mesh axes.

Parameters use the plain names, activations the ``activation_`` ones, so a rules table can shard
weights for FSDP (e.g. ``embed`` -> ``fsdp``) without also sharding the activations' model axis.
Fused projection widths (``qkv``, ``ssm_in``, ``ssm_conv``) are laid out group-major (KV groups,
SSM groups), so sharding them evenly over ``tensor`` (a divisor of the group count) splits whole
groups, as sharding ``kv_heads`` / ``ssm_inner`` would.
"""

PARAM_AXIS_NAMES = (
    "vocab",        # embedding rows, LM head columns
    "embed",        # d_model
    "mlp",          # MLP hidden width
    "qkv",          # fused QKV output: n_kv_heads x (q per kv + 2) x head_dim, KV-group-major
    "heads",        # attention output-projection input: n_heads x head_dim
    "ssm_in",       # Mamba-2 in_proj output: n_groups x (z, x, B, C, dt of the group)
    "ssm_conv",     # depthwise conv channels: n_groups x (x, B, C of the group)
    "conv_width",   # conv taps
    "ssm_inner",    # d_inner = expand * d_model: out_proj input, gated-norm scale
    "ssm_heads",    # per-SSM-head parameters: A_log, D, dt_bias
    "experts",      # MoE: the routed experts as expert parallelism splits them (models.expert_parallel)
    "expert_kernels",   # MoE: the stored experts' leading axis (split over expert and fsdp, gathered per layer)
    "moe_latent",   # MoE: the latent width of fc1/fc2_latent_proj and the experts in it
)

ACTIVATION_AXIS_NAMES = (
    "activation_batch",
    "activation_seq",
    "activation_embed",
    "activation_mlp",
    "activation_heads",       # attention query heads
    "activation_kv_heads",
    "activation_head_dim",    # attention and SSM head dim
    "activation_vocab",
    "activation_ssm_heads",
    "activation_ssm_groups",
    "activation_ssm_state",
)

LOGICAL_AXIS_NAMES = PARAM_AXIS_NAMES + ACTIVATION_AXIS_NAMES
