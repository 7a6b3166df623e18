"""fp4jax's Mosaic GPU NVFP4 GEMM against cuDNN's, compiled for the B200 without a GPU: one fprop GEMM
(x (M, K) 1x16 · w (N, K) 16x16 tiles, bf16 out) through ``fp4jax.native.matmul`` with each kernel.

  python bench/predict/mosaic_gemm_aot.py --shape 65536,20480,5120 --dump /tmp/mosaic_dump --json out.json
  python bench/predict/mosaic_gemm_aot.py --shape 65536,20480,5120 --devices 8   # x's rows over 8 B200s
  python bench/predict/mosaic_gemm_aot.py --shape 16384,2688,1024 --experts 16   # the experts' grouped rows GEMM

With ``--devices N`` x's rows are sharded over N GPUs of one HGX node (w whole on each): each device runs the
GEMM on its M/N rows, which the Mosaic kernel's name in the program shows (``mosaic_gemms``), with no collective.
Per route: lowering and XLA compile seconds, the custom calls and fusions of the optimized HLO, the ruler's
predicted ms (bench/predict/ruler.py on the B200 HGX node) and, for the Mosaic kernel, what its compile wrote
(``MOSAIC_GPU_DUMP_TO``): the PTX and SASS sizes, ptxas's registers and spills, and whether the PTX holds
the block-scaled MMA and no fused multiply-add. cuDNN's GEMM is not compiled here: XLA leaves a
``__cudnn$blockScaledDot`` call whose kernel cuDNN picks (and JIT-compiles, or loads from its library) on
the device. Run in a fresh process (a Mosaic GPU kernel is compiled once per process; the dump is written
then). Everything here is a prediction; nothing ran on a GPU.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BLOCK_SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X"


def _artifacts(dump: str) -> dict:
  """What the Mosaic kernel's compile wrote into ``dump``."""
  read = lambda pattern: "".join(open(p, encoding="utf-8", errors="replace").read()
                                 for p in sorted(glob.glob(os.path.join(dump, pattern))))
  ptx, ptxas, sass = read("*.ptx"), read("*.ptxas"), read("*.sass*")
  regs = re.search(r"Used (\d+) registers", ptxas)
  spills = re.search(r"(\d+) bytes spill stores", ptxas)
  target = re.search(r"for '(sm_\w+)'", ptxas)
  return dict(ptx_bytes=len(ptx), sass_bytes=len(sass), sass_lines=sass.count("\n"),
              ptx_block_scaled_mma=ptx.count(BLOCK_SCALED_MMA), ptx_fma=len(re.findall(r"\bfma\.\w*f32", ptx)),
              sass_utcomma=sass.count("UTCOMMA"), sass_ffma=sass.count("FFMA"),
              registers=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else None,
              sm=target.group(1) if target else None)


def _compiled(fn, *args):
  """fn lowered for sm_100 and compiled: (lower s, compile s, the optimized HLO, the ruler's prediction on one
  B200 of an HGX node, the custom-call targets in order)."""
  from bench.predict import ruler   # pylint: disable=import-outside-toplevel
  from fp4jax import _mosaic_compat as mc   # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  with mc.lowering_arch((10, 0)):
    lowered = fn.lower(*args)
  t1 = time.perf_counter()
  text = lowered.compile().as_text()
  t2 = time.perf_counter()
  return (round(t1 - t0, 2), round(t2 - t1, 2), text, ruler.predict(text, "b200", "hgx_b200"),
          re.findall(r'custom_call_target="([^"]+)"', text))


