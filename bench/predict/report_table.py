"""The headline table of bench/predict/report.py: each cached compile priced by the ruler, the calibration points,
and the block written at the top of docs/PERF.md."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time

from bench.predict import calibration
from bench.predict import cluster as cluster_lib
from bench.predict import gemm_rates
from bench.predict import report_cache
from bench.predict import report_rows
from bench.predict import xla_schedule

ROOT = report_cache.ROOT
PERF_MD = os.path.join(ROOT, "docs", "PERF.md")
BEGIN, END = "<!-- bench/predict/report.py: begin -->", "<!-- bench/predict/report.py: end -->"
RULER_FILES = tuple(f"bench/predict/{name}.py" for name in (
    "ruler", "xla_schedule", "cluster", "gemm_rates", "hlo_cost", "hlo_text", "hlo_walk", "hlo_kernels",
    "hlo_parts", "gpu_aot", "peaks"))
GiB = 2 ** 30


def ruler_hash() -> str:
  h = hashlib.sha256()
  for f in RULER_FILES:
    with open(os.path.join(ROOT, f), "rb") as fh:
      h.update(fh.read())
  return h.hexdigest()[:16]


def priced(cache: report_cache.Cache, row: report_rows.Row, variant: str) -> dict:
  """One cell of the table: ``dict(state="missing" | "error" | "ok", ...)``, the ruler's numbers cached
  beside the compile under the ruler's own hash."""
  key = cache.key(row.argv(variant), row.target)
  meta_path, _ = cache.paths(key)
  if not os.path.exists(meta_path):
    return dict(state="missing")
  with open(meta_path, encoding="utf-8") as f:
    meta = json.load(f)
  if meta.get("error"):
    return dict(state="error", reason=meta["error"], date=meta.get("date", ""))
  # rows that share a compile (super_b200 and its NVLink what-if) are priced on their own clusters
  priced_path = os.path.join(cache.dir, f"{key}.ruler-{ruler_hash()}.{row.cluster}.json")
  if os.path.exists(priced_path):
    with open(priced_path, encoding="utf-8") as f:
      return json.load(f)
  from bench.predict import ruler   # pylint: disable=import-outside-toplevel
  _, text = cache.load(key)
  res = meta["results"][0]
  pred = ruler.predict(text, row.target, row.cluster, partition_devices=res.get("partition_devices"))
  tokens = res["tokens_per_device"]
  active = res.get("active_params", res["params"])
  peak = ruler.spec_peaks(row.target)["flops"]["bf16"]
  mem = res["memory"]
  out = dict(state="ok", date=meta.get("date", ""), fallbacks=len(res.get("kernel_fallbacks", [])),
             step_ms=pred["step_s"] * 1e3,
             tokens_per_s=tokens / pred["step_s"], mfu=6 * active * tokens / (pred["step_s"] * peak),
             kernels=pred["kernels"], exposed_comm_ms=pred["exposed_comm_s"] * 1e3, comm_ms=pred["comm_s"] * 1e3,
             floor_ms=pred["floor_s"] * 1e3, memory_gib=(mem["argument_bytes"] + mem["temp_bytes"]) / GiB,
             roofline_ms=pred["roofline_s"] * 1e3, tokens=tokens, active_params=active,
             compile_s=res.get("compile_s"), collectives=pred["collectives"],
             xla=xla_schedule.compare(pred, report_cache.load_schedule(cache.dir, key)))
  with open(priced_path, "w", encoding="utf-8") as f:
    json.dump(out, f)
  return out


def _versions() -> str:
  from importlib import metadata   # pylint: disable=import-outside-toplevel
  out = []
  for pkg in ("jax", "jaxlib", "jax-cuda13-plugin"):
    try:
      out.append(f"{pkg} {metadata.version(pkg)}")
    except metadata.PackageNotFoundError:
      out.append(f"{pkg} (not installed)")
  return ", ".join(out)


def tokens_per_step(cells) -> str:
  """The compiled rows' tokens per GPU per step, each count with the rows that have it (the dense rows one
  sequence of 8192, Super its config's global batch over 64 GPUs in micro-batches)."""
  by_count: dict[int, list[str]] = {}
  for row, _, c in cells:
    if c["state"] == "ok" and row.title not in by_count.setdefault(int(c["tokens"]), []):
      by_count[int(c["tokens"])].append(row.title)
  if not by_count:
    return "as each row's config sets them"
  return "; ".join(f"{n:,} ({', '.join(titles)})" for n, titles in sorted(by_count.items()))


KEPT = re.compile(r" \(kept from ([0-9a-f]+)\)")


