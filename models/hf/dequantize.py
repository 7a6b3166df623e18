"""NVFP4 checkpoints in NVIDIA ModelOpt's layout read back, the inverse of ``models.hf.modelopt``: the quantization
config checked, every NVFP4 weight decoded to float32, and the layers whose training quantization does not give
the checkpoint's codes and scales again.

A quantized module ``m`` is ``m.weight`` (uint8 [N, K/2], two E2M1 codes a byte, element 2j in the low nibble),
``m.weight_scale`` (float8_e4m3fn [N, K/16], one scale per 1x16 block along K), ``m.weight_scale_2`` (float32 [])
and, for a W4A4 checkpoint, ``m.input_scale`` (float32 []). Decoded, left to right in float32:

  w = (e2m1(code) · f32(weight_scale)) · weight_scale_2

The first product is exact: an E2M1 value has at most 2 significant bits and an E4M3 value at most 4, so the
product has at most 6, within [2^-10, 2688] or zero; fp4jax's own decoder computes it (``block_products``). The
one multiply by ``weight_scale_2`` rounds once: ``w`` is the float32 nearest the real value the checkpoint stands
for. ``input_scale`` (a serving engine's static
activation scale) is not a parameter: training measures each activation's amax as it goes, and an export
calibrates the input scales again.

Re-quantized as the training forward pass does (16x16 tiles, amax = max |w|), these weights give the checkpoint's
codes, block scales and ``weight_scale_2`` back when the checkpoint is one of ours (docs/EXPORT.md says why, and
where not); ``requantization_mismatches`` names the layers where that fails.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp4jax
from models import ModelConfig
from models.hf.files import QUANT_CONFIG, ConversionError
from models.hf.layout import E4M3_X_E2M1_MAX, GROUP, QUANTIZED_SUFFIXES, canonical_name
from models.hf.modelopt import to_hf_nvfp4

_ORIGINAL = "import the bf16/fp32 checkpoint it was made from"
# Tensors of ModelOpt formats other than plain NVFP4, named when a checkpoint has them without saying so.
_FOREIGN = {"pre_quant_scale": "an AWQ / SmoothQuant input scaling (quant_algo NVFP4_AWQ or NVFP4_SVD)",
            "k_scale": "a KV-cache scale (kv_cache_quant_algo FP8)", "v_scale": "a KV-cache scale "
            "(kv_cache_quant_algo FP8)"}


def nvfp4_checkpoint(config_json: dict, hf_quant: dict | None = None) -> bool:
  """True when ``hf_quant_config.json`` (``hf_quant``) or config.json's ``quantization_config`` declare ModelOpt
  NVFP4 (E2M1 weights, an E4M3 scale per 16 elements, a float32 tensor scale, no KV-cache quantization); False
  when neither declares a quantization. Any other quantization raises a ConversionError naming the setting."""
  declared = []
  if hf_quant is not None:
    quantization = hf_quant.get("quantization")
    if not isinstance(quantization, dict):
      raise ConversionError(f"{QUANT_CONFIG} has no 'quantization' entry, so it is not ModelOpt's; remove it if "
                            f"the checkpoint is not quantized, or {_ORIGINAL}")
    declared.append((QUANT_CONFIG, quantization))
  config = config_json.get("quantization_config")
  if config:
    method = config.get("quant_method")
    if method != "modelopt":
      raise ConversionError(f"config.json has quantization_config.quant_method={method!r}; only NVIDIA ModelOpt "
                            f"NVFP4 checkpoints (quant_method 'modelopt', quant_algo 'NVFP4') import: {_ORIGINAL}")
    declared.append(("config.json's quantization_config", config))
  for where, quantization in declared:
    _check_nvfp4(where, quantization)
  return bool(declared)


def _check_nvfp4(where: str, quantization: dict) -> None:
  algo = quantization.get("quant_algo")
  if algo == "MIXED_PRECISION":
    layers = (quantization.get("quantized_layers") or {}).values()
    per_layer = sorted({str(layer.get("quant_algo")) for layer in layers})
    raise ConversionError(f"{where} has quant_algo='MIXED_PRECISION' (per layer: {', '.join(per_layer)}); only a "
                          f"checkpoint in NVFP4 throughout imports: {_ORIGINAL}")
  if algo != "NVFP4":
    raise ConversionError(f"{where} has quant_algo={algo!r}; only NVFP4 (E2M1 weights, one E4M3 scale per {GROUP} "
                          f"elements, a float32 tensor scale) imports: {_ORIGINAL}")
  formats = [group.get(role) or {} for group in (quantization.get("config_groups") or {}).values()
             for role in ("weights", "input_activations")]
  sizes = {quantization.get("group_size")} | {fmt.get("group_size") for fmt in formats}
  other = sorted(str(size) for size in sizes - {None, GROUP})
  if other:
    raise ConversionError(f"{where} has group_size {', '.join(other)}; NVFP4 has one E4M3 scale per {GROUP} "
                          f"elements (group_size {GROUP}), the blocks this model trains with: {_ORIGINAL}")
  for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
    if quantization.get(key):
      raise ConversionError(f"{where} has {key}={quantization[key]!r}: the checkpoint carries the scales of a "
                            "quantized KV cache for serving (k_proj.k_scale, v_proj.v_scale), which this model, "
                            "trained without one, has no place for; export the checkpoint without KV-cache "
                            f"quantization (ModelOpt's hf_ptq.py --kv_cache_qformat none), or {_ORIGINAL}")


def dequantize_nvfp4(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The checkpoint with every NVFP4 module's ``weight`` decoded to float32 (module docstring) and its scales
  removed; every other tensor as it is."""
  modules = sorted(name[:-len(".weight_scale")] for name in tensors if name.endswith(".weight_scale"))
  if not modules:
    raise ConversionError("the quantization config declares NVFP4, but no tensor of the checkpoint has a "
                          f"weight_scale: if it is not quantized, remove {QUANT_CONFIG} and config.json's "
                          "quantization_config; else its NVFP4 tensors are missing, export or download it again")
  for name in tensors:
    suffix = name.rsplit(".", 1)[-1]
    if suffix in _FOREIGN:
      raise ConversionError(f"the checkpoint has {name}, {_FOREIGN[suffix]}, which plain NVFP4 does not have and "
                            f"this model has no place for: {_ORIGINAL}")
    if name.endswith(QUANTIZED_SUFFIXES) and name.rsplit(".", 1)[0] not in modules:
      raise ConversionError(f"{name} has no {name.rsplit('.', 1)[0]}.weight_scale beside it: an NVFP4 module has "
                            "weight, weight_scale and weight_scale_2; the checkpoint is incomplete, export or "
                            "download it again")
  out = {name: value for name, value in tensors.items() if not name.endswith(QUANTIZED_SUFFIXES)}
  for module in modules:
    out[module + ".weight"] = _decode(module, tensors)
  return out


