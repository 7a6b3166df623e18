"""The programs an on-device proof can choose compile for their meshes, on a machine without a GPU: the 12B on 8
GPUs (fsdp 8) and Nemotron 3 Super on 64 (fsdp 8 x expert 8), for H200 (sm_90) and B200 (sm_100), with every
kernel on: ``--what_if_proved=all`` (each kernel of ``fp4jax.dispatch.KERNEL_OPS`` counts as proved
exact and faster, as a passing proof records it) and the model kernels (the Mamba-2 SSD and gated-norm
kernels) on. The kernels then run per shard inside the partitioned primitives and inside the expert-parallel
shard_map, where they must carry the varying-manual-axes types jax checks there.

Slow: each is a whole-model compile (Super: minutes and several GiB of host memory; run it alone).
"""
import os

import pytest

from test_gpu_aot import ROOT, _check, _gpu_aot, needs_plugin   # pylint: disable=import-error

MODEL_KERNELS = ("--config.model.ssd_impl=pallas", "--config.model.gate_norm_impl=pallas")
PROGRAMS = {
    "12b_8": ("nemotron_h_12b.py", 8, ("--mesh.fsdp=8", "--batch_per_device=1")),   # the report's 8192 tokens per GPU
    # Super's blocks regrouped (every distinct block kind, hence every kernel, still compiles: the report's rows
    # compile it so; the full program takes 11 GiB of host memory at its two sequences per GPU)
    "super_64": ("nemotron3_super.py", 64, ("--regroup_blocks",)),
}
# an H200 holds one sequence per GPU at a time, not Super's two (bench/predict/report_rows.py, super_h200)
PER_TARGET = {("super_64", "h200"): ("--config.micro_batches=8",)}


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("target", ["h200", "b200"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_proved_kernel_path_compiles_on_its_mesh(tmp_path, program, target):
  config, devices, extra = PROGRAMS[program]
  proc, report = _gpu_aot(tmp_path, "--target", target, "--what", "step", "--config",
                          os.path.join(ROOT, "configs", config), "--devices", str(devices), *extra,
                          *PER_TARGET.get((program, target), ()),
                          "--twin=false", "--what_if_proved=all", *MODEL_KERNELS, timeout=3600)
  _check(proc, report, 3000, rss_gib=12.0)   # a whole model's compile: 7.7 GiB measured (the 12B for H200)
  result = report["results"][0]
  assert result["kernels"] > 0, "no Pallas kernel in the GPU HLO: the proved path did not run the kernels"
  assert result["memory"]["temp_bytes"] > 0
