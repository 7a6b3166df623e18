"""Multi-token prediction (models.mtp): the depths' inputs and targets on a hand-checked window, the parameter
tree, the loss against a direct computation from the depths' logits (targets shifted by d + 1, the last d
positions masked), gradients into every MTP parameter, the precision policy on MTP layers, a few train steps,
and the export under the names vLLM's NemotronH MTP loader reads, round-tripped bit-exactly."""
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from models import LanguageModel, ModelConfig, hf, mtp, policy
from models.lm import Block
from training import step as step_lib

BASE = dict(vocab_size=64, d_model=32, pattern="M*-", mlp_dim=48, n_heads=4, n_kv_heads=2, head_dim=8, d_state=8,
            ssm_head_dim=8, chunk_size=4, dtype=jnp.float32, mtp_depths=2, mtp_pattern="*")
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
CONFIG = ModelConfig(**BASE)


def _init(config, seed=0, length=8):
  model = LanguageModel(config)
  variables = model.init({"params": jax.random.key(seed), "fp4": jax.random.key(seed)}, jnp.zeros((1, length), jnp.int32))
  return model, nn.unbox(variables["params"])


def _window(config, batch=2, length=12, seed=0):
  tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length + 1))
  return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _flat(params):
  return {"/".join(k): v for k, v in traverse_util.flatten_dict(params).items()}


def test_depth_inputs_on_a_hand_checked_window():
  # window t0..t5 = 10..15: targets (token t+1 at position t) are 11..15
  targets = jnp.asarray([[11, 12, 13, 14, 15]], jnp.int32)
  tokens, tgt, w = mtp.depth_inputs(targets, 1)     # position t embeds t+1, predicts t+2
  np.testing.assert_array_equal(tokens, [[11, 12, 13, 14, 15]])
  np.testing.assert_array_equal(tgt, [[12, 13, 14, 15, 0]])
  np.testing.assert_array_equal(w, [[1, 1, 1, 1, 0]])
  tokens, tgt, w = mtp.depth_inputs(targets, 2)     # embeds t+2, predicts t+3
  np.testing.assert_array_equal(tokens, [[12, 13, 14, 15, 0]])
  np.testing.assert_array_equal(tgt, [[13, 14, 15, 0, 0]])
  np.testing.assert_array_equal(w, [[1, 1, 1, 0, 0]])


def test_depth_weights_under_document_masking():
  """Next-token weight 0 where token t+1 starts a document: depth d's target t+d+1 counts only when no
  document starts after t up to it."""
  targets = jnp.asarray([[11, 12, 13, 14, 15, 16]], jnp.int32)
  next_token = jnp.asarray([[1, 1, 0, 1, 1, 1]])             # token 3 starts the second document
  np.testing.assert_array_equal(mtp.depth_inputs(targets, 1, next_token)[2], [[1, 0, 0, 1, 1, 0]])
  np.testing.assert_array_equal(mtp.depth_inputs(targets, 2, next_token)[2], [[0, 0, 0, 1, 0, 0]])


def test_objective_is_main_plus_weight_times_mean_over_depths():
  c = CONFIG.replace(mtp_loss_weight=0.5)
  value = mtp.objective(c, jnp.float32(2.0), (jnp.float32(3.0), jnp.float32(5.0)))
  assert float(value) == 2.0 + 0.5 * 4.0
  assert float(mtp.objective(c, jnp.float32(2.0), ())) == 2.0


def test_parameter_tree_of_the_mtp_modules():
  _, params = _init(CONFIG.replace(mtp_pattern="*-"))
  D = CONFIG.d_model
  for m in ("mtp_0", "mtp_1"):
    flat = {k[len(m) + 1:]: v.shape for k, v in _flat(params).items() if k.startswith(m + "/")}
    assert flat == {"enorm/scale": (D,), "hnorm/scale": (D,), "eh_proj/kernel": (2 * D, D), "final_norm/scale": (D,),
                    "layers_0/norm/scale": (D,), "layers_0/mixer/qkv/kernel": (D, 2 * (2 + 2) * 8),
                    "layers_0/mixer/out/kernel": (4 * 8, D), "layers_1/norm/scale": (D,),
                    "layers_1/mixer/up/kernel": (D, 48), "layers_1/mixer/down/kernel": (48, D)}
  _, shared = _init(CONFIG.replace(mtp_depths=3, mtp_share_depths=True))
  assert sorted({k.split("/")[0] for k in _flat(shared) if k.startswith("mtp_")}) == ["mtp_0"]
  _, off = _init(CONFIG.replace(mtp_depths=0))
  assert set(_flat(off)) == {k for k in _flat(params) if not k.startswith("mtp_")}


