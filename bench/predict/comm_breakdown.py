"""A compiled step's communication on the ruler, broken down: what each collective moves, over which links,
in which dtype, how often, and how much of it the schedule leaves exposed.

  python bench/predict/comm_breakdown.py --hlo step.hlo --json step.json --target b200 --cluster hgx_b200

(``--hlo`` and ``--json``: bench/predict/gpu_aot.py's outputs for one step; the JSON gives the mesh's device order,
``partition_devices``.) Every collective of the optimized HLO is priced and walked by bench/predict/ruler.py and
sorted by:

- **what it moves** (``purpose``, from its kind and the jax op it comes from; a collective XLA combined from
  several is classed by the op its metadata names): ``weights`` (an all-gather of parameters: values, FP4 /
  FP8 codes, scales), ``gradients`` (a reduce-scatter, or an all-reduce in the backward of a float dtype),
  ``experts`` (expert parallelism's dispatch and combine and their counts: ``models.expert_parallel``),
  ``statistics`` (a quantize's tensor amax over the shards, and the other all-reduces: losses, loads) and
  ``resharding`` (an all-to-all that moves an activation between layouts);
- **where**: inside one node (NVLink) or across nodes (the network);
- **how often**: ``per micro-batch`` (issued inside the train step's loop over micro-batches, the scan of
  ``training.step.accumulate_gradients``, or from its ops where XLA peeled a micro-batch out of the loop) or
  ``per step``;
- **the schedule's share**: a computation (the step, a loop body) whose collectives take ``comm`` and whose
  kernels take ``compute`` cannot hide more than ``min(comm, compute)`` on one compute and one communication
  stream, so at least ``max(0, comm - compute)`` of it is exposed whatever the order; what is exposed beyond
  that is what a better schedule of the same program could hide (a bound: dependencies may forbid it).
"""
from __future__ import annotations

import collections
import os
import re
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# pylint: disable=wrong-import-position
from bench.predict import hlo_text
from bench.predict import hlo_walk
from bench.predict import ruler

GiB = 2 ** 30
# training.step: the scan over micro-batches, in its named scope (inside the shard_map of the gradients reduced
# once per step, config.mesh.grad_reduce "per_step", one level deeper)
MICRO_BATCH_LOOP = re.compile(r"forward_backward/(?:shard_map/)?while")


def purpose(c: dict) -> str:
  """What a collective (a ruler ``each_collective`` row) moves: module docstring."""
  kind, op, floats = c["kind"], c["op_name"], any(d in c["dtype"] for d in ("f32", "bf16", "f16"))
  if kind == "ragged-all-to-all" or "moe_experts/shard_map/all_" in op:
    return "experts"
  if "quantize/reduce" in op or "reduce_max" in op:   # a tensor amax (its int32 bits) over the shards
    return "statistics"
  if kind == "all-to-all":
    return "experts" if "moe_experts" in op else "resharding"
  if kind == "reduce-scatter" or (kind == "all-reduce" and floats and "transpose(" in op
                                  and "reduce_max" not in op):
    return "gradients"
  if kind == "all-gather":
    return "weights"
  return "statistics"


def _in_micro_batch(op_name: str) -> bool:
  return any(op_name.startswith("/body", m.end()) for m in MICRO_BATCH_LOOP.finditer(op_name))


def micro_batch_computations(mod: hlo_walk.Module) -> set[str]:
  """The computations the loop over micro-batches runs (its body and everything called from it); empty
  when the step has one micro-batch (no such loop). The loop is the entry's while named by the scan's scope,
  or, where XLA rewrote it (the collective pipeliner's copy has no name), whose body runs the scope's ops."""
  def is_loop(i):
    return i.opcode == "while" and (MICRO_BATCH_LOOP.search(i.op_name) or any(
        _in_micro_batch(j.op_name) for j in mod.comps.get(i.attr("body"), [])))
  loops = [i for i in mod.comps.get(mod.entry, []) if is_loop(i)]
  inside, todo = set(), [i.attr("body") for i in loops] + [i.attr("condition") for i in loops]
  while todo:
    comp = todo.pop()
    if comp in inside or comp not in mod.comps:
      continue
    inside.add(comp)
    for ins in mod.comps[comp]:
      todo += [n for key in ("body", "condition", "to_apply", "calls") if (n := ins.attr(key))]
      branches = hlo_text.OPERAND.findall(ins.attrs.split("branch_computations={", 1)[1].split("}", 1)[0]) \
          if "branch_computations={" in ins.attrs else []
      todo += branches
  return inside