def previous_table(path: str = PERF_MD) -> dict[tuple[str, str], tuple[str, str]]:
  """The priced lines of the table now in docs/PERF.md's report block: {(program, variant): (its line, the
  commit that compiled it)} (a line kept from an older table keeps that table's commit); {} if there is none.
  ``render`` keeps those lines for cells not in the cache (compiles too long to redo at once)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if BEGIN not in text or END not in text:
    return {}
  block = text.split(BEGIN, 1)[1].split(END, 1)[0]
  header = re.search(r", commit ([0-9a-f]+)", block)
  table_commit = header.group(1) if header else "?"
  out = {}
  for line in block.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 10 and re.match(r"[\d,.]+$", cells[2]):   # a priced row (its step ms a number)
      older = KEPT.search(cells[1])
      out[(cells[0], cells[1].split(" (")[0])] = (line, older.group(1) if older else table_commit)
  return out


def _tokens(line: str) -> float:
  """The tokens/s/GPU of a table line."""
  return float(line.split("|")[4].split("(")[0].replace(",", ""))


def _kept(line: str, commit: str, bias) -> str:
  """A previous table's line with its variant marked by the commit that compiled it, and its tokens/s divided by
  this table's calibration bias."""
  cells = line.split("|")
  cells[2] = f" {KEPT.sub('', cells[2].strip())} (kept from {commit}) "
  cells[5] = f" {_tokens(line) / bias:,.0f} " if bias else " "
  return "|".join(cells)


