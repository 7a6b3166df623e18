"""Read a ``jax.profiler`` capture (``*.xplane.pb``): the time of each HLO op it timed, and the op_name
that the compiled HLO gives that op.

A capture is an XSpace: planes (``/host:CPU``, ``/device:GPU:0``, ``/host:metadata``, ...) of lines
(threads, GPU streams) of timed events with stats. Where fp4jax's names are:

- CPU: each HLO op that ran is an event on a thread of ``/host:CPU`` named by its HLO instruction
  (``fusion.12``, ``while.3``, ``copy.7``) with the stats ``hlo_op``, ``hlo_module`` and ``program_id``,
  and no op_name. The op_names are in the ``/host:metadata`` plane: one event metadata per compiled
  module holding its ``HloProto`` (stat "Hlo Proto") and ``program_id``; each instruction's
  ``metadata.op_name`` there is what ``jax.named_scope`` wrote (``fp4jax/dot/fprop/...``).
- GPU (read from XLA's source and not yet run on a GPU; tested on CPU captures and on a capture in this
  form built from its text proto, tests/test_profile_command.py): each kernel is an event on a stream
  line of ``/device:GPU:<n>`` named by the kernel, with the stats that XLA's launch annotation gives it:
  ``hlo_op``, ``hlo_module``, ``program_id``, ``name`` (the op_name without the module's common
  ``prefix``, also a stat) and, at XLA's detailed annotation level, ``op_name``. ``/host:metadata``
  holds the HLO protos as on the CPU.

``timed_ops`` resolves an op's name from the HLO proto of its module first (by ``program_id``, or by the
module's name where the executable came from the persistent compilation cache), then from the
event's own ``op_name``, then ``prefix``/``name`` stats. An instruction without an op_name (a fusion
XLA made, a copy it added) takes the longest common scope of the op_names in the computations it
calls, as XLA's GPU annotation does; with none, its op_name is "".

The protobuf wire format is decoded here (field numbers of ``xplane.proto`` and ``hlo.proto``), so
no profiler package is needed; the events themselves come from jaxlib's ``ProfileData``.
"""
from __future__ import annotations

import dataclasses
import glob
import os

# xplane.proto: XSpace.planes 1; XPlane.name 2, .event_metadata 4, .stat_metadata 5;
# XEventMetadata.stats 5; XStatMetadata.id 1, .name 2; XStat.metadata_id 1, .uint64 3, .int64 4, .bytes 6
# hlo.proto: HloProto.hlo_module 1; HloModuleProto.name 1, .computations 3, .id 5;
# HloComputationProto.instructions 2, .id 5; HloInstructionProto.name 1, .metadata 7,
# .called_computation_ids 38; OpMetadata.op_name 2
_METADATA_PLANE = "/host:metadata"
# lines that xprof derives from the stream lines (absent from a raw capture): their events repeat them
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Framework Ops", "Framework Name Scope",
                  "Source code", "Steps", "Step Marker", "SparseCore Steps"}


# ------------------------------------------------------------------------------------ the wire format

