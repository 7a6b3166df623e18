"""tools.profile (``fp4jax-profile``): a captured profile's HLO op time by fp4jax's scopes, read back from a
CPU capture taken here (two named layers, forward only: it compiles in seconds) and from a capture in the
GPU's event form (stats instead of HLO protos), built from its text proto."""
import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

import fp4jax
from tools import op_names, profile, xplane


@pytest.fixture(scope="module", params=["compiled", "from the persistent cache"])
def cpu_capture(request, tmp_path_factory):
  """The capture, with the program compiled in this process or (as a resumed run's step is) loaded from
  JAX's persistent compilation cache, which keeps the program_id of the process that compiled it."""
  folder = tmp_path_factory.mktemp("profile")
  recipe = fp4jax.recipes.nvfp4()

  @jax.jit
  def two_layers(x_BxD, w_DxF, w_FxD):
    with jax.named_scope("blocks_0/up"):
      h_BxF = fp4jax.dot(x_BxD, w_DxF, recipe=recipe).astype(jnp.bfloat16)
    with jax.named_scope("blocks_0/down"):
      return fp4jax.dot(h_BxF, w_FxD, recipe=recipe)

  args = [jnp.full(shape, v, jnp.bfloat16) for shape, v in (((32, 64), 0.5), ((64, 32), 0.25), ((32, 64), 2.0))]
  jax.block_until_ready(two_layers(*args))   # compiled outside the capture, as the loop's profile steps are
  if request.param == "from the persistent cache":   # the suite's cache (tests/conftest.py) holds it now
    jax.clear_caches()
    jax.block_until_ready(two_layers(*args))
  jax.profiler.start_trace(str(folder))
  for step in range(2):
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      jax.block_until_ready(two_layers(*args))
  jax.profiler.stop_trace()
  return folder


def test_cpu_capture_by_scope(cpu_capture, capsys):
  [path] = xplane.find(str(cpu_capture))
  assert path.endswith(".xplane.pb") and "plugins/profile" in path
  s = profile.summarize(str(cpu_capture))
  assert list(s.planes) == ["/host:CPU"] and s.steps_found == 2
  assert s.fp4jax_ns > 0.5 * s.total_ns, (s.fp4jax_ns, s.total_ns)    # the HLO protos name the CPU's events
  assert s.by_label["fprop/quantize"] > 0 and s.by_label["fprop/scaled_matmul"] > 0
  assert set(s.by_layer) == {"blocks_0/up", "blocks_0/down"}
  for layer in s.by_layer.values():
    assert layer["fprop"] > 0 and layer["dgrad"] == layer["wgrad"] == 0

  assert profile.main([str(cpu_capture)]) == 0
  out = capsys.readouterr().out
  assert "2 \"train\" steps" in out and "(under blocks_0/)" in out
  assert "fprop/scaled_matmul" in out and "\n  up " in out and "\n  down " in out


_STAT_IDS = {"hlo_op": 10, "program_id": 11, "prefix": 12, "name": 13, "op_name": 14}


def _stats(**stats):
  return " ".join(f'stats {{ metadata_id: {_STAT_IDS[k]} {"int64_value" if isinstance(v, int) else "str_value"}: '
                  f'{v if isinstance(v, int) else chr(34) + v + chr(34)} }}' for k, v in stats.items())


_GPU_CAPTURE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 7 name: "Stream #7(Kernel)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 %s }
    events { metadata_id: 2 offset_ps: 5000000 duration_ps: 6000000 %s }
    events { metadata_id: 3 offset_ps: 12000000 duration_ps: 1000000 } }
  event_metadata { key: 1 value { id: 1 name: "loop_convert_fusion" } }
  event_metadata { key: 2 value { id: 2 name: "fp4jax_scaled_matmul_kernel" } }
  event_metadata { key: 3 value { id: 3 name: "MemcpyD2D" } }
  %s }
planes { id: 2 name: "/host:CPU"
  lines { id: 1 name: "launcher" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 90000000 %s } }
  event_metadata { key: 1 value { id: 1 name: "Thunk" } }
  %s }
"""


def test_gpu_event_stats(tmp_path):
  """A GPU kernel's own stats name it (XLA's launch annotation: ``prefix`` + ``name``, or ``op_name`` at the
  detailed level) when no HLO proto does; the host's launch events are not counted."""
  stat_meta = " ".join(f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in _STAT_IDS.items())
  fprop = _stats(hlo_op="fusion.1", program_id=5, prefix="jit(train_step)/jvp(LanguageModel)",
                 name="blocks_0/up/up/Fp4DotGeneral_0/jvp(fp4jax/dot)/fprop/fp4jax/quantize/x")
  wgrad = _stats(hlo_op="custom-call.2", program_id=5, op_name="jit(train_step)/transpose(jvp(LanguageModel))/"
                 "blocks_0/up/up/Fp4DotGeneral_0/transpose(jvp(fp4jax/dot))/wgrad/fp4jax/scaled_matmul/y")
  text = _GPU_CAPTURE % (fprop, wgrad, stat_meta, _stats(hlo_op="fusion.1", program_id=5), stat_meta)
  path = tmp_path / "gpu.xplane.pb"
  path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))

  s = profile.summarize(str(path))
  assert list(s.planes) == ["/device:GPU:0"] and s.executions == 2 and not s.steps_found
  assert s.total_ns == s.fp4jax_ns == 10_000
  assert dict(s.by_label) == {"fprop/quantize": 4000, "wgrad/scaled_matmul": 6000}
  assert dict(s.by_layer["LanguageModel/blocks_0/up"]) == {"fprop": 4000, "wgrad": 6000, "quantize": 4000}


def test_layer_names():
  pre = "jit(train_step)/transpose(jvp(LanguageModel))/blocks_3/mixer/models/linear/in_proj/in_proj/"
  assert op_names.layer(pre + "Fp4DotGeneral_0/transpose(jvp(fp4jax/dot))/dgrad/fp4jax/quantize/nvfp4_1x16_sr/x") \
      == "LanguageModel/blocks_3/mixer/in_proj"
  assert op_names.layer("jit(loss)/jvp(fp4jax/dot)/fprop/fp4jax/scaled_matmul/x") == ""
  assert op_names.layer("jit(train_step)/optimizer/mul") is None


def test_no_capture(tmp_path, capsys):
  assert profile.main([str(tmp_path)]) == 2
  assert "no *.xplane.pb under it" in capsys.readouterr().err
