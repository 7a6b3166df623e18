"""The budget study's summary written out: the Markdown tables (``summary.md``: the tokens each recipe needs to
reach the reference's loss at T, and the final validation loss of every budget) and the plot
(``tokens_to_loss.png``), from ``budget_summary.collect``."""
from __future__ import annotations

import math

from experiments.budget_match import AT_MOST, BRACKETED, MORE_THAN
from experiments.budget_summary import DIVERGED, PENDING
from experiments.study_render import hardware_line, pm

PLOT_FILE = "tokens_to_loss.png"
PAPER = ("the paper (spec §7: 8B hybrid, last 8 of 52 blocks in bf16, 1T tokens): MXFP4 needs 36% more tokens "
         "than NVFP4 to reach NVFP4's loss, a ratio of 1.36")


def ratio_text(kind: str | None, value: float) -> str:
  """A ratio of tokens to T, or its bound: "1.312", "≤ 1", "> 1.6"."""
  if kind == BRACKETED:
    return f"{value:.3f}"
  if kind == AT_MOST:
    return f"≤ {value:.3g}"
  if kind == MORE_THAN:
    return f"> {value:.3g}"
  return "—"


def _seed_text(m: dict) -> str:
  if m["kind"] == PENDING:
    return "pending"
  if m["kind"] == DIVERGED:
    return "diverged: " + ", ".join(m["runs"])
  return ratio_text(m["kind"], m["ratio"])


def _mean_text(m: dict, seeds: int) -> str:
  if not m["measured_seeds"]:
    return "not run yet"
  if m["kind"] is None:
    return "no bound (seeds on both sides of the budgets)"
  text = ratio_text(m["kind"], m["mean"])
  if m["kind"] == BRACKETED:
    text = f"**{text}** ({100 * (m['mean'] - 1):+.0f}%)"
  if len(m["measured_seeds"]) < seeds:
    text += f" ({len(m['measured_seeds'])} of {seeds} seeds)"
  return text


def _interval_text(m: dict) -> str:
  if m["kind"] != BRACKETED or not math.isfinite(m["low"]):
    return "—"
  return f"{m['low']:.3f} ... {m['high']:.3f}"


def render_markdown(s: dict) -> str:
  mdl, hw, ref = s["model"], s["hardware"], s["reference"]
  n_seeds = len(s["seeds"])
  pct = f"{100 * s['confidence']:.0f}%"
  fractions = ", ".join(f"{f:g}" for f in s["fractions"])
  lines = [
      f"# Tokens to {ref}'s loss: `{s['name']}`",
      "",
      f"Model: `{mdl['preset']}` preset, pattern `{mdl['pattern']}`, d_model {mdl['d_model']}, MLP {mdl['mlp_dim']}, "
      f"{s['params']:,} parameters ({s['non_embedding_params']:,} without the embedding and LM head); bf16 "
      f"blocks: first {mdl['bf16_first_blocks']}, last {mdl['bf16_last_blocks']}, for every recipe. "
      f"T = {s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens = {s['t_tokens']:,} tokens "
      f"({s['tokens_per_param']:.1f} per parameter, {s['tokens_per_non_embedding_param']:.1f} per non-embedding "
      f"parameter). Seeds {s['seeds']}; runs finished {s['runs_done']}/{s['runs_total']}.",
      f"Hardware: {hardware_line(s)}, jax {hw['jax']}; total wall time of the finished runs "
      f"{s['total_wall_seconds'] / 60:.1f} min. Updated {s['updated']}.",
      "",
      f"Method: {ref} is trained for T; every other recipe for {fractions} x T, each budget its own run with the "
      f"learning-rate schedule scaled to it ({s['schedule']}: round(fraction x {s['steps']}) steps, the same "
      f"{s['warmup_steps']}-step warmup, the decay over the last {100 * s['decay_fraction']:.0f}% of its own "
      f"steps). Per recipe and seed, the tokens at which its final validation loss equals {ref}'s at T with the "
      "same seed (same initialization, data order and validation batches), interpolated linearly in tokens "
      "between the two budgets that bracket it; a recipe already at or under that loss at its smallest budget "
      "gives an upper bound (≤), one over it at every budget a lower bound (>). Tokens needed / T: the mean over "
      f"seeds, with the {pct} Student-t interval of the per-seed ratios when every seed is bracketed; with "
      "bounded seeds the mean (each bounded seed at its bound) is itself a bound and has no interval.",
      "",
      f"| recipe | what | tokens needed / T | {pct} interval | per seed | seeds bracketed |",
      "|---|---|---|---|---|---|",
      f"| {ref} | {s['descriptions'][ref]} | 1 (reference" + (
          ": its loss at T, per seed " + ", ".join(f"{s['target'][k]:.4f}" for k in sorted(s["target"]))
          if s["target"] else "") + ") | | | |",
  ]
  for v in s["variants"][1:]:
    m = s["matches"][v]
    per_seed = ", ".join(_seed_text(m["per_seed"][k]) for k in s["seeds"])
    lines.append(f"| {v} | {m['description']} | {_mean_text(m, n_seeds)} | {_interval_text(m)} | {per_seed} | "
                 f"{m['bracketed']}/{n_seeds} |")
  lines += [
      "",
      f"For comparison, {PAPER}.",
      "",
      "## Final validation loss per budget",
      "",
      "Mean ± sample standard deviation over the seeds that finished the run (how many, when not all; a diverged run "
      "has no loss).",
      "",
      "| recipe | " + " | ".join(f"{f:g} T ({round(f * s['steps']) * s['tokens_per_step']:,} tokens)"
                                  for f in _all_fractions(s)) + " |",
      "|---|" + "---|" * len(_all_fractions(s)),
  ]
  for v in s["variants"]:
    cells = []
    for f in _all_fractions(s):
      row = next((r for r in s["rows"].values() if r["variant"] == v and r["fraction"] == f), None)
      cells.append(_loss_cell(row, n_seeds))
    lines.append(f"| {v} | " + " | ".join(cells) + " |")
  lines += ["", f"![final validation loss against tokens]({PLOT_FILE})", ""]
  return "\n".join(lines)


