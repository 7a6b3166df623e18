"""The precision policy: which recipe each linear layer's three GEMMs run, decided from its module path.

``config.precision`` (``models.rules``) is an ordered list of rules, first match wins, or a preset:
  "nemotron_h"       the paper's policy (the default): the config's first ``bf16_first_blocks`` and last
                     ``bf16_last_blocks`` blocks in bf16, every other linear layer in the model's recipe
  "nemotron3_super"  Nemotron 3 Super's (Megatron-Bridge): attention qkv/out, the MoE latent projections
                     and the MTP layers in bf16, Mamba out_proj in MXFP8, the last round(14/88 · n_blocks)
                     blocks in bf16 (14 of Super's 88), everything else (experts, shared experts, Mamba
                     in_proj, MLPs) in the model's recipe
  "all_fp4"          every eligible linear layer in the model's recipe
Only a linear layer named in ``QUANTIZABLE_LAYERS`` inside a block (``blocks_<i>``) or an MTP layer
(``mtp_<d>``) is eligible; the embedding, LM head, norms, SSM scan and its parameters, the router and the
attention score/value products are never a quantized dot, and a rule aimed at them is an error. A model
whose recipe quantizes nothing (bf16) runs every layer in bf16 whatever the rules say.

``decide`` gives a layer's ``Decision`` (its recipe, per GEMM, and the rule that chose it);
``dot_general_cls`` turns it into the ``dot_general_cls`` of ``nn.Dense`` (the only place that imports
``fp4jax.flax``); ``outcontrol_ratio`` says where TetraJet-v2's OutControl applies (``config.outcontrol_ratio
> 0`` and a layer running a tetrajet2 recipe). Each layer draws its own random bits from the "fp4" stream
(its own module path), so layers of different recipes keep independent stochastic-rounding keys.

A leaf of ``models``: it imports only ``models.config``, ``models.rules`` and fp4jax's public API; the
report that lists every layer's decision, ``describe_linear_layers``, builds the model and lives in
``models.report``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Iterable, Sequence

from fp4jax import Recipe, recipes
from fp4jax.quantizers import TRANSPOSED, Roles
from models import rules as rules_lib
from models.config import ModelConfig
from models.rules import MODEL_RECIPE, PrecisionRuleError, Rule

# MoE blocks: experts/up, experts/down and shared_experts/up, /down end in "up"/"down"; the router never.
QUANTIZABLE_LAYERS = ("in_proj", "out_proj", "qkv", "out", "gate", "up", "down", "fc1_latent_proj",
                      "fc2_latent_proj", "eh_proj")   # eh_proj: an MTP module's input projection (models.mtp)
_BLOCK = re.compile(r"blocks_(\d+)")
_GROUP = re.compile(r"blocks_\d+_\d+x\d+")     # a scanned group of blocks (models.lm.BlockGroup)
_MTP = re.compile(r"mtp_\d+")
# Linear layers of a block, relative to it (block_signature): today's and the MoE layers' names.
_BLOCK_LAYERS = tuple(f"mixer/{n}" for n in QUANTIZABLE_LAYERS) + tuple(
    f"mixer/{n}" for n in ("experts/up", "experts/down", "experts/gate", "shared_experts/up",
                           "shared_experts/down", "shared_experts/gate", "fc1_latent_proj", "fc2_latent_proj"))
# What a rule may aim at by mistake: never-quantized modules, by a word of their names.
NEVER_QUANTIZED = (("embed", "the embedding"), ("lm_head", "the LM head"), ("norm", "a norm"),
                   ("router", "the MoE router"), ("A_log", "the SSM scan"), ("dt_bias", "the SSM scan"),
                   ("conv", "the SSM scan's conv"), ("ssm", "the SSM scan"), ("scan", "the SSM scan"))
_SUPER_LAST = (14, 88)   # Nemotron 3 Super keeps the last 14 of its 88 layers in bf16


def _path_tuple(path: str | Sequence[str]) -> tuple[str, ...]:
  return tuple(path.split("/")) if isinstance(path, str) else tuple(str(p) for p in path)


def block_index(path: str | Sequence[str]) -> int | None:
  """The block a parameter/module path belongs to (``blocks_<i>`` element), or None."""
  for part in _path_tuple(path):
    match = _BLOCK.fullmatch(part)
    if match:
      return int(match.group(1))
  return None


def module_path(path: str | Sequence[str]) -> str:
  """The path rules match: "/"-joined, without the scanned-group level (``blocks_2_5x9/``)."""
  return "/".join(p for p in _path_tuple(path) if not _GROUP.fullmatch(p))


def is_eligible(path: str | Sequence[str]) -> bool:
  """Whether the layer at ``path`` can run a quantized dot: a ``QUANTIZABLE_LAYERS`` name in a block or in
  an MTP layer."""
  parts = _path_tuple(path)
  return bool(parts) and parts[-1] in QUANTIZABLE_LAYERS and (
      block_index(parts) is not None or any(_MTP.fullmatch(p) for p in parts))


# -------------------------------------------------------------------------------------------------- the rules

def super_last_blocks(n_blocks: int) -> int:
  """Blocks the nemotron3_super preset keeps in bf16 at the end: 14 of 88, scaled to the model (rounded)."""
  return int(math.floor(n_blocks * _SUPER_LAST[0] / _SUPER_LAST[1] + 0.5))


def _blocks(which: str, n: int) -> str:
  return f"{which} block" if n == 1 else f"{which} {n} blocks"


def _bf16(pattern: str, why: str) -> Rule:
  return Rule(pattern, "bf16", why=why, required=False)


@functools.lru_cache(maxsize=256)
def rules(config: ModelConfig) -> tuple[Rule, ...]:
  """The ordered rules of ``config.precision`` (a preset expanded against the config)."""
  precision = config.precision
  if not isinstance(precision, str):
    return precision
  first, last = config.bf16_first_blocks, config.bf16_last_blocks
  out = []
  if precision == "nemotron_h":
    if first:
      out.append(_bf16(f"blocks_{{:{first}}}/*", _blocks("first", first)))
    if last:
      out.append(_bf16(f"blocks_{{-{last}:}}/*", _blocks("last", last)))
    out.append(_bf16("mtp_*", "MTP"))
  elif precision == "nemotron3_super":
    out.append(_bf16("mtp_*", "MTP"))
    n_last = super_last_blocks(config.n_blocks)
    if n_last:
      out.append(_bf16(f"blocks_{{-{n_last}:}}/*", _blocks("last", n_last)))
    out += [_bf16("blocks_*/mixer/qkv", "attention"), _bf16("blocks_*/mixer/out", "attention"),
            _bf16("blocks_*/mixer/fc1_latent_proj", "latent"), _bf16("blocks_*/mixer/fc2_latent_proj", "latent"),
            Rule("blocks_*/mixer/out_proj", "mxfp8", why="Mamba out_proj", required=False)]
  out.append(Rule("*", MODEL_RECIPE, required=False, why="the recipe"))
  return tuple(out)


def matching_rule(config: ModelConfig, path: str | Sequence[str]) -> int | None:
  """The index in ``rules(config)`` of the first rule matching the layer at ``path``, or None."""
  name = module_path(path)
  for i, rule in enumerate(rules(config)):
    if rules_lib.matches(rule.pattern, name, config.n_blocks):
      return i
  return None


def block_signature(config: ModelConfig, index: int) -> tuple:
  """Which rule each linear layer of block ``index`` follows (blocks with equal kinds and signatures can
  share one scanned step, ``models.lm.block_groups``)."""
  return tuple(matching_rule(config, f"blocks_{index}/{rel}") for rel in _BLOCK_LAYERS)


# -------------------------------------------------------------------------------------------------- decisions

@dataclasses.dataclass(frozen=True)
class Decision:
  """What one linear layer runs. ``recipe``: a Recipe or a Roles table for ``fp4jax.dot_general``, None for
  plain ``lax.dot_general``; ``gemms``: the recipe name of each of fprop, dgrad, wgrad ("bf16": unquantized);
  ``why``: the rule that decided (its ``why`` or pattern)."""

  recipe: Recipe | Roles | None
  gemms: tuple[str, str, str]
  why: str
  rank: int = -1            # the deciding rule's index (-1: no rule), to list the reasons in rule order

  @property
  def label(self) -> str:
    """"bf16"; the Recipe's name (one recipe for the layer, e.g. "nvfp4", "mxfp8", "nvfp4_bf16_fprop"); or,
    where a rule overrides single GEMMs, each GEMM's: "fprop bf16/dgrad nvfp4/wgrad nvfp4"."""
    if self.recipe is None:
      return "bf16"
    if isinstance(self.recipe, Recipe):
      return self.recipe.name
    return "/".join(f"{g} {r}" for g, r in zip(rules_lib.GEMMS, self.gemms))


