"""XLA's own estimate of a compiled step: the latency-hiding scheduler's schedule, dumped by the compile
(``--xla_dump_latency_hiding_schedule``; bench/predict/report_cache.py keeps it).

The dump is a ``ScheduleProto`` in text form: the module, then one ``computation_schedules`` entry per
computation the scheduler ran on, with each instruction's estimated start and end and the computation's
``total_cycles`` (``cycles_per_microsecond`` converts). In jax 0.10.2's XLA the GPU default is the
analytical speed-of-light estimator (``xla_gpu_enable_analytical_sol_latency_estimator``): its NCCL
model for collectives (sol_gpu_cost_model.cc), its matmul table for GEMMs (the one bench/predict/gemm_rates.py
cites) and a cost per instruction for the rest. A computation's total counts each while loop in it as
one instruction, not its trips, so XLA's estimate is compared with the ruler's over computations without
loops: the innermost loop bodies, each times its executions per step.
"""
from __future__ import annotations

import re

_COMPUTATION = re.compile(r'\n  computations \{\n    name: "([^"]+)"')
_ID = re.compile(r"\n    id: (\d+)\n")


def estimates_us(schedule_text: str) -> dict[str, float]:
  """``{computation name: XLA's estimated microseconds for one execution}`` of a dumped schedule (tens of MB
  for Super's step: one pass over it, each computation's id searched from where its name ends)."""
  names = {}
  for m in _COMPUTATION.finditer(schedule_text):
    cid = _ID.search(schedule_text, m.end())
    if cid:
      names[cid.group(1)] = m.group(1)
  out = {}
  for part in schedule_text.split("computation_schedules {")[1:]:
    cid = re.search(r"computation_id: (\d+)", part)
    total = re.search(r"total_cycles: ([\d.e+-]+)", part)
    per_us = re.search(r"cycles_per_microsecond: ([\d.e+-]+)", part)
    if cid and total and cid.group(1) in names:
      out[names[cid.group(1)]] = float(total.group(1)) / (float(per_us.group(1)) if per_us else 1.0)
  return out


def compare(pred: dict, schedule_text: str | None) -> dict | None:
  """XLA's estimate beside the ruler's (``ruler.predict``'s ``body_s``) over the innermost loop bodies
  both have: ``dict(xla_ms, ruler_ms, bodies, executions)`` per step, or None without a schedule."""
  if not schedule_text:
    return None
  xla = estimates_us(schedule_text)
  bodies = [b for b in pred["leaf_bodies"] if b in xla]
  if not bodies:
    return dict(xla_ms=None, ruler_ms=None, bodies=0, scheduled=sorted(xla)[:8])
  ex = pred["executions"]
  return dict(xla_ms=sum(xla[b] * ex.get(b, 1) for b in bodies) / 1e3,
              ruler_ms=sum(pred["body_s"][b] * ex.get(b, 1) for b in bodies) * 1e3,
              bodies=len(bodies))
