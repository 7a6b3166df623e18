"""The GPU program compiles, for sm_90 (H200) and sm_100 (B200), on a machine without a GPU.

Each compile runs ``bench/predict/gpu_aot.py`` in a subprocess with the deviceless environment of
``fp4jax._platform`` (platforms cpu,cuda, the CUDA plugin's version check skipped), so the pytest
workers' jax stays CPU-only. A compile fails the test on an error (Triton, LLVM or ptxas included), on
a compile longer than its time budget, on host memory past its budget, or when a kernel program's HLO
lacks its Pallas kernels. The budgets sit far above a healthy compile on a loaded 2-core machine
(kernels 1-25 s and 0.8 GiB each) and far below the RHT kernel's old stall (minutes, 8.6 GiB, never
done). Skipped only where jax's CUDA plugin is not installed (the dev extra installs it).

The cost model's HLO walk (bench/predict/hlo_cost.py) is tested on a hand-written module and on a compiled
CPU scan, without the plugin.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bench.predict import hlo_cost, hlo_kernels, hlo_parts, hlo_text, hlo_walk
from fp4jax import _platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = _platform.cuda_plugin()
needs_plugin = pytest.mark.skipif(
    PLUGIN is None, reason="jax's CUDA plugin is not installed, so XLA's GPU compiler is absent "
    "(pip install -e '.[dev]' installs it: the gpu-compile extra, jax[cuda13] at jax's version)")

COMPILE_BUDGET_S = 600       # one program (the batch of 14 dots: 110-185 s on a loaded 2-core machine)
KERNEL_BUDGET_S = 180        # one Pallas kernel program (1-25 s)
RSS_BUDGET_GIB = 6.0         # the compiling process's peak RSS (healthy: 0.8-1.7 GiB)
GiB = 2 ** 30


def _gpu_aot(tmp_path, *args, timeout=900):
  """Runs bench/predict/gpu_aot.py with ``args`` in a deviceless subprocess; returns its --json report."""
  out = tmp_path / "out.json"
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, os.path.join(ROOT, "bench", "predict", "gpu_aot.py"), *args, "--json", str(out)]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{' '.join(args)}: no result within {timeout} s (a compile that never finishes)\n"
                f"{(e.stdout or b'')[-3000:]!r}")
  assert out.exists(), f"gpu_aot.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-5000:]}"
  report = json.loads(out.read_text())
  return proc, report


def _check(proc, report, time_s, rss_gib=RSS_BUDGET_GIB):
  problems = []
  for r in report["results"]:
    if r.get("error"):
      problems.append(f"{r['name']}: {r['error'][:3000]}")
      continue
    if r["lower_s"] + r["compile_s"] > time_s:
      problems.append(f"{r['name']}: {r['lower_s'] + r['compile_s']:.1f} s > budget {time_s} s")
    if r["max_rss_bytes"] > rss_gib * GiB:
      problems.append(f"{r['name']}: host RSS {r['max_rss_bytes'] / GiB:.2f} GiB > {rss_gib} GiB")
    if r["kernels"] < r["kernels_required"]:
      problems.append(f"{r['name']}: {r['kernels']} Pallas kernels in the GPU HLO, "
                      f"expected {r['kernels_required']}")
  assert not problems, "\n".join(problems) + f"\n(exit {proc.returncode})\n{proc.stdout[-2000:]}"
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_plugin
@pytest.mark.parametrize("target", ["h200", pytest.param("b200", marks=pytest.mark.slow)])
# ~80 s idle. By default: a Pallas GEMM through Triton and ptxas for sm_90 (test_mixed_gemm_compiles_for_sm90),
# the SSD kernels (tests/test_gpu_aot_ssd.py), every kernel's Triton lowering (tests/test_kernels_triton_lowering.py).
@pytest.mark.slow
def test_every_kernel_and_op_compiles(tmp_path, target):
  """Every Pallas kernel (its own compile, so a slow one is named) and the XLA composition of every
  op (one module), for the target, with predicted costs."""
  proc, report = _gpu_aot(tmp_path, "--target", target, "--what", "kernels,ops", "--combine=ops",
                          f"--budget_s={KERNEL_BUDGET_S}", f"--budget_gib={RSS_BUDGET_GIB}")
  _check(proc, report, KERNEL_BUDGET_S)
  names = [r["name"] for r in report["results"]]
  assert "quantize_rht_t_sr_nvfp4_pallas" in names and "quantize_rht_t_mxfp4_pallas" in names
  assert names[-1] == "ops"
  for r in report["results"]:
    assert r["cost"]["predicted_ms"] > 0, r["name"]
  assert report["results"][-1]["cost"]["counts"].get("gemm", 0) == 2   # the two scaled matmuls


@needs_plugin
@pytest.mark.slow   # ~2.5 min per target; the default suite compiles the nvfp4 dot natively (test_gpu_aot_native)
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_every_recipe_dot_compiles(tmp_path, target):
  """value_and_grad of fp4jax.dot for every recipe preset, one module."""
  import fp4jax   # pylint: disable=import-outside-toplevel
  proc, report = _gpu_aot(tmp_path, "--target", target, "--what", "dots", "--combine=dots",
                          f"--budget_s={COMPILE_BUDGET_S}", f"--budget_gib={RSS_BUDGET_GIB}",
                          timeout=1200)
  _check(proc, report, COMPILE_BUDGET_S)
  (r,) = report["results"]
  # three GEMMs per recipe (fprop, dgrad, wgrad), some split by the recipe's scheme
  assert r["cost"]["counts"]["gemm"] >= 3 * len(fp4jax.recipes.NAMES)


@needs_plugin
@pytest.mark.slow
def test_small_train_step_compiles_for_one_h200(tmp_path):
  proc, report = _gpu_aot(tmp_path, "--target", "h200", "--what", "step", "--config",
                          os.path.join(ROOT, "configs", "small.py"), timeout=1800)
  _check(proc, report, 1200)
  assert report["ratio_vs_bf16"] > 1.0
  assert report["results"][0]["memory"]["temp_bytes"] > 0


@pytest.mark.slow   # the attention implementations: test_models_attention.py's test_attend_agrees_across_...
@needs_plugin
def test_12b_slice_compiles_with_cudnn_attention(tmp_path):
  """The 12B as an H200 runs it, compiled without one: attention_impl="auto" is decided for the
  topology's sm_90 devices (fp4jax.target), so the step's HLO holds cuDNN's fused attention forward
  and backward, not the chunked attention that this CPU process would pick. The 12B's dimensions
  (d_model 5120, 40/8 heads of 128, 8192 tokens, vocabulary 131072) over three of its 62 blocks
  (Mamba, attention, MLP: the full depth compiles for minutes on two cores); about 30 s of compile."""
  hlo = tmp_path / "step.hlo"
  proc, report = _gpu_aot(tmp_path, "--target", "h200", "--what", "step", "--config",
                          os.path.join(ROOT, "configs", "nemotron_h_12b.py"), "--config.model.pattern=M*-",
                          "--batch_per_device=1", "--twin=false", "--hlo", str(hlo), timeout=1200)
  _check(proc, report, COMPILE_BUDGET_S)
  text = hlo.read_text()
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in text
  assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in text
  assert "chunked_attention" not in text
  B, H, L, P = 1, 40, 8192, 128
  forward = 2 * B * H * (L * (L + 1) // 2) * 2 * P   # Q·Kᵀ and P·V over the causal half
  cost = report["results"][0]["cost"]
  assert cost["counts"]["attention"] >= 2
  assert cost["attention_tflop"] * 1e12 >= 0.999 * (1 + 2.5) * forward   # forward + backward (+ remat)
  assert cost["attention_ms"] > 0


def test_cpu_user_sees_no_plugin_error():
  """``import fp4jax`` first, no JAX_PLATFORMS: jax runs on the CPU (on a machine without a GPU) and
  prints nothing about the CUDA plugin. Meaningful where the plugin is installed; passes anywhere."""
  env = {k: v for k, v in os.environ.items()
         if k not in (_platform.PLATFORMS_ENV, _platform.SKIP_CHECK_ENV)}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  code = "import fp4jax, jax; print(jax.devices()[0].platform); print(fp4jax._platform.cuda_plugin())"
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  platform = proc.stdout.split()[0]
  if not _platform.nvidia_driver_present():
    assert platform == "cpu"
  assert "Traceback" not in proc.stderr and "cuPTI" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ the HLO walk

SYNTHETIC = """HloModule synthetic, entry_computation_layout={()->f32[]}

