"""Configs, the rules table, the optimizer, and bad input failing with a clear error before any compute."""
import glob
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import shrunken
import models
from training import config as config_lib
from training import optim
from training import sharding
from training import trainer
from training import workdir
from training.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIGS = ("tiny.py", "small.py", "nemotron_h_12b.py", "hybrid_8b.py")
CONFIGS = [os.path.join(ROOT, "configs", name) for name in TRAIN_CONFIGS]


def _load(path, *overrides):
  argv = ["train.py", f"--config={path}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", path, flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_files_validate_and_document_their_command(path):
  config = _load(path)
  config_lib.validate(config)
  name = os.path.basename(path)
  with open(path, encoding="utf-8") as f:
    source = f.read()
  assert f"python train.py --config configs/{name}" in source, f"{name}: put the run command in the docstring"
  assert config.name == name[:-3]


def test_every_config_file_loads_and_validates():
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    if os.path.basename(path) != "__init__.py":
      config_lib.validate(_load(path))


def test_command_line_overrides_the_model_preset_and_recipe():
  config = _load(os.path.join(ROOT, "configs", "tiny.py"), "--config.model.d_model=128", "--config.recipe=mxfp4",
                 "--config.model.pattern=M-")
  model_config = config_lib.resolve_model_config(config.model)
  assert (model_config.d_model, model_config.pattern) == (128, "M-")
  assert model_config.mlp_dim == models.get_model_config("tiny").mlp_dim  # untouched fields: the preset's
  assert config_lib.resolve_recipes(config)[0].name == "mxfp4"


def test_sr_bits_chooses_the_recipes_rounding_bits_and_an_old_run_resumes_without_it():
  tiny = os.path.join(ROOT, "configs", "tiny.py")
  config = _load(tiny, "--config.sr_bits=jax")
  recipe, late, _ = config_lib.resolve_recipes(_load(tiny, "--config.sr_bits=jax",
                                                     "--config.precision_switch.fraction=0.2"))
  assert (recipe.name, recipe.sr_bits, late.sr_bits) == ("nvfp4", "jax", "jax")
  assert config_lib.resolve_recipes(_load(tiny))[0].sr_bits == "philox"   # not chosen: fp4jax's default
  assert config_lib.resolve_recipes(_load(tiny, "--config.sr_bits=jax", "--config.recipe=bf16"))[0].name == "bf16"
  with pytest.raises(ConfigError, match=r"sr_bits='per_8'; use one of \('jax', 'packed', 'philox'\)"):
    config_lib.resolve_recipes(_load(tiny, "--config.sr_bits=per_8"))
  # Not chosen (None): a new run takes the default, and its record names it.
  fresh = _load(tiny)
  config_lib.keep_recorded_sr_bits(fresh, None)
  assert fresh.sr_bits == "philox" and config_lib.to_plain(fresh)["sr_bits"] == "philox"
  # A run recorded before the field existed (the stream was "jax") resumes with "jax", and sees no change.
  before = config_lib.to_plain(config)
  del before["sr_bits"]
  resumed = _load(tiny)
  config_lib.keep_recorded_sr_bits(resumed, before)
  assert resumed.sr_bits == "jax" and config_lib.resolve_recipes(resumed)[0].sr_bits == "jax"
  assert workdir.config_changes(before, resumed) == {}
  # A run recorded with "jax" or "packed" (former defaults) keeps it; a stream chosen on the command line
  # that differs from the record is a change a resume refuses.
  for recorded in ("jax", "packed"):
    again = _load(tiny)
    config_lib.keep_recorded_sr_bits(again, {**before, "sr_bits": recorded})
    assert again.sr_bits == recorded and workdir.config_changes({**before, "sr_bits": recorded}, again) == {}
  chosen = _load(tiny, "--config.sr_bits=packed")
  config_lib.keep_recorded_sr_bits(chosen, before)
  assert workdir.config_changes(before, chosen) == {"sr_bits": (None, "packed")}
  # XLA's compiler options change how the step compiles, not what it computes: a resume may change them.
  assert workdir.is_free("xla_options.h200.xla_gpu_memory_limit_slop_factor") and not workdir.is_free("sr_bits")


def test_document_masking_is_off_by_default_and_a_resume_sees_it():
  """Off by default (the paper's setup); on from the command line; a run recorded before the field existed
  resumes with it off and sees no change, and turning it on or off is a change a resume refuses."""
  tiny = os.path.join(ROOT, "configs", "tiny.py")
  assert _load(tiny).data.document_masking is False
  on = _load(tiny, "--config.data.document_masking=True")
  assert on.data.document_masking is True
  config_lib.validate(on)
  with pytest.raises(flags.IllegalFlagValueError, match="document_masking"):
    _load(tiny, "--config.data.document_masking=sometimes")
  before = config_lib.to_plain(_load(tiny))
  del before["data"]["document_masking"]
  assert workdir.config_changes(before, _load(tiny)) == {}
  assert workdir.config_changes(before, on) == {"data.document_masking": (None, True)}
  assert not workdir.is_free("data.document_masking")


def test_wrong_type_is_rejected():
  with pytest.raises(flags.IllegalFlagValueError, match="d_model"):
    _load(os.path.join(ROOT, "configs", "tiny.py"), "--config.model.d_model=wide")


def test_unknown_field_is_one_clear_line():
  result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config.model.d_modl=64"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 2
  assert "unknown config field" in result.stderr and "d_model" in result.stderr
  assert "Traceback" not in result.stderr


def test_a_config_file_field_the_config_lacks_is_refused(tmp_path):
  """A config file that sets a field fp4jax's config does not have (a misspelling, a field of another version) is
  refused before anything runs, naming each such field: before, nothing read it and the run went on without it."""
  path = tmp_path / "mine.py"
  path.write_text("from configs import tiny\n\n\ndef get_config():\n  c = tiny.get_config()\n"
                  "  c.mesh.fsdp_gathr = 'per_step'\n  c.warmup = 5\n  return c\n")
  result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--config={path}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "sets 2 field(s) that fp4jax's config does not have: config.mesh.fsdp_gathr, config.warmup" in result.stderr
  assert "Traceback" not in result.stderr


def test_the_config_files_set_only_the_base_configs_fields():
  from configs import base   # pylint: disable=import-outside-toplevel
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    name = os.path.basename(path)[:-3]
    module = __import__(f"configs.{name}", fromlist=["get_config"])
    if hasattr(module, "get_config"):
      assert base.unknown_fields(module.get_config(), ("study",)) == [], name
  c = shrunken.shrunken_config()
  c.report.nested = {"field": 1}
  c.model.anything = 1   # the model's own check refuses it (resolve_model_config)
  assert base.unknown_fields(c) == ["report.nested"]


def test_rules_table_covers_every_model_axis_name():
  rules = dict(sharding.LOGICAL_RULES)
  assert set(models.LOGICAL_AXIS_NAMES) <= set(rules), set(models.LOGICAL_AXIS_NAMES) - set(rules)
  for name, axes in rules.items():
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    assert set(names) <= set(sharding.MESH_AXES), name


def test_precision_switch_recipes():
  config = shrunken.shrunken_config(steps=100, recipe="nvfp4", **{"precision_switch.fraction": 0.2})
  recipe, late, start = config_lib.resolve_recipes(config)
  assert (recipe.name, late.fprop, late.dgrad, late.wgrad, start) == ("nvfp4", "bf16", "nvfp4", "nvfp4", 80)
  config.precision_switch.mode = "fwd_bwd"
  assert config_lib.resolve_recipes(config)[1].name == "bf16"
  config.precision_switch.mode = "sideways"
  with pytest.raises(ConfigError, match="precision_switch.mode"):
    config_lib.resolve_recipes(config)


# Optimizer -----------------------------------------------------------------------------------------------

def test_weight_decay_only_on_matrices():
  params = {"w": jnp.ones((4, 4)), "scale": jnp.ones((4,)), "conv": jnp.ones((4, 2, 3))}
  assert optim.decay_mask(params) == {"w": True, "scale": False, "conv": True}
  config = shrunken.shrunken_config().optim
  config.weight_decay, config.grad_clip = 0.25, 1.0
  tx, _ = optim.make_optimizer(config, 10)   # at learning rate 1: the step scales its updates
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)   # zero gradients: only decay moves a param
  assert float(jnp.abs(updates["scale"]).max()) == 0.0
  np.testing.assert_array_equal(updates["w"], -0.25 * params["w"])
  np.testing.assert_array_equal(updates["conv"], -0.25 * params["conv"])


