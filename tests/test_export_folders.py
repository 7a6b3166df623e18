"""Export folders hold one export, and bad checkpoint files get one line: ``fp4jax-hf`` (tools/hf.py) with
models.hf.files."""
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import LanguageModel, ModelConfig, hf
from models.hf import files as hf_files
from tools import hf as hf_cli
from tools import runs

CLEAR = "clear error"
CORRECT = "correct result"
# test name -> (case, expected verdict, exit code of fp4jax-hf or None); in docs/RELIABILITY.md's training matrix
CASES = {
    "test_reexport_replaces_the_previous_export": (
        "fp4jax-hf export into a folder holding an export (single file -> shards, nvfp4 -> float32): the old "
        "weights and index removed and named; import loads the new one", CORRECT, 0),
    "test_reexport_removes_the_quant_config_of_an_nvfp4_export": (
        "fp4jax-hf export (float32) into an NVFP4 export's folder: its hf_quant_config.json removed", CORRECT, 0),
    "test_export_refuses_another_checkpoints_folder": (
        "fp4jax-hf export --out a folder with another checkpoint's weight files: refused, nothing removed",
        CLEAR, 2),
    "test_export_out_is_a_file": ("fp4jax-hf export --out FILE: 'is a file; --out is a directory'", CLEAR, 2),
    "test_import_of_a_truncated_safetensors_file": (
        "fp4jax-hf import of a truncated or padded model.safetensors: the file, expected and actual size", CLEAR, 2),
    "test_import_of_a_flipped_byte": ("fp4jax-hf import of an export with a flipped byte: checksums.sha256 names "
                                      "the file", CLEAR, 2),
    "test_calibration_text_past_the_vocabulary_is_refused": (
        "fp4jax-hf export --format nvfp4 with calibration tokens past vocab_size: the token id and the vocabulary, "
        "not a NaN input_scale", CLEAR, 2),
}

CONFIG = ModelConfig(vocab_size=64, d_model=32, pattern="M*-", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16,
                     d_state=8, ssm_head_dim=16, chunk_size=16, dtype=jnp.float32)


def _run(directory, params, name):
  runs.write_run(str(directory), runs.training_config(CONFIG, name=name), params)
  return str(directory), params


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("runs")
  model = LanguageModel(CONFIG)
  init = jax.jit(lambda key: nn.unbox(model.init({"params": key}, jnp.zeros((1, 8), jnp.int32))["params"]))
  params = init(jax.random.key(0))
  return _run(base / "a", params, "a"), _run(base / "b", jax.tree.map(lambda p: p * 2 + 1, params), "b")


def _imported_params(out, tmp_path, name="back"):
  assert hf_cli.main(["import", "--hf", str(out), "--out", str(tmp_path / name)]) == 0
  return runs.load_run(str(tmp_path / name)).params


def _same(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_reexport_replaces_the_previous_export(two_runs, tmp_path, capsys):
  (run_a, _), (run_b, params_b) = two_runs
  out = tmp_path / "hf"
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(out)]) == 0
  assert (out / "model.safetensors").exists()
  (out / "notes.txt").write_text("mine")
  assert hf_cli.main(["export", "--workdir", run_b, "--out", str(out), "--max_shard_gb", "0.00005"]) == 0
  printed = capsys.readouterr().out
  assert f"replacing the export in {out}: removed checksums.sha256, config.json, model.safetensors" in printed
  names = sorted(os.listdir(out))
  assert "model.safetensors" not in names and "model.safetensors.index.json" in names
  assert "notes.txt" in names   # not an export's file: kept
  _same(_imported_params(out, tmp_path), params_b)


