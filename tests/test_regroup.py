"""bench/predict/regroup.py: a config's blocks reordered into few scan loops keep every block's kind, precision
and parameters, so bench/predict/gpu_aot.py's ``--regroup_blocks`` compiles the same step in fewer distinct blocks.

The default tests check the reorder and its wiring without compiling. The slow test compiles Nemotron 3 Super's step
for 64 B200 both ways (the full compile: 7-21 minutes on 2 cores) and holds the regrouped prediction to the full
one within 5% on the ruler's step and on memory per GPU (docs/PERF.md, "A Super prediction in minutes").
"""
import collections
import os

import jax
import pytest

from bench.predict import regroup, report_cache
from models import lm, policy, presets, rules
from training import config as config_lib
from test_gpu_aot import ROOT, _check, _gpu_aot, needs_plugin   # pylint: disable=import-error


def test_super_regrouped_keeps_each_block_and_compiles_12_distinct_blocks_instead_of_26():
  config = presets.get_model_config("nemotron3_super", scan_blocks=True, remat="full")
  out = regroup.regrouped(config)
  # NVFP4 blocks 0-73: the scanned ones as Mamba / MoE pairs and attention, then the five unscanned (6 M, 7 *,
  # 16 *, 72 M, 73 E); bf16 blocks 74-87 likewise (78 * and 87 E unscanned)
  assert out.pattern == "ME" * 32 + "*" * 5 + "M*E*M" + "EM" * 6 + "*E"
  # every index keeps its precision (the bf16 tail stays the last 14), every kind its count per precision and scan
  assert [policy.block_signature(out, i) for i in range(88)] == [policy.block_signature(config, i) for i in range(88)]
  assert regroup.blocks(out) == regroup.blocks(config)
  assert sum(scanned for _, _, scanned in regroup.blocks(config)) == 81
  assert [u for _, u, _ in lm.block_groups(config)] == [2, 2, 2, 1, 11, 2, 2, 1, 2, 1]
  assert lm.block_groups(out) == [(0, 2, 32), (64, 1, 5), (69, 5, 1), (74, 2, 6), (86, 2, 1)]
  assert regroup.describe(config) == dict(pattern=config.pattern, regrouped=out.pattern, groups=10,
                                          distinct_blocks=26, regrouped_groups=5, regrouped_distinct_blocks=12)


def test_units_interleave_the_kinds_of_equal_count():
  assert regroup._units("MEMEM*EMEME*") == [("ME", 5), ("*", 2)]   # pylint: disable=protected-access
  assert regroup._units("M-M-MM**") == [("M", 4), ("-*", 2)]   # pylint: disable=protected-access


def test_regrouped_keeps_the_parameters():
  """The same parameter shapes block by block of each kind, so the same state per GPU."""
  config = presets.get_model_config("moe_tiny", pattern="MEMEME*MEME-ME*E", scan_blocks=False, remat="full")
  out = regroup.regrouped(config.replace(scan_blocks=True)).replace(scan_blocks=False)
  assert out.pattern == "ME" * 5 + "*-ME*" + "E"   # the last block is the bf16 one

  def shapes(cfg):
    params = lm.abstract_variables(lm.LanguageModel(cfg), length=8)["params"]
    per_block = collections.Counter()
    for name, tree in params.items():
      if name.startswith("blocks_"):
        kind = cfg.pattern[int(name.split("_")[1])]
        per_block[kind, str(jax.tree.map(lambda x: x.shape, tree))] += 1
    rest = {k: jax.tree.map(lambda x: x.shape, v) for k, v in params.items() if not k.startswith("blocks_")}
    return per_block, rest

  assert shapes(out) == shapes(config)


def test_regrouping_is_refused_where_it_saves_nothing_and_keeps_a_block_a_rule_names():
  config = presets.get_model_config("moe_tiny", pattern="MEMEME*MEME-ME*E")
  with pytest.raises(ValueError, match="scan_blocks=True"):
    regroup.regrouped(config)
  # a rule naming one block by index: its run is that block alone, so the reorder keeps it in place
  pinned = config.replace(scan_blocks=True, precision=(rules.Rule("blocks_{4}/*", "bf16"), rules.Rule("*")))
  out = regroup.regrouped(pinned)
  assert out.pattern[4] == "M" and regroup.blocks(out) == regroup.blocks(pinned)
  # no pattern without a repeated group: nothing to regroup, the pattern stays
  assert regroup.pattern(config.replace(scan_blocks=True, pattern="ME*MEM-E*E")) == "ME*MEM-E*E"


def test_gpu_aot_regroups_the_configs_pattern():
  import configs.nemotron3_super   # pylint: disable=import-outside-toplevel
  from bench.predict import gpu_aot   # pylint: disable=import-outside-toplevel
  config = configs.nemotron3_super.get_config()
  out, described = gpu_aot._regrouped(config)   # pylint: disable=protected-access
  assert config.model.pattern is None   # the flag's config is left as it was
  model = config_lib.resolve_model_config(out.model)
  assert model.pattern == described["regrouped"] != presets.SUPER_PATTERN
  assert model.replace(pattern=presets.SUPER_PATTERN) == config_lib.resolve_model_config(config.model)


SUPER = ("--target", "b200", "--what", "step", "--config", os.path.join(ROOT, "configs", "nemotron3_super.py"),
         "--devices", "64", "--twin=false", "--config.recipe=nvfp4", "--what_if_proved=all",
         "--config.model.ssd_impl=pallas", "--config.model.gate_norm_impl=pallas",
         # one compile each: the regrouping against the full program, each scheduled by XLA's own estimate (the
         # config's second compile, with the ruler's profile, is held against the full one in docs/PERF.md,
         # "Super scheduled by a profile of itself")
         "--nopgle")


@needs_plugin
@pytest.mark.slow
def test_regrouped_super_predicts_the_full_compile_within_5_percent(tmp_path, monkeypatch):
  """The full compile of Super's proved step on 64 B200 (7-21 minutes) against the regrouped one, both in the
  report's environment (bench/predict/report_cache.py: the B200's cuBLAS GEMMs)."""
  for name, value in report_cache.TARGET_ENV["b200"].items():
    monkeypatch.setenv(name, value)
  runs = {}
  for name, extra in (("full", ()), ("regrouped", ("--regroup_blocks",))):
    (tmp_path / name).mkdir()
    proc, report = _gpu_aot(tmp_path / name, *SUPER, *extra, timeout=3600)
    runs[name] = report["results"][0]
    assert not runs[name].get("error") and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  full, fast = runs["full"], runs["regrouped"]
  _check(proc, report, 600)   # the regrouped compile within the suite's budgets (the full one's host RSS is past them)
  assert fast["cpu_s"] < 300   # under 5 minutes on 2 cores (142-167 CPU s measured; the full compile 354-488)
  assert fast["params"] == full["params"]
  assert fast["memory"]["argument_bytes"] == full["memory"]["argument_bytes"]
  memory = {name: r["memory"]["argument_bytes"] + r["memory"]["temp_bytes"] for name, r in runs.items()}
  assert memory["regrouped"] == pytest.approx(memory["full"], rel=0.05)
  assert fast["ruler"]["step_ms"] == pytest.approx(full["ruler"]["step_ms"], rel=0.05)
  assert fast["cpu_s"] < full["cpu_s"] / 1.5   # 2.2-3.2x less measured; wall times swing with the machine's load
