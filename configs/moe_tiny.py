"""MoE tiny: the mixture-of-experts toy (models.presets.moe_tiny: Mamba, MLP, attention and two E blocks of 8
routed experts, 2 per token, with a shared expert and latent projections) learns Python source in NVFP4 on a
CPU, its experts' GEMMs in FP4 (fp4jax.grouped_dot), balanced by the aux-loss-free bias update.

  python train.py --config configs/moe_tiny.py
  python train.py --config configs/moe_tiny.py --config.recipe=bf16 --config.model.moe_bias_update_rate=0
"""
from configs import base


def get_config():
  c = base.get_config()
  c.name = "moe_tiny"
  c.recipe = "nvfp4"
  c.model.preset = "moe_tiny"
  c.model.moe_bias_update_rate = 1e-2   # γ: the toy runs few steps, so a faster balance than the 1e-3 default
  c.steps = 200
  c.batch_size = 8
  c.data.seq_len = 128
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 20
  c.eval.every_steps = 100
  c.eval.batches = 4
  c.checkpoint.every_steps = 100
  c.log_every = 20
  return c
