"""Small: the 5.2M-parameter hybrid (12 blocks, last 2 in bf16) on the standard library's source, in NVFP4.
About 10M tokens: a coffee break on one GPU, hours on a CPU.

  python train.py --config configs/small.py
  python train.py --config configs/small.py --config.recipe=bf16 --workdir runs/small_bf16   # the baseline
"""
from configs import base


def get_config():
  c = base.get_config()
  c.name = "small"
  c.model.preset = "small"
  c.steps = 2000
  c.batch_size = 32
  c.data.seq_len = 256
  c.optim.lr = 2e-3
  c.optim.warmup_steps = 100
  c.eval.every_steps = 200
  c.eval.batches = 16
  c.checkpoint.every_steps = 500
  return c
