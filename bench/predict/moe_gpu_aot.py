"""Compile the MoE expert GEMMs (``fp4jax.grouped.grouped_dot``: y, dx, dw) for an H200 / B200 without a GPU.

  python bench/predict/moe_gpu_aot.py --target b200 --recipes nvfp4 --shape 8,2176,64,128 --plans xla,native:S,native:512

--shape E,S,K,N: E experts, S sorted rows (group sizes traced: an even split here), K, N. --plans: the grouped
GEMM's implementation per compile: "xla" (FP4JAX_DEFAULT_IMPL=xla: ``lax.ragged_dot`` on the bf16 products),
"native" (the default tiling, ``fp4jax.native.TILING``), "native:S" (one tile of all S rows: each expert's
GEMM padded to S) or "native:T" (tiles of T rows). Prints, per recipe and plan, whether it compiled, the
compile seconds, XLA's per-device temp memory, the launches (``launches``: hlo_cost's charged ops times their
loop trip counts, the ruler's kernel count), how XLA lowered the grouped GEMMs (block-scaled cuDNN calls /
ragged-dot custom calls / cuBLAS GEMMs / Triton fusions in the optimized HLO), and bench/predict/hlo_cost.py's
prediction for the target: milliseconds (all, GEMMs), GEMM TFLOP, the bytes of the non-GEMM ops and the
integer ops (charged at the int32 rate with ``--int_ops``, as in bench/predict/gpu_aot.py). Uses
bench/predict/deviceless.py's topology and compile; one GPU. ``--what_if_proved``: as gpu_aot.py's
(``mosaic_grouped_gemm``: the experts' rows GEMMs, y and dx, on fp4jax's grouped Mosaic GEMM instead of cuDNN's);
``--fprop_only``: y alone.

  python bench/predict/moe_gpu_aot.py --recipes nvfp4 --plans native --shape 8,8192,1024,2688 --fprop_only \
      --what_if_proved mosaic_grouped_gemm
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _plan(plan: str):
  """(FP4JAX_DEFAULT_IMPL, fp4jax.native.Tiling or None) of one --plans entry."""
  from fp4jax import native   # pylint: disable=import-outside-toplevel
  impl, _, tile = plan.partition(":")
  if impl not in ("xla", "native"):
    raise ValueError(f"--plans entry {plan!r}: use xla, native, native:S or native:<rows>")
  if impl == "xla" or not tile:
    return impl, native.TILING
  if tile == "S":
    return impl, native.Tiling(one_tile_groups=1 << 30)
  return impl, native.Tiling(one_tile_groups=0, rows=int(tile))


def main() -> int:
  from bench.predict import deviceless   # pylint: disable=import-outside-toplevel
  from bench.predict import peaks   # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser()
  p.add_argument("--target", default="b200")
  p.add_argument("--recipes", default="nvfp4,mxfp4,quartet2,tetrajet2")
  p.add_argument("--shape", default="8,1024,256,512")
  p.add_argument("--plans", default="xla,native")
  p.add_argument("--json", default=None)
  p.add_argument("--int_ops", action="store_true", help=peaks.INT_OPS_HELP)
  p.add_argument("--fprop_only", action="store_true", help="compile y = grouped_dot(x, w) alone (no dx, dw)")
  p.add_argument("--what_if_proved", default="", help="comma-separated kernel ops (or 'all') counted as proved, "
                 "as bench/predict/gpu_aot.py's flag")
  args = p.parse_args()
  from fp4jax import _platform   # pylint: disable=import-outside-toplevel
  _platform.enable_deviceless()
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  if args.what_if_proved:
    from bench.predict.gpu_aot import assume_proved   # pylint: disable=import-outside-toplevel
    assume_proved(args.what_if_proved.split(","))
  from bench.predict import hlo_cost   # pylint: disable=import-outside-toplevel
  from fp4jax import _native_compat as nc   # pylint: disable=import-outside-toplevel
  from fp4jax import _mosaic_compat as mc   # pylint: disable=import-outside-toplevel
  from fp4jax import grouped, native, target   # pylint: disable=import-outside-toplevel
  n_e, s, k, n = (int(v) for v in args.shape.split(","))
  device = deviceless.gpu_devices(args.target, 1)[0]
  capability = target.Target.of(device).capability or (9, 0)
  single = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=single)
  out = []
  for recipe in args.recipes.split(","):
    for plan in args.plans.split(","):
      impl, tiling = _plan(plan)
      os.environ["FP4JAX_DEFAULT_IMPL"] = impl
      native.TILING = tiling

      def fn(x, w, dy, sizes, key, recipe=recipe):
        if args.fprop_only:
          return grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key)
        y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key), x, w)
        return (y, *vjp(dy.astype(y.dtype)))
      key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=single)
      prog = deviceless.Program(f"grouped_{recipe}_{plan}", fn,
                             (spec((s, k), jnp.bfloat16), spec((n_e, k, n), jnp.bfloat16),
                              spec((s, n), jnp.bfloat16), spec((n_e,), jnp.int32), key))
      with mc.lowering_arch(capability):   # the target's, where the Mosaic GPU lowering reads it
        res = deviceless.compile_program(prog)
      text = res.pop("text", "") or ""
      res.update(plan=plan, block_scaled_calls=text.count(nc.BLOCK_SCALED_TARGET),
                 ragged_dot_ops=text.count("ragged-dot") + text.count("ragged_dot"),
                 cublas_gemms=text.count("__cublas$gemm") + text.count("__cublas$lt$matmul"),
                 triton_fusions=text.count("__triton"), dots=text.count(" dot("),
                 mosaic_calls=text.count(f'custom_call_target="{mc.MOSAIC_CUSTOM_CALL}"'))
      if text:
        cost = hlo_cost.analyze(text, peaks.peaks(args.target, int_ops=args.int_ops))
        res.update(launches=sum(o["count"] for o in cost["ops"]),
                   predicted_ms=round(cost["seconds"] * 1e3, 4), gemm_ms=round(cost["gemm_seconds"] * 1e3, 4),
                   gemm_tflop=round(cost["gemm_flops"] / 1e12, 4),
                   other_mb=round(cost["other_bytes"] / 2**20, 1),
                   int_gops=round(cost["int_ops"] / 1e9, 3), int_ops_charged=cost["int_ops_charged"],
                   gemm_mb=round(sum(o["bytes"] * o["count"] for o in cost["ops"] if o["kind"] == "gemm") / 2**20, 1))
      out.append(res)
      print(json.dumps({k_: v for k_, v in res.items() if k_ != "error"} | {"error": (res["error"] or "")[:300]}),
            flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(target=args.target, shape=args.shape, results=out), f, indent=1)
  return 1 if any(r.get("error") for r in out) else 0


if __name__ == "__main__":
  sys.exit(main())