_BF16_GEMMS = ("bf16", "bf16", "bf16")


def _gemm_names(recipe: Recipe) -> tuple[str, str, str]:
  return tuple("bf16" if getattr(recipe, g) == "bf16" else recipe.name for g in rules_lib.GEMMS)


def _resolve(value, recipe: Recipe) -> Recipe:
  return recipe if value == MODEL_RECIPE else recipes.get(value)


def _compose(rule: Rule, base: Recipe, recipe: Recipe) -> tuple[Roles, tuple[str, str, str]]:
  """The Roles of ``base`` with the GEMMs the rule overrides taken from other recipes."""
  sources = {g: _resolve(rule.overrides.get(g, base), recipe) if g in rule.overrides else base
             for g in rules_lib.GEMMS}
  for g, r in sources.items():
    if r.scheme != "nvidia" and r.quantizes_anything:
      raise PrecisionRuleError(f"precision rule {rule.pattern!r}: a per-GEMM override mixes {r.name!r} "
                               f"(scheme {r.scheme!r}), whose backward pass re-quantizes the forward's operands; "
                               "per-GEMM overrides take the paper-style recipes (nvfp4, mxfp4, fp8, mxfp8, bf16)")
  fp, dg, wg = (sources[g].roles for g in rules_lib.GEMMS)
  dgrad_w = dg.dgrad_w
  if dgrad_w == TRANSPOSED and sources["fprop"] is not sources["dgrad"]:
    dgrad_w = dg.fprop_w   # the same 16x16 tiles, quantized from w (K, N) itself: equal values
  align = tuple(math.lcm(*axis) for axis in zip(*(r.roles.alignment() for r in sources.values())))
  names = tuple(_gemm_names(sources[g])[k] for k, g in enumerate(rules_lib.GEMMS))
  name = "+".join([base.name] + [f"{g}:{sources[g].name}" for g in rule.overrides])
  roles = Roles(fprop_x=fp.fprop_x, fprop_w=fp.fprop_w, dgrad_dy=dg.dgrad_dy, dgrad_w=dgrad_w,
                wgrad_x=wg.wgrad_x, wgrad_dy=wg.wgrad_dy, key_reason=base.roles.key_reason, align=align,
                name=name, out_dtype=base.out_dtype)
  return roles, names