def _decode(module: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
  """float32 [N, K] of one module: (e2m1(code) · f32(weight_scale)) · weight_scale_2."""
  if module + ".weight" not in tensors or module + ".weight_scale_2" not in tensors:
    missing = module + (".weight" if module + ".weight" not in tensors else ".weight_scale_2")
    raise ConversionError(f"the checkpoint lacks {missing}: an NVFP4 module has weight, weight_scale and "
                          "weight_scale_2; export or download it again")
  packed = np.asarray(tensors[module + ".weight"])
  scale, scale_2 = np.asarray(tensors[module + ".weight_scale"]), np.asarray(tensors[module + ".weight_scale_2"])
  if packed.dtype != np.uint8 or packed.ndim != 2:
    raise ConversionError(f"{module}.weight is {packed.dtype} {list(packed.shape)}; an NVFP4 weight is uint8 "
                          "[N, K/2], two E2M1 codes a byte")
  n, k = packed.shape[0], 2 * packed.shape[1]
  if scale.dtype != ml_dtypes.float8_e4m3fn or k % GROUP or scale.shape != (n, k // GROUP):
    raise ConversionError(f"{module}.weight_scale is {scale.dtype} {list(scale.shape)}; for an NVFP4 weight of "
                          f"{n} x {k} it is float8_e4m3fn [{n}, {k // GROUP}], one scale per {GROUP} elements along "
                          "K (scales swizzled or padded for a GEMM kernel do not import)")
  if scale_2.dtype != np.float32 or scale_2.size != 1:
    raise ConversionError(f"{module}.weight_scale_2 is {scale_2.dtype} {list(scale_2.shape)}; it is one float32")
  factor = np.float32(scale_2.reshape(()))
  if not np.isfinite(factor) or factor < 0 or not np.all(scale.astype(np.float32) >= 0):   # NaN fails >= too
    raise ConversionError(f"{module} has a negative or non-finite scale (weight_scale_2 {factor}); the checkpoint "
                          "is damaged: export or download it again")
  return block_products(packed, scale) * factor   # the one rounding (numpy: nothing reassociates it)


def block_products(packed, scale) -> np.ndarray:
  """e2m1(code) · f32(scale) of every element (packed: uint8 [N, K/2]; scale: float8_e4m3fn [N, K/16]) as float32
  [N, K], exact, decoded by fp4jax: ``fp4jax.dequantize`` with the tensor amax 6 · 448, whose tensor factor
  (f32(s) · 2688) · f32(1/2688) is s itself for every E4M3 value s (tests/test_hf_import_nvfp4.py checks all of them),
  so only the exact product e2m1 · s remains."""
  q = fp4jax.QTensor(data=jnp.asarray(packed), scale=jnp.asarray(scale), amax=jnp.float32(E4M3_X_E2M1_MAX),
                     fmt="nvfp4", axis=-1, block=GROUP, tile=None, dtype=jnp.float32)
  return np.asarray(fp4jax.dequantize(q, jnp.float32))


def requantization_mismatches(params, c: ModelConfig, recipe, tensors: dict[str, np.ndarray]) -> dict[str, list[str]]:
  """Modules (names as ``to_hf_nvfp4`` writes them) where quantizing the imported ``params`` as the training
  forward pass does (the precision policy of ``c`` and ``recipe``, 16x16 weight tiles) does not give the
  checkpoint's NVFP4 ``tensors`` back:
    ``bf16``       NVFP4 in the checkpoint, kept in bf16 by the policy;
    ``nvfp4``      bf16 in the checkpoint, NVFP4 under the policy;
    ``different``  NVFP4 in both, with other codes, block scales or weight_scale_2.
  Codes under a zero block scale decode to zero whatever they are and are not compared."""
  ours, _ = to_hf_nvfp4(params, c, recipe)
  theirs = {canonical_name(name): value for name, value in tensors.items()
            if c.mtp_depths or not name.startswith("mtp.")}
  quantized = lambda named: {name[:-len(".weight_scale")] for name in named if name.endswith(".weight_scale")}
  both = quantized(ours) & quantized(theirs)
  return {"bf16": sorted(quantized(theirs) - both), "nvfp4": sorted(quantized(ours) - both),
          "different": [m for m in sorted(both) if not _same_nvfp4(ours, theirs, m)]}


def _same_nvfp4(a: dict[str, np.ndarray], b: dict[str, np.ndarray], module: str) -> bool:
  scale_a, scale_b = (np.asarray(t[module + ".weight_scale"]) for t in (a, b))
  if scale_a.shape != scale_b.shape or a[module + ".weight"].shape != b[module + ".weight"].shape:
    return False
  if scale_a.view(np.uint8).tobytes() != scale_b.view(np.uint8).tobytes():
    return False
  if np.asarray(a[module + ".weight_scale_2"]).tobytes() != np.asarray(b[module + ".weight_scale_2"]).tobytes():
    return False
  counts = np.repeat(scale_a.astype(np.float32) != 0, GROUP // 2, axis=1)   # per byte: a block is 8 bytes
  return bool(np.all((a[module + ".weight"] == b[module + ".weight"]) | ~counts))
