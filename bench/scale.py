"""Ahead-of-time memory and communication of the real train step on a simulated mesh (nothing allocated).

  python bench/scale.py --config configs/nemotron_h_12b.py --devices 64
  python bench/scale.py --config configs/nemotron_h_12b.py --devices 8 --config.model.pattern='M*-' \
      --mesh.fsdp=8 --json /tmp/slice.json
  python bench/scale.py --config configs/tiny.py --devices 8 --batch_per_device 2

``--devices N`` runs on N CPU devices (``--xla_force_host_platform_device_count``, set before JAX is imported).
The step is ``training.step.jit_train_step`` with the shardings of ``training.sharding.train_state_shardings``:
the trainer's own function and placement. The state and the batch are ``jax.ShapeDtypeStruct``s, so any model
size compiles. The global batch is ``config.micro_batches`` x ``--batch_per_device`` x (data x fsdp x expert)
sequences of ``config.data.seq_len``: ``--batch_per_device`` sequences per rank in each micro-batch.
``--mesh.<axis>=k`` is short for ``--config.mesh.<axis>=k``; any ``--config.<field>=<value>`` override works.

Printed (and written by ``--json``): per-device argument / output / alias / temp bytes from XLA's memory
analysis of the compiled executable; wall and CPU seconds of lowering and compiling (CPU seconds are less
sensitive to other jobs on a shared machine); the collectives by kind and dtype with their count and output
bytes per device, once as the program has them right after SPMD partitioning and once as compiled for the
CPU, where ops in a loop body also count times the loop's trip count (MiB/step). ``all-reduce+slice`` is an
all-reduce whose result each device slices to its shard: a reduce-scatter on GPU, which the CPU compiler
does not form. The CPU compiler's buffer assignment approximates a GPU's; ``--cpu_passes`` below says which
CPU-only passes are switched off so that it does. FP4JAX_SCALE_DUMP=dir keeps XLA's dump (buffer
assignment, live ranges at the peak) in dir, and then also prints the buffers live at the memory peak summed
by block (``peak_breakdown``: each block's backward pass and its remat recomputation apart).
"""
from __future__ import annotations

import os
import sys
import tempfile


