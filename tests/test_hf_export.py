"""Export to / import from Hugging Face Nemotron-H: transformers is the judge of the layout, NVFP4 export is
bit-exact against the training forward pass, the round trip is exact, bad input gets a clear error."""
import dataclasses
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import inputs
import fp4jax
import sample
from models import LanguageModel, ModelConfig, hf
from models.lm import scanned_params
from tools import hf as hf_cli
from tools import runs

# Every block kind, two SSM groups (the in_proj / conv permutations), GQA with 2 queries per KV head,
# sequences longer than the SSD chunk. in_proj has 2*64 + 2*2*8 + 8 = 168 outputs: not whole 16x16 tiles.
CONFIG = ModelConfig(vocab_size=96, d_model=32, pattern="M*-M-", mlp_dim=64, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_groups=2, d_state=8, ssm_head_dim=8, expand=2, chunk_size=4,
                     dtype=jnp.float32, bf16_last_blocks=1)


def _params(config=CONFIG, seed=0):
  model = LanguageModel(config)
  params = nn.unbox(model.init({"params": jax.random.key(seed)}, jnp.zeros((1, 8), jnp.int32))["params"])
  # Weights larger than the init and non-trivial A_log/D/dt_bias/norms, so every tensor matters.
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [p * 4.0 if p.ndim == 2 else p + 0.3 * inputs.normal(k, p.shape) for p, k in zip(leaves, keys)]
  return model, jax.tree_util.tree_unflatten(tree, leaves)


