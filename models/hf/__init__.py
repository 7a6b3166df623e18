"""Conversion between ``LanguageModel`` parameters and Hugging Face Nemotron-H checkpoints (pure functions).

transformers' ``NemotronHForCausalLM`` is the same architecture: pre-norm residual blocks chosen by a
pattern (``M`` Mamba-2, ``*`` attention without position encoding, ``-`` squared-ReLU MLP), RMSNorm,
untied LM head. The layouts differ, and every difference is a fixed permutation or a transpose:

  ours (Flax)                                       Nemotron-H (torch, ``backbone.`` prefix)
  Dense kernel  [in, out]                           Linear weight [out, in]
  in_proj out axis per group g: z_g x_g B_g C_g dt_g  [z | x | B | C | dt], each over all groups/heads
  conv channels per group g: x_g B_g C_g              [x | B | C];  conv weight [W, E] -> [E, 1, W]
  fused qkv, per KV head k: R queries, key, value     q_proj, k_proj, v_proj
  blocks_<i>/norm/scale, mixer/norm_scale             layers.<i>.norm.weight, mixer.norm.weight

transformers clamps softplus(dt + dt_bias) from below at ``time_step_min`` in its chunked scan; this model
does not clamp, so the exported config sets ``time_step_min = 0`` (a no-op clamp) and the math matches.

NVFP4 out (``to_hf_nvfp4``): every linear layer the precision policy quantizes is written in NVIDIA ModelOpt's
layout (``weight`` uint8 [N, K/2], two E2M1 codes per byte, element 2j in the low nibble; ``weight_scale``
float8_e4m3fn [N, K/16]; ``weight_scale_2`` float32 = amax / (6 * 448); ``input_scale`` float32 =
activation amax / (6 * 448)). The codes and scales are those of the training forward pass: the weight cast
to the compute dtype, quantized by ``fp4jax.quantize(w.T, "nvfp4", tile=(16, 16))``; a 16x16 tile's scale
is the scale of each of its sixteen 1x16 row blocks, so it is only repeated, never recomputed.

NVFP4 in (``dequantize_nvfp4``, after ``nvfp4_checkpoint`` accepted the quantization config): each NVFP4 weight
decoded to float32, (e2m1 · f32(weight_scale)) · weight_scale_2, the first product exact, the second one
rounding; ``from_hf`` then reads the float32 tensors. ``requantization_mismatches`` names the layers whose
training quantization does not give the checkpoint's codes and scales back (none for our own exports).

No torch here: tensors are numpy arrays (bfloat16 / float8 through ml_dtypes) and safetensors files are
read and written by the small codec of ``models.hf.files``.

Legend: N output features, K input features, G SSM groups, R heads per group (SSM) or queries per KV head
(attention), P head dim, H heads, E conv channels, W conv width, D model width, V vocabulary.

The package, one idea a module: ``files`` (the safetensors codec, export folders, checksums), ``layout`` (which
tensor goes where), ``config`` (config.json both ways), ``params`` (the parameters both ways), ``modelopt``
(the NVFP4 export), ``dequantize`` (an NVFP4 checkpoint read back).
"""
from models.hf.config import from_hf_config, model_config_from_json, model_config_to_json, to_hf_config
from models.hf.dequantize import dequantize_nvfp4, nvfp4_checkpoint, requantization_mismatches
from models.hf.files import (ConversionError, load_hf_tensors, load_quant_config, load_safetensors, save_hf_tensors,
                             save_safetensors)
from models.hf.layout import GROUP, HF_LAYER_TYPES, MTP_BLOCKS, PREFIX, Linear, Tensor, check_exportable, layout
from models.hf.modelopt import (calibration_amax, fprop_weight, modelopt_tensors, nvfp4_quant_configs,
                                quantized_paths, to_hf_nvfp4)
from models.hf.params import check_params, from_hf, to_hf

__all__ = ["GROUP", "HF_LAYER_TYPES", "MTP_BLOCKS", "PREFIX", "ConversionError", "Linear", "Tensor",
           "calibration_amax", "check_exportable", "check_params", "dequantize_nvfp4", "fprop_weight", "from_hf",
           "from_hf_config", "layout", "load_hf_tensors", "load_quant_config", "load_safetensors",
           "model_config_from_json", "model_config_to_json", "modelopt_tensors", "nvfp4_checkpoint",
           "nvfp4_quant_configs", "quantized_paths", "requantization_mismatches", "save_hf_tensors",
           "save_safetensors", "to_hf", "to_hf_config", "to_hf_nvfp4"]