def breakdown(text: str, target: str, cluster_name: str, partition_devices=None) -> dict:
  """The ruler's prediction of a compiled step (``ruler.predict``) with ``rows``: every collective with its
  ``purpose``, ``crosses_nodes`` and ``per_micro_batch``, and ``schedule``: per computation that issues
  collectives, its ``compute_s`` (its loops' included) and ``comm_s`` per step, the ``exposed_s`` and the
  ``floor_s`` no order of it avoids (module docstring)."""
  p = ruler.predict(text, target, cluster_name, partition_devices=partition_devices)
  mod = hlo_walk.Module(text)
  inside = micro_batch_computations(mod)
  rows = [dict(c, purpose=purpose(c), crosses_nodes=c["nodes"] > 1,
               per_micro_batch=c["computation"] in inside or _in_micro_batch(c["op_name"]))
          for c in p["each_collective"]]
  schedule = collections.defaultdict(lambda: dict(compute_s=0.0, comm_s=0.0, exposed_s=0.0))
  for r in rows:
    s = schedule[r["computation"]]
    s["comm_s"] += r["seconds"] * r["count"]
    s["exposed_s"] += r["exposed_s"]
  own = p["compute_by_computation"]
  for comp, s in schedule.items():
    s["compute_s"] = _compute_with_loops(mod, own, comp) * p["executions"].get(comp, 1)
    s["floor_s"] = max(0.0, s["comm_s"] - s["compute_s"])
  return dict(p, rows=rows, schedule=dict(schedule))


def _compute_with_loops(mod: hlo_walk.Module, own: dict, comp: str, depth: int = 0) -> float:
  """One execution of ``comp``'s kernels, those of the loops and calls it runs included (their trips)."""
  total = own.get(comp, 0.0)
  for ins in mod.comps.get(comp, []) if depth < 64 else []:
    if ins.opcode == "while":
      total += mod.trip_count(ins) * _compute_with_loops(mod, own, ins.attr("body"), depth + 1)
    elif ins.opcode == "call":
      total += _compute_with_loops(mod, own, ins.attr("to_apply"), depth + 1)
  return total


def table(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
  """``rows`` summed by ``keys``: ops per step, GiB per step, ms on the link and ms exposed; most exposed
  first."""
  out = collections.defaultdict(lambda: dict(ops=0, gib=0.0, comm_ms=0.0, exposed_ms=0.0))
  for r in rows:
    o = out[tuple(r[k] for k in keys)]
    o["ops"] += r["count"]
    o["gib"] += r["buffer_bytes"] * r["count"] / GiB
    o["comm_ms"] += r["seconds"] * r["count"] * 1e3
    o["exposed_ms"] += r["exposed_s"] * 1e3
  return [dict(zip(keys, k), **v) for k, v in sorted(out.items(), key=lambda kv: -kv[1]["exposed_ms"])]


def report(b: dict) -> str:
  """Markdown: the step, then the tables by what / where / how often, by kind and dtype, and the schedule's
  share."""
  where = lambda r: "across nodes" if r["crosses_nodes"] else "in a node"
  often = lambda r: "per micro-batch" if r["per_micro_batch"] else "per step"
  rows = [dict(r, where=where(r), often=often(r)) for r in b["rows"]]
  sched = b["schedule"].values()
  floor = sum(s["floor_s"] for s in sched)
  lines = [f"step {b['step_s'] * 1e3:,.1f} ms = compute {b['compute_s'] * 1e3:,.1f} ms + exposed communication "
           f"{b['exposed_comm_s'] * 1e3:,.1f} ms (of {b['comm_s'] * 1e3:,.1f} ms on the links); of the exposed, "
           f"{floor * 1e3:,.1f} ms is more communication than its computation has compute to hide it behind, "
           f"{(b['exposed_comm_s'] - floor) * 1e3:,.1f} ms the schedule could hide", ""]
  for keys in (("purpose", "where", "often"), ("kind", "dtype", "where")):
    lines.append("| " + " | ".join(keys) + " | ops/step | GiB/step | ms on the link | ms exposed |")
    lines.append("|" + "---|" * (len(keys) + 4))
    for t in table(rows, keys):
      if t["comm_ms"] < 0.05 and t["exposed_ms"] < 0.05:
        continue
      lines.append("| " + " | ".join(str(t[k]) for k in keys)
                   + f" | {t['ops']:,} | {t['gib']:,.1f} | {t['comm_ms']:,.1f} | {t['exposed_ms']:,.1f} |")
    lines.append("")
  lines.append("| computation | executions/step | compute ms | comm ms | exposed ms | exposed whatever the order |")
  lines.append("|---|---|---|---|---|---|")
  for comp, s in sorted(b["schedule"].items(), key=lambda kv: -kv[1]["exposed_s"]):
    if s["exposed_s"] * 1e3 < 0.05:
      continue
    lines.append(f"| {comp} | {b['executions'].get(comp, 1):,} | {s['compute_s'] * 1e3:,.1f} | "
                 f"{s['comm_s'] * 1e3:,.1f} | {s['exposed_s'] * 1e3:,.1f} | {s['floor_s'] * 1e3:,.1f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  import argparse   # pylint: disable=import-outside-toplevel
  import json   # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--hlo", required=True, help="the optimized HLO text (bench/predict/gpu_aot.py --hlo)")
  parser.add_argument("--json", help="bench/predict/gpu_aot.py --json of the same compile: the mesh's device order")
  parser.add_argument("--target", default="b200")
  parser.add_argument("--cluster", default="hgx_b200", help="bench/predict/cluster.py's CLUSTERS key")
  args = parser.parse_args(argv)
  devices = None
  if args.json:
    with open(args.json, encoding="utf-8") as f:
      devices = json.load(f)["results"][0].get("partition_devices")
  with open(args.hlo, encoding="utf-8") as f:
    text = f.read()
  print(report(breakdown(text, args.target, args.cluster, devices)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
