"""scripts/gpu_check.py's report: its rows, the targets they are held to, the verdict lines, and the JSON
and Markdown files (gpu_check.json, gpu_check.md)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time

import jax

from fp4jax import _pallas_compat, dispatch
from tools import prove

TARGETS = {"quantize_bw": 0.70, "gemm": 0.90, "step": 1.25, "native_gemm": 2.0, "native_dot": 1.0}


@dataclasses.dataclass
class Row:
  section: str             # "yardstick" | "quantize" | "matmul" | "native" | "ssd" | "gated_norm" | "train"
  name: str
  impl: str                # "xla" | "pallas" | "native" | "default"
  shape: str
  status: str = "ok"       # ok | MISMATCH | ERROR | skipped
  exact: str = "-"         # how exactness was checked and the verdict
  ms: float | None = None
  rate: float | None = None
  unit: str = ""
  ratio: float | None = None   # against the yardstick (or the bf16 step)
  target: str = ""
  error: str = ""
  at_s: float = 0.0        # seconds since the start when the row finished
  predicted_ms: float | None = None   # bench/predict/hlo_cost.py's cost model of the compiled HLO (derated peaks)


class Report:
  def __init__(self, out_dir, sizes, rehearse, budget_s):
    self.rows: list[Row] = []
    self.out_dir, self.sizes, self.rehearse = out_dir, sizes, rehearse
    self.start = time.perf_counter()
    self.budget_s = budget_s
    self.proof: dict = {}      # "<op>/<fmt>" -> tools.prove entry (verdict, summary, evidence)

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def add(self, row: Row) -> Row:
    row.at_s = round(self.elapsed(), 1)
    self.rows.append(row)
    print(format_row(row), flush=True)
    return row


def format_row(r: Row) -> str:
  f = lambda v, fmt: "-" if v is None else format(v, fmt)
  text = (f"{r.section:9s} {r.name:34s} {r.impl:6s} {r.shape:12s} {r.status:8s} {r.exact:24s} "
          f"{f(r.ms, '9.3f')} ms {f(r.predicted_ms, '9.3f')} ms {f(r.rate, '9.2f')} {r.unit:7s} "
          f"{f(r.ratio, '6.2f')} {r.at_s:5.0f}s {r.target}")
  if r.error:
    text += f"\n          ! {r.error}"
  return text


HEADER = (f"{'section':9s} {'op':34s} {'impl':6s} {'shape':12s} {'status':8s} {'exact':24s} "
          f"{'time':>12s} {'predicted':>12s} {'rate':>9s} {'unit':7s} {'ratio':>6s} {'at':>6s} target")


# ------------------------------------------------------------------------------------------ report

def verdicts(rows, quantize_ops: dict, matmul_ops: dict, native_ops) -> tuple[list[str], list]:
  """Target lines and the VERIFIED_KERNELS candidates (kernel exact and faster than its XLA row), for the
  check's op tables (name -> (op, fmt, ...) of its quantize rows, name -> (fmt, ...) of its matmul rows, the
  native rows' names)."""
  by = {(r.name, r.impl): r for r in rows}
  lines = []
  q = by.get(("quantize nvfp4_1x16", "xla"))
  for impl in ("xla", "pallas"):
    r = by.get(("quantize nvfp4_1x16", impl))
    if r and r.ratio is not None:
      lines.append(f"target quantize nvfp4 1x16 ({impl}): {r.ratio:.2f} of copy bandwidth "
                   f"(target >= {TARGETS['quantize_bw']:.2f}) -> {'met' if r.ratio >= TARGETS['quantize_bw'] else 'NOT met'}")
    r = by.get(("scaled_matmul nvfp4 1x16.16x16", impl))
    if r and r.ratio is not None:
      lines.append(f"target emulated NVFP4 GEMM ({impl}): {r.ratio:.2f} of bf16 "
                   f"(target >= {TARGETS['gemm']:.2f}) -> {'met' if r.ratio >= TARGETS['gemm'] else 'NOT met'}")
  for name in native_ops:
    r = by.get((name, "native"))
    if r and r.status == "skipped":
      lines.append(f"GEMM {name}: skipped: not Blackwell")
    elif r and r.ratio is not None:
      lines.append(f"GEMM {name}: {r.status}, {r.ratio:.2f} of bf16"
                   + (f" (target >= {TARGETS['native_gemm']:.2f}) -> "
                      f"{'met' if r.ratio >= TARGETS['native_gemm'] else 'NOT met'}"
                      if name == "native nvfp4 1x16.16x16" else ""))
  r = by.get(("dot nvfp4 y,dx,dw, native", "native"))
  if r and r.ratio is not None:
    verdict = "confirms" if r.status == "ok" and r.ratio <= TARGETS["native_dot"] else "revokes"
    lines.append(f"dot nvfp4 native: {r.status}, {r.ratio:.2f}x the bf16 dot -> {verdict} impl=None = native "
                 "on cc 10.x (fp4jax.dispatch.NATIVE_DEFAULTS)")
  for op, row_name in (("ssd", "ssd fwd+bwd (+D x)"), ("gated_norm", "gated norm fwd+bwd")):
    r, x = by.get((row_name, "pallas")), by.get((row_name, "xla"))
    if r and x and r.ms and x.ms:
      ok = r.status == "ok" and x.ms > r.ms
      lines.append(f"kernel {op}: {r.status} ({r.exact}), {x.ms / r.ms:.2f}x the XLA path"
                   + (f" -> candidate: models.{'ssd_pallas' if op == 'ssd' else op}.VERIFIED = Evidence(...)"
                      if ok else " -> stays impl='xla'"))
  r = by.get(("train step nvfp4", "default"))
  if r and r.ratio is not None:
    lines.append(f"target small nvfp4 step: {r.ratio:.2f}x the bf16 step (target <= {TARGETS['step']:.2f}) "
                 f"-> {'met' if r.ratio <= TARGETS['step'] else 'NOT met'}")
  del q
  candidates = []
  ops = {**{n: (op, fmt) for n, (op, fmt, *_) in quantize_ops.items()},
         **{n: ("scaled_matmul", fmt) for n, (fmt, *_) in matmul_ops.items()}}
  for name, (op, fmt) in ops.items():
    k, x = by.get((name, "pallas")), by.get((name, "xla"))
    if k and x and k.status == "ok" and x.status == "ok" and k.ms and x.ms:
      speedup = x.ms / k.ms
      lines.append(f"kernel {name}: exact, {speedup:.2f}x the XLA path")
      if speedup > 1.0:
        candidates.append((op, fmt, name, speedup))
    elif k:
      lines.append(f"kernel {name}: {k.status}" + (f" ({k.error.splitlines()[0]})" if k.error else ""))
  return lines, candidates


