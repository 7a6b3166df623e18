"""Numerics of real tensors: SQNR per format and gradient fidelity per recipe, from a trained checkpoint.

  python -m experiments.numerics_study --run runs/study_cpu/bf16/seed0 --out results/study_cpu/numerics.md

Legend: M tokens (batch x sequence, flattened), K a linear layer's input width, N its output width.

1. Restore the run's parameters (latest checkpoint) and take one validation batch of its data.
2. Forward and backward of the unquantized model with every block linear layer intercepted: its input
   x_MxK, its kernel w_KxN, the loss gradient at its output dy_MxN (a zero "tap" added to the output and
   differentiated) and its weight gradient dw_KxN.
3. SQNR = 10 log10(|t|² / |t - dq(q(t))|²) of each tensor in each format, quantized along the axis its GEMM
   reduces (w and x along K for fprop, dy along N for dgrad; xᵀ and dyᵀ along M for wgrad, with and without
   the 16-point RHT). Zero padding to whole blocks changes no scale, as in ``fp4jax.dot``.
4. For each recipe, the full-model gradient on the same parameters, batch and key, against the unquantized
   one: cosine similarity over all parameters and per quantized layer, and the relative norm error. For
   recipes with stochastic rounding the mean gradient over several keys is compared too (SR is unbiased,
   so averaging should move it towards the reference; round-to-nearest bias does not average out).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from ml_collections import config_dict

import fp4jax
from fp4jax.dot import needs_key
from models.lm import LanguageModel
from models.report import describe_linear_layers
from training import config as config_lib
from training import data as data_lib
from training.trainer import cross_entropy

STUDY_RECIPES = ("fp8", "mxfp4", "nvfp4", "nvfp4_no_sr", "nvfp4_no_rht", "nvfp4_no_2d", "nvfp4_all_fp4")
FORMATS = {  # name -> (fmt, kwargs for weights, kwargs for 1D operands)
    "nvfp4 1x16": ("nvfp4", {}, {}),
    "nvfp4 16x16": ("nvfp4", {"tile": (16, 16)}, None),
    "mxfp4 1x32": ("mxfp4", {}, {}),
    "fp8 1x128": ("fp8", {}, {}),
    "fp8 128x128": ("fp8", {"tile": (128, 128)}, None),
}
_BLOCK = {"nvfp4": 16, "mxfp4": 32, "fp8": 128}


# ------------------------------------------------------------------------------------------- helpers

def _pad_to(x, multiples: dict[int, int]):
  pads = [(0, (-x.shape[a]) % multiples.get(a, 1)) for a in range(x.ndim)]
  return jnp.pad(x, pads)


def sqnr_db(t, fmt: str, *, axis: int = -1, tile=None, rounding: str = "nearest", key=None,
            rht_size: int | None = None) -> float:
  """SQNR (dB) of ``t`` (2-D) quantized to ``fmt`` in blocks along ``axis`` (or ``tile``), zero-padded.

  With ``rht_size`` the RHT along ``axis`` is applied first; it is orthogonal, so the error is measured
  in the rotated basis (equal to the error after the inverse transform).
  """
  t = np.asarray(t, np.float32)
  if key is None:
    key = jax.random.key(0)
  signal, noise = _sqnr_parts(t, key, fmt=fmt, axis=axis % t.ndim, tile=tile, rounding=rounding,
                              rht_size=rht_size)
  signal, noise = float(signal), float(noise)
  return 10.0 * math.log10(signal / noise) if noise > 0 else float("inf")


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "tile", "rounding", "rht_size"))
def _sqnr_parts(t, key, *, fmt, axis, tile, rounding, rht_size):
  if tile is not None:
    padded = _pad_to(t, {0: tile[0], 1: tile[1]})
  else:
    padded = _pad_to(t, {axis: math.lcm(_BLOCK[fmt], rht_size or 1)})
  if rht_size:
    padded = fp4jax.rht(padded, axis=axis, size=rht_size)
  q = fp4jax.quantize(padded, fmt, axis=axis, tile=tile, rounding=rounding,
                      key=key if rounding == "stochastic" else None)
  err = fp4jax.dequantize(q, jnp.float32) - padded
  return jnp.sum(padded ** 2), jnp.sum(err ** 2)


def _cosine(a, b) -> float:
  a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
  denom = np.linalg.norm(a) * np.linalg.norm(b)
  return float(a @ b / denom) if denom > 0 else float("nan")


def _rel_err(a, ref) -> float:
  a, ref = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(ref, np.float64))
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


# --------------------------------------------------------------------------------- model and data

def load_run(run_dir: str, batch_size: int):
  """(model config, run config, params, tokens_BxW) of a run directory (config.json + checkpoints/)."""
  with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
    plain = json.load(f)
  config = config_dict.ConfigDict(plain)
  model_config = config_lib.resolve_model_config(config.model)
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), item_names=("state", "data"))
  step = manager.latest_step()
  if step is None:
    raise SystemExit(f"error: no checkpoint under {run_dir}/checkpoints; train the run first")
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  params = restored["state"]["params"]
  tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
  _, val_split, _ = data_lib.load_splits(config.data, tokenizer)
  batch = data_lib.eval_batches(val_split, global_batch=batch_size, num_batches=1, seed=int(config.seed) + 7,
                                process_index=0, process_count=1)[0]
  return model_config, config, params, np.asarray(batch), step


def linear_layers(model_config) -> list[tuple[str, str, int, int]]:
  return describe_linear_layers(model_config, "nvfp4")


def capture(model_config, params, tokens_BxW, key):
  """Unquantized forward/backward with taps: {path: dict(x=x_MxK, w=w_KxN, dy=dy_MxN, dw=dw_KxN)}, loss."""

  layers = linear_layers(model_config)
  model = LanguageModel(model_config, recipe="bf16")
  inputs_BxL, targets_BxL = tokens_BxW[:, :-1], tokens_BxW[:, 1:]
  B, L = inputs_BxL.shape
  taps = {path: jnp.zeros((B, L, out_dim), model_config.dtype) for path, _, _, out_dim in layers}

  def loss_fn(params, taps):
    seen = {}

    def interceptor(next_fun, args, kwargs, context):
      path = "/".join(context.module.path)
      if isinstance(context.module, nn.Dense) and context.method_name == "__call__" and path in taps:
        seen[path] = args[0]
        return next_fun(*args, **kwargs) + taps[path]
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      logits = model.apply({"params": params}, inputs_BxL, rngs={"fp4": key})
    return cross_entropy(logits, targets_BxL), seen

  (loss, xs), (dparams, dtaps) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(params, taps)
  flat_w = traverse_util.flatten_dict(params, sep="/")
  flat_dw = traverse_util.flatten_dict(dparams, sep="/")
  out = {}
  for path, precision, in_dim, out_dim in layers:
    out[path] = dict(precision=precision, x=np.asarray(xs[path], np.float32).reshape(-1, in_dim),
                     w=np.asarray(flat_w[path + "/kernel"], np.float32),
                     dy=np.asarray(dtaps[path], np.float32).reshape(-1, out_dim),
                     dw=np.asarray(flat_dw[path + "/kernel"], np.float32))
  return out, float(loss), dparams


def recipe_model(model_config, name: str):
  """(LanguageModel, label) for a study recipe name; ``nvfp4_all_fp4`` is nvfp4 with no bf16 blocks."""
  if name == "nvfp4_all_fp4":
    return LanguageModel(model_config.replace(bf16_first_blocks=0, bf16_last_blocks=0), recipe="nvfp4")
  return LanguageModel(model_config, recipe=name)


def gradients(model, params, tokens_BxW, key):

  def loss_fn(p, k):
    logits = model.apply({"params": p}, tokens_BxW[:, :-1], rngs={"fp4": k})
    return cross_entropy(logits, tokens_BxW[:, 1:])

  return jax.jit(jax.value_and_grad(loss_fn))(params, key)


# ------------------------------------------------------------------------------------------- study

def sqnr_tables(taps: dict, key) -> tuple[list[dict], list[dict]]:
  """Per layer: SQNR of w, x, dy per format; and the wgrad operands along tokens with and without RHT."""
  per_format, wgrad = [], []
  for path, t in taps.items():
    row = dict(layer=path, precision=t["precision"])
    for name, (fmt, w_kw, a_kw) in FORMATS.items():
      row[("w", name)] = sqnr_db(t["w"], fmt, axis=0, **w_kw)  # w_KxN: blocks along K (fprop)
      if a_kw is not None:
        row[("x", name)] = sqnr_db(t["x"], fmt, axis=-1)          # x_MxK along K (fprop)
        row[("dy", name)] = sqnr_db(t["dy"], fmt, axis=-1)        # dy_MxN along N (dgrad)
    row[("dy", "nvfp4 1x16 SR")] = sqnr_db(t["dy"], "nvfp4", axis=-1, rounding="stochastic",
                                           key=jax.random.fold_in(key, len(per_format)))
    per_format.append(row)
    wrow = dict(layer=path, precision=t["precision"])
    for kind in ("x", "dy"):
      wrow[(kind, "plain")] = sqnr_db(t[kind], "nvfp4", axis=0)              # along M: wgrad operand
      wrow[(kind, "rht16")] = sqnr_db(t[kind], "nvfp4", axis=0, rht_size=16)
      wrow[(kind, "mxfp4 rht32")] = sqnr_db(t[kind], "mxfp4", axis=0, rht_size=32)
    wgrad.append(wrow)
  return per_format, wgrad


def gradient_table(model_config, params, tokens_BxW, key, recipes_: tuple[str, ...], draws: int,
                   ref_grads, ref_loss: float) -> list[dict]:
  flat_ref = traverse_util.flatten_dict(ref_grads, sep="/")
  layers = linear_layers(model_config)
  ref_all = np.concatenate([np.ravel(v) for v in flat_ref.values()])
  rows = []
  for name in recipes_:
    model = recipe_model(model_config, name)
    base = "nvfp4" if name == "nvfp4_all_fp4" else name
    stochastic = needs_key(fp4jax.recipes.get(base))
    n = draws if stochastic else 1
    losses, grads = [], []
    for i in range(n):
      loss, g = gradients(model, params, tokens_BxW, jax.random.fold_in(key, 1000 + i))
      losses.append(float(loss))
      grads.append(traverse_util.flatten_dict(jax.device_get(g), sep="/"))
    first = grads[0]
    mean = {k: np.mean([g[k] for g in grads], axis=0) for k in first}
    quant_layers = [p for p, prec, _, _ in layers
                    if name == "nvfp4_all_fp4" or prec != "bf16"]
    per_layer = [_cosine(first[p + "/kernel"], flat_ref[p + "/kernel"]) for p in quant_layers]
    all_first = np.concatenate([np.ravel(first[k]) for k in flat_ref])
    all_mean = np.concatenate([np.ravel(mean[k]) for k in flat_ref])
    rows.append(dict(recipe=name, loss_gap=100.0 * (losses[0] - ref_loss) / ref_loss,
                     cos_all=_cosine(all_first, ref_all), rel_err=_rel_err(all_first, ref_all),
                     cos_layer_mean=float(np.mean(per_layer)), cos_layer_min=float(np.min(per_layer)),
                     draws=n, cos_all_mean=_cosine(all_mean, ref_all) if n > 1 else None,
                     per_layer=dict(zip(quant_layers, per_layer))))
  return rows


def render(run_dir, step, model_config, tokens_shape, ref_loss, per_format, wgrad, grad_rows) -> str:
  def mean_over(rows, key):
    vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return float(np.mean(vals)) if vals else float("nan")

  lines = [f"# Numerics on real tensors: `{run_dir}` step {step}", "",
           f"Model pattern `{model_config.pattern}`, d_model {model_config.d_model}; one validation batch of "
           f"{tokens_shape[0]} x {tokens_shape[1] - 1} tokens; unquantized loss {ref_loss:.4f}. Tensors from the "
           "unquantized forward/backward of every block linear layer (the bf16-policy layers included).", "",
           "## SQNR (dB) per format, mean over the layers", "",
           "w_KxN is blocked along K (fprop), x_MxK along K, dy_MxN along N (dgrad). Higher is better; "
           "each 6 dB is one bit.", "",
           "| tensor | " + " | ".join(FORMATS) + " | nvfp4 1x16 SR |",
           "|---|" + "---|" * (len(FORMATS) + 1)]
  for kind in ("w", "x", "dy"):
    cells = [f"{mean_over(per_format, (kind, f)):.2f}" if any((kind, f) in r for r in per_format) else "—"
             for f in FORMATS]
    sr = f"{mean_over(per_format, ('dy', 'nvfp4 1x16 SR')):.2f}" if kind == "dy" else "—"
    lines.append(f"| {kind} | " + " | ".join(cells) + f" | {sr} |")
  lines += ["", "## Wgrad operands along tokens (M): NVFP4 1x16 with and without the 16-point RHT", "",
            "| layer | x plain | x RHT-16 | dy plain | dy RHT-16 | x mxfp4 RHT-32 | dy mxfp4 RHT-32 |",
            "|---|---|---|---|---|---|---|"]
  for r in wgrad:
    lines.append(f"| {r['layer']} | {r[('x', 'plain')]:.2f} | {r[('x', 'rht16')]:.2f} | {r[('dy', 'plain')]:.2f} | "
                 f"{r[('dy', 'rht16')]:.2f} | {r[('x', 'mxfp4 rht32')]:.2f} | {r[('dy', 'mxfp4 rht32')]:.2f} |")
  lines.append(f"| **mean** | {mean_over(wgrad, ('x', 'plain')):.2f} | {mean_over(wgrad, ('x', 'rht16')):.2f} | "
               f"{mean_over(wgrad, ('dy', 'plain')):.2f} | {mean_over(wgrad, ('dy', 'rht16')):.2f} | "
               f"{mean_over(wgrad, ('x', 'mxfp4 rht32')):.2f} | {mean_over(wgrad, ('dy', 'mxfp4 rht32')):.2f} |")
  lines += ["", "## Per layer SQNR (dB), nvfp4 1x16 / nvfp4 16x16 / mxfp4 / fp8 1x128", "",
            "| layer | policy | w | x | dy |", "|---|---|---|---|---|"]
  for r in per_format:
    w = " / ".join(f"{r[('w', f)]:.1f}" for f in ("nvfp4 1x16", "nvfp4 16x16", "mxfp4 1x32", "fp8 1x128"))
    x = " / ".join(f"{r[('x', f)]:.1f}" for f in ("nvfp4 1x16", "mxfp4 1x32", "fp8 1x128"))
    dy = " / ".join(f"{r[('dy', f)]:.1f}" for f in ("nvfp4 1x16", "mxfp4 1x32", "fp8 1x128"))
    lines.append(f"| {r['layer']} | {r['precision']} | {w} | {x} | {dy} |")
  lines += ["", "## Gradients per recipe against the unquantized gradient (same params, batch, key)", "",
            "cos: cosine similarity of the gradient of all parameters; per layer: over the layers the recipe "
            "quantizes; rel. error |g - g_ref| / |g_ref|; loss gap: the quantized forward's loss vs the "
            "unquantized one. For stochastic-rounding recipes 'cos of mean' averages the gradient over the "
            "draws (different SR keys).", "",
            "| recipe | loss gap (%) | cos (all params) | rel. error | cos per layer mean | min | cos of mean (draws) |",
            "|---|---|---|---|---|---|---|"]
  for r in grad_rows:
    mean_cell = f"{r['cos_all_mean']:.5f} ({r['draws']})" if r["cos_all_mean"] is not None else "— (RNE)"
    lines.append(f"| {r['recipe']} | {r['loss_gap']:+.3f} | {r['cos_all']:.5f} | {r['rel_err']:.4f} | "
                 f"{r['cos_layer_mean']:.5f} | {r['cos_layer_min']:.5f} | {mean_cell} |")
  lines.append("")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--run", required=True, help="a run directory (config.json and checkpoints/)")
  parser.add_argument("--out", default=None, help="markdown output (default: print only)")
  parser.add_argument("--batch", type=int, default=16, help="validation sequences in the batch")
  parser.add_argument("--draws", type=int, default=4, help="SR keys averaged for 'cos of mean'")
  parser.add_argument("--recipes", default=",".join(STUDY_RECIPES))
  args = parser.parse_args(argv)

  model_config, _, params, tokens, step = load_run(args.run, args.batch)
  key = jax.random.key(0)
  taps, ref_loss, ref_grads = capture(model_config, params, tokens, key)
  per_format, wgrad = sqnr_tables(taps, key)
  grad_rows = gradient_table(model_config, params, tokens, key, tuple(r for r in args.recipes.split(",") if r),
                             args.draws, jax.device_get(ref_grads), ref_loss)
  text = render(args.run, step, model_config, tokens.shape, ref_loss, per_format, wgrad, grad_rows)
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
