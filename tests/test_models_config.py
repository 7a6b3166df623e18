"""Presets: the paper's model sizes (spec §7), computed with jax.eval_shape, and config validation."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import models
from models import ModelConfig, count_params, get_model_config


def _kinds(config):
  return {c: config.pattern.count(c) for c in "M-*"}


class TestPresets:

  def test_nemotron_h_12b_matches_the_spec(self):
    c = get_model_config("nemotron_h_12b")
    assert c.n_blocks == 62 and _kinds(c) == {"M": 28, "-": 28, "*": 6}
    assert (c.d_model, c.mlp_dim, c.n_heads, c.n_kv_heads, c.head_dim) == (5120, 20480, 40, 8, 128)
    assert (c.n_groups, c.d_state, c.ssm_head_dim, c.expand, c.conv_width) == (8, 128, 64, 2, 4)
    assert c.ssm_n_heads == 160 and c.vocab_size == 131072 and c.mlp_kind == "relu2" and not c.rope
    assert (c.bf16_first_blocks, c.bf16_last_blocks) == (2, 8)
    assert c.param_dtype == jnp.float32 and c.dtype == jnp.bfloat16

  def test_nemotron_h_12b_has_12_3b_parameters(self):
    n = count_params(get_model_config("nemotron_h_12b"))   # jax.eval_shape: nothing allocated
    assert 12.0e9 <= n <= 12.6e9, n

  def test_hybrid_8b(self):
    c = get_model_config("hybrid_8b")
    assert c.n_blocks == 52 and _kinds(c) == {"M": 24, "-": 24, "*": 4}
    assert (c.d_model, c.mlp_dim, c.n_heads, c.n_kv_heads) == (4096, 21504, 32, 4)
    assert (c.bf16_first_blocks, c.bf16_last_blocks) == (0, 8)
    assert 7.8e9 <= count_params(c) <= 8.4e9

  @pytest.mark.parametrize("name", ["nemotron_h_12b", "hybrid_8b"])
  def test_attention_is_spread_through_depth_and_not_last(self, name):
    pattern = get_model_config(name).pattern
    where = [i for i, c in enumerate(pattern) if c == "*"]
    gaps = {b - a for a, b in zip(where, where[1:])}
    assert max(gaps) - min(gaps) <= 2 and where[-1] < len(pattern) - 8
    assert "--" not in pattern and "MM" not in pattern

  def test_cpu_presets_are_small(self):
    assert count_params(get_model_config("tiny")) < 1e6
    assert 1e6 < count_params(get_model_config("small")) < 10e6
    for name in ("tiny", "small"):
      c = get_model_config(name)
      assert c.vocab_size == 256 and c.dtype == jnp.float32

  def test_param_count_by_hand(self):
    """Every parameter accounted for: in_proj, conv, A/D/dt_bias, gated norm, out_proj; qkv, out; MLP."""
    c = get_model_config("nemotron_h_12b")
    mamba = (c.d_model * c.in_proj_dim + (c.conv_width + 1) * c.conv_dim + 3 * c.ssm_n_heads
             + c.d_inner + c.d_inner * c.d_model + c.d_model)
    attention = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.d_model
    mlp = 2 * c.d_model * c.mlp_dim
    total = (28 * mamba + 6 * (attention + c.d_model) + 28 * (mlp + c.d_model)
             + 2 * c.vocab_size * c.d_model + c.d_model)
    assert count_params(c) == total

  def test_overrides_and_unknown_names(self):
    c = get_model_config("tiny", d_model=64, pattern="M-")
    assert c.d_model == 64 and c.pattern == "M-"
    assert dataclasses.replace(c, rope=True).rope
    with pytest.raises(ValueError, match="unknown model config"):
      get_model_config("gpt5")


class TestValidation:

  @pytest.mark.parametrize("changes,match", [
      (dict(pattern="M-X"), "unknown block characters"),
      (dict(pattern=""), "pattern"),
      (dict(n_heads=5, n_kv_heads=2), "multiple of n_kv_heads"),
      (dict(ssm_head_dim=48), "multiple of ssm_head_dim"),
      (dict(n_groups=3), "multiple of n_groups"),
      (dict(mlp_kind="gelu"), "mlp_kind"),
  ])
  def test_bad_configs_say_how_to_fix(self, changes, match):
    with pytest.raises(ValueError, match=match):
      get_model_config("tiny", **changes)

  def test_config_is_hashable_and_dtypes_normalized(self):
    c = ModelConfig(dtype="bfloat16")
    assert c.dtype == jnp.bfloat16 and hash(c) == hash(ModelConfig(dtype=jnp.bfloat16))

  def test_bf16_blocks(self):
    c = get_model_config("nemotron_h_12b")
    assert [i for i in range(c.n_blocks) if c.is_bf16_block(i)] == [0, 1, *range(54, 62)]


def test_logical_axis_names_are_unique_strings():
  names = models.LOGICAL_AXIS_NAMES
  assert len(set(names)) == len(names) and all(isinstance(n, str) for n in names)
  for required in ("embed", "mlp", "vocab", "heads", "ssm_inner", "ssm_heads", "activation_batch",
                   "activation_seq", "activation_embed", "activation_kv_heads"):
    assert required in names


def test_eval_shape_does_not_allocate():
  abstract = models.abstract_variables(models.LanguageModel(get_model_config("nemotron_h_12b")))
  leaves = jax.tree_util.tree_leaves(abstract)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
