"""Precision rules: ``ModelConfig.precision`` as plain data, parsed into ``Rule``s, and the path patterns.

``precision`` is a preset name (``PRESETS``: "nemotron_h", the default; "nemotron3_super"; "all_fp4") or an
ordered sequence of rules, first match wins. A rule, as plain data (a config file, config.json):
  {"pattern": "blocks_*/mixer/out_proj", "recipe": "mxfp8"}
  {"pattern": "*/qkv", "recipe": "recipe", "fprop": "bf16"}      # per-GEMM override: forward in bf16
  ("blocks_{-2:}/*", "bf16")                                      # (pattern, recipe[, {gemm: recipe}])
On the command line the list is a Python literal:
``--config.model.precision="[('*/mixer/out_proj', 'mxfp8'), ('*', 'recipe')]"``.
A recipe is a name of ``fp4jax.recipes`` ("nvfp4", "mxfp8", "bf16", ...), "recipe" (the model's own
recipe: ``LanguageModel(config, recipe=...)``, the training config's ``recipe``), an ``fp4jax.Recipe``, or
a dict of Recipe fields. fprop / dgrad / wgrad (optional) take that GEMM's two role quantizers from another
recipe. A linear layer no rule matches runs in bf16.

Patterns match the whole module path of a linear layer (``blocks_3/mixer/in_proj``, ``mtp_0/...``):
``*`` any characters (also ``/``), ``?`` one character other than ``/``, and after ``blocks_`` a brace
group of block indices: ``{3}``, ``{0,5}``, ``{2:6}``, ``{-14:}`` (Python slices over the model's blocks,
negative counted from the end), e.g. ``blocks_{-14:}/*`` is every layer of the last 14 blocks.

A leaf of ``models``: it imports only fp4jax's public recipes.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
from typing import Any

from fp4jax import Recipe, recipes

PRESETS = ("nemotron_h", "nemotron3_super", "all_fp4")
MODEL_RECIPE = "recipe"           # a rule's recipe "recipe": the model's own recipe
GEMMS = ("fprop", "dgrad", "wgrad")
_BRACE = re.compile(r"\{([^{}]*)\}")
_INDEX = re.compile(r"^\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?$")


class PrecisionRuleError(ValueError):
  """A precision rule that cannot be parsed, or matches no linear layer, or targets a never-quantized one."""


def _check_recipe(value: Any, where: str) -> Any:
  """A rule's recipe in canonical form: a name (validated), ``MODEL_RECIPE``, or an ``fp4jax.Recipe``."""
  if isinstance(value, Recipe) or value == MODEL_RECIPE:
    return value
  if isinstance(value, dict):
    try:
      return Recipe(**value)
    except (TypeError, ValueError) as e:
      raise PrecisionRuleError(f"{where}: {value!r} is not a Recipe's fields ({e})") from None
  if isinstance(value, str):
    try:
      recipes.get(value)
    except ValueError:
      raise PrecisionRuleError(f"{where}: unknown recipe {value!r}; use 'recipe' (the model's recipe) or one of "
                               f"{recipes.NAMES}") from None
    return value
  raise PrecisionRuleError(f"{where}: {value!r} is not a recipe; use a name such as 'nvfp4', 'mxfp8', 'bf16', "
                           "'recipe' (the model's recipe), an fp4jax.Recipe or a dict of its fields")


@dataclasses.dataclass(frozen=True)
class Rule:
  """One precision rule (module docstring). ``why``: its name in summaries ("attention", "last 14 blocks");
  ``required``: a rule that matches no linear layer is an error (a preset's rules need not match)."""

  pattern: str
  recipe: Any = MODEL_RECIPE
  fprop: Any = None
  dgrad: Any = None
  wgrad: Any = None
  why: str | None = None
  required: bool = True

  def __post_init__(self):
    if not isinstance(self.pattern, str) or not self.pattern.strip():
      raise PrecisionRuleError(f"precision rule {self.pattern!r}: the pattern must be a non-empty string such as "
                               "'blocks_*/mixer/out_proj' or '*/qkv'")
    where = f"precision rule {self.pattern!r}"
    object.__setattr__(self, "recipe", _check_recipe(self.recipe, where))
    for gemm in GEMMS:
      if getattr(self, gemm) is not None:
        object.__setattr__(self, gemm, _check_recipe(getattr(self, gemm), f"{where}, {gemm}"))
    compile_pattern(self.pattern)

  @property
  def overrides(self) -> dict[str, Any]:
    return {g: getattr(self, g) for g in GEMMS if getattr(self, g) is not None}

  @property
  def label(self) -> str:
    return self.why or self.pattern

  def to_plain(self) -> dict:
    """The rule as config-file data (``Recipe`` objects as dicts of their fields)."""
    def plain(r):
      if isinstance(r, Recipe):
        fields = dataclasses.asdict(r)
        fields["out_dtype"] = None if r.out_dtype is None else str(r.out_dtype)
        return fields
      return r
    out = {"pattern": self.pattern, "recipe": plain(self.recipe)}
    out.update({g: plain(r) for g, r in self.overrides.items()})
    return out