def _all_fractions(s: dict) -> list[float]:
  return sorted(set(s["fractions"]) | {1.0})


def _loss_cell(row: dict | None, n_seeds: int) -> str:
  if row is None:
    return ""
  losses = row["validation_loss"]
  if not losses:
    return "not run yet"
  finite = sum(math.isfinite(x) for x in losses.values())
  text = pm(row["loss_mean"], row["loss_std"], ".4f")
  if finite < n_seeds:
    text += f" ({finite} of {n_seeds}" + (f", {len(losses) - finite} diverged" if finite < len(losses) else "") + ")"
  return text


def plot_budget(s: dict, path: str) -> None:
  """Final validation loss against tokens, one line per recipe (mean over seeds), the reference's level at T
  and each recipe's matching point (the mean tokens needed, its interval as an error bar; a bound as an arrow)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 5))
  ref, t = s["reference"], s["t_tokens"]
  colors = {"nvfp4": "tab:blue", "mxfp4": "tab:red", "fp8": "tab:green", "quartet2": "tab:purple",
            "tetrajet2": "tab:brown"}
  level = s["rows"][next(r["name"] for r in s["runs"] if r["variant"] == ref)]["loss_mean"]
  for v in s["variants"]:
    points = sorted((r["tokens"], r["loss_mean"]) for r in s["rows"].values()
                    if r["variant"] == v and math.isfinite(r["loss_mean"]))
    if not points:
      continue
    color = colors.get(v)
    x, y = zip(*points)
    if v == ref:
      ax.plot(x, y, "*", color=color, ms=12, label=f"{v} at T ({y[0]:.4f})")
      continue
    m = s["matches"][v]
    label = f"{v}: {ratio_text(m['kind'], m['mean'])} T" if m["kind"] else v
    line, = ax.plot(x, y, "-o", color=color, ms=4, lw=1.4, label=label)
    if m["kind"] and math.isfinite(level):
      color = line.get_color()
      if m["kind"] == BRACKETED:
        err = ([[t * (m["mean"] - m["low"])], [t * (m["high"] - m["mean"])]] if math.isfinite(m["low"]) else None)
        ax.errorbar([t * m["mean"]], [level], xerr=err, fmt="D", color=color, ms=7, capsize=4, zorder=5)
      else:
        ax.plot([t * m["mean"]], [level], "<" if m["kind"] == AT_MOST else ">", color=color, ms=9, zorder=5)
  if math.isfinite(level):
    ax.axhline(level, color=colors[ref] if ref in colors else "black", ls="--", lw=0.9)
  ax.axvline(t, color="gray", ls=":", lw=0.9)
  ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))
  ax.set_xlabel(f"tokens (dotted: T = {t:,})")
  top = ax.secondary_xaxis("top", functions=(lambda x: x / t, lambda r: r * t))
  top.set_xlabel("tokens / T")
  ax.set_ylabel("final validation loss (mean over seeds)")
  ax.set_title(f"{s['name']}, {len(s['seeds'])} seeds: {ref}'s loss at T (dashed)\nand the mean tokens each "
               "recipe needs to reach it (markers on the dashed line)", fontsize=10)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
