"""Config helpers: the model config and recipes a training config names, and the up-front checks that
run before any compute.

A training config is an ``ml_collections.ConfigDict`` (see ``configs/base.py``). Its ``model`` section names
a preset of ``models.presets`` and may override any ``ModelConfig`` field (``None``: the preset's value).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ml_collections import config_dict

import jax
import jax.numpy as jnp

import fp4jax
from fp4jax import osci_reset
from models import presets, rules
from training import optim, sharding, trackers
from training import step as step_lib
from training.errors import ConfigError


def resolve_model_config(section: config_dict.ConfigDict):
  """``models.ModelConfig``: the preset ``section.preset`` with every non-None field of the section applied."""
  try:
    base = presets.get_model_config(section.preset)
  except (KeyError, ValueError) as e:
    raise ConfigError(f"config.model.preset={section.preset!r}: {e}") from None
  names = {f.name for f in dataclasses.fields(base)}
  overrides = {}
  for key, value in section.items():
    if key == "preset" or value is None:
      continue
    if key not in names:
      raise ConfigError(f"config.model.{key} is not a ModelConfig field; fields are {sorted(names)}")
    overrides[key] = tuple(value) if isinstance(value, list) else value
  try:
    return dataclasses.replace(base, **overrides)
  except rules.PrecisionRuleError as e:
    raise ConfigError(f"config.model.precision: {e}") from None
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.model (preset {section.preset!r} with {overrides}): {e}") from None


def keep_recorded_sr_bits(config, recorded: dict | None) -> None:
  """Sets ``config.sr_bits`` where it is None (not chosen): a resumed run keeps the stochastic-rounding stream
  its record names, a record made before the field existed "jax" (the stream of those runs), and a new run
  (``recorded`` None) takes fp4jax's default (``fp4jax.random_bits.DEFAULT``). The run's record then names
  the stream, so a later default does not change a run's bits on resume."""
  if config.get("sr_bits") is not None:
    return
  if recorded is None:
    config.sr_bits = fp4jax.random_bits.DEFAULT
  else:
    config.sr_bits = recorded.get("sr_bits") or fp4jax.random_bits.JAX


# The model's vocabulary is the tokenizer's rounded up to a multiple of this: the LM head's and the embedding
# gradient's GEMMs then run whole 128-wide tensor-core tiles and whole NVFP4 (16) / MXFP4-MXFP8 (32) scale
# blocks along the vocabulary without padding, and the vocabulary splits evenly over a tensor axis of any
# power of two up to 128 (docs/TRAINING.md, "The vocabulary").
VOCAB_MULTIPLE = 128


def padded_vocab_size(tokens: int) -> int:
  """``tokens`` rounded up to a multiple of ``VOCAB_MULTIPLE``."""
  return -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def keep_recorded_vocab_size(config, recorded: dict | None, tokens: int) -> None:
  """Sets ``config.model.vocab_size`` where it is None (not chosen) and ``config.data.tokenizer`` names a
  tokenizer file of ``tokens`` tokens: a new run takes ``padded_vocab_size(tokens)``, a resumed run the number
  its record names (``training.run.vocab_record``: a new run started from another run's params, that run's
  record), and a record of None (made before this default) keeps None, the preset's value, as it was made. With the byte tokenizer (which also reads pre-tokenized files) the preset's value stays:
  the small presets' 256 is the byte vocabulary, the large ones' 131072 their pre-tokenized corpora's. The
  run's record then names the number, so the tools that read it (fp4jax-sample, fp4jax-hf) build the same model."""
  if config.model.get("vocab_size") is not None or config.data.tokenizer == "byte":
    return
  if recorded is not None:
    config.model.vocab_size = (recorded.get("model") or {}).get("vocab_size")
  else:
    config.model.vocab_size = padded_vocab_size(tokens)