def _early_devices(argv) -> int:
  """``--devices N`` from the command line, read before JAX is imported (XLA reads its flags once)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--devices="):
      return int(arg.split("=", 1)[1])
    if arg == "--devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 8


def _mesh_aliases(argv) -> list[str]:
  """``--mesh.fsdp=8`` -> ``--config.mesh.fsdp=8``."""
  return [f"--config.{a[2:]}" if a.startswith("--mesh.") else a for a in argv]


# FP4JAX_SCALE_DUMP=dir keeps the dump (with XLA's buffer assignment: which buffers make up temp).
KEEP_DUMP = bool(os.environ.get("FP4JAX_SCALE_DUMP"))
DUMP_DIR = os.environ.get("FP4JAX_SCALE_DUMP") or os.path.join(tempfile.gettempdir(), f"fp4jax_scale_dump_{os.getpid()}")

if __name__ == "__main__":
  sys.argv = _mesh_aliases(sys.argv)
  # The partitioned program is dumped once, right after SPMD partitioning: its collectives carry the
  # program's dtypes (the CPU backend later widens bf16 collectives to float32, which a GPU does not).
  # Two CPU-backend passes that would make the simulation unlike a GPU, off unless --cpu_passes:
  # - cse_barrier_expander drops the optimization barriers jax.checkpoint puts on the inputs of the
  #   recomputation, after which CSE merges the recomputation with the forward pass: remat is undone
  #   and every block's activations stay live (a 6-block toy: 832 MiB with or without checkpoint).
  # - the concurrency-optimized scheduler trades memory for parallelism; a GPU schedules to a memory
  #   limit, so the CPU's memory-minimizing scheduler is used instead.
  cpu_passes = any(a in ("--cpu_passes", "--cpu_passes=true") for a in sys.argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={_early_devices(sys.argv)}"
                             + f" --xla_cpu_enable_concurrency_optimized_scheduler={str(cpu_passes).lower()}"
                             + ("" if cpu_passes else " --xla_disable_hlo_passes=cse_barrier_expander")
                             + f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_pass_re=spmd-partitioning"
                             + " --xla_dump_hlo_module_re=.*train_step.*").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import collections
import json
import re
import shutil
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from ml_collections import config_flags

import fp4jax
from training import config as config_lib
from training import optim
from training import sharding
from training import step as step_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py).", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated host devices (read before JAX starts).")
_BATCH = flags.DEFINE_integer("batch_per_device", 1, "Sequences per data-parallel rank (data x fsdp x expert) in "
                               "each of the step's config.micro_batches micro-batches.")
_CPU_PASSES = flags.DEFINE_boolean(
    "cpu_passes", False, "Keep the CPU backend's barrier expansion (undoes remat) and concurrency-optimized "
    "scheduler (read before JAX starts); by default both are off, closer to a GPU compile.")
_JSON = flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
_HLO = flags.DEFINE_string("hlo", None, "Also write the compiled HLO text to this file.")
_PARTITIONED = flags.DEFINE_string("partitioned_hlo", None, "Also write the HLO after SPMD partitioning here.")

GiB = 2 ** 30
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
ALL_TO_ALL = ("all-to-all", "ragged-all-to-all")   # expert parallelism's dispatch and combine (and counts)
_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8,
         "f8e8m0fnu": 8, "f8e4m3": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32,
         "u32": 32, "f64": 64, "s64": 64, "u64": 64, "c64": 64, "c128": 128}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                          r"(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+.*\{\s*$")   # unindented: a computation header
_BODY = re.compile(r"body=%?([\w.\-]+)")
_SLICED = re.compile(r"dynamic-slice\((?:[a-z]\w*\[[\d,]*\]\S*\s)?%([\w.\-]+)")   # an all-reduce whose result is sliced
_COND = re.compile(r"condition=%?([\w.\-]+)")
_INT_CONSTANT = re.compile(r"s32\[\] constant\((\d+)\)")
_TRIPS = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _array_bytes(dtype: str, dims: str) -> int:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n * _BITS.get(dtype, 32) // 8


def all_to_all_bytes(rows: list[dict] | None) -> int | None:
  """Bytes per step per device of the all-to-alls (expert parallelism: tokens out to the experts and back,
  forward and backward, and the pair counts): the sum of their ``collectives`` rows. A ragged all-to-all
  counts its output buffer (the worst-case receive capacity, models.expert_parallel), not the rows that a
  given routing moves; the CPU's dense twin moves its whole capacity."""
  if rows is None:
    return None
  return sum(r["bytes_per_step"] for r in rows if r["kind"] in ALL_TO_ALL)


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """``{computation name: its instruction lines}``."""
  comps, name = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def _trip_counts(hlo_text: str, comps: dict[str, list[str]]) -> dict[str, int]:
  """``{while body computation: iterations}``: XLA's known_trip_count when annotated (optimized HLO), else
  the one integer constant of the loop condition (a scan's ``i < N``); 1 when neither is found."""
  trips = {}
  for line in hlo_text.splitlines():
    body = _BODY.search(line)
    if not (body and " while(" in line):
      continue
    known = _TRIPS.search(line)
    cond = _COND.search(line)
    constants = set(_INT_CONSTANT.findall("\n".join(comps.get(cond.group(1), [])))) if cond else set()
    trips[body.group(1)] = int(known.group(1)) if known else int(constants.pop()) if len(constants) == 1 else 1
  return trips