def _write_hf(directory, params, config=CONFIG):
  os.makedirs(directory, exist_ok=True)
  hf.save_safetensors(os.path.join(directory, "model.safetensors"), hf.to_hf(params, config), {"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf.to_hf_config(config, eos_token_id=0), f)


# ------------------------------------------------------------------------------ transformers as the judge

@pytest.mark.slow   # covered by transformers' logits: test_moe_hf.py::test_transformers_logits_and_choices_equal_ours
def test_transformers_logits_equal_ours(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model, params = _params()
  _write_hf(tmp_path, params)
  theirs = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 13))
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
  with torch.no_grad():
    got = theirs(torch.tensor(tokens)).logits.numpy()
  assert got.shape == ours.shape
  # float32 on both sides, different summation orders: 1e-4 of the logits' scale.
  np.testing.assert_allclose(got, ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
  # transformers' own decoding (its cache, its recurrent Mamba step) picks the same greedy tokens as ours.
  prompt = tokens[:1, :6]
  with torch.no_grad():
    generated = theirs.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0).numpy()[0, 6:]
  mine = sample.Generator(model, params, temperature=0.0).generate([prompt[0].astype(np.int32)], 8)[0]
  np.testing.assert_array_equal(generated, mine)


def test_hf_config_says_what_transformers_needs():
  config = hf.to_hf_config(CONFIG)
  assert config["model_type"] == "nemotron_h" and config["hybrid_override_pattern"] == "M*-M-"
  assert config["time_step_min"] == 0.0      # transformers clamps dt from below at this value
  assert config["mamba_num_heads"] * config["mamba_head_dim"] == CONFIG.d_inner
  assert hf.from_hf_config(config) == CONFIG
  del config["fp4jax"]                       # a foreign checkpoint: dimensions from the Nemotron-H fields
  foreign = hf.from_hf_config(config, dtype=jnp.float32, bf16_last_blocks=1)
  assert dataclasses.replace(foreign, dt_min=CONFIG.dt_min) == CONFIG


# ----------------------------------------------------------------------------------------------- NVFP4

def _decode_e4m3(bits_u8):
  """Independent E4M3 decoder: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals at exponent 0."""
  bits = bits_u8.astype(np.int64)
  sign = np.where(bits & 0x80, -1.0, 1.0)
  exp, man = (bits >> 3) & 0xF, bits & 0x7
  value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
  assert not np.any((exp == 0xF) & (man == 0x7)), "NaN scale"
  return sign * value


def _decode_e2m1_packed(packed_u8):
  """Independent E2M1 decoder of ModelOpt's packing: element 2j in the low nibble, 2j+1 in the high."""
  magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  codes = np.stack([packed_u8 & 0xF, packed_u8 >> 4], axis=-1).reshape(packed_u8.shape[0], -1)
  return np.where(codes & 8, -1.0, 1.0) * magnitudes[codes & 7]


def _training_fprop_weight(kernel_KxN, config):
  """What fp4jax.dot's forward pass multiplies with: W cast to the compute dtype, as (N, K), zero-padded
  to whole tiles, quantized in 16x16 tiles (fp4jax.dot docs: fprop weight operand)."""
  w_NxK = jnp.asarray(kernel_KxN).astype(config.dtype).T
  N, K = w_NxK.shape
  return fp4jax.quantize(jnp.pad(w_NxK, ((0, -N % 16), (0, -K % 16))), "nvfp4", tile=(16, 16)), N, K


@pytest.fixture(scope="module")
def nvfp4_export():
  _, params = _params()
  return params, *hf.to_hf_nvfp4(params, CONFIG, "nvfp4")


def test_nvfp4_layout_is_modelopts(nvfp4_export):
  _, tensors, excluded = nvfp4_export
  # Blocks 0-3 run in NVFP4, block 4 (bf16_last_blocks=1) and the LM head stay in bf16.
  assert excluded == ["backbone.layers.4.mixer.up_proj", "backbone.layers.4.mixer.down_proj", "lm_head"]
  q = "backbone.layers.0.mixer.in_proj"
  assert tensors[q + ".weight"].dtype == np.uint8 and tensors[q + ".weight"].shape == (168, 16)
  assert tensors[q + ".weight_scale"].dtype == ml_dtypes.float8_e4m3fn
  assert tensors[q + ".weight_scale"].shape == (168, 2)
  assert tensors[q + ".weight_scale_2"].dtype == np.float32 and tensors[q + ".weight_scale_2"].shape == ()
  assert tensors["lm_head.weight"].dtype == ml_dtypes.bfloat16
  for name in ("q_proj", "k_proj", "v_proj"):   # split from one fused weight: one tensor scale
    assert tensors[f"backbone.layers.1.mixer.{name}.weight_scale_2"] == tensors[
        "backbone.layers.1.mixer.q_proj.weight_scale_2"]
  hf_quant, quantization_config = hf.nvfp4_quant_configs(excluded, producer_version="0")
  assert hf_quant["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                      "exclude_modules": sorted(excluded)}
  assert quantization_config["quant_method"] == "modelopt" and quantization_config["ignore"] == sorted(excluded)


def test_nvfp4_export_is_the_training_forward_weight_bit_exactly(nvfp4_export):
  params, tensors, _ = nvfp4_export
  linears, _ = hf.layout(CONFIG)
  quantized = hf.quantized_paths(CONFIG, "nvfp4")
  assert len(quantized) == 8
  # The training weights in Nemotron-H layout: each quantized kernel replaced by its fprop e2m1 * scale
  # (fp4jax.dequantize with the tensor factor set to 1: amax = 6 * 448 decodes the block products exactly).
  unit, with_amax, amaxes = {}, {}, {}
  for path in quantized:
    kernel = params
    for key in path:
      kernel = kernel[key]
    q, N, K = _training_fprop_weight(kernel["kernel"], CONFIG)
    amaxes[path] = np.float32(q.amax)
    unit_q = dataclasses.replace(q, amax=jnp.float32(2688.0))
    unit[path] = {"kernel": np.asarray(fp4jax.dequantize(unit_q, jnp.float32))[:N, :K].T}
    with_amax[path] = {"kernel": np.asarray(fp4jax.dequantize(q, jnp.float32))[:N, :K].T}
  as_tree = lambda replaced: jax.tree_util.tree_map_with_path(
      lambda kp, leaf: _lookup(replaced, kp, leaf), params)
  reference_unit = hf.to_hf(as_tree(unit), CONFIG, np.float64)
  reference_values = hf.to_hf(as_tree(with_amax), CONFIG, np.float32)
  for lin in linears:
    if lin.path not in quantized:
      continue
    module = lin.hf_name[:-len(".weight")]
    codes, scales = tensors[module + ".weight"], tensors[module + ".weight_scale"]
    # 1. Independent numpy decoder: e2m1(code) * e4m3(scale) equals the training block products bit for bit.
    blocks = np.repeat(_decode_e4m3(scales.view(np.uint8)), 16, axis=1)
    np.testing.assert_array_equal(_decode_e2m1_packed(codes) * blocks, reference_unit[lin.hf_name])
    # 2. The tensor scale is ModelOpt's amax / (6 * 448) of the training amax.
    assert tensors[module + ".weight_scale_2"] == amaxes[lin.path] / np.float32(2688.0)
    # 3. fp4jax reads the exported 1x16 blocks back to the training forward weights, bit for bit.
    rows, k = codes.shape[0], codes.shape[1] * 2
    probe = fp4jax.quantize(jnp.zeros((rows, k), jnp.float32), "nvfp4")
    exported = dataclasses.replace(probe, data=jnp.asarray(codes), scale=jnp.asarray(scales),
                                   amax=jnp.float32(amaxes[lin.path]))
    np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(exported, jnp.float32)),
                                  reference_values[lin.hf_name])


