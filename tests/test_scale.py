"""bench/scale.py: the train step compiled ahead of time on 8 simulated devices, and its HLO collective count."""
import json
import os
import subprocess
import sys

import pytest

from configs.shrunken import SHRUNKEN_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "scale.py")


def _load_scale():
  """bench/scale.py as the module ``bench.scale`` (no __main__: XLA_FLAGS untouched). Imported under that one
  name, as tests/test_train_config.py and bench/predict/gpu_aot.py import it: it defines absl flags, and a second copy
  of the module under another name would define them again (DuplicateFlagError in whichever test loads it
  second in the process)."""
  from bench import scale   # pylint: disable=import-outside-toplevel
  return scale


HLO = """\
HloModule jit_train_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ag.1 = bf16[64,32]{1,0} all-gather(bf16[8,32]{1,0} %x), channel_id=1, dimensions={0}
  %ar.1 = f32[64,32]{1,0} all-reduce(f32[64,32]{1,0} %y), channel_id=2, to_apply=%add
  %ds.1 = f32[8,32]{1,0} dynamic-slice(f32[64,32]{1,0} %ar.1, s32[] %i, s32[] %j), dynamic_slice_sizes={8,32}
}

ENTRY %main.2 (a: f32[4], /*index=1*/b: f32[4]) -> f32[4] {
  %ag.2 = f32[1024]{0} all-gather(f32[128]{0} %a), channel_id=3, dimensions={0}
  %ar.2 = (f32[], bf16[16]{0}) all-reduce(f32[] %s, bf16[16]{0} %t), channel_id=4, to_apply=%add
  %ags = (u8[16]{0}, u8[128]{0}) all-gather-start(u8[16]{0} %c), channel_id=5, dimensions={0}
  %agd = u8[128]{0} all-gather-done(%ags)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_collectives_are_counted_by_kind_dtype_and_loop():
  rows = {(r["kind"], r["dtype"], r["in_loop"]): r for r in _load_scale().collectives(HLO)}
  assert set(rows) == {("all-gather", "bf16", True), ("all-reduce+slice", "f32", True), ("all-gather", "f32", False),
                       ("all-reduce", "f32", False), ("all-reduce", "bf16", False), ("all-gather", "u8", False)}
  assert rows[("all-gather", "bf16", True)]["bytes"] == 64 * 32 * 2
  assert rows[("all-gather", "bf16", True)]["bytes_per_step"] == 5 * 64 * 32 * 2
  assert rows[("all-reduce+slice", "f32", True)]["bytes_per_step"] == 5 * 64 * 32 * 4   # a reduce-scatter on GPU
  assert rows[("all-gather", "f32", False)]["bytes"] == 1024 * 4
  assert rows[("all-reduce", "bf16", False)]["bytes"] == 32 and rows[("all-reduce", "f32", False)]["bytes"] == 4
  assert rows[("all-gather", "u8", False)] == dict(kind="all-gather", dtype="u8", in_loop=False, count=1,
                                                   bytes=128, bytes_per_step=128)


def _run(tmp_path, *flags, timeout=600):
  out = tmp_path / "scale.json"
  cmd = [sys.executable, SCRIPT, "--config", os.path.join(ROOT, "configs", "tiny.py"), "--devices", "8",
         "--mesh.data=1", "--mesh.fsdp=8", "--json", str(out), *flags]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow   # the 8-device mesh trains by default in test_train_distributed; bench/scale.py's counting is tested above and below
def test_shrunken_tiny_on_8_devices(tmp_path):
  flags = ["--config.recipe=bf16", "--config.data.seq_len=32"]
  flags += [f"--config.model.{k}={v}" for k, v in SHRUNKEN_MODEL.items()]
  result, stdout = _run(tmp_path, *flags)
  assert result["devices"] == 8 and result["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
  assert result["pattern"] == "M*-" and result["seq_len"] == 32 and result["batch_per_device"] == 1
  assert result["temp_bytes"] > 0 and result["argument_bytes"] > 0 and result["compile_s"] > 0
  assert result["alias_bytes"] > 0            # the state is donated
  kinds = {c["kind"] for c in result["collectives"]}
  assert "all-gather" in kinds                # FSDP gathers weights
  assert "all-reduce+slice" in kinds          # and reduces gradients to shards
  assert result["compiled_collectives"]
  assert "temp" in stdout and "all-gather" in stdout


@pytest.mark.slow
def test_tiny_nvfp4_on_8_devices(tmp_path):
  result, _ = _run(tmp_path)
  assert result["recipe"] == "nvfp4" and result["n_blocks"] == 6
  assert any(c["kind"] == "all-gather" and c["dtype"] == "u8" for c in result["collectives"])  # FP4 codes


LIVE_RANGE = """\
HloLiveRange (max 10):
  Stack trace breakdown for peak usage: 1000 bytes
    main.1_spmd (100.0%, total: 1000 bytes, current: 0 bytes, remaining: 1000 bytes)
      ├── jit(train_step)/transpose(jvp(LanguageModel))/while (60.0%, total: 600 bytes, current: 0 bytes, remaining: 1000 bytes)
      │   └── region_1 (60.0%, total: 600 bytes, current: 0 bytes, remaining: 1000 bytes)
      │       ├── jit(train_step)/T/while/body/checkpoint/blocks_9/mixer/in_proj/fp4jax/quantize_rht_t/while (20.0%, total: 200 bytes, current: 0 bytes, remaining: 1000 bytes)
      │       │   └── region_2 (20.0%, total: 200 bytes, current: 0 bytes, remaining: 1000 bytes)
      │       │       └── copy.7 (20.0%, total: 200 bytes, current: 200 bytes, remaining: 800 bytes)
      │       ├── jit(train_step)/T/while/body/checkpoint/rematted_computation/blocks_2/mixer/mul (10.0%, total: 100 bytes, current: 100 bytes, remaining: 700 bytes)
      │       ├── fusion.3 (20.0%, total: 200 bytes, current: 200 bytes, remaining: 500 bytes)
      │       └── jit(train_step)/T/while/body/checkpoint/blocks_9/mixer/add_any (10.0%, total: 100 bytes, current: 100 bytes, remaining: 400 bytes)
      ├── wrapped_convert.4 (30.0%, total: 300 bytes, current: 300 bytes, remaining: 100 bytes)
      └── state['params']['w'] (10.0%, total: 100 bytes, current: 100 bytes, remaining: 0 bytes)
"""

PEAK_HLO = """\
%fused_computation.1 (p: f32[4]) -> f32[4] {
  ROOT %m = f32[4]{0} multiply(f32[4]{0} %p, f32[4]{0} %p), metadata={op_name="jit(train_step)/T/while/body/checkpoint/rematted_computation/blocks_4/mixer/mul"}
}

ENTRY %main.1 (a: f32[4]) -> f32[4] {
  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop, calls=%fused_computation.1
  %wrapped_convert.4 = f32[4]{0} fusion(bf16[4]{0} %gte.5), kind=kLoop, calls=%wrapped_convert_computation.4
  %gte.5 = bf16[4]{0} get-tuple-element((bf16[4]{0}) %w), index=0, metadata={op_name="jit(train_step)/forward_backward/jvp(LanguageModel)/while"}
}
"""


def test_peak_breakdown_sums_live_buffers_by_block():
  rows = dict(_load_scale().peak_breakdown(LIVE_RANGE, PEAK_HLO))
  assert rows == {"stochastic-rounding bits": 200, "blocks_2 recomputed": 100, "blocks_4 recomputed": 200,
                  "blocks_9": 100, "saved inputs of scanned blocks": 300, "arguments": 100}
