"""The native path compiled for sm_100 (B200) on a machine without a GPU: every GEMM of a quantized
dot is a block-scaled FP4 GEMM (``__cudnn$blockScaledDot``) and none is a bf16 GEMM of its operands.

The compile runs in a deviceless subprocess (as tests/test_gpu_aot.py's) without FP4JAX_DEFAULT_IMPL: the
native GEMM is what impl=None selects for the program's devices, the B200 topology's (fp4jax.target), as
on a GPU of compute capability 10.x, though the compiling process runs on the CPU. The optimized HLO is read per
recipe: each preset's value_and_grad(fp4jax.dot) runs inside a named scope, so its GEMMs carry the
preset's name in their op_name. Deviceless, XLA's GPU compile finishes with the cuDNN custom call in
the HLO; whether cuDNN accepts the graph (and its numbers) only a device run shows
(scripts/gpu_check.py's native rows).
"""
import json
import os
import re
import subprocess
import sys

import pytest

import fp4jax
from fp4jax import _native_compat as nc
from fp4jax import _platform, native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_plugin = pytest.mark.skipif(
    _platform.cuda_plugin() is None, reason="jax's CUDA plugin is not installed, so XLA's GPU compiler "
    "is absent (pip install -e '.[dev]' installs it)")
SHAPE = (256, 512, 256)   # M, K, N: the quantized dot's x (M, K), w (K, N)

_PROGRAM = r'''
import collections, json, re, sys
sys.path.insert(0, ROOT)
from fp4jax import _platform
_platform.enable_deviceless()
import jax
from bench.predict import deviceless, hlo_cost, peaks, programs
recipes, shape = RECIPES, SHAPE
dev = deviceless.gpu_devices("b200", 1)[0]
single = jax.sharding.SingleDeviceSharding(dev)
progs = []
for r in recipes:
  p = programs.dot_program(r, shape, single)
  def scoped(*args, _fn=p.fn, _r=r):
    with jax.named_scope(f"recipe_{_r}"):
      return _fn(*args)
  progs.append(deviceless.Program(p.name, scoped, p.args))
res = deviceless.compile_program(programs.combined("native_dots", progs))
if res.get("error"):
  print(json.dumps(dict(error=res["error"]))); sys.exit(0)
cost = hlo_cost.analyze(res["text"], peaks.peaks("b200"))
out = collections.defaultdict(lambda: collections.defaultdict(int))
for o in cost["ops"]:
  if o["kind"] == "gemm":
    m = re.search(r"recipe_(\w+?)/", o["op_name"])
    passes = re.findall(r"\b(fprop|dgrad|wgrad)\b", o["op_name"])
    out[m.group(1) if m else "?"][f"{o['dtype']} {passes[-1] if passes else '?'}"] += o["count"]
text = res["text"]
print(json.dumps(dict(gemms=out, block_scaled_calls=text.count(TARGET), seconds=res["seconds"])))
'''


def _compile(recipes, timeout=900, impl=None):
  code = (_PROGRAM.replace("ROOT", repr(ROOT)).replace("RECIPES", repr(list(recipes)))
          .replace("SHAPE", repr(SHAPE)).replace("TARGET", repr(nc.BLOCK_SCALED_TARGET)))
  return _run_report(code, timeout, impl)


def _run_report(code: str, timeout: int, impl: str | None = None) -> dict:
  """Runs a deviceless program (the target decides every impl, or FP4JAX_DEFAULT_IMPL=``impl``) and
  returns the JSON of its last line."""
  env = _platform.deviceless_env()
  env.pop("FP4JAX_DEFAULT_IMPL", None)   # the target decides
  if impl is not None:
    env["FP4JAX_DEFAULT_IMPL"] = impl
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=timeout, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert "error" not in report, report["error"][:3000]
  return report


