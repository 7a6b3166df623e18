"""The pretraining pipeline: configs, grain data, optax, mesh sharding, orbax checkpoints, metrics.

``train_and_evaluate(config, workdir)`` is the whole run; ``train.py`` is its command line. Every
foreseeable failure raises a ``training.errors.TrainingError`` subclass with an exit code.
"""
from training.errors import (CheckpointError, ConfigChangedError, ConfigError, DataError, DistributedError,
                             StorageError, TrainingDiverged, TrainingError, WorkdirError, WorkdirInUse)
from training.trainer import train_and_evaluate

__all__ = ["CheckpointError", "ConfigChangedError", "ConfigError", "DataError", "DistributedError", "StorageError",
           "TrainingDiverged", "TrainingError", "WorkdirError", "WorkdirInUse", "train_and_evaluate"]