def test_wsd_schedule_shape():
  config = shrunken.shrunken_config().optim
  config.lr, config.min_lr_ratio, config.warmup_steps, config.decay_fraction = 1.0, 0.01, 10, 0.2
  lr = optim.schedule(config, 100)
  values = np.asarray([lr(i) for i in range(100)])
  np.testing.assert_allclose(values[[0, 5, 10, 50, 80]], [0.0, 0.5, 1.0, 1.0, 1.0], atol=1e-6)
  assert np.all(np.diff(values[80:]) < 0) and abs(values[99] - 0.01) < 1e-6


def test_cosine_schedule_ends_at_floor():
  config = shrunken.shrunken_config().optim
  config.schedule, config.lr, config.min_lr_ratio, config.warmup_steps = "cosine", 1.0, 0.1, 5
  lr = optim.schedule(config, 50)
  assert float(lr(5)) == pytest.approx(1.0) and float(lr(50)) == pytest.approx(0.1)


def test_runs_of_any_length_and_learning_rate_share_one_compiled_step():
  """The schedule's points are an input of the train step: a longer run, another peak or another warmup lowers
  to the same program (one compile, served by the compilation cache), its points bound to the jitted step."""
  import fp4jax   # pylint: disable=import-outside-toplevel
  from training import step as step_lib   # pylint: disable=import-outside-toplevel
  config = shrunken.shrunken_config(**{"model.pattern": "-"})
  model = step_lib.build_model(config_lib.resolve_model_config(config.model), fp4jax.recipes.get("bf16"))
  mesh = sharding.make_mesh(config.mesh)
  tx, _ = optim.make_optimizer(config.optim, 10)
  with sharding.mesh_context(mesh):
    boxed = jax.eval_shape(lambda: step_lib.init_state(model, tx, 0, 8))
  abstract, state_sh = sharding.train_state_shardings(boxed, tx, mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)
  tokens = jax.ShapeDtypeStruct((4, 9), jnp.int32, sharding=sharding.batch_sharding(mesh))
  with sharding.mesh_context(mesh):
    texts, steps = set(), []
    for steps_, lr, warmup in ((10, 1e-3, 2), (40, 3e-3, 0), (7, 1e-3, 5)):
      config.optim.lr, config.optim.warmup_steps = lr, warmup
      schedule = optim.schedule(config.optim, steps_)
      step = step_lib.jit_train_step(model, tx, schedule, state_sh, mesh)
      texts.add(step.lower(abstract, tokens).as_text())
      steps.append(step)
  assert len(texts) == 1 and "module @jit_train_step" in texts.pop()   # the name profiles and dumps look for
  assert [np.asarray(s.points)[[0, 2]].tolist() for s in steps] == [[np.float32(1e-3), 2], [np.float32(3e-3), 0],
                                                                       [np.float32(1e-3), 5]]