%fused_exp (p0: f32[8,1024,1024], p1: s32[]) -> f32[1024,1024] {
  %p0 = f32[8,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  %b = f32[1024,1024]{1,0} bitcast(%ds)
  ROOT %e = f32[1024,1024]{1,0} exponential(%b)
}

%fused_dus (p0: f32[8,1024,1024], p1: f32[1024,1024], p2: s32[]) -> f32[8,1024,1024] {
  %p0 = f32[8,1024,1024]{2,1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %upd = f32[1,1024,1024]{2,1,0} bitcast(%p1)
  ROOT %d = f32[8,1024,1024]{2,1,0} dynamic-update-slice(%p0, %upd, %p2, %z, %z)
}

%fused_dot (p0: bf16[512,256], p1: bf16[256,128]) -> f32[512,128] {
  %p0 = bf16[512,256]{1,0} parameter(0)
  %p1 = bf16[256,128]{1,0} parameter(1)
  ROOT %d = f32[512,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (s: (s32[], f32[8,1024,1024], f32[1024])) -> (s32[], f32[8,1024,1024], f32[1024]) {
  %s = (s32[], f32[8,1024,1024]{2,1,0}, f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %buf = f32[8,1024,1024]{2,1,0} get-tuple-element(%s), index=1
  %v = f32[1024]{0} get-tuple-element(%s), index=2
  %f = f32[1024,1024]{1,0} fusion(%buf, %i), kind=kLoop, calls=%fused_exp
  %u = f32[8,1024,1024]{2,1,0} fusion(%buf, %f, %i), kind=kLoop, calls=%fused_dus
  %ar = bf16[1024]{0} all-reduce(%v), replica_groups={}, to_apply=%add
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,1024,1024]{2,1,0}, f32[1024]{0}) tuple(%i2, %u, %v)
}

%cond (s: (s32[], f32[8,1024,1024], f32[1024])) -> pred[] {
  %s = (s32[], f32[8,1024,1024]{2,1,0}, f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[512,256], b: bf16[256,128], buf: f32[8,1024,1024], v: f32[1024]) -> f32[512,128] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[256,128]{1,0} parameter(1)
  %buf = f32[8,1024,1024]{2,1,0} parameter(2)
  %v = f32[1024]{0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,1024,1024]{2,1,0}, f32[1024]{0}) tuple(%zero, %buf, %v)
  %w = (s32[], f32[8,1024,1024]{2,1,0}, f32[1024]{0}) while(%init), condition=%cond, body=%body
  ROOT %g = f32[512,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""

PEAKS = dict(flops={"bf16": 1e15, "f32": 1e14}, hbm=1e12, link=1e11)
MiB = 2 ** 20


def test_hlo_walk_charges_loop_slices_per_trip():
  mod = hlo_walk.Module(SYNTHETIC)
  assert mod.entry == "main"
  assert mod.multipliers()["body"] == 8                      # the condition's constant
  cost = hlo_cost.analyze(SYNTHETIC, PEAKS)
  ops = {o["name"]: o for o in cost["ops"]}
  # exp: reads one 4 MiB layer (not the 32 MiB stack) and the index, writes 4 MiB, per trip
  assert ops["f"]["bytes"] == 8 * MiB + 4 and ops["f"]["count"] == 8
  # in-place update: reads the 4 MiB update (+ the index), writes 4 MiB into the stack
  assert ops["u"]["bytes"] == 8 * MiB + 4
  gemm = ops["g"]
  assert gemm["kind"] == "gemm" and gemm["flops"] == 2 * 512 * 128 * 256
  assert gemm["mnk"] == (512, 128, 256) and gemm["dtype"] == "bf16xbf16"
  gemm_bytes = 512 * 256 * 2 + 256 * 128 * 2 + 512 * 128 * 4
  assert gemm["bytes"] == gemm_bytes
  assert gemm["seconds"] == pytest.approx(max(gemm["flops"] / 1e15, gemm_bytes / 1e12))
  (coll,) = cost["collectives"]
  assert (coll["kind"], coll["dtype"], coll["count"], coll["bytes_per_step"]) == ("all-reduce", "bf16", 8, 8 * 2048)
  # the naive walk charges the whole stack to both fusions on every trip
  assert hlo_cost.naive_bytes(SYNTHETIC) > 8 * (32 + 4 + 32 + 4 + 32) * MiB
  # + the scalar add per trip, + the condition's compare (4 + 4 + 1 bytes) on each of its 9 runs
  assert cost["other_bytes"] == 8 * (2 * (8 * MiB + 4) + 12) + 9 * 9
  assert cost["seconds"] == pytest.approx(gemm["seconds"] + cost["other_bytes"] / 1e12)


def test_hlo_walk_on_a_compiled_scan():
  """A scan over stacked weights, compiled for the CPU: the loop body runs trip-count times and its
  ops read one layer per trip."""
  layers, d = 6, 256

  def f(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

  text = jax.jit(f).lower(jax.ShapeDtypeStruct((layers, d, d), jnp.float32),
                          jax.ShapeDtypeStruct((8, d), jnp.float32)).compile().as_text()
  mod = hlo_walk.Module(text)
  mult = mod.multipliers()
  assert layers in mult.values(), mult
  cost = hlo_cost.analyze(text, PEAKS)
  stack = layers * d * d * 4
  looped = [o for o in cost["ops"] if o["count"] == layers]
  assert looped
  assert all(o["bytes"] < stack for o in looped), [(o["name"], o["bytes"]) for o in looped]
  assert cost["other_bytes"] + sum(o["bytes"] * o["count"] for o in cost["ops"] if o["kind"] == "gemm") \
      < hlo_cost.naive_bytes(text)


def test_label_reads_the_pass_and_the_primitive():
  assert hlo_parts.label("jit(f)/transpose(jvp(fp4jax/dot))/wgrad/fp4jax/quantize_rht_t/x/slice") \
      == "wgrad/quantize_rht_t"
  assert hlo_parts.label("jit(f)/jvp(fp4jax/dot)/fprop/fp4jax/quantize/nvfp4_1x16/or") == "fprop/quantize"
  assert hlo_parts.label("jit(train_step)/LanguageModel/blocks_0/mul") == "other"


# One quantize call as XLA writes it: an amax pass and a codes pass over the same bf16 input inside a
# layer loop (the input a slice of the stacked activations), then a consumer outside the call.
QUANTIZE = """HloModule quantize, entry_computation_layout={()->f32[]}

%fused_amax (p0: bf16[4,1024,1024], p1: s32[]) -> f32[] {
  %p0 = bf16[4,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  ROOT %m = f32[] convert(%ds)
}

%fused_codes (p0: bf16[4,1024,1024], p1: f32[], p2: s32[]) -> (u8[1024,512], u8[1024,64]) {
  %p0 = bf16[4,1024,1024]{2,1,0} parameter(0)
  %p1 = f32[] parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p2, %z, %z), dynamic_slice_sizes={1,1024,1024}
  %c = u8[1024,512]{1,0} convert(%ds)
  %s = u8[1024,64]{1,0} convert(%ds)
  ROOT %t = (u8[1024,512]{1,0}, u8[1024,64]{1,0}) tuple(%c, %s)
}

%fused_use (p0: u8[1024,512]) -> u8[1024,512] {
  %p0 = u8[1024,512]{1,0} parameter(0)
  ROOT %n = u8[1024,512]{1,0} negate(%p0)
}

%body (s: (s32[], bf16[4,1024,1024])) -> (s32[], bf16[4,1024,1024]) {
  %s = (s32[], bf16[4,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = bf16[4,1024,1024]{2,1,0} get-tuple-element(%s), index=1
  %amax = f32[] fusion(%x, %i), kind=kLoop, calls=%fused_amax, metadata={op_name="jit(f)/blocks/in_proj/fprop/fp4jax/quantize/reduce_max"}
  %q = (u8[1024,512]{1,0}, u8[1024,64]{1,0}) fusion(%x, %amax, %i), kind=kLoop, calls=%fused_codes, metadata={op_name="jit(f)/blocks/in_proj/fprop/fp4jax/quantize/nvfp4_1x16/fp4jax_quantize_xla/or"}
  %codes = u8[1024,512]{1,0} get-tuple-element(%q), index=0
  %use = u8[1024,512]{1,0} fusion(%codes), kind=kLoop, calls=%fused_use, metadata={op_name="jit(f)/blocks/in_proj/mul"}
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,1024,1024]{2,1,0}) tuple(%i2, %x)
}

%cond (s: (s32[], bf16[4,1024,1024])) -> pred[] {
  %s = (s32[], bf16[4,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[4,1024,1024]) -> f32[] {
  %x = bf16[4,1024,1024]{2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,1024,1024]{2,1,0}) tuple(%zero, %x)
  %w = (s32[], bf16[4,1024,1024]{2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[] constant(0)
}
"""


def test_passes_are_charged_as_multiples_of_a_copy_of_what_they_read():
  cost = hlo_cost.analyze(QUANTIZE, PEAKS)
  assert hlo_parts.scope("jit(f)/a/fprop/fp4jax/quantize/nvfp4_1x16/fp4jax_quantize_xla/or") \
      == "jit(f)/a/fprop/fp4jax/quantize"
  assert hlo_parts.scope("jit(f)/blocks/in_proj/mul") is None
  (row,) = hlo_parts.passes(cost)          # the consumer outside the call is no pass
  layer, trips = 1024 * 1024 * 2, 4
  assert row["label"] == "fprop/quantize" and row["calls"] == 1
  # what it reads from outside: one layer of x (each pass slices the same layer; counted once) and the
  # loop index; the amax it made itself is internal
  assert row["read_bytes"] == trips * (layer + 4)
  amax_bytes = layer + 4 + 4                      # the layer and the index in, the f32 amax out
  codes_bytes = layer + 4 + 1024 * 512 + 1024 * 64   # (this toy fusion never reads the amax: 0 bytes)
  assert row["bytes"] == trips * (amax_bytes + codes_bytes)
  # reading x twice and writing 4-bit codes + scales: about 1.14 copies of x
  assert row["copy_ratio"] == pytest.approx(row["bytes"] / (2 * row["read_bytes"]))
  assert 1.1 < row["copy_ratio"] < 1.2


PALLAS = """HloModule pallas, entry_computation_layout={()->bf16[1024,512]}

ENTRY %main (a: bf16[1024,256], b: bf16[512,256], f: f32[4]) -> bf16[1024,512] {
  %a = bf16[1024,256]{1,0} parameter(0)
  %b = bf16[512,256]{1,0} parameter(1)
  %f = f32[4]{0} parameter(2)
  %k = bf16[1024,256]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/fp4jax/scaled_matmul/x/fp4jax_scaled_matmul_pallas/fp4jax_dequantize_bf16_nvfp4_1x16/pallas_call"}, backend_config={grid_x = 8 : i32}
  ROOT %g = bf16[1024,512]{1,0} custom-call(%k, %b, %f), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/fp4jax/scaled_matmul/x/fp4jax_scaled_matmul_pallas/fp4jax_gemm_bf16_f32acc/pallas_call"}, backend_config={grid_x = 8 : i32}
}
"""


def test_hlo_walk_knows_pallas_gemm_kernels():
  ops = {o["name"]: o for o in hlo_cost.analyze(PALLAS, PEAKS)["ops"]}
  assert ops["k"]["kind"] == "kernel" and ops["k"]["bytes"] == 2 * 1024 * 256 * 2
  g = ops["g"]
  assert g["kind"] == "gemm" and g["flops"] == 2 * 1024 * 512 * 256 and g["mnk"] == (1024, 512, 256)
  assert g["bytes"] == (1024 * 256 + 512 * 256 + 1024 * 512) * 2 + 16


MIXED = """HloModule mixed, entry_computation_layout={()->bf16[1024,512]}

ENTRY %main (a: u8[1024,128], sa: u8[1024,16], b: u8[512,128], sb: u8[32,16], f: f32[4]) -> bf16[1024,512] {
  %a = u8[1024,128]{1,0} parameter(0)
  %sa = u8[1024,16]{1,0} parameter(1)
  %b = u8[512,128]{1,0} parameter(2)
  %sb = u8[32,16]{1,0} parameter(3)
  %f = f32[4]{0} parameter(4)
  ROOT %g = bf16[1024,512]{1,0} custom-call(%a, %sa, %b, %sb, %f), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/fprop/fp4jax/scaled_matmul/x/fp4jax_scaled_matmul_mixed/fp4jax_mixed_matmul_nvfp4_1x16_16x16_1024x512x256/pallas_call"}, backend_config={grid_x = 8 : i32}
}
"""


def test_hlo_walk_charges_the_mixed_gemm_by_its_flops_and_bytes():
  """The mixed-input GEMM (uint8 operands) is a bf16 GEMM of the M x N x K in its name; its bytes are the
  packed codes and scales it reads and the output it writes, no bf16 copy of either operand."""
  cost = hlo_cost.analyze(MIXED, PEAKS)
  (g,) = cost["ops"]
  assert g["kind"] == "gemm" and g["dtype"] == "bf16xbf16" and g["mnk"] == (1024, 512, 256)
  assert g["flops"] == 2 * 1024 * 512 * 256
  assert g["bytes"] == 1024 * 128 + 1024 * 16 + 512 * 128 + 32 * 16 + 16 + 1024 * 512 * 2
  flop_s = g["flops"] / PEAKS["flops"]["bf16"]
  assert cost["gemm_seconds"] == pytest.approx(max(flop_s, g["bytes"] / PEAKS["hbm"]))
  assert hlo_kernels.mixed_gemm_shape(hlo_text.parse_instr(PALLAS.splitlines()[-3])) is None


def test_hlo_walk_reads_the_kernel_name_of_a_partitioned_primitive():
  """Under a mesh the GEMM primitive is partitioned by ``custom_partitioning``: its Triton call's op_name
  ends there and the kernel name survives only in the backend_config. The walk still charges it as the
  mixed GEMM (the 12B's FP4 GEMMs on 8 GPUs were once charged as memory-bound kernels this way)."""
  partitioned = MIXED.replace("fp4jax_scaled_matmul_mixed/fp4jax_mixed_matmul_nvfp4_1x16_16x16_1024x512x256/"
                              "pallas_call", "custom_partitioning").replace(
      "backend_config={grid_x = 8 : i32}",
      'backend_config={debug = false, grid_x = 8 : i32, name = "fp4jax_mixed_matmul_nvfp4_1x16_16x16_1024x512x256"}')
  assert "custom_partitioning" in partitioned
  (whole,), (part,) = (hlo_cost.analyze(t, PEAKS)["ops"] for t in (MIXED, partitioned))
  assert part["kind"] == "gemm" and (part["flops"], part["mnk"]) == (whole["flops"], whole["mnk"])
  assert part["seconds"] == pytest.approx(whole["seconds"])


HASHING = """HloModule hashing, entry_computation_layout={()->u8[1024,256]}

%fused_bits (p0: u32[1024,256], p1: u32[1024,256]) -> u8[1024,256] {
  %p0 = u32[1024,256]{1,0} parameter(0)
  %p1 = u32[1024,256]{1,0} parameter(1)
  %s = u32[1024,256]{1,0} add(%p0, %p1)
  %c = u32[] constant(13)
  %cb = u32[1024,256]{1,0} broadcast(%c), dimensions={}
  %r = u32[1024,256]{1,0} shift-left(%s, %cb)
  %x = u32[1024,256]{1,0} xor(%r, %s)
  ROOT %t = u8[1024,256]{1,0} convert(%x)
}

ENTRY %main (a: u32[1024,256], b: u32[1024,256], x: bf16[1024,256], k: u32[1024,4]) -> u8[1024,256] {
  %a = u32[1024,256]{1,0} parameter(0)
  %b = u32[1024,256]{1,0} parameter(1)
  %x = bf16[1024,256]{1,0} parameter(2)
  %k = u32[1024,4]{1,0} parameter(3)
  %q = u8[1024,128]{1,0} custom-call(%x, %k), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/fp4jax/quantize/nvfp4_1x16_sr/fp4jax_quantize_pallas/fp4jax_quantize_nvfp4_1x16_33030144iop/pallas_call"}
  ROOT %f = u8[1024,256]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_bits
}
"""


def test_hlo_walk_counts_integer_work_and_charges_it_with_an_int_rate():
  """A fusion's integer elementwise ops (the threefry of jax.random.bits: add, shifts, xors on u32) and a
  kernel's declared ops (``_<n>iop``, the quantize kernels that hash their bits) are counted always and
  charged at max(ops / int rate, bytes / HBM) only when the peaks carry an "int" rate."""
  ops = {o["name"]: o for o in hlo_cost.analyze(HASHING, PEAKS)["ops"]}
  assert ops["f"]["iops"] == 3 * 1024 * 256          # add, shift-left, xor; not the convert or broadcast
  assert ops["q"]["iops"] == 33030144 and ops["q"]["kind"] == "kernel"
  assert ops["q"]["bound"] == "memory"
  slow_int = dict(PEAKS, int=1e9)
  charged = {o["name"]: o for o in hlo_cost.analyze(HASHING, slow_int)["ops"]}
  assert charged["q"]["bound"] == "integer"
  assert charged["q"]["seconds"] == pytest.approx(33030144 / 1e9)
  assert charged["f"]["seconds"] == pytest.approx(max(3 * 1024 * 256 / 1e9, ops["f"]["bytes"] / PEAKS["hbm"]))


@needs_plugin
def test_mixed_gemm_compiles_for_sm90(tmp_path):
  """kernels.mixed_matmul through Triton, LLVM and ptxas for the H200, charged by the cost model as one
  bf16 GEMM of its shape (a few seconds)."""
  proc, report = _gpu_aot(tmp_path, "--target", "h200", "--what", "mixed_matmul", "--impl", "pallas",
                          "--fmt", "nvfp4", "--shape", "256,512,1024", f"--budget_s={KERNEL_BUDGET_S}")
  _check(proc, report, KERNEL_BUDGET_S)
  (r,) = report["results"]
  assert r["kernels"] == 1
  (g,) = r["cost"]["gemms"]
  assert g["mnk"] == [256, 512, 1024] and g["dtype"] == "bf16xbf16"


# Two cuDNN fused-attention calls as XLA's GPU compile writes them (from a deviceless sm_90 compile of
# jax.nn.dot_product_attention(implementation="cudnn", is_causal=True) and its vjp; backend configs cut
# to the fields the cost model reads): GQA, B 2, L = S 512, H 8 query and K 2 KV heads of P 128.
_FMHA_CONFIG = ('backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.088, '
                '"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "8", "512", "512"]}, '
                '"is_flash_attention": true, "mask_type": "CAUSAL", "sliding_window_length": 0}}')
FMHA = f"""HloModule fmha, entry_computation_layout={{()->bf16[2,8,512,128]}}

ENTRY %main (q: bf16[2,512,8,128], k: bf16[2,512,2,128], v: bf16[2,512,2,128], do: bf16[2,512,8,128]) -> bf16[2,8,512,128] {{
  %q = bf16[2,512,8,128]{{3,2,1,0}} parameter(0)
  %k = bf16[2,512,2,128]{{3,2,1,0}} parameter(1)
  %v = bf16[2,512,2,128]{{3,2,1,0}} parameter(2)
  %do = bf16[2,512,8,128]{{3,2,1,0}} parameter(3)
  %fwd = (bf16[2,8,512,128]{{3,1,2,0}}, f32[2,8,512]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={{op_name="jit(f)/jvp()/dot_product_attention_fwd"}}, {_FMHA_CONFIG}
  %o = bf16[2,8,512,128]{{3,1,2,0}} get-tuple-element(%fwd), index=0
  %lse = f32[2,8,512]{{2,1,0}} get-tuple-element(%fwd), index=1
  %bwd = (bf16[2,8,512,128]{{3,1,2,0}}, bf16[2,2,512,128]{{3,1,2,0}}, bf16[2,2,512,128]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%q, %k, %v, %lse, %do, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={{op_name="jit(f)/transpose(jvp())/dot_product_attention_bwd"}}, {_FMHA_CONFIG}
  ROOT %dq = bf16[2,8,512,128]{{3,1,2,0}} get-tuple-element(%bwd), index=0
}}
"""


def test_visible_pairs_counts_the_mask():
  brute = lambda L, S, W: sum(1 for i in range(L) for j in range(S) if j <= i and (not W or i - j < W))
  for L, S, W in [(512, 512, 0), (7, 3, 0), (3, 7, 0), (64, 64, 16), (10, 4, 6), (10, 4, 2)]:
    assert hlo_kernels.visible_pairs(L, S, True, W) == brute(L, S, W), (L, S, W)
  assert hlo_kernels.visible_pairs(512, 384, False) == 512 * 384
  assert hlo_kernels.visible_pairs(8192, 8192, True) == 8192 * 8193 // 2   # about half of L²


def test_hlo_walk_charges_cudnn_attention_by_flops_and_bytes():
  """Forward: Q·Kᵀ and P·V over the causal half, 2·B·H·L(L+1)/2·2P; backward five products, 2.5x;
  bytes: operands and outputs (the scores stay on chip); at the bf16 peak or HBM, whichever binds."""
  cost = hlo_cost.analyze(FMHA, PEAKS)
  ops = {o["name"]: o for o in cost["ops"]}
  fwd, bwd = ops["fwd"], ops["bwd"]
  B, H, K, L, P = 2, 8, 2, 512, 128
  pairs = L * (L + 1) // 2
  assert fwd["kind"] == bwd["kind"] == "attention"
  assert fwd["flops"] == 2 * B * H * pairs * 2 * P        # half of 4·B·H·L²·P, up to the diagonal
  assert bwd["flops"] == 2 * B * H * pairs * 5 * P == 2.5 * fwd["flops"]
  assert fwd["mnk"] == (B * H, L, L, P) and fwd["dtype"] == "bf16xbf16"
  q, kv, lse = B * L * H * P * 2, B * L * K * P * 2, B * H * L * 4
  assert fwd["bytes"] == (q + 2 * kv) + (q + lse)
  assert bwd["bytes"] == (q + 2 * kv + lse + q + q) + (q + 2 * kv)
  for o in (fwd, bwd):
    assert o["seconds"] == pytest.approx(max(o["flops"] / 1e15, o["bytes"] / 1e12))
    assert o["bound"] == ("compute" if o["flops"] / 1e15 >= o["bytes"] / 1e12 else "memory")
  assert cost["attention_seconds"] == pytest.approx(fwd["seconds"] + bwd["seconds"])
  assert cost["attention_flops"] == fwd["flops"] + bwd["flops"]
  assert cost["seconds"] == pytest.approx(cost["attention_seconds"] + cost["gemm_seconds"] + cost["other_seconds"])
  assert cost["other_bytes"] == 0 and hlo_parts.by_label(cost) == []   # charged apart from "other"
  full = hlo_cost.analyze(FMHA.replace('"CAUSAL"', '"NO_MASK"'), PEAKS)
  assert full["attention_flops"] == cost["attention_flops"] * L * L // pairs   # no mask: all L² pairs


def test_what_if_proved_records_the_kernels_it_names(monkeypatch):
  from bench.predict import gpu_aot   # pylint: disable=import-outside-toplevel
  from fp4jax import dispatch   # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(dispatch, "VERIFIED_KERNELS", {})
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  with pytest.raises(ValueError, match="unknown kernel ops.*quantise"):
    gpu_aot.assume_proved(["quantise"])
  gpu_aot.assume_proved(["quantize_rht_t"])
  assert {op for op, _ in dispatch.VERIFIED_KERNELS} == {"quantize_rht_t"}
  assert dispatch.default_impl("quantize_rht_t", "nvfp4", platform="cuda") == "pallas"
  assert dispatch.default_impl("quantize_1d", "nvfp4", platform="cuda") == "xla"
  gpu_aot.assume_proved(["all"])   # fp4jax's kernels and its Mosaic GEMM (for nvfp4)
  assert {op for op, _ in dispatch.VERIFIED_KERNELS} == (set(dispatch.KERNEL_OPS)
                                                         | {dispatch.MOSAIC_GEMM, dispatch.MOSAIC_GROUPED_GEMM})
  assert [fmt for op, fmt in dispatch.VERIFIED_KERNELS if op == dispatch.MOSAIC_GEMM] == ["nvfp4"]


def test_a_kernel_that_ran_its_twin_is_recorded(monkeypatch, capsys):
  """A kernel that did not lower runs its XLA twin (fp4jax.primitives.pair warns): the compile's result lists it,
  so a prediction that prices the twin says so. The warning is pair's own (a quantize kernel made to fail)."""
  import types   # pylint: disable=import-outside-toplevel
  import warnings   # pylint: disable=import-outside-toplevel
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from bench.predict import gpu_aot   # pylint: disable=import-outside-toplevel
  from fp4jax.kernels import quantize_1d   # pylint: disable=import-outside-toplevel
  from fp4jax.primitives.quantize import quantize_last   # pylint: disable=import-outside-toplevel

  def broken(*args, **kwargs):
    raise NotImplementedError("no tiling for this shape")

  def compile_program(prog, mesh):
    x = jnp.ones((48, 80), jnp.float32)
    jax.jit(lambda x: quantize_last(x, jnp.max(jnp.abs(x)), fmt="nvfp4", impl="pallas")).lower(x).compile()
    warnings.warn("something else", UserWarning)
    return {}

  monkeypatch.setattr(quantize_1d, "quantize_1d", broken)
  monkeypatch.setattr(gpu_aot, "compile_program", compile_program)
  monkeypatch.setattr(gpu_aot, "summarize", lambda *a: {})
  flags = types.SimpleNamespace(hlo="", target="b200", peaks="derated", int_ops=True, cluster="")
  out = gpu_aot._compiled(flags, None)   # pylint: disable=protected-access
  assert len(out["kernel_fallbacks"]) == 1 and "quantize kernel (impl='pallas'" in out["kernel_fallbacks"][0]
  assert "something else" in capsys.readouterr().err