def collectives(hlo_text: str) -> list[dict]:
  """``[{kind, dtype, in_loop, count, bytes, bytes_per_step}]`` of the collectives in compiled HLO text,
  one row per (kind, dtype, in_loop). Kind ``all-reduce+slice``: an all-reduce whose result feeds a
  dynamic-slice, each device keeping its shard (the GPU compiler rewrites it into a reduce-scatter; the
  CPU compiler keeps it); its bytes are the all-reduce's. bytes: output bytes per device of each op counted once (the gathered
  tensor for an all-gather, the scattered shard for a reduce-scatter); bytes_per_step multiplies ops in a
  loop body by its trip count (one level of nesting). An async ``-start`` counts its result (the last
  array of its tuple)."""
  comps = _computations(hlo_text)
  trips = _trip_counts(hlo_text, comps)
  sliced = set(_SLICED.findall(hlo_text))
  rows = collections.defaultdict(lambda: [0, 0, 0])
  for computation, lines in comps.items():
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      name, shape, kind, is_start = match.groups()
      if kind == "all-reduce" and name in sliced:
        kind = "all-reduce+slice"
      arrays = _ARRAY.findall(shape)
      if is_start:
        arrays = arrays[-1:]
      for dtype, dims in arrays:
        row = rows[(kind, dtype, computation in trips)]
        row[0] += 1
        row[1] += _array_bytes(dtype, dims)
        row[2] += _array_bytes(dtype, dims) * trips.get(computation, 1)
  return [dict(kind=k, dtype=d, in_loop=loop, count=c, bytes=b, bytes_per_step=t)
          for (k, d, loop), (c, b, t) in sorted(rows.items())]


_LEAF = re.compile(r"── (.+?) \(\d[\d.]*%, total: [\d ]+ bytes, current: ([\d ]+) bytes")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OPERAND = re.compile(r"\(\S*? ?%([\w.\-]+)")
_BLOCK = re.compile(r"(rematted_computation/)?(blocks_\d+)/")


def _op_names(hlo_text: str):
  """``name -> op_name`` for the instructions of compiled HLO text: an instruction's own metadata, else its
  fused computation's last op_name, else (a copy, a get-tuple-element) its first operand's."""
  comps = _computations(hlo_text)
  last_in_comp = {c: next((m.group(1) for m in map(_OP_NAME.search, reversed(lines)) if m), None)
                  for c, lines in comps.items()}
  lines = {}
  for body in comps.values():
    for line in body:
      d = _DEFINITION.match(line)
      if d:
        lines[d.group(1)] = d.group(2)

  def resolve(name, depth=0):
    line = lines.get(name)
    if line is None or depth > 4:
      return name
    for pattern, get in ((_OP_NAME, lambda m: m.group(1)), (_CALLS, lambda m: last_in_comp.get(m.group(1))),
                         (_OPERAND, lambda m: resolve(m.group(1), depth + 1))):
      m = pattern.search(line)
      if m and get(m):
        return get(m)
    return name
  return resolve


def peak_breakdown(live_range_text: str, hlo_text: str) -> list[tuple[str, int]]:
  """The buffers live at XLA's memory peak (the "Stack trace breakdown for peak usage" tree of the dump's
  ``*-live-range.txt``), summed by what they belong to, read from the op_name of the instruction that defines
  each buffer and of the tree nodes above it: ``arguments``; ``stochastic-rounding bits`` (threefry and its
  counters); ``blocks_<i>`` (that block's backward pass) or ``blocks_<i> recomputed`` (its remat
  recomputation); ``saved inputs of scanned blocks`` (the forward scan's stacked outputs); ``other``.
  ``[(label, bytes)]``, largest first."""
  start = live_range_text.find("Stack trace breakdown for peak usage")
  if start < 0:
    return []
  op_name = _op_names(hlo_text)
  totals, path = collections.Counter(), []
  for line in live_range_text[start:].splitlines()[1:]:
    leaf = _LEAF.search(line)
    if not leaf:
      continue
    depth = line.index("── ") // 4 - 1   # the tree's root line (the entry computation) has no "── "
    name, live = leaf.group(1), int(leaf.group(2).replace(" ", ""))
    full = name if "/" in name else op_name(name)
    del path[depth:]
    path.append(full)
    if not live:
      continue
    context = "\n".join(path)
    block = _BLOCK.search(full)
    if name.startswith(("state", "tokens")):
      totals["arguments"] += live
    elif re.search(r"random_bits|threefry|iota_2x32|quantize(_rht_t)?/while", context):
      totals["stochastic-rounding bits"] += live
    elif block:
      totals[block.group(2) + (" recomputed" if block.group(1) else "")] += live
    elif re.search(r"jvp\(LanguageModel\)/while(\{\d+\})?$", full):
      totals["saved inputs of scanned blocks"] += live
    else:
      totals["other"] += live
  return totals.most_common()


