"""fp4jax's Mosaic GPU NVFP4 GEMM (fp4jax/kernels/mosaic_gemm.py) compiled for sm_100 (B200) without a GPU,
and read back: the PTX and SASS that XLA's compile produced, and the cost model's price of the custom call.

The compile (bench/predict/mosaic_gemm_aot.py, beside cuDNN's route) runs in a deviceless subprocess, as
tests/test_gpu_aot.py's, with ``MOSAIC_GPU_DUMP_TO`` set: the Mosaic kernel's compile stage writes its PTX,
ptxas report and SASS (docs/KERNELS.md, "What a Mosaic GPU kernel shows without a GPU"). What only a device
shows (the barriers, the scale and nibble layouts, the numbers, the speed) is tools.prove's
"mosaic_gemm/nvfp4". The default run lowers the kernel in-process (tests/test_kernels_mosaic_gemm.py), prices
hand-written custom calls here and compiles the grouped kernel (9 s); the dense compiles (about 15 s, and 8 s on a
mesh of 8) are slow-marked.
"""
import json
import os
import subprocess
import sys

import pytest

from bench.predict import hlo_cost, hlo_kernels, hlo_text, peaks
from fp4jax import _platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_plugin = pytest.mark.skipif(
    _platform.cuda_plugin() is None, reason="jax's CUDA plugin is not installed, so XLA's GPU compiler "
    "is absent (pip install -e '.[dev]' installs it)")
PEAKS = peaks.peaks("b200")


@needs_plugin
@pytest.mark.slow
def test_compiles_for_sm100_to_the_block_scaled_mma(tmp_path):
  dump, out = tmp_path / "dump", tmp_path / "out.json"
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, os.path.join(ROOT, "bench", "predict", "mosaic_gemm_aot.py"), "--shape", "256,512,1024",
         "--dump", str(dump), "--json", str(out)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-5000:]
  routes = json.loads(out.read_text())["routes"]
  mosaic, cudnn = routes["mosaic"], routes["cudnn"]
  assert mosaic["custom_calls"] == ["mosaic_gpu_v2"] and mosaic["mosaic_calls"] == 1
  assert cudnn["custom_calls"] == ["__cudnn$blockScaledDot"]
  art = mosaic["artifacts"]
  assert art["sm"] == "sm_100a"
  # one block-scaled MMA per 64 elements of K of a 256-wide tile: 4 per K step, for each of the 3 slots
  assert art["ptx_block_scaled_mma"] == 4 * 3
  assert art["ptx_fma"] == 0   # the epilogue's products are never fused into the residual's add
  assert art["spill_bytes"] == 0 and art["registers"] <= 255
  if art["sass_bytes"]:   # nvdisasm present (the gpu-compile extra)
    assert art["sass_utcomma"] == art["ptx_block_scaled_mma"] and art["sass_ffma"] == 0
  # the epilogue inside: no float32 (M, N) leaves the kernel, so fewer passes than cuDNN's route
  assert mosaic["fusions"] < cudnn["fusions"] and mosaic["predicted_ms"] < cudnn["predicted_ms"]


@needs_plugin
@pytest.mark.slow
def test_on_a_mesh_each_device_runs_the_kernel_on_its_rows(tmp_path):
  """x's rows sharded over 8 B200s: the Mosaic GEMM is a partitioned op, so each device's kernel is a GEMM of
  M/8 rows (its name carries the shape), and no collective moves x or the result."""
  out = tmp_path / "out.json"
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, os.path.join(ROOT, "bench", "predict", "mosaic_gemm_aot.py"), "--shape", "2048,1024,512",
         "--devices", "8", "--json", str(out)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-5000:]
  mosaic = json.loads(out.read_text())["routes"]["mosaic"]
  assert mosaic["mosaic_gemms"] == ["256x1024x512"] and mosaic["collectives"] == 0


