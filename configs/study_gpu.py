"""The recipe study at H200 size: every variant of experiments/study_config.py (17) x 3 seeds of a 0.2M-parameter
hybrid; the estimate below was made for the first 9 (~8 minutes of device time), so expect about twice that.

  python -m experiments.study --config configs/study_gpu.py        # -> results/study_gpu

NOT YET RUN: no GPU was available when this config was written, so the budget is an estimate, not a
measurement. The estimate: 500 steps of 64 x 128 tokens (4.1M tokens, 20 tokens per parameter) of a
launch-bound model run at roughly 10-20 ms per step on an H200 (5-10 s per run, 27 runs ~4 min), plus
one compilation per variant (the other seeds hit the persistent compilation cache; 9 x ~20-30 s). If the
first variant's log shows a slower step, lower ``steps``/``batch_size`` together (keep >= 20 tokens per
parameter) or drop a seed (``--config.study.seeds='(0, 1)'``).
Compute in bfloat16 (the CPU study keeps the tiny preset's float32 compute); the same block pattern and
precision split as configs/study_cpu.py, twice as wide.
"""
from ml_collections import config_dict

from configs import base

STUDY_MODEL = dict(d_model=64, pattern="M-*-M-", mlp_dim=256, n_heads=2, n_kv_heads=1, head_dim=32,
                   d_state=16, ssm_head_dim=32, chunk_size=64, bf16_first_blocks=0, bf16_last_blocks=1,
                   dtype="bfloat16")


def get_config():
  c = base.get_config()
  c.name = "study_gpu"
  c.model.preset = "tiny"
  for name, value in STUDY_MODEL.items():
    c.model[name] = value
  c.steps = 500
  c.batch_size = 64
  c.data.seq_len = 128
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 25
  c.log_every = 50
  c.eval.every_steps = 50
  c.eval.batches = 8
  c.checkpoint.every_steps = 250
  c.checkpoint.keep = 1

  c.study = config_dict.ConfigDict()
  c.study.seeds = (0, 1, 2)
  c.study.variants = "all"
  c.study.reference = ""            # the paired baseline; "": nvfp4, or nvfp4_all_fp4 without it
  c.study.runs_dir = "runs/study_gpu"
  c.study.switch_fraction = 0.18
  c.study.compilation_cache = True
  return c
