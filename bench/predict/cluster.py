"""A GPU cluster as the ruler prices collectives on it: GPUs per node, NVLink per direction, network per GPU.

A collective's replica groups (read from the compiled HLO) are mapped onto the links they cross: a group
whose GPUs sit in one node (one NVLink domain) runs at NVLink speed; a group that spans nodes is limited
by each GPU's network link (an HGX node has one 400 Gb/s NIC per GPU). Partition ``p`` of the SPMD
program runs on the mesh's ``p``-th device (jit's device assignment is the mesh's devices in order), whose id
bench/predict/gpu_aot.py records (``partition_devices``: the mesh laid out in nodes by
``training.sharding.make_mesh`` may order them otherwise than by id); device ``d`` sits in node
``d // gpus_per_node`` (the topology is ``1 x hosts x 8``, ids host-major). Without the ids, partition ``p``
is device ``p`` (a flat mesh).

Time of one collective over a group of ``n`` GPUs, ``S`` its full buffer per GPU (all-gather: the gathered
output; reduce-scatter: the input it reduces; all-reduce: the buffer; all-to-all: what one GPU sends and
receives; collective-permute: what it sends), NCCL's ring bus-bandwidth factors:
  all-gather, reduce-scatter  S (n-1)/n / bw
  all-reduce                  2 S (n-1)/n / bw
  all-to-all                  S (k-1)/n / nvlink  and  S (n-k)/n / network, whichever is longer
                              (k: the group's GPUs in this GPU's node)
  collective-permute          S / bw
where bw is NVLink inside a node; across nodes, k x the network (k: the group's GPUs in each node), at most
NVLink. NCCL runs a collective as several rings at once (channels), each entering and leaving a node through a
different GPU's NIC, so a group with k GPUs in a node spreads its traffic between nodes over k NICs: one ring
runs at its slowest hop (the network), k of them at k times it, while inside the node every GPU still moves
its (n-1)/n share over NVLink (NVIDIA/nccl issue 412: "data can flow from the NIC to the nearest GPU, go
through all the other GPUs through NVLink, then exit from the last GPU, back to the NIC", several such flows
at once; NVIDIA/nccl-tests issue 277: all-reduce "will form multiple rings so that it can utilize all the
available NICs"; NVIDIA/nccl issue 1168: all-reduce bus bandwidth on 4 nodes about 45 GB/s with 4 GPUs per
node and 90 with 8). A group of one GPU per node (k = 1) runs at one NIC's speed; a collective-permute is a
single send, one NIC. Plus a latency per operation: XLA's NCCL kernel launch overhead (5 us,
``GpuPerformanceModelBase::kNcclKernelLaunchOverhead``) inside a node; across nodes, XLA's SoL model's
terms for an HGX node (``sol_gpu_cost_model.cc``: op launch 100 us x 0.45, round trip 68.89 us x 0.45 on
H100 / 46.67 us x 0.45 on B200, per (n-1)/k ring steps).
"""
from __future__ import annotations

import dataclasses
import re

NCCL_LAUNCH_S = 5e-6           # xla/service/gpu/model/gpu_performance_model_base.h, kNcclKernelLaunchOverhead
SOL_COEFF = 0.45               # xla/service/collective_utils.h, kDefaultNcclCostModelCoeff


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  gpus_per_node: int          # GPUs in one NVLink domain
  nvlink_Bps: float           # per GPU, per direction
  network_Bps: float          # per GPU, per direction, between NVLink domains
  inter_launch_s: float       # latency of starting a collective that crosses domains
  inter_rtt_s: float          # per ring step across domains
  description: str = ""


