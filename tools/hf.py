"""Export a train.py run to a Hugging Face Nemotron-H checkpoint, or import one as a run.

  python -m tools.hf export --workdir runs/tiny --out hf/tiny                      # float32, lossless
  python -m tools.hf export --workdir runs/tiny --out hf/tiny-bf16 --format bfloat16
  python -m tools.hf export --workdir runs/tiny --out hf/tiny-nvfp4 --format nvfp4  # ModelOpt NVFP4
  python -m tools.hf import --hf hf/tiny --out runs/from_hf [--config configs/tiny.py]
  python -m tools.hf import --hf hf/tiny-nvfp4 --out runs/from_nvfp4                 # NVFP4, decoded exactly

Export writes ``config.json`` (model_type nemotron_h), ``model.safetensors`` (or shards and their index),
``checksums.sha256`` and the tokenizer (``tokenizer.json``; the byte tokenizer becomes an equivalent byte-level
``tokenizers`` file), plus ``hf_quant_config.json`` for NVFP4. A folder holds one export: a previous export's
files there are removed first (and named); ``--out`` naming a file, or a folder with another checkpoint's weight
files, is refused. Import writes ``<out>/config.json`` and checkpoint 0 of ``<out>/checkpoints`` in the
trainer's layout (an NVFP4 checkpoint, ours or ModelOpt's, decoded to float32); ``sample.py --workdir <out>``
reads it, and a training run starts from its parameters. The conversion itself is ``models.hf`` (no torch);
this command line sits above ``training`` because it reads and writes runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

import flax.linen as nn
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging

import fp4jax
from models import LanguageModel, abstract_variables, hf
from models.hf import files as hf_files
from models.lm import unscanned_params
from tools import runs
from training import data as data_lib

FORMATS = ("float32", "bfloat16", "nvfp4")


# ----------------------------------------------------------------------------------------------- export

def _byte_chars() -> dict[int, str]:
  """Byte-level BPE's printable stand-in for each byte: itself when printable, else 256, 257, ... in order."""
  printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def byte_tokenizer_json() -> str:
  """A ``tokenizers`` JSON whose ids are the UTF-8 bytes (the byte tokenizer), as byte-level BPE with no
  merges: each byte is one vocabulary entry."""
  from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  chars = _byte_chars()
  tokenizer = Tokenizer(tok_models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer.to_str()


def _write_tokenizer(spec: str, out: str, eos_id: int | None) -> str:
  """Tokenizer files next to the model; returns a one-line description."""
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
  if spec == "byte":
    try:
      text = byte_tokenizer_json()
    except ImportError:
      return "byte tokenizer: no tokenizer.json written (pip install tokenizers); token id = UTF-8 byte"
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
      f.write(text)
    if eos_id is not None:
      config["eos_token"] = _byte_chars()[eos_id]
  elif spec.endswith(".json"):
    shutil.copyfile(spec, os.path.join(out, "tokenizer.json"))
  else:
    shutil.copyfile(spec, os.path.join(out, "tokenizer.model"))
    return f"sentencepiece model copied to tokenizer.model ({spec})"
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return f"tokenizer.json ({spec})"


def _calibration_tokens(run: runs.Run, calib_file: str | None, n_tokens: int) -> np.ndarray:
  """Up to ``n_tokens`` tokens of ``calib_file`` (default: the run's validation data) as rows of seq_len."""
  tokenizer = data_lib.make_tokenizer(run.config.data.tokenizer)
  if calib_file:
    if not os.path.isfile(calib_file):
      raise hf.ConversionError(f"--calib_file {calib_file!r} does not exist")
    with open(calib_file, "rb") as f:
      tokens = np.asarray(tokenizer.encode(f.read()), np.int64)
  else:
    _, validation, _ = data_lib.load_splits(run.config.data, tokenizer)
    pieces = [np.asarray(s[:n_tokens], np.int64) for s in validation.segments if len(s)]
    if not pieces:
      raise hf.ConversionError("the run has no validation data to calibrate input_scale on; pass --calib_file")
    tokens = np.concatenate(pieces)
  tokens = tokens[:n_tokens]
  if len(tokens) < 2:
    raise hf.ConversionError("the calibration text has fewer than 2 tokens; pass a longer --calib_file")
  vocab = run.model_config.vocab_size
  if tokens.max() >= vocab:   # the embedding would read past its table: NaN activations
    raise hf.ConversionError(f"the calibration text has token id {int(tokens.max())}, past the model's vocab_size "
                             f"{vocab} (tokenizer {run.config.data.tokenizer!r}); pass a --calib_file whose "
                             "tokens the model has")
  length = min(int(run.config.data.seq_len), len(tokens))
  rows = len(tokens) // length
  return tokens[:rows * length].reshape(rows, length)


def export(args) -> int:
  run = runs.load_run(args.workdir, args.step)
  c, params = run.model_config, run.params
  if c.scan_blocks:   # transformers' layout has one tensor per block: unstack the scanned groups
    c, params = c.replace(scan_blocks=False), unscanned_params(params, c)
  tokenizer = data_lib.make_tokenizer(run.config.data.tokenizer)
  hf_files.check_export_folder(args.out)   # before the work: --out a file, or another checkpoint's folder
  extra = {"recipe": run.config.recipe, "step": run.step, "tokenizer": run.config.data.tokenizer,
           "source": run.workdir, "format": args.format}
  if args.format == "nvfp4":
    recipe = fp4jax.recipes.get(args.recipe or run.config.recipe)
    paths = hf.quantized_paths(c, recipe)
    if not paths:
      raise hf.ConversionError(f"the policy keeps every linear layer of this model in bf16 for recipe "
                               f"{recipe.name!r}: nothing to write in NVFP4")
    tokens = _calibration_tokens(run, args.calib_file, args.calib_tokens)
    # Eager (no remat): the calibration reads concrete activations.
    amax = hf.calibration_amax(LanguageModel(c.replace(remat=False), recipe=recipe), params, tokens, paths)
    tensors, excluded = hf.to_hf_nvfp4(params, c, recipe, input_amax=amax)
    config = hf.to_hf_config(c, dtype="bfloat16", eos_token_id=tokenizer.eos_id, extra=extra)
    hf_quant, config["quantization_config"] = hf.nvfp4_quant_configs(excluded, producer_version=fp4jax.__version__)
    note = (f"{len(paths)} linear layers in NVFP4 ({len(excluded)} modules excluded: kept in bf16), "
            f"input_scale from {tokens.size} calibration tokens")
  else:
    dtype = np.float32 if args.format == "float32" else ml_dtypes.bfloat16
    tensors = hf.to_hf(params, c, dtype)
    config = hf.to_hf_config(c, dtype=args.format, eos_token_id=tokenizer.eos_id, extra=extra)
    note = f"every tensor in {args.format}"
    hf_quant = None
  removed = hf_files.clear_export_folder(args.out)   # one export per folder: the previous one's files go
  if removed:
    print(f"replacing the export in {args.out}: removed {', '.join(removed)}")
  if hf_quant is not None:
    with open(os.path.join(args.out, hf_files.QUANT_CONFIG), "w", encoding="utf-8") as f:
      json.dump(hf_quant, f, indent=2)
  files = hf.save_hf_tensors(args.out, tensors, max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
  with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  tok_note = _write_tokenizer(run.config.data.tokenizer, args.out, tokenizer.eos_id)
  size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files if f.endswith(".safetensors"))
  print(f"exported {run.workdir} step {run.step} ('{c.pattern}', d_model {c.d_model}) to {args.out}: "
        f"{len([f for f in files if f.endswith('.safetensors')])} safetensors file(s), {size:,} bytes, {note}; "
        f"{tok_note}")
  return 0


# ----------------------------------------------------------------------------------------------- import

def _load_config_file(path: str):
  if not os.path.isfile(path):
    raise hf.ConversionError(f"--config {path!r} does not exist")
  spec = importlib.util.spec_from_file_location("_fp4jax_import_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def import_(args) -> int:
  config_path = os.path.join(args.hf, "config.json")
  if not os.path.isdir(args.hf):
    raise hf.ConversionError(f"--hf {args.hf!r} is not a directory")
  if not os.path.isfile(config_path):
    raise hf.ConversionError(f"{config_path} is missing: --hf must be a Hugging Face checkpoint directory")
  with open(config_path, encoding="utf-8") as f:
    hf_config = json.load(f)
  nvfp4 = hf.nvfp4_checkpoint(hf_config, hf.load_quant_config(args.hf))
  c = hf.from_hf_config(hf_config, dtype=jnp.dtype(args.dtype), bf16_first_blocks=args.bf16_first_blocks,
                        bf16_last_blocks=args.bf16_last_blocks)
  tensors = hf.load_hf_tensors(args.hf)
  params = hf.from_hf(hf.dequantize_nvfp4(tensors) if nvfp4 else tensors, c)
  dt_floor = hf_config.get("time_step_min", hf_config.get("mamba_dt_min", 0.001))   # transformers' default
  if "M" in c.pattern and dt_floor > 0.0:
    print(f"note: transformers clamps softplus(dt + dt_bias) at time_step_min={dt_floor}; this model does not "
          "clamp, so the two differ where dt falls below it", file=sys.stderr)
  hf.check_params(params, nn.unbox(abstract_variables(LanguageModel(c))["params"]))
  base = _load_config_file(args.config) if args.config else None
  config = runs.training_config(c, base=base, name=os.path.basename(os.path.normpath(args.out)))
  ours = hf_config.get("fp4jax") or {}
  if base is None and ours.get("recipe"):
    config.recipe = ours["recipe"]
  tokenizer = ours.get("tokenizer")
  if tokenizer == "byte":
    config.data.tokenizer = "byte"
  elif os.path.isfile(os.path.join(args.hf, "tokenizer.json")):
    os.makedirs(args.out, exist_ok=True)
    shutil.copyfile(os.path.join(args.hf, "tokenizer.json"), os.path.join(args.out, "tokenizer.json"))
    config.data.tokenizer = os.path.abspath(os.path.join(args.out, "tokenizer.json"))
  elif os.path.isfile(os.path.join(args.hf, "tokenizer.model")):
    os.makedirs(args.out, exist_ok=True)
    shutil.copyfile(os.path.join(args.hf, "tokenizer.model"), os.path.join(args.out, "tokenizer.model"))
    config.data.tokenizer = os.path.abspath(os.path.join(args.out, "tokenizer.model"))
  elif c.vocab_size > 256:
    print(f"warning: {args.hf} has no tokenizer file; set --config.data.tokenizer when training", file=sys.stderr)
  how = _nvfp4_note(params, c, config.recipe, tensors) if nvfp4 else ""
  directory = runs.write_run(args.out, config, params, note=f"imported from {os.path.abspath(args.hf)}")
  print(f"imported {args.hf} ('{c.pattern}', d_model {c.d_model}{how}) to {directory}/0 with {args.out}/config.json; "
        f"continue with train.py --config ... --config.init_from={args.out}, or sample.py --workdir {args.out}")
  return 0


def _nvfp4_note(params, c, recipe: str, tensors) -> str:
  """How the run's training forward pass quantizes the decoded NVFP4 weights: a phrase for the summary line when
  it gives the checkpoint's codes and scales back, else a note on stderr naming the layers where it does not."""
  n = sum(name.endswith(".weight_scale") for name in tensors)
  if fp4jax.recipes.get(recipe).fprop != "nvfp4":
    return f"; {n} NVFP4 weights decoded, for recipe {recipe!r}, whose forward pass is not NVFP4"
  found = hf.requantization_mismatches(params, c, recipe, tensors)
  if not any(found.values()):
    return f"; {n} NVFP4 weights decoded, each re-quantized by recipe {recipe!r} to the checkpoint's codes and scales"
  names = lambda modules: ", ".join(modules[:3]) + (", ..." if len(modules) > 3 else "")
  parts = []
  if found["different"]:
    parts.append(f"{len(found['different'])} of its {n} NVFP4 weights re-quantize to other codes or scales "
                 f"({names(found['different'])}): block scales that differ within the 16x16 tiles training "
                 "quantizes weights in (ModelOpt writes one per 1x16 block), or block scales at the bottom of E4M3's "
                 "range (docs/EXPORT.md)")
  if found["bf16"]:
    parts.append(f"{len(found['bf16'])} of its NVFP4 weights run in bf16 under the precision policy "
                 f"({names(found['bf16'])})")
  if found["nvfp4"]:
    parts.append(f"{len(found['nvfp4'])} of its bf16 weights run in NVFP4 under the precision policy "
                 f"({names(found['nvfp4'])})")
  if found["bf16"] or found["nvfp4"]:
    parts[-1] += ("; match the policy to the checkpoint with --bf16_first_blocks / --bf16_last_blocks here, or "
                  "with the training config's model.precision rules")
  print(f"note: the run starts from the checkpoint's decoded weights exactly, but recipe {recipe!r} does not "
        f"quantize them as the checkpoint did: {'; '.join(parts)}. There the run's forward pass differs from the "
        "checkpoint's, and an export of the run writes other codes", file=sys.stderr)
  return f"; {n} NVFP4 weights decoded"


# ----------------------------------------------------------------------------------------------- the CLI

def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="fp4jax-hf", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  e = sub.add_parser("export", help="a train.py run -> a Hugging Face Nemotron-H directory")
  e.add_argument("--workdir", required=True, help="work directory of a train.py run")
  e.add_argument("--out", required=True, help="output directory (a previous export there is replaced)")
  e.add_argument("--format", choices=FORMATS, default="float32",
                 help="float32 (lossless), bfloat16, or nvfp4 (ModelOpt layout, the trained FP4 weights)")
  e.add_argument("--step", type=int, default=None, help="checkpoint step; default: the latest")
  e.add_argument("--max_shard_gb", type=float, default=5.0, help="split model.safetensors into shards of "
                                                                  "at most this size (with an index file)")
  e.add_argument("--recipe", default=None, help="nvfp4: the recipe whose policy picks the FP4 layers; "
                                                 "default: the run's")
  e.add_argument("--calib_file", default=None, help="nvfp4: text for the activation input_scale; "
                                                     "default: the run's validation data")
  e.add_argument("--calib_tokens", type=int, default=4096, help="nvfp4: calibration tokens")
  i = sub.add_parser("import", help="a Hugging Face Nemotron-H directory -> a run (checkpoint 0)")
  i.add_argument("--hf", required=True, help="directory with config.json and model.safetensors")
  i.add_argument("--out", required=True, help="new work directory")
  i.add_argument("--config", default=None, help="training config file whose non-model fields the run gets "
                                                "(default: configs/base.py)")
  i.add_argument("--dtype", default="bfloat16", help="compute dtype when the checkpoint does not say (ours do)")
  i.add_argument("--bf16_first_blocks", type=int, default=0, help="precision policy, when the checkpoint "
                                                                  "does not say")
  i.add_argument("--bf16_last_blocks", type=int, default=0)
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  logging.set_verbosity(logging.ERROR)
  try:
    return export(args) if args.command == "export" else import_(args)
  except (hf.ConversionError, runs.RunError, data_lib.ConfigError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def run() -> None:
  """The ``fp4jax-hf`` command."""
  sys.exit(main())


if __name__ == "__main__":
  run()