@pytest.mark.parametrize("depths, share", [(0, False), (2, False), (3, True)])
def test_inactive_params_count_the_idle_experts_of_the_mtp_modules(depths, share):
  """moe.inactive_params against the parameter tree: (E - k) / E of every routed-expert kernel, main and MTP."""
  from models import moe   # pylint: disable=import-outside-toplevel
  config = CONFIG.replace(pattern="ME*", mtp_pattern="*E", mtp_depths=depths, mtp_share_depths=share, **MOE)
  params = jax.eval_shape(lambda: _init(config)[1])
  kernels = [v.size for k, v in _flat(params).items() if "/experts/" in k]
  assert len(kernels) == 2 * (1 + config.mtp_modules)
  idle = config.n_routed_experts - config.num_experts_per_tok
  assert moe.inactive_params(config) == sum(n // config.n_routed_experts * idle for n in kernels)


@pytest.mark.parametrize("share", [pytest.param(False, marks=pytest.mark.slow), True])
def test_loss_is_the_masked_cross_entropy_of_each_depths_logits(share):
  config = CONFIG.replace(mtp_share_depths=share)
  model, params = _init(config)
  inputs, targets = _window(config)
  L = inputs.shape[1]
  main, collections = model.apply({"params": params}, inputs, targets_BxL=targets, mutable=[mtp.LOSSES])
  losses = mtp.sown_losses(collections)
  assert len(losses) == config.mtp_depths
  logits, depth_logits = model.apply({"params": params}, inputs, mtp_logits=True)
  window = np.concatenate([np.asarray(inputs), np.asarray(targets)[:, -1:]], axis=1)   # t_0 .. t_L
  ce = lambda lg, tg: optax.softmax_cross_entropy_with_integer_labels(lg, jnp.asarray(tg))
  np.testing.assert_allclose(main, jnp.mean(ce(logits, window[:, 1:])), rtol=2e-6)
  for d, (loss, lg) in enumerate(zip(losses, depth_logits), start=1):
    valid = L - d                       # position t predicts t + d + 1 <= L
    expected = jnp.mean(ce(lg[:, :valid], window[:, d + 1:]))
    np.testing.assert_allclose(loss, expected, rtol=2e-6)
  # The main loss is the model's without MTP (the same parameters less mtp_*).
  base = {k: v for k, v in params.items() if not k.startswith("mtp_")}
  alone = LanguageModel(config.replace(mtp_depths=0)).apply({"params": base}, inputs, targets_BxL=targets)
  np.testing.assert_array_equal(main, alone)


def test_document_masking_masks_every_depths_loss_and_reaches_its_blocks():
  """With segment ids and the next-token weights, each depth's loss is the cross entropy of its logits (the
  depths' blocks given the segment ids) over the positions whose target lies in the position's document."""
  model, params = _init(CONFIG)
  inputs, targets = _window(CONFIG)
  seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 8], 2, axis=0), jnp.int32)    # window of 13: documents 5 + 8
  next_token = seg[:, :-1] == seg[:, 1:]
  docs = dict(segment_ids_BxL=seg[:, :-1])
  main, collections = model.apply({"params": params}, inputs, targets_BxL=targets, target_weights_BxL=next_token,
                                  mutable=[mtp.LOSSES], **docs)
  logits, depth_logits = model.apply({"params": params}, inputs, mtp_logits=True, **docs)
  plain = model.apply({"params": params}, inputs, mtp_logits=True)[1]
  assert not np.allclose(depth_logits[0][:, 5:], plain[0][:, 5:])   # the depth's attention saw the first document
  window = np.concatenate([np.asarray(inputs), np.asarray(targets)[:, -1:]], axis=1)
  ce = lambda lg, tg: optax.softmax_cross_entropy_with_integer_labels(lg, jnp.asarray(tg))
  masked_mean = lambda lg, tg, w: jnp.sum(w * ce(lg, tg)) / jnp.sum(w)
  np.testing.assert_allclose(main, masked_mean(logits, window[:, 1:], next_token), rtol=2e-6)
  L = inputs.shape[1]
  for d, (loss, lg) in enumerate(zip(mtp.sown_losses(collections), depth_logits), start=1):
    t = np.arange(L - d)
    in_document = np.asarray(seg)[:, t] == np.asarray(seg)[:, t + d + 1]
    np.testing.assert_allclose(loss, masked_mean(lg[:, :L - d], window[:, d + 1:], in_document), rtol=2e-6)