def resolve_recipes(config) -> tuple[fp4jax.Recipe, fp4jax.Recipe | None, int]:
  """(main recipe, precision-switch recipe or None, first step of the switch)."""
  try:
    recipe = fp4jax.recipes.get(config.recipe)
  except ValueError as e:
    raise ConfigError(f"config.recipe: {e}") from None
  sr_bits = config.get("sr_bits") or recipe.sr_bits   # None: the recipe's own (fp4jax.random_bits.DEFAULT)
  if sr_bits != recipe.sr_bits:
    try:
      recipe = recipe.replace(sr_bits=sr_bits)
    except ValueError as e:
      raise ConfigError(f"config.sr_bits={sr_bits!r} with config.recipe={config.recipe!r}: {e}") from None
  switch = config.precision_switch
  if not 0.0 <= switch.fraction < 1.0:
    raise ConfigError(f"config.precision_switch.fraction={switch.fraction} must be in [0, 1)")
  if switch.fraction == 0.0:
    return recipe, None, config.steps
  if switch.mode == "fwd":
    late = recipe.replace(fprop="bf16", name=f"{recipe.name}_bf16_fprop")
  elif switch.mode == "fwd_bwd":
    late = fp4jax.recipes.get("bf16")
  else:
    raise ConfigError(f"config.precision_switch.mode={switch.mode!r}; use 'fwd' (forward in bf16) or "
                      "'fwd_bwd' (forward and backward in bf16)")
  start = config.steps - int(round(switch.fraction * config.steps))
  return recipe, late, start


_ON, _OFF = ("on", "true", "1"), ("off", "false", "0")


def resolve_osci_reset(config, recipe: fp4jax.Recipe) -> osci_reset.OsciResetConfig | None:
  """TetraJet-v2's OsciReset for this run (``config.osci_reset``), or None when it is off.

  ``enabled``: "auto" (on for the TetraJet-v2 recipes, ``recipe.scheme == "tetrajet2"``), "on" or "off".
  Period P = max(round(period_fraction * steps), detect_steps + 2), start S = int(start_fraction * steps).
  """
  section = config.get("osci_reset")
  if section is None:
    return None
  enabled = str(section.enabled).strip().lower()
  if enabled not in ("auto",) + _ON + _OFF:
    raise ConfigError(f"config.osci_reset.enabled={section.enabled!r}; use 'auto' (on for the tetrajet2 "
                      "recipes), 'on' or 'off'")
  if enabled in _OFF or (enabled == "auto" and recipe.scheme != "tetrajet2"):
    return None
  if enabled in _ON and not recipe.quantizes_anything:
    raise ConfigError(f"config.osci_reset.enabled={section.enabled!r} but recipe {recipe.name} quantizes no "
                      "linear layer, so there are no FP4 weights to reset; set it to 'auto' or 'off'")
  checks = [
      (isinstance(section.detect_steps, int) and section.detect_steps >= 1,
       f"config.osci_reset.detect_steps={section.detect_steps} must be an integer >= 1 (TetraJet-v2: 50)"),
      (section.threshold > 0, f"config.osci_reset.threshold={section.threshold} must be > 0 (TetraJet-v2: 8)"),
      (0.0 < section.period_fraction <= 1.0,
       f"config.osci_reset.period_fraction={section.period_fraction} must be in (0, 1] (proposed: 0.012, "
       "a period of about 1.2% of the steps)"),
      (0.0 <= section.start_fraction < 1.0,
       f"config.osci_reset.start_fraction={section.start_fraction} must be in [0, 1) (proposed: 0.65)"),
  ]
  for ok, msg in checks:
    if not ok:
      raise ConfigError(msg)
  try:
    return osci_reset.OsciResetConfig.for_run(
        config.steps, period_fraction=section.period_fraction, start_fraction=section.start_fraction,
        detect_steps=section.detect_steps, threshold=float(section.threshold), axis=-2)
  except ValueError as e:
    raise ConfigError(f"config.osci_reset: {e}") from None


