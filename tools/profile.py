"""Where a profiled step's time goes, by fp4jax's scopes: no viewer needed.

  python -m tools.profile runs/tiny/profile                  # the newest capture under it
  python -m tools.profile runs/tiny/profile/plugins/profile/2026_01_02_03_04_05/host.xplane.pb
  fp4jax-profile runs/tiny/profile --top 30

Reads a ``jax.profiler`` capture (``train.py --config.profile_steps="(10, 11, 12)"`` writes one under
``<workdir>/profile``; so does ``jax.profiler.start_trace``), times every HLO op that ran (its own time:
a while loop without its body) and names it by the op_name of its HLO instruction (``tools.xplane``:
where those names are on the CPU and on a GPU). Prints:

1. the capture: files, where the ops ran, the steps it holds (``StepTraceAnnotation`` "train" events),
   the HLO op time per step and fp4jax's share of it;
2. fp4jax's time by GEMM pass and primitive (``fprop/quantize``, ``wgrad/quantize_rht_t``,
   ``dgrad/scaled_matmul``, ...; ``tools.op_names.label``);
3. by layer (the scope path of each ``fp4jax.dot``), with fprop, dgrad and wgrad as columns, and how
   much of the layer's total its quantize passes take (``op_names.QUANTIZE``);
4. the rest of the step by model part (``models.scopes``) or train-step scope, and the ops without an
   op_name (copies and other ops XLA adds).

Times are per step (the capture's total over its step count) and summed over the lines that ran ops: on
a CPU, XLA runs independent ops on several threads, so the sum can exceed the step's wall time; on a GPU
it is kernel time per stream. Exit status: 0 done; 2 no capture at the path, or one without timed HLO
ops, with one ``error:`` line.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

from tools import op_names, xplane

PASSES = ("fprop", "dgrad", "wgrad")
NO_NAME = "(no op_name: copies and ops XLA added)"


@dataclasses.dataclass
class Summary:
  """One capture's HLO op time (ns, over the whole capture) by fp4jax label, layer x pass and part."""
  files: list[str]
  planes: dict[str, int]          # plane name -> lines (threads, streams) that timed ops
  executions: int                 # HLO op executions timed
  steps_found: int                # "train" step annotations
  span_ns: float                  # from the first op's start to the last op's end (summed over files)
  total_ns: float = 0.0
  fp4jax_ns: float = 0.0
  by_label: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
  by_layer: dict[str, dict[str, float]] = dataclasses.field(
      default_factory=lambda: collections.defaultdict(lambda: collections.defaultdict(float)))
  by_part: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))

  @property
  def steps(self) -> int:
    return max(self.steps_found, 1)


def summarize(path: str) -> Summary:
  """Read the capture at ``path`` (``xplane.find``) and add up its HLO op time by fp4jax scope."""
  files = xplane.find(path)
  ops, steps, span_ns = [], 0, 0.0
  for f in files:
    timed = xplane.timed_ops(f)
    ops.extend(timed)
    steps += xplane.steps(f)
    if timed:
      span_ns += max(op.end_ns for op in timed) - min(op.start_ns for op in timed)
  lines = collections.defaultdict(set)
  for op in ops:
    lines[op.plane].add(op.line)
  s = Summary(files, {p: len(v) for p, v in sorted(lines.items())}, len(ops), steps, span_ns)
  for op in ops:
    s.total_ns += op.self_ns
    name = op.op_name
    if "fp4jax/" not in name:
      s.by_part[op_names.part(name) or NO_NAME] += op.self_ns
      continue
    s.fp4jax_ns += op.self_ns
    label = op_names.label(name)
    s.by_label[label] += op.self_ns
    pass_ = label.split("/")[0] if "/" in label else "other"
    layer = s.by_layer[op_names.layer(name) or ""]
    layer[pass_ if pass_ in PASSES else "other"] += op.self_ns
    if op_names.QUANTIZE.search(label):
      layer["quantize"] += op.self_ns
  return s


