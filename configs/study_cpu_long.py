"""The recipe study at ~100 tokens per non-embedding parameter: the comparison of RECIPES_SPEC-style §12 tables
(every linear layer in FP4) on the CPU study model of configs/study_cpu.py, 5.5x longer.

  nohup python -m experiments.study --config configs/study_cpu_long.py --workdir results/study_cpu_long \
      > results/study_cpu_long/log.txt 2>&1 &

2200 steps x 32 x 64 = 4.5M tokens per run: 75 tokens per parameter, 103 per non-embedding parameter (the
published table counts non-embedding parameters: its 100M/10B row is D/N = 97). The newer methods separate
from the paper's recipe only from about there on. Measured cost on the idle 2-core machine: ~25 min per seed
for the six variants (bf16 0.6 min ... tetrajet2 7.5 min), ~75 min for three seeds.
"""
from configs import study_cpu

LONG_VARIANTS = ("bf16,nvfp4_all_fp4,nvfp4_4over6_all_fp4,quartet2_rtn_all_fp4,quartet2_all_fp4,"
                 "tetrajet2_all_fp4")


def get_config():
  c = study_cpu.get_config()
  c.name = "study_cpu_long"
  c.steps = 2200
  c.optim.warmup_steps = 100
  c.log_every = 100
  c.eval.every_steps = 100         # 22 points on the gap curve
  c.checkpoint.every_steps = 500
  c.study.seeds = (0, 1, 2)
  c.study.variants = LONG_VARIANTS
  c.study.runs_dir = "runs/study_cpu_long"
  return c
