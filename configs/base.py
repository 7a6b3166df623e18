"""The base training config: every field, with defaults; the named configs are small diffs of it.

Not meant to be run directly; see ``configs/tiny.py``. Fields:
  recipe            fp4jax.recipes name: nvfp4, mxfp4, fp8, bf16, nvfp4_no_sr, nvfp4_no_rht, nvfp4_no_2d, ...
  sr_bits           the bits of stochastic rounding in the recipe: "philox" (one philox4x32-10 per 16 elements,
                    fp4jax's default), "packed" (one threefry2x32 per 8: 2.3x the integer work in the quantize
                    kernels) or "jax" (jax.random.bits, one hash per element: 16x), the same statistics, other
                    bits (docs/NUMERICS.md); None: a new run takes
                    the default, a resumed run the stream its record names ("jax" for a record without the
                    field); rules of ``model.precision`` that name another recipe keep its default
  model             a models.presets name (``model.preset``) and overrides of any ModelConfig field;
                    ``model.precision``: which recipe each linear layer runs, a preset ("nemotron_h", the
                    default; "nemotron3_super"; "all_fp4") or ordered rules (docs/TRAINING.md, "Choosing
                    precision per layer"), e.g. [("blocks_*/mixer/out_proj", "mxfp8"), ("*", "recipe")]
  steps, batch_size global optimizer steps and global batch (sequences); tokens/step = batch_size * seq_len
  micro_batches     the micro-batches each step's batch is split into (gradient accumulation): one optimizer
                    step over batch_size sequences, computed batch_size / micro_batches at a time; batch_size
                    must be a multiple of micro_batches x data x fsdp x expert (docs/TRAINING.md, "Micro-batches")
  halt_after        stop (with a checkpoint) after this many steps of this run; 0: run to ``steps``
  data.sources      comma-separated files, globs or directories (text, .jsonl, .parquet/.arrow tables and
                    datasets' save_to_disk directories (text in data.text_column), .npy/.bin tokens); empty:
                    the Python standard library's source files; a text file holding a NUL byte (a binary
                    file, UTF-16 text) is refused unless ``data.raw_bytes`` (its bytes, NULs as document ends)
  data.document_masking  off (the paper's setup): packed windows run across document ends. On: attention sees
                    only its own document, the Mamba-2 conv and state restart at each document, and the loss
                    skips each document's first token (docs/TRAINING.md, "Document masking")
  report.trackers   where the metrics go, comma-separated: "jsonl" (metrics.jsonl, always), "tensorboard",
                    "mlflow" (pip install 'fp4jax[mlflow]'), "wandb" (pip install 'fp4jax[wandb]', offline by
                    default); their settings: report.mlflow_uri, mlflow_experiment, wandb_project, wandb_mode
  mesh              (data, fsdp, expert, tensor) sizes; -1 takes the remaining devices; expert: expert
                    parallelism (a divisor of n_routed_experts; docs/TRAINING.md); dcn_<axis>: the nodes the
                    axis spans (its across-node factor, a divisor of its size; all 1: a flat mesh), their
                    product the node count; devices_per_node (0: the devices of one process); fsdp_gather:
                    "per_layer" (each layer gathers its weights over fsdp, in every micro-batch) or "per_step"
                    (once per optimizer step, ahead of the micro-batches: memory for traffic) (docs/TRAINING.md,
                    "Laying out a multi-node run"); grad_reduce: "per_micro_batch" (each micro-batch's
                    gradients reduced over every batch axis) or "per_step" (with fsdp_gather "per_step": summed
                    unreduced over data and fsdp, reduced over them once per step; docs/TRAINING.md,
                    "Gradients reduced once per step")
  precision_switch  the last ``fraction`` of steps in bf16: mode "fwd" (forward only) or "fwd_bwd"
  profile_steps     steps to capture with jax.profiler into <workdir>/profile, e.g. "(10, 11, 12)"
  pgle_steps        profile-guided scheduling (GPU): trace this many steps after each start's first one and
                    compile the step again with their instruction times, so XLA's latency-hiding scheduler
                    overlaps by measured costs; the profile is kept in <workdir>/pgle (training/pgle.py;
                    docs/TRAINING.md, "Profile-guided scheduling"); 0: off
  init_from         a run's work directory: a new run starts from its latest checkpoint's params (fresh
                    optimizer, step 0); ignored when the work directory has checkpoints of its own
  xla_options       XLA compiler options of the train step's compile, per device kind: {"all": {...},
                    "h200": {...}} (a kind's entry applies where the device kind contains its name); e.g.
                    {"h200": {"xla_gpu_memory_limit_slop_factor": 49}}: XLA_FLAGS' options, as a config
  allow_config_change  let a resume change the recipe, model, optimizer, data, seed, batch or steps
  preemption_grace_s  after SIGTERM/SIGINT the run exits within this many seconds: it saves after the
                    current step when the save fits in the time left, else exits without it, and says which
  peer_timeout_s    multi-process runs: a peer that stops answering (dies or hangs) ends every other
                    process within about this many seconds, with one line and exit 10 (the step watchdog;
                    given on the command line it also sets JAX's heartbeat timeout); keep it above the
                    longest step, save or evaluation
  lock_stale_s      another host's lock on the work directory counts as stale when its heartbeat is older
  checkpoint.fallback  restore the newest intact checkpoint when the latest cannot be read (else stop)
  osci_reset        TetraJet-v2's OsciReset after each update: enabled "auto" (on for tetrajet2 recipes) /
                    "on" / "off"; threshold, detect_steps, and period / start as fractions of ``steps``
  outcontrol        TetraJet-v2's OutControl (recipe tetrajet2 only; off by default): the input channels with
                    the largest activation norms, ``ratio`` of them (rounded up to 128s), run in MXFP8 from
                    step ``record_start_step + record_steps`` on, chosen from the norms summed over the
                    ``record_steps`` steps before. A mixed-precision method: the study's "every linear layer
                    in FP4" comparisons (and the published table they sit next to) leave it off
"""
import dataclasses