def build_step(config, mesh, batch_per_device: int = 1) -> dict:
  """The trainer's jitted train step for ``config`` on ``mesh`` and abstract inputs with their shardings:
  ``{step_fn, state_in, tokens_in, batch_in, abstract, model_config, recipe}``: the step's batch is
  ``config.micro_batches`` micro-batches of ``batch_per_device`` sequences per rank; ``batch_in`` is what the step
  takes: ``tokens_in``, or with ``config.data.document_masking`` the tokens and their segment ids. Shared with
  bench/predict/gpu_aot.py, which passes a mesh of GPU-topology devices."""
  model_config = config_lib.resolve_model_config(config.model)
  recipe, _, _ = config_lib.resolve_recipes(config)
  ranks = sharding.batch_ways(mesh)
  seq_len = config.data.seq_len
  model = step_lib.build_model(model_config, recipe)
  tx, schedule = optim.make_optimizer(config.optim, config.steps)
  with sharding.mesh_context(mesh):
    abstract_boxed = jax.eval_shape(lambda: step_lib.init_state(model, tx, config.seed, seq_len))
  abstract, state_sh = sharding.train_state_shardings(abstract_boxed, tx, mesh)
  state_in = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)
  micro = config.micro_batches
  tokens_in = jax.ShapeDtypeStruct((micro * batch_per_device * ranks, seq_len + 1), jnp.int32,
                                   sharding=sharding.batch_sharding(mesh))
  batch_in = ({"tokens": tokens_in, "segment_ids": tokens_in} if config.data.get("document_masking", False)
              else tokens_in)
  options = config_lib.xla_options(config, fp4jax.target.Target.of(mesh).device_kind)
  step_fn = step_lib.jit_train_step(model, tx, schedule, state_sh, mesh, compiler_options=options, micro_batches=micro,
                                    fsdp_gather=config.mesh.get("fsdp_gather", "per_layer"),
                                    grad_reduce=config.mesh.get("grad_reduce", "per_micro_batch"))
  return dict(step_fn=step_fn, state_in=state_in, tokens_in=tokens_in, batch_in=batch_in, abstract=abstract,
              model_config=model_config, recipe=recipe, compiler_options=options)


def measure(config, batch_per_device: int = 1, hlo_path: str | None = None,
            partitioned_path: str | None = None) -> dict:
  """Lowers and compiles the train step of ``config`` on the current devices; returns the numbers."""
  mesh = sharding.make_mesh(config.mesh)
  built = build_step(config, mesh, batch_per_device)
  step_fn, state_in, batch_in = built["step_fn"], built["state_in"], built["batch_in"]
  model_config, recipe, abstract = built["model_config"], built["recipe"], built["abstract"]
  seq_len = config.data.seq_len
  with sharding.mesh_context(mesh):
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step_fn.lower(state_in, batch_in)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(hlo)
  partitioned = _partitioned_hlo()
  if partitioned and partitioned_path:
    with open(partitioned_path, "w", encoding="utf-8") as f:
      f.write(partitioned)
  n_params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
  return dict(
      config=config.name, preset=config.model.preset, pattern=model_config.pattern,
      n_blocks=model_config.n_blocks, d_model=model_config.d_model, recipe=recipe.name,
      remat=model_config.remat, scan_blocks=model_config.scan_blocks, params=int(n_params),
      devices=jax.device_count(), mesh=dict(mesh.shape), xla_flags=os.environ.get("XLA_FLAGS", ""),
      batch_per_device=batch_per_device, seq_len=seq_len,
      argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
      lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2), lower_cpu_s=round(c1 - c0, 2),
      compile_cpu_s=round(c2 - c1, 2),
      collectives=collectives(partitioned) if partitioned else None, compiled_collectives=collectives(hlo),
      all_to_all_bytes_per_step=all_to_all_bytes(collectives(partitioned) if partitioned else None),
      compiled_all_to_all_bytes_per_step=all_to_all_bytes(collectives(hlo)))


