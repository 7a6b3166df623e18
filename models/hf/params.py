"""Parameters to Hugging Face tensors and back (float32 or a compute dtype), through ``layout``."""
from __future__ import annotations

import jax
import numpy as np

from models import ModelConfig
from models.hf.files import ConversionError
from models.hf.layout import (QUANTIZED_SUFFIXES, ROUTER_TENSORS, Linear, canonical_name, join_experts, layout,
                              split_mtp_experts)


def param_at(params, path):
  for key in path:
    params = params[key]
  return params


def as_numpy(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def to_hf(params, c: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
  """Nemotron-H tensors (``dtype``: float32 or bfloat16) of our unboxed parameter tree."""
  linears, tensors = layout(c)
  out = {}
  for lin in linears:
    w_NxK = as_numpy(param_at(params, lin.path)["kernel"]).T
    out[lin.hf_name] = np.ascontiguousarray(w_NxK if lin.rows is None else w_NxK[lin.rows]).astype(dtype)
  for t in tensors:
    keep = np.float32 if t.hf_name.endswith(ROUTER_TENSORS) else dtype
    out[t.hf_name] = np.ascontiguousarray(t.to_hf(as_numpy(param_at(params, t.path)))).astype(keep)
  return split_mtp_experts(out)


def from_hf(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict:
  """Our parameter tree (float32 numpy) from Nemotron-H tensors (``backbone.`` or ``model.`` prefix)."""
  named = {canonical_name(name): value for name, value in tensors.items()
           if c.mtp_depths or not name.startswith("mtp.")}   # MTP heads of a model without them: skipped
  quantized = sorted(n for n in named if n.endswith(QUANTIZED_SUFFIXES))
  if quantized:
    raise ConversionError(f"the checkpoint holds quantized tensors ({quantized[0]}, ...) that neither "
                          "hf_quant_config.json nor config.json's quantization_config describes as NVFP4; "
                          "import an NVFP4 (ModelOpt) checkpoint with the hf_quant_config.json it was exported "
                          "with (dequantize_nvfp4 reads it first), or the bf16/fp32 checkpoint it was made from")
  named = join_experts(named)
  linears, others = layout(c)
  used, params = set(), {}

  def take(name):
    if name not in named:
      raise ConversionError(f"the checkpoint lacks {name!r}; is it a Nemotron-H checkpoint of this config?")
    used.add(name)
    return np.asarray(named[name]).astype(np.float32)

  def put(path, value):
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value

  by_path: dict[tuple, list[Linear]] = {}
  for lin in linears:
    by_path.setdefault(lin.path, []).append(lin)
  for path, pieces in by_path.items():
    K = take(pieces[0].hf_name).shape[-1]
    N = sum(take(p.hf_name).shape[0] if p.rows is None else len(p.rows) for p in pieces)
    w_NxK = np.zeros((N, K), np.float32)
    filled = np.zeros(N, bool)
    for p in pieces:
      part = take(p.hf_name)
      rows = np.arange(N) if p.rows is None else p.rows
      if part.shape != (len(rows), K):
        raise ConversionError(f"{p.hf_name} has shape {part.shape}; the config implies {(len(rows), K)}")
      w_NxK[rows] = part
      filled[rows] = True
    assert filled.all(), path
    put((*path, "kernel"), w_NxK.T.copy())
  for t in others:
    value = take(t.hf_name)
    try:
      put(t.path, np.ascontiguousarray(t.from_hf(value)))
    except (IndexError, ValueError):
      raise ConversionError(f"{t.hf_name} has shape {value.shape}, which does not fit the config") from None
  leftover = sorted(set(named) - used)
  if leftover:
    raise ConversionError(f"the checkpoint has tensors this model has no place for: {leftover[:4]}")
  return params


def check_params(params, abstract) -> None:
  """Raises ConversionError when ``params`` and the model's ``abstract`` tree differ in keys or shapes."""
  flat_p = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  flat_a = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  bad = [k for k in sorted(set(flat_p) | set(flat_a)) if flat_p.get(k) != flat_a.get(k)]
  if bad:
    raise ConversionError(f"converted parameters do not fit the model: {[(k, flat_p.get(k), flat_a.get(k)) for k in bad[:3]]}")