def _quantized_gemms(recipe):
  """The GEMMs of the preset's dot that quantize, and how many block-scaled GEMMs each becomes: one,
  or one per 128-chunk of the contraction for DBQ (TetraJet-v2)."""
  m, k, n = SHAPE
  roles = fp4jax.recipes.get(recipe).roles
  contraction = {"fprop": k, "dgrad": n, "wgrad": m}
  first = {"fprop": roles.fprop_x, "dgrad": roles.dgrad_dy, "wgrad": roles.wgrad_x}
  return {p: (contraction[p] // 128 if q.fmt == "nvfp4_dbq" else 1)
          for p, q in first.items() if q is not None}


NVFP4_PRESETS = [r for r in fp4jax.recipes.NAMES
                 if _quantized_gemms(r) and all(
                     q.fmt in native.NVFP4_FORMATS for q in (fp4jax.recipes.get(r).roles.fprop_x,
                                                       fp4jax.recipes.get(r).roles.dgrad_dy) if q is not None)]


def test_presets_listed():
  assert set(NVFP4_PRESETS) == set(fp4jax.recipes.NAMES) - {"mxfp4", "mxfp8", "fp8", "bf16"}
  assert _quantized_gemms("nvfp4") == {"fprop": 1, "dgrad": 1, "wgrad": 1}
  assert _quantized_gemms("nvfp4_bf16_fprop") == {"dgrad": 1, "wgrad": 1}
  assert _quantized_gemms("tetrajet2") == {"fprop": 4, "dgrad": 2, "wgrad": 2}


@pytest.mark.slow   # covered by test_native.py::test_native_runs_the_block_scaled_op_on_cuda_only
@needs_plugin
@pytest.mark.parametrize("presets", [pytest.param(["nvfp4", "nvfp4_bf16_fprop"], id="nvfp4"),
                                     pytest.param(NVFP4_PRESETS, id="every", marks=pytest.mark.slow)])
def test_every_nvfp4_preset_dot_is_three_block_scaled_gemms(presets):
  """One module with the NVFP4 presets' value_and_grad(fp4jax.dot) (one compile; every preset: about
  three minutes on two cores, slow): per preset, each quantized GEMM (fprop, dgrad, wgrad) is block-scaled
  FP4 and no other GEMM runs, except the bf16 fprop of nvfp4_bf16_fprop."""
  report = _compile(presets)
  f4 = "f4e2m1fnxf4e2m1fn"
  total = 0
  for recipe in presets:
    gemms = report["gemms"].get(recipe, {})
    want = {f"{f4} {p}": n for p, n in _quantized_gemms(recipe).items()}
    if recipe == "nvfp4_bf16_fprop":
      want["bf16xbf16 fprop"] = 1
    assert gemms == want, (recipe, gemms)
    total += sum(n for key, n in want.items() if key.startswith(f4))
  assert report["block_scaled_calls"] == total
  assert set(report["gemms"]) == set(presets)   # no GEMM outside a preset's scope


_MXFP8 = _PROGRAM.replace("print(json.dumps(dict(gemms=out,", """swizzles = re.findall(
    r"f8e8m0fnu\\[1,(\\d+),(\\d+),32,4,4\\]\\S* transpose\\(\\S+\\), dimensions=\\{0,1,4,3,2,5\\}", text)
print(json.dumps(dict(gemms=out, swizzles=swizzles,""")


@needs_plugin
@pytest.mark.slow   # 5 s here (a subprocess: imports and a 3 s compile)
def test_mxfp8_dot_is_three_block_scaled_fp8_gemms():
  """value_and_grad(fp4jax.dot, recipe="mxfp8") for a B200 with the native GEMM on (FP4JAX_DEFAULT_IMPL=
  native: it is off until a device proves it): fprop, dgrad and wgrad are each one cuDNN block-scaled GEMM
  of float8_e4m3fn operands (E8M0 scales per 32), no other GEMM runs, and XLA swizzles each of the six
  row-major (R, K/32) scale operands into the tensor cores' 128x4 tiles: (R/128, 4, 32, K/128, 4) ->
  (R/128, K/128, 32, 4, 4), one transpose each (docs/KERNELS.md, "Native MXFP8")."""
  code = (_MXFP8.replace("ROOT", repr(ROOT)).replace("RECIPES", repr(["mxfp8"]))
          .replace("SHAPE", repr(SHAPE)).replace("TARGET", repr(nc.BLOCK_SCALED_TARGET)))
  report = _run_report(code, 900, impl="native")
  f8 = "f8e4m3fnxf8e4m3fn"
  assert report["gemms"] == {"mxfp8": {f"{f8} fprop": 1, f"{f8} dgrad": 1, f"{f8} wgrad": 1}}, report["gemms"]
  assert report["block_scaled_calls"] == 3
  m, k, n = SHAPE
  rows = {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (k, n, m)}   # (lhs R, rhs R, K) per GEMM
  want = sorted((str(-(-r // 128)), str(-(-kk // 128))) for a, b, kk in rows.values() for r in (a, b))
  assert sorted(map(tuple, report["swizzles"])) == want, report["swizzles"]


_STEP = r'''
import collections, json, re, sys
sys.path.insert(0, ROOT)
from fp4jax import _platform
_platform.enable_deviceless()
import jax, numpy as np
from bench import scale
from bench.predict import deviceless, hlo_cost, peaks
from configs import CONFIG as chosen
from training import sharding
cfg = chosen.get_config()
devices = deviceless.gpu_devices("b200", 1)
mesh = jax.sharding.Mesh(np.asarray(devices).reshape(sharding.mesh_shape(cfg.mesh, 1)), sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sharding.MESH_AXES))
built = scale.build_step(cfg, mesh, cfg.batch_size)
res = deviceless.compile_program(deviceless.Program("step", built["step_fn"], (built["state_in"], built["tokens_in"])),
                                 mesh)
if res.get("error"):
  print(json.dumps(dict(error=res["error"]))); sys.exit(0)
cost = hlo_cost.analyze(res["text"], peaks.peaks("b200"))
out = collections.defaultdict(lambda: collections.defaultdict(int))
for o in cost["ops"]:
  if o["kind"] == "gemm":
    m = re.search(LAYER, re.sub(r"/models/\w+", "", o["op_name"]))   # the parts' scopes (models.scopes) are no layer
    passes = re.findall(r"\b(fprop|dgrad|wgrad)\b", o["op_name"])
    out[m.group(1) if m else "other"][o["dtype"] + (f" {passes[-1] if passes else '?'}" if PASSES else "")] += o["count"]
print(json.dumps(dict(gemms=out, predicted_ms=cost["seconds"] * 1e3)))
'''


def _step(config: str, layer: str, passes: bool, timeout: int) -> dict:
  """The deviceless B200 train-step program of configs/<config>.py, compiled in a subprocess with the
  target deciding every impl: its GEMMs per layer (``layer``: a regex whose group names it, matched in the
  op_name without the model parts' scopes ``models/<part>``) and dtype pair, and per pass when ``passes``."""
  code = (_STEP.replace("ROOT", repr(ROOT)).replace("CONFIG", config).replace("LAYER", repr(layer))
          .replace("PASSES", repr(passes)))
  return _run_report(code, timeout)


@needs_plugin
@pytest.mark.slow   # about 2 minutes of compile on two idle cores
def test_small_train_step_quantized_layers_are_block_scaled():
  """configs/small.py's train step for one B200: each quantized linear layer (policy.layer_precision)
  is exactly three block-scaled GEMMs; the bf16 blocks and the rest of the model have none."""
  from configs import small   # pylint: disable=import-outside-toplevel
  from models import policy   # pylint: disable=import-outside-toplevel
  report = _step("small", r"/(blocks_\d+/mixer/\w+)/", False, timeout=1800)
  from training import config as config_lib   # pylint: disable=import-outside-toplevel
  cfg = small.get_config()
  model_cfg = config_lib.resolve_model_config(cfg.model)
  f4 = "f4e2m1fnxf4e2m1fn"
  quantized = {layer for layer in report["gemms"] if layer != "other"
               and policy.layer_precision(model_cfg, cfg.recipe, layer) != "bf16"}
  assert len(quantized) == 20, sorted(report["gemms"])       # 10 quantized blocks x 2 linear layers
  for layer, gemms in report["gemms"].items():
    if layer in quantized:
      assert gemms == {f4: 3}, (layer, gemms)
    else:
      assert f4 not in gemms and gemms, (layer, gemms)       # bf16 layers keep their plain GEMMs
  assert sum(g.get(f4, 0) for g in report["gemms"].values()) == 3 * len(quantized)
  assert any(re.match(r"blocks_1[01]/", layer) for layer in report["gemms"])


@needs_plugin
@pytest.mark.slow   # about 5 minutes of compile on two shared cores
def test_moe_tiny_train_step_expert_gemms_are_block_scaled():
  """configs/moe_tiny.py's train step for one B200 (impl=None, the target decides): the routed experts'
  grouped GEMMs (fp4jax.gemm.grouped_matmul, native work items) of each quantized E block are block-scaled,
  fprop, dgrad and wgrad once each for up and down; the bf16 E block's are not."""
  from configs import moe_tiny   # pylint: disable=import-outside-toplevel
  from models import policy   # pylint: disable=import-outside-toplevel
  from training import config as config_lib   # pylint: disable=import-outside-toplevel
  report = _step("moe_tiny", r"/(blocks_\d+/mixer/experts/\w+)/", True, timeout=2400)
  cfg = moe_tiny.get_config()
  model_cfg = config_lib.resolve_model_config(cfg.model)
  f4 = "f4e2m1fnxf4e2m1fn"
  experts = {layer: gemms for layer, gemms in report["gemms"].items() if layer != "other"}
  quantized = {layer for layer in experts if policy.layer_precision(model_cfg, cfg.recipe, layer) != "bf16"}
  assert {layer.split("/")[-1] for layer in quantized} == {"up", "down"} and len(quantized) >= 2, sorted(experts)
  for layer, gemms in experts.items():
    if layer in quantized:
      assert gemms == {f"{f4} fprop": 1, f"{f4} dgrad": 1, f"{f4} wgrad": 1}, (layer, gemms)
    else:
      assert not any(key.startswith(f4) for key in gemms) and gemms, (layer, gemms)
  assert len(experts) > len(quantized)   # the bf16 last E block's experts are there too


BLOCK_SCALED = """HloModule bs, entry_computation_layout={()->f32[1,512,256]}

ENTRY %main (a: f4e2m1fn[1,512,1024], b: f4e2m1fn[1,256,1024], sa: f8e4m3fn[1,512,64], sb: f8e4m3fn[1,256,64]) -> f32[1,512,256] {
  %a = f4e2m1fn[1,512,1024]{2,1,0:E(4)} parameter(0)
  %b = f4e2m1fn[1,256,1024]{2,1,0:E(4)} parameter(1)
  %sa = f8e4m3fn[1,512,64]{2,1,0} parameter(2)
  %sb = f8e4m3fn[1,256,64]{2,1,0} parameter(3)
  %c = (f32[1,512,256]{2,1,0}, u8[0]{0}) custom-call(%a, %b, %sa, %sb), custom_call_target="__cudnn$blockScaledDot", metadata={op_name="jit(f)/fprop/scaled_matmul"}
  ROOT %g = f32[1,512,256]{2,1,0} get-tuple-element(%c), index=0
}
"""


def test_cost_model_charges_block_scaled_gemms_at_the_fp4_rate():
  from bench.predict import hlo_cost, hlo_kernels, peaks   # pylint: disable=import-outside-toplevel
  rates = peaks.peaks("b200", "spec")
  (op,) = [o for o in hlo_cost.analyze(BLOCK_SCALED, rates)["ops"] if o["kind"] == "gemm"]
  flops = 2 * 512 * 256 * 1024
  assert op["mnk"] == (512, 256, 1024) and op["flops"] == flops and op["dtype"] == "f4e2m1fnxf4e2m1fn"
  assert hlo_cost.gemm_peak(rates, op["dtype"]) == 9e15                 # B200 dense FP4
  moved = (512 * 1024 + 256 * 1024) // 2 + (512 + 256) * 64 + 512 * 256 * 4
  assert op["bytes"] == moved
  assert op["seconds"] == pytest.approx(max(flops / 9e15, moved / 8e12))
  assert hlo_kernels.block_scaled_shape("f4e2m1fn[4,128,256]", "f4e2m1fn[4,64,256]") == (
      2 * 4 * 128 * 64 * 256, "f4e2m1fnxf4e2m1fn", (4, 128, 64, 256))