def _partitioned_hlo() -> str | None:
  """The train step's HLO right after SPMD partitioning (from the dump bench/scale.py asks XLA for), or
  None when run without the dump (imported rather than run as a script). Deletes the dump."""
  if not os.path.isdir(DUMP_DIR):
    return None
  names = sorted(n for n in os.listdir(DUMP_DIR) if "train_step" in n and "after_spmd-partitioning" in n)
  text = None
  if names:
    with open(os.path.join(DUMP_DIR, names[-1]), encoding="utf-8") as f:
      text = f.read()
  if not KEEP_DUMP:
    shutil.rmtree(DUMP_DIR, ignore_errors=True)
  return text


def _print_peak():
  """The live buffers at the peak by block (FP4JAX_SCALE_DUMP kept the dump)."""
  names = sorted(os.listdir(DUMP_DIR))
  live = [n for n in names if "train_step" in n and n.endswith("cpu_after_optimizations-live-range.txt")]
  hlo = [n for n in names if "train_step" in n and n.endswith("cpu_after_optimizations.txt")]
  if not (live and hlo):
    return
  with open(os.path.join(DUMP_DIR, live[-1]), encoding="utf-8") as f_live, \
       open(os.path.join(DUMP_DIR, hlo[-1]), encoding="utf-8") as f_hlo:
    rows = peak_breakdown(f_live.read(), f_hlo.read())
  print(f"live at the peak (XLA's buffer assignment, {sum(b for _, b in rows) / GiB:.2f} GiB; by op_name):")
  for label, nbytes in rows:
    print(f"  {nbytes / GiB:8.2f} GiB  {label}")


def report(r: dict) -> str:
  lines = [f"{r['config']}: {r['preset']} '{r['pattern']}' ({r['n_blocks']} blocks, d_model {r['d_model']}, "
           f"{r['params'] / 1e9:.3f}B params), recipe {r['recipe']}, remat {r['remat']}",
           f"devices {r['devices']} mesh {r['mesh']}, {r['batch_per_device']} x {r['seq_len']} tokens per rank",
           f"per device: arguments {r['argument_bytes'] / GiB:.3f} GiB, outputs {r['output_bytes'] / GiB:.3f} GiB "
           f"(aliased {r['alias_bytes'] / GiB:.3f}), temp {r['temp_bytes'] / GiB:.3f} GiB",
           f"lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s (CPU time of this process, all threads: "
           f"lower {r['lower_cpu_s']:.1f} s, compile {r['compile_cpu_s']:.1f} s)",
           "collectives per device (ops in the HLO; loop: inside a loop body, MiB/step x its trip count):"]
  tables = [("partitioned program (the program's dtypes)", r["collectives"]),
            ("compiled for CPU (bf16 collectives widened to f32; all-reduce + dynamic-slice where a GPU "
             "forms reduce-scatter)", r["compiled_collectives"])]
  for title, rows in tables:
    if rows is None:
      continue
    lines += [f"  {title}:", f"    {'kind':<20}{'dtype':<10}{'loop':<6}{'ops':>6}{'MiB (once)':>12}{'MiB/step':>12}"]
    for c in rows:
      lines.append(f"    {c['kind']:<20}{c['dtype']:<10}{'yes' if c['in_loop'] else '':<6}{c['count']:>6}"
                   f"{c['bytes'] / 2 ** 20:>12.1f}{c['bytes_per_step'] / 2 ** 20:>12.1f}")
  a2a = [f"{title} {r[key] / 2 ** 20:.1f} MiB" for title, key in
         (("partitioned", "all_to_all_bytes_per_step"), ("compiled", "compiled_all_to_all_bytes_per_step"))
         if r.get(key) is not None]
  lines.append(f"all-to-all (MoE dispatch and combine, or SPMD resharding) per device per step: {', '.join(a2a)}")
  return "\n".join(lines)


def main(argv):
  del argv
  if jax.device_count() != _DEVICES.value:
    raise SystemExit(f"JAX sees {jax.device_count()} devices, not --devices={_DEVICES.value}; run bench/scale.py "
                     "as a script (it sets XLA_FLAGS before JAX starts)")
  try:
    result = measure(_CONFIG.value, _BATCH.value, _HLO.value, _PARTITIONED.value)
  finally:   # a failed compile leaves XLA's dump behind
    if not KEEP_DUMP:
      shutil.rmtree(DUMP_DIR, ignore_errors=True)
  print(report(result))
  if KEEP_DUMP:
    _print_peak()
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