@functools.lru_cache(maxsize=4096)
def _decide(config: ModelConfig, recipe: Recipe, name: str) -> Decision:
  if not is_eligible(name):
    return Decision(None, _BF16_GEMMS, "never quantized")
  if not recipe.quantizes_anything:
    return Decision(None, _BF16_GEMMS, f"recipe {recipe.name}")
  index = matching_rule(config, name)
  if index is None:
    return Decision(None, _BF16_GEMMS, "no rule")
  rule = rules(config)[index]
  base = _resolve(rule.recipe, recipe)
  if not rule.overrides:
    if not base.quantizes_anything:
      return Decision(None, _BF16_GEMMS, rule.label, index)
    return Decision(base, _gemm_names(base), rule.label, index)
  roles, names = _compose(rule, base, recipe)
  return Decision(roles if roles.quantizes_anything else None, names, rule.label, index)


def decide(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> Decision:
  """The ``Decision`` for the linear layer at ``path`` (e.g. ``("blocks_3", "mixer", "in_proj")``) of a
  model built with ``recipe``."""
  return _decide(config, recipes.get(recipe), module_path(path))


def layer_precision(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> str:
  """``"bf16"`` for a layer kept in high precision, else its recipe's name (``"nvfp4"``, ``"mxfp8"``, ...;
  ``Decision.label`` when a rule overrides single GEMMs)."""
  return decide(config, recipe, path).label


def dot_general_cls(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> Any:
  """The ``dot_general_cls`` for ``nn.Dense`` at ``path``: None (plain ``lax.dot_general``) for bf16
  layers, else ``partial(fp4jax.flax.Fp4DotGeneral, recipe=<the layer's recipe or Roles>)``."""
  layer_recipe = decide(config, recipe, path).recipe
  if layer_recipe is None:
    return None
  from fp4jax.flax import Fp4DotGeneral  # pylint: disable=g-import-not-at-top  (only quantized runs need it)
  return functools.partial(Fp4DotGeneral, recipe=released(config, layer_recipe))


def released(config: ModelConfig, recipe: Recipe | Roles) -> Recipe | Roles:
  """A quantized layer's ``recipe`` as the model releases its backward's dx and dw (``config.release_dx_with_dw``:
  apart where False; the recipe's own choice otherwise)."""
  return recipe if config.release_dx_with_dw else dataclasses.replace(recipe, release_dx_with_dw=False)


def outcontrol_ratio(config: ModelConfig, recipe: Recipe | str, path: str | Sequence[str]) -> float:
  """The OutControl ratio of the linear layer at ``path``: ``config.outcontrol_ratio`` for a layer that runs
  a tetrajet2 recipe's quantized dot, else 0.0 (no OutControl). The layer then puts
  ``fp4jax.outcontrol.k8(in_features, ratio)`` input channels in MXFP8 (a multiple of 128; 0 below 128)."""
  if not config.outcontrol_ratio:
    return 0.0
  layer_recipe = decide(config, recipe, path).recipe
  if not isinstance(layer_recipe, Recipe) or layer_recipe.scheme != "tetrajet2":
    return 0.0
  return config.outcontrol_ratio


# -------------------------------------------------------------------------------------------------- checks

def check_rules(config: ModelConfig, param_paths: Iterable[str | Sequence[str]]) -> None:
  """PrecisionRuleError for the first user rule that matches no eligible linear layer of the model whose
  parameters are ``param_paths`` (e.g. ``("blocks_0", "mixer", "in_proj", "kernel")``), naming the rule,
  and saying so when it aims at a module that is never quantized. Presets' rules may match nothing."""
  params = [module_path(p) for p in param_paths]
  linear = sorted({p.rsplit("/", 1)[0] for p in params if p.endswith("/kernel") and is_eligible(p.rsplit("/", 1)[0])})
  others = sorted({prefix for p in params for prefix in _prefixes(p)} - set(linear))
  n = config.n_blocks
  for i, rule in enumerate(rules(config)):
    if not rule.required or any(rules_lib.matches(rule.pattern, p, n) for p in linear):
      continue
    hit = next((p for p in others if rules_lib.matches(rule.pattern, p, n)), None)
    word = next(((w, what) for w, what in NEVER_QUANTIZED if w.lower() in (hit or rule.pattern).lower()), None)
    if hit is not None or word is not None:
      what = word[1] if word else "a module that is not a linear layer"
      target = f"{hit} ({what})" if hit else what
      raise PrecisionRuleError(
          f"precision rule {i} {rule.pattern!r} targets {target}, which is never quantized: the embedding, LM "
          "head, norms, SSM scan and router always run in high precision; remove the rule")
    examples = ", ".join(linear[:4]) + (", ..." if len(linear) > 4 else "")
    raise PrecisionRuleError(f"precision rule {i} {rule.pattern!r} matches no linear layer of the model (a typo?); "
                             f"its linear layers are {examples}")


def _prefixes(path: str):
  parts = path.split("/")
  return ("/".join(parts[:k]) for k in range(1, len(parts) + 1))


def summarize(decisions: Sequence[Decision]) -> str:
  """"nvfp4 8 layers, mxfp8 2, bf16 6 (attention, last 1 blocks)": layers per label, most first, bf16 last
  with the rules that kept them in bf16."""
  counts: dict[str, int] = {}
  whys: dict[str, int] = {}
  for d in decisions:
    counts[d.label] = counts.get(d.label, 0) + 1
    if d.label == "bf16":
      whys.setdefault(d.why, d.rank)
  whys = sorted(whys, key=lambda w: whys[w])
  order = sorted((k for k in counts if k != "bf16"), key=lambda k: -counts[k]) + (["bf16"] if "bf16" in counts else [])
  parts = [f"{k} {counts[k]}" + (" layers" if j == 0 else "") for j, k in enumerate(order)]
  text = ", ".join(parts)
  return text + (f" ({', '.join(whys)})" if "bf16" in counts and whys else "")
