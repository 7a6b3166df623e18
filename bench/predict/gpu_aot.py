"""Compile fp4jax's GPU program for an H100, H200 or B200 on a machine without a GPU, and cost it.

  python bench/predict/gpu_aot.py --target h200 --what dot --shape 8192,8192,8192 --recipe nvfp4
  python bench/predict/gpu_aot.py --target b200 --what quantize --shape 8192,8192 --impl pallas
  python bench/predict/gpu_aot.py --target h200 --what step --config configs/small.py
  python bench/predict/gpu_aot.py --target b200 --what dot     # the B200 default: the block-scaled FP4 GEMMs
  python bench/predict/gpu_aot.py --target b200 --what dot --impl xla     # the XLA path (bf16 GEMMs) instead
  python bench/predict/gpu_aot.py --target h200 --what step --config configs/nemotron_h_12b.py --devices 8 --mesh.fsdp=8
  python bench/predict/gpu_aot.py --target h200 --what kernels --json /tmp/k.json     # every Pallas kernel
  python bench/predict/gpu_aot.py --target b200 --what step --config configs/nemotron3_super.py --devices 64 \
      --twin=false --regroup_blocks     # Super as 12 distinct blocks, not 26; its config's batch

Needs jax's CUDA plugin at the installed jax's version (``pip install -e ".[gpu-compile]"``), no GPU:
the process compiles for a ``GpuTargetConfigProto`` (bench/predict/gpu_targets/<target>.txtpb) through
``jax.experimental.topologies``, so XLA's GPU pipeline, Triton and ptxas all run. ``--devices N`` makes
a topology of N GPUs (8 per host); ``--mesh.<axis>=k`` / ``--config.<field>=v`` as in bench/scale.py,
whose step builder (``scale.build_step``) is the one used here. ``--regroup_blocks`` compiles the config's blocks
reordered into few scan loops (bench/predict/regroup.py): the same step for the ruler in a fraction
of the compile. A config that profiles its step (``config.pgle_steps``, training/pgle.py: on a GPU the step is
compiled again with its measured instruction times) is compiled twice here too, the second time with the ruler's
costs of the first as the profile (bench/predict/pgle_profile.py); the second is the one priced, the first's
step printed beside it (``--nopgle``: the first only).

Every automatic choice is made for the target's devices, as a GPU process makes it (``fp4jax.target``):
attention_impl="auto" traces cuDNN's fused attention, and on the B200 the quantized dot's GEMMs are
native; ``--impl`` forces one instead.

``--what``: one op (``quantize``, ``quantize_sr``, ``quantize_2d``, ``quantize_rht_t``,
``dequantize``, ``scaled_matmul``; ``--fmt``, ``--impl``), ``dot`` (``value_and_grad`` of
``fp4jax.dot``: y, dx and dw for a cotangent input, any ``--recipe``), ``step`` (a config's train
step), or the batches the tests compile (``kernels``: every Pallas kernel; ``ops``: the XLA
composition of every op; ``dots``: every recipe preset's dot).

Printed, and written by ``--json``: per-device memory (XLA's memory analysis), compile seconds, the
collectives by kind and dtype in bytes per step (loop trip counts applied), fusion / kernel / GEMM
counts, the launches by part and work against the twin's (``launches.py``), the GEMMs with shapes and
dtypes, the bytes of the other ops by what they belong to, and the
cost model of ``bench/predict/hlo_cost.py`` (what it ignores is said there: autotuning, overlap, launch
latency, caches): the predicted time and, for ``dot`` and ``step``, its ratio to the bf16 twin of the
same program compiled in the same run (top-level ``ratio_vs_bf16``). ``--hlo PATH`` keeps the optimized HLO
of the program and of its twin (``twin_hlo_path``: PATH with ".twin" before the extension).
"""
from __future__ import annotations

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mesh_aliases(argv) -> list[str]:
  return [f"--config.{a[2:]}" if a.startswith("--mesh.") else a for a in argv]


