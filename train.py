"""Pretrain a language model with fp4jax: ``python train.py --config configs/tiny.py``.

  python train.py                                             # configs/tiny.py, work dir ./runs/tiny
  python train.py --config configs/small.py --workdir /tmp/small
  python train.py --config.model.d_model=128 --config.recipe=mxfp4 --config.steps=500
  python train.py --config.data.sources='~/texts/*.txt,~/more.jsonl'

Running again with the same work directory resumes from its latest checkpoint. Ctrl-C (or SIGTERM) saves
a checkpoint and exits. Multi-host: pass --coordinator_address/--num_processes/--process_id, or set
JAX_COORDINATOR_ADDRESS, or FP4JAX_DISTRIBUTED=1 on a cluster JAX detects (SLURM, MPI, ...).
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags



def _unknown_field(error) -> None:
  bad = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.")]
  while isinstance(error, Exception) and error.args:  # config_flags nests the KeyError's message
    error = error.args[0]
  detail = str(error).replace("\n", "; ")
  print(f"error: unknown config field {detail} (in {' '.join(bad)}); list the fields with "
        "`python -c \"from configs import base; print(base.get_config())\"`", file=sys.stderr)
  sys.exit(2)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # config files import `configs` and `training`
try:  # config_flags applies the --config.<field> overrides right here, when the flag is defined
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py"),
      "Training config file (a configs/*.py); override fields with --config.<field>=<value>.", lock_config=True)
except (AttributeError, KeyError) as e:
  _unknown_field(e)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory for checkpoints and metrics; default "
                               "./runs/<config.name>.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-host runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes, for multi-host runs.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, for multi-host runs.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", os.path.join("~", ".cache", "fp4jax", "jax_compilation_cache"),
    "Directory of JAX's persistent compilation cache, so reruns and resumes skip compiling; '' turns it off.")


def _parse_flags(argv):
  """absl's parser, with unknown --config keys reported as a one-line usage error."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    _unknown_field(e)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.<field>=<value>")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # Import after flag parsing: jax.distributed must initialize before anything touches a device.
  import training  # pylint: disable=g-import-not-at-top
  from training import sharding  # pylint: disable=g-import-not-at-top
  sharding.maybe_initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if _COMPILATION_CACHE.value:
    sharding.use_compilation_cache(_COMPILATION_CACHE.value)
  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join("runs", config.name)
  try:
    summary = training.train_and_evaluate(config, workdir)
  except training.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except training.TrainingDiverged as e:
    print(f"error: training diverged: {e}", file=sys.stderr)
    return 1
  return 0 if summary["status"] in ("done", "halted", "stopped") else 1


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