def parse_rule(value: Any, index: int) -> Rule:
  """A ``Rule`` from plain data: a dict, a (pattern, recipe[, {gemm: recipe}]) sequence, or a Rule."""
  if isinstance(value, Rule):
    return value
  if isinstance(value, dict) or hasattr(value, "to_dict"):
    data = dict(value.to_dict() if hasattr(value, "to_dict") else value)
    unknown = sorted(set(data) - {"pattern", "recipe", *GEMMS})
    if unknown or "pattern" not in data:
      raise PrecisionRuleError(f"precision rule {index} {data!r}: the keys are 'pattern' (required), 'recipe', "
                               f"'fprop', 'dgrad', 'wgrad'; got {sorted(data)}")
    return Rule(**data)
  if isinstance(value, (list, tuple)) and len(value) in (2, 3) and isinstance(value[0], str):
    extra = dict(value[2]) if len(value) == 3 else {}
    bad = sorted(set(extra) - set(GEMMS))
    if bad:
      raise PrecisionRuleError(f"precision rule {index} {tuple(value)!r}: the third element overrides GEMMs "
                               f"{GEMMS}; got {bad}")
    return Rule(value[0], value[1], **extra)
  raise PrecisionRuleError(f"precision rule {index} {value!r}: write a rule as {{'pattern': ..., 'recipe': ...}} "
                           "or (pattern, recipe), e.g. ('*/qkv', 'bf16')")


def parse(value: Any) -> str | tuple[Rule, ...]:
  """``ModelConfig.precision`` in canonical, hashable form: a preset name or a tuple of Rules."""
  if isinstance(value, str) and value.strip()[:1] in "[(":   # rules from the command line, as a literal
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      raise PrecisionRuleError(f"precision={value!r} is not a Python literal list of rules; write e.g. "
                               "\"[('*/qkv', 'bf16'), ('*', 'recipe')]\"") from None
    return parse(value)
  if isinstance(value, str):
    if value not in PRESETS:
      raise PrecisionRuleError(f"precision={value!r} is not a preset; use one of {PRESETS} or a list of rules "
                               "such as [('*/qkv', 'bf16'), ('*', 'recipe')]")
    return value
  if isinstance(value, (list, tuple)):
    if not value:
      raise PrecisionRuleError("precision=[] has no rules (every layer would run in bf16); use the recipe "
                               "'bf16', or a preset such as 'nemotron_h'")
    if len(value) in (2, 3) and isinstance(value[0], str) and not isinstance(value[1], (list, tuple, dict)) \
        and "/" not in str(value[1]) and _looks_like_recipe(value[1]):
      raise PrecisionRuleError(f"precision={tuple(value)!r} is one rule, not a list of rules; write "
                               f"[{tuple(value)!r}]")
    return tuple(parse_rule(v, i) for i, v in enumerate(value))
  raise PrecisionRuleError(f"precision={value!r}: use a preset name {PRESETS} or a list of rules")


def _looks_like_recipe(value) -> bool:
  return isinstance(value, Recipe) or value == MODEL_RECIPE or value in recipes.NAMES


def to_plain(value: str | tuple[Rule, ...]) -> str | list:
  """``precision`` as config-file data (round-trips through ``parse``)."""
  return value if isinstance(value, str) else [rule.to_plain() for rule in value]


# -------------------------------------------------------------------------------------------------- patterns

@functools.lru_cache(maxsize=1024)
def _index_set(spec: str, n_blocks: int, pattern: str) -> frozenset[int]:
  out = set()
  for part in spec.split(","):
    match = _INDEX.match(part)
    if not match or not part.strip():
      raise PrecisionRuleError(f"precision rule {pattern!r}: block range {{{spec}}} is not an index or a slice; "
                               "write e.g. {3}, {0,5}, {2:6} or {-14:}")
    lo, hi = match.group(1), match.group(2)
    if ":" not in part:
      i = int(lo)
      i = i + n_blocks if i < 0 else i
      if 0 <= i < n_blocks:
        out.add(i)
      continue
    out.update(range(n_blocks)[slice(None if lo is None else int(lo), None if hi is None else int(hi))])
  return frozenset(out)


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str):
  """(regex, brace specs) of a pattern: ``*`` -> any characters, ``?`` -> one character other than ``/``,
  each ``blocks_{...}`` -> a captured block index whose membership ``matches`` checks."""
  out, specs, pos = [], [], 0
  for match in _BRACE.finditer(pattern):
    literal = pattern[pos:match.start()]
    if not literal.endswith("blocks_"):
      raise PrecisionRuleError(f"precision rule {pattern!r}: a brace group {{...}} selects blocks and must follow "
                               "'blocks_', e.g. 'blocks_{-14:}/*'")
    out.append(_glob(literal))
    out.append(r"(\d+)")
    _index_set(match.group(1), 1, pattern)   # its syntax, checked now
    specs.append(match.group(1))
    pos = match.end()
  rest = pattern[pos:]
  if "{" in rest or "}" in rest:
    raise PrecisionRuleError(f"precision rule {pattern!r}: unbalanced brace; write e.g. 'blocks_{{-14:}}/*'")
  out.append(_glob(rest))
  return re.compile("".join(out)), tuple(specs)


def _glob(text: str) -> str:
  return "".join(".*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in text)


def matches(pattern: str, path: str, n_blocks: int) -> bool:
  """Whether the module path ``path`` ("blocks_3/mixer/in_proj") matches ``pattern`` in a model of
  ``n_blocks`` blocks."""
  regex, specs = compile_pattern(pattern)
  match = regex.fullmatch(path)
  if match is None:
    return False
  return all(int(match.group(k + 1)) in _index_set(spec, n_blocks, pattern) for k, spec in enumerate(specs))