def test_masked_positions_do_not_reach_the_loss():
  """What sits past the end at depth d (the padding of its shifted inputs) changes no loss: causal blocks."""
  model, params = _init(CONFIG)
  inputs, targets = _window(CONFIG)
  _, ref = model.apply({"params": params}, inputs, targets_BxL=targets, mutable=[mtp.LOSSES])
  h = jnp.ones((2, inputs.shape[1], CONFIG.d_model))
  e = jax.random.normal(jax.random.key(3), h.shape)
  depth = mtp.MTPDepth(CONFIG, Block, name="mtp_0")
  out = depth.apply({"params": params["mtp_0"]}, h, e)
  e2 = e.at[:, -2:].set(7.0)                   # change only the last two positions' embeddings
  out2 = depth.apply({"params": params["mtp_0"]}, h, e2)
  np.testing.assert_array_equal(out[:, :-2], out2[:, :-2])
  assert not np.array_equal(out[:, -2:], out2[:, -2:])
  assert len(mtp.sown_losses(ref)) == 2


@pytest.mark.slow   # ~38 s idle (AMD EPYC); the masked loss of each depth runs by default
def test_gradients_reach_every_mtp_parameter():
  config = CONFIG.replace(mtp_pattern="*E", **MOE)
  model = LanguageModel(config, "bf16")
  tx = optax.adamw(1.0)
  state = step_lib.init_state(model, tx, 0, 8)
  params = nn.unbox(state["params"])
  inputs, targets = _window(config)
  grads = jax.grad(lambda p: step_lib.model_loss_and_stats(model, p, inputs, targets, jax.random.key(0))[0])(params)
  flat = _flat(grads)
  mtp_grads = {k: v for k, v in flat.items() if k.startswith("mtp_")}
  assert len(mtp_grads) > 10
  for k, g in mtp_grads.items():
    if k.endswith("e_score_correction_bias"):     # moved by the balance update, not a gradient
      continue
    assert float(jnp.abs(g).max()) > 0, k
  # The evaluation loss is the next-token loss alone: no gradient reaches the MTP modules.
  eval_grads = _flat(jax.grad(lambda p: step_lib.model_loss(model, p, inputs, targets, jax.random.key(0)))(params))
  assert all(float(jnp.abs(v).max()) == 0 for k, v in eval_grads.items() if k.startswith("mtp_"))


def test_super_policy_keeps_mtp_layers_in_bf16_and_all_fp4_quantizes_them():
  config = CONFIG.replace(pattern="M*E", mtp_pattern="*E", **MOE)
  _, params = _init(config)
  linear = sorted({k.rsplit("/", 1)[0] for k in _flat(params) if k.startswith("mtp_") and k.endswith("/kernel")
                   and "router" not in k})
  linear += ["mtp_0/layers_1/mixer/experts/up", "mtp_1/layers_1/mixer/experts/down"]
  assert "mtp_0/eh_proj" in linear and "mtp_1/layers_0/mixer/qkv" in linear
  super_ = config.replace(precision="nemotron3_super")
  assert {policy.layer_precision(super_, "nvfp4", p) for p in linear} == {"bf16"}
  assert {policy.layer_precision(config, "nvfp4", p) for p in linear} == {"bf16"}        # nemotron_h: MTP in bf16
  all_fp4 = config.replace(precision="all_fp4")
  assert {policy.layer_precision(all_fp4, "nvfp4", p) for p in linear} == {"nvfp4"}


