"""The shared amaxes of a token-sharded operand (``quantizers.shared_amaxes``) on an 8-device mesh: each device
reduces its rows to per-chunk partials, the partials are gathered, and one reduction finishes them.

A reduction to a scalar of a sharded array is, in the partitioned program, a local reduction (two launches on
a GPU for a large operand: XLA reduces to partials, then the partials), a gather of each device's scalar and a
reduction of those: three launches per amax, at every quantized linear's x and dy. Gathering the partials
(``primitives.sharding.replicated``) leaves two. The compiled program is read (the gathered shapes), and the
amaxes equal one device's, bit for bit.

Runs in a subprocess because the device count must be set before jax initializes.
"""
import json
import math
import os
import subprocess
import sys
import textwrap

from configs import shrunken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, C = 512, 64   # 64 token rows per device: 4 chunks of 16 each

_SCRIPT = textwrap.dedent(r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from fp4jax import quantizers, recipes

    T, C = {shape}
    roles = recipes.get("nvfp4").roles
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    x1 = jnp.asarray(np.random.default_rng(0).standard_normal((T, C)) * 3, jnp.bfloat16)
    f = jax.jit(lambda x: quantizers.shared_amaxes(roles.fprop_x, roles.wgrad_x, x))
    with jax.set_mesh(mesh):
      x = jax.device_put(x1, NamedSharding(mesh, P("fsdp")))
      text = f.lower(x).compile().as_text()
      got = f(x)
    shapes = lambda op: [[int(d) for d in s.split(",") if d]
                         for result in re.findall(rf"= (.*?) {{op}}(?:-start)?\(", text)
                         for s in re.findall(r"\w+\[([\d,]*)\]", result)]
    ref = f(x1)
    print("RESULT" + json.dumps(dict(
        all_gather=shapes("all-gather"), all_reduce=shapes("all-reduce"),
        equal=all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, ref)))))
""").format(shape=(T, C))


def test_shared_amaxes_gather_the_partials():
  env = dict(os.environ, **shrunken.compilation_cache_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  row = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
  assert row["equal"], "the amaxes on the mesh differ from one device's"
  assert [T // 16, 8] in row["all_gather"], f"the per-chunk partials were not gathered: {row}"
  assert not row["all_reduce"] and not [s for s in row["all_gather"] if math.prod(s) == 8], \
      f"each device's amax crossed the mesh: {row}"
