"""The recipe study at CPU size: every variant of experiments/study_config.py (17: the paper's recipe, its ablations
and the newer methods 4/6, Quartet II, TetraJet-v2, also with every linear layer in FP4) x the seeds below,
a 60K-parameter hybrid on the stdlib corpus. The published table (results/study_cpu) predates the newer
methods: it ran the first 9 variants (``--config.study.variants=bf16,fp8,mxfp4,nvfp4,...``).

  python -m experiments.study --config configs/study_cpu.py                      # -> results/study_cpu
  nohup python -m experiments.study --config configs/study_cpu.py > results/study_cpu/log.txt 2>&1 &

Sized for 2 x86 cores shared with other jobs: throughput measured with short runs (batch 32 x 64 bytes,
load average ~12 on the 2 cores): 4.3K tokens/s in NVFP4 emulation, 5.9K in bf16 (most of the step is the
unquantized part: Mamba-2 scan, norms, optimizer), ~50 s to compile an NVFP4 step. 400 steps x 2048
tokens = 819K tokens per run: 13.7 tokens per parameter (18.8 per non-embedding parameter), below spec
§7's ~20 because 18 runs must fit in about an hour on that machine (~65 min at that load; ~25 min on an
idle one). Raise ``steps`` on a quiet machine.
The model: tiny's block pattern (M-*-M-, 12 linear layers, the last block's 2 in bf16 = 17%, the paper's
~15%) at width 32. Runs go to runs/study_cpu/<variant>/seed<k> (git-ignored); an interrupted study
resumes where it stopped.
"""
from ml_collections import config_dict

from configs import base

STUDY_MODEL = dict(d_model=32, pattern="M-*-M-", mlp_dim=128, n_heads=2, n_kv_heads=1, head_dim=16,
                   d_state=16, ssm_head_dim=16, chunk_size=32, bf16_first_blocks=0, bf16_last_blocks=1)


def get_config():
  c = base.get_config()
  c.name = "study_cpu"
  c.model.preset = "tiny"
  for name, value in STUDY_MODEL.items():
    c.model[name] = value
  c.steps = 400
  c.batch_size = 32
  c.data.seq_len = 64
  c.data.read_threads = 1
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 30
  c.log_every = 40
  c.eval.every_steps = 40           # 10 points on the gap curve
  c.eval.batches = 8                # 16K validation tokens, the same batches for every variant of a seed
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 1

  c.study = config_dict.ConfigDict()
  c.study.seeds = (0, 1)
  c.study.variants = "all"          # or e.g. "bf16,nvfp4,mxfp4"
  c.study.reference = ""            # the paired baseline; "": nvfp4, or nvfp4_all_fp4 without it
  c.study.runs_dir = "runs/study_cpu"
  c.study.switch_fraction = 0.18    # nvfp4_switch: the last 18% of the steps with a bf16 forward pass
  c.study.compilation_cache = True  # the second seed reuses the first seed's compiled steps
  return c