def _varint(buf: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = buf[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i


def _fields(buf: bytes):
  """``(field number, value)`` of one message: ints for varints, bytes for the rest."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    number, kind = key >> 3, key & 7
    if kind == 0:
      value, i = _varint(buf, i)
    elif kind == 1:
      value, i = buf[i:i + 8], i + 8
    elif kind == 5:
      value, i = buf[i:i + 4], i + 4
    elif kind == 2:
      size, i = _varint(buf, i)
      value, i = buf[i:i + size], i + size
    else:
      raise ValueError(f"protobuf wire type {kind} at byte {i}: not an xplane.pb file, or a damaged one")
    yield number, value


def _packed(value) -> list[int]:
  if isinstance(value, int):
    return [value]
  out, i = [], 0
  while i < len(value):
    v, i = _varint(value, i)
    out.append(v)
  return out


# ------------------------------------------------------------------------------ the compiled modules

@dataclasses.dataclass(frozen=True)
class Module:
  """One compiled HLO module of a capture: ``op_names`` maps instruction name -> op_name ("" if none)."""
  name: str
  program_id: int
  op_names: dict[str, str]


def _common_scope(names) -> str:
  """The longest common '/'-separated prefix of non-empty op_names ("" if none)."""
  split = [n.split("/") for n in names if n]
  if not split:
    return ""
  common = split[0]
  for parts in split[1:]:
    k = 0
    while k < min(len(common), len(parts)) and common[k] == parts[k]:
      k += 1
    common = common[:k]
  return "/".join(common)


def _module(hlo_proto: bytes, program_id: int) -> Module:
  module = next((v for f, v in _fields(hlo_proto) if f == 1), b"")
  name, computations = "", {}
  for f, v in _fields(module):
    if f == 1:
      name = v.decode()
    elif f == 3:
      comp_id, instructions = None, []
      for cf, cv in _fields(v):
        if cf == 5:
          comp_id = cv
        elif cf == 2:
          inst = dict(name="", op_name="", calls=[])
          for inf, inv in _fields(cv):
            if inf == 1:
              inst["name"] = inv.decode()
            elif inf == 7:
              inst["op_name"] = next((m.decode() for mf, m in _fields(inv) if mf == 2), "")
            elif inf == 38:
              inst["calls"].extend(_packed(inv))
          instructions.append(inst)
      computations[comp_id] = instructions

  def called(inst, depth=0):   # the op_names inside the computations an instruction calls
    for comp in inst["calls"]:
      for inner in computations.get(comp, ()):
        yield inner["op_name"]
        if depth < 8:
          yield from called(inner, depth + 1)

  op_names = {}
  for instructions in computations.values():
    for inst in instructions:
      op_names[inst["name"]] = inst["op_name"] or _common_scope(called(inst))
  return Module(name, program_id, op_names)


def modules(path: str) -> dict[int, Module]:
  """The HLO modules that a capture holds in its ``/host:metadata`` plane, by program_id."""
  with open(path, "rb") as f:
    space = f.read()
  out = {}
  for number, plane in _fields(space):
    if number != 1:
      continue
    fields = list(_fields(plane))
    if next((v for f, v in fields if f == 2), b"") != _METADATA_PLANE.encode():
      continue
    stat_names = {}
    for f, entry in fields:
      if f == 5:
        meta = dict(_fields(dict(_fields(entry)).get(2, b"")))
        stat_names[meta.get(1, 0)] = meta.get(2, b"").decode()
    for f, entry in fields:
      if f != 4:
        continue
      stats = {}
      for mf, stat in _fields(dict(_fields(entry)).get(2, b"")):
        if mf == 5:
          s = dict(_fields(stat))
          stats[stat_names.get(s.get(1))] = s.get(6, s.get(3, s.get(4)))
      if isinstance(stats.get("Hlo Proto"), bytes) and isinstance(stats.get("program_id"), int):
        out[stats["program_id"]] = _module(stats["Hlo Proto"], stats["program_id"])
  return out


# ---------------------------------------------------------------------------------------- the events

@dataclasses.dataclass(frozen=True)
class TimedOp:
  """One execution of one HLO op: ``self_ns`` is its time less that of the HLO ops timed inside it on
  the same line (a while loop's body, a call's ops); ``start_ns``/``end_ns`` since the epoch."""
  plane: str
  line: str
  hlo_module: str
  hlo_op: str
  op_name: str
  self_ns: float
  start_ns: float
  end_ns: float


def _event_module(stats: dict, mods: dict[int, Module]) -> Module | None:
  """The module an event's op belongs to: by its ``program_id`` where that module has the event's
  ``hlo_module`` name, else the one module of that name holding the op. An executable loaded from JAX's
  persistent compilation cache keeps the program_id it was compiled with, while the capture's metadata
  plane numbers the module afresh, so the name is the key that survives the cache."""
  name, op = str(stats.get("hlo_module", "")), stats["hlo_op"]
  try:
    module = mods.get(int(stats.get("program_id", -1)))
  except (TypeError, ValueError):
    module = None
  if module is not None and (not name or module.name == name):
    return module
  named = [m for m in mods.values() if m.name == name and op in m.op_names]
  if len({m.op_names[op] for m in named}) == 1:
    return named[0]
  return None


def _stat_name(stats: dict, mods: dict[int, Module]) -> str:
  module = _event_module(stats, mods)
  if module is not None and stats["hlo_op"] in module.op_names:
    return module.op_names[stats["hlo_op"]]
  if stats.get("op_name"):
    return str(stats["op_name"])
  # XLA's annotation: name is the op_name less the module's prefix, or the whole op_name where that does
  # not start with the prefix (then this join repeats the prefix; the HLO protos have no such ambiguity)
  name, prefix = str(stats.get("name", "")), str(stats.get("prefix", ""))
  if prefix and name and not name.startswith(prefix):
    return f"{prefix}/{name}"
  return name or prefix


def _timed_planes(planes) -> list:
  """The device planes that timed HLO ops if any (a GPU's kernels; the host then only launched them),
  else the host's."""
  def timed(plane):
    return any(any(k == "hlo_op" for k, _ in e.stats) for line in plane.lines for e in line.events)
  device = [p for p in planes if p.name.startswith("/device:") and timed(p)]
  return device or [p for p in planes if p.name.startswith("/host:CPU")]


def timed_ops(path: str) -> list[TimedOp]:
  """Every timed HLO op of a capture, with its op_name (see the module docstring for where it comes from)."""
  from jax.profiler import ProfileData   # pylint: disable=import-outside-toplevel  (jaxlib, not the reader)

  mods = modules(path)
  out = []
  for plane in _timed_planes(list(ProfileData.from_file(path).planes)):
    for line in plane.lines:
      if line.name in _DERIVED_LINES:
        continue
      events = []
      for e in line.events:
        stats = dict(e.stats)
        if "hlo_op" in stats:
          events.append((e.start_ns, e.start_ns + e.duration_ns, stats))
      events.sort(key=lambda ev: (ev[0], -ev[1]))
      own = [end - start for start, end, _ in events]
      stack = []   # indices of the events that enclose the current one
      for i, (start, end, _) in enumerate(events):
        while stack and events[stack[-1]][1] <= start:
          stack.pop()
        if stack:
          own[stack[-1]] -= end - start
        stack.append(i)
      for (start, end, stats), self_ns in zip(events, own):
        out.append(TimedOp(plane.name, line.name, str(stats.get("hlo_module", "")), str(stats["hlo_op"]),
                           _stat_name(stats, mods), max(self_ns, 0.0), start, end))
  return out


def steps(path: str, name: str = "train") -> int:
  """How many step annotations (``jax.profiler.StepTraceAnnotation(name, step_num=...)``, as the training
  loop writes them) the host recorded. Their durations time the step's dispatch, which returns before the
  device's work is done (JAX dispatches asynchronously), so only their number is used."""
  from jax.profiler import ProfileData   # pylint: disable=import-outside-toplevel

  return sum(1 for plane in ProfileData.from_file(path).planes if plane.name.startswith("/host:CPU")
             for line in plane.lines for e in line.events
             if e.name == name and any(k == "step_num" for k, _ in e.stats))


def find(path: str) -> list[str]:
  """The ``*.xplane.pb`` files of one capture: ``path`` itself, the ones in it, or those of the newest
  ``plugins/profile/<time>/`` folder under it (a run's ``<workdir>/profile`` or the workdir)."""
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such file or folder; pass a *.xplane.pb file or the folder that "
                            "--config.profile_steps wrote (<workdir>/profile)")
  here = sorted(glob.glob(os.path.join(path, "*.xplane.pb")))
  if here:
    return here
  captures = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(path, "**", "*.xplane.pb"),
                                                            recursive=True)},
                    key=lambda d: (os.path.basename(d), d))
  if not captures:
    raise FileNotFoundError(f"{path}: no *.xplane.pb under it; capture one with "
                            "--config.profile_steps=\"(10, 11, 12)\" or jax.profiler.start_trace")
  return sorted(glob.glob(os.path.join(captures[-1], "*.xplane.pb")))
