"""GEMM throughput by shape and dtype, from published measurements: what the ruler charges a GEMM.

A GEMM of (batch B, M, N, K) runs at the rate interpolated from measured rows of the same GPU architecture
and dtype class: the four nearest rows in log2 (B·M, N, K), weighted by inverse squared distance, on each
row's fraction of its datasheet peak; a shape outside the rows' range is clamped to it (a GEMM larger than
every row runs at the largest rows' rate). The rate is that fraction times the target's datasheet peak
(bench/predict/peaks.py ``_SPEC``), so an H200 uses the H100 rows (the same SMs, clock and tensor cores).

Sources (each row names one):
- ``xla_tf``: XLA's default matmul performance table, the measured rates its GPU cost model
  interpolates (tensorflow/tensorflow, third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h
  at 372d578b, ``kDefaultMatmulPTable``, key "sm_90", "bf16xbf16->bf16"; an H100 SXM).
- ``xla_openxla``: the same table, newer (openxla/xla, xla/backends/gpu/cost_model/matmul_interpolator_data.h,
  keys "sm_100" (a B200: "bf16xbf16->bf16", "f8e4m3fnxf8e4m3fn->bf16") and "sm_90" ("bf16xbf16->bf16"); its
  "sm_90" f8 rows (up to 2.62 PFLOP/s, above the H100's 1.98 PFLOP/s dense FP8 datasheet peak) are not used.
- ``tilelang_h800``: TileLang's FP8 GEMM benchmark, M = N = 8192 over K, on an H800 SXM (the H100's compute)
  (tile-ai/tilelang, benchmark/matmul_fp8/README.md, "Results").
Block-scaled MXFP8 and NVFP4 GEMMs (cuBLASLt / cuDNN on a B200) have no measured rows here: they take the
FP8 rows' fraction of peak at the same shape, times their own datasheet peak (MXFP8 4.5, NVFP4 9 PFLOP/s):
an assumption, named in every report (``ASSUMED``).
"""
from __future__ import annotations

import math

SOURCES = {
    "xla_tf": "XLA default matmul perf table, sm_90 (H100): tensorflow/tensorflow "
              "third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h @372d578b",
    "xla_openxla": "XLA default matmul perf table, sm_100 (B200) and sm_90: openxla/xla "
                   "xla/backends/gpu/cost_model/matmul_interpolator_data.h",
    "tilelang_h800": "TileLang FP8 GEMM benchmark, H800 SXM, M=N=8192: tile-ai/tilelang "
                     "benchmark/matmul_fp8/README.md",
}
ASSUMED = {"mxfp8": "f8", "nvfp4": "f8"}   # dtype class -> the measured class whose fraction of peak it takes

