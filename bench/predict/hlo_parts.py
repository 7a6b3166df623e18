"""What each op of a priced module belongs to, from its op_name: fp4jax's primitives and the dot's passes
(``label``, ``scope``), the model's named parts (``part``, ``models.scopes``) and the phase (forward,
remat, backward), which tools.op_names reads (fp4jax-profile shares it), and the tables built on them from
``hlo_cost.analyze``'s result: ``by_label``, ``passes`` (each primitive call against one copy of what it
reads), ``by_part`` and ``columns``."""
from __future__ import annotations

import collections
import re

from tools.op_names import MODEL_PART as _MODEL_PART
from tools.op_names import QUANTIZE as _QUANTIZE
from tools.op_names import label, part, phase, scope  # noqa: F401  (this module's names for them)


def by_label(cost: dict) -> list[tuple[str, float, int]]:
  """``[(label, seconds, bytes per step)]`` of the ops that are neither GEMMs nor fused attention,
  largest first."""
  acc = collections.defaultdict(lambda: [0.0, 0])
  for o in cost["ops"]:
    if o["kind"] in ("gemm", "attention"):
      continue
    row = acc[label(o["op_name"])]
    row[0] += o["seconds"]
    row[1] += o["bytes"] * o["count"]
  return sorted(((k, s, b) for k, (s, b) in acc.items()), key=lambda r: -r[1])


def passes(cost: dict) -> list[dict]:
  """The fp4jax primitives' passes over memory, each as a multiple of one copy of what it reads.

  A pass is every non-GEMM op of one primitive call (``scope``: the quantize of fprop's operands in
  one layer, the wgrad RHT + quantize, a dequantize before a GEMM with its epilogue). What it reads
  is the values that come from outside the call, each counted once (at its largest read: a slice
  counts as the slice). One copy of those moves twice their bytes (read, then write), so
  ``copy_ratio`` = bytes the pass moves / (2 x bytes it reads): a quantize of bf16 that reads its
  input once and writes 4-bit codes + scales is 0.64, one that also reads the input for its amax
  1.14. Rows: ``dict(label, calls, ms, bytes, read_bytes, copy_ratio)`` per label (``by_label``'s
  names, all layers together), largest first."""
  groups = collections.defaultdict(list)
  for o in cost["ops"]:
    if o["kind"] in ("gemm", "attention"):
      continue
    s = scope(o["op_name"])
    if s is not None:
      groups[s].append(o)
  acc = collections.defaultdict(lambda: dict(calls=0, seconds=0.0, bytes=0, read_bytes=0))
  for s, ops in groups.items():
    inside = {o["name"] for o in ops}
    external = {}
    for o in ops:
      for src, b in o["reads"]:
        if src not in inside:
          external[src] = max(external.get(src, 0), b * o["count"])
    row = acc[label(s)]
    row["calls"] += 1
    row["seconds"] += sum(o["seconds"] for o in ops)
    row["bytes"] += sum(o["bytes"] * o["count"] for o in ops)
    row["read_bytes"] += sum(external.values())
  rows = [dict(label=k, calls=v["calls"], ms=v["seconds"] * 1e3, bytes=v["bytes"],
               read_bytes=v["read_bytes"],
               copy_ratio=v["bytes"] / (2 * v["read_bytes"]) if v["read_bytes"] else float("inf"))
          for k, v in acc.items()]
  return sorted(rows, key=lambda r: -r["bytes"])


LINEAR_PARTS = ("linear", "moe_experts")   # the model parts whose GEMMs are linear layers'


def by_part(cost: dict) -> list[dict]:
  """The step's time by ``part`` and ``phase``: ``dict(part, fwd, remat, bwd, ms, gib, gemm_ms)`` per
  part (ms per step; an op without an op_name is charged to ``origin``'s part, its name prefixed with
  "copy:"), largest first. GEMMs and attention included (``gemm_ms`` says how much of ``ms`` they are)."""
  acc = collections.defaultdict(lambda: dict(fwd=0.0, remat=0.0, bwd=0.0, gib=0.0, gemm_ms=0.0))
  for o in cost["ops"]:
    name = o["op_name"] or o.get("origin", "")
    key = part(name) if o["op_name"] else f"copy:{part(name) or '?'}"
    row = acc[key]
    row[phase(name)] += o["seconds"] * 1e3
    row["gib"] += o["bytes"] * o["count"] / 2 ** 30
    if o["kind"] in ("gemm", "attention"):
      row["gemm_ms"] += o["seconds"] * 1e3
  rows = [dict(part=k, ms=v["fwd"] + v["remat"] + v["bwd"], **v) for k, v in acc.items()]
  return sorted(rows, key=lambda r: -r["ms"])


def columns(cost: dict) -> dict:
  """The step's time in the issue-29 table's columns (ms): ``linear_gemm`` (GEMMs of linear layers:
  inside a ``models/linear`` or ``models/moe_experts`` scope, or fp4jax's dots), ``other_gemm`` (the
  rest: the LM head, the XLA SSD's einsums, a router), ``attention`` (cuDNN's fused attention and
  every op of ``models/attention_core``), ``ssd`` (every op of ``models/mamba2_ssd``: the Pallas kernels,
  or ssd_chunked's GEMMs and elementwise work), ``quantize`` (fp4jax's quantize, RHT and random-bits
  passes), ``other`` (everything else: norms, conv, gates, the dot's dequantize and epilogue work, the
  optimizer, copies)."""
  out = dict(linear_gemm=0.0, other_gemm=0.0, attention=0.0, ssd=0.0, quantize=0.0, other=0.0)
  for o in cost["ops"]:
    name = o["op_name"] or o.get("origin", "")
    parts = _MODEL_PART.findall(name)
    inner = parts[-1] if parts else ""
    ms = o["seconds"] * 1e3
    if o["kind"] == "attention" or inner == "attention_core":
      out["attention"] += ms
    elif inner == "mamba2_ssd":
      out["ssd"] += ms
    elif o["kind"] == "gemm":
      linear = inner in LINEAR_PARTS or re.search(r"fp4jax/(dot|grouped_dot)\b", name)
      out["linear_gemm" if linear else "other_gemm"] += ms
    elif _QUANTIZE.search(label(name)):
      out["quantize"] += ms
    else:
      out["other"] += ms
  return out
