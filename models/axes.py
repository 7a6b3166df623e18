"""Logical axis names used by the models; the training rules table maps each one to mesh axes.

Parameters use the plain names, activations the ``activation_`` ones, so a rules table can shard
weights for FSDP (e.g. ``embed`` -> ``fsdp``) without also sharding the activations' model axis.
Fused projection widths (``qkv``, ``ssm_in``, ``ssm_conv``) are laid out group-major (KV groups,
SSM groups), so sharding them evenly over ``tensor`` (a divisor of the group count) splits whole
groups, as sharding ``kv_heads`` / ``ssm_inner`` would.

``fit`` is the one rule for how far a dimension is split: the trainer places every parameter by it
(``fit_spec``, through ``training.sharding``), and a model that must lay an activation out like a parameter
reads it too (``as_param``: a parameter's cast kept in the parameter's own placement).
"""
import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from fp4jax import formats

# A matrix's last two dimensions are split only into whole multiples of this (an NVFP4 tile, 16), so its
# 1x16 blocks and 16x16 weight tiles never straddle a shard boundary and each shard quantizes locally.
MATRIX_UNIT = formats.TILE["nvfp4"][0]

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


def fit(axes, dim: int, mesh_shape, unit: int = 1):
  """The mesh axes (a name, a tuple of names, or None) of ``axes`` that cut a dimension of ``dim`` elements
  into whole ``unit``s. One name stays or goes; of several, those of size 1 are dropped (the same split)
  and then the longest leading run that cuts whole units is kept (``("fsdp", "expert")`` falls back to
  ``"fsdp"``)."""
  if isinstance(axes, str):
    return axes if dim % (mesh_shape[axes] * unit) == 0 else None
  names = tuple(n for n in axes or () if mesh_shape[n] > 1)
  while names and dim % (math.prod(mesh_shape[n] for n in names) * unit):
    names = names[:-1]
  return names[0] if len(names) == 1 else names or None


def fit_spec(spec, shape, mesh_shape) -> P:
  """``spec`` (mesh axes per dimension) with each dimension's axes cut down by ``fit``: a matrix's (rank >= 2)
  last two dimensions into whole ``MATRIX_UNIT``s, so NVFP4's 1x16 blocks and 16x16 weight tiles never
  straddle a shard boundary and each shard quantizes locally; vectors, and the leading axes of stacked
  matrices (the experts' (E, in, out)), only into whole elements."""
  padded = tuple(spec) + (None,) * (len(shape) - len(spec))
  units = [MATRIX_UNIT if len(shape) >= 2 and i >= len(shape) - 2 else 1 for i in range(len(shape))]
  return P(*(fit(axes, dim, mesh_shape, unit) for dim, axes, unit in zip(shape, padded, units)))


def as_param(x, names):
  """``x``, a value of a parameter's shape (its cast to the compute dtype, its quantized codes), constrained to
  the placement the trainer gives a parameter of logical axes ``names``: so it is computed on each device's
  shard, and a gather of it moves the narrow value. Without a mesh (or one device), ``x``."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, fit_spec(nn.logical_to_mesh_axes(names), x.shape, mesh.shape))