# (arch, dtype class, B, M, N, K, measured TFLOP/s, source)
ROWS = (
    # H100 (sm_90), bf16
    ("sm_90", "bf16", 1, 4096, 4096, 4096, 783.3, "xla_tf"),
    ("sm_90", "bf16", 2, 4096, 2048, 4096, 783.2, "xla_tf"),
    ("sm_90", "bf16", 2, 2048, 4096, 4096, 779.3, "xla_tf"),
    ("sm_90", "bf16", 4, 2048, 2048, 4096, 779.1, "xla_tf"),
    ("sm_90", "bf16", 4, 1024, 4096, 4096, 773.5, "xla_tf"),
    ("sm_90", "bf16", 1, 1024, 4096, 4096, 738.5, "xla_tf"),
    ("sm_90", "bf16", 1, 512, 4096, 4096, 644.1, "xla_tf"),
    ("sm_90", "bf16", 1, 4096, 4096, 1024, 677.4, "xla_tf"),
    ("sm_90", "bf16", 4, 4096, 4096, 512, 619.9, "xla_tf"),
    ("sm_90", "bf16", 1, 4096, 4096, 256, 392.2, "xla_tf"),
    ("sm_90", "bf16", 1, 4096, 256, 4096, 376.2, "xla_tf"),
    ("sm_90", "bf16", 1, 4096, 512, 2048, 521.7, "xla_tf"),
    ("sm_90", "bf16", 1, 4096, 1024, 2048, 632.0, "xla_tf"),
    ("sm_90", "bf16", 1, 2048, 2048, 2048, 632.0, "xla_tf"),
    ("sm_90", "bf16", 1, 2048, 2048, 512, 345.5, "xla_tf"),
    ("sm_90", "bf16", 1, 1024, 1024, 1024, 236.3, "xla_tf"),
    ("sm_90", "bf16", 1, 512, 512, 512, 40.7, "xla_tf"),
    ("sm_90", "bf16", 1, 256, 256, 256, 6.45, "xla_tf"),
    ("sm_90", "bf16", 4, 4096, 4096, 4096, 788.7, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 2048, 4096, 804.7, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 1024, 4096, 773.5, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 512, 4096, 720.6, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 256, 4096, 611.3, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 4096, 1024, 722.3, "xla_openxla"),
    ("sm_90", "bf16", 4, 4096, 4096, 256, 505.2, "xla_openxla"),
    # H100-class (H800 SXM), FP8 e4m3, M = N = 8192
    ("sm_90", "f8", 1, 8192, 8192, 256, 569.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 512, 858.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 1024, 1129.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 2048, 1343.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 4096, 1467.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 8192, 1507.0, "tilelang_h800"),
    ("sm_90", "f8", 1, 8192, 8192, 16384, 1541.0, "tilelang_h800"),
    # B200 (sm_100), bf16 and FP8 e4m3 (bf16 output)
    ("sm_100", "bf16", 1, 4096, 4096, 4096, 1416.9, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 2048, 4096, 1343.5, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 1024, 4096, 1204.9, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 512, 4096, 991.5, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 256, 4096, 645.1, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 4096, 2048, 1277.8, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 2048, 2048, 1170.0, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 1024, 2048, 990.3, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 4096, 1024, 1075.6, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 2048, 1024, 913.8, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 1024, 1024, 715.6, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 4096, 512, 805.3, "xla_openxla"),
    ("sm_100", "bf16", 1, 4096, 4096, 256, 514.7, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 4096, 4096, 1670.5, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 4096, 2048, 1539.9, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 2048, 4096, 1465.7, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 1024, 4096, 1411.9, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 512, 4096, 1322.7, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 256, 4096, 1152.4, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 4096, 1024, 1350.5, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 4096, 512, 1090.6, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 2048, 2048, 1345.8, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 1024, 1024, 1060.5, "xla_openxla"),
    ("sm_100", "bf16", 4, 4096, 256, 512, 455.6, "xla_openxla"),
    ("sm_100", "bf16", 2, 512, 4096, 4096, 1209.2, "xla_openxla"),
    ("sm_100", "bf16", 2, 512, 2048, 4096, 989.6, "xla_openxla"),
    ("sm_100", "bf16", 2, 256, 4096, 4096, 993.1, "xla_openxla"),
    ("sm_100", "bf16", 1, 256, 4096, 4096, 651.4, "xla_openxla"),
    ("sm_100", "bf16", 1, 256, 1024, 1024, 81.2, "xla_openxla"),
    ("sm_100", "bf16", 1, 512, 512, 512, 48.5, "xla_openxla"),
    ("sm_100", "bf16", 1, 256, 256, 256, 6.77, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 4096, 4096, 2765.0, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 2048, 4096, 2499.4, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 1024, 4096, 1951.8, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 512, 4096, 1485.0, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 256, 4096, 861.8, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 4096, 2048, 2485.0, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 2048, 2048, 1833.5, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 1024, 2048, 1462.6, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 4096, 1024, 1895.4, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 2048, 1024, 1332.2, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 1024, 1024, 850.8, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 4096, 512, 1172.1, "xla_openxla"),
    ("sm_100", "f8", 1, 4096, 4096, 256, 666.9, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 4096, 4096, 3279.7, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 4096, 2048, 3122.5, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 2048, 4096, 3133.3, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 1024, 4096, 2662.0, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 512, 4096, 2274.4, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 256, 4096, 1804.6, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 4096, 1024, 2651.2, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 4096, 512, 1712.2, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 2048, 2048, 2884.9, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 1024, 1024, 1868.7, "xla_openxla"),
    ("sm_100", "f8", 4, 4096, 256, 512, 504.5, "xla_openxla"),
    ("sm_100", "f8", 2, 512, 4096, 4096, 1908.9, "xla_openxla"),
    ("sm_100", "f8", 2, 512, 2048, 4096, 1490.9, "xla_openxla"),
    ("sm_100", "f8", 2, 256, 4096, 4096, 1431.7, "xla_openxla"),
    ("sm_100", "f8", 1, 256, 4096, 4096, 930.5, "xla_openxla"),
    ("sm_100", "f8", 1, 256, 1024, 1024, 81.2, "xla_openxla"),
    ("sm_100", "f8", 1, 512, 512, 512, 39.3, "xla_openxla"),
    ("sm_100", "f8", 1, 256, 256, 256, 6.92, "xla_openxla"),
)
# Datasheet dense peaks (TFLOP/s) of the GPU each row was measured on: fractions of peak are taken against these.
ROW_PEAKS = {("sm_90", "bf16"): 989.0, ("sm_90", "f8"): 1979.0, ("sm_100", "bf16"): 2250.0,
             ("sm_100", "f8"): 4500.0}
