"""Compile the MoE expert GEMMs (``fp4jax.grouped.grouped_dot``: y, dx, dw) for an H200 / B200 without a GPU.

  python bench/moe_gpu_aot.py --target h200 --recipes nvfp4,mxfp4,quartet2,tetrajet2 --shape 8,4096,1024,2048

--shape E,S,K,N: E experts, S sorted rows (group sizes traced: an even split here), K, N. Prints, per recipe,
whether it compiled, the compile seconds, XLA's per-device temp memory, and how XLA lowered the grouped
GEMMs (ragged-dot custom calls / cuBLAS GEMMs / Triton fusions in the optimized HLO). Uses
bench/gpu_aot.py's deviceless topology and compile; one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--target", default="h200")
  p.add_argument("--recipes", default="nvfp4,mxfp4,quartet2,tetrajet2")
  p.add_argument("--shape", default="8,1024,256,512")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  from fp4jax import _platform   # pylint: disable=import-outside-toplevel
  _platform.enable_deviceless()
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from bench import gpu_aot   # pylint: disable=import-outside-toplevel
  from fp4jax import grouped   # pylint: disable=import-outside-toplevel
  n_e, s, k, n = (int(v) for v in args.shape.split(","))
  device = gpu_aot.gpu_devices(args.target, 1)[0]
  single = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=single)
  out = []
  for recipe in args.recipes.split(","):
    def fn(x, w, dy, sizes, key, recipe=recipe):
      y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key), x, w)
      return (y, *vjp(dy.astype(y.dtype)))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=single)
    prog = gpu_aot.Program(f"grouped_{recipe}", fn, (spec((s, k), jnp.bfloat16), spec((n_e, k, n), jnp.bfloat16),
                                                    spec((s, n), jnp.bfloat16), spec((n_e,), jnp.int32), key))
    res = gpu_aot.compile_program(prog)
    text = res.pop("text", "") or ""
    res.update(ragged_dot_ops=text.count("ragged-dot") + text.count("ragged_dot"),
               cublas_gemms=text.count("__cublas$gemm") + text.count("__cublas$lt$matmul"),
               triton_fusions=text.count("__triton"), dots=text.count(" dot("))
    out.append(res)
    print(json.dumps({k_: v for k_, v in res.items() if k_ != "error"} | {"error": (res["error"] or "")[:300]}),
          flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(target=args.target, shape=args.shape, results=out), f, indent=1)
  return 1 if any(r.get("error") for r in out) else 0


if __name__ == "__main__":
  sys.exit(main())
