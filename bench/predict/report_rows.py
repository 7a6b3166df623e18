"""The rows of the headline table (bench/predict/report.py): which program, on which GPUs, in which variant.

A row is a config on a GPU topology (``--devices``, 8 per node, as bench/predict/gpu_aot.py builds it) and a
cluster (``bench.predict.cluster``) that prices its collectives; a variant is the flags that choose the recipe
and the path:

- ``bf16``: the bf16 recipe, every default as a GPU process decides it before any on-device proof;
- ``mxfp8``: the MXFP8 recipe, likewise;
- ``nvfp4``: the NVFP4 recipe on the default path (what a user gets before the on-device proof: the XLA
  compositions of the quantizers, the XLA SSD scan and gated norm; on a B200 the native FP4 GEMMs);
- ``nvfp4_proved``: the same as if every kernel had proved exact and faster on the device
  (``--what_if_proved=all``, the Pallas SSD and gated-norm kernels): a what-if, no device has run them;
- ``bf16_proved`` (the Mamba rows): bf16 with the same Pallas SSD and gated-norm kernels, nvfp4_proved's twin.

Calibration rows are fp4jax programs shaped like a published, measured run (``Reference``).
"""
from __future__ import annotations

import dataclasses

VARIANTS = {
    "bf16": ("--config.recipe=bf16",),
    "mxfp8": ("--config.recipe=mxfp8",),
    "nvfp4": ("--config.recipe=nvfp4",),
    "nvfp4_proved": ("--config.recipe=nvfp4", "--what_if_proved=all", "--config.model.ssd_impl=pallas",
                     "--config.model.gate_norm_impl=pallas"),
    # bf16 with the model kernels of the proved path (the Pallas SSD and gated norm): nvfp4_proved's twin
    "bf16_proved": ("--config.recipe=bf16", "--config.model.ssd_impl=pallas", "--config.model.gate_norm_impl=pallas"),
}
HEADLINE_VARIANTS = ("bf16", "mxfp8", "nvfp4", "nvfp4_proved")

# Llama-3-8B's shape (Meta's config.json: 32 layers, hidden 4096, 32 / 8 heads of 128, MLP 14336 SwiGLU,
# vocabulary 128256, RoPE theta 500000), as fp4jax blocks: one attention and one MLP block per layer.
LLAMA3_8B = ("--config.model.vocab_size=128256", "--config.model.d_model=4096", "--config.model.pattern=" + "*-" * 32,
             "--config.model.n_heads=32", "--config.model.n_kv_heads=8", "--config.model.head_dim=128",
             "--config.model.mlp_dim=14336", "--config.model.mlp_kind=swiglu", "--config.model.rope=True",
             "--config.model.rope_theta=500000.0", "--config.model.bf16_first_blocks=0",
             "--config.model.bf16_last_blocks=0", "--config.model.remat=none")

# Super's 88 blocks compiled as 12 distinct blocks instead of 26 (bench/predict/regroup.py): the same step for
# the ruler in less than half the compile (docs/PERF.md, "A Super prediction in minutes", holds it against the full one).
REGROUPED = ("--regroup_blocks",)
# MXFP8 at the config's two sequences per GPU needs 157.6 GiB on a B200 before XLA's rematerialization, which then
# crashes; its rows run one sequence per GPU in 8 micro-batches, as the H200 rows do (the same 512 x 8192 per step).
# The bf16 step scheduled by the ruler's profile of itself (config.pgle_steps) is slower on the ruler than by XLA's
# own estimate (16,813 against 16,542 ms: docs/PERF.md, "Super scheduled by a profile of itself"): its rows, the
# baseline of the ratios, compile the faster one
SUPER_B200_VARIANTS = (("mxfp8", ("--config.micro_batches=8",)), ("bf16", ("--nopgle",)))