@pytest.mark.slow   # ~25 s idle; by default every MTP parameter gets a gradient (above)
def test_a_few_train_steps_lower_both_losses_and_log_them():
  model = LanguageModel(CONFIG, "nvfp4")
  tx = optax.adam(1.0)   # train_step scales by lr_fn
  state = step_lib.init_state(model, tx, 0, 16)
  state = dict(state, params=nn.unbox(state["params"]))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (4, 17)), jnp.int32)   # a small vocabulary in use
  step = jax.jit(lambda s, t: step_lib.train_step(s, t, model=model, tx=tx, lr_fn=lambda _: 3e-3))
  history = []
  for _ in range(8):
    state, metrics = step(state, tokens)
    history.append({k: float(v) for k, v in metrics.items()})
  first, last = history[0], history[-1]
  assert {"loss", "objective", "mtp/loss", "mtp/loss_1", "mtp/loss_2"} <= set(first)
  np.testing.assert_allclose(first["objective"], first["loss"] + 0.3 * first["mtp/loss"], rtol=1e-6)
  np.testing.assert_allclose(first["mtp/loss"], (first["mtp/loss_1"] + first["mtp/loss_2"]) / 2, rtol=1e-6)
  assert last["loss"] < first["loss"] - 0.5 and last["mtp/loss"] < first["mtp/loss"] - 0.5


def test_sampling_logits_ignore_the_mtp_heads():
  model, params = _init(CONFIG)
  inputs, _ = _window(CONFIG)
  base = {k: v for k, v in params.items() if not k.startswith("mtp_")}
  ours = model.apply({"params": params}, inputs)
  alone = LanguageModel(CONFIG.replace(mtp_depths=0)).apply({"params": base}, inputs)
  np.testing.assert_array_equal(ours, alone)


# ------------------------------------------------------------------------------------------------- export

EXPORT = ModelConfig(**{**BASE, "pattern": "M*E", "mtp_depths": 1, "mtp_pattern": "*E", **MOE})


def _expected_mtp_names(c):
  """The MTP tensors vLLM's NemotronHMTP.load_weights maps onto its modules
  (vllm/model_executor/models/nemotron_h_mtp.py): layers mtp.layers.<i>, i < num_nextn_predict_layers x
  len(mtp_hybrid_override_pattern); the first of a module has enorm, hnorm, eh_proj (hidden_size * 2 ->
  hidden_size); the last final_layernorm; attention q_proj/k_proj/v_proj (stacked into qkv_proj), o_proj and
  the decoder layer's norm; MoE gate.weight (+ e_score_correction_bias), experts.<e>.up_proj/down_proj (its
  expert mapping, non-gated), shared_experts.up_proj/down_proj. Shapes: torch Linear [out, in]."""
  D, H, K, P, E = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.n_routed_experts
  F, S = c.moe_intermediate_size, c.moe_shared_expert_intermediate_size
  return {
      "mtp.layers.0.enorm.weight": (D,), "mtp.layers.0.hnorm.weight": (D,), "mtp.layers.0.eh_proj.weight": (D, 2 * D),
      "mtp.layers.0.norm.weight": (D,), "mtp.layers.0.mixer.q_proj.weight": (H * P, D),
      "mtp.layers.0.mixer.k_proj.weight": (K * P, D), "mtp.layers.0.mixer.v_proj.weight": (K * P, D),
      "mtp.layers.0.mixer.o_proj.weight": (D, H * P),
      "mtp.layers.1.norm.weight": (D,), "mtp.layers.1.mixer.gate.weight": (E, D),
      "mtp.layers.1.mixer.gate.e_score_correction_bias": (E,),
      **{f"mtp.layers.1.mixer.experts.{e}.up_proj.weight": (F, D) for e in range(E)},
      **{f"mtp.layers.1.mixer.experts.{e}.down_proj.weight": (D, F) for e in range(E)},
      "mtp.layers.1.mixer.shared_experts.up_proj.weight": (S, D),
      "mtp.layers.1.mixer.shared_experts.down_proj.weight": (D, S),
      "mtp.layers.1.final_layernorm.weight": (D,)}


