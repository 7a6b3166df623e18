"""Every benchmark table in one run: numerics, the quantized dot, the kernels, and train steps.

  python bench/run.py            # the default sizes (~10 min on a 2-core CPU)
  python bench/run.py --quick    # small sizes, the tiny config only (~1 min on a quiet 2-core CPU)

1. ``bench/numerics.py``: quantization error per format and quantize throughput.
2. ``bench/dot.py``: forward+backward time and residual bytes of ``fp4jax.dot`` vs bf16.
3. ``bench/kernels.py``: the Pallas kernels (prints "missing" when the file does not exist).
4. Train steps (here): for the model, batch and sequence length of ``configs/tiny.py`` and ``configs/small.py``,
   the jitted ``training.trainer.train_step`` in nvfp4 and in bf16: tokens/s (median of timed steps after
   a warm-up), compile time (lower + compile), XLA's memory analysis of the compiled step (arguments +
   outputs + temporaries - aliased) and the peak RSS of the measuring process. Each (config, recipe) is
   measured in a fresh subprocess, so RSS and compile caches do not leak between them; the persistent
   compilation cache is off. nvfp4 / bf16 ratios follow: on a CPU, or a GPU without FP4 tensor cores, the
   FP4 GEMMs are emulated, so the tokens/s ratio is the emulation's cost, not FP4's speed-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


# ----------------------------------------------------------------------------- the other benchmarks

def _supports(script: str, flag: str) -> bool:
  try:
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return False
  return flag in out.stdout


def run_script(name: str, args: list[str], quick_args: list[str], quick: bool, timeout: int) -> None:
  """Runs ``bench/<name>.py`` in a subprocess, streaming its tables; "missing" when it does not exist."""
  script = os.path.join(BENCH, f"{name}.py")
  print(f"\n## bench/{name}.py", flush=True)
  if not os.path.exists(script):
    print("missing (bench/%s.py does not exist yet)" % name, flush=True)
    return
  argv = list(quick_args if quick else args)
  if quick and "--quick" in argv and not _supports(script, "--quick"):
    argv.remove("--quick")
  print(f"$ python bench/{name}.py {' '.join(argv)}", flush=True)
  start = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, script, *argv], cwd=ROOT, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = "\n".join(l for l in proc.stdout.splitlines() if "UserWarning" not in l and "warnings.warn" not in l)
    print(out.rstrip(), flush=True)
    if proc.returncode:
      print(f"(bench/{name}.py exited with status {proc.returncode})", flush=True)
  except subprocess.TimeoutExpired:
    print(f"(bench/{name}.py timed out after {timeout} s)", flush=True)
  print(f"({time.perf_counter() - start:.0f} s)", flush=True)


# ---------------------------------------------------------------------------------------- train steps

def measure_train_step(config_name: str, recipe: str, steps: int) -> dict:
  """One (config, recipe): compile time, step time, memory. Runs in its own process (see ``--_measure``)."""
  sys.path.insert(0, ROOT)
  import functools  # pylint: disable=g-import-not-at-top
  import importlib  # pylint: disable=g-import-not-at-top
  import resource  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import fp4jax  # pylint: disable=g-import-not-at-top
  from training import config as config_lib  # pylint: disable=g-import-not-at-top
  from training import optim, trainer  # pylint: disable=g-import-not-at-top

  config = importlib.import_module(f"configs.{config_name}").get_config()
  model_config = config_lib.resolve_model_config(config.model)
  model = trainer.build_model(model_config, fp4jax.recipes.get(recipe))
  B, L = int(config.batch_size), int(config.data.seq_len)
  tx, lr_fn = optim.make_optimizer(config.optim, int(config.steps))
  state = jax.jit(lambda: trainer._unboxed(trainer.init_state(model, tx, 0, L)))()  # pylint: disable=protected-access
  step_fn = jax.jit(functools.partial(trainer.train_step, model=model, tx=tx, lr_fn=lr_fn,
                                      micro_batches=config.micro_batches), donate_argnums=(0,))
  tokens = jax.random.randint(jax.random.key(1), (B, L + 1), 0, model_config.vocab_size, jnp.int32)
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, tokens).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla_bytes = None
  if mem is not None:
    xla_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                    - mem.alias_size_in_bytes)
  state, metrics = compiled(state, tokens)  # warm-up
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, tokens)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
  return dict(config=config_name, recipe=recipe, params=n_params, batch=B, seq_len=L, compile_s=compile_s,
              step_s=step_s, tokens_per_s=B * L / step_s, xla_bytes=xla_bytes,
              temp_bytes=int(mem.temp_size_in_bytes) if mem is not None else None,
              peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              loss=float(metrics["loss"]))


def train_step_table(configs: dict[str, int], timeout: int) -> None:
  """``configs``: config name -> number of timed steps (after one warm-up step)."""
  print("\n## Train step: nvfp4 vs bf16 (training.trainer.train_step, jitted, donated state)", flush=True)
  rows = {}
  for name, steps in configs.items():
    for recipe in ("bf16", "nvfp4"):
      cmd = [sys.executable, os.path.abspath(__file__), "--_measure", f"{name}:{recipe}:{steps}"]
      try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
      except subprocess.TimeoutExpired:
        print(f"{name} {recipe}: timed out after {timeout} s", flush=True)
        continue
      line = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      if proc.returncode or not line:
        print(f"{name} {recipe}: failed (status {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
        continue
      rows[(name, recipe)] = r = json.loads(line[-1])
      print(f"  measured {name} {recipe}: {r['tokens_per_s']:,.0f} tokens/s (median of {steps} steps)", flush=True)
  mib = lambda b: "—" if b is None else f"{b / 2**20:.1f}"
  print("\n| config | params | batch x seq | recipe | tokens/s | ms/step | compile s | XLA memory MiB "
        "| temporaries MiB | peak RSS MiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for (name, recipe), r in rows.items():
    print(f"| {name} | {r['params']:,} | {r['batch']} x {r['seq_len']} | {recipe} | {r['tokens_per_s']:,.0f} | "
          f"{1e3 * r['step_s']:.1f} | {r['compile_s']:.1f} | {mib(r['xla_bytes'])} | {mib(r['temp_bytes'])} | "
          f"{mib(r['peak_rss_bytes'])} |")
  print("\nRatios nvfp4 / bf16 (same config, same run):")
  print("| config | tokens/s | compile time | XLA memory | temporaries | peak RSS |")
  print("|---|---|---|---|---|---|")
  ratio = lambda a, b: "—" if not a or not b else f"{a / b:.2f}x"
  for name in configs:
    if (name, "bf16") in rows and (name, "nvfp4") in rows:
      q, b = rows[(name, "nvfp4")], rows[(name, "bf16")]
      print(f"| {name} | {ratio(q['tokens_per_s'], b['tokens_per_s'])} | {ratio(q['compile_s'], b['compile_s'])} | "
            f"{ratio(q['xla_bytes'], b['xla_bytes'])} | {ratio(q['temp_bytes'], b['temp_bytes'])} | "
            f"{ratio(q['peak_rss_bytes'], b['peak_rss_bytes'])} |")
  print("(tokens/s below 1x is the cost of emulating FP4 where there are no FP4 tensor cores; XLA memory is "
        "the compiled step's arguments + outputs + temporaries; peak RSS includes the Python/JAX runtime.)",
        flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small sizes and the tiny config only")
  parser.add_argument("--steps", type=int, default=None,
                      help="timed train steps per measurement (default: tiny 5, small 2; --quick: tiny 3)")
  parser.add_argument("--only", default="numerics,dot,kernels,train", help="comma-separated sections")
  parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args._measure:  # pylint: disable=protected-access
    name, recipe, steps = args._measure.split(":")  # pylint: disable=protected-access
    print(json.dumps(measure_train_step(name, recipe, int(steps))), flush=True)
    return 0
  import jax  # pylint: disable=g-import-not-at-top
  only = set(args.only.split(","))
  start = time.perf_counter()
  print(f"# fp4jax benchmarks  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  "
        f"{platform.machine()} {os.cpu_count()} cpus  {jax.devices()[0].platform} ({jax.devices()[0].device_kind}) "
        f"x{jax.device_count()}  jax {jax.__version__}{'  --quick' if args.quick else ''}", flush=True)
  if "numerics" in only:
    run_script("numerics", ["--size", "2048", "--error-size", "1024", "--repeats", "3"],
               ["--size", "1024", "--error-size", "256", "--repeats", "2"], args.quick, timeout=900)
  if "dot" in only:
    run_script("dot", [], ["--quick"], args.quick, timeout=1200)
  if "kernels" in only:
    run_script("kernels", [], ["--quick"], args.quick, timeout=1200)
  if "train" in only:
    # small: 8192 tokens per step take ~30-40 s on 2 CPU cores, so fewer timed steps.
    tiny_steps = args.steps or (3 if args.quick else 5)
    train_step_table({"tiny": tiny_steps} if args.quick else {"tiny": tiny_steps, "small": args.steps or 2},
                     timeout=1200)
  print(f"\n(total {time.perf_counter() - start:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