@dataclasses.dataclass(frozen=True)
class Reference:
  """A published measurement of a run shaped like the row: tokens/s per GPU by variant."""
  source: str             # who measured, and the document
  url: str
  hardware: str
  tokens_per_s_per_gpu: dict   # {variant: measured tokens/s per GPU}
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  title: str
  target: str             # bench/predict/gpu_targets/<target>.txtpb
  devices: int
  cluster: str            # bench.predict.cluster.CLUSTERS key
  config: str
  flags: tuple = ()
  variants: tuple = HEADLINE_VARIANTS
  reference: Reference | None = None
  batch_per_device: int | None = 1   # sequences per GPU in each micro-batch; None: the config's batch
  variant_flags: tuple = ()          # ((variant, flags), ...): what one variant adds to the row's flags

  def argv(self, variant: str) -> list[str]:
    """bench/predict/gpu_aot.py's arguments for one variant of this row."""
    batch = [] if self.batch_per_device is None else ["--batch_per_device", str(self.batch_per_device)]
    extra = dict(self.variant_flags).get(variant, ())
    return (["--target", self.target, "--what", "step", "--config", self.config, "--devices", str(self.devices)]
            + batch + ["--twin=false"] + list(self.flags) + list(VARIANTS[variant]) + list(extra))


TORCHTITAN_B200 = Reference(
    source="torchtitan, Llama-3-8B on 8 B200 (its NVFP4 training document: bf16 baseline; NVFP4 1.37x bf16)",
    url="https://github.com/pytorch/torchtitan (docs: NVFP4 training on B200)",
    hardware="8 B200 (one HGX node), FSDP",
    tokens_per_s_per_gpu={"bf16": 21919.0, "nvfp4": 21919.0 * 1.37},
    note="NVFP4 as the document's ratio to its bf16 run (1.37x), not a separately printed figure")

MEGATRON_SUPER_B200 = Reference(
    source="Megatron-Bridge performance summary, Nemotron 3 Super pretraining on 64 B200",
    url="https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html",
    hardware="64 B200 (8 DGX/HGX B200 nodes)",
    tokens_per_s_per_gpu={"nvfp4": 5632.0, "mxfp8": 6400.0},
    note="Megatron's own parallel layout (TP/EP/PP, CUDA graphs), not fp4jax's fsdp x expert")

ROWS = {r.name: r for r in (
    Row("12b_h200", "nemotron_h_12b, 8 H200", "h200", 8, "hgx_h200", "configs/nemotron_h_12b.py",
        ("--config.mesh.fsdp=8",), HEADLINE_VARIANTS + ("bf16_proved",)),
    Row("12b_b200", "nemotron_h_12b, 8 B200", "b200", 8, "hgx_b200", "configs/nemotron_h_12b.py",
        ("--config.mesh.fsdp=8",), HEADLINE_VARIANTS + ("bf16_proved",)),
    # an H200 (141 GB) holds one sequence per GPU at a time, not the config's two: 8 micro-batches of 64
    Row("super_h200", "nemotron3_super, 64 H200 (8 HGX nodes)", "h200", 64, "hgx_h200", "configs/nemotron3_super.py",
        REGROUPED + ("--config.micro_batches=8",), batch_per_device=None),
    Row("super_b200", "nemotron3_super, 64 B200 (8 HGX nodes)", "b200", 64, "hgx_b200", "configs/nemotron3_super.py",
        REGROUPED, reference=MEGATRON_SUPER_B200, batch_per_device=None, variant_flags=SUPER_B200_VARIANTS),
    # the same compiles as super_b200, priced as if the 64 GPUs shared one NVLink domain (no network)
    Row("super_b200_nvl", "nemotron3_super, 64 B200 in one NVLink domain (what-if)", "b200", 64, "gb200_nvl72",
        "configs/nemotron3_super.py", REGROUPED, batch_per_device=None, variant_flags=SUPER_B200_VARIANTS),
    Row("llama8b_b200", "Llama-3-8B shape, 8 B200", "b200", 8, "hgx_b200", "configs/nemotron_h_12b.py",
        ("--config.mesh.fsdp=8",) + LLAMA3_8B, variants=("bf16", "mxfp8", "nvfp4", "nvfp4_proved"),
        reference=TORCHTITAN_B200),
    Row("llama8b_h200", "Llama-3-8B shape, 8 H200", "h200", 8, "hgx_h200", "configs/nemotron_h_12b.py",
        ("--config.mesh.fsdp=8",) + LLAMA3_8B, variants=("bf16", "mxfp8", "nvfp4", "nvfp4_proved")),
)}