def _common_prefix(paths: list[str]) -> str:
  split = [p.split("/") for p in paths]
  if len(split) < 2:
    return ""
  common = split[0]
  for parts in split[1:]:
    k = 0
    while k < min(len(common), len(parts) - 1) and common[k] == parts[k]:
      k += 1
    common = common[:k]
  return "/".join(common)


def report(s: Summary, top: int = 15) -> str:
  """The tables of the module docstring, as text."""
  ms = lambda ns: ns / s.steps / 1e6   # noqa: E731  (per step)
  pct = lambda ns: 100.0 * ns / s.total_ns if s.total_ns else 0.0   # noqa: E731
  out = [f"capture: {', '.join(s.files)}",
         "ops timed on: " + ", ".join(f"{p} ({n} {'threads' if p.startswith('/host') else 'lines'})"
                                      for p, n in s.planes.items()) + f"; {s.executions:,} HLO op executions"]
  if s.steps_found:
    out.append(f"steps: {s.steps_found} \"train\" steps; their HLO ops ran over {s.span_ns / 1e6:.1f} ms, first "
               f"start to last end ({ms(s.span_ns):.1f} ms per step); times below are per step")
  else:
    out.append(f"steps: no \"train\" step annotations; times below are totals over the capture (its HLO ops "
               f"ran over {s.span_ns / 1e6:.1f} ms, first start to last end)")
  out.append(f"HLO op time: {ms(s.total_ns):.3f} ms, of it fp4jax {ms(s.fp4jax_ns):.3f} ms "
             f"({pct(s.fp4jax_ns):.1f}%)")

  out += ["", f"{'fp4jax by pass and primitive':<44}{'ms':>10}{'%':>7}"]
  for label, ns in sorted(s.by_label.items(), key=lambda kv: -kv[1]):
    out.append(f"  {label:<42}{ms(ns):>10.3f}{pct(ns):>6.1f}%")

  total = lambda cols: sum(cols[c] for c in (*PASSES, "other"))   # noqa: E731  (quantize is inside them)
  layers = sorted(s.by_layer.items(), key=lambda kv: -total(kv[1]))
  strip = _common_prefix([name for name, _ in layers if name])
  columns = (*PASSES, "other")
  out += ["", f"{'fp4jax by layer (ms)':<44}" + "".join(f"{c:>9}" for c in (*columns, "total", "quantize"))]
  if strip:
    out[-1] += f"   (under {strip}/)"
  for name, cols in layers[:top]:
    shown = name[len(strip) + 1:] if strip and name.startswith(strip + "/") else name
    out.append(f"  {shown or '(top level)':<42}" + "".join(f"{ms(cols[c]):>9.3f}" for c in columns)
               + f"{ms(total(cols)):>9.3f}{ms(cols['quantize']):>9.3f}")
  if len(layers) > top:
    out.append(f"  ... {len(layers) - top} more layers (--top)")

  parts = sorted(s.by_part.items(), key=lambda kv: -kv[1])
  out += ["", f"{'outside fp4jax, by model part or step scope':<44}{'ms':>10}{'%':>7}"]
  for part, ns in parts[:top]:
    out.append(f"  {part:<42}{ms(ns):>10.3f}{pct(ns):>6.1f}%")
  if len(parts) > top:
    out.append(f"  ... {len(parts) - top} more (--top)")
  return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="fp4jax-profile", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("path", help="a *.xplane.pb file, or a folder with one under it (<workdir>/profile)")
  p.add_argument("--top", type=int, default=15, help="rows of the layer and part tables")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    summary = summarize(os.path.expanduser(args.path))
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not summary.executions:
    print(f"error: {', '.join(summary.files)} holds no timed HLO op (a capture of steps that ran no jitted "
          "computation, or of a platform whose events carry no hlo_op)", file=sys.stderr)
    return 2
  print(report(summary, args.top))
  return 0


def run() -> None:
  """The ``fp4jax-profile`` command."""
  sys.exit(main())


if __name__ == "__main__":
  run()
