"""The recipe study's variants: each a set of overrides (dotted config paths) of the study's base training
config, its one-line description, and the training config of one (variant, seed) run."""
from __future__ import annotations

import copy
from typing import Any

# Each variant is a set of overrides (dotted config paths) of the study's base training config.
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"recipe": "bf16"},
    "fp8": {"recipe": "fp8"},
    "mxfp4": {"recipe": "mxfp4"},
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4_no_sr": {"recipe": "nvfp4_no_sr"},
    "nvfp4_no_rht": {"recipe": "nvfp4_no_rht"},
    "nvfp4_no_2d": {"recipe": "nvfp4_no_2d"},
    "nvfp4_all_fp4": {"recipe": "nvfp4", "model.bf16_first_blocks": 0, "model.bf16_last_blocks": 0},
    "nvfp4_switch": {"recipe": "nvfp4", "precision_switch.mode": "fwd"},  # fraction from study.switch_fraction
    "nvfp4_4over6": {"recipe": "nvfp4_4over6"},
    "quartet2_rtn": {"recipe": "quartet2_rtn"},
    "quartet2": {"recipe": "quartet2"},
    "tetrajet2": {"recipe": "tetrajet2"},
    # Nemotron 3 Super's per-module policy (models.policy) with the paper's recipe, against nvfp4's.
    "nvfp4_super": {"recipe": "nvfp4", "model.precision": "nemotron3_super"},
    # Half of it: the paper's policy plus Mamba out_proj in MXFP8 (Super minus this = attention in bf16).
    "nvfp4_mxfp8_out_proj": {"recipe": "nvfp4", "model.precision": [
        ("blocks_{-1:}/*", "bf16"), ("blocks_*/mixer/out_proj", "mxfp8"), ("*", "recipe")]},
}
# The newer methods with every linear layer in FP4, the setting of their published comparisons.
for _name in ("nvfp4_4over6", "quartet2_rtn", "quartet2", "tetrajet2"):
  VARIANTS[f"{_name}_all_fp4"] = {**VARIANTS[_name], "model.bf16_first_blocks": 0, "model.bf16_last_blocks": 0}

DESCRIPTIONS = {
    "bf16": "no quantization (the reference)",
    "fp8": "E4M3, 1x128 blocks, 128x128 weight tiles",
    "mxfp4": "E2M1, E8M0 scale per 32, SR, RHT-32 on wgrad",
    "nvfp4": "paper recipe: 16x16 weight tiles, SR on grads, RHT-16 on wgrad",
    "nvfp4_no_sr": "nvfp4, round-to-nearest gradients",
    "nvfp4_no_rht": "nvfp4, no Hadamard transform on wgrad",
    "nvfp4_no_2d": "nvfp4, 1x16 weight blocks (dgrad requantizes W)",
    "nvfp4_all_fp4": "nvfp4, every linear layer in FP4 (no bf16 blocks)",
    "nvfp4_switch": "nvfp4, forward in bf16 for the last steps",
    "nvfp4_4over6": "nvfp4 + Four Over Six (MSE, bound 256) on weights and activations",
    "quartet2_rtn": "Quartet II: 1x16 RTN forward, MS-EDEN backward after RHT-128 on both backward GEMMs",
    "quartet2": "Quartet II with a Four Over Six forward",
    "tetrajet2": "TetraJet-v2: double-block scales, SR backward after RHT-16 on both backward GEMMs",
    "nvfp4_super": "nvfp4 with Nemotron 3 Super's policy: attention bf16, Mamba out_proj MXFP8, last "
                   "round(14/88 n) blocks bf16",
    "nvfp4_mxfp8_out_proj": "nvfp4 (last block bf16) with Mamba out_proj in MXFP8, attention in nvfp4",
}
DESCRIPTIONS.update({f"{n}_all_fp4": f"{DESCRIPTIONS[n]}; every linear layer in FP4"
                     for n in ("nvfp4_4over6", "quartet2_rtn", "quartet2", "tetrajet2")})


def set_path(config, path: str, value) -> None:
  """``config.<path> = value`` for a dotted ``path`` ("optim.lr")."""
  *parents, leaf = path.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def study_variants(config) -> list[str]:
  """The variant names of ``config.study.variants`` ("all" or comma-separated), bf16 first."""
  spec = config.study.variants
  names = list(VARIANTS) if spec in ("all", "", None) else [
      v.strip() for v in (spec.split(",") if isinstance(spec, str) else spec) if v.strip()]
  unknown = [v for v in names if v not in VARIANTS]
  if unknown:
    raise ValueError(f"config.study.variants: unknown {unknown}; choose from {list(VARIANTS)} or 'all'")
  if "bf16" not in names:
    raise ValueError("config.study.variants must include bf16: every gap is measured against it")
  return ["bf16"] + [v for v in names if v != "bf16"]


def reference_variant(config) -> str | None:
  """The variant every other one is compared with, paired by seed: ``config.study.reference`` if set, else
  nvfp4 (the paper's recipe) or, in a study without it, nvfp4_all_fp4; None if the study has neither."""
  variants = study_variants(config)
  wanted = config.study.get("reference")
  if wanted:
    if wanted not in variants:
      raise ValueError(f"config.study.reference={wanted!r} is not among the study's variants {variants}; "
                       "add it to config.study.variants or choose one of them")
    return wanted
  return next((v for v in ("nvfp4", "nvfp4_all_fp4") if v in variants), None)


def run_config(config, variant: str, seed: int):
  """The training config of one run: the study config without its ``study`` section, plus the variant."""
  run = copy.deepcopy(config)
  with run.unlocked():
    del run["study"]
  run.name = f"{config.name}/{variant}/seed{seed}"
  run.seed = int(seed)
  for path, value in VARIANTS[variant].items():
    set_path(run, path, value)
  if variant == "nvfp4_switch":
    run.precision_switch.fraction = float(config.study.switch_fraction)
  return run
