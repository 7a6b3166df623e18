"""The ruler: a train step's predicted time on a GPU cluster, from its compiled (scheduled) HLO text.

  step = ruler.predict(compiled.as_text(), "b200", "hgx_b200")
  step["step_s"], step["exposed_comm_s"], step["kernels"]

On top of bench/predict/hlo_cost.py's per-op roofline (bytes at the derated HBM bandwidth, integer work at the
derated integer rate, always), four charges a GPU pays:

1. **A floor per kernel.** Every kernel launch adds ``KERNEL_FLOOR_S`` = 1 us, XLA's own GPU performance
   model constant (``GpuPerformanceModelBase::kKernelLaunchOverhead``,
   xla/service/gpu/model/gpu_performance_model_base.h; its NCCL kernels: ``kNcclKernelLaunchOverhead`` 5 us,
   charged here in each collective's latency, bench/predict/cluster.py). XLA's command buffers capture runs of
   kernels into CUDA graphs, which removes the host's launch cost but not the device's per-kernel gap;
   they are formed from thunks after the HLO is final, so the compiled text does not show them, and the
   floor is charged to every kernel alike. Kernels per step are reported beside the time.
2. **GEMMs at measured rates** by shape and dtype (bench/predict/gemm_rates.py), not a flat 80% of peak; cuDNN
   attention at the bf16 rows' largest-shape rate.
3. **Collectives on a cluster** (bench/predict/cluster.py): replica groups mapped onto NVLink or the network,
   NCCL's ring traffic factors, a latency per operation.
4. **Overlap from the schedule.** The compiled module is scheduled: each computation's instructions are
   in issue order. Walking it with one compute stream and one communication stream, an async collective
   (``*-start`` .. ``*-done``, or ``async-start`` wrapping one) starts when issued (after the link is free
   of earlier collectives) and hides behind the work issued before its done; at the done the compute
   stream waits for whatever is left, which is the exposed communication. A synchronous collective is
   exposed whole. A while body is walked twice (a collective started at the end of one iteration and
   finished in the next, as XLA's pipeliner arranges, is then seen) and its second pass, the steady
   state, is charged per trip. Not modelled: collectives inside a loop contending with ones outside it,
   and a collective still in flight when its loop exits (counted as hidden).
"""
from __future__ import annotations

import collections
import dataclasses
import re

from bench.predict import cluster as cluster_lib
from bench.predict import gemm_rates
from bench.predict import peaks as peak_rates
from bench.predict import hlo_cost
from bench.predict import hlo_text
from bench.predict import hlo_walk

KERNEL_FLOOR_S = 1e-6
_ASYNC_DONE = ("all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "send-done",
               "recv-done", "copy-done", "all-to-all-done", "reduce-scatter-done", "ragged-all-to-all-done")


def peaks(target: str) -> dict:
  """bench/predict/gpu_aot.py's derated rates with the integer rate (integer work is always charged)."""
  return peak_rates.peaks(target, "derated", int_ops=True)


def spec_peaks(target: str) -> dict:
  return peak_rates.peaks(target, "spec")


@dataclasses.dataclass
class Collective:
  name: str
  kind: str
  buffer_bytes: int
  group_size: int
  nodes: int
  seconds: float          # one execution
  count: int = 0          # executions per step
  dtype: str = ""         # of the buffer it moves (several joined by "+")
  op_name: str = ""       # the jax op it comes from (the HLO's metadata)
  computation: str = ""   # where it is issued (the entry, a loop body)


def _inner_collective(mod: hlo_walk.Module, ins: hlo_text.Instr):
  """The collective an ``async-start`` wraps (its called computation's), or None."""
  for i in mod.comps.get(ins.attr("calls") or "", []):
    kind = hlo_text.collective(i)
    if kind is not None:
      return i
  return None