def render(cache: report_cache.Cache, rows, variants=(), previous=None) -> str:
  """The report block: each (row, variant) priced from the cache; a cell not in the cache keeps its line of
  ``previous`` (``previous_table``), marked with the commit that compiled it, or says how to compile it."""
  previous = previous or {}
  kept = {}   # commit: rows kept from it
  cells, points = [], []
  for row in rows:
    for v in row.variants:
      if variants and v not in variants:
        continue
      c = priced(cache, row, v)
      cells.append((row, v, c))
      ref = row.reference
      predicted = (c["tokens_per_s"] if c["state"] == "ok" else _tokens(previous[(row.title, v)][0])
                   if c["state"] == "missing" and (row.title, v) in previous else None)
      if ref and predicted is not None and v in ref.tokens_per_s_per_gpu:
        points.append(calibration.Point(ref.source, ref.hardware, v, ref.tokens_per_s_per_gpu[v], predicted))
  b = calibration.bias(points)
  lines = [f"**Predictions, not measurements** (no GPU ran these programs): `python bench/predict/report.py`, "
           f"{time.strftime('%Y-%m-%d', time.gmtime())}, commit {report_cache.code_commit()}, {_versions()}; each "
           f"program compiled without a GPU "
           f"(bench/predict/gpu_aot.py; tokens per GPU per step: {tokens_per_step(cells)}) and priced by "
           f"bench/predict/ruler.py. Calibration bias: {calibration.describe(b)}.",
           "",
           "| program, GPUs | variant | step ms | tokens/s/GPU | ÷ bias | MFU | kernels/step | exposed comm ms "
           "(of all) | memory GiB/GPU | old ruler ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for row, v, c in cells:
    if c["state"] == "missing" and (row.title, v) in previous:
      line, commit = previous[(row.title, v)]
      lines.append(_kept(line, commit, b))
      kept[commit] = kept.get(commit, 0) + 1
    elif c["state"] == "missing":
      lines.append(f"| {row.title} | {v} | not compiled yet (`bench/predict/report.py --rows {row.name} --variants {v}`) "
                   "| | | | | | | |")
    elif c["state"] == "error":
      lines.append(f"| {row.title} | {v} | does not compile: {c['reason'][:140].replace('|', '/')} | | | | | | | |")
    else:
      corrected = f"{c['tokens_per_s'] / b:,.0f}" if b else ""
      if c.get("fallbacks"):   # a kernel that did not lower ran its XLA twin: the row prices that
        v = f"{v} ({c['fallbacks']} kernel shapes ran their XLA twin: the compile's log says which)"
      lines.append(f"| {row.title} | {v} | {c['step_ms']:,.1f} | {c['tokens_per_s']:,.0f} (optimistic)"
                   if b and b > 1 else
                   f"| {row.title} | {v} | {c['step_ms']:,.1f} | {c['tokens_per_s']:,.0f}")
      lines[-1] += (f" | {corrected} | {100 * c['mfu']:.1f}% | {c['kernels']:,} | {c['exposed_comm_ms']:,.1f} "
                    f"({c['comm_ms']:,.1f}) | {c['memory_gib']:.1f} | {c['roofline_ms']:,.1f} |")
  for commit, n in kept.items():
    lines[0] += (f" {n} rows marked \"kept from {commit}\" were not compiled again: their numbers are those of "
                 f"commit {commit}'s compiles (their tokens/s in the calibration below too).")
  xla_rows = [(row, v, c["xla"]) for row, v, c in cells if c["state"] == "ok" and c.get("xla")
              and c["xla"].get("xla_ms")]
  lines += ["", "XLA's own estimate beside the ruler's (bench/predict/xla_schedule.py: the latency-hiding scheduler's "
            "schedule dumped by the same compile, its default analytical estimator; over the innermost loop "
            "bodies, each times its executions per step, the computations whose totals XLA does not cut "
            "short at a loop):", ""]
  if xla_rows:
    lines += ["| program, GPUs | variant | loop bodies | XLA's estimate ms | the ruler's ms | XLA / ruler |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {row.title} | {v} | {x['bodies']} | {x['xla_ms']:,.1f} | {x['ruler_ms']:,.1f} | "
              f"{x['xla_ms'] / x['ruler_ms']:.2f} |" for row, v, x in xla_rows]
  else:
    lines.append("(no compiled row has a dumped schedule)")
  lines += ["", "Calibration: the ruler against published measurements of the same shapes on the same GPU kind "
            "(predicted = the table's tokens/s/GPU):", "", calibration.render(points), "", _assumptions()]
  return "\n".join(lines)


def _assumptions() -> str:
  from bench.predict import peaks as peak_rates   # pylint: disable=import-outside-toplevel
  from bench.predict import ruler   # pylint: disable=import-outside-toplevel
  clusters = "; ".join(c.description for c in cluster_lib.CLUSTERS.values())
  return "\n".join([
      "Assumptions (docs/PERF.md, \"The ruler's charges\"): step = the compiled schedule walked with one "
      "compute and one communication stream; each kernel its roofline (bytes at "
      f"{100 * peak_rates.HBM_DERATE:.0f}% of the datasheet HBM bandwidth, integer work at 64 int32 ops/SM/clock x "
      f"{100 * peak_rates.COMPUTE_DERATE:.0f}%, always charged) plus a {ruler.KERNEL_FLOOR_S * 1e6:.0f} us floor "
      "(XLA's kKernelLaunchOverhead); GEMMs at measured rates by shape (bench/predict/gemm_rates.py: XLA's matmul "
      "tables for H100 and B200, TileLang's H800 FP8; block-scaled MXFP8/NVFP4 assumed at FP8's measured "
      f"fraction of their peak: {', '.join(sorted(gemm_rates.ASSUMED))}); collectives on {clusters}; ring "
      "factors (n-1)/n (all-gather, reduce-scatter on the full buffer), 2(n-1)/n (all-reduce), all-to-all split "
      "NVLink/network (a ragged one on the smaller of its send and receive buffers); across nodes a group's "
      "traffic spread over the NICs of its GPUs in each node (NCCL's rings, one per NIC), at most NVLink; "
      "5 us per collective inside "
      "a node, XLA's SoL launch and round-trip terms across nodes. "
      "The B200 programs are compiled with XLA's Triton GEMM emitter off (cuBLAS; a deviceless-compile "
      "workaround). The nemotron3_super rows are compiled with their blocks regrouped (bench/predict/regroup.py: "
      "the same blocks, fewer of them distinct; held against the full compile in docs/PERF.md, \"A Super "
      "prediction in minutes\"); since their config profiles its step (config.pgle_steps; not the rows kept "
      "from earlier commits) they are compiled a second time with the ruler's costs of the first compile as XLA's "
      "scheduling profile (bench/predict/pgle_profile.py; a device profile assumed close to the ruler's times; "
      "the NVLink what-if shares the HGX compile's). "
      "MFU = 6 x active parameters x tokens / (step x datasheet bf16 peak). \"÷ bias\": the "
      "tokens/s divided by the calibration bias. \"old ruler\": the flat-80% roofline this replaces (no floor, "
      "no communication, integer work charged). A cell that does not compile says why."])


def write_perf(block: str, path: str = PERF_MD) -> None:
  """Replaces the report block at the top of docs/PERF.md (or puts it under the title)."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  new = f"{BEGIN}\n{block}\n{END}"
  if BEGIN in text and END in text:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    text = head + new + tail
  else:
    title, _, rest = text.partition("\n")
    text = f"{title}\n\n## Headline (bench/predict/report.py)\n\n{new}\n{rest}"
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