def resolve_outcontrol(config, recipe: fp4jax.Recipe) -> optim.OutControl | None:
  """TetraJet-v2's OutControl for this run (``config.outcontrol``), or None when it is off (the default).

  On only with a tetrajet2 recipe; the calibration window [record_start_step, record_start_step +
  record_steps) must end before the last step (and before a precision switch), so that the split is used.
  """
  section = config.get("outcontrol")
  if section is None or section.enabled is False:
    return None
  if section.enabled is not True:
    raise ConfigError(f"config.outcontrol.enabled={section.enabled!r}; use True or False")
  if recipe.scheme != "tetrajet2":
    raise ConfigError(f"config.outcontrol.enabled=True needs a TetraJet-v2 recipe, but config.recipe="
                      f"{recipe.name!r} (scheme {recipe.scheme!r}); set --config.recipe=tetrajet2, or "
                      "--config.outcontrol.enabled=False")
  start, window = section.record_start_step, section.record_steps
  checks = [
      (0.0 < section.ratio <= 1.0,
       f"config.outcontrol.ratio={section.ratio} must be in (0, 1] (TetraJet-v2: 0.1)"),
      (isinstance(start, int) and start >= 0,
       f"config.outcontrol.record_start_step={start} must be an integer >= 0 (proposed: 500)"),
      (isinstance(window, int) and window >= 1,
       f"config.outcontrol.record_steps={window} must be an integer >= 1 (proposed: 50)"),
  ]
  for ok, msg in checks:
    if not ok:
      raise ConfigError(msg)
  if start + window >= config.steps:
    fix = (f"--config.outcontrol.record_start_step to at most {config.steps - window - 1}" if window < config.steps
           else f"--config.outcontrol.record_steps below {config.steps}")
    raise ConfigError(f"config.outcontrol: the calibration window (steps {start}..{start + window - 1}) must end "
                      f"before the last step (config.steps={config.steps}), or the MXFP8 split is never used; set "
                      f"{fix}, or raise config.steps")
  _, late, switch_step = resolve_recipes(config)
  if late is not None and start + window >= switch_step:
    raise ConfigError(
        f"config.outcontrol: the calibration window ends at step {start + window} but the precision switch "
        f"starts at step {switch_step} (its steps run without OutControl); set --config.outcontrol."
        f"record_start_step below {switch_step - window}, or lower config.precision_switch.fraction")
  return optim.OutControl(ratio=float(section.ratio), record_start=start, record_steps=window)


def xla_options(config, device_kind: str) -> dict:
  """The XLA compiler options ``config.xla_options`` gives the train step on devices of ``device_kind``
  (e.g. "NVIDIA H200"): its "all" entry, then every other entry whose name the kind contains (case-insensitive:
  "h200"), in the config's order, later entries winning. Each entry maps an XLA option (a DebugOptions field:
  ``xla_gpu_memory_limit_slop_factor``, ``xla_disable_hlo_passes``, ...) to its value; the train step's jit
  passes them as ``compiler_options``, so ``train.py`` and ``bench/predict/gpu_aot.py`` compile the same program."""
  section = config.get("xla_options", None) or {}
  kind = device_kind.lower()
  out: dict = {}
  for name in ["all"] + [n for n in section.keys() if n != "all"]:
    if name in section and (name == "all" or name.lower() in kind):
      out.update(dict(section[name]))
  return out


def check_xla_options(config) -> None:
  """A ConfigError naming the entry and the option unless every entry of ``config.xla_options`` is a table
  of options this jaxlib's XLA knows with values of their types (tried on a one-op compile)."""
  section = config.get("xla_options", None) or {}
  for name in section.keys():
    options = section[name]
    if not hasattr(options, "keys"):
      raise ConfigError(f"config.xla_options.{name}={options!r}: each entry is a table of XLA options, e.g. "
                        "{'xla_gpu_memory_limit_slop_factor': 50}, under 'all' or a device-kind name such as 'h200'")
    try:
      jax.jit(lambda: jnp.zeros(()), compiler_options=dict(options)).lower().compile()
    except Exception as e:   # pylint: disable=broad-except  (jaxlib's error type for a bad option varies)
      raise ConfigError(f"config.xla_options.{name}: {str(e).splitlines()[0]}; use an XLA DebugOptions field "
                        "(the names XLA_FLAGS takes, without the leading --) and a value of its type") from None