# Bad input: a clear ConfigError before any model is built ---------------------------------------------

def _no_model(*_):
  raise AssertionError("the model was built before the bad input was caught")


def _bad_run(tmp_path, **overrides):
  config = shrunken.shrunken_config(**overrides)
  with pytest.raises(ConfigError) as info:
    trainer.train_and_evaluate(config, str(tmp_path / "run"), model_fn=_no_model)
  return str(info.value)


def test_missing_data_path(tmp_path):
  message = _bad_run(tmp_path, **{"data.sources": str(tmp_path / "no_such_file.txt")})
  assert "does not exist" in message and "no_such_file.txt" in message


def test_glob_matching_nothing(tmp_path):
  assert "matches no files" in _bad_run(tmp_path, **{"data.sources": str(tmp_path / "*.txt")})


def test_empty_corpus(tmp_path):
  (tmp_path / "a.txt").write_text("")
  (tmp_path / "b.txt").write_text("")
  message = _bad_run(tmp_path, **{"data.sources": str(tmp_path / "*.txt")})
  assert "corpus is empty" in message


def test_seq_len_larger_than_the_data(tmp_path):
  (tmp_path / "a.txt").write_text("just a few words\n" * 3)
  message = _bad_run(tmp_path, **{"data.sources": str(tmp_path / "a.txt"), "data.seq_len": 4096})
  assert "seq_len=4096 is larger than the training data" in message


def test_unknown_recipe(tmp_path):
  message = _bad_run(tmp_path, recipe="nvfp3")
  assert "config.recipe" in message and "nvfp4" in message


