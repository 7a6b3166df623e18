"""The fused producers (fp4jax.fused) on an 8-device FSDP mesh, into the dot of an FSDP weight: each device
normalizes (or squares) and quantizes its own rows, and the fprop GEMM gathers the weight, not the tokens.

Without a partitioning rule the producer's Pallas kernel had its operands replicated: every device gathered
the whole batch, and the next GEMM contracted over its shard of the weight's K with all the tokens and
summed float32 (tokens x N) partial products across the devices (docs/PERF.md, "The contraction-partitioned
GEMM"). The compiled program is read: no GEMM over the batch's global rows, no gather of the activation and
no all-reduce of a (tokens x N) buffer; y and dx equal the same program's on one device, bit for bit.

Runs in a subprocess because the device count must be set before jax initializes. The default suite compiles
the norm's kernel path (the MLP's input layer); the relu² producer and the values run with ``-m slow``.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from configs import shrunken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, L, D, F = 8, 32, 128, 384   # 256 tokens over fsdp 8: 32 rows per device; D / 8 = 16, one NVFP4 block

_SCRIPT = textwrap.dedent(r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import fp4jax
    from fp4jax import fused

    cases, check_values = json.loads(sys.argv[1]), sys.argv[2] == "1"
    B, L, D, F = {shape}
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)

    def producer(name, impl):
      if name == "rmsnorm_quantize":
        return lambda x: fused.rmsnorm_quantize(x, jnp.linspace(0.5, 1.5, D), "nvfp4", eps=1e-5, impl=impl)
      return lambda x: fused.relu2_quantize(x, "nvfp4", impl=impl)

    def loss(name, impl):
      def f(x, w):
        y = fp4jax.dot(producer(name, impl)(x), w, recipe="nvfp4", key=jax.random.key(0))
        return jnp.sum(jnp.square(y.astype(jnp.float32)))
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    def rows(name, impl):   # y and dx: row by row, no sum across the devices (whose order the mesh changes)
      def f(x, w):
        fwd = lambda x: fp4jax.dot(producer(name, impl)(x), w, recipe="nvfp4", key=jax.random.key(0))
        y, vjp = jax.vjp(fwd, x)
        return y, vjp(jnp.cos(y))[0]
      return jax.jit(f)

    out = {{}}
    for name, impl in cases:
      k, n = (D, F) if name == "rmsnorm_quantize" else (F, D)
      x1, w1 = normal(B, L, k), normal(k, n)
      with jax.set_mesh(mesh):
        x, w = put(x1, "fsdp"), put(w1, "fsdp", None)   # w: K over fsdp, as FSDP keeps it
        f = loss(name, impl)
        text = f.lower(x, w).compile().as_text()
        shapes = lambda op: [tuple(int(d) for d in s.split(",") if d)   # every result of every such op
                             for result in re.findall(rf"= (.*?) {{op}}\(", text)
                             for s in re.findall(r"\w+\[([\d,]*)\]", result)]
        row = dict(dots=shapes("dot"), all_gather=shapes("all-gather"),
                   reduced=shapes("all-reduce") + shapes("reduce-scatter"))
        got = rows(name, impl)(x, w) if check_values else None
      if check_values:   # the same program on one device: only the partitioning differs
        ref = rows(name, impl)(x1, w1)
        row["equal"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
      out[f"{{name}}/{{impl}}"] = row
    print("RESULT" + json.dumps(out))
""").format(shape=(B, L, D, F))


def _run(cases, check_values: bool) -> dict:
  env = dict(os.environ, **shrunken.compilation_cache_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases), "1" if check_values else "0"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])


def _check_local(row, n_out: int):
  """Every GEMM and collective of the step sized for the local rows (module docstring)."""
  rows, local = B * L, B * L // 8
  row = {k: [tuple(s) for s in v] if isinstance(v, list) else v for k, v in row.items()}
  assert not [s for s in row["dots"] if rows in s], f"a GEMM over the global {rows} rows: {row['dots']}"
  assert (local, n_out) in row["dots"], f"no fprop GEMM over the {local} local rows: {row['dots']}"
  assert not [s for s in row["reduced"] if rows in s or (local, n_out) == s], \
      f"activations summed across devices: {row['reduced']}"
  assert not [s for s in row["all_gather"] if rows in s], f"the tokens were gathered: {row['all_gather']}"


def test_norm_kernel_keeps_rows_local():
  results = _run([("rmsnorm_quantize", "pallas")], check_values=False)
  _check_local(results["rmsnorm_quantize/pallas"], F)


@pytest.mark.slow   # ~2 min: both producers, both impls, values against one device
def test_producers_keep_rows_local_and_equal_one_device():
  cases = [(name, impl) for name in ("rmsnorm_quantize", "relu2_quantize") for impl in ("pallas", "xla")]
  results = _run(cases, check_values=True)
  for name, impl in cases:
    row = results[f"{name}/{impl}"]
    _check_local(row, F if name == "rmsnorm_quantize" else D)
    assert row["equal"], f"{name} impl={impl}: y or dx on the mesh differ from one device's"