if __name__ == "__main__":
  sys.argv = _mesh_aliases(sys.argv)
  sys.path.insert(0, ROOT)

# pylint: disable=wrong-import-position
import functools
import json

from bench.predict.deviceless import PER_HOST, TARGETS, Program, compile_program, gpu_devices
from bench.predict.peaks import INT_OPS_HELP, peaks
from bench.predict.programs import batch_programs, combined, dot_program, op_program
from bench.predict.summary import GiB, check_budget, report, summarize

KERNEL_FALLBACK = "did not lower"   # fp4jax.primitives.pair's warning: a kernel ran its XLA twin instead


def _flags():
  from absl import flags   # pylint: disable=import-outside-toplevel
  from bench import scale   # noqa: F401  (defines --config, --devices, --batch_per_device, --json, --hlo)
  flags.FLAGS.set_default("devices", 1)   # scale.py's flag; here: GPUs of the topology (--what step)
  flags.DEFINE_enum("target", "h200", TARGETS, "GPU target (bench/predict/gpu_targets/<target>.txtpb).")
  flags.DEFINE_string("what", "dot", "quantize | quantize_sr | quantize_2d | quantize_rht_t | "
                      "quantize_rht_t_sr | (quantize_sr | quantize_2d_sr | quantize_rht_t_sr)_(packed | philox) | dequantize | "
                      "scaled_matmul | mixed_matmul | ssd | gated_norm | dot | step | kernels | ops | dots "
                      "(the last three: a comma-separated list compiles them in one process)")
  flags.DEFINE_string("shape", None, "M,K for an op (T,C for quantize_rht_t), M,N,K for "
                      "scaled_matmul, M,K,N for dot (default 8192 each), B,L,H,P,G,N for ssd "
                      "and B,L,G,RP for gated_norm (default the 12B mixer's).")
  flags.DEFINE_string("fmt", "nvfp4", "nvfp4 | mxfp4 (ops).")
  flags.DEFINE_enum("impl", "auto", ("auto", "xla", "pallas", "native"),
                    "auto: every default decided for --target as a GPU process decides it (fp4jax.target: "
                    "on b200 the native GEMMs); xla | pallas force an op's impl, and for dot and step "
                    "FP4JAX_DEFAULT_IMPL for the run; native (dot, step): every GEMM that has one "
                    "block-scaled, FP4JAX_DEFAULT_IMPL=native.")
  flags.DEFINE_string("recipe", "nvfp4", "recipe preset of --what dot.")
  flags.DEFINE_enum("sr_bits", None, ("jax", "packed", "philox"), "--what dot: the recipe with this "
                    "Recipe.sr_bits (the layout of its stochastic-rounding bits; default: the preset's, 'philox').")
  flags.DEFINE_enum("peaks", "derated", ("derated", "spec"), "peak rates of the cost model.")
  flags.DEFINE_boolean("twin", True, "also compile the bf16 twin (dot, step) and print the ratio.")
  flags.DEFINE_boolean("small", True, "kernels/ops/dots at small shapes.")
  flags.DEFINE_list("combine", [], "batches among kernels,ops,dots to compile as one module each (one "
                    "compile; identical kernels compiled once); the others compile program by program.")
  flags.DEFINE_boolean("one_pass_rht_amax", False, "what-if: the RHT amax as one pass "
                       "(kernels.quantize_rht_t.rht_amax(one_pass=True)) where fp4jax.api takes it.")
  flags.DEFINE_list("what_if_proved", [], "what-if: these kernel ops (of fp4jax.dispatch.KERNEL_OPS and "
                    "mosaic_gemm, or 'all') count as proved exact and faster on --target, as the on-device "
                    "proof (tools.prove) would record them, so --impl auto picks them (on b200 beside the "
                    "native GEMMs; mosaic_gemm: fp4jax's GEMM instead of cuDNN's behind them, unless "
                    "FP4JAX_NATIVE_KERNEL=cudnn).")
  flags.DEFINE_boolean("int_ops", True, INT_OPS_HELP)
  flags.DEFINE_string("cluster", "", "the cluster that prices the step's collectives (bench/predict/cluster.py: "
                      "hgx_h200, "
                      "hgx_b200, gb200_nvl72; default the HGX node of --target)")
  flags.DEFINE_boolean("regroup_blocks", False, "step: the config's blocks reordered into few scan loops "
                       "(bench/predict/regroup.py): the same blocks, parameters and collectives for the ruler, "
                       "compiled in a fraction of the time (Nemotron 3 Super: 12 distinct blocks instead of 26).")
  flags.DEFINE_boolean("pgle", True, "step: where the config profiles its step (config.pgle_steps, "
                       "training/pgle.py), compile it again with the ruler's costs of the first compile as the "
                       "profile (bench/predict/pgle_profile.py) and price that one, as a GPU run schedules its "
                       "step after the profiled steps; --nopgle: the first compile only.")
  flags.DEFINE_float("budget_s", 0, "with kernels/ops/dots: exit 1 if a compile takes longer.")
  flags.DEFINE_float("budget_gib", 0, "with kernels/ops/dots: exit 1 if host RSS grows past this.")
  return flags.FLAGS