def test_mesh_that_does_not_divide_the_devices(tmp_path):
  message = _bad_run(tmp_path, **{"mesh.data": jax.device_count() + 1})
  assert "config.mesh" in message and "devices" in message


@pytest.mark.parametrize("mesh, devices", [((2, 2, 1), 8), ((-1, 3, 1), 4), ((-1, -1, 1), 4), ((0, 1, 1), 1)])
def test_mesh_shape_errors(mesh, devices):
  with pytest.raises(ConfigError, match="config.mesh"):
    sharding.mesh_shape(dict(zip(sharding.MESH_AXES, mesh)), devices)


def test_mesh_fills_the_minus_one_axis():
  assert sharding.mesh_shape(dict(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 1, 2)   # no expert: 1
  assert sharding.mesh_shape(dict(data=2, fsdp=1, expert=-1, tensor=1), 8) == (2, 1, 4, 1)


def test_unknown_model_preset(tmp_path):
  assert "config.model.preset" in _bad_run(tmp_path, **{"model.preset": "huge"})


def test_model_vocab_smaller_than_the_tokenizer(tmp_path):
  assert "vocab_size" in _bad_run(tmp_path, **{"model.vocab_size": 128})


def test_nemotron3_super_keeps_remat_full_and_its_receive_factor():
  """Super's config derives from the 12B's, whose remat save_linear_fp4 would keep every E block's expert
  hidden (56 GiB per GPU on 64 GPUs: docs/PERF.md, "nemotron3_super on 64 GPUs"); it names "full" and f = 1.5 itself."""
  c = _load(os.path.join(ROOT, "configs", "nemotron3_super.py"))
  assert c.model.remat == "full" and c.model.moe_receive_factor == 1.5


def test_xla_options_by_device_kind_and_a_bad_option_is_one_clear_error():
  """config.xla_options: "all", then the entries the device kind contains; Super's name its budget per GPU.
  An option XLA does not know (or a value of the wrong type) stops validate naming the entry."""
  c = _load(os.path.join(ROOT, "configs", "nemotron3_super.py"))
  config_lib.validate(c)
  h200, b200 = (config_lib.xla_options(c, f"NVIDIA {k}") for k in ("H200", "B200"))
  assert h200["xla_gpu_memory_limit_slop_factor"] != b200["xla_gpu_memory_limit_slop_factor"]
  assert config_lib.xla_options(c, "cpu") == {}
  with c.unlocked():
    c.xla_options.all = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
  assert config_lib.xla_options(c, "NVIDIA H200") == dict(h200, xla_disable_hlo_passes="while-loop-invariant-code-motion")
  assert config_lib.xla_options(_load(CONFIGS[0]), "NVIDIA H200") == {}
  with c.unlocked():
    c.xla_options.h200.xla_gpu_memory_limit_slop_factr = 40
  with pytest.raises(ConfigError, match=r"config.xla_options.h200: .*xla_gpu_memory_limit_slop_factr"):
    config_lib.validate(c)
  with c.unlocked():
    del c.xla_options.h200["xla_gpu_memory_limit_slop_factr"]
    c.xla_options.b200.xla_gpu_autotune_level = "high"
  with pytest.raises(ConfigError, match=r"config.xla_options.b200: .*not a valid int32"):
    config_lib.validate(c)


def test_xla_options_reach_the_train_steps_compile():
  """bench.scale.build_step (the step train.py and bench/predict/gpu_aot.py compile) passes the config's options to
  jit: an unknown option fails the step's own compile, a known one compiles."""
  from bench import scale   # pylint: disable=import-outside-toplevel
  c = _load(CONFIGS[0], "--config.model.pattern=-", "--config.data.seq_len=32", "--config.recipe=bf16")
  mesh = sharding.make_mesh(c.mesh)
  for options, ok in (({"xla_gpu_memory_limit_slop_factor": 50}, True), ({"xla_no_such_option": 1}, False)):
    with c.unlocked():
      c.xla_options = {"all": options}
    built = scale.build_step(c, mesh, 1)
    assert built["compiler_options"] == options
    with sharding.mesh_context(mesh):
      lowered = built["step_fn"].lower(built["state_in"], built["tokens_in"])
      if ok:
        lowered.compile()
      else:
        with pytest.raises(Exception, match="xla_no_such_option"):
          lowered.compile()
