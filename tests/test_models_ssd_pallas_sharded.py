"""The Pallas SSD kernels inside a sharded program (``ssd_pallas.partition_specs``: a ``shard_map`` over
the batch and head axes), on 4 host CPU devices in the Pallas interpreter, against the unsharded
``ssd_chunked``: forward (y, final state) and every gradient.

Tolerance: each output within 1e-5 of its largest magnitude. Both are float32 and differ only in
summation order (the kernel's chunk of 16 vs the same chunk in ``ssd_chunked``, dD and dA summed across
shards); a wrong shard (a head read with another group's B and C, a missing sum over the batch shards)
is off by the size of the values themselves.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5

_DRIVER = """
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from models import ssd_pallas
from training import sharding as sh

TILES = ssd_pallas.SsdTiles(chunk=16, state_p=16)
mesh = jax.make_mesh(sh.mesh_shape(dict(data=1, fsdp=2, tensor=2), 4), sh.MESH_AXES,
                     axis_types=(jax.sharding.AxisType.Auto,) * len(sh.MESH_AXES))
NAMES = ("dx", "ddt", "da", "db", "dc", "dd", "ds0", "y", "final")

def grads(impl, cy, cf):
  def f(x, dt, a, b, c, d, s0):
    y, final = ssd_pallas.ssd(x, dt, a, b, c, chunk_size=TILES.chunk, d_H=d, initial_state_BxHxPxN=s0,
                              impl=impl, tiles=TILES, interpret=True)
    return jnp.sum(y * cy) + jnp.sum(final * cf), (y, final)
  return jax.jit(jax.grad(f, argnums=tuple(range(7)), has_aux=True))

out = {{"devices": jax.device_count()}}
for B, L, H, G in ((2, 40, 4, 2), (2, 24, 2, 1)):   # heads split over tensor; G = 1: heads not split
  P_, N = 16, 16
  k = jax.random.split(jax.random.key(B * L + H + G), 9)
  x = jax.random.normal(k[0], (B, L, H, P_))
  dt = jax.nn.softplus(jax.random.normal(k[1], (B, L, H)) - 1.0)
  a = -jnp.exp(jax.random.uniform(k[2], (H,), minval=-1.0, maxval=1.5))
  b, c = jax.random.normal(k[3], (B, L, G, N)), jax.random.normal(k[4], (B, L, G, N))
  d, s0 = jax.random.normal(k[5], (H,)), jax.random.normal(k[6], (B, H, P_, N))
  cy, cf = jax.random.normal(k[7], (B, L, H, P_)), jax.random.normal(k[8], (B, H, P_, N))
  ref = grads("xla", cy, cf)(x, dt, a, b, c, d, s0)
  bat, hd = ("data", "fsdp"), "tensor"
  put = lambda t, *spec: jax.device_put(t, NamedSharding(mesh, P(*spec)))
  args = (put(x, bat, None, hd), put(dt, bat, None, hd), put(a, hd), put(b, bat), put(c, bat), put(d, hd),
          put(s0, bat, hd))
  with sh.mesh_context(mesh):
    specs = ssd_pallas.partition_specs(B, H, G)
    fn = grads("pallas", cy, cf)
    text = fn.lower(*args).as_text()
    res = fn(*args)
  r = {{"specs": str(specs), "manual": "sdy.manual_computation" in text or "shard_map" in text}}
  for name, want, got in zip(NAMES, jax.tree.leaves(ref), jax.tree.leaves(res)):
    want, got = np.asarray(want), np.asarray(got)
    r[name] = float(np.abs(want - got).max() / np.abs(want).max())
  out[f"{{B}}x{{L}}x{{H}}x{{G}}"] = r
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow   # ~45 s (8 host devices in a subprocess); test_models_ssd_pallas checks the kernel unsharded
def test_sharded_kernel_equals_unsharded_chunked():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", _DRIVER.format(root=ROOT)], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  res = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
  print(json.dumps(res, indent=1))
  assert res["devices"] == 4
  split, whole = res["2x40x4x2"], res["2x24x2x1"]
  assert "'tensor'" in split["specs"] and "'fsdp'" in split["specs"], split["specs"]
  assert "'tensor'" not in whole["specs"] and "'fsdp'" in whole["specs"], whole["specs"]
  for r in (split, whole):
    assert r["manual"]
    for name in ("y", "final", "dx", "ddt", "da", "db", "dc", "dd", "ds0"):
      assert r[name] <= TOL, (name, r)


def test_no_mesh_no_partition():
  from models import ssd_pallas   # pylint: disable=import-outside-toplevel
  assert ssd_pallas.partition_specs(2, 4, 2) is None