def buffer_bytes(mod: hlo_walk.Module, ins: hlo_text.Instr, kind: str, group_size: int) -> int:
  """The full buffer a collective moves per GPU (bench/predict/cluster.py's ``S``): an all-gather's gathered
  output, a reduce-scatter's input (its output x the group), an all-reduce's or all-to-all's buffer, a ragged
  all-to-all's smaller buffer (``_ragged_bytes``), a permute's send. An ``all-gather-start`` or
  ``reduce-scatter-start`` counts its results (the second half of its (operands, results) tuple: XLA combines
  small ones into one), a ``collective-permute-start`` its operand, an ``all-reduce-start`` its result."""
  if kind == "ragged-all-to-all":
    return _ragged_bytes(mod, ins)
  out = sum(hlo_text.nbytes(f"{d}[{','.join(map(str, dims))}]") for d, dims in _moved(ins))
  if kind == "reduce-scatter":
    return out * group_size
  return out


def _moved(ins: hlo_text.Instr) -> list:
  """The arrays a collective's size is counted from: its results (of an ``all-gather-start``,
  ``reduce-scatter-start`` or ``all-to-all-start``, the second half of its (operands, results) tuple; of a
  ``collective-permute-start``, its operand)."""
  shapes = hlo_text.arrays(ins.shape)
  if ins.opcode in ("all-gather-start", "reduce-scatter-start", "all-to-all-start"):
    return shapes[len(shapes) // 2:]          # ((operands...), (results...)): XLA combines small ones
  if ins.opcode == "collective-permute-start":   # (operand, result, contexts...)
    return shapes[:1]
  return shapes


def _ragged_bytes(mod: hlo_walk.Module, ins: hlo_text.Instr) -> int:
  """A ragged all-to-all's ``S``: the smaller of its send buffer (operand 0) and its receive buffer (operand
  1, the shape of its result). Both are static bounds of what it moves (the rows it sends and receives are
  set at run time, at most each buffer); for expert parallelism's dispatch the send buffer is every (token,
  choice) pair, T x R rows, and the receive buffer the budget (``moe_receive_factor`` x T x R), the combine
  the reverse, so the smaller is the average traffic either way. (Its async start's shape lists its operands
  and its result together; summed, they counted both buffers and the receive buffer again.)"""
  send, receive = (mod.shapes.get(o, "") for o in ins.operands[:2])
  return min(hlo_text.nbytes(send), hlo_text.nbytes(receive))


def collective_of(mod: hlo_walk.Module, ins: hlo_text.Instr, n_devices: int, cluster: cluster_lib.Cluster,
                  partition_devices: list[int] | None = None):
  """The ``Collective`` an instruction starts or runs (a ``*-start``, a synchronous collective, an
  ``async-start`` wrapping one), else None; ``partition_devices``: the device id of each partition
  (``cluster.placement``)."""
  inner = ins
  kind = hlo_text.collective(ins)
  if kind is None and ins.opcode == "async-start":
    inner = _inner_collective(mod, ins)
    kind = hlo_text.collective(inner) if inner is not None else None
  if kind is None:
    return None
  groups = cluster_lib.replica_groups(inner.attrs, n_devices)
  where = cluster_lib.placement(groups, cluster, partition_devices)
  size = buffer_bytes(mod, inner if inner is not ins else ins, kind, where.group_size)
  return Collective(ins.name, kind, size, where.group_size, where.nodes,
                    cluster_lib.collective_seconds(kind, size, where, cluster),
                    dtype=_buffer_dtype(inner if inner is not ins else ins),
                    op_name=(inner if inner is not ins else ins).op_name or ins.op_name)


def _buffer_dtype(ins: hlo_text.Instr) -> str:
  """The dtypes of what a collective moves (``_moved``; of a ragged all-to-all, its result)."""
  shapes = hlo_text.arrays(ins.shape)[-1:] if "ragged-all-to-all" in ins.opcode else _moved(ins)
  return "+".join(sorted({d for d, _ in shapes}))


def _num_partitions(text: str) -> int:
  m = re.search(r"num_partitions=(\d+)", text[:4000])
  return int(m.group(1)) if m else 1


class _Walk:
  """The schedule walk of the module docstring's item 4."""

  def __init__(self, mod, op_s: dict, colls: dict):
    self.mod, self.op_s, self.colls = mod, op_s, colls
    self.exposed = 0.0
    self.comm = 0.0
    self.exposed_by = collections.Counter()   # collective name -> its exposed seconds per step
    self._local = {}
    self.body_s = {}        # one steady-state trip of each while body walked

  def run(self, comp: str, scale: float = 1.0, depth: int = 0) -> float:
    """Time of one execution of ``comp``; adds its exposed and total communication x ``scale``."""
    t, _ = self._walk(comp, {}, scale, depth)
    return t

  def _started(self, comp: str, name: str) -> str:
    """The start a done waits on: ``name`` itself, or, when ``name`` is element i of the loop's carried
    tuple (a collective started in the previous trip), the instruction the body's root puts at i."""
    local = self._local.get(comp)
    if local is None:
      local = self._local[comp] = {i.name: i for i in self.mod.comps.get(comp, [])}
    ins = local.get(name)
    if ins is None or ins.opcode != "get-tuple-element" or not ins.operands:
      return name
    src = local.get(ins.operands[0])
    index = re.search(r"index=(\d+)", ins.attrs)
    if src is None or src.opcode != "parameter" or index is None:
      return name
    root = next((i for i in self.mod.comps.get(comp, []) if i.root), None)
    if root is None or root.opcode != "tuple" or int(index.group(1)) >= len(root.operands):
      return name
    return root.operands[int(index.group(1))]

  def _walk(self, comp, pending, scale, depth):
    t, link = 0.0, 0.0
    for ins in self.mod.comps.get(comp, []):
      c = self.colls.get(ins.name)
      if c is not None and (ins.opcode.endswith("-start") or ins.opcode == "async-start"):
        begin = max(t, link)
        link = begin + c.seconds
        pending[ins.name] = link
        self.comm += c.seconds * scale
      elif c is not None:                      # synchronous: the compute stream waits for it
        begin = max(t, link)
        link = begin + c.seconds
        self.exposed += (link - t) * scale
        self.exposed_by[ins.name] += (link - t) * scale
        self.comm += c.seconds * scale
        t = link
      elif ins.opcode in _ASYNC_DONE and ins.operands and self._started(comp, ins.operands[0]) in pending:
        start = self._started(comp, ins.operands[0])
        end = pending.pop(start)
        if end > t:
          self.exposed += (end - t) * scale
          self.exposed_by[start] += (end - t) * scale
          t = end
      elif ins.opcode == "while" and depth < 64:
        trips = self.mod.trip_count(ins)
        body, cond = ins.attr("body"), ins.attr("condition")
        carry = {}
        self._walk(body, carry, 0.0, depth + 1)                  # warms the collectives carried across trips
        steady, _ = self._walk(body, carry, scale * trips, depth + 1)
        self.body_s[body] = steady
        t += trips * steady + (trips + 1) * self.run(cond, scale * (trips + 1), depth + 1)
      elif ins.opcode == "call" and depth < 64:
        t += self.run(ins.attr("to_apply"), scale, depth + 1)
      elif ins.opcode == "conditional" and depth < 64:
        branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = hlo_text.OPERAND.findall(branches.group(1)) if branches else [
            ins.attr("true_computation"), ins.attr("false_computation")]
        t += sum(self.run(b, scale, depth + 1) for b in names if b)
      elif ins.opcode == "async-start" and depth < 64:
        t += self.run(ins.attr("calls"), scale, depth + 1)       # work on another stream, charged serially
      else:
        t += self.op_s.get(ins.name, 0.0)
    return t, pending


def predict(text: str, target: str, cluster_name: str, floor_s: float = KERNEL_FLOOR_S,
            partition_devices: list[int] | None = None) -> dict:
  """The step of a compiled module on ``target`` GPUs of ``cluster_name``, partition ``p`` on device
  ``partition_devices[p]`` (bench/predict/gpu_aot.py's record of the mesh; default ``p``): ``step_s`` (the schedule
  walk), ``compute_s`` (every kernel's time, no communication), ``exposed_comm_s``, ``comm_s`` (every
  collective's time), ``floor_s`` (the floor's share), ``kernels`` (launches per step, collectives
  included), ``gemm_s``, the old roofline's ``roofline_s`` (flat 80% GEMMs, no floor, no communication),
  per-kind collective rows, ``each_collective`` (every collective instruction: a ``Collective``'s fields
  and its ``exposed_s`` per step), ``op_seconds`` (each kernel's seconds per execution, by instruction name)
  and ``compute_by_computation`` (each computation's own kernels, one
  execution, its nested loops not included)."""
  cluster = cluster_lib.get(cluster_name)
  rates = peaks(target)
  spec = spec_peaks(target)
  cost = hlo_cost.analyze(text, rates)
  mod = hlo_walk.Module(text)
  attention_frac = max(r[6] / gemm_rates.ROW_PEAKS[(r[0], r[1])] for r in gemm_rates.ROWS
                       if r[0] == gemm_rates.ARCH[target] and r[1] == "bf16")
  op_s, gemm_s, kernels = {}, 0.0, 0
  for o in cost["ops"]:
    seconds = o["seconds"] / max(1, o["count"])
    if o["kind"] in ("gemm", "attention"):
      peak = hlo_cost.gemm_peak(spec, o["dtype"], highest=o["highest"])
      rate = (gemm_rates.rate(target, o["dtype"], tuple(o["mnk"]), peak) if o["kind"] == "gemm"
              else attention_frac * peak)
      if rate:
        seconds = max(o["flops"] / rate, o["bytes"] / rates["hbm"])
      gemm_s += seconds * o["count"]
    op_s[o["name"]] = seconds + floor_s
    kernels += o["count"]
  n = _num_partitions(text)
  mult = mod.multipliers()
  colls, rows = {}, collections.defaultdict(lambda: dict(count=0, bytes_per_step=0, seconds=0.0, nodes=1,
                                                          group_size=0))
  for comp, m in mult.items():
    for ins in mod.comps[comp]:
      c = collective_of(mod, ins, n, cluster, partition_devices)
      if c is None:
        continue
      c.count, c.computation = m, comp
      colls[ins.name] = c
      row = rows[(c.kind, c.nodes > 1)]
      row["count"] += m
      row["bytes_per_step"] += c.buffer_bytes * m
      row["seconds"] += c.seconds * m
      row["nodes"] = max(row["nodes"], c.nodes)
      row["group_size"] = max(row["group_size"], c.group_size)
  walk = _Walk(mod, op_s, colls)
  step = walk.run(mod.entry)
  compute = sum(op_s[o["name"]] * o["count"] for o in cost["ops"])
  return dict(
      target=target, cluster=cluster_name, floor_per_kernel_s=floor_s,
      step_s=step, compute_s=compute, exposed_comm_s=walk.exposed, comm_s=walk.comm,
      floor_s=floor_s * kernels, kernels=kernels + sum(c.count for c in colls.values()),
      compute_kernels=kernels, collective_ops=sum(c.count for c in colls.values()),
      gemm_s=gemm_s, roofline_s=cost["seconds"], int_ops=cost["int_ops"], counts=cost["counts"],
      collectives=[dict(kind=k, crosses_nodes=x, **v) for (k, x), v in sorted(rows.items())],
      each_collective=[dict(dataclasses.asdict(c), exposed_s=walk.exposed_by[name]) for name, c in colls.items()],
      op_seconds=op_s,
      compute_by_computation={comp: sum(op_s.get(i.name, 0.0) for i in mod.comps[comp]) for comp in mult},
      body_s=walk.body_s, executions={c: m for c, m in mult.items()},
      leaf_bodies=sorted(b for b in walk.body_s if not any(i.opcode == "while" for i in mod.comps.get(b, []))))


def summary(p: dict) -> dict:
  """The headline numbers of ``predict`` in ms."""
  return dict(cluster=p["cluster"], step_ms=p["step_s"] * 1e3, compute_ms=p["compute_s"] * 1e3,
              floor_ms=p["floor_s"] * 1e3, exposed_comm_ms=p["exposed_comm_s"] * 1e3, comm_ms=p["comm_s"] * 1e3,
              kernels=p["kernels"], gemm_ms=p["gemm_s"] * 1e3, roofline_ms=p["roofline_s"] * 1e3)
