"""What the op_names of compiled HLO say about fp4jax's and the model's work: which GEMM pass and
primitive an op belongs to (``label``), which model part (``part``), which linear layer (``layer``),
which phase of the step (``phase``).

The names are ``jax.named_scope`` paths that survive jit, jvp, transpose and remat, e.g.
``jit(train_step)/jvp(LanguageModel)/blocks_0/mixer/models/linear/in_proj/jvp(fp4jax/dot)/fprop/
fp4jax/quantize/nvfp4_1x16/fp4jax_quantize_xla/reduce_max``. Standard library only: bench/predict/hlo_parts.py
reads them from HLO text, tools/profile.py from a profile.
"""
from __future__ import annotations

import re

_PASS = re.compile(r"\b(fprop|dgrad|wgrad)\b")
_PRIM = re.compile(r"fp4jax/(quantize_rht_t|quantize|dequantize|scaled_matmul|rht|random_bits|rmsnorm_quantize|relu2_quantize)\b")


def label(op_name: str) -> str:
  """What an op belongs to, from its op_name: ``<pass>/<primitive>`` inside fp4jax.dot (pass =
  fprop/dgrad/wgrad), ``<primitive>`` elsewhere, else ``other``."""
  prims = _PRIM.findall(op_name)
  passes = _PASS.findall(op_name)
  prim = prims[-1] if prims else None
  if prim is None:
    return f"{passes[-1]}/other" if passes else "other"
  return f"{passes[-1]}/{prim}" if passes else prim


def scope(op_name: str) -> str | None:
  """The call of an fp4jax primitive an op belongs to: its op_name up to the last
  ``fp4jax/<primitive>`` (``.../blocks_0/mixer/in_proj/fprop/fp4jax/quantize``), or None."""
  last = None
  for last in _PRIM.finditer(op_name):
    pass
  return op_name[:last.end()] if last else None


MODEL_PART = re.compile(r"\bmodels/([a-z0-9_]+)")
# fp4jax labels of quantize passes (``label``'s names; a dequantize is not one)
QUANTIZE = re.compile(r"(?:^|/)(?:quantize|quantize_rht_t|rht|random_bits|rmsnorm_quantize|relu2_quantize)$")
_STEP_PART = re.compile(r"(?:^|/)(optimizer|grad_norm|nonfinite_guard|moe_balance|osci_reset)(?:/|$)")


def part(op_name: str) -> str:
  """Where an op belongs: fp4jax's ``label`` inside fp4jax.dot or a primitive (``fprop/quantize``,
  ``wgrad/other``, ...), else the innermost ``models/<part>`` scope (``models.scopes``:
  ``mamba2_conv_silu``, ``rmsnorm``, ...), else a train-step scope (``optimizer``, ``grad_norm``, ...),
  else "unscoped" (an op_name outside every named part) or "" (no op_name)."""
  lab = label(op_name)
  if lab != "other":
    return lab
  parts = MODEL_PART.findall(op_name)
  if parts:
    return parts[-1]
  step = _STEP_PART.findall(op_name)
  if step:
    return step[-1]
  return "unscoped" if op_name else ""


def phase(op_name: str) -> str:
  """"fwd", "remat" (a rematerialized forward, inside the backward pass) or "bwd" (jvp's transpose)."""
  if "rematted_computation" in op_name:
    return "remat"
  return "bwd" if "transpose(" in op_name else "fwd"


_CALL = re.compile(r"fp4jax/(?:dot|grouped_dot)\b|" + _PRIM.pattern)
_JIT = re.compile(r"(?:^|/)jit\([^()]*\)")
_WRAPPER = re.compile(r"\b[a-z_]+\(")
_DOT_MODULE = re.compile(r"Fp4DotGeneral(?:NNX)?_\d+")   # fp4jax.flax's module inside a layer
_NOISE = ("checkpoint", "rematted_computation")


def layer(op_name: str) -> str | None:
  """The layer whose fp4jax call an op belongs to: the op_name before its first ``fp4jax/dot`` (or
  primitive), without jit's function name, the transformations' wrappers (``jvp(``, ``transpose(``, ...),
  remat's ``checkpoint``/``rematted_computation``, the ``models/<part>`` scopes, fp4jax.flax's
  ``Fp4DotGeneral_0`` and a repeated name (``.../in_proj/in_proj/Fp4DotGeneral_0/fp4jax/dot`` ->
  ``LanguageModel/blocks_0/mixer/in_proj``); "" for a call at the top of the function; None outside fp4jax."""
  call = _CALL.search(op_name)
  if call is None:
    return None
  path = _WRAPPER.sub("", _JIT.sub("", op_name[:call.start()])).replace(")", "")
  out = []
  for p in MODEL_PART.sub("", path).split("/"):
    if p and p not in _NOISE and not _DOT_MODULE.fullmatch(p) and (not out or out[-1] != p):
      out.append(p)
  return "/".join(out)
