"""Import of NVFP4 checkpoints (fp4jax's own export and ModelOpt's layout): the weights decode exactly, the
round trip export -> import -> export is bit-identical, and what cannot be read is refused clearly."""
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hf_cases as cases
from hf_cases import CONFIG
from models import hf
from tools import hf as hf_cli
from tools import runs


@pytest.fixture(scope="module")
def nvfp4_export():
  return cases.nvfp4_export()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return cases.write_run(str(tmp_path_factory.mktemp("run")))


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
      blocks = np.repeat(cases.decode_e4m3(tensors[name].view(np.uint8)), 16, axis=1)
      scale_2 = np.float64(tensors[module + ".weight_scale_2"])
      out[module + ".weight"] = (cases.decode_e2m1_packed(tensors[module + ".weight"]) * blocks * scale_2).astype(np.float32)
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
  exact = cases.decode_e2m1_packed(module["m.weight"]) * cases.decode_e4m3(scale_bits)[:, None]
  np.testing.assert_array_equal(hf.dequantize.block_products(module["m.weight"], module["m.weight_scale"]), exact)
  got = hf.dequantize_nvfp4(module)
  assert list(got) == ["m.weight"] and got["m.weight"].dtype == np.float32
  np.testing.assert_array_equal(got["m.weight"], _decoded(module)["m.weight"])


def test_nvfp4_export_import_export_is_bit_identical(nvfp4_export):
  """Our NVFP4 export, decoded into parameters and quantized again as training does, gives every byte back:
  codes, block scales, weight_scale_2 and the bf16 tensors, with a bf16 and a float32 compute dtype."""
  for dtype in (jnp.float32, jnp.bfloat16):
    config = CONFIG.replace(dtype=dtype)
    params, tensors, _ = nvfp4_export if dtype == jnp.float32 else (None, *hf.to_hf_nvfp4(cases.params()[1], config))
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
  _, params = cases.params()
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
  theirs = cases.decode_e2m1_packed(tensors[q + ".weight"]).astype(np.float32) * np.repeat(
      tensors[q + ".weight_scale"].astype(np.float32) * tensors[q + ".weight_scale_2"], 16, axis=1)
  ours = decoded[q.replace("model.", "backbone.") + ".weight"]
  assert np.all(np.abs(theirs - ours) <= np.spacing(np.abs(ours)))


def test_nvfp4_round_trip_at_the_bottom_of_e4m3(tmp_path):
  """Where decoding and quantizing again is not the identity (docs/EXPORT.md): a 16x16 tile whose scale is
  2^-8 with largest code 4 re-quantizes with scale 2^-9 (its values change, and the layer is named); a tile whose
  scale rounded to 0 keeps its zero values, but its codes (±6 for nonzero inputs) come back as 0."""
  _, params = cases.params()
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
  assert cases.decode_e2m1_packed(tensors[up + ".weight"][16:17]).max() == 4
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
