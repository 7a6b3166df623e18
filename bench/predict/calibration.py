"""The ruler against published measurements: each point a run measured on real GPUs and the ruler's
prediction of an fp4jax program of the same shape on the same GPU kind; the bias is their geometric mean
ratio (predicted / measured tokens/s per GPU: above 1, the ruler is optimistic).

The points are made by bench/predict/report.py from its calibration rows (bench/predict/report_rows.py ``Reference``);
this module only computes and renders, so the bias is always the rows' own.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Point:
  source: str
  hardware: str
  variant: str
  measured: float      # tokens/s per GPU, published
  predicted: float     # tokens/s per GPU, the ruler's

  @property
  def ratio(self) -> float:
    return self.predicted / self.measured


def bias(points) -> float | None:
  """The geometric mean of predicted / measured over ``points``; None without points."""
  points = list(points)
  if not points:
    return None
  return math.exp(sum(math.log(p.ratio) for p in points) / len(points))


def describe(b: float | None) -> str:
  if b is None:
    return "no calibration point: the bias is unknown"
  if b >= 1:
    return f"optimistic: predicts {b:.2f}x the measured tokens/s (geometric mean)"
  return f"pessimistic: predicts {b:.2f}x the measured tokens/s (geometric mean)"


def render(points) -> str:
  """A markdown table of the points and the bias line computed from them."""
  points = list(points)
  lines = ["| source | hardware | variant | measured tokens/s/GPU | predicted | predicted / measured |",
           "|---|---|---|---|---|---|"]
  for p in points:
    lines.append(f"| {p.source} | {p.hardware} | {p.variant} | {p.measured:,.0f} | {p.predicted:,.0f} | "
                 f"{p.ratio:.2f} |")
  lines.append("")
  lines.append(f"Bias over {len(points)} points: {describe(bias(points))}.")
  return "\n".join(lines)
