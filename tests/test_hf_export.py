"""Export to / import from Hugging Face Nemotron-H: transformers is the judge of the layout, NVFP4 export is
bit-exact against the training forward pass, the round trip is exact, bad input gets a clear error."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4jax
import hf_cases as cases
import sample
from hf_cases import CONFIG
from models import LanguageModel, hf
from models.lm import scanned_params
from tools import hf as hf_cli
from tools import runs


# ------------------------------------------------------------------------------ transformers as the judge

@pytest.mark.slow   # covered by transformers' logits: test_moe_hf.py::test_transformers_logits_and_choices_equal_ours
def test_transformers_logits_equal_ours(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model, params = cases.params()
  cases.write_hf(tmp_path, params)
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

def _training_fprop_weight(kernel_KxN, config):
  """What fp4jax.dot's forward pass multiplies with: W cast to the compute dtype, as (N, K), zero-padded
  to whole tiles, quantized in 16x16 tiles (fp4jax.dot docs: fprop weight operand)."""
  w_NxK = jnp.asarray(kernel_KxN).astype(config.dtype).T
  N, K = w_NxK.shape
  return fp4jax.quantize(jnp.pad(w_NxK, ((0, -N % 16), (0, -K % 16))), "nvfp4", tile=(16, 16)), N, K


@pytest.fixture(scope="module")
def nvfp4_export():
  return cases.nvfp4_export()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return cases.write_run(str(tmp_path_factory.mktemp("run")))


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
    blocks = np.repeat(cases.decode_e4m3(scales.view(np.uint8)), 16, axis=1)
    np.testing.assert_array_equal(cases.decode_e2m1_packed(codes) * blocks, reference_unit[lin.hf_name])
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
  _, params = cases.params(config)
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
  _, params = cases.params()
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
  text.write_text("DEF F(X):\n    RETURN X * 2\n" * 40)   # byte tokens below the test vocabulary
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
  _, params = cases.params()
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
