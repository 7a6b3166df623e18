"""The tokens-to-loss study at CPU size: how many tokens each recipe needs to reach the loss the paper's NVFP4
recipe reaches with the budget T (the paper, spec §7: MXFP4 needs ~36% more, 8B hybrid, 1T tokens).

  mkdir -p results/study_budget_cpu && nohup python -m experiments.budget_study \
      --config configs/study_budget_cpu.py > results/study_budget_cpu/log.txt 2>&1 &
  python -m experiments.budget_study --config configs/study_budget_cpu.py --quick   # minutes: the pipeline

The model, data and schedule of configs/study_cpu_long.py: T = 2200 steps x 32 x 64 = 4.5M tokens, 103 tokens
per non-embedding parameter. The recipes keep the paper's policy (the last block's 2 linear layers in bf16) so
that they differ only in the format: nvfp4 (the reference, trained for T), mxfp4, fp8, quartet2 and tetrajet2
(each trained for 1.0, 1.2, 1.4 and 1.6 T, its own run per budget, warmup 100 steps, the wsd decay over the last
20% of its own steps). 3 seeds x (1 + 4 x 4) = 51 runs, 21.8 T of training per seed.
"""
from configs import study_cpu_long


def get_config():
  c = study_cpu_long.get_config()
  c.name = "study_budget_cpu"
  c.study.variants = "nvfp4,mxfp4,fp8,quartet2,tetrajet2"
  c.study.reference = "nvfp4"
  c.study.fractions = (1.0, 1.2, 1.4, 1.6)   # of T, for every recipe but the reference; add 0.8 to bracket one
  c.study.confidence = 0.95                  # of the t-interval over seeds
  c.study.runs_dir = "runs/study_budget_cpu"
  c.sr_bits = "packed"   # the stream its first runs (2026-12-06) were recorded with: every run of the study draws alike
  return c