# config.optim's fields: (allowed range as a predicate on a real number, the range in words, the usual value).
_OPTIM_RANGES = {
    "lr": (lambda v: 0 < v < math.inf, "> 0 and finite (the peak learning rate; a negative one ascends the loss)",
           "3e-3"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1] (the final lr is lr * min_lr_ratio)", "0.01"),
    "decay_fraction": (lambda v: 0 <= v <= 1, "in [0, 1] (the share of the steps the wsd decay takes)", "0.2"),
    "b1": (lambda v: 0 <= v < 1, "in [0, 1) (Adam's first-moment decay)", "0.9"),
    "b2": (lambda v: 0 <= v < 1, "in [0, 1) (Adam's second-moment decay)", "0.95"),
    "eps": (lambda v: 0 < v < math.inf, "> 0 and finite (Adam's denominator floor)", "1e-8"),
    "weight_decay": (lambda v: 0 <= v < math.inf, ">= 0 and finite (decoupled, on matrices)", "0.1"),
    "grad_clip": (lambda v: v > 0, "> 0 (the global-norm bound; inf clips nothing)", "1.0"),
}
_OPTIM_FIELDS = ("schedule", "warmup_steps", *_OPTIM_RANGES)


def check_optim(section) -> None:
  """ConfigError naming the field and its value unless every field of ``config.optim`` is known and in range
  (optax takes any number: a negative lr would train by gradient ascent, b2 >= 1 never forgets)."""
  unknown = sorted(set(section.keys()) - set(_OPTIM_FIELDS))
  if unknown:
    raise ConfigError(f"config.optim.{unknown[0]} is not an optimizer field; the fields are {list(_OPTIM_FIELDS)}")
  if section.schedule not in ("wsd", "cosine", "constant"):
    raise ConfigError(f"config.optim.schedule={section.schedule!r}; use 'wsd', 'cosine' or 'constant'")
  steps = section.warmup_steps
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
    raise ConfigError(f"config.optim.warmup_steps={steps!r} must be an integer >= 0")
  for name, (ok, words, usual) in _OPTIM_RANGES.items():
    value = section[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
      raise ConfigError(f"config.optim.{name}={value!r} must be {words}; e.g. --config.optim.{name}={usual}")


def check_schedule(section, steps: int) -> None:
  """ConfigError naming the values and the fix unless every phase of the learning-rate schedule fits in ``steps``:
  the warmup ends before the last step, and a wsd warmup and decay (``round(decay_fraction * steps)`` steps)
  do not overlap (``optim.schedule`` would otherwise cut the warmup short or leave the decay unfinished)."""
  warmup = section.warmup_steps
  if warmup and warmup >= steps:
    raise ConfigError(f"config.optim.warmup_steps={warmup} >= config.steps={steps}: the warmup would never reach "
                      f"the peak lr {section.lr:g}; set --config.optim.warmup_steps below {steps} (e.g. "
                      f"{max(steps // 10, 0)}), or raise config.steps")
  if section.schedule == "wsd":
    decay = int(round(section.decay_fraction * steps))
    if warmup + decay > steps:
      raise ConfigError(
          f"config.optim: warmup_steps={warmup} and the wsd decay (decay_fraction={section.decay_fraction} of "
          f"config.steps={steps}: {decay} steps) need {warmup + decay} steps, more than the run has, so the decay "
          f"would not reach lr * min_lr_ratio; set --config.optim.warmup_steps to at most {steps - decay}, or "
          f"--config.optim.decay_fraction to at most {(steps - warmup) / steps:.3g}, or raise config.steps")


def validate(config) -> None:
  """Checks that need neither data nor devices; raises ConfigError naming the field and the fix."""
  def need(ok, msg):
    if not ok:
      raise ConfigError(msg)

  need(config.steps > 0, f"config.steps={config.steps} must be > 0")
  need(config.batch_size > 0, f"config.batch_size={config.batch_size} must be > 0")
  n = config.micro_batches
  need(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
       f"config.micro_batches={n!r} must be an integer >= 1 (1: no gradient accumulation)")
  need(config.batch_size % n == 0,
       f"config.batch_size={config.batch_size} is the batch of one optimizer step, split into "
       f"config.micro_batches={n}; it must be a multiple of {n}: set --config.batch_size="
       f"{-(-config.batch_size // n) * n} or a config.micro_batches that divides {config.batch_size}")
  need(config.data.seq_len > 0, f"config.data.seq_len={config.data.seq_len} must be > 0")
  need(0.0 <= config.data.validation_fraction < 1.0,
       f"config.data.validation_fraction={config.data.validation_fraction} must be in [0, 1)")
  check_optim(config.optim)
  check_schedule(config.optim, config.steps)
  need(config.health.max_nonfinite_streak > 0,
       f"config.health.max_nonfinite_streak={config.health.max_nonfinite_streak} must be > 0")
  need(config.checkpoint.keep > 0, f"config.checkpoint.keep={config.checkpoint.keep} must be > 0")
  trackers.check(config.report)
  for axis in sharding.MESH_AXES:
    size, nodes = config.mesh.get(axis, 1), config.mesh.get(f"dcn_{axis}", 1)
    need(size == -1 or size > 0, f"config.mesh.{axis}={size} must be a positive size or -1 (the rest)")
    need(isinstance(nodes, int) and nodes > 0,
         f"config.mesh.dcn_{axis}={nodes!r} must be a positive integer: the nodes the {axis} axis spans (1: within "
         "a node)")
    need(size == -1 or size % nodes == 0,
         f"config.mesh.dcn_{axis}={nodes} does not divide config.mesh.{axis}={size}: the axis's size is its "
         f"within-node x across-node factor; choose a dcn_{axis} that divides {size}")
  need([config.mesh.get(a, 1) for a in sharding.MESH_AXES].count(-1) <= 1, "config.mesh: at most one axis may be -1")
  sharding.check_fsdp_gather(config.mesh.get("fsdp_gather", "per_layer"))
  sharding.check_grad_reduce(config.mesh.get("grad_reduce", "per_micro_batch"),
                             config.mesh.get("fsdp_gather", "per_layer"))
  per_node = config.mesh.get("devices_per_node", 0)
  need(isinstance(per_node, int) and per_node >= 0,
       f"config.mesh.devices_per_node={per_node!r} must be the devices of one node, or 0 (those of one process)")
  pgle_steps = config.get("pgle_steps", 0)
  need(isinstance(pgle_steps, int) and not isinstance(pgle_steps, bool) and pgle_steps >= 0,
       f"config.pgle_steps={pgle_steps!r} must be a number of steps to profile (0: off)")
  for step in config.profile_steps:
    need(isinstance(step, int) and 0 <= step < config.steps,
         f"config.profile_steps={tuple(config.profile_steps)}: each must be a step in [0, {config.steps})")
  recipe, _, _ = resolve_recipes(config)
  resolve_osci_reset(config, recipe)
  outcontrol = resolve_outcontrol(config, recipe)
  if config.mesh.get("grad_reduce", "per_micro_batch") == "per_step":
    try:
      step_lib.check_unreduced(step_lib.build_model(resolve_model_config(config.model), recipe), outcontrol is not None)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  sharding.check_experts(config.mesh, resolve_model_config(config.model))
  check_xla_options(config)


def to_plain(value: Any) -> Any:
  """A JSON-friendly copy of a ConfigDict (for the run's config.json)."""
  if isinstance(value, (config_dict.ConfigDict, dict)):
    return {str(k): to_plain(v) for k, v in value.items()}
  if isinstance(value, rules.Rule):
    return value.to_plain()
  if isinstance(value, fp4jax.Recipe):
    return rules.Rule("*", value).to_plain()["recipe"]
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return str(value)
