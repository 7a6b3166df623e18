"""Nemotron-H 12B (spec §7): 62 blocks (28 Mamba-2, 28 MLP, 6 attention), first 2 and last 8 in bf16,
NVFP4 elsewhere; sequence 8192, batch 736, AdamW (0.9, 0.95), weight decay 0.1, warmup-stable-decay at 4.5e-4
decaying to 4.5e-6 over the last 20%. Parameters and optimizer state are sharded over all devices (fsdp).
Remat "save_linear_fp4": each block keeps its linear layers' outputs and FP4 operands and recomputes only
elementwise work, the fastest policy whose compiled memory fits 80% of an H200 at 1 x 8192 tokens per GPU
(docs/PERF.md, "Remat policies for the 12B": 61 GiB per GPU; "none" needs 216 GiB, "full" is 10% slower).
Point the data at your pre-tokenized corpus (vocabulary 131072):

  python train.py --config configs/nemotron_h_12b.py --config.data.sources='/data/tokens/*.bin' \
      --config.data.token_dtype=uint32 --workdir /ckpt/nemotron_h_12b

`steps` is the paper's 10T tokens (10e12 / (736 * 8192)); lower it (and keep the schedule's shape) for
shorter runs. The paper's precision switch (--config.precision_switch.fraction=0.18) is off by default.

Memory and communication per device, compiled ahead of time for a simulated mesh (docs/PERF.md, "The 12B on a simulated CPU mesh"):

  python bench/scale.py --config configs/nemotron_h_12b.py --devices 64

The repeated block groups are scanned (``model.scan_blocks``: 18 distinct blocks to compile instead of 62;
2.6x less temp memory and 3.5x less compile time on the simulated 64-device mesh, docs/PERF.md). The
scanned parameter tree stacks each group's repetitions; ``python -m tools.hf export`` unstacks it, and
``config.init_from`` accepts a per-block (e.g. imported) checkpoint and stacks it.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.name = "nemotron_h_12b"
  c.model.preset = "nemotron_h_12b"
  c.model.remat = "save_linear_fp4"   # docs/PERF.md: fastest policy that fits
  c.model.scan_blocks = True
  c.steps = 1_658_000
  c.batch_size = 736
  c.data.seq_len = 8192
  c.data.validation_fraction = 0.001
  c.data.read_threads = 8
  c.data.prefetch = 8
  c.optim.lr = 4.5e-4
  c.optim.min_lr_ratio = 0.01
  c.optim.warmup_steps = 2000
  c.optim.decay_fraction = 0.2
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.log_every = 10
  c.eval.every_steps = 1000
  c.eval.batches = 8
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep = 2
  return c
