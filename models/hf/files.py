"""The files of a Hugging Face checkpoint directory: the safetensors codec, shards and their index, a checksum
file, and what an export folder may hold.

  model.safetensors                      one file, or above ``max_shard_bytes`` the shards
  model-0000i-of-0000n.safetensors       with model.safetensors.index.json (transformers' layout)
  checksums.sha256                       ``sha256sum`` lines of every safetensors file (``sha256sum -c`` reads it)

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
offsets) and the raw little-endian data. Reading checks the file against its header (a truncated or padded file
names the expected and actual size) and, when ``checksums.sha256`` is there, every file's SHA-256 (a flipped
byte names its file).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct

import ml_dtypes
import numpy as np


class ConversionError(ValueError):
  """A checkpoint or config that cannot be converted; the message says what and how to fix it."""


SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHECKSUMS = "checksums.sha256"
QUANT_CONFIG = "hf_quant_config.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def save_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
  """Writes a safetensors file: 8-byte little-endian header length, JSON header, raw little-endian data."""
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    array = np.asarray(tensors[name]).copy(order="C")   # (ascontiguousarray would make scalars 1-D)
    if array.dtype not in _NAMES:
      raise ConversionError(f"tensor {name!r} has dtype {array.dtype}, which safetensors here does not store")
    blob = array.tobytes()
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
  if metadata:
    header["__metadata__"] = dict(metadata)
  encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
  encoded += b" " * (-len(encoded) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for blob in blobs:
      f.write(blob)


def _corrupt(path: str, what: str) -> ConversionError:
  return ConversionError(f"{path} is truncated or corrupt: {what}; export or download it again")


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  """Reads every tensor of a safetensors file into numpy arrays, after checking the file against its header:
  a ConversionError names the file and the expected and actual size (or the tensor that does not fit)."""
  if not os.path.isfile(path):
    raise ConversionError(f"{path} is missing")
  with open(path, "rb") as f:
    raw = f.read()
  if len(raw) < 8:
    raise ConversionError(f"{path} is not a safetensors file (too short: {len(raw)} bytes)")
  (size,) = struct.unpack("<Q", raw[:8])
  if 8 + size > len(raw):
    raise _corrupt(path, f"its header alone should be {8 + size:,} bytes, the file has {len(raw):,}")
  try:
    header = json.loads(raw[8:8 + size])
  except (ValueError, UnicodeDecodeError):
    raise ConversionError(f"{path} is not a safetensors file (bad header)") from None
  if not isinstance(header, dict):
    raise ConversionError(f"{path} is not a safetensors file (its header is not a table of tensors)")
  base, out, data_end = 8 + size, {}, 0
  infos = {name: info for name, info in header.items() if name != "__metadata__"}
  for name, info in infos.items():
    try:
      dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise ConversionError(f"{path} is not a safetensors file (bad header entry for {name!r})") from None
    if dtype not in _DTYPES:
      raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype}, which this reader does not know")
    nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if end - start != nbytes or start < 0:
      raise _corrupt(path, f"tensor {name!r} {dtype}{shape} needs {nbytes:,} bytes, its header gives it "
                           f"{end - start:,} (offsets {start}..{end})")
    data_end = max(data_end, end)
  expected = base + data_end
  if len(raw) != expected:
    raise _corrupt(path, f"its header describes {expected:,} bytes, the file has {len(raw):,}")
  for name, info in infos.items():
    start, end = info["data_offsets"]
    out[name] = np.frombuffer(raw[base + start:base + end], _DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def save_hf_tensors(directory: str, tensors: dict[str, np.ndarray], *, max_shard_bytes: int = 5 << 30) -> list[str]:
  """Writes ``model.safetensors``, or, above ``max_shard_bytes``, shards ``model-0000i-of-0000n.safetensors``
  with the ``model.safetensors.index.json`` transformers reads, then ``checksums.sha256``. Returns the file
  names written."""
  shards, current, size = [], {}, 0
  for name in sorted(tensors):
    nbytes = int(np.asarray(tensors[name]).nbytes)
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = tensors[name]
    size += nbytes
  shards.append(current)
  if len(shards) == 1:
    save_safetensors(os.path.join(directory, SINGLE), shards[0], {"format": "pt"})
    return [SINGLE, write_checksums(directory, [SINGLE])]
  files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for file, shard in zip(files, shards):
    save_safetensors(os.path.join(directory, file), shard, {"format": "pt"})
    weight_map.update({name: file for name in shard})
  index = {"metadata": {"total_size": sum(int(np.asarray(t).nbytes) for t in tensors.values())},
           "weight_map": weight_map}
  with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
    json.dump(index, f, indent=2)
  return files + [write_checksums(directory, files), INDEX]


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      digest.update(chunk)
  return digest.hexdigest()


def write_checksums(directory: str, files: list[str]) -> str:
  """``checksums.sha256`` for ``files`` of ``directory`` (``sha256sum`` format); returns its name."""
  with open(os.path.join(directory, CHECKSUMS), "w", encoding="utf-8") as f:
    for file in files:
      f.write(f"{_sha256(os.path.join(directory, file))}  {file}\n")
  return CHECKSUMS


def verify_checksums(directory: str, files: list[str]) -> None:
  """ConversionError naming the file whose SHA-256 differs from ``checksums.sha256`` (nothing to check when the
  directory has no such file, e.g. a checkpoint from elsewhere)."""
  path = os.path.join(directory, CHECKSUMS)
  if not os.path.isfile(path):
    return
  sums = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      digest, _, name = line.strip().partition("  ")
      if name:
        sums[name] = digest
  for file in files:
    if file in sums and _sha256(os.path.join(directory, file)) != sums[file]:
      raise ConversionError(f"{os.path.join(directory, file)} does not match its SHA-256 in {path}: the file "
                            "changed after the export (a flipped byte, a partial copy); export or copy it again")


def load_hf_tensors(directory: str) -> dict[str, np.ndarray]:
  """All tensors of a Hugging Face checkpoint directory (``model.safetensors`` or a sharded index), each file
  checked against its header and, when the directory has one, ``checksums.sha256``."""
  single = os.path.join(directory, SINGLE)
  index = os.path.join(directory, INDEX)
  if os.path.isfile(single) and os.path.isfile(index):
    raise ConversionError(f"{directory} holds both {SINGLE} and {INDEX} (two checkpoints in one folder); keep "
                          "the one you mean, or export again into an empty folder")
  if os.path.isfile(single):
    verify_checksums(directory, [SINGLE])
    return load_safetensors(single)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise _corrupt(index, f"not an index with a weight_map ({e})") from None
    verify_checksums(directory, shards)
    tensors = {}
    for shard in shards:
      tensors.update(load_safetensors(os.path.join(directory, shard)))
    return tensors
  if any(n.endswith(".bin") for n in os.listdir(directory)):
    raise ConversionError(f"{directory} holds pytorch_model*.bin files; convert them to safetensors first "
                          "(transformers: model.save_pretrained(dir, safe_serialization=True))")
  raise ConversionError(f"{directory} has no {SINGLE} or {INDEX}")


def load_quant_config(directory: str) -> dict | None:
  """``hf_quant_config.json`` of a checkpoint directory (ModelOpt's quantization config), None when absent."""
  path = os.path.join(directory, QUANT_CONFIG)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except ValueError as e:
    raise _corrupt(path, f"not JSON ({e})") from None
  if not isinstance(config, dict):
    raise _corrupt(path, "not a JSON object")
  return config


# ------------------------------------------------------------------------------------- the export folder

# What an export writes; all of it goes before the next export into the same folder writes anything.
EXPORT_FILES = (SINGLE, INDEX, CHECKSUMS, QUANT_CONFIG, "config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model")


def _is_weights(name: str) -> bool:
  return (name in (SINGLE, INDEX, QUANT_CONFIG) or bool(_SHARD.match(name)) or name.endswith(".safetensors")
          or name.endswith(".bin"))


def check_export_folder(out: str) -> list[str]:
  """The files of a previous export in ``out`` that ``clear_export_folder`` will remove; ConversionError when
  ``out`` is a file, or holds weight files that are not an fp4jax export's (nothing is removed then).

  A previous fp4jax export is recognised by its config.json's "fp4jax" entry; its files are ``EXPORT_FILES`` and
  its shards. Other files (notes, a README) stay."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConversionError(f"--out {out} is a file; --out is a directory (the export writes several files into it)")
  if not os.path.isdir(out):
    return []
  names = sorted(os.listdir(out))
  ours = False
  try:
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
      ours = isinstance(json.load(f).get("fp4jax"), dict)
  except (OSError, ValueError, AttributeError):
    pass
  stale = [n for n in names if n in EXPORT_FILES or _SHARD.match(n)] if ours else []
  foreign = [n for n in names if _is_weights(n) and n not in stale]
  if foreign:
    raise ConversionError(f"--out {out} holds another checkpoint's files ({', '.join(foreign[:4])}"
                          f"{', ...' if len(foreign) > 4 else ''}), not an fp4jax export's; export into an empty or "
                          "new folder, or remove them first")
  return stale


def clear_export_folder(out: str) -> list[str]:
  """Makes ``out`` hold no export (``check_export_folder``'s checks, then its files removed; the folder made when
  missing), so that the next export is the only one there and no stale weight file, index or quantization config
  is left for a loader to pick up. Returns the names removed."""
  stale = check_export_folder(out)
  os.makedirs(out, exist_ok=True)
  for name in stale:
    os.remove(os.path.join(out, name))
  return stale