def main(argv):
  del argv
  from fp4jax import _platform   # pylint: disable=import-outside-toplevel
  _platform.enable_deviceless()
  import jax   # pylint: disable=import-outside-toplevel
  F = flags_
  if F.one_pass_rht_amax:
    import functools   # pylint: disable=import-outside-toplevel
    from fp4jax import api   # pylint: disable=import-outside-toplevel
    from fp4jax.kernels import quantize_rht_t   # pylint: disable=import-outside-toplevel
    api.rht_amax = functools.partial(quantize_rht_t.rht_amax, one_pass=True)
  if F.what_if_proved:
    assume_proved(F.what_if_proved)
  devices = gpu_devices(F.target, F.devices if F.what == "step" else 1)
  mesh, results, twin = None, [], None
  single = jax.sharding.SingleDeviceSharding(devices[0])
  shape = tuple(int(v) for v in F.shape.split(",")) if F.shape else None
  batches = F.what.split(",")
  if all(b in ("kernels", "ops", "dots") for b in batches):
    progs = []
    for b in batches:
      batch = batch_programs(b, single, small=F.small)
      progs += [combined(b, batch)] if b in F.combine else batch
    for p in progs:
      results.append(_compiled(F, p))
      print(report(results[-1]), flush=True)
  elif F.what == "dot":
    _force_impl(F.impl)
    shape = shape or (8192, 8192, 8192)
    results.append(_compiled(F, dot_program(F.recipe, shape, single, F.sr_bits)))
    if F.twin:
      twin = _compiled(F, dot_program("bf16", shape, single), twin=True)
    print(report(results[0], twin))
  elif F.what == "step":
    results, twin, mesh = _step(F, devices)
  else:
    shape = shape or {"scaled_matmul": (8192, 8192, 8192), "mixed_matmul": (8192, 8192, 8192),
                      "ssd": None, "gated_norm": None}.get(F.what, (8192, 8192))
    if F.impl == "native":
      raise ValueError("--impl native is a GEMM backend (--what dot or step); ops take auto, xla or pallas")
    results.append(_compiled(F, op_program(F.what, shape, F.fmt, None if F.impl == "auto" else F.impl,
                                           single)))
    print(report(results[0]))
  out = dict(target=F.target, peaks=peaks(F.target, F.peaks, F.int_ops), peaks_kind=F.peaks, what=F.what,
             devices=len(devices), jax_version=jax.__version__, results=results, twin=twin)
  if twin is not None and not twin.get("error") and results and not results[0].get("error"):
    out["ratio_vs_bf16"] = results[0]["cost"]["predicted_ms"] / twin["cost"]["predicted_ms"]
  if F.json:
    with open(F.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  problems = [p for r in results for p in check_budget(r, F.budget_s or float("inf"),
                                                      (F.budget_gib or float("inf")) * GiB)]
  for p in problems:
    print("BUDGET/ERROR:", p)
  return 1 if problems or any(r.get("error") for r in results) else 0


def assume_proved(ops: list[str]) -> None:
  """--what_if_proved: record ``ops`` in VERIFIED_KERNELS for every kernel format, as a device run
  that found them exact and faster would (the evidence says it is a what-if)."""
  from fp4jax import formats   # pylint: disable=import-outside-toplevel
  from fp4jax import dispatch   # pylint: disable=import-outside-toplevel
  known = {**{op: formats.KERNEL_FORMATS for op in dispatch.KERNEL_OPS}, dispatch.MOSAIC_GEMM: dispatch.MOSAIC_FORMATS,
           dispatch.MOSAIC_GROUPED_GEMM: dispatch.MOSAIC_FORMATS}
  ops = list(known) if ops == ["all"] else ops
  unknown = sorted(set(ops) - set(known))
  if unknown:
    raise ValueError(f"--what_if_proved: unknown kernel ops {unknown}; use some of {list(known)} or 'all'")
  what_if = dispatch.Evidence(date="what-if", device="--what_if_proved", jax_version="", speedup=float("nan"))
  for op in ops:
    for fmt in known[op]:
      dispatch.VERIFIED_KERNELS[(op, fmt)] = what_if


def _force_impl(impl: str) -> None:
  """--impl for dot and step: "auto" leaves every default to the target; the others force it."""
  if impl != "auto":
    os.environ["FP4JAX_DEFAULT_IMPL"] = impl


_HLO_WRITTEN: list[str] = []


def twin_hlo_path(path: str) -> str:
  """Where ``--hlo PATH`` keeps the bf16 twin's HLO: PATH with ".twin" before its extension."""
  stem, ext = os.path.splitext(path)
  return f"{stem}.twin{ext}"


def _compiled(F, prog, mesh=None, twin=False) -> dict:
  """compile_program + summarize; --hlo keeps the first program's optimized HLO text, and its twin's
  (``twin_hlo_path``). A kernel that did not lower runs its XLA twin in the program (``fp4jax.primitives.pair``
  warns): the result lists those warnings (``kernel_fallbacks``), since the prediction then prices the twin."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = compile_program(prog, mesh)
  for w in caught:
    print(f"{w.category.__name__}: {w.message}", file=sys.stderr, flush=True)
  path = twin_hlo_path(F.hlo) if F.hlo and twin else F.hlo
  if path and res.get("text") and path not in _HLO_WRITTEN:
    with open(path, "w", encoding="utf-8") as f:
      f.write(res["text"])
    _HLO_WRITTEN.append(path)
  out = summarize(res, F.target, F.peaks, F.int_ops, F.cluster)
  out["kernel_fallbacks"] = sorted({str(w.message) for w in caught if KERNEL_FALLBACK in str(w.message)})
  return out


def _step(F, devices):
  import jax   # pylint: disable=import-outside-toplevel
  from bench import scale   # pylint: disable=import-outside-toplevel
  from models import moe   # pylint: disable=import-outside-toplevel
  from training import sharding   # pylint: disable=import-outside-toplevel
  config = F.config
  per_node = config.mesh.get("devices_per_node", 0)
  if per_node not in (0, PER_HOST):
    raise ValueError(f"--config.mesh.devices_per_node={per_node}: the topology's nodes are its hosts of {PER_HOST} "
                     "GPUs (the clusters' HGX nodes); leave it 0")
  mesh = sharding.make_mesh(config.mesh, devices)   # the trainer's placement: the topology's hosts are its nodes
  ranks = sharding.batch_ways(mesh)
  regrouped = None
  if F.regroup_blocks:
    config, regrouped = _regrouped(config)
    print(f"regrouped blocks: {regrouped['regrouped']} ({regrouped['regrouped_distinct_blocks']} distinct blocks "
          f"in {regrouped['regrouped_groups']} groups; as configured {regrouped['distinct_blocks']} in "
          f"{regrouped['groups']})", flush=True)
  micro = config.micro_batches
  bpd = F.batch_per_device if F["batch_per_device"].present else max(1, config.batch_size // (micro * ranks))
  _force_impl(F.impl)

  def one(cfg, name, twin=False):
    built = scale.build_step(cfg, mesh, bpd)
    profile = functools.partial(_ruler_profile, F, twin) if F.pgle and cfg.get("pgle_steps", 0) else None
    prog = Program(name, built["step_fn"], (built["state_in"], built["batch_in"]), profile=profile)
    out = _compiled(F, prog, mesh, twin)
    out["compiler_options"] = built["compiler_options"]   # the config's xla_options for this target
    if regrouped is not None:
      out["regrouped"] = regrouped
    print(f"{name}: XLA compiler options {built['compiler_options'] or '(XLA defaults)'}", flush=True)
    if not out.get("error"):   # MFU = 6 · active params · tokens per device / (step · datasheet bf16 peak)
      out["params"] = sum(x.size for x in jax.tree.leaves(built["abstract"]["params"]))
      out["active_params"] = out["params"] - moe.inactive_params(built["model_config"])   # all but MoE's idle experts
      out["tokens_per_device"] = built["tokens_in"].shape[0] * cfg.data.seq_len // len(devices)
      out["mfu"] = (6 * out["active_params"] * out["tokens_per_device"]
                    / (out["cost"]["predicted_ms"] * 1e-3 * peaks(F.target, "spec")["flops"]["bf16"]))
    return out

  nodes = sharding.describe_nodes(config.mesh, dict(mesh.shape))
  res = one(config, f"step {config.name} recipe {config.recipe} mesh {dict(mesh.shape)} "
            + (f"({nodes}) " if nodes else "") + f"{bpd}x{config.data.seq_len} tokens/rank"
            + (f" in each of {micro} micro-batches" if micro > 1 else ""))
  twin = None
  if F.twin and config.recipe != "bf16":
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.recipe = "bf16"
    twin = one(cfg, f"step {config.name} recipe bf16 (twin)", twin=True)
  print(report(res, twin))
  if twin is not None:
    print(report(twin))
  return [res], twin, mesh


def _ruler_profile(F, twin: bool, text: str, partition_devices) -> str:
  """The ruler's costs of a first compile's HLO ``text`` as a profile (bench/predict/pgle_profile.py), written
  beside ``--hlo`` (PATH with ".pgle.pbtxt" for its extension) or to a temporary file; its path."""
  from bench.predict import pgle_profile   # pylint: disable=import-outside-toplevel
  import tempfile   # pylint: disable=import-outside-toplevel
  if F.hlo:
    path = os.path.splitext(twin_hlo_path(F.hlo) if twin else F.hlo)[0] + ".pgle.pbtxt"
  else:
    fd, path = tempfile.mkstemp(prefix="fp4jax-pgle-", suffix=".pbtxt")
    os.close(fd)
  pgle_profile.write(pgle_profile.costs(text, F.target, F.cluster or f"hgx_{F.target}", partition_devices), path)
  return path


def _regrouped(config):
  """``config`` with ``model.pattern`` regrouped (bench/predict/regroup.py) and what regrouping did."""
  from bench.predict import regroup   # pylint: disable=import-outside-toplevel
  from training import config as config_lib   # pylint: disable=import-outside-toplevel
  model_config = config_lib.resolve_model_config(config.model)
  described = regroup.describe(model_config)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.model.pattern = described["regrouped"]
  return config, described


flags_ = None

if __name__ == "__main__":
  from absl import app   # pylint: disable=import-outside-toplevel
  flags_ = _flags()
  app.run(lambda argv: sys.exit(main(argv)))
