"""bench/predict/pgle_profile.py: the ruler's costs of a compiled program, written as the profile XLA's
latency-hiding scheduler reads, change the schedule of a deviceless GPU compile (the prediction of
config.pgle_steps, training/pgle.py).

The program: a reduce-scatter across two HGX nodes (16 GPUs) beside a chain of twelve GEMMs it does not depend
on. Without a profile, where its speed-of-light model does not take the module (turned off here, as a ragged
all-to-all turns it off for Super), XLA prices every collective at five kernels and starts it late; with the
ruler's costs (the reduce-scatter crosses the network) it starts it earlier, with more of the chain inside it,
and the ruler finds less of it exposed."""
import json
import os
import subprocess
import sys

import pytest

from fp4jax import _platform
from test_gpu_aot import ROOT, needs_plugin   # pylint: disable=import-error

SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bench.predict import pgle_profile, ruler
from bench.predict.deviceless import gpu_devices

mesh = Mesh(np.array(gpu_devices("b200", 16)), ("f",))
sh = lambda *s: NamedSharding(mesh, P(*s))

def f(a, w, x, v):
  y = a @ w                    # contracts over the sharded dimension: a reduce-scatter
  for _ in range(12):
    x = jnp.tanh(x @ v)        # independent of y
  return y, x

spec = lambda *s: jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=sh(*s))
lowered = jax.jit(f, out_shardings=(sh("f", None), sh("f", None))).lower(
    spec(None, "f"), spec("f", None), spec("f", None), spec(None, None))
# XLA's speed-of-light model off, as for a module with a collective it does not take (Super's ragged all-to-all)
options = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_analytical_sol_latency_estimator": False}
first = lowered.compile(options).as_text()
profile = pgle_profile.costs(first, "b200", "hgx_b200")
path = sys.argv[1]
pgle_profile.write(profile, path)
second = lowered.compile(dict(options, xla_gpu_pgle_profile_file_or_directory_path=path)).as_text()

def inside(text):
  entry = text[text.index("ENTRY"):]
  names = [m.group(1) for m in re.finditer(r"^  (?:ROOT )?%([\w.\-]+) =", entry, re.M)]
  return names.index("reduce-scatter-done") - names.index("reduce-scatter-start")

p = ruler.predict(first, "b200", "hgx_b200")
print(json.dumps(dict(
    profile=profile, inside=[inside(first), inside(second)],
    exposed=[p["exposed_comm_s"], ruler.predict(second, "b200", "hgx_b200")["exposed_comm_s"]],
    rs_seconds=[c["seconds"] for c in p["each_collective"] if c["kind"] == "reduce-scatter"],
    kernels=sorted(p["op_seconds"]), text_lines=len(open(path).read().splitlines()))))
"""


@needs_plugin
def test_the_rulers_profile_starts_the_collective_earlier(tmp_path):
  env = _platform.deviceless_env()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "p.pbtxt")], env=env, capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  profile = out["profile"]
  assert out["text_lines"] == len(profile)
  [rs] = out["rs_seconds"]
  assert profile["reduce-scatter-start"] == pytest.approx(rs * 1e6, rel=1e-6)   # across the network: the ruler's
  assert rs > 20e-6
  assert len(out["kernels"]) >= 12 and all(v > 0 for v in profile.values())
  before, after = out["inside"]
  assert after > before, out["inside"]           # more of the chain runs while the reduce-scatter travels
  assert out["exposed"][1] < out["exposed"][0], out["exposed"]
