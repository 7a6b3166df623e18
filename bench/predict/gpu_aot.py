"""Compile fp4jax's GPU program for an H100, H200 or B200 on a machine without a GPU, and cost it.

  python bench/predict/gpu_aot.py --target h200 --what dot --shape 8192,8192,8192 --recipe nvfp4
  python bench/predict/gpu_aot.py --target b200 --what quantize --shape 8192,8192 --impl pallas
  python bench/predict/gpu_aot.py --target h200 --what step --config configs/small.py
  python bench/predict/gpu_aot.py --target b200 --what dot     # the B200 default: the block-scaled FP4 GEMMs
  python bench/predict/gpu_aot.py --target b200 --what dot --impl xla     # the XLA path (bf16 GEMMs) instead
  python bench/predict/gpu_aot.py --target h200 --what step --config configs/nemotron_h_12b.py --devices 8 --mesh.fsdp=8
  python bench/predict/gpu_aot.py --target h200 --what kernels --json /tmp/k.json     # every Pallas kernel

Needs jax's CUDA plugin at the installed jax's version (``pip install -e ".[gpu-compile]"``), no GPU:
the process compiles for a ``GpuTargetConfigProto`` (bench/predict/gpu_targets/<target>.txtpb) through
``jax.experimental.topologies``, so XLA's GPU pipeline, Triton and ptxas all run. ``--devices N`` makes
a topology of N GPUs (8 per host); ``--mesh.<axis>=k`` / ``--config.<field>=v`` as in bench/scale.py,
whose step builder (``scale.build_step``) is the one used here.

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
counts, the GEMMs with shapes and dtypes, the bytes of the other ops by what they belong to, and the
cost model of ``bench/predict/hlo_cost.py`` (what it ignores is said there: autotuning, overlap, launch
latency, caches): the predicted time and, for ``dot`` and ``step``, its ratio to the bf16 twin of the
same program compiled in the same run (top-level ``ratio_vs_bf16``).
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TARGETS_DIR = os.path.join(HERE, "gpu_targets")
TARGETS = ("h100", "h200", "b200")


def _mesh_aliases(argv) -> list[str]:
  return [f"--config.{a[2:]}" if a.startswith("--mesh.") else a for a in argv]


if __name__ == "__main__":
  sys.argv = _mesh_aliases(sys.argv)
  sys.path.insert(0, ROOT)

# pylint: disable=wrong-import-position
import dataclasses
import json
import resource
import time

from bench.predict.peaks import peaks   # the rates (a leaf that bench/predict/ruler.py reads too); gpu_aot.peaks for its callers


INT_OPS_HELP = ("charge integer work (hlo_cost: fusions' integer elementwise ops, e.g. jax.random.bits's "
                "threefry, and the ops a kernel declares, e.g. the quantize kernels that hash their SR bits) at 64 "
                "int32 ops per SM per clock (the default); --noint_ops: bytes only, the old roofline (integer ops "
                "counted and printed, not charged).")


def target_config(target: str) -> str:
  with open(os.path.join(TARGETS_DIR, f"{target}.txtpb"), encoding="utf-8") as f:
    return f.read()


def gpu_devices(target: str, n: int):
  """N devices of a deviceless GPU topology (8 per host, as an HGX node)."""
  from jax.experimental import topologies   # pylint: disable=import-outside-toplevel
  per_host = min(n, 8)
  if n % per_host:
    raise ValueError(f"--devices={n}: use up to 8, or a multiple of 8")
  topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                      topology=f"1x{n // per_host}x{per_host}")
  return topo.devices


def max_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class Program:
  """One function to compile: ``fn`` jitted over ``args`` (ShapeDtypeStructs with shardings);
  ``kernels``: Pallas kernels its HLO must hold (0 = none required)."""
  name: str
  fn: object
  args: tuple
  kernels: int = 0


def program_devices(args) -> list:
  """The devices a program's arguments are placed on (their shardings'): what it is compiled for."""
  import jax   # pylint: disable=import-outside-toplevel
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return sorted(sharding.device_set, key=lambda d: d.id)
  return []


def compile_program(prog: Program, mesh=None) -> dict:
  """Lowers and compiles; returns the compiled executable's text, memory and times (never raises:
  an error is returned in ``error``). Every automatic choice (attention's kernel, the GEMM backend,
  the primitives' impl) is traced for the program's devices (``fp4jax.target``): the mesh's, else its
  arguments', the GPU topology's, as a GPU process would decide, not this CPU process's."""
  import jax   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  t0, c0 = time.perf_counter(), time.process_time()
  try:
    fn = prog.fn if hasattr(prog.fn, "lower") else jax.jit(prog.fn)
    if mesh is not None:
      from training import sharding   # pylint: disable=import-outside-toplevel
      with sharding.mesh_context(mesh), fp4jax.target.use(mesh):
        lowered = fn.lower(*prog.args)
    else:
      with fp4jax.target.use(program_devices(prog.args) or None):
        lowered = fn.lower(*prog.args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
  except Exception as e:   # pylint: disable=broad-except  (reported per program)
    return dict(name=prog.name, error=f"{type(e).__name__}: {str(e)[:2000]}",
                seconds=round(time.perf_counter() - t0, 2), max_rss_bytes=max_rss_bytes())
  t2, c2 = time.perf_counter(), time.process_time()
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  return dict(name=prog.name, error=None, text=text, lower_s=round(t1 - t0, 2),
              compile_s=round(t2 - t1, 2), seconds=round(t2 - t0, 2), cpu_s=round(c2 - c0, 2),
              max_rss_bytes=max_rss_bytes(),
              kernels=text.count('custom_call_target="__gpu$xla.gpu.triton"'),
              kernels_required=prog.kernels,
              memory=dict(argument_bytes=int(mem.argument_size_in_bytes),
                          output_bytes=int(mem.output_size_in_bytes),
                          alias_bytes=int(mem.alias_size_in_bytes),
                          temp_bytes=int(mem.temp_size_in_bytes)))


# ------------------------------------------------------------------------------------ programs

def _spec(shape, dtype, sharding):
  import jax   # pylint: disable=import-outside-toplevel
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _with(sharding, tree):
  import jax   # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def op_program(what: str, shape, fmt: str, impl: str, sharding) -> Program:
  """One fp4jax op on bf16 inputs of ``shape`` ((M, K); (M, N, K) for scaled_matmul). An SR quantize op
  ending in ``_packed`` draws its bits in the packed layout (``sr_bits="packed"``)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  from fp4jax.api import quantize_rht_transposed   # pylint: disable=import-outside-toplevel
  key = _with(sharding, jax.eval_shape(lambda: jax.random.key(0)))
  kern = 1 if impl == "pallas" else 0
  tag = f"{what}_{fmt}_{impl or 'auto'}"
  sr_bits = "packed" if what.endswith("_sr_packed") else "jax"
  what = what.removesuffix("_packed") if sr_bits == "packed" else what
  if what in ("quantize", "quantize_sr", "quantize_2d", "quantize_2d_sr"):
    m, k = shape
    tile = (16, 16) if what.startswith("quantize_2d") else None
    rounding = "stochastic" if what.endswith("_sr") else "nearest"
    kw = {"sr_bits": sr_bits} if rounding == "stochastic" else {}   # nearest: no stream to name
    def fn(x, key):
      q = fp4jax.quantize(x, fmt, tile=tile, rounding=rounding, key=key, impl=impl, **kw)
      return q.data, q.scale
    return Program(tag, fn, (_spec((m, k), jnp.bfloat16, sharding), key), kern)
  if what in ("quantize_rht_t", "quantize_rht_t_sr"):
    t, c = shape
    rounding = "stochastic" if what.endswith("_sr") else "nearest"
    size = 32 if fmt == "mxfp4" else 16
    kw = {"sr_bits": sr_bits} if rounding == "stochastic" else {}
    def fn(x, key):
      q = quantize_rht_transposed(x, fmt, rht_size=size, rounding=rounding, key=key, impl=impl, **kw)
      return q.data, q.scale
    return Program(tag, fn, (_spec((t, c), jnp.bfloat16, sharding), key), kern)
  if what == "dequantize":
    m, k = shape
    q = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, impl="xla"),
                                       jax.ShapeDtypeStruct((m, k), jnp.bfloat16)))
    return Program(tag, lambda q: fp4jax.dequantize(q, jnp.bfloat16, impl=impl), (q,), 0)
  if what in ("scaled_matmul", "mixed_matmul"):
    m, n, k = shape
    w_tile = (16, 16) if fmt == "nvfp4" else None
    qa = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, impl="xla"),
                                        jax.ShapeDtypeStruct((m, k), jnp.bfloat16)))
    qb = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, tile=w_tile, impl="xla"),
                                        jax.ShapeDtypeStruct((n, k), jnp.bfloat16)))
    if what == "mixed_matmul" and impl == "pallas":   # one kernel: the GEMM that decodes as it loads
      from fp4jax import primitives   # pylint: disable=import-outside-toplevel
      return Program(tag, lambda a, b: primitives.mixed_matmul(a, b, out_dtype=jnp.bfloat16), (qa, qb), 1)
    # the kernel path: its two dequantize passes and its GEMM are kernels
    return Program(tag, lambda a, b: fp4jax.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl),
                   (qa, qb), 3 * kern)
  if what == "ssd":
    return ssd_program(shape, impl, sharding)
  if what == "gated_norm":
    return gated_norm_program(shape, impl, sharding)
  raise ValueError(f"unknown op {what!r}")


SSD_12B_MIXER = (1, 8192, 160, 64, 8, 128)   # B, L, H, P, G, N of one 12B Mamba-2 mixer per GPU


def ssd_program(shape, impl: str, sharding, chunk_size: int = 256) -> Program:
  """The Mamba-2 SSD (``models.ssd_pallas.ssd``: y = SSD + D x) forward and backward, as the mixer
  calls it (float32 x, B, C after the conv), for a cotangent input: y, dx, ddt, da, dB, dC, dD.
  ``shape``: (B, L, H, P, G, N); impl "xla" is ``ssd_chunked`` at ``chunk_size`` (the 12B's 256)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from models import ssd_pallas   # pylint: disable=import-outside-toplevel
  b, l, h, p, g, n = shape or SSD_12B_MIXER

  def fn(x, dt, a, bm, cm, d, dy):
    def f(x, dt, a, bm, cm, d):
      return ssd_pallas.ssd(x, dt, a, bm, cm, chunk_size=chunk_size, d_H=d, impl=impl)[0]
    y, vjp = jax.vjp(f, x, dt, a, bm, cm, d)
    return (y, *vjp(dy))

  f32 = jnp.float32
  args = tuple(_spec(s, f32, sharding) for s in ((b, l, h, p), (b, l, h), (h,), (b, l, g, n), (b, l, g, n),
                                                 (h,), (b, l, h, p)))
  return Program(f"ssd_{impl}", fn, args, len(ssd_pallas.KERNEL_NAMES) + 1 if impl == "pallas" else 0)


GATED_NORM_12B_MIXER = (1, 8192, 8, 1280)   # B, L, G, R P of one 12B Mamba-2 mixer per GPU


def gated_norm_program(shape, impl: str, sharding) -> Program:
  """The mixer's gated RMSNorm (``models.gated_norm.gated_norm``) forward and backward as the mixer calls
  it (float32 y from the scan, bf16 z from in_proj, float32 scale, bf16 out), for a cotangent input:
  out, dy, dz, dscale. ``shape``: (B, L, G, RP)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from models import gated_norm   # pylint: disable=import-outside-toplevel
  b, l, g, rp = shape or GATED_NORM_12B_MIXER

  def fn(y, z, w, dout):
    out, vjp = jax.vjp(lambda y, z, w: gated_norm.gated_norm(y, z, w, eps=1e-5, out_dtype=jnp.bfloat16,
                                                             impl=impl), y, z, w)
    return (out, *vjp(dout))

  bf16, f32 = jnp.bfloat16, jnp.float32
  args = (_spec((b, l, g, rp), f32, sharding), _spec((b, l, g, rp), bf16, sharding),
          _spec((g, rp), f32, sharding), _spec((b, l, g, rp), bf16, sharding))
  return Program(f"gated_norm_{impl}", fn, args, len(gated_norm.KERNEL_NAMES) if impl == "pallas" else 0)


def dot_program(recipe: str, shape, sharding, sr_bits: str | None = None) -> Program:
  """``fp4jax.dot`` forward and backward (y, dx, dw for a cotangent dy, all inputs): value_and_grad
  of the layer, with no constant cotangent for XLA to fold. ``sr_bits``: the recipe's ``Recipe.sr_bits``
  instead of its own."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  m, k, n = shape
  rec = fp4jax.recipes.get(recipe)
  if sr_bits is not None:
    rec = rec.replace(sr_bits=sr_bits)

  def fn(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=rec, key=key), x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    return y, dx, dw

  key = _with(sharding, jax.eval_shape(lambda: jax.random.key(0)))
  args = (_spec((m, k), jnp.bfloat16, sharding), _spec((k, n), jnp.bfloat16, sharding),
          _spec((m, n), jnp.bfloat16, sharding), key)
  return Program(f"dot_{recipe}" + (f"_sr_{sr_bits}" if sr_bits else ""), fn, args, 0)


KERNEL_OPS = (("quantize", "nvfp4"), ("quantize_sr", "nvfp4"), ("quantize_2d", "nvfp4"),
              ("quantize", "mxfp4"), ("quantize_sr", "mxfp4"), ("quantize_rht_t", "nvfp4"),
              ("quantize_rht_t_sr", "nvfp4"), ("quantize_rht_t", "mxfp4"),
              ("scaled_matmul", "nvfp4"), ("scaled_matmul", "mxfp4"), ("mixed_matmul", "nvfp4"),
              ("mixed_matmul", "mxfp4"), ("quantize_sr_packed", "nvfp4"), ("quantize_2d_sr_packed", "nvfp4"),
              ("quantize_rht_t_sr_packed", "nvfp4"))
XLA_OPS = tuple(o for o in KERNEL_OPS if o[0] != "mixed_matmul") + (("dequantize", "nvfp4"), ("dequantize", "mxfp4"))


def batch_programs(what: str, sharding, small: bool = True) -> list[Program]:
  """The batches the tests compile: ``kernels`` (every Pallas kernel), ``ops`` (every op's XLA
  composition), ``dots`` (every recipe preset's dot). Small shapes: compile time, not size, is tested."""
  import fp4jax   # pylint: disable=import-outside-toplevel
  mk = (256, 512) if small else (8192, 8192)
  mnk = (256, 256, 512) if small else (8192, 8192, 8192)
  if what == "kernels":
    return [op_program(op, mnk if op.endswith("_matmul") else mk, fmt, "pallas", sharding)
            for op, fmt in KERNEL_OPS]
  if what == "ops":
    return [op_program(op, mnk if op.endswith("_matmul") else mk, fmt, "xla", sharding)
            for op, fmt in XLA_OPS]
  if what == "dots":
    return [dot_program(r, (256, 512, 256) if small else (8192, 8192, 8192), sharding)
            for r in fp4jax.recipes.NAMES]
  raise ValueError(what)


def combined(name: str, progs: list[Program]) -> Program:
  """One program that runs all of ``progs`` (one XLA module, one compile; identical kernels are
  compiled once)."""
  def fn(*args):
    out, i = [], 0
    for p in progs:
      out.append(p.fn(*args[i:i + len(p.args)]))
      i += len(p.args)
    return out
  return Program(name, fn, tuple(a for p in progs for a in p.args), sum(p.kernels for p in progs))


# ------------------------------------------------------------------------------------ report

GiB, MiB = 2 ** 30, 2 ** 20


def summarize(res: dict, target: str, peak_kind: str = "derated", int_ops: bool = False,
              cluster: str = "") -> dict:
  """The compile result with the cost model applied (``cost``; ``ruler``: bench/predict/ruler.py's step, with the
  per-kernel floor, GEMM efficiencies and collectives on ``cluster``) and the HLO text dropped."""
  from bench.predict import hlo_cost   # pylint: disable=import-outside-toplevel
  from bench.predict import hlo_parts   # pylint: disable=import-outside-toplevel
  out = {k: v for k, v in res.items() if k != "text"}
  if res.get("error"):
    return out
  try:
    from bench.predict import ruler   # pylint: disable=import-outside-toplevel
    out["ruler"] = ruler.summary(ruler.predict(res["text"], target, cluster or f"hgx_{target}"))
  except Exception as e:   # pylint: disable=broad-except  (the roofline below still stands)
    out["ruler"] = dict(error=f"{type(e).__name__}: {e}")
  cost = hlo_cost.analyze(res["text"], peaks(target, peak_kind, int_ops))
  gemms = [o for o in cost["ops"] if o["kind"] == "gemm"]
  out["cost"] = dict(
      predicted_ms=cost["seconds"] * 1e3, gemm_ms=cost["gemm_seconds"] * 1e3,
      attention_ms=cost["attention_seconds"] * 1e3, attention_tflop=cost["attention_flops"] / 1e12,
      other_ms=cost["other_seconds"] * 1e3, gemm_tflop=cost["gemm_flops"] / 1e12,
      other_gib=cost["other_bytes"] / GiB, int_gops=cost["int_ops"] / 1e9, int_ops_charged=cost["int_ops_charged"],
      naive_gib=hlo_cost.naive_bytes(res["text"]) / GiB,
      counts=cost["counts"], collectives=cost["collectives"],
      collective_gib=cost["collective_bytes"] / GiB,
      # expert parallelism's dispatch and combine (a ragged all-to-all counts its worst-case output buffer)
      all_to_all_gib=sum(r["bytes_per_step"] for r in cost["collectives"]
                         if r["kind"] in ("all-to-all", "ragged-all-to-all")) / GiB,
      collective_ms_if_serial=(cost["collective_seconds"] or 0) * 1e3,
      gemms=[dict(name=o["name"], op_name=o["op_name"], dtype=o["dtype"], mnk=list(o["mnk"]),
                  count=o["count"], ms=o["seconds"] * 1e3, bound=o["bound"], bytes=o["bytes"],
                  flops=o["flops"], highest=o["highest"]) for o in gemms],
      by_label=[dict(label=lab, ms=s * 1e3, gib=b / GiB) for lab, s, b in hlo_parts.by_label(cost)],
      # each fp4jax primitive's passes over memory as a multiple of one copy of what they read
      passes=[dict(label=r["label"], calls=r["calls"], ms=r["ms"], gib=r["bytes"] / GiB,
                   read_gib=r["read_bytes"] / GiB, copy_ratio=r["copy_ratio"]) for r in hlo_parts.passes(cost)],
      # the step by the model's named parts (models.scopes) and phase, and in the issue-29 table's columns
      parts=hlo_parts.by_part(cost), columns=hlo_parts.columns(cost),
      # Pallas kernels that declare their FLOPs (the SSD's): charged by FLOPs and bytes
      flop_kernels=[dict(name=o["name"], op_name=o["op_name"], count=o["count"], ms=o["seconds"] * 1e3,
                         bound=o["bound"], bytes=o["bytes"], flops=o["flops"])
                    for o in cost["ops"] if o["kind"] == "kernel" and o["flops"]])
  return out


def report(s: dict, twin: dict | None = None) -> str:
  if s.get("error"):
    return f"{s['name']}: COMPILE FAILED after {s['seconds']:.1f} s: {s['error'][:600]}"
  m, c = s["memory"], s["cost"]
  lines = [f"{s['name']}: compiled in {s['compile_s']:.1f} s (lower {s['lower_s']:.1f} s), "
           f"peak host RSS {s['max_rss_bytes'] / GiB:.2f} GiB, Pallas kernels {s['kernels']}",
           f"  per device: arguments {m['argument_bytes'] / GiB:.3f} GiB, outputs "
           f"{m['output_bytes'] / GiB:.3f} GiB (aliased {m['alias_bytes'] / GiB:.3f}), temp "
           f"{m['temp_bytes'] / GiB:.3f} GiB",
           f"  launches per step: " + ", ".join(f"{k} {v}" for k, v in sorted(c["counts"].items())),
           f"  predicted {c['predicted_ms']:.3f} ms = GEMMs {c['gemm_ms']:.3f} ms ({c['gemm_tflop']:.2f} "
           f"TFLOP) + cuDNN attention {c['attention_ms']:.3f} ms ({c['attention_tflop']:.2f} TFLOP) + "
           f"other ops {c['other_ms']:.3f} ms ({c['other_gib']:.2f} GiB moved; a walk without "
           f"slice accounting: {c['naive_gib']:.2f} GiB)",
           f"  integer ops {c['int_gops']:.2f} G ({'charged' if c['int_ops_charged'] else 'not charged: --int_ops'})"]
  r = s.get("ruler") or {}
  if r.get("error"):
    lines.append(f"  ruler: failed: {r['error'][:300]}")
  elif r:
    lines.append(f"  ruler (bench/predict/ruler.py, a prediction): step {r['step_ms']:.1f} ms = compute {r['compute_ms']:.1f} "
                 f"(of which the per-kernel floor {r['floor_ms']:.1f}) + exposed communication "
                 f"{r['exposed_comm_ms']:.1f} (of {r['comm_ms']:.1f} on {r['cluster']}); {r['kernels']} kernels per step")
  if twin is not None and not twin.get("error"):
    lines.append(f"  bf16 twin {twin['cost']['predicted_ms']:.3f} ms: ratio "
                 f"{c['predicted_ms'] / twin['cost']['predicted_ms']:.3f}")
  if s.get("mfu"):
    active = s.get("active_params", s["params"])
    of_total = f" of {s['params'] / 1e9:.3f}e9" if active != s["params"] else ""
    lines.append(f"  MFU {100 * s['mfu']:.1f}% (6 x {active / 1e9:.3f}e9 active params{of_total} x "
                 f"{s['tokens_per_device']} tokens per device / (step x the datasheet bf16 peak))")
  k = c["columns"]
  lines.append("  columns (ms): linear-layer GEMMs {linear_gemm:.3f}, other GEMMs {other_gemm:.3f}, attention "
               "{attention:.3f}, SSD {ssd:.3f}, quantize passes {quantize:.3f}, other {other:.3f}".format(**k))
  if c["gemms"]:
    lines.append("  GEMMs (dtype, M x N x K, executions per step, ms per step, bound):")
    agg = {}
    for g in c["gemms"]:
      key = (g["dtype"], tuple(g["mnk"]), g["bound"])
      a = agg.setdefault(key, [0, 0.0])
      a[0] += g["count"]
      a[1] += g["ms"]
    for (dt, mnk, bound), (n, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:24]:
      lines.append(f"    {dt:<22}{' x '.join(map(str, mnk)):<24}{n:>6}{ms:>10.3f}  {bound}")
  lines.append("  other ops by what they belong to (ms, GiB per step):")
  for r in c["by_label"][:16]:
    lines.append(f"    {r['label']:<40}{r['ms']:>10.3f}{r['gib']:>10.3f}")
  lines.append("  by model part (models.scopes; ms per step: fwd, remat, bwd, total, of which GEMMs; GiB moved):")
  for r in c["parts"][:28]:
    lines.append(f"    {r['part'] or '(no op_name)':<34}{r['fwd']:>9.3f}{r['remat']:>9.3f}{r['bwd']:>9.3f}"
                 f"{r['ms']:>10.3f}{r['gemm_ms']:>10.3f}{r['gib']:>9.2f}")
  if c.get("passes"):
    lines.append("  fp4jax passes (calls, ms, GiB moved, GiB read from outside the call, moved / one copy "
                 "of what is read):")
    for r in c["passes"][:12]:
      lines.append(f"    {r['label']:<32}{r['calls']:>6}{r['ms']:>10.3f}{r['gib']:>10.3f}{r['read_gib']:>10.3f}"
                   f"{r['copy_ratio']:>8.2f}x")
  if c["collectives"]:
    lines.append(f"  collectives per device per step ({c['collective_gib']:.2f} GiB; "
                 f"{c['collective_ms_if_serial']:.2f} ms at one NVLink direction if not overlapped):")
    for r in c["collectives"]:
      lines.append(f"    {r['kind']:<20}{r['dtype']:<10}{r['count']:>6} ops{r['bytes_per_step'] / GiB:>10.3f} GiB")
    lines.append("    of which all-to-all (MoE dispatch and combine, or SPMD resharding): "
                 f"{c['all_to_all_gib']:.3f} GiB")
  return "\n".join(lines)


def check_budget(s: dict, time_s: float, rss_bytes: float) -> list[str]:
  """Why a compile result breaks the budget (empty: it does not)."""
  problems = []
  if s.get("error"):
    problems.append(f"{s['name']}: {s['error'][:1500]}")
    return problems
  if s["compile_s"] + s["lower_s"] > time_s:
    problems.append(f"{s['name']}: compile took {s['compile_s'] + s['lower_s']:.1f} s > {time_s} s")
  if s["max_rss_bytes"] > rss_bytes:
    problems.append(f"{s['name']}: host RSS {s['max_rss_bytes'] / GiB:.2f} GiB > {rss_bytes / GiB:.2f} GiB")
  if s["kernels"] < s.get("kernels_required", 0):
    problems.append(f"{s['name']}: {s['kernels']} Pallas kernels in the HLO, expected "
                    f">= {s['kernels_required']}")
  return problems


# ------------------------------------------------------------------------------------ CLI

def _flags():
  from absl import flags   # pylint: disable=import-outside-toplevel
  from bench import scale   # noqa: F401  (defines --config, --devices, --batch_per_device, --json, --hlo)
  flags.FLAGS.set_default("devices", 1)   # scale.py's flag; here: GPUs of the topology (--what step)
  flags.DEFINE_enum("target", "h200", TARGETS, "GPU target (bench/predict/gpu_targets/<target>.txtpb).")
  flags.DEFINE_string("what", "dot", "quantize | quantize_sr | quantize_2d | quantize_rht_t | "
                      "quantize_rht_t_sr | (quantize_sr | quantize_2d_sr | quantize_rht_t_sr)_packed | dequantize | "
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
  flags.DEFINE_enum("sr_bits", None, ("jax", "packed"), "--what dot: the recipe with this Recipe.sr_bits (the "
                    "layout of its stochastic-rounding bits; default: the preset's, 'packed').")
  flags.DEFINE_enum("peaks", "derated", ("derated", "spec"), "peak rates of the cost model.")
  flags.DEFINE_boolean("twin", True, "also compile the bf16 twin (dot, step) and print the ratio.")
  flags.DEFINE_boolean("small", True, "kernels/ops/dots at small shapes.")
  flags.DEFINE_list("combine", [], "batches among kernels,ops,dots to compile as one module each (one "
                    "compile; identical kernels compiled once); the others compile program by program.")
  flags.DEFINE_boolean("one_pass_rht_amax", False, "what-if: the RHT amax as one pass "
                       "(kernels.quantize_rht_t.rht_amax(one_pass=True)) where fp4jax.api takes it.")
  flags.DEFINE_list("what_if_proved", [], "what-if: these kernel ops (of fp4jax.dispatch.KERNEL_OPS, "
                    "or 'all') count as proved exact and faster on --target, as the on-device proof "
                    "(tools.prove) would record them, so --impl auto picks them (on b200 beside the native "
                    "GEMMs).")
  flags.DEFINE_boolean("int_ops", True, INT_OPS_HELP)
  flags.DEFINE_string("cluster", "", "the cluster that prices the step's collectives (bench/predict/cluster.py: hgx_h200, "
                      "hgx_b200, gb200_nvl72; default the HGX node of --target)")
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
    _assume_proved(F.what_if_proved)
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
      twin = _compiled(F, dot_program("bf16", shape, single))
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


def _assume_proved(ops: list[str]) -> None:
  """--what_if_proved: record ``ops`` in VERIFIED_KERNELS for every kernel format, as a device run
  that found them exact and faster would (the evidence says it is a what-if)."""
  from fp4jax import formats   # pylint: disable=import-outside-toplevel
  from fp4jax import dispatch   # pylint: disable=import-outside-toplevel
  ops = list(dispatch.KERNEL_OPS) if ops == ["all"] else ops
  unknown = sorted(set(ops) - set(dispatch.KERNEL_OPS))
  if unknown:
    raise ValueError(f"--what_if_proved: unknown kernel ops {unknown}; use some of {dispatch.KERNEL_OPS} or 'all'")
  what_if = dispatch.Evidence(date="what-if", device="--what_if_proved", jax_version="", speedup=float("nan"))
  for op in ops:
    for fmt in formats.KERNEL_FORMATS:
      dispatch.VERIFIED_KERNELS[(op, fmt)] = what_if


def _force_impl(impl: str) -> None:
  """--impl for dot and step: "auto" leaves every default to the target; the others force it."""
  if impl != "auto":
    os.environ["FP4JAX_DEFAULT_IMPL"] = impl


_HLO_WRITTEN: list[str] = []


def _compiled(F, prog, mesh=None) -> dict:
  """compile_program + summarize; --hlo keeps the first program's optimized HLO text."""
  res = compile_program(prog, mesh)
  if F.hlo and res.get("text") and not _HLO_WRITTEN:
    with open(F.hlo, "w", encoding="utf-8") as f:
      f.write(res["text"])
    _HLO_WRITTEN.append(F.hlo)
  return summarize(res, F.target, F.peaks, F.int_ops, F.cluster)


def _step(F, devices):
  import jax   # pylint: disable=import-outside-toplevel
  import numpy as np   # pylint: disable=import-outside-toplevel
  from bench import scale   # pylint: disable=import-outside-toplevel
  from models import moe   # pylint: disable=import-outside-toplevel
  from training import sharding   # pylint: disable=import-outside-toplevel
  config = F.config
  shape = sharding.mesh_shape(config.mesh, len(devices))
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(shape), sharding.MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(sharding.MESH_AXES))
  ranks = sharding.batch_ways(mesh)
  bpd = F.batch_per_device if F["batch_per_device"].present else max(1, config.batch_size // ranks)
  _force_impl(F.impl)

  def one(cfg, name):
    built = scale.build_step(cfg, mesh, bpd)
    prog = Program(name, built["step_fn"], (built["state_in"], built["tokens_in"]))
    out = _compiled(F, prog, mesh)
    out["compiler_options"] = built["compiler_options"]   # the config's xla_options for this target
    print(f"{name}: XLA compiler options {built['compiler_options'] or '(XLA defaults)'}", flush=True)
    if not out.get("error"):   # MFU = 6 · active params · tokens per device / (step · datasheet bf16 peak)
      out["params"] = sum(x.size for x in jax.tree.leaves(built["abstract"]["params"]))
      out["active_params"] = out["params"] - moe.inactive_params(built["model_config"])   # all but MoE's idle experts
      out["tokens_per_device"] = built["tokens_in"].shape[0] * cfg.data.seq_len // len(devices)
      out["mfu"] = (6 * out["active_params"] * out["tokens_per_device"]
                    / (out["cost"]["predicted_ms"] * 1e-3 * peaks(F.target, "spec")["flops"]["bf16"]))
    return out

  res = one(config, f"step {config.name} recipe {config.recipe} mesh {dict(mesh.shape)} "
            f"{bpd}x{config.data.seq_len} tokens/rank")
  twin = None
  if F.twin and config.recipe != "bf16":
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.recipe = "bf16"
    twin = one(cfg, f"step {config.name} recipe bf16 (twin)")
  print(report(res, twin))
  if twin is not None:
    print(report(twin))
  return [res], twin, mesh


flags_ = None

if __name__ == "__main__":
  from absl import app   # pylint: disable=import-outside-toplevel
  flags_ = _flags()
  app.run(lambda argv: sys.exit(main(argv)))
