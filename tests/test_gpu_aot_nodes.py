"""bench/predict/gpu_aot.py compiles on the trainer's placement: 16 GPUs as 2 HGX nodes of 8 (the topology's hosts),
the mesh laid out by ``training.sharding.make_mesh`` from ``config.mesh.dcn_<axis>``, and the ruler maps each
collective's partitions to the nodes through the recorded device order (``partition_devices``).

Slow: two deviceless compiles of moe_tiny's E block (about a minute each on 2 cores).
"""
import json
import os

import numpy as np
import pytest

from bench.predict import cluster, ruler
from training import sharding
from test_gpu_aot import ROOT, _check, _gpu_aot, needs_plugin   # pylint: disable=import-error
from test_mesh_nodes import _Device, _cpu_top_k, _reduction, node_collectives   # pylint: disable=import-error

SMALL_MOE = ("--config.recipe=bf16", "--config.model.pattern=E", "--config.model.d_model=64",
             "--config.model.n_routed_experts=8", "--config.model.moe_intermediate_size=64",
             "--config.model.moe_shared_expert_intermediate_size=64", "--config.model.moe_latent_size=32",
             "--config.model.n_group=1", "--config.model.topk_group=1", "--config.data.seq_len=64",
             "--config.micro_batches=2", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.expert=4", "--mesh.tensor=1",
             "--batch_per_device=1", "--twin=false")
LAYOUTS = {"data_across": ("--mesh.dcn_data=2",), "fsdp_across": ("--mesh.dcn_fsdp=2",)}


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_deviceless_compile_places_the_mesh_in_hgx_nodes(tmp_path, layout):
  hlo = tmp_path / "step.hlo"
  proc, report = _gpu_aot(tmp_path, "--target", "h200", "--what", "step", "--config",
                          os.path.join(ROOT, "configs", "moe_tiny.py"), "--devices", "16", *SMALL_MOE,
                          *LAYOUTS[layout], "--hlo", str(hlo), timeout=1800)
  _check(proc, report, 900)
  result = report["results"][0]
  config = dict(data=2, fsdp=2, expert=4, tensor=1, **{a[len("--mesh."):].split("=")[0]: 2 for a in LAYOUTS[layout]})
  want = sharding.node_grid([_Device(i, 0) for i in range(16)], (2, 2, 4, 1),
                            [config.get(k, 1) for k in sharding.NODE_KEYS], 8)
  assert result["partition_devices"] == [d.id for d in np.asarray(want).flat]
  text = hlo.read_text()
  hgx = cluster.get("hgx_h200")
  rows = node_collectives(text, result["partition_devices"], hgx)
  dispatch = [c for c in rows if c["kind"] in ("all-to-all", "ragged-all-to-all") and "blocks_0/mixer" in c["op"]]
  assert dispatch and not any(c["crosses"] for c in dispatch)   # the expert exchange stays on NVLink
  crossing = [c for c in rows if c["crosses"]]
  if layout == "data_across":
    assert [c for c in crossing if not _reduction(c)] == [], json.dumps(crossing)[:3000]
    assert not any(_cpu_top_k(c) for c in rows)   # the GPU's top-k runs on each device's rows
  else:
    assert any(c["kind"] == "all-gather" and "dot_general" in c["op"] for c in crossing)
  priced = ruler.predict(text, "h200", "hgx_h200", partition_devices=result["partition_devices"])
  assert any(r["crosses_nodes"] for r in priced["collectives"])
  assert result["ruler"]["comm_ms"] == pytest.approx(priced["comm_s"] * 1e3)   # gpu_aot priced the same nodes