MOSAIC = """HloModule mosaic, entry_computation_layout={()->bf16[1024,512]}

ENTRY %main (a: f4e2m1fn[1024,256], sa: f8e4m3fn[8,4,32,16], b: f4e2m1fn[512,256], sb: f8e4m3fn[4,4,32,16], f: f32[32]) -> bf16[1024,512] {
  %a = f4e2m1fn[1024,256]{1,0} parameter(0)
  %sa = f8e4m3fn[8,4,32,16]{3,2,1,0} parameter(1)
  %b = f4e2m1fn[512,256]{1,0} parameter(2)
  %sb = f8e4m3fn[4,4,32,16]{3,2,1,0} parameter(3)
  %f = f32[32]{0} parameter(4)
  ROOT %g = bf16[1024,512]{1,0} custom-call(%a, %sa, %b, %sb, %f), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/cond/branch_0_fun/fp4jax_mosaic_gemm_nvfp4_1024x512x256/mpmd_map"}, backend_config={kernel_hash = "0", module = "ML"}
}
"""


def test_cost_model_charges_the_mosaic_gemm_as_an_fp4_gemm():
  """M x N x K from the kernel's name, the FP4 rate, the bytes it reads (codes at half a byte, scales,
  factor) and writes (bf16, the epilogue inside)."""
  cost = hlo_cost.analyze(MOSAIC, PEAKS)
  (g,) = cost["ops"]
  assert g["kind"] == "gemm" and g["dtype"] == "f4e2m1fnxf4e2m1fn" and g["mnk"] == (1024, 512, 256)
  assert g["flops"] == 2 * 1024 * 512 * 256
  assert g["bytes"] == 1024 * 128 + 8 * 4 * 32 * 16 + 512 * 128 + 4 * 4 * 32 * 16 + 32 * 4 + 1024 * 512 * 2
  other = MOSAIC.replace("fp4jax_mosaic_gemm_nvfp4", "some_kernel")
  assert hlo_kernels.mosaic_gemm_shape(hlo_text.parse_instr(other.splitlines()[-3])) is None
  # partitioned (an fp4jax op on a mesh): the op_name ends at custom_partitioning; the kernel's module holds the name
  sharded = MOSAIC.replace("fp4jax_mosaic_gemm_nvfp4_1024x512x256/mpmd_map", "fp4jax/dot/custom_partitioning").replace(
      'module = "ML"', 'module = "ML\\EFR\\01fp4jax_mosaic_gemm_nvfp4_1024x512x256_mosaic_gpu\\00"')
  assert "fp4jax_mosaic_gemm_nvfp4_1024x512x256/" not in sharded
  (g2,) = hlo_cost.analyze(sharded, PEAKS)["ops"]
  assert g2["kind"] == "gemm" and g2["mnk"] == (1024, 512, 256) and g2["flops"] == g["flops"]


@needs_plugin
def test_grouped_gemm_compiles_for_sm100_to_the_block_scaled_mma(tmp_path):
  """The experts' rows GEMM (gemm.grouped_matmul, 4 experts, S = 4096 rows in 1024-row tiles: W = 7 items) with
  the grouped Mosaic kernel forced: one mosaic_gpu_v2 call compiled to sm_100a with the block-scaled MMA, no spills;
  cuDNN's route a batched block-scaled GEMM; the Mosaic route predicted faster (no gathered operands, no float32
  (W, T, N), no epilogue pass)."""
  dump, out = tmp_path / "dump", tmp_path / "out.json"
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, os.path.join(ROOT, "bench", "predict", "mosaic_gemm_aot.py"), "--shape", "4096,512,1024",
         "--experts", "4", "--dump", str(dump), "--json", str(out)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-5000:]
  routes = json.loads(out.read_text())["routes"]
  mosaic, cudnn = routes["mosaic"], routes["cudnn"]
  assert mosaic["custom_calls"] == ["mosaic_gpu_v2"] and mosaic["mosaic_calls"] == 1
  assert mosaic["mosaic_grouped_gemms"] == ["7x1024x512x1024"]
  assert cudnn["custom_calls"] == ["__cudnn$blockScaledDot"]
  art = mosaic["artifacts"]
  assert art["sm"] == "sm_100a" and art["ptx_block_scaled_mma"] == 4 * 3 and art["ptx_fma"] == 0
  assert art["spill_bytes"] == 0 and art["registers"] <= 255
  if art["sass_bytes"]:
    assert art["sass_utcomma"] == art["ptx_block_scaled_mma"] and art["sass_ffma"] == 0
  assert mosaic["gemm_ms"] > 0 and mosaic["predicted_ms"] < cudnn["predicted_ms"]


