"""Tiny: the default. A 719,088-parameter hybrid (Mamba-2, attention, MLP) learns Python source code in NVFP4
on a laptop CPU in a few minutes, from the standard library's own files (no download).

  python train.py --config configs/tiny.py
  python train.py --config configs/tiny.py --config.model.d_model=128 --config.recipe=mxfp4
"""
from configs import base


def get_config():
  c = base.get_config()
  c.name = "tiny"
  c.recipe = "nvfp4"
  c.model.preset = "tiny"
  c.steps = 300
  c.batch_size = 16
  c.data.seq_len = 128
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 30
  c.eval.every_steps = 100
  c.eval.batches = 8
  c.checkpoint.every_steps = 100
  return c