def write_report(report: Report, env: dict, quantize_ops: dict, matmul_ops: dict, native_ops):
  """Prints the verdict lines and writes gpu_check.json and gpu_check.md to the report's directory."""
  lines, candidates = verdicts(report.rows, quantize_ops, matmul_ops, native_ops)
  today = datetime.date.today().isoformat()
  evidence = []
  seen = set()
  for op, fmt, name, speedup in candidates:
    if (op, fmt) in seen:       # quantize_1d nvfp4 appears twice (RNE, SR): the slower speedup counts
      continue
    speeds = [c[3] for c in candidates if (c[0], c[1]) == (op, fmt)]
    n_rows = sum(1 for n, (o, f, *_) in quantize_ops.items() if (o, f) == (op, fmt)) if op != "scaled_matmul" \
        else sum(1 for n, (f, *_) in matmul_ops.items() if f == fmt)
    if len(speeds) < n_rows:    # every variant of the op must be exact and faster
      continue
    seen.add((op, fmt))
    evidence.append(f'    ("{op}", "{fmt}"): Evidence("{today}", "{env["device"]}", "{env["jax"]}", '
                    f'{min(speeds):.2f}),')
  if report.rehearse:       # CPU timings justify nothing about a GPU
    evidence = []
  print("\n" + "\n".join(lines), flush=True)
  if report.rehearse:
    print("# rehearsal on CPU: interpreted kernels, tiny shapes; the times and ratios say nothing about a GPU")
  elif evidence:
    print("# VERIFIED_KERNELS entries this run justifies (fp4jax/dispatch.py):\n" + "\n".join(evidence))
  else:
    print("# no kernel was both exact and faster than its XLA path: VERIFIED_KERNELS stays empty")
  data = dict(env=env, sizes=dataclasses.asdict(report.sizes), rehearse=report.rehearse,
              elapsed_s=report.elapsed(), targets=TARGETS, rows=[dataclasses.asdict(r) for r in report.rows],
              verdicts=lines, verified_kernels_candidates=evidence, proof=report.proof)
  os.makedirs(report.out_dir, exist_ok=True)
  with open(os.path.join(report.out_dir, "gpu_check.json"), "w") as f:
    json.dump(data, f, indent=1)
  fmt = lambda v, spec: "" if v is None else format(v, spec)
  md = [f"# fp4jax gpu_check {'(CPU rehearsal) ' if report.rehearse else ''}— {env['time']}", "",
        f"{env['device']} ({env['backend']}), jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"python {env['python']}, {report.elapsed():.0f} s", "",
        "| section | op | impl | shape | status | exact | ms | predicted ms | rate | unit | ratio | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report.rows:
    md.append(f"| {r.section} | {r.name} | {r.impl} | {r.shape} | {r.status} | {r.exact} | "
              f"{fmt(r.ms, '.3f')} | {fmt(r.predicted_ms, '.3f')} | {fmt(r.rate, '.2f')} | {r.unit} | "
              f"{fmt(r.ratio, '.2f')} | {r.target} |")
  md += ["", *[f"- {line}" for line in lines]]
  if report.proof:
    md += ["", "On-device proof (tools.prove, printed first):", ""]
    md += [f"- {prove.describe(*name.split('/'), entry)}" for name, entry in report.proof.items()]
  if evidence:
    md += ["", "VERIFIED_KERNELS candidates:", "```", *evidence, "```"]
  errors = [r for r in report.rows if r.error]
  if errors:
    md += ["", "Errors:", ""] + [f"- {r.name} ({r.impl}): {r.error.splitlines()[0]}" for r in errors]
  with open(os.path.join(report.out_dir, "gpu_check.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  print(f"# report: {os.path.join(report.out_dir, 'gpu_check.json')} and gpu_check.md", flush=True)


def environment() -> dict:
  """The device, the versions and the kernel defaults a report was made with."""
  dev = jax.devices()[0]
  import jaxlib  # pylint: disable=g-import-not-at-top
  return dict(time=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              device=getattr(dev, "device_kind", dev.platform), backend=jax.default_backend(),
              devices=len(jax.devices()), jax=jax.__version__, jaxlib=jaxlib.__version__,
              python=platform.python_version(), triton=_pallas_compat.has_triton(),
              default_impl_env=os.environ.get(dispatch.DEFAULT_IMPL_ENV, ""),
              verified_kernels={f"{k[0]}/{k[1]}": dataclasses.asdict(v)
                                for k, v in dispatch.VERIFIED_KERNELS.items()})
