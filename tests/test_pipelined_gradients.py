"""configs/nemotron3_super.py sends a layer's gradient across the nodes during the next layer's kernels: in a
deviceless GPU compile on two HGX nodes, the gradients summed across the nodes inside a loop over layers (nested
in the loop over micro-batches, as in Super's step) are collectives that XLA's collective pipeliner moved into
the next iteration ("is_pipelined"):
- the experts' (a psum in a shard_map, kept split over the nodes: a reduce-scatter) with the config's XLA
  options, none without their all-reduce pipelining;
- the quantized dense layers' (reduced inside their wgrad GEMM) with dx and dw released apart
  (``Recipe.release_dx_with_dw=False``, as the config's model sets it), none with the barrier."""
import json
import os
import subprocess
import sys

import pytest

from fp4jax import _platform
from test_gpu_aot import ROOT, needs_plugin   # pylint: disable=import-error

SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bench.predict.deviceless import gpu_devices
from configs import nemotron3_super

mesh = Mesh(np.array(gpu_devices("b200", 16)).reshape(2, 8), ("node", "gpu"))
sh = lambda *s: NamedSharding(mesh, P(*s))

def layer_grads(w_LxKxN, x_MxK):
  def body(h_MxK, w_KxN):
    def local(x, w):
      y = jnp.tanh(x @ w)
      return jax.lax.psum(x.T @ y, "node"), y     # this device's part of the gradient, summed across the nodes
    g, y = jax.shard_map(local, mesh=mesh, in_specs=(P(("node", "gpu")), P()),
                         out_specs=(P(), P(("node", "gpu"))), check_vma=False)(h_MxK, w_KxN)
    return y.astype(h_MxK.dtype), jax.lax.with_sharding_constraint(g.astype(jnp.bfloat16), sh("node", None))
  return jax.lax.scan(body, x_MxK, w_LxKxN)[1]

def step(w, x_NxMxK):
  micro = lambda acc, x: (acc + layer_grads(w, x).astype(jnp.float32), None)
  return jax.lax.scan(micro, jnp.zeros(w.shape, jnp.float32), x_NxMxK)[0]

w = jax.ShapeDtypeStruct((6, 512, 512), jnp.bfloat16, sharding=sh())
x = jax.ShapeDtypeStruct((4, 16 * 256, 512), jnp.bfloat16, sharding=sh(None, ("node", "gpu")))
lowered = jax.jit(step, out_shardings=sh(None, "node")).lower(w, x)
out = {}
for kind, options in nemotron3_super.get_config().xla_options.items():
  options = dict(options)
  if not options.get("xla_gpu_enable_pipelined_all_reduce"):
    continue
  for name, o in [("config", options), ("without", dict(options, xla_gpu_enable_pipelined_all_reduce=False))]:
    starts = re.findall(r"reduce-scatter-start\(.*", lowered.compile(o).as_text())
    out[f"{kind} {name}"] = [len(starts), sum('"is_pipelined":true' in s for s in starts)]
print(json.dumps(out))
"""


DENSE = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import fp4jax
from bench.predict.deviceless import gpu_devices
from configs import nemotron3_super

mesh = Mesh(np.array(gpu_devices("b200", 16)).reshape(2, 8), ("node", "gpu"))
sh = lambda *s: NamedSharding(mesh, P(*s))
config = nemotron3_super.get_config()

def step(recipe):
  def loss(w_LxKxK, x_MxK, key):
    def layer(h, wk):
      return jnp.tanh(fp4jax.dot(h, wk[0], recipe=recipe, key=wk[1])), None
    h = jax.lax.scan(layer, x_MxK, (w_LxKxK, jax.random.split(key, len(w_LxKxK))))[0]
    return jnp.mean(h.astype(jnp.float32) ** 2)
  micro = lambda w, key: lambda acc, x: (acc + jax.grad(loss)(w, x, key).astype(jnp.float32), None)
  return lambda w, x_NxMxK, key: jax.lax.scan(micro(w, key), jnp.zeros(w.shape, jnp.float32), x_NxMxK)[0]

w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16, sharding=sh())
x = jax.ShapeDtypeStruct((2, 16 * 256, 512), jnp.bfloat16, sharding=sh(None, ("node", "gpu")))
out = {}
for release in (config.model.release_dx_with_dw, True):
  recipe = fp4jax.recipes.nvfp4(release_dx_with_dw=release)
  text = jax.jit(step(recipe), out_shardings=sh(None, "node")).lower(w, x, jax.random.key(0)).compile(
      dict(config.xla_options.b200)).as_text()
  starts = re.findall(r"(?:reduce-scatter|all-reduce)-start\(.*", text)
  out["together" if release else "apart"] = [len(starts), sum('"is_pipelined":true' in s for s in starts)]
print(json.dumps(out))
"""


def _run(script):
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_plugin
def test_super_sends_the_experts_gradients_during_the_next_layer():
  out = _run(SCRIPT)
  assert "b200 config" in out, out                  # the B200's options pipeline them (the H200's memory: none)
  for kind in {k.split()[0] for k in out}:
    starts, pipelined = out[f"{kind} config"]
    assert starts and pipelined == starts, out       # every gradient's reduce-scatter moved to the next layer
    assert out[f"{kind} without"][1] == 0, out       # XLA's default pipelines none of them


@pytest.mark.slow
@needs_plugin
def test_super_sends_the_dense_layers_gradients_during_the_next_layer():
  out = _run(DENSE)
  assert set(out) == {"apart", "together"}, out       # the config releases them apart
  starts, pipelined = out["apart"]
  assert starts and pipelined == starts, out          # every layer's wgrad reduction moved to the next layer
  assert out["together"][0] and out["together"][1] == 0, out