def test_reexport_removes_the_quant_config_of_an_nvfp4_export(two_runs, tmp_path, capsys):
  """The quick twin of the slow test below: an export folder as an NVFP4 export leaves it (its files, ours)."""
  (run_a, _), (run_b, _) = two_runs
  out = tmp_path / "hf"
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(out)]) == 0
  (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
  assert hf_cli.main(["export", "--workdir", run_b, "--out", str(out)]) == 0
  assert "hf_quant_config.json" in capsys.readouterr().out
  assert not (out / "hf_quant_config.json").exists()


@pytest.mark.slow
def test_float32_export_over_an_nvfp4_export(two_runs, tmp_path, capsys):
  """An NVFP4 export, then a float32 one: no hf_quant_config.json left for vLLM to read."""
  (run_a, _), (run_b, params_b) = two_runs
  calib = tmp_path / "calib.txt"
  calib.write_text("12 + 34 = 46;\n" * 40)   # bytes below the model's vocab_size of 64
  nvfp4 = tmp_path / "nvfp4"
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(nvfp4), "--format", "nvfp4",
                      "--calib_file", str(calib)]) == 0
  assert (nvfp4 / "hf_quant_config.json").exists()
  assert hf_cli.main(["export", "--workdir", run_b, "--out", str(nvfp4)]) == 0
  assert "hf_quant_config.json" in capsys.readouterr().out
  assert not (nvfp4 / "hf_quant_config.json").exists()
  assert "quantization_config" not in json.loads((nvfp4 / "config.json").read_text())
  _same(_imported_params(nvfp4, tmp_path, "back2"), params_b)


def test_export_refuses_another_checkpoints_folder(two_runs, tmp_path, capsys):
  (run_a, _), _ = two_runs
  out = tmp_path / "theirs"
  out.mkdir()
  (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (out / "model.safetensors").write_bytes(b"not ours")
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "holds another checkpoint's files (model.safetensors)" in err
  assert (out / "model.safetensors").read_bytes() == b"not ours"


def test_export_out_is_a_file(two_runs, tmp_path, capsys):
  (run_a, _), _ = two_runs
  target = tmp_path / "file"
  target.write_text("x")
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(target)]) == 2
  err = capsys.readouterr().err
  assert err == f"error: --out {target} is a file; --out is a directory (the export writes several files into it)\n"


@pytest.mark.parametrize("change", ["truncate", "pad"])
def test_import_of_a_truncated_safetensors_file(two_runs, tmp_path, capsys, change):
  (run_a, _), _ = two_runs
  out = tmp_path / "hf"
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(out)]) == 0
  (out / hf_files.CHECKSUMS).unlink()   # the size check alone (a checkpoint from elsewhere has no checksums)
  path = out / "model.safetensors"
  raw = path.read_bytes()
  path.write_bytes(raw[:-1000] if change == "truncate" else raw + b"\0" * 8)
  capsys.readouterr()
  assert hf_cli.main(["import", "--hf", str(out), "--out", str(tmp_path / "back")]) == 2
  err = capsys.readouterr().err
  actual = len(raw) - 1000 if change == "truncate" else len(raw) + 8
  assert err == (f"error: {path} is truncated or corrupt: its header describes {len(raw):,} bytes, the file has "
                 f"{actual:,}; export or download it again\n")
  path.write_bytes(raw[:100])   # cut inside the header
  with pytest.raises(hf.ConversionError, match="truncated or corrupt: its header alone should be"):
    hf.load_hf_tensors(str(out))


def test_import_of_a_flipped_byte(two_runs, tmp_path, capsys):
  (run_a, _), _ = two_runs
  out = tmp_path / "hf"
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(out), "--max_shard_gb", "0.00005"]) == 0
  shard = sorted(out.glob("model-*.safetensors"))[1]
  raw = bytearray(shard.read_bytes())
  raw[-3] ^= 0x10
  shard.write_bytes(bytes(raw))
  capsys.readouterr()
  assert hf_cli.main(["import", "--hf", str(out), "--out", str(tmp_path / "back")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{shard} does not match its SHA-256 in {out / 'checksums.sha256'}" in err


def test_calibration_text_past_the_vocabulary_is_refused(two_runs, tmp_path, capsys):
  """Bytes past vocab_size 64 would make the embedding read past its table (NaN activations, NaN input_scale)."""
  (run_a, _), _ = two_runs
  calib = tmp_path / "calib.txt"
  calib.write_text("def f(x):\n    return x * 2\n" * 40)
  assert hf_cli.main(["export", "--workdir", run_a, "--out", str(tmp_path / "nvfp4"), "--format", "nvfp4",
                      "--calib_file", str(calib)]) == 2
  assert "token id 120, past the model's vocab_size 64" in capsys.readouterr().err