CLUSTERS = {c.name: c for c in (
    Cluster("hgx_h200", 8, 450e9, 50e9, 100e-6 * SOL_COEFF, 68.89e-6 * SOL_COEFF,
            "HGX H200 nodes: 8 GPUs, NVLink 4 at 900 GB/s bidirectional (450 per direction), one 400 Gb/s "
            "(50 GB/s) NIC per GPU between nodes"),
    Cluster("hgx_b200", 8, 900e9, 50e9, 100e-6 * SOL_COEFF, 46.67e-6 * SOL_COEFF,
            "HGX B200 nodes: 8 GPUs, NVLink 5 at 1.8 TB/s bidirectional (900 per direction), one 400 Gb/s "
            "(50 GB/s) NIC per GPU between nodes"),
    Cluster("gb200_nvl72", 72, 900e9, 50e9, 100e-6 * SOL_COEFF, 46.67e-6 * SOL_COEFF,
            "GB200 NVL72: 72 GPUs in one NVLink 5 domain at 900 GB/s per direction; 400 Gb/s per GPU beyond it"),
)}


def get(name: str) -> Cluster:
  if name not in CLUSTERS:
    raise ValueError(f"unknown cluster {name!r}; one of {sorted(CLUSTERS)}")
  return CLUSTERS[name]


_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^()]*(?:\([^()]*\))?)\))?\s*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_DEVICE_IOTA = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_SUB_AXIS = re.compile(r"^(.*):\((\d+)\)(\d+)$")


def replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
  """The replica groups of a collective's attributes: the mesh form ``mesh['a'=8,'b'=1] {'a'}`` (devices
  numbered row-major over the named axes, or as ``device_ids=([dims]T(perm))`` / ``device_ids=(0,4,...)``
  lists them; a group varies the axes in braces, the others fixed; a sub-axis ``'a':(pre)size`` is the
  ``size`` factor of ``a`` after its major ``pre``), the listed form ``{{0,1},{2,3}}``, the iota form
  ``[G,S]<=[dims]T(perm)`` (iota over dims, transposed by perm, reshaped to G groups of S), a
  collective-permute's ``source_target_pairs`` (each pair a group), or every device when none is given."""
  m = _MESH.search(attrs)
  if m:
    return _mesh_groups(m.group(1), m.group(2), m.group(3), attrs)
  m = _IOTA.search(attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else list(range(len(dims)))
    ids = _transposed_iota(dims, perm)
    size = shape[-1]
    return [ids[i:i + size] for i in range(0, len(ids), size)]
  m = _PAIRS.search(attrs)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  m = _LIST.search(attrs)
  if m:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    groups = [g for g in groups if g]
    if groups:
      return groups
  return [list(range(n_devices))]


def _mesh_groups(axes_text: str, device_ids: str | None, chosen_text: str, attrs: str) -> list[list[int]]:
  """XLA's ``MeshAxesReplicaGroupList``: the mesh's device ids reshaped so that each chosen (sub-)axis is one
  dimension, the chosen ones transposed to the end in their listed order, cut into groups."""
  unquote = lambda a: a.strip().strip("'\"")
  axes = [(unquote(a), int(n)) for a, n in (part.rsplit("=", 1) for part in axes_text.split(",") if "=" in part)]
  names = [a for a, _ in axes]
  total = 1
  for _, n in axes:
    total *= n
  ids = list(range(total))
  if device_ids:
    iota = _DEVICE_IOTA.match(device_ids.strip())
    if iota:
      dims = [int(x) for x in iota.group(1).split(",")]
      ids = _transposed_iota(dims, [int(x) for x in iota.group(2).split(",")] if iota.group(2)
                             else list(range(len(dims))))
    else:
      ids = [int(x) for x in re.findall(r"\d+", device_ids)]
  chosen = []   # (axis, pre, size): the size factor of axis after its major pre
  for ref in (r.strip() for r in chosen_text.split(",") if r.strip()):
    sub = _SUB_AXIS.match(ref)
    name = unquote(sub.group(1) if sub else ref)
    if name not in names:
      raise ValueError(f"replica groups name axes [{name!r}] not in the mesh {names}: {attrs[:200]}")
    full = dict(axes)[name]
    chosen.append((name, int(sub.group(2)), int(sub.group(3))) if sub else (name, 1, full))
  dims, grouped = [], {}
  for name, full in axes:   # each axis split so that every chosen factor of it is one dimension, major first
    prefix = 1
    for ref in sorted((c for c in chosen if c[0] == name), key=lambda c: c[1]):
      if ref[1] != prefix:
        dims.append(ref[1] // prefix)
        prefix = ref[1]
      grouped[ref] = len(dims)
      dims.append(ref[2])
      prefix *= ref[2]
    if prefix != full:
      dims.append(full // prefix)
  order = [grouped[c] for c in chosen]
  perm = [d for d in range(len(dims)) if d not in order] + order
  flat = [ids[i] for i in _transposed_iota(dims, perm)]
  size = 1
  for _, _, n in chosen:
    size *= n
  return [flat[i:i + size] for i in range(0, len(flat), size)]


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
  """iota(prod(dims)).reshape(dims).transpose(perm).ravel(), without numpy."""
  strides = [1] * len(dims)
  for i in range(len(dims) - 2, -1, -1):
    strides[i] = strides[i + 1] * dims[i + 1]
  out_dims = [dims[p] for p in perm]
  out_strides = [strides[p] for p in perm]
  ids = [0]
  for d, s in zip(out_dims, out_strides):
    ids = [base + k * s for base in ids for k in range(d)]
  return ids


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a collective's groups sit: the largest group's size, the most nodes a group spans, and the
  fewest of a spanning group's GPUs that share one node (what one GPU's ring neighbours look like)."""
  group_size: int
  nodes: int
  per_node: int

  @property
  def crosses_nodes(self) -> bool:
    return self.nodes > 1


def placement(groups: list[list[int]], cluster: Cluster, partition_devices: list[int] | None = None) -> Placement:
  """The ``Placement`` of replica ``groups`` (partition ids) on ``cluster``: partition ``p`` is device
  ``partition_devices[p]`` (default ``p``), in node ``device // gpus_per_node``."""
  node = ((lambda p: p // cluster.gpus_per_node) if partition_devices is None
          else (lambda p: partition_devices[p] // cluster.gpus_per_node))
  size = max(len(g) for g in groups)
  worst = max(groups, key=lambda g: (len({node(p) for p in g}), len(g)))
  nodes = {}
  for p in worst:
    nodes[node(p)] = nodes.get(node(p), 0) + 1
  return Placement(size, len(nodes), min(nodes.values()))


def collective_seconds(kind: str, buffer_bytes: float, where: Placement, cluster: Cluster) -> float:
  """Seconds one GPU spends in one collective of ``kind`` moving a full buffer of ``buffer_bytes`` over
  groups placed as ``where`` (the module docstring's formulas)."""
  n = where.group_size
  if n <= 1:
    return 0.0
  if where.crosses_nodes:
    steps = (n - 1) / max(1, where.per_node)
    latency = cluster.inter_launch_s + cluster.inter_rtt_s * steps * (2 if kind == "all-reduce" else 1)
    nics = 1 if kind in ("collective-permute", "collective-broadcast") else where.per_node
    bw = min(cluster.network_Bps * nics, cluster.nvlink_Bps)
  else:
    latency, bw = NCCL_LAUNCH_S, cluster.nvlink_Bps
  if kind in ("all-gather", "reduce-scatter"):
    return latency + buffer_bytes * (n - 1) / n / bw
  if kind == "all-reduce":
    return latency + 2 * buffer_bytes * (n - 1) / n / bw
  if kind in ("all-to-all", "ragged-all-to-all"):
    k = where.per_node if where.crosses_nodes else n
    inside = buffer_bytes * (k - 1) / n / cluster.nvlink_Bps
    outside = buffer_bytes * (n - k) / n / cluster.network_Bps if where.crosses_nodes else 0.0
    return latency + max(inside, outside)
  return latency + buffer_bytes / bw     # collective-permute, collective-broadcast: one send
