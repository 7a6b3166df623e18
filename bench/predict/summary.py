"""A compile result priced and printed: the cost model (hlo_cost, with hlo_parts' tables) and the ruler
applied to its HLO (``summarize``), the lines gpu_aot.py prints (``report``), and the budget the tests hold a
compile to (``check_budget``)."""
from __future__ import annotations

from bench.predict.peaks import peaks

GiB = 2 ** 30


def summarize(res: dict, target: str, peak_kind: str = "derated", int_ops: bool = False,
              cluster: str = "") -> dict:
  """The compile result with the cost model applied (``cost``; ``ruler``: bench/predict/ruler.py's step, with the
  per-kernel floor, GEMM efficiencies and collectives on ``cluster``) and the HLO text dropped."""
  from bench.predict import hlo_cost   # pylint: disable=import-outside-toplevel
  from bench.predict import hlo_parts   # pylint: disable=import-outside-toplevel
  from bench.predict import launches   # pylint: disable=import-outside-toplevel
  out = {k: v for k, v in res.items() if k not in ("text", "unprofiled")}
  if res.get("error"):
    return out
  from bench.predict import ruler   # pylint: disable=import-outside-toplevel
  priced = lambda text: ruler.summary(ruler.predict(text, target, cluster or f"hgx_{target}",
                                                    partition_devices=res.get("partition_devices")))
  try:
    out["ruler"] = priced(res["text"])
    if res.get("unprofiled"):   # compiled again with a profile of itself: the first compile's step beside it
      first = res["unprofiled"]
      out["unprofiled"] = dict(compile_s=first["compile_s"], profile=first["profile"], ruler=priced(first["text"]))
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
      # the launches per step by part and by what each does (bench/predict/launches.py: the kernel count's census)
      launches=launches.census(res["text"], cost),
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
    lines.append(f"  ruler (bench/predict/ruler.py, a prediction): step {r['step_ms']:.1f} ms = compute "
                 f"{r['compute_ms']:.1f} (of which the per-kernel floor {r['floor_ms']:.1f}) + exposed communication "
                 f"{r['exposed_comm_ms']:.1f} (of {r['comm_ms']:.1f} on {r['cluster']}); {r['kernels']} kernels per step")
    first = (s.get("unprofiled") or {}).get("ruler")
    if first:
      lines.append(f"  scheduled with the ruler's profile of its first compile ({s['unprofiled']['profile']}; "
                   f"config.pgle_steps); that compile ({s['unprofiled']['compile_s']:.1f} s): step "
                   f"{first['step_ms']:.1f} ms, exposed communication {first['exposed_comm_ms']:.1f}")
  if twin is not None and not twin.get("error"):
    lines.append(f"  bf16 twin {twin['cost']['predicted_ms']:.3f} ms: ratio "
                 f"{c['predicted_ms'] / twin['cost']['predicted_ms']:.3f}")
    lines.extend(_launch_lines(c, twin["cost"]))
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


def _launch_lines(c: dict, t: dict, rows: int = 24) -> list[str]:
  """The census of launches against the twin's (bench/predict/launches.py): totals, and the parts that differ most."""
  from bench.predict import launches   # pylint: disable=import-outside-toplevel
  if "launches" not in c or "launches" not in t:
    return []
  total = lambda rs: sum(r["launches"] for r in rs if r["part"] != "collective")
  n, n_twin = total(c["launches"]), total(t["launches"])
  lines = [f"  compute launches per step {n} against the twin's {n_twin} ({n / max(1, n_twin):.2f}x); by what they do "
           "(this, twin): " + ", ".join(f"{w} {v} ({launches.by_work([r for r in t['launches'] if r['part'] != 'collective']).get(w, 0)})"
                                     for w, v in launches.by_work([r for r in c["launches"] if r["part"] != "collective"]).items()),
           "  launches by part and work, the largest differences (this, twin):"]
  for part, work, a, b in launches.compare(c["launches"], t["launches"])[:rows]:
    lines.append(f"    {part:<32}{work:<16}{a:>8}{b:>8}")
  return lines


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