def _lookup(replaced, keypath, leaf):
  path = tuple(k.key for k in keypath)
  if path[:-1] in replaced and path[-1] == "kernel":
    return replaced[path[:-1]]["kernel"]
  return leaf


def test_nvfp4_is_a_quarter_plus_scales(nvfp4_export):
  _, tensors, _ = nvfp4_export
  q = "backbone.layers.0.mixer.in_proj"
  fp4_bytes = sum(tensors[q + s].nbytes for s in (".weight", ".weight_scale", ".weight_scale_2"))
  assert fp4_bytes == 168 * 32 // 2 + 168 * 32 // 16 + 4     # 4.5 bits per weight, plus one float


# ------------------------------------------------------------------------------------------- round trip

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  _, params = _params()
  config = runs.training_config(CONFIG, name="hf_test")
  runs.write_run(workdir, config, params)
  return workdir


def test_export_import_round_trip_is_exact(run_dir, tmp_path, capsys):
  assert hf_cli.main(["export", "--workdir", run_dir, "--out", str(tmp_path / "hf")]) == 0
  assert hf_cli.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
  capsys.readouterr()
  before, after = runs.load_run(run_dir), runs.load_run(str(tmp_path / "back"))
  assert after.model_config == before.model_config
  assert after.config.recipe == before.config.recipe and after.config.data.tokenizer == "byte"
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               before.params, after.params)


def test_export_of_a_scanned_run_equals_the_per_block_export(tmp_path, capsys):
  config = CONFIG.replace(pattern="M*-M*-", bf16_last_blocks=0)
  _, params = _params(config)
  stacked = scanned_params(params, config)
  assert set(stacked) != set(params)   # the scanned run really stores stacked groups
  runs.write_run(str(tmp_path / "a"), runs.training_config(config, name="a"), params)
  runs.write_run(str(tmp_path / "b"), runs.training_config(config.replace(scan_blocks=True), name="b"), stacked)
  for name in ("a", "b"):
    assert hf_cli.main(["export", "--workdir", str(tmp_path / name), "--out", str(tmp_path / f"hf_{name}")]) == 0
  capsys.readouterr()
  per_block, scanned = hf.load_hf_tensors(str(tmp_path / "hf_a")), hf.load_hf_tensors(str(tmp_path / "hf_b"))
  assert sorted(per_block) == sorted(scanned)
  for name, tensor in per_block.items():
    np.testing.assert_array_equal(scanned[name], tensor)


def test_sharded_weights_round_trip(tmp_path):
  _, params = _params()
  tensors = hf.to_hf(params, CONFIG)
  files = hf.save_hf_tensors(str(tmp_path), tensors, max_shard_bytes=20_000)
  assert len(files) > 3 and files[-1] == "model.safetensors.index.json"
  back = hf.load_hf_tensors(str(tmp_path))
  assert sorted(back) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(back[name], value)


@pytest.mark.slow   # covered by the NVFP4 export: test_nvfp4_layout_is_modelopts; the CLI: test_export_import_round_trip_is_exact
def test_nvfp4_cli_writes_modelopt_files(run_dir, tmp_path, capsys):
  text = tmp_path / "calib.txt"
  text.write_text("def f(x):\n    return x * 2\n" * 40)
  out = tmp_path / "nvfp4"
  assert hf_cli.main(["export", "--workdir", run_dir, "--out", str(out), "--format", "nvfp4",
                      "--calib_file", str(text)]) == 0
  assert "8 linear layers in NVFP4" in capsys.readouterr().out
  config = json.loads((out / "config.json").read_text())
  assert config["quantization_config"]["quant_algo"] == "NVFP4"
  assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["group_size"] == 16
  tensors = hf.load_safetensors(str(out / "model.safetensors"))
  scale = tensors["backbone.layers.0.mixer.in_proj.input_scale"]
  assert scale.dtype == np.float32 and scale.shape == () and scale > 0
  assert "backbone.layers.4.mixer.up_proj.input_scale" not in tensors


def test_byte_tokenizer_exports_as_a_standard_tokenizer(run_dir, tmp_path):
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("tokenizers")
  assert hf_cli.main(["export", "--workdir", run_dir, "--out", str(tmp_path / "hf")]) == 0
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  text = "def f(x):\n\treturn 'héllo wörld'  # ✓\n"
  assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
  assert tokenizer.decode(list(text.encode("utf-8"))) == text
  assert tokenizer.eos_token_id == 0


