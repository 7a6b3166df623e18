"""config.precision: rules by module path and GEMM, the presets, their errors, config.json and resume.

Recorded values: none. The loss and gradients (summation-order dependent) are compared with twins computed
in the same process; the pinned strings and counts are decisions of the policy (order-free)."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
import flax.linen as nn

import inputs
import fp4jax
from fp4jax import recipes
from models import get_model_config, policy, rules
from models.lm import LanguageModel, block_groups
from models.report import describe_linear_layers, precision_summary
from models.rules import PrecisionRuleError

STUDY = dict(d_model=32, mlp_dim=128, n_heads=2, n_kv_heads=1, head_dim=16, d_state=16, ssm_head_dim=16,
             chunk_size=16)


def _tiny(**kw):
  return get_model_config("tiny", **{**STUDY, **kw})


def _today(config, recipe, path):
  """The policy before config.precision (bf16_first/last_blocks only), for the bit-identity check."""
  recipe = recipes.get(recipe)
  parts = tuple(path.split("/"))
  index = policy.block_index(parts)
  if (index is None or parts[-1] not in policy.QUANTIZABLE_LAYERS or config.is_bf16_block(index)
      or not recipe.quantizes_anything):
    return "bf16"
  return recipe.name


class TestPatterns:

  @pytest.mark.parametrize("pattern,path,n,hit", [
      ("blocks_{-14:}/*", "blocks_74/mixer/in_proj", 88, True),
      ("blocks_{-14:}/*", "blocks_73/mixer/in_proj", 88, False),
      ("blocks_{:2}/*", "blocks_1/mixer/up", 10, True),
      ("blocks_{:2}/*", "blocks_2/mixer/up", 10, False),
      ("blocks_{3}/mixer/qkv", "blocks_3/mixer/qkv", 10, True),
      ("blocks_{-1}/mixer/qkv", "blocks_9/mixer/qkv", 10, True),
      ("blocks_{0,5}/*", "blocks_5/mixer/out", 10, True),
      ("blocks_{2:6}/*", "blocks_6/mixer/out", 10, False),
      ("*/qkv", "blocks_3/mixer/qkv", 10, True),
      ("*/qkv", "blocks_3/mixer/qkv_extra", 10, False),
      ("blocks_*/mixer/out_proj", "blocks_12/mixer/out_proj", 20, True),
      ("blocks_?/mixer/out", "blocks_12/mixer/out", 20, False),
      ("blocks_*/mixer/experts/up", "blocks_1/mixer/experts/up", 4, True),
  ])
  def test_match(self, pattern, path, n, hit):
    assert rules.matches(pattern, path, n) is hit

  @pytest.mark.parametrize("value,message", [
      ("nemotron", "is not a preset"),
      ([("*/qkv", "nvfp5")], "unknown recipe 'nvfp5'"),
      ([("layers_{1}/*", "bf16")], "must follow 'blocks_'"),
      ([("blocks_{a}/*", "bf16")], "is not an index or a slice"),
      ([{"pattern": "*/qkv", "recpie": "bf16"}], "the keys are"),
      ([("*/qkv", "bf16", {"forward": "bf16"})], "overrides GEMMs"),
      (("*/qkv", "bf16"), "is one rule, not a list of rules"),
      ([], "has no rules"),
  ])
  def test_bad_rules_give_one_line_errors(self, value, message):
    with pytest.raises(PrecisionRuleError, match=message) as e:
      _tiny(precision=value)
    assert "\n" not in str(e.value)


class TestDefaultIsToday:

  @pytest.mark.parametrize("first,last", [(0, 0), (0, 1), (1, 1), (2, 3), (0, 6), (7, 0)])
  @pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "bf16", "nvfp4_bf16_fprop", "tetrajet2"])
  def test_every_decision_equals_the_old_policy(self, first, last, recipe):
    config = _tiny(bf16_first_blocks=first, bf16_last_blocks=last)
    names = ("in_proj", "out_proj", "qkv", "out", "up", "down", "gate", "conv1d", "norm")
    paths = [f"blocks_{i}/mixer/{n}" for i in range(config.n_blocks) for n in names] + ["lm_head", "embed"]
    for path in paths:
      assert policy.layer_precision(config, recipe, path) == _today(config, recipe, path), path
      d = policy.decide(config, recipe, path)
      assert d.recipe is None or d.recipe == recipes.get(recipe)    # the model's own recipe object

  def test_presets_of_the_models_keep_their_counts(self):
    rows = describe_linear_layers(get_model_config("nemotron_h_12b"), "nvfp4")
    assert sum(r[1] == "bf16" for r in rows) == 20 and len(rows) == 124

  @pytest.mark.slow   # ~60 s idle; every decision of the policy is compared with the old one by default above
  def test_loss_and_gradients_bit_identical_to_the_recorded_policy(self, monkeypatch):
    """The default ("nemotron_h") and the same policy as explicit rules give, bit for bit, the loss and
    gradients of the policy before config.precision, computed in this process: the model built with that
    policy's ``dot_general_cls`` (``_today``: bf16 in the first/last blocks, the recipe elsewhere) in place of
    the rules. Every value here is summation-order dependent (GEMMs, sums, the loss), so it is compared with
    its same-process twin, never with a float recorded on another machine. all_fp4 must differ:
    the comparison sees a policy that changes a layer."""
    base = _tiny(bf16_first_blocks=1, bf16_last_blocks=1)
    explicit = base.replace(precision=[("blocks_{:1}/*", "bf16"), ("blocks_{-1:}/*", "bf16"), ("*", "recipe")])
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)

    def loss_and_grads(config):
      model = LanguageModel(config, recipe="nvfp4")
      params = model.init({"params": jax.random.key(0), "fp4": jax.random.key(0)}, tokens[:, :-1])["params"]
      loss_fn = lambda p: model.apply({"params": p}, tokens[:, :-1], targets_BxL=tokens[:, 1:],
                                      rngs={"fp4": jax.random.key(2)})
      loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
      flat = traverse_util.flatten_dict(nn.unbox(grads))
      return np.float32(loss), {"/".join(k): np.asarray(v) for k, v in flat.items()}

    def equal(a, b):
      return a[0].tobytes() == b[0].tobytes() and a[1].keys() == b[1].keys() and all(
          a[1][k].tobytes() == b[1][k].tobytes() for k in a[1])

    default, rules_, all_fp4 = (loss_and_grads(c) for c in (base, explicit, base.replace(precision="all_fp4")))

    def today_dot_general_cls(config, recipe, path):   # models.policy.dot_general_cls before config.precision
      if _today(config, recipe, "/".join(path)) == "bf16":
        return None
      from fp4jax.flax import Fp4DotGeneral  # pylint: disable=g-import-not-at-top
      return functools.partial(Fp4DotGeneral, recipe=recipes.get(recipe))

    monkeypatch.setattr(policy, "dot_general_cls", today_dot_general_cls)
    recorded = loss_and_grads(base)
    assert equal(default, recorded), "the default policy changed the loss or gradients of the recorded policy"
    assert equal(rules_, recorded), "the explicit rules changed the loss or gradients of the recorded policy"
    out_proj = "blocks_0/mixer/out_proj/kernel"                   # a bf16 layer of the recorded policy
    assert not np.array_equal(all_fp4[1][out_proj], recorded[1][out_proj])


class TestPresets:

  def test_nemotron3_super_on_the_study_model(self):
    config = _tiny(precision="nemotron3_super")
    got = {path: label for path, label, _, _ in describe_linear_layers(config, "nvfp4")}
    assert got["blocks_2/mixer/qkv"] == got["blocks_2/mixer/out"] == "bf16"          # attention
    assert got["blocks_0/mixer/out_proj"] == got["blocks_4/mixer/out_proj"] == "mxfp8"
    assert got["blocks_0/mixer/in_proj"] == got["blocks_1/mixer/up"] == "nvfp4"
    assert got["blocks_5/mixer/up"] == got["blocks_5/mixer/down"] == "bf16"          # last round(6·14/88)
    assert precision_summary(config, "nvfp4") == "nvfp4 6 layers, mxfp8 2, bf16 4 (last block, attention)"

  def test_super_scales_the_last_blocks(self):
    assert [policy.super_last_blocks(n) for n in (88, 62, 52, 6, 3)] == [14, 10, 8, 1, 0]
    rules_88 = policy.rules(get_model_config("tiny", pattern="M-" * 44, bf16_last_blocks=0,
                                             precision="nemotron3_super"))
    assert "blocks_{-14:}/*" in [r.pattern for r in rules_88]

  def test_super_on_the_12b_layout(self):
    config = get_model_config("nemotron_h_12b", precision="nemotron3_super")
    text = precision_summary(config, "nvfp4")
    # 62 blocks: 28 Mamba, 28 MLP, 6 attention; the last 10 blocks (* - and 4 x M -) in bf16, the other 5
    # attention blocks in bf16, the other 24 Mamba out_proj in MXFP8.
    assert text == "nvfp4 70 layers, mxfp8 24, bf16 30 (last 10 blocks, attention)", text

  def test_all_fp4_and_a_preset_with_nothing_to_match(self):
    config = _tiny(precision="all_fp4")
    assert {r[1] for r in describe_linear_layers(config, "nvfp4")} == {"nvfp4"}
    no_attention = _tiny(pattern="M-M-", precision="nemotron3_super")   # no qkv: a preset need not match
    assert describe_linear_layers(no_attention, "nvfp4")[0][1] == "nvfp4"

  def test_bf16_recipe_runs_bf16_whatever_the_rules(self):
    config = _tiny(precision="nemotron3_super")
    assert {r[1] for r in describe_linear_layers(config, "bf16")} == {"bf16"}


class TestRuleErrors:

  @pytest.mark.parametrize("pattern,message", [
      ("*/qvk", r"precision rule 0 '\*/qvk' matches no linear layer of the model"),
      ("*/router", "targets the MoE router, which is never quantized"),
      ("embed", "targets embed \\(the embedding\\), which is never quantized"),
      ("lm_head", "the LM head"),
      ("blocks_*/norm", "blocks_0/norm \\(a norm\\)"),
      ("*/A_log", "the SSM scan"),
      ("blocks_{7}/*", "matches no linear layer"),
  ])
  def test_rule_that_matches_no_layer_names_itself(self, pattern, message):
    config = _tiny(precision=[(pattern, "bf16"), ("*", "recipe")])
    with pytest.raises(PrecisionRuleError, match=message) as e:
      describe_linear_layers(config, "nvfp4")
    assert "\n" not in str(e.value)
    with pytest.raises(PrecisionRuleError, match=message):   # the Flax model's init checks too (as it traces)
      jax.eval_shape(LanguageModel(config, "nvfp4").init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))

  def test_override_of_a_requantizing_recipe_is_refused(self):
    config = _tiny(precision=[{"pattern": "*/up", "recipe": "quartet2", "fprop": "bf16"}, ("*", "recipe")])
    with pytest.raises(PrecisionRuleError, match="per-GEMM override mixes 'quartet2'"):
      policy.decide(config, "nvfp4", "blocks_1/mixer/up")


def _dot_and_grads(recipe, x_shape, w_shape):
  """(y, dx, dw) of fp4jax.dot_general(x, w) with ``recipe`` (a Recipe, a name or a Roles table), fixed inputs,
  key and cotangent of ones."""
  x = inputs.normal(jax.random.key(0), x_shape)
  w = inputs.normal(jax.random.key(1), w_shape)
  y, vjp = jax.vjp(lambda a, b: fp4jax.dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe,
                                                     key=jax.random.key(3)), x, w)
  return (y, *vjp(jnp.ones_like(y)))


class TestPerGemm:

  def test_forward_only_bf16_equals_the_recipe_nvfp4_bf16_fprop(self):
    config = _tiny(precision=[{"pattern": "*", "recipe": "recipe", "fprop": "bf16"}])
    d = policy.decide(config, "nvfp4", "blocks_0/mixer/in_proj")
    assert d.gemms == ("bf16", "nvfp4", "nvfp4") and d.label == "fprop bf16/dgrad nvfp4/wgrad nvfp4"
    outs = [_dot_and_grads(r, (24, 48), (48, 40)) for r in (d.recipe, "nvfp4_bf16_fprop")]
    for a, b in zip(*outs):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_gemm_from_another_recipe(self):
    config = _tiny(precision=[("*/down", "recipe", {"wgrad": "mxfp8"}), ("*", "recipe")])
    d = policy.decide(config, "nvfp4", "blocks_1/mixer/down")
    assert d.gemms == ("nvfp4", "nvfp4", "mxfp8")
    assert d.recipe.wgrad_x.fmt == "mxfp8" and d.recipe.fprop_x.fmt == "nvfp4"
    assert d.recipe.dgrad_w == "fprop tiles, transposed"     # fprop and dgrad from one recipe: shared tiles
    # The layer's dot: fprop and dgrad are nvfp4's bit for bit, only wgrad changes (and stays finite).
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = [_dot_and_grads(r, (32, 64), (64, 48)) for r in (d.recipe, "nvfp4")]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
    assert np.all(np.isfinite(np.asarray(dw))) and not np.array_equal(np.asarray(dw), np.asarray(dw_ref))


@pytest.mark.slow
def test_a_model_with_a_per_gemm_rule_has_finite_gradients():
  """The per-GEMM Roles table through the Flax model (Fp4DotGeneral), end to end (a minute: slow)."""
  config = _tiny(precision=[("*/down", "recipe", {"wgrad": "mxfp8"}), ("*", "recipe")])
  model = LanguageModel(config, "nvfp4")
  tokens = jnp.zeros((1, 16), jnp.int32)
  params = model.init({"params": jax.random.key(0)}, tokens)["params"]
  g = jax.grad(lambda p: model.apply({"params": p}, tokens, targets_BxL=tokens,
                                     rngs={"fp4": jax.random.key(1)}))(params)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(nn.unbox(g)))


def test_two_recipes_keep_independent_keys(monkeypatch):
  """Each layer's stochastic-rounding key comes from its own module path: the layers of an nvfp4 + mxfp4
  model get the keys they get in an all-nvfp4 model, and no two layers share one."""
  import fp4jax.flax as fp4_flax
  seen = []
  real = fp4_flax.dot_general

  def spy(*args, recipe, key=None, **kw):
    seen.append((recipe.name, None if key is None else tuple(np.asarray(jax.random.key_data(key)).ravel())))
    return real(*args, recipe=recipe, key=key, **kw)

  monkeypatch.setattr(fp4_flax, "dot_general", spy)
  tokens = jnp.zeros((1, 16), jnp.int32)
  keys = {}
  for name, precision in (("mixed", [("*/out_proj", "mxfp4"), ("*", "recipe")]), ("plain", "all_fp4")):
    seen.clear()
    model = LanguageModel(_tiny(precision=precision), "nvfp4")
    params = model.init({"params": jax.random.key(0)}, tokens)["params"]
    seen.clear()
    model.apply({"params": params}, tokens, rngs={"fp4": jax.random.key(5)})
    keys[name] = list(seen)
  mixed = keys["mixed"]
  assert {r for r, _ in mixed} == {"nvfp4", "mxfp4"}
  assert len({k for _, k in mixed}) == len(mixed) == 12 and None not in {k for _, k in mixed}
  assert [k for _, k in mixed] == [k for _, k in keys["plain"]]     # by layer, whatever its recipe


@pytest.mark.slow   # covered by test_models_policy.py::test_model_routes_exactly_the_policy_layers_through_the_quantized_dot
def test_scanned_blocks_follow_the_rules():
  config = _tiny(pattern="M-M-M-M-", precision=[("blocks_{-2:}/*", "bf16"), ("*/out_proj", "mxfp8"),
                                                 ("*", "recipe")], bf16_last_blocks=0)
  assert block_groups(config) == [(0, 2, 3), (6, 2, 1)]
  scanned = config.replace(scan_blocks=True)
  params = LanguageModel(scanned, "nvfp4").init({"params": jax.random.key(0)}, jnp.zeros((1, 16), jnp.int32))
  assert precision_summary(scanned, "nvfp4", params["params"]) == precision_summary(config, "nvfp4") \
      == "nvfp4 9 layers, mxfp8 3, bf16 4 (blocks_{-2:}/*)"


class TestConfigFile:

  def _config(self, precision):
    from configs import tiny
    c = tiny.get_config()
    c.model.precision = precision
    return c

  def test_round_trips_through_config_json(self):
    from training import config as config_lib
    rule_list = [{"pattern": "blocks_*/mixer/out_proj", "recipe": "mxfp8"},
                 ("*/qkv", "recipe", {"fprop": "bf16"}),
                 {"pattern": "blocks_{-1:}/*", "recipe": recipes.nvfp4(rht=False, name="nvfp4_x")},
                 ("*", "recipe")]
    c = self._config(rule_list)
    plain = json.loads(json.dumps(config_lib.to_plain(c)))
    again = self._config(plain["model"]["precision"])
    m0, m1 = config_lib.resolve_model_config(c.model), config_lib.resolve_model_config(again.model)
    assert m0.precision == m1.precision and len(m0.precision) == 4
    assert json.loads(json.dumps(config_lib.to_plain(again))) == plain

  def test_rules_from_the_command_line_are_a_literal(self):
    from training import config as config_lib
    c = self._config("[('blocks_*/mixer/out_proj', 'mxfp8'), ('*', 'recipe')]")
    m = config_lib.resolve_model_config(c.model)
    assert [r.pattern for r in m.precision] == ["blocks_*/mixer/out_proj", "*"]
    with pytest.raises(PrecisionRuleError, match="is not a Python literal list of rules"):
      rules.parse("[('*/qkv', 'bf16'")

  def test_bad_precision_is_a_config_error(self):
    from training import config as config_lib
    from training.errors import ConfigError
    with pytest.raises(ConfigError, match="config.model.precision: precision rule '\\*/qkv': unknown recipe 'nvfp5'"):
      config_lib.resolve_model_config(self._config([("*/qkv", "nvfp5")]).model)

  def test_resume_with_another_policy_is_refused(self, tmp_path):
    from training import workdir as workdir_lib
    from training.errors import ConfigChangedError
    workdir_lib.record_config(str(tmp_path), self._config(None), step=0, event="start")
    workdir_lib.check_resume(str(tmp_path), self._config(None), 10)
    with pytest.raises(ConfigChangedError, match="model.precision: None -> 'nemotron3_super'"):
      workdir_lib.check_resume(str(tmp_path), self._config("nemotron3_super"), 10)
    allowed = self._config("nemotron3_super")
    allowed.allow_config_change = True
    assert workdir_lib.check_resume(str(tmp_path), allowed, 10).messages
    # A run recorded before config.model.precision existed resumes with the default.
    plain = json.loads((tmp_path / "config.json").read_text())
    del plain["model"]["precision"]
    (tmp_path / "config.json").write_text(json.dumps(plain))
    workdir_lib.check_resume(str(tmp_path), self._config(None), 10)
