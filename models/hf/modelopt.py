"""NVFP4 export in NVIDIA ModelOpt's layout: the training forward pass's codes and scales of every
linear layer the precision policy quantizes, the quant configs vLLM reads, and the activation amaxes
measured on calibration tokens."""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

import flax.linen as nn
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp4jax
from models import ModelConfig, moe, policy
from models.hf.files import ConversionError
from models.hf.layout import E4M3_X_E2M1_MAX, GROUP, ROUTER_TENSORS, Tensor, layout, split_mtp_experts
from models.hf.params import as_numpy, param_at


def fprop_weight(kernel_KxN, c: ModelConfig) -> fp4jax.QTensor:
  """The weight as the training forward pass quantizes it: cast to the compute dtype, transposed to
  (N, K), zero-padded to whole 16x16 tiles (zeros change no amax), ``quantize(..., tile=(16, 16))``."""
  w_NxK = jnp.asarray(kernel_KxN).astype(c.dtype).T
  N, K = w_NxK.shape
  w_NxK = jnp.pad(w_NxK, ((0, -N % 16), (0, -K % 16)))
  return fp4jax.quantize(w_NxK, "nvfp4", tile=(16, 16))


def modelopt_tensors(q: fp4jax.QTensor, n: int, k: int) -> dict[str, np.ndarray]:
  """``weight`` [n, k/2] uint8, ``weight_scale`` [n, k/16] float8_e4m3fn, ``weight_scale_2`` float32 of a
  16x16-tiled QTensor of an (n, k) weight: each tile scale repeated for the tile's 16 rows."""
  if k % GROUP:
    raise ConversionError(f"a quantized layer has K={k} inputs, not a multiple of {GROUP}: ModelOpt's NVFP4 "
                          "layout needs whole 1x16 blocks along K")
  data = np.asarray(q.data)[:n, :k // 2]
  scale = np.repeat(np.asarray(q.scale), 16, axis=0)[:n, :k // GROUP]
  scale_2 = np.float32(np.asarray(q.amax, np.float32)) / np.float32(E4M3_X_E2M1_MAX)
  return {"weight": np.ascontiguousarray(data), "weight_scale": np.ascontiguousarray(scale),
          "weight_scale_2": np.asarray(scale_2, np.float32)}


def quantized_paths(c: ModelConfig, recipe) -> set[tuple[str, ...]]:
  """Module paths of the linear layers whose forward pass the precision policy runs in NVFP4 (a layer that a
  rule gives another format, e.g. the MXFP8 ``out_proj`` of ``precision="nemotron3_super"``, is exported
  unquantized with the excluded modules)."""
  recipe = fp4jax.recipes.get(recipe)
  if recipe.fprop != "nvfp4":
    raise ConversionError(f"recipe {recipe.name!r} runs its forward pass in {recipe.fprop}; the NVFP4 export "
                          "writes the weights an nvfp4 forward pass uses (pass --recipe nvfp4)")
  linears, tensors = layout(c)
  experts = {t.path[:-1] for t in tensors if _expert_path(t.path)}
  return ({lin.path for lin in linears if _nvfp4_forward(c, recipe, lin.path)}
          | {path for path in experts if _nvfp4_forward(c, recipe, path)})


def _nvfp4_forward(c: ModelConfig, recipe, path) -> bool:
  """Whether the policy runs the forward pass of the layer at ``path`` with NVFP4 weights."""
  layer = policy.decide(c, recipe, path).recipe
  return layer is not None and layer.roles.fprop_w is not None and layer.roles.fprop_w.fmt == "nvfp4"


def to_hf_nvfp4(params, c: ModelConfig, recipe="nvfp4", *, input_amax: dict[tuple, float] | None = None,
                dtype=ml_dtypes.bfloat16) -> tuple[dict[str, np.ndarray], list[str]]:
  """(tensors, excluded module names): the policy's FP4 layers in ModelOpt's NVFP4 layout, every other
  tensor in ``dtype``. ``input_amax[path]``: calibrated max |input| of a quantized layer -> input_scale."""
  quantized = quantized_paths(c, recipe)
  linears, tensors = layout(c)
  out, excluded, fprop = {}, [], {}
  for lin in linears:
    module = lin.hf_name[:-len(".weight")]
    kernel = param_at(params, lin.path)["kernel"]
    if lin.path not in quantized:
      w_NxK = as_numpy(kernel).T
      out[lin.hf_name] = np.ascontiguousarray(w_NxK if lin.rows is None else w_NxK[lin.rows]).astype(dtype)
      excluded.append(module)
      continue
    if lin.path not in fprop:
      fprop[lin.path] = modelopt_tensors(fprop_weight(kernel, c), kernel.shape[1], kernel.shape[0])
    full = fprop[lin.path]
    rows = slice(None) if lin.rows is None else lin.rows
    out[module + ".weight"] = np.ascontiguousarray(full["weight"][rows])
    out[module + ".weight_scale"] = np.ascontiguousarray(full["weight_scale"][rows])
    out[module + ".weight_scale_2"] = full["weight_scale_2"]
    if input_amax is not None:
      amax = np.float32(input_amax[lin.path])
      out[module + ".input_scale"] = np.asarray(amax / np.float32(E4M3_X_E2M1_MAX), np.float32)
  for t in tensors:
    if _expert_path(t.path) and t.path[:-1] in quantized:
      out.update(_nvfp4_experts(t, param_at(params, t.path), c, input_amax))
      continue
    keep = np.float32 if t.hf_name.endswith(ROUTER_TENSORS) else dtype
    out[t.hf_name] = np.ascontiguousarray(t.to_hf(as_numpy(param_at(params, t.path)))).astype(keep)
  return split_mtp_experts(out), excluded


def _expert_path(path) -> bool:
  return len(path) >= 2 and path[-1] == "kernel" and "experts" in path and path[-2] in ("up", "down")


def _nvfp4_experts(t: Tensor, kernel_ExKxN, c: ModelConfig, input_amax) -> dict[str, np.ndarray]:
  """The routed experts of one GEMM in ModelOpt's per-expert layout, ``...experts.<e>.up_proj.weight`` etc.:
  each expert quantized as its own tensor, as the training forward pass does (``fp4jax.grouped``: its own
  amax and 16x16 tiles). ``input_scale`` (with ``input_amax``) is the amax over all experts' inputs, the
  same for each: the calibration sees the experts' rows together."""
  out = {}
  base = t.hf_name[:-len("_proj")].rsplit(".", 1)[0]   # ...mixer.experts
  proj = t.hf_name.rsplit(".", 1)[1]                   # up_proj / down_proj
  n_e, k, n = kernel_ExKxN.shape
  for e in range(n_e):
    tensors = modelopt_tensors(fprop_weight(kernel_ExKxN[e], c), n, k)
    for suffix, value in tensors.items():
      out[f"{base}.{e}.{proj}.{suffix}"] = value
    if input_amax is not None:
      amax = np.float32(input_amax[t.path[:-1]])
      out[f"{base}.{e}.{proj}.input_scale"] = np.asarray(amax / np.float32(E4M3_X_E2M1_MAX), np.float32)
  return out


def nvfp4_quant_configs(excluded: Iterable[str], *, producer_version: str) -> tuple[dict, dict]:
  """(``hf_quant_config.json``, config.json's ``quantization_config``) in ModelOpt's format."""
  excluded = sorted(set(excluded))
  producer = {"name": "fp4jax", "version": producer_version}
  hf_quant = {"producer": producer,
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                               "exclude_modules": excluded}}
  fmt = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP}
  quantization_config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                         "kv_cache_quant_algo": None, "exclude_modules": excluded, "ignore": excluded,
                         "config_groups": {"group_0": {"weights": dict(fmt), "input_activations": dict(fmt),
                                                       "targets": ["Linear"]}},
                         "producer": producer}
  return hf_quant, quantization_config


