"""The kernel path on every mesh: configs tiny and moe_tiny (shrunk), 2 training steps, on 4 simulated CPU devices,
for each mesh x impl x recipe. impl "xla" is the XLA path; "pallas" turns every kernel on (FP4JAX_DEFAULT_IMPL=
pallas: the path an on-device proof can choose, here run by the Pallas interpreter).

The two impls' losses agree within LOSS_RTOL. The quantize kernels are bit-exact with their twins; the Pallas
GEMM (kernels.scaled_matmul: dequantize, then a bf16 x bf16 dot in float32) sums K in tiles where the XLA path's
one dot sums it in XLA's order. Float32 sums in another order differ by a few ulp (~1e-7 relative); where such a
difference moves a value across an FP4 rounding boundary of the next quantize, that element moves by a grid
step, and the second step's loss sees the first step's update through Adam. LOSS_RTOL (1e-3) allows a few such
flips in a loss of ~5.5 and is far below what a wrong kernel gives (a wrong block or scale moves the first
loss by more than 1e-2). mxfp8, quartet2 and tetrajet2 have no kernel on their path (their formats, MXFP8, Four
Over Six NVFP4, MS-EDEN and DBQ, quantize in XLA), so there the two impls compile one program (the pallas cell's
compile is served by the xla cell's cache entry): their cells test that each recipe trains on each mesh.

Measured (2026-12-03, 2-core Intel Xeon (KVM), jax 0.10.2, the machine shared,
`python -m pytest -q -m slow tests/test_mesh_matrix.py -p no:xdist -s`): 100 cells (tiny 40, moe_tiny 60) pass,
the two impls' losses bit-identical in every cell (largest relative difference 0 for tiny and for moe_tiny), in
27:58 (tiny 11 min, moe_tiny 17) with the compilation cache already holding the programs; the default slice's
losses are bit-identical too.

The full product and its slice are slow (``-m slow``). The slice: moe_tiny's E block alone on data 2 x expert
2 in nvfp4, each impl (the grouped GEMMs' quantize of a one-block axis under data sharding, and the kernels
inside the expert-parallel shard_map: the two failures of the kernel path on a mesh), in one subprocess that
shares the persistent compilation cache of the suite (about 2 min of CPU). The default suite's representatives:
tests/test_mesh_primitives.py (the quantize and the dense dot on row-sharded inputs of one block in NVFP4 and
MXFP4, the kernels and the grouped dot inside ``shard_map``) and tests/test_train_micro_batches.py (moe_tiny
trained with expert parallelism on 8 devices); every line the slice runs is run by the default suite too
(``scripts/coverage_gap.py --by_test``, docs/PERF.md "The test suite's time").
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import shrunken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
TIMEOUT_S = 3000
LOSS_RTOL = 1e-3

RECIPES = ("nvfp4", "mxfp4", "mxfp8", "quartet2", "tetrajet2")
IMPLS = ("xla", "pallas")
# mesh name -> (data, fsdp, expert, tensor); expert meshes for moe_tiny only (its 4 routed experts split 4 ways).
# "1" runs on one device, the others on DEVICES.
MESHES = {"1": (1, 1, 1, 1), "fsdp4": (1, 4, 1, 1), "data2_fsdp2": (2, 2, 1, 1), "expert4": (1, 1, 4, 1),
          "data2_expert2": (2, 1, 2, 1), "tensor2": (2, 1, 1, 2)}
CONFIGS = ("tiny", "moe_tiny")
# moe_tiny made tiny: one Mamba and one E block (4 experts, 2 per token, latent 16: a one-block quantized axis),
# nothing kept in bf16, so the experts' GEMMs run in the recipe's formats.
SHRUNKEN_MOE = dict(d_model=32, pattern="ME", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
                    ssm_head_dim=16, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, moe_latent_size=16,
                    n_group=2, topk_group=2, bf16_first_blocks=0, bf16_last_blocks=0)
# model fields per config name; "moe_tiny_e" (the default suite's): the E block alone, a third of the compile.
MODELS = {"tiny": {}, "moe_tiny": SHRUNKEN_MOE, "moe_tiny_e": dict(SHRUNKEN_MOE, pattern="E")}

_DRIVER = r"""
import json, os, sys, tempfile
sys.path.insert(0, {root!r})
import jax
from configs import shrunken
from training import trainer
out = {{}}
for cell in {cells!r}:
  config_name, mesh, impl, recipe = cell
  os.environ["FP4JAX_DEFAULT_IMPL"] = impl
  overrides = {{"data.seq_len": 32, "batch_size": 8, "eval.batches": 0}}   # train losses only: no eval program
  data, fsdp, expert, tensor = {meshes!r}[mesh]
  overrides.update({{"mesh.data": data, "mesh.fsdp": fsdp, "mesh.expert": expert, "mesh.tensor": tensor}})
  c = shrunken.shrunken_config(steps=2, recipe=recipe, **overrides)
  if config_name != "tiny":
    c.model.preset = "moe_tiny"
  for k, v in {models!r}[config_name].items():
    c.model[k] = v
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(c, workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      losses = [r["last_loss"] for r in map(json.loads, f) if r["kind"] == "train"]
  out["/".join(cell)] = losses
  print("CELL " + "/".join(cell) + " " + json.dumps(losses), flush=True)
print("RESULT " + json.dumps(dict(out, devices=jax.device_count())))
"""


def run_cells(cells) -> dict:
  """{"config/mesh/impl/recipe": [loss of step 1, loss of step 2]} for ``cells``: one subprocess per device count
  (a mesh's product of axes: 1 or DEVICES simulated CPU devices)."""
  out = {}
  for devices in sorted({math.prod(MESHES[c[1]]) for c in cells}):
    out.update(_run(devices, [tuple(c) for c in cells if math.prod(MESHES[c[1]]) == devices]))
  return out


def _run(devices, cells) -> dict:
  env = dict(os.environ, **shrunken.compilation_cache_env(),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  code = _DRIVER.format(root=ROOT, cells=cells, meshes=MESHES, models=MODELS)
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=TIMEOUT_S)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  assert out.pop("devices") == devices
  return out


def product(configs=CONFIGS, meshes=tuple(MESHES), recipes=RECIPES):
  """Every (config, mesh, impl, recipe) cell the configs support (expert meshes: moe_tiny only)."""
  return [(c, m, i, r) for c in configs for m in meshes for r in recipes for i in IMPLS
          if c != "tiny" or MESHES[m][2] == 1]


def check_impls_agree(losses: dict):
  """Each cell's two impls train (finite losses, 2 steps) and agree within LOSS_RTOL."""
  pairs = {}
  for key, value in losses.items():
    config, mesh, impl, recipe = key.split("/")
    pairs.setdefault((config, mesh, recipe), {})[impl] = np.asarray(value)
  worst = 0.0
  for cell, by_impl in sorted(pairs.items()):
    xla, pallas = by_impl["xla"], by_impl["pallas"]
    assert xla.shape == pallas.shape == (2,), (cell, by_impl)
    assert np.isfinite(xla).all() and np.isfinite(pallas).all(), (cell, by_impl)
    worst = max(worst, float(np.max(np.abs(pallas - xla) / np.abs(xla))))
    np.testing.assert_allclose(pallas, xla, rtol=LOSS_RTOL, atol=0, err_msg=str(cell))
  return worst


SLICE = [("moe_tiny_e", "data2_expert2", impl, "nvfp4") for impl in IMPLS]


@pytest.mark.slow   # the default representatives: the module docstring
def test_kernel_path_trains_on_a_mesh_slice():
  check_impls_agree(run_cells(SLICE))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_kernel_path_trains_on_every_mesh(config):
  worst = check_impls_agree(run_cells(product(configs=(config,))))
  print(f"{config}: largest relative loss difference between the impls {worst:.3g}")