from ml_collections import config_dict

from models import ModelConfig

# ModelConfig fields the trainer sets from other sections (outcontrol_ratio from config.outcontrol).
TRAINER_MODEL_FIELDS = ("outcontrol_ratio",)


def model_section(preset: str, **overrides) -> config_dict.ConfigDict:
  """A ``config.model`` section: ``preset`` plus one typed placeholder per ``ModelConfig`` field.

  Every field is present, ``None`` meaning "the preset's value", so that ``--config.model.d_model=128``
  works from the command line. dtype fields are strings ("bfloat16"); ``overrides`` set fields of the preset.
  """
  section = config_dict.ConfigDict()
  section.preset = preset
  defaults = ModelConfig()
  for field in dataclasses.fields(defaults):
    if field.name in TRAINER_MODEL_FIELDS:
      continue
    value = getattr(defaults, field.name)
    if field.name == "precision":   # a preset name or a list of rules (models.rules): any plain data
      kind = object
    elif value is None:  # an Optional field: its annotation names the type
      annotation = str(field.type)
      kind = int if "int" in annotation else float if "float" in annotation else str
    elif isinstance(value, type) or field.name.endswith("dtype"):
      kind = str
    else:
      kind = type(value)
    section[field.name] = config_dict.placeholder(kind)
  for name, value in overrides.items():
    if name not in section:
      raise ValueError(f"model_section: {name!r} is not a ModelConfig field; "
                       f"fields are {sorted(k for k in section.keys() if k != 'preset')}")
    section[name] = value
  return section


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.name = "base"
  c.seed = 0
  c.recipe = "nvfp4"
  c.sr_bits = config_dict.placeholder(str)   # stochastic rounding's bits: None, "philox", "packed" or "jax" (docstring)
  c.model = model_section("tiny")
  c.steps = 1000
  c.batch_size = 16
  c.micro_batches = 1
  c.halt_after = 0
  c.log_every = 10
  c.profile_steps = ()
  c.pgle_steps = 0
  c.init_from = ""
  c.allow_config_change = False
  c.preemption_grace_s = 30.0       # SIGTERM/SIGINT: exit within this many seconds (a cluster's grace period)
  c.peer_timeout_s = 300.0          # multi-process: a silent peer ends the run after this (exit 10)
  c.lock_stale_s = 300.0            # a work-directory lock whose heartbeat is older than this is stale

  c.data = config_dict.ConfigDict()
  c.data.sources = ""               # empty: the standard library's *.py files (no download)
  c.data.jsonl_field = "text"
  c.data.text_column = "text"       # the column of Parquet/Arrow files and saved datasets that holds the text
  c.data.token_dtype = "uint16"     # dtype of raw .bin token files
  c.data.tokenizer = "byte"         # or a tokenizers .json / sentencepiece .model file
  c.data.seq_len = 256
  c.data.validation_fraction = 0.02
  c.data.read_threads = 1
  c.data.prefetch = 4
  c.data.raw_bytes = False          # True: read text files holding NUL bytes (binary files) as their bytes
  c.data.document_masking = False   # True: each document of a packed window to itself (docstring)

  c.optim = config_dict.ConfigDict()
  c.optim.schedule = "wsd"          # warmup-stable-decay (the paper's), "cosine" or "constant"
  c.optim.lr = 3e-3
  c.optim.min_lr_ratio = 0.01       # final lr = lr * min_lr_ratio (the paper: 4.5e-4 -> 4.5e-6)
  c.optim.warmup_steps = 50
  c.optim.decay_fraction = 0.2      # wsd: decay over the last 20% of the steps
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1        # matrices only
  c.optim.grad_clip = 1.0

  # Each axis's size; dcn_<axis>: how many nodes it spans (docs/TRAINING.md, "Laying out a multi-node run").
  c.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, dcn_data=1, dcn_fsdp=1, dcn_expert=1,
                                       dcn_tensor=1, devices_per_node=0, fsdp_gather="per_layer",
                                       grad_reduce="per_micro_batch"))

  c.eval = config_dict.ConfigDict()
  c.eval.every_steps = 100
  c.eval.batches = 8

  c.checkpoint = config_dict.ConfigDict()
  c.checkpoint.every_steps = 200
  c.checkpoint.keep = 3
  c.checkpoint.async_save = True
  c.checkpoint.fallback = True

  c.precision_switch = config_dict.ConfigDict()
  c.precision_switch.fraction = 0.0
  c.precision_switch.mode = "fwd"

  c.osci_reset = config_dict.ConfigDict()
  c.osci_reset.enabled = "auto"     # "auto": on for the tetrajet2 recipes; "on"; "off"
  c.osci_reset.threshold = 8.0      # reset where D_Q / D_FP >= threshold
  c.osci_reset.detect_steps = 50    # N: tracking steps after each snapshot
  c.osci_reset.period_fraction = 0.012  # P = max(round(0.012 * steps), N + 2)
  c.osci_reset.start_fraction = 0.65    # S = int(0.65 * steps): no snapshot before it

  # Off by default: OutControl keeps >= 10% of every quantized layer's input channels in MXFP8, so it is not
  # "every linear layer in FP4"; --config.outcontrol.enabled=True turns it on (recipe tetrajet2 only).
  c.outcontrol = config_dict.ConfigDict()
  c.outcontrol.enabled = False
  c.outcontrol.ratio = 0.1              # k8 = min(floor(K/128)*128, ceil(floor(K*ratio)/128)*128) channels
  c.outcontrol.record_start_step = 500  # the first step that accumulates the channel norms
  c.outcontrol.record_steps = 50        # steps in the window; the split is on from start + record_steps

  c.health = config_dict.ConfigDict()
  c.health.max_nonfinite_streak = 10

  # Where the metrics go (training.trackers): metrics.jsonl always, plus tensorboard, mlflow, wandb.
  c.report = config_dict.ConfigDict()
  c.report.trackers = "jsonl,tensorboard"
  c.report.mlflow_uri = ""          # empty: the local file store <workdir>/mlruns; or a path, file:, sqlite:, http:
  c.report.mlflow_experiment = ""   # empty: config.name
  c.report.wandb_project = ""       # empty: config.name
  c.report.wandb_mode = "offline"   # "offline": <workdir>/wandb, no network (wandb sync uploads it); "online"

  # XLA compiler options of the train step (training.config.xla_options): {"all" or a device-kind name such
  # as "h200": {option: value}}; empty: XLA's defaults.
  c.xla_options = config_dict.ConfigDict()
  return c


# Sections whose fields are checked elsewhere or are not fp4jax's: the model's by training.config's
# resolve_model_config (against models.ModelConfig), XLA's options by name for XLA.
_OPEN_SECTIONS = ("model", "xla_options")


def unknown_fields(config, sections: tuple[str, ...] = ()) -> list[str]:
  """The dotted names of ``config``'s fields that the base config lacks, sorted: a misspelt or retired name that
  nothing reads, which would otherwise be ignored. Not looked into: the model's fields and XLA's options
  (``_OPEN_SECTIONS``) and the extra sections a tool names (``sections``, e.g. a study's ``study``)."""
  def extra(given, known, prefix):
    out = []
    for key, value in given.items():
      if key not in known:
        out.append(prefix + key)
      elif isinstance(value, config_dict.ConfigDict) and isinstance(known[key], config_dict.ConfigDict):
        out += extra(value, known[key], f"{prefix}{key}.")
    return out
  skip = set(_OPEN_SECTIONS) | set(sections)
  return sorted(extra({k: v for k, v in config.items() if k not in skip}, get_config(), ""))
