"""The Pallas SSD kernels (models/ssd_pallas.py) and the gated RMSNorm's (models/gated_norm.py) compile for sm_90 (H200) and sm_100 (B200) on a machine
without a GPU, forward and backward, through XLA's Triton pipeline, LLVM and ptxas; and the cost model
charges their custom calls by the FLOPs their names declare.

The compiles run ``bench/predict/gpu_aot.py --what ssd`` in a deviceless subprocess, as tests/test_gpu_aot.py's
(whose helpers and budgets are used): a small mixer (L 512, 16 heads, P 64, 2 groups, N 128) takes
about 10 s.
"""
import pytest

from bench.predict import hlo_cost
from models import gated_norm, ssd_pallas
from test_gpu_aot import KERNEL_BUDGET_S, RSS_BUDGET_GIB, _check, _gpu_aot, needs_plugin

SHAPE = "1,512,16,64,2,128"   # B, L, H, P, G, N


@pytest.mark.slow   # covered by the kernels in interpret mode: test_models_ssd_pallas.py
@needs_plugin
@pytest.mark.parametrize("target", ["h200", pytest.param("b200", marks=pytest.mark.slow)])
def test_ssd_kernels_compile_forward_and_backward(tmp_path, target):
  proc, report = _gpu_aot(tmp_path, "--target", target, "--what", "ssd", "--impl", "pallas", "--shape",
                          SHAPE, f"--budget_s={KERNEL_BUDGET_S}", f"--budget_gib={RSS_BUDGET_GIB}")
  _check(proc, report, KERNEL_BUDGET_S)
  (r,) = report["results"]
  assert r["kernels"] == 5   # states, scan; states (recomputed), dstates, dchunk
  kernels = r["cost"]["flop_kernels"]
  assert len(kernels) == 5 and all(o["ms"] > 0 for o in kernels)
  B, L, H, P, G, N = map(int, SHAPE.split(","))
  C = ssd_pallas.DEFAULT_TILES.chunk
  want = sum(ssd_pallas.kernel_flops(k, B, L, H, P, G, N, C)
             for k in ("ssd_states", "ssd_scan", "ssd_states", "ssd_dstates", "ssd_dchunk"))
  assert sum(o["flops"] * o["count"] for o in kernels) == want



GATED_NORM_SHAPE = "1,200,2,1280"   # B, L, G, RP: the 12B's row width, a token count no tile divides


@needs_plugin
@pytest.mark.slow   # the Triton lowering of both kernels is checked by default (tests/test_models_gated_norm.py)
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_gated_norm_kernels_compile_forward_and_backward(tmp_path, target):
  proc, report = _gpu_aot(tmp_path, "--target", target, "--what", "gated_norm", "--impl", "pallas", "--shape",
                          GATED_NORM_SHAPE, f"--budget_s={KERNEL_BUDGET_S}", f"--budget_gib={RSS_BUDGET_GIB}")
  _check(proc, report, KERNEL_BUDGET_S)
  (r,) = report["results"]
  assert r["kernels"] == 2   # the forward, the backward
  kernels = r["cost"]["flop_kernels"]
  assert len(kernels) == 2 and all(o["ms"] > 0 for o in kernels)
  B, L, G, RP = map(int, GATED_NORM_SHAPE.split(","))
  # the backward runs on the tokens padded to its tiles (224 of the 200: 7 programs of 32)
  want = gated_norm.kernel_flops("gated_norm_fwd", 200, G, RP) + gated_norm.kernel_flops("gated_norm_bwd", 224, G, RP)
  assert sum(o["flops"] * o["count"] for o in kernels) == want


PALLAS_SSD = """HloModule ssd, entry_computation_layout={()->f32[1,128,64]}

ENTRY %main (x: f32[1,128,64], b: f32[1,128,32]) -> f32[1,128,64] {
  %x = f32[1,128,64]{2,1,0} parameter(0)
  %b = f32[1,128,32]{2,1,0} parameter(1)
  ROOT %k = f32[1,128,64]{2,1,0} custom-call(%x, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/models_ssd_scan_tf32_123456789flop/pallas_call"}
}
"""
PEAKS = dict(flops={"bf16": 1e15, "tf32": 5e14, "f32": 1e14}, hbm=1e12, link=1e11)


def test_the_cost_model_charges_declared_kernel_flops():
  (op,) = hlo_cost.analyze(PALLAS_SSD, PEAKS)["ops"]
  assert op["kind"] == "kernel" and op["flops"] == 123456789
  moved = (128 * 64 * 2 + 128 * 32) * 4
  assert op["bytes"] == moved
  assert op["seconds"] == pytest.approx(max(123456789 / 5e14, moved / 1e12))
  ieee = PALLAS_SSD.replace("_tf32_", "_ieee_")
  (op,) = hlo_cost.analyze(ieee, PEAKS)["ops"]
  assert op["seconds"] == pytest.approx(max(123456789 / 1e14, moved / 1e12))
  plain = PALLAS_SSD.replace("_tf32_123456789flop", "")
  (op,) = hlo_cost.analyze(plain, PEAKS)["ops"]
  assert op["flops"] == 0 and op["seconds"] == pytest.approx(moved / 1e12)