GROUPED = """HloModule grouped, entry_computation_layout={()->bf16[7,1024,512]}

ENTRY %main (a: f4e2m1fn[4096,1024], sa: f8e4m3fn[32,16,32,16], b: f4e2m1fn[4,512,1024], sb: f8e4m3fn[4,4,16,32,16], f: f32[4,32], t: s32[7], g: s32[7]) -> bf16[7,1024,512] {
  %a = f4e2m1fn[4096,1024]{1,0} parameter(0)
  %sa = f8e4m3fn[32,16,32,16]{3,2,1,0} parameter(1)
  %b = f4e2m1fn[4,512,1024]{2,1,0} parameter(2)
  %sb = f8e4m3fn[4,4,16,32,16]{4,3,2,1,0} parameter(3)
  %f = f32[4,32]{1,0} parameter(4)
  %t = s32[7]{0} parameter(5)
  %g = s32[7]{0} parameter(6)
  ROOT %y = bf16[7,1024,512]{2,1,0} custom-call(%a, %sa, %b, %sb, %f, %t, %g), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/cond/branch_0_fun/fp4jax_mosaic_grouped_gemm_nvfp4_7x1024x512x1024/mpmd_map"}, backend_config={kernel_hash = "0", module = "ML"}
}
"""


def test_cost_model_charges_the_grouped_mosaic_gemm_as_fp4_gemms():
  """W x T x N x K from the kernel's name: W block-scaled FP4 GEMMs (2·W·T·N·K FLOPs at the FP4 rate); its bytes what
  it reads (a's codes and scales once, each expert's weight once: read in place, not gathered per item; the
  factors and the item tables) and writes (the bf16 (W, T, N), the epilogue inside)."""
  cost = hlo_cost.analyze(GROUPED, PEAKS)
  (g,) = cost["ops"]
  assert g["kind"] == "gemm" and g["dtype"] == "f4e2m1fnxf4e2m1fn" and g["mnk"] == (7, 1024, 512, 1024)
  assert g["flops"] == 2 * 7 * 1024 * 512 * 1024
  assert g["bytes"] == (4096 * 512 + 32 * 16 * 32 * 16 + 4 * 512 * 512 + 4 * 4 * 16 * 32 * 16 + 4 * 32 * 4 + 2 * 7 * 4
                        + 7 * 1024 * 512 * 2)
  assert hlo_kernels.mosaic_gemm_shape(hlo_text.parse_instr(GROUPED.splitlines()[-3])) is None   # not the dense one
  other = GROUPED.replace("fp4jax_mosaic_grouped_gemm_nvfp4", "some_kernel")
  assert hlo_kernels.mosaic_grouped_gemm_shape(hlo_text.parse_instr(other.splitlines()[-3])) is None
  # the name in the kernel's serialized module where the op_name has none (an op partitioned on a mesh)
  kernel = "fp4jax_mosaic_grouped_gemm_nvfp4_7x1024x512x1024"
  named = GROUPED.replace(f"{kernel}/mpmd_map", "fp4jax/custom_partitioning").replace(
      'module = "ML"', f'module = "ML\\EFR\\01{kernel}_mosaic_gpu\\00"')
  (g2,) = hlo_cost.analyze(named, PEAKS)["ops"]
  assert g2["mnk"] == (7, 1024, 512, 1024) and g2["flops"] == g["flops"]