# ------------------------------------------------------------------------------------------- bad input

def test_import_rejects_other_architectures(tmp_path):
  config = hf.to_hf_config(CONFIG)
  with pytest.raises(hf.ConversionError, match="model_type='llama'"):
    hf.from_hf_config(dict(config, model_type="llama"))
  moe = dict(config, hybrid_override_pattern="ME", layers_block_type=["linear_attention", "moe"],
             n_shared_experts=2)   # MoE imports (tests/test_moe_hf.py), but only with one shared expert
  del moe["fp4jax"]
  with pytest.raises(hf.ConversionError, match="n_shared_experts=2"):
    hf.from_hf_config(moe)
  with pytest.raises(hf.ConversionError, match="quant_algo='FP8'"):   # NVFP4 imports: test_nvfp4_import_*
    hf.from_hf_config(dict(config, quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}))
  with pytest.raises(hf.ConversionError, match="biases"):
    hf.from_hf_config(dict(config, attention_bias=True))


def test_import_rejects_missing_and_foreign_tensors(tmp_path):
  _, params = _params()
  tensors = hf.to_hf(params, CONFIG)
  missing = dict(tensors)
  del missing["backbone.layers.0.mixer.A_log"]
  with pytest.raises(hf.ConversionError, match="lacks 'backbone.layers.0.mixer.A_log'"):
    hf.from_hf(missing, CONFIG)
  with pytest.raises(hf.ConversionError, match="no place"):   # expert tensors for a dense config
    hf.from_hf(dict(tensors, **{"backbone.layers.2.mixer.experts.0.up_proj.weight": np.zeros((2, 2))}), CONFIG)
  for name in ("backbone.layers.0.mixer.in_proj.weight", "backbone.layers.1.mixer.k_proj.weight",
               "backbone.layers.0.mixer.conv1d.weight"):
    with pytest.raises(hf.ConversionError, match=f"{name} has shape"):
      hf.from_hf(dict(tensors, **{name: np.zeros((10, 32), np.float32)}), CONFIG)
  with pytest.raises(hf.ConversionError, match="no place"):
    hf.from_hf(dict(tensors, **{"backbone.extra.weight": np.zeros(2)}), CONFIG)
  renamed = {k.replace("backbone.", "model."): v for k, v in tensors.items()}   # transformers 5 naming
  jax.tree.map(np.testing.assert_array_equal, hf.from_hf(renamed, CONFIG), jax.tree.map(np.asarray, params))