def _random_params(config, seed=0):
  _, params = _init(config, seed)
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def test_export_names_and_shapes_are_vllms():
  params = _random_params(EXPORT)
  tensors = hf.to_hf(params, EXPORT)
  ours = {k: v.shape for k, v in tensors.items() if k.startswith("mtp.")}
  assert ours == _expected_mtp_names(EXPORT)
  assert "backbone.embeddings.weight" in tensors and "lm_head.weight" in tensors   # shared with the MTP module
  config = hf.to_hf_config(EXPORT)
  assert config["num_nextn_predict_layers"] == 1 and config["mtp_hybrid_override_pattern"] == "*E"
  assert config["mtp_layers_block_type"] == ["full_attention", "moe"]
  # eh_proj's input is [enorm(embedding) | hnorm(hidden)]: its first D columns act on the embedding.
  np.testing.assert_array_equal(tensors["mtp.layers.0.eh_proj.weight"],
                                np.asarray(params["mtp_0"]["eh_proj"]["kernel"]).T)


def test_shared_depths_export_one_module_and_unshared_number_the_layers_on():
  shared = EXPORT.replace(mtp_depths=3, mtp_share_depths=True)
  assert hf.to_hf_config(shared)["num_nextn_predict_layers"] == 1
  assert {k for k in hf.to_hf(_random_params(shared), shared) if k.startswith("mtp.")} == set(_expected_mtp_names(EXPORT))
  two = EXPORT.replace(mtp_depths=2)
  names = {k for k in hf.to_hf(_random_params(two), two) if k.startswith("mtp.")}
  assert "mtp.layers.2.eh_proj.weight" in names and "mtp.layers.3.final_layernorm.weight" in names
  assert hf.to_hf_config(two)["num_nextn_predict_layers"] == 2


def test_export_import_round_trip_is_bit_exact(tmp_path):
  params = _random_params(EXPORT)
  config = hf.to_hf_config(EXPORT)
  hf.save_hf_tensors(str(tmp_path), hf.to_hf(params, EXPORT))
  back_config = hf.from_hf_config(json.loads(json.dumps(config)), dtype=jnp.float32)
  assert back_config == EXPORT
  back = hf.from_hf(hf.load_hf_tensors(str(tmp_path)), back_config)
  hf.check_params(back, params)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))
  # Without our fp4jax entry the Nemotron-H fields alone give the same MTP config.
  plain = hf.from_hf_config({k: v for k, v in config.items() if k != "fp4jax"}, dtype=jnp.float32)
  assert (plain.mtp_depths, plain.mtp_pattern, plain.mtp_share_depths) == (1, "*E", False)


def test_export_refuses_an_mtp_pattern_vllm_cannot_build():
  with pytest.raises(hf.ConversionError, match="vLLM's NemotronH MTP loader"):
    hf.to_hf_config(CONFIG.replace(mtp_pattern="*-"))


@pytest.mark.slow   # covered by the per-expert export: test_moe_hf.py::test_nvfp4_export_covers_the_experts_bit_identical_to_training
def test_nvfp4_export_of_quantized_mtp_experts_is_per_expert():
  config = EXPORT.replace(precision="all_fp4")
  tensors, excluded = hf.to_hf_nvfp4(_random_params(config), config, "nvfp4")
  assert "mtp.layers.1.mixer.experts.3.down_proj.weight_scale" in tensors
  assert tensors["mtp.layers.1.mixer.experts.0.up_proj.weight"].dtype == np.uint8
  paths = hf.quantized_paths(config, "nvfp4")
  assert ("mtp_0", "eh_proj") in paths
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 8))
  amax = hf.calibration_amax(LanguageModel(config, "nvfp4"), _random_params(config), tokens, paths)
  assert amax[("mtp_0", "eh_proj")] > 0
  super_ = EXPORT.replace(precision="nemotron3_super")
  tensors, excluded = hf.to_hf_nvfp4(_random_params(super_), super_, "nvfp4")
  assert "mtp.layers.0.eh_proj" in excluded and "mtp.layers.1.mixer.shared_experts.up_proj" in excluded
  assert {k for k in tensors if k.startswith("mtp.")} == set(_expected_mtp_names(EXPORT))


def test_transformers_loads_the_checkpoint_and_ignores_the_mtp_layers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = EXPORT.replace(pattern="M*-")
  params = _random_params(config)
  hf.save_safetensors(os.path.join(tmp_path, "model.safetensors"), hf.to_hf(params, config), {"format": "pt"})
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(hf.to_hf_config(config, eos_token_id=0), f)
  theirs = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
  ours = np.asarray(LanguageModel(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
  with torch.no_grad():
    logits = theirs(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4)
