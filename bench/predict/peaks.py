"""The GPUs' peak rates the cost models read (datasheets and the derating of the default ruler): a leaf, so
that bench/predict/gpu_aot.py and bench/predict/ruler.py both read it without importing each other."""
from __future__ import annotations

# Peak rates, per GPU. "spec": the vendor's datasheet (dense, no sparsity). "derated": what the cost
# model uses by default: an H200's measured bf16 GEMM rate (about 790 TFLOP/s of 989, 0.80) and copy
# bandwidth (about 4.3 TB/s of 4.8, 0.90), and the same two fractions applied to the other parts (an
# assumption until a device run measures them). f32 GEMMs (no tensor cores, no TF32): SMs x 128 FMA x 2
# x clock, from the target file (66.9 TFLOP/s on Hopper, which is the datasheet's FP32 figure), used
# only for dots at the highest precision; other f32 dots run as TF32 (datasheets: 494.7 TFLOP/s dense
# on H100/H200, 1.12 PFLOP/s on B200 = half the sparse figure).
# NVLink: the datasheet's bidirectional figure / 2, one direction, used only for the collectives line.
_SPEC = {
    # H100 SXM5 80 GB datasheet: BF16 989 TFLOP/s, FP8 1,979 TFLOP/s, HBM3 3.35 TB/s, NVLink 900 GB/s.
    "h100": dict(flops={"bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12, "f8e5m2": 1979e12,
                        "f32": 66.9e12, "tf32": 494.7e12}, hbm=3.35e12, link=450e9),
    # H200 SXM 141 GB datasheet: the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s.
    "h200": dict(flops={"bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12, "f8e5m2": 1979e12,
                        "f32": 66.9e12, "tf32": 494.7e12}, hbm=4.8e12, link=450e9),
    # B200 (HGX B200) datasheet, dense: BF16 2.25 PFLOP/s, FP8 4.5, FP4 9, HBM3e 8 TB/s, NVLink 5
    # 1.8 TB/s. f32: 148 SMs x 256 x 1.98 GHz = 75 TFLOP/s (the clock is the target file's, Hopper's).
    "b200": dict(flops={"bf16": 2.25e15, "f16": 2.25e15, "f8e4m3fn": 4.5e15, "f8e5m2": 4.5e15,
                        "f4e2m1fn": 9e15, "f32": 75e12, "tf32": 1.12e15}, hbm=8e12, link=900e9),
}
COMPUTE_DERATE, HBM_DERATE = 790 / 989, 4.3 / 4.8
# 32-bit integer ops (add, logic, shift, funnel shift): 64 per SM per clock on sm_90 (the CUDA guide's
# throughput table) and assumed the same on sm_100; SMs and the 1.98 GHz clock as for f32 above.
_INT_OPS = {"h100": 132 * 64 * 1.98e9, "h200": 132 * 64 * 1.98e9, "b200": 148 * 64 * 1.98e9}


INT_OPS_HELP = ("charge integer work (hlo_cost: fusions' integer elementwise ops, e.g. jax.random.bits's "
                "threefry, and the ops a kernel declares, e.g. the quantize kernels that hash their SR bits) at 64 "
                "int32 ops per SM per clock (the default); --noint_ops: bytes only, the old roofline (integer ops "
                "counted and printed, not charged).")


def peaks(target: str, which: str = "derated", int_ops: bool = False) -> dict:
  """The cost model's rates; ``int_ops``: also the integer rate ("int"), so that hlo_cost charges integer
  work (fusions' integer ops, kernels' declared ones) and not only bytes."""
  spec = _SPEC[target]
  if which == "spec":
    out = dict(spec, flops=dict(spec["flops"]))
  else:
    out = dict(flops={k: v * COMPUTE_DERATE for k, v in spec["flops"].items()},
               hbm=spec["hbm"] * HBM_DERATE, link=spec["link"])
  if int_ops:
    out["int"] = _INT_OPS[target] * (1.0 if which == "spec" else COMPUTE_DERATE)
  return out