ARCH = {"h100": "sm_90", "h200": "sm_90", "b200": "sm_100"}


def dtype_class(dtype_pair: str) -> str | None:
  """The measured class of a GEMM's operand dtypes (``"bf16xbf16"``): "bf16" (bf16/f16, or any pair with
  a 16-bit operand: it runs at the wider operand's rate), "f8" (two FP8 operands), "nvfp4" (two E2M1
  operands), None for anything else (f32/tf32 and integer GEMMs keep the derated peak)."""
  parts = dtype_pair.split("x")
  if any(p in ("bf16", "f16") for p in parts):
    return "bf16"
  if all(p.startswith("f8") for p in parts):
    return "f8"
  if all(p.startswith("f4") for p in parts):
    return "nvfp4"
  return None


def fraction_of_peak(arch: str, cls: str, b: int, m: int, n: int, k: int) -> tuple[float, list]:
  """(fraction of the datasheet peak, the rows used) for a GEMM of this shape; ``cls`` in "bf16", "f8",
  or an ``ASSUMED`` class (which takes its measured class's fraction)."""
  measured = ASSUMED.get(cls, cls)
  rows = [r for r in ROWS if r[0] == arch and r[1] == measured]
  if not rows:
    raise ValueError(f"no measured GEMM rows for {arch} {measured}; known: "
                     f"{sorted({(r[0], r[1]) for r in ROWS})}")
  peak = ROW_PEAKS[(arch, measured)]
  pts = [(math.log2(r[2] * r[3]), math.log2(r[4]), math.log2(r[5])) for r in rows]
  lo = [min(p[i] for p in pts) for i in range(3)]
  hi = [max(p[i] for p in pts) for i in range(3)]
  q = [math.log2(max(1, b * m)), math.log2(max(1, n)), math.log2(max(1, k))]
  q = [min(max(q[i], lo[i]), hi[i]) for i in range(3)]
  dist = sorted((sum((a - c) ** 2 for a, c in zip(p, q)), r) for p, r in zip(pts, rows))
  if dist[0][0] == 0:
    return dist[0][1][6] / peak, [dist[0][1]]
  near = dist[:4]
  w = [1.0 / d for d, _ in near]
  frac = sum(wi * r[6] / peak for wi, (_, r) in zip(w, near)) / sum(w)
  return frac, [r for _, r in near]


def rate(target: str, dtype_pair: str, mnk: tuple, peak_flops: float) -> float | None:
  """FLOP/s of one GEMM on ``target`` (h100/h200/b200): its measured fraction of peak times ``peak_flops``
  (the datasheet peak of its operand dtype); None where no class applies (the caller keeps its own rate)."""
  cls = dtype_class(dtype_pair)
  if cls is None or target not in ARCH or not mnk:
    return None
  b, (m, n, k) = (1, mnk) if len(mnk) == 3 else (mnk[0], mnk[1:])
  return fraction_of_peak(ARCH[target], cls, b, m, n, k)[0] * peak_flops