def compile_routes(shape, dump: str | None, devices: int = 1) -> dict:
  """Both routes compiled for ``devices`` B200s (x's rows sharded over them): {"mosaic": {...}, "cudnn": {...}}."""
  from fp4jax import _platform   # pylint: disable=import-outside-toplevel
  _platform.enable_deviceless()
  if dump:
    os.makedirs(dump, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from bench.predict import deviceless   # pylint: disable=import-outside-toplevel
  from fp4jax import _mosaic_compat as mc   # pylint: disable=import-outside-toplevel
  from fp4jax import native   # pylint: disable=import-outside-toplevel
  from fp4jax.qtensor import QTensor   # pylint: disable=import-outside-toplevel
  m, n, k = shape
  from jax.sharding import NamedSharding, PartitionSpec as P   # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(deviceless.gpu_devices("b200", devices), ("rows",))
  spec = lambda s, dt, *rows: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P(*rows)))
  a = QTensor(spec((m, k // 2), jnp.uint8, "rows"), spec((m, k // 16), jnp.float8_e4m3fn, "rows"),
              spec((), jnp.float32), "nvfp4", -1, 16, None, jnp.bfloat16)
  b = QTensor(spec((n, k // 2), jnp.uint8), spec((n // 16, k // 16), jnp.float8_e4m3fn), spec((), jnp.float32),
              "nvfp4", -1, None, (16, 16), jnp.bfloat16)
  out = {}
  for kernel in ("mosaic", "cudnn"):
    fn = jax.jit(lambda a, b, kernel=kernel: native.matmul(a, b, out_dtype=jnp.bfloat16, kernel=kernel))
    lower_s, compile_s, text, p, calls = _compiled(fn, a, b)
    out[kernel] = dict(lower_s=lower_s, compile_s=compile_s, custom_calls=sorted(set(calls)),
                       mosaic_calls=calls.count(mc.MOSAIC_CUSTOM_CALL),
                       mosaic_gemms=sorted(set(re.findall(r"fp4jax_mosaic_gemm_nvfp4_(\d+x\d+x\d+)", text))),
                       collectives=len(re.findall(r"= \S+ (?:all-gather|all-reduce|reduce-scatter|all-to-all|"
                                                  r"collective-permute)(?:-start)?\(", text)),
                       fusions=len(re.findall(r"= \S+ fusion\(", text)),
                       predicted_ms=round(p["step_s"] * 1e3, 3), gemm_ms=round(p["gemm_s"] * 1e3, 3),
                       kernels=p["compute_kernels"])
  if dump:
    out["mosaic"]["artifacts"] = _artifacts(dump)
  return out


def compile_grouped_routes(shape, experts: int, dump: str | None) -> dict:
  """The experts' rows GEMM (``fp4jax.gemm.grouped_matmul``, impl="native", amax per group as ``fp4jax.grouped``
  quantizes) of S sorted rows in ``experts`` equal traced groups, x (S, K) 1x16 · w[e] (N, K) 16x16 tiles, bf16
  out, compiled for one B200 with each kernel: {"mosaic": {...}, "cudnn": {...}} (the Mosaic grouped GEMM with the
  factor and the cast inside, or cuDNN's batched GEMM of gathered work items and the XLA epilogue)."""
  from fp4jax import _platform   # pylint: disable=import-outside-toplevel
  _platform.enable_deviceless()
  if dump:
    os.makedirs(dump, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from bench.predict import deviceless   # pylint: disable=import-outside-toplevel
  from fp4jax import _mosaic_compat as mc   # pylint: disable=import-outside-toplevel
  from fp4jax import dispatch, gemm   # pylint: disable=import-outside-toplevel
  from fp4jax.qtensor import QTensor   # pylint: disable=import-outside-toplevel
  s, n, k = shape
  rows = 16
  single = jax.sharding.SingleDeviceSharding(deviceless.gpu_devices("b200", 1)[0])
  spec = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=single)
  u = s // rows
  a = QTensor(spec((u, rows, k // 2), jnp.uint8), spec((u, rows, k // 16), jnp.float8_e4m3fn), spec((u,), jnp.float32),
              "nvfp4", -1, 16, None, jnp.bfloat16)
  b = QTensor(spec((experts, n, k // 2), jnp.uint8), spec((experts, n // 16, k // 16), jnp.float8_e4m3fn),
              spec((experts,), jnp.float32), "nvfp4", -1, None, (16, 16), jnp.bfloat16)
  sizes = spec((experts,), jnp.int32)
  out = {}
  for kernel in ("mosaic", "cudnn"):
    os.environ[dispatch.NATIVE_KERNEL_ENV] = kernel
    fn = jax.jit(lambda a, b, sizes: gemm.grouped_matmul(a, b, gemm.groups(sizes, s, rows), out_dtype=jnp.bfloat16,
                                                         impl="native", amax_per_group=True))
    lower_s, compile_s, text, p, calls = _compiled(fn, a, b, sizes)
    out[kernel] = dict(lower_s=lower_s, compile_s=compile_s, custom_calls=sorted(set(calls)),
                       mosaic_calls=calls.count(mc.MOSAIC_CUSTOM_CALL),
                       mosaic_grouped_gemms=sorted(set(re.findall(r"fp4jax_mosaic_grouped_gemm_nvfp4_(\d+x\d+x\d+x\d+)",
                                                                  text))),
                       fusions=len(re.findall(r"= \S+ fusion\(", text)),
                       predicted_ms=round(p["step_s"] * 1e3, 3), gemm_ms=round(p["gemm_s"] * 1e3, 3),
                       kernels=p["compute_kernels"])
  os.environ.pop(dispatch.NATIVE_KERNEL_ENV, None)
  if dump:
    out["mosaic"]["artifacts"] = _artifacts(dump)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="65536,20480,5120", help="M,N,K of the GEMM (x (M, K) · w (N, K)ᵀ)")
  parser.add_argument("--dump", default="", help="directory for the Mosaic kernel's PTX/SASS (empty: none)")
  parser.add_argument("--json", default="", help="write the result here")
  parser.add_argument("--devices", type=int, default=1, help="B200s of one node, x's rows sharded over them")
  parser.add_argument("--experts", type=int, default=0, help="E > 0: the experts' grouped rows GEMM instead, M the "
                      "S sorted rows in E equal groups (one B200; fp4jax.gemm.grouped_matmul, impl='native')")
  args = parser.parse_args(argv)
  shape = tuple(int(v) for v in args.shape.split(","))
  if len(shape) != 3:
    parser.error(f"--shape={args.shape!r}; give M,N,K")
  if args.experts:
    routes = compile_grouped_routes(shape, args.experts, args.dump or None)
  else:
    routes = compile_routes(shape, args.dump or None, args.devices)
  result = dict(shape=list(shape), devices=args.devices, experts=args.experts, routes=routes)
  text = json.dumps(result, indent=1)
  print(text)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
