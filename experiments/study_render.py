"""A study's summary written out: the Markdown tables (``summary.md``: the variants, and the expert balance
of a model with MoE blocks) and the plots (``loss_gap.png``, ``balance.png``), from ``study_summary.collect``."""
from __future__ import annotations

import math


def pm(mean: float, std: float, fmt: str) -> str:
  """"mean ± std" in ``fmt`` ("mean" alone without a spread, "—" without a mean)."""
  if not math.isfinite(mean):
    return "—"
  return f"{mean:{fmt}} ± {std:{fmt.lstrip('+')}}" if math.isfinite(std) else f"{mean:{fmt}}"


def render_markdown(s: dict) -> str:
  m, hw = s["model"], s["hardware"]
  ref = s.get("reference") or "nvfp4"
  lines = [
      f"# Recipe study `{s['name']}`",
      "",
      f"Model: `{m['preset']}` preset, pattern `{m['pattern']}`, d_model {m['d_model']}, MLP {m['mlp_dim']}, "
      f"{s['params']:,} parameters{_active(s)}; bf16 blocks: first {m['bf16_first_blocks']}, last "
      f"{m['bf16_last_blocks']}. {s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens = "
      f"{s['tokens_per_run']:,} tokens per run ({s['tokens_per_param']:.1f} tokens/parameter"
      f"{_active(s, per_token=True)}). Seeds {s['seeds']}; runs finished "
      f"{s['runs_done']}/{s['runs_total']}.",
      f"Hardware: {hardware_line(s)}, jax {hw['jax']}; "
      f"total wall time of the finished runs {s['total_wall_seconds'] / 60:.1f} min. Updated {s['updated']}.",
      "",
      "Gap = (validation loss - bf16 validation loss) / bf16 validation loss, paired by seed; "
      f"vs {ref} = gap - gap of {ref} with the same seed, in percentage points (per seed in brackets): the "
      "seeds move all variants together, so this paired difference is the sharper test of an ablation; "
      "± is the sample standard deviation over seeds. tokens/s excludes compilation; wall time is per run "
      "and includes compilation and evaluation. Both depend on what else the machine runs: on shared cores "
      "they are not comparable between variants (bench/run.py measures nvfp4 vs bf16 back to back).",
      "",
      f"| variant | what | final validation loss | gap to bf16 (%) | per seed (%) | vs {ref} (pp) | tokens/s | wall / run |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for v in s["variants"]:
    r = s["rows"][v]
    if not r["seeds"]:
      lines.append(f"| {v} | {r['description']} | not run yet | | | | | |")
      continue
    status = "" if r["statuses"] == ["done"] else f" ({', '.join(r['statuses'])})"
    per_seed = ", ".join(f"{r['gap_percent'][k]:+.2f}" for k in sorted(r["gap_percent"]))
    gap = "0 (reference)" if v == "bf16" else pm(r["gap_mean"], r["gap_std"], "+.2f")
    vs = "" if v in ("bf16", s.get("reference")) or not r.get("vs_reference_pp") else (
        pm(r["vs_reference_mean"], r["vs_reference_std"], "+.2f") + " (" +
        ", ".join(f"{r['vs_reference_pp'][k]:+.2f}" for k in sorted(r["vs_reference_pp"])) + ")")
    lines.append(f"| {v}{status} | {r['description']} | {pm(r['loss_mean'], r['loss_std'], '.4f')} | {gap} | "
                 f"{'' if v == 'bf16' else per_seed} | {vs} | {r['tokens_per_second']:,.0f} | "
                 f"{r['wall_seconds'] / 60:.1f} min |")
  lines += [
      "",
      f"Seed noise: the bf16 runs' final losses differ by {s['bf16_seed_std_percent']:.2f}% (sample std / mean "
      "over seeds); a gap smaller than that, or than its own ± over seeds, is not a result.",
  ]
  if "nvfp4_switch" in s["variants"]:
    lines.append(f"Precision switch: the last {100 * s['switch_fraction']:.0f}% of the steps (from token "
                 f"{s['switch_tokens']:,}) run the forward pass in bf16.")
  lines += [
      "",
      "![relative loss gap](loss_gap.png)",
      "",
  ]
  if s.get("balance"):
    lines += render_balance(s)
  return "\n".join(lines)


def hardware_line(s: dict) -> str:
  """This machine, or per processor the runs that ran on it when they did not all run here."""
  hw, procs = s["hardware"], s.get("processors") or {}
  here = f"{hw['cpus']} x {hw['processor']} ({hw['platform']})"
  if set(procs) <= {hw["processor"]}:
    return here
  return "; ".join(f"{p}: {', '.join(runs)}" for p, runs in procs.items()) + f" (summarized on {here})"


def _active(s: dict, per_token: bool = False) -> str:
  """", N active per token" (or ", T per active parameter") for a model with idle experts, else ""."""
  if s.get("active_params", s["params"]) == s["params"]:
    return ""
  if per_token:
    return f", {s['tokens_per_active_param']:.1f} per active parameter"
  return f" ({s['active_params']:,} active per token)"


def render_balance(s: dict) -> list[str]:
  """The expert-balance table: MaxVio and entropy averaged over the E blocks, per variant, paired with bf16."""
  b, w = s["balance"], s["balance_window"]

  def cell(v, key, fmt):
    c = b[v][key]
    if not c["per_seed"]:
      return "not run yet"
    text = pm(c["mean"], c["std"], fmt)
    if v != "bf16" and c["vs_bf16"]:
      text += (f"; vs bf16 {pm(c['vs_bf16_mean'], c['vs_bf16_std'], '+' + fmt)} ("
               + ", ".join(f"{c['vs_bf16'][k]:+{fmt}}" for k in sorted(c["vs_bf16"])) + ")")
    return text

  lines = [
      "## Expert balance",
      "",
      "Per run, each logged step's expert load (the (token, choice) pairs each routed expert received in that "
      "step's batch) gives MaxVio = max load / mean load - 1 (0: balanced) and the load's entropy / log E "
      "(1: balanced), averaged over the E blocks. *late* = the mean over the logged steps of the last "
      f"{100 * w:.0f}% of training, *final* = the last logged step. Mean ± sample std over seeds; vs bf16 = "
      "variant - bf16 with the same seed (per seed in brackets).",
      "",
      "| variant | MaxVio, late | MaxVio, final | entropy, late | entropy, final |",
      "|---|---|---|---|---|",
  ]
  for v in s["variants"]:
    lines.append(f"| {v} | {cell(v, 'late_max_vio', '.3f')} | {cell(v, 'final_max_vio', '.3f')} | "
                 f"{cell(v, 'late_entropy', '.4f')} | {cell(v, 'final_entropy', '.4f')} |")
  ref = b["bf16"]["late_max_vio"]
  lines += [
      "",
      f"Seed noise of the balance: bf16's late MaxVio {pm(ref['mean'], ref['std'], '.3f')} over seeds.",
      "",
      "![expert balance](balance.png)",
      "",
  ]
  return lines


def plot_gaps(s: dict, path: str) -> None:
  """Relative validation-loss gap to bf16 (%) against tokens, one line per variant (mean over seeds)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 4.8))
  styles = {"fp8": ("tab:green", "-"), "mxfp4": ("tab:red", "-"), "nvfp4": ("tab:blue", "-"),
            "nvfp4_no_sr": ("tab:orange", "--"), "nvfp4_no_rht": ("tab:purple", "--"),
            "nvfp4_no_2d": ("tab:brown", "--"), "nvfp4_all_fp4": ("tab:pink", ":"),
            "nvfp4_switch": ("tab:cyan", "-.")}
  for v in s["variants"]:
    curve = s["rows"][v]["gap_curve"]
    if v == "bf16" or not curve:
      continue
    color, ls = styles.get(v, (None, "-"))
    x, y = zip(*curve)
    n = len(s["rows"][v]["seeds"])
    ax.plot(x, y, ls, color=color, marker="o", ms=3, lw=1.6 if v in ("nvfp4", "mxfp4") else 1.1,
            label=f"{v} ({s['rows'][v]['gap_mean']:+.2f}%, {n} seed{'s' if n != 1 else ''})")
  ax.axhline(0.0, color="black", lw=0.8)
  if "nvfp4_switch" in s["variants"] and s["switch_fraction"] > 0:
    ax.axvline(s["switch_tokens"], color="tab:cyan", lw=0.8, alpha=0.6)
  if math.isfinite(s["bf16_seed_std_percent"]):
    ax.axhspan(-s["bf16_seed_std_percent"], s["bf16_seed_std_percent"], color="gray", alpha=0.15,
               label="bf16 seed noise (±1 std)")
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda t, _: f"{t / 1e6:g}M"))
  ax.set_xlabel("tokens")
  ax.set_ylabel("relative validation loss gap to bf16 (%)")
  ax.set_title(f"{s['name']}: {s['params']:,} params, {s['tokens_per_run'] / 1e6:.2f}M tokens "
               f"({s['tokens_per_param']:.0f}/param), mean over {len(s['seeds'])} seeds")
  ax.grid(alpha=0.3)
  # The first evaluations (still far from converged) can dwarf the end; show the second half's range well.
  ys = [y for v in s["variants"] if v != "bf16" for _, y in s["rows"][v]["gap_curve"][len(s["rows"][v]["gap_curve"]) // 3:]]
  if ys:
    lo, hi = min(ys + [0.0]), max(ys + [0.0])
    pad = 0.15 * (hi - lo or 1.0)
    ax.set_ylim(lo - pad, hi + pad)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_balance(s: dict, path: str) -> None:
  """MaxVio and load entropy (mean over the E blocks and the seeds) against tokens, one line per variant."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  tokens_per_step = s["batch_size"] * s["seq_len"]
  for v in s["variants"]:
    curve = s["balance_curves"].get(v)
    if not curve:
      continue
    steps, max_vio, entropy = zip(*curve)
    x = [st * tokens_per_step / 1e6 for st in steps]
    lw = 1.8 if v == "bf16" else 1.1
    axes[0].plot(x, max_vio, lw=lw, label=f"{v} ({s['balance_curve_seeds'][v]} seeds)")
    axes[1].plot(x, entropy, lw=lw, label=v)
  for ax, label in zip(axes, ("MaxVio (0: balanced)", "load entropy / log E (1: balanced)")):
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.axvline((1 - s["balance_window"]) * s["tokens_per_run"] / 1e6, color="gray", lw=0.8, ls=":")
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=8, loc="best")
  fig.suptitle(f"{s['name']}: expert balance, mean over the E blocks and the seeds (dotted: start of 'late')")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