def calibration_amax(model, params, tokens_BxL, paths: set[tuple[str, ...]]) -> dict[tuple, float]:
  """max |input| of each linear layer in ``paths`` over a forward pass of ``tokens_BxL`` (the input_scale
  of a static-activation NVFP4 checkpoint; training itself used each batch's own amax)."""
  seen: dict[tuple, float] = {}

  def see(path, x):
    if isinstance(x, fp4jax.PreQuantized):   # a producer quantized it in its pass: its values before that
      x = x.x
    amax = float(np.max(np.abs(np.asarray(x, np.float32)), initial=0.0))   # numpy's max keeps NaN
    if not np.isfinite(amax):
      raise ConversionError(f"calibration: the input of {'/'.join(path)} is not finite (max |x| = {amax}) on "
                            "the calibration tokens; export a checkpoint whose loss is finite, or choose other "
                            "calibration text (--calib_file)")
    seen[path] = max(seen.get(path, 0.0), amax)

  def record(next_fun, args, kwargs, context):
    path = tuple(context.module.path)
    if context.method_name != "__call__" or path not in paths:
      return next_fun(*args, **kwargs)
    if isinstance(context.module, moe.ExpertLinear):   # it returns the GEMM; the rows reach that (zero padding rows)
      return dataclasses.replace(next_fun(*args, **kwargs), observe=functools.partial(see, path))
    see(path, args[0])
    return next_fun(*args, **kwargs)

  mtp = {"mtp_logits": True} if model.config.mtp_depths else {}   # the MTP layers see their inputs too
  with nn.intercept_methods(record):
    model.apply({"params": params}, jnp.asarray(tokens_BxL, jnp.int32), **mtp)
  missing = sorted(paths - set(seen))
  if missing:
    raise ConversionError(f"calibration saw no input for {missing[:3]}")
  return seen