def test_cli_bad_input(tmp_path, capsys):
  assert hf_cli.main(["import", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
  assert "is not a directory" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert hf_cli.main(["import", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
  assert "config.json is missing" in capsys.readouterr().err
  (tmp_path / "empty" / "config.json").write_text(json.dumps(hf.to_hf_config(CONFIG)))
  assert hf_cli.main(["import", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
  assert "no model.safetensors" in capsys.readouterr().err
  assert hf_cli.main(["export", "--workdir", str(tmp_path / "norun"), "--out", str(tmp_path / "y")]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_export_rejects_what_nemotron_h_cannot_express():
  with pytest.raises(hf.ConversionError, match="rope"):
    hf.to_hf_config(CONFIG.replace(rope=True))
  with pytest.raises(hf.ConversionError, match="relu2"):
    hf.to_hf_config(CONFIG.replace(mlp_kind="swiglu"))
  with pytest.raises(hf.ConversionError, match="forward pass in bf16"):
    hf.quantized_paths(CONFIG, "bf16")


def test_library_training_and_sampling_never_import_torch():
  """In a fresh interpreter (this one has torch loaded by the tests above)."""
  code = ("import sys, fp4jax, models, models.hf, training, training.step, sample, tools.hf; "
          "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_import_of_a_checkpoint_transformers_wrote(tmp_path, capsys):
  """A foreign checkpoint: written by transformers' save_pretrained ("model." names, its own config.json
  with no fp4jax entry); once imported, our model computes transformers' logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.NemotronHConfig(
      vocab_size=80, hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp"],
      intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=8,
      mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4, layer_norm_epsilon=1e-5)
  theirs = transformers.NemotronHForCausalLM(config).eval()
  theirs.save_pretrained(str(tmp_path / "hf"))
  # This model never clamps dt; with time_step_min = 0 transformers does not either.
  saved = json.loads((tmp_path / "hf" / "config.json").read_text())
  (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(saved, time_step_min=0.0)))
  theirs = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
  assert hf_cli.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"),
                      "--dtype", "float32"]) == 0
  capsys.readouterr()
  run = runs.load_run(str(tmp_path / "run"))
  assert run.model_config.pattern == "M*-" and run.model_config.n_groups == 2
  tokens = np.random.default_rng(1).integers(0, 80, (2, 9))
  ours = np.asarray(LanguageModel(run.model_config).apply({"params": run.params}, jnp.asarray(tokens, jnp.int32)))
  with torch.no_grad():
    got = theirs(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())


# ---------------------------------------------------------------------------------------------- NVFP4 in

def _modelopt_nvfp4(w_NxK, amax):
  """NVFP4 as ModelOpt's NVFP4QTensor quantizes a weight (modelopt/torch/quantization/qtensor/nvfp4_tensor.py), in
  numpy float32: weight_scale_2 = amax / (6 * 448); a 1x16 block's scale = block amax / (6 * weight_scale_2),
  0 -> 1, clamped to [2^-9, 448], cast to E4M3; codes: |w| / (scale * weight_scale_2) against the E2M1 bounds
  (searchsorted, ties at 0.75, 1.75, 3.5 up to the even code), the sign in bit 3, element 2j in the low nibble."""
  n, k = w_NxK.shape
  scale_2 = np.float32(amax) / np.float32(2688.0)
  blocks = w_NxK.astype(np.float32).reshape(n, k // 16, 16)
  scale = np.abs(blocks).max(-1) / (np.float32(6.0) * scale_2)
  scale[scale == 0] = 1.0
  scale = np.clip(scale, 2.0 ** -9, 448.0).astype(ml_dtypes.float8_e4m3fn)
  magnitude = np.abs(blocks / (scale.astype(np.float32) * scale_2)[..., None]).reshape(n, k)
  bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  codes = (np.searchsorted(bounds, magnitude, side="left") + np.isin(magnitude, bounds[[1, 3, 5]])
           + 8 * (w_NxK < 0)).astype(np.uint8)
  return {"weight": (codes[:, 1::2] << 4) | codes[:, 0::2], "weight_scale": scale,
          "weight_scale_2": np.asarray(scale_2, np.float32)}


def _decoded(tensors):
  """The checkpoint with each NVFP4 weight decoded by the independent numpy decoders, e2m1 * e4m3 * scale_2 in
  float64 (exact: at most 30 significant bits), then rounded once to float32."""
  out = {n: v for n, v in tensors.items() if not n.endswith(("weight_scale", "weight_scale_2", "input_scale"))}
  for name in tensors:
    if name.endswith(".weight_scale"):
      module = name[:-len(".weight_scale")]
      blocks = np.repeat(_decode_e4m3(tensors[name].view(np.uint8)), 16, axis=1)
      scale_2 = np.float64(tensors[module + ".weight_scale_2"])
      out[module + ".weight"] = (_decode_e2m1_packed(tensors[module + ".weight"]) * blocks * scale_2).astype(np.float32)
  return out


def test_nvfp4_decode_is_the_rounded_exact_value_for_every_code_and_scale():
  """Every E4M3 scale (NaN aside) with every E2M1 code: the decoded float32 is e2m1 * scale * scale_2 rounded
  once, and fp4jax's block products (dequantize with the tensor amax 6 * 448) are e2m1 * scale exactly."""
  scale_bits = np.arange(256, dtype=np.uint8)
  scale_bits = scale_bits[(scale_bits & 0x7F) != 0x7F]
  scale_bits = scale_bits[scale_bits < 0x80]                       # ModelOpt's scales are not negative
  codes = np.tile(np.arange(16, dtype=np.uint8), (len(scale_bits), 1))
  module = {"m.weight": (codes[:, 1::2] << 4) | codes[:, 0::2], "m.weight_scale": scale_bits[:, None].view(
      ml_dtypes.float8_e4m3fn), "m.weight_scale_2": np.float32(0.7310585) / np.float32(2688.0)}
  exact = _decode_e2m1_packed(module["m.weight"]) * _decode_e4m3(scale_bits)[:, None]
  np.testing.assert_array_equal(hf.dequantize.block_products(module["m.weight"], module["m.weight_scale"]), exact)
  got = hf.dequantize_nvfp4(module)
  assert list(got) == ["m.weight"] and got["m.weight"].dtype == np.float32
  np.testing.assert_array_equal(got["m.weight"], _decoded(module)["m.weight"])


def test_nvfp4_export_import_export_is_bit_identical(nvfp4_export):
  """Our NVFP4 export, decoded into parameters and quantized again as training does, gives every byte back:
  codes, block scales, weight_scale_2 and the bf16 tensors, with a bf16 and a float32 compute dtype."""
  for dtype in (jnp.float32, jnp.bfloat16):
    config = CONFIG.replace(dtype=dtype)
    params, tensors, _ = nvfp4_export if dtype == jnp.float32 else (None, *hf.to_hf_nvfp4(_params()[1], config))
    decoded = hf.dequantize_nvfp4(tensors)
    imported = hf.from_hf(decoded, config)
    for name, value in _decoded(tensors).items():   # exact: the independent decoder's values
      np.testing.assert_array_equal(decoded[name], value)
    again, _ = hf.to_hf_nvfp4(imported, config, "nvfp4")
    assert sorted(again) == sorted(tensors)
    for name, value in tensors.items():
      assert again[name].dtype == value.dtype and again[name].tobytes() == value.tobytes(), name
    assert hf.requantization_mismatches(imported, config, "nvfp4", tensors) == {"bf16": [], "nvfp4": [],
                                                                                "different": []}
  # Why weight_scale_2 comes back with a float32 compute dtype: the decoded amax is fl(2688 s2), not always the
  # training amax a, but fl(fl(2688 s2) / 2688) == s2 for s2 = fl(a / 2688), for every float32 mantissa of a
  # (powers of two scale exactly). With bf16 the amax itself always comes back.
  a = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(127 << 23)).view(np.float32)   # [1, 2)
  s2 = a / np.float32(2688.0)
  amax = np.float32(2688.0) * s2
  assert np.all(amax / np.float32(2688.0) == s2) and 0.8 < np.mean(amax == a) < 0.9
  bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
  b = bf16(a)
  assert np.all(bf16(np.float32(2688.0) * (b / np.float32(2688.0))) == b)


def _write_nvfp4(directory, tensors, config_json, hf_quant):
  os.makedirs(directory, exist_ok=True)
  hf.save_hf_tensors(str(directory), tensors)
  (directory / "config.json").write_text(json.dumps(config_json))
  (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))


def test_nvfp4_import_of_our_export(nvfp4_export, tmp_path, capsys):
  params, tensors, excluded = nvfp4_export
  amax = {path: 1.5 for path in hf.quantized_paths(CONFIG, "nvfp4")}
  with_input_scales, _ = hf.to_hf_nvfp4(params, CONFIG, "nvfp4", input_amax=amax)
  config_json = hf.to_hf_config(CONFIG, dtype="bfloat16", eos_token_id=0,
                                extra={"recipe": "nvfp4", "tokenizer": "byte"})
  hf_quant, config_json["quantization_config"] = hf.nvfp4_quant_configs(excluded, producer_version="0")
  _write_nvfp4(tmp_path / "hf", with_input_scales, config_json, hf_quant)
  assert hf_cli.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
  out, err = capsys.readouterr()
  assert "10 NVFP4 weights decoded, each re-quantized by recipe 'nvfp4' to the checkpoint's codes and scales" in out
  assert "note: the run starts" not in err
  run = runs.load_run(str(tmp_path / "run"))
  assert run.model_config == CONFIG and run.config.recipe == "nvfp4"
  jax.tree.map(np.testing.assert_array_equal, run.params, hf.from_hf(_decoded(tensors), CONFIG))


@pytest.mark.slow   # ~15 s: three calibrated exports; the default representatives are the tests above
def test_nvfp4_cli_round_trip(run_dir, tmp_path, capsys):
  """export -> import -> export through the command line: the NVFP4 weights and the bf16 tensors come back bit
  for bit; input_scale is calibrated again on the imported run, whose unquantized tensors the checkpoint rounded
  to bf16, so it differs; from then on the cycle is a fixpoint, every file byte for byte."""
  calib = tmp_path / "calib.txt"
  calib.write_text("F(X) = X * 2 + 1;\nG(Y) = (Y - 3) / 4;\n" * 40)   # byte tokens below the test vocabulary
  workdir = run_dir
  for i in range(3):
    assert hf_cli.main(["export", "--workdir", workdir, "--out", str(tmp_path / f"hf{i}"), "--format", "nvfp4",
                        "--calib_file", str(calib)]) == 0
    workdir = str(tmp_path / f"run{i}")
    assert hf_cli.main(["import", "--hf", str(tmp_path / f"hf{i}"), "--out", workdir]) == 0
  capsys.readouterr()
  first, second = (hf.load_safetensors(str(tmp_path / f"hf{i}" / "model.safetensors")) for i in (0, 1))
  assert sorted(first) == sorted(second)
  for name in first:
    if not name.endswith("input_scale"):
      assert first[name].tobytes() == second[name].tobytes(), name
  assert (tmp_path / "hf1" / "checksums.sha256").read_text() == (tmp_path / "hf2" / "checksums.sha256").read_text()


def test_nvfp4_import_of_modelopts_layout(tmp_path, capsys):
  """A checkpoint as ModelOpt writes one (built here by its algorithm: 1x16 block scales, a weight_scale_2 shared
  by q/k/v, bf16 elsewhere, transformers 5's "model." names, its quantization_config and hf_quant_config.json,
  no fp4jax entry) imports to its exactly decoded values; training quantizes in 16x16 tiles, so the note names
  the weights whose codes or scales it does not reproduce."""
  _, params = _params()
  plain = hf.to_hf(params, CONFIG, ml_dtypes.bfloat16)            # ModelOpt quantizes the model's bf16 weights
  weights = {n[:-len(".weight")]: v.astype(np.float32) for n, v in plain.items()
             if n.endswith("proj.weight") and ".layers." in n}
  tensors = {n: v for n, v in plain.items() if n[:-len(".weight")] not in weights}
  for module, w in weights.items():
    fused = [m for m in weights if m.rsplit(".", 1)[0] == module.rsplit(".", 1)[0] and m[-6:] in ("q_proj", "k_proj",
                                                                                                  "v_proj")]
    amax = max(np.abs(weights[m]).max() for m in (fused if module in fused else [module]))   # unified, as ModelOpt
    for suffix, value in _modelopt_nvfp4(w, amax).items():
      tensors[f"{module}.{suffix}"] = value
    tensors[f"{module}.input_scale"] = np.asarray(np.float32(3.0) / np.float32(2688.0))
  tensors = {n.replace("backbone.", "model.", 1): v for n, v in tensors.items()}
  config_json = hf.to_hf_config(CONFIG.replace(bf16_last_blocks=0))
  del config_json["fp4jax"]
  groups = {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}
  config_json["quantization_config"] = {
      "config_groups": {"group_0": dict(groups, input_activations=groups["weights"], targets=["Linear"])},
      "ignore": ["lm_head"], "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.37.0"},
      "quant_method": "modelopt"}
  hf_quant = {"producer": {"name": "modelopt", "version": "0.37.0"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": ["lm_head"]}}
  _write_nvfp4(tmp_path / "hf", tensors, config_json, hf_quant)
  assert hf_cli.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"),
                      "--dtype", "float32"]) == 0
  out, err = capsys.readouterr()
  assert "12 NVFP4 weights decoded" in out
  assert "re-quantize to other codes or scales" in err and "precision policy" not in err   # the same layers
  run = runs.load_run(str(tmp_path / "run"))
  assert run.model_config.dtype == jnp.float32 and run.config.recipe == "nvfp4"
  decoded = {n.replace("model.", "backbone.", 1): v for n, v in _decoded(tensors).items()}
  jax.tree.map(np.testing.assert_array_equal, run.params, hf.from_hf(decoded, run.model_config))
  # ModelOpt's own dequantize rounds scale * scale_2 first: within one float32 step of the exact value.
  q = "model.layers.0.mixer.in_proj"
  theirs = _decode_e2m1_packed(tensors[q + ".weight"]).astype(np.float32) * np.repeat(
      tensors[q + ".weight_scale"].astype(np.float32) * tensors[q + ".weight_scale_2"], 16, axis=1)
  ours = decoded[q.replace("model.", "backbone.") + ".weight"]
  assert np.all(np.abs(theirs - ours) <= np.spacing(np.abs(ours)))


def test_nvfp4_round_trip_at_the_bottom_of_e4m3(tmp_path):
  """Where decoding and quantizing again is not the identity (docs/EXPORT.md): a 16x16 tile whose scale is
  2^-8 with largest code 4 re-quantizes with scale 2^-9 (its values change, and the layer is named); a tile whose
  scale rounded to 0 keeps its zero values, but its codes (±6 for nonzero inputs) come back as 0."""
  _, params = _params()
  kernel_KxN = np.array(params["blocks_2"]["mixer"]["up"]["kernel"])   # [K, N]: tile (i, j) is [16j:, 16i:]
  kernel_KxN[:16, :32] = 0.0
  unit = np.abs(kernel_KxN).max() / 448.0 * 2.0 ** -9   # the tile amax whose E4M3 scale is 2^-9
  kernel_KxN[:16, :16] = 0.1 * unit         # tile (0, 0): scale 0.1 * 2^-9 rounds to 0
  kernel_KxN[:16, 16:32] = 0.2 * unit
  kernel_KxN[0, 16] = 1.55 * unit           # tile (1, 0): scale 1.55 * 2^-9 rounds to 2^-8; largest code 4 (4.65)
  params = jax.tree.map(lambda x: x, params)
  params["blocks_2"]["mixer"]["up"]["kernel"] = jnp.asarray(kernel_KxN)
  tensors, _ = hf.to_hf_nvfp4(params, CONFIG, "nvfp4")
  up = "backbone.layers.2.mixer.up_proj"
  scales = tensors[up + ".weight_scale"].astype(np.float32) * 512
  assert scales[0, 0] == 0 and scales[16, 0] == 2
  assert _decode_e2m1_packed(tensors[up + ".weight"][16:17]).max() == 4
  imported = hf.from_hf(hf.dequantize_nvfp4(tensors), CONFIG)
  again, _ = hf.to_hf_nvfp4(imported, CONFIG, "nvfp4")
  assert again[up + ".weight_scale"][16, 0].astype(np.float32) * 512 == 1
  assert np.all(again[up + ".weight"][:16, :8] == 0) and np.any(tensors[up + ".weight"][:16, :8] != 0)
  found = hf.requantization_mismatches(imported, CONFIG, "nvfp4", tensors)
  assert found == {"bf16": [], "nvfp4": [], "different": [up]}


def test_nvfp4_import_refuses_what_it_cannot_read(nvfp4_export, tmp_path, capsys):
  config = hf.to_hf_config(CONFIG)
  nvfp4 = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": []}
  refused = [({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, None,
              "quant_method='compressed-tensors'"),
             ({"quant_method": "modelopt", "quant_algo": "FP8"}, None, "quant_algo='FP8'"),
             (None, dict(nvfp4, quant_algo="NVFP4_AWQ"), "quant_algo='NVFP4_AWQ'"),
             (None, dict(nvfp4, quant_algo="MIXED_PRECISION", quantized_layers={"a": {"quant_algo": "FP8"}, "b": {
                 "quant_algo": "NVFP4"}}), r"MIXED_PRECISION' \(per layer: FP8, NVFP4\)"),
             (None, dict(nvfp4, group_size=32), "group_size 32"),
             ({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"group_0": {"weights": {
                 "group_size": 32}}}}, None, "group_size 32"),
             (None, dict(nvfp4, kv_cache_quant_algo="FP8"), "kv_cache_quant_algo='FP8'.*--kv_cache_qformat none"),
             ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": {"num_bits": 8}}, None,
              "kv_cache_scheme"),
             (None, {"quant_algo": "NVFP4"}, "no 'quantization' entry")]
  for quantization_config, quantization, match in refused:
    config_json = dict(config, quantization_config=quantization_config)
    hf_quant = quantization if match == "no 'quantization' entry" else (
        None if quantization is None else {"quantization": quantization})
    with pytest.raises(hf.ConversionError, match=match):
      hf.nvfp4_checkpoint(config_json, hf_quant)
  _, tensors, _ = nvfp4_export
  q = "backbone.layers.0.mixer.in_proj"
  broken = [({q + ".weight_scale_2": None}, "lacks backbone.layers.0.mixer.in_proj.weight_scale_2"),
            ({q + ".weight_scale": np.pad(tensors[q + ".weight_scale"], ((0, 0), (0, 2)))},
             r"weight_scale is float8_e4m3fn \[168, 4\]; .* float8_e4m3fn \[168, 2\]"),
            ({q + ".weight": tensors[q + ".weight"].astype(ml_dtypes.bfloat16)}, "uint8"),
            ({q + ".pre_quant_scale": np.ones(32, np.float32)}, "AWQ"),
            ({"backbone.layers.1.mixer.k_proj.k_scale": np.float32(1)}, "KV-cache scale"),
            ({q + ".weight_scale": np.full((168, 2), np.nan, np.float32).astype(ml_dtypes.float8_e4m3fn)},
             "non-finite"),
            ({"lm_head.weight_scale_2": np.float32(1)}, "no lm_head.weight_scale beside it"),
            ({n: None for n in tensors if n.endswith("weight_scale")}, "no tensor of the checkpoint has a weight_scale")]
  for change, match in broken:
    damaged = {n: v for n, v in dict(tensors, **change).items() if v is not None}
    with pytest.raises(hf.ConversionError, match=match):
      hf.dequantize_nvfp4(damaged)
  with pytest.raises(hf.ConversionError, match="neither hf_quant_config.json nor"):
    hf.from_hf(tensors, CONFIG)
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
  (tmp_path / "hf" / "hf_quant_config.json").write_text(json.dumps({"quantization": dict(nvfp4, quant_algo="FP8")}))
  assert hf_cli.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
  assert "error: hf_quant_config.json has quant_algo='FP8'" in capsys.readouterr().err
