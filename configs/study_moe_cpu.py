"""The MoE recipe study at CPU size (docs/STUDY.md): bf16, nvfp4, nvfp4 with Nemotron 3 Super's policy,
Quartet II and TetraJet-v2 x 3 seeds on a small mixture-of-experts hybrid, the loss gap and the router's
balance (MaxVio, entropy of the expert load) per recipe.

  nohup nice -n 19 python -m experiments.study --config configs/study_moe_cpu.py \
      --workdir results/study_moe_cpu > results/study_moe_cpu/log.txt 2>&1 &
  python -m experiments.study --config configs/study_moe_cpu.py --workdir results/study_moe_cpu --summarize_only

The model: moe_tiny's structure sized down (SIZING below): Mamba, attention, an MLP and two E blocks of 8
routed experts, 2 per token, in 2 groups, with a shared expert and the latent projections, pattern STUDY_PATTERN.
The last block is the MLP, so under both nvfp4 policies (the paper's last block in bf16; Super's last
round(14/88 x 6) = 1 block in bf16) both E blocks' experts run in FP4: the router sees FP4 noise in each.
Balance: the aux-loss-free bias update at moe_tiny's γ = 1e-2, no auxiliary loss.

Active parameters = ``models.count_params`` (all parameters, embedding and LM head included, as the dense
study counts them) - ``models.moe.inactive_params`` (the 6 routed experts of 8 a token does not use, in each
E block). The dense study (configs/study_cpu.py) trains 59,960 parameters on 819,200 tokens: 13.7 tokens per
parameter; this study keeps that ratio per active parameter.

Sizing (2026-12-02, 2-core AMD EPYC VM shared with a full test suite and other jobs, this study at nice 19):
a first try at d_model 32 (66,632 parameters, 54,344 active) timed 40 Quartet II steps of 32 x 64 tokens at
1.8-2.3 s/step after 148 s to compile the train step and 158 s the evaluation step; 13.7 tokens per active
parameter (363 such steps) would have taken ~15 min per FP4 run, ~3 h for the 15. The step's cost grows with
the activations (tokens x width), so the model shrank to width 16 (26,764 parameters, 20,620 active; 8,192 of
them the byte embedding and LM head) and the batch to 16 x 64: 276 steps = 282,624 tokens = 13.7 per active
parameter (10.6 per parameter). Measured in the study itself: bf16 0.25-0.3 s/step, nvfp4 ~1.1 s/step, and
~10 min to compile an FP4 train step at that load (once per variant: the seeds share the compilation cache).
TetraJet-v2's step is ~10x nvfp4's here (58 min for its seed 0 at that load), Quartet II's compile took 28 min:
on 2026-12-02 10 of the 15 runs finished that day. The other 5 (quartet2 x 3, tetrajet2 seeds
1 and 2) ran the same evening on a 2-core Intel Xeon VM at load 10-13, two study processes side by side
(``--config.study.variants=bf16,quartet2`` and ``=bf16,tetrajet2``): Quartet II compiled its train step in 475 s
(70 s to initialize the state) and ran 0.73-1.6 s/step (per-run means), TetraJet-v2 382 s and 1.8-3.0 s/step;
the seeds after the first took 70-140 s to trace, lower and load the cached step. The 5 runs took 40 min in all
(docs/PERF.md, "Why Quartet II and TetraJet-v2 are slow on the CPU"). The runs were split over processes on
the same runs directory to use both cores' idle time; each skips what another finished or is training, and the
output directory keeps every finished run's records (``experiments.study_records.KEPT_FILES``), so a summary needs no
runs directory.
"""
from ml_collections import config_dict

from configs import base

STUDY_PATTERN = "ME*ME-"
STUDY_MODEL = dict(d_model=16, pattern=STUDY_PATTERN, mlp_dim=64, n_heads=1, n_kv_heads=1, head_dim=16,
                   d_state=16, ssm_head_dim=16, chunk_size=32, moe_intermediate_size=16,
                   moe_shared_expert_intermediate_size=16, moe_latent_size=16, moe_bias_update_rate=1e-2,
                   bf16_first_blocks=0, bf16_last_blocks=1)
VARIANTS = "bf16,nvfp4,nvfp4_super,quartet2,tetrajet2"


def get_config():
  c = base.get_config()
  c.name = "study_moe_cpu"
  c.model.preset = "moe_tiny"
  for name, value in STUDY_MODEL.items():
    c.model[name] = value
  c.steps = 276                     # x 16 x 64 = 282,624 tokens: 13.7 per active parameter (20,620)
  c.batch_size = 16
  c.data.seq_len = 64
  c.data.read_threads = 1
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 20
  c.log_every = 4                   # the balance metrics are the logged step's load: 69 samples per run
  c.eval.every_steps = 46           # 6 points on the gap curve
  c.eval.batches = 8                # 8K validation tokens, the same batches for every variant of a seed
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 1

  c.study = config_dict.ConfigDict()
  c.study.seeds = (0, 1, 2)
  c.study.variants = VARIANTS
  c.study.reference = ""            # nvfp4
  c.study.runs_dir = "runs/study_moe_cpu"
  c.study.switch_fraction = 0.18    # unused here (no nvfp4_switch), kept for the summary's fields
  c.study.compilation_cache = True
  c.study.balance_window = 0.25     # the balance summary's "late" mean: the logged steps of the last 25%
  return c
