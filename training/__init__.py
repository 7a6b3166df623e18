"""The pretraining pipeline: configs, grain data, optax, mesh sharding, orbax checkpoints, metrics.

``train_and_evaluate(config, workdir)`` is the whole run; ``train.py`` is its command line.
"""
from training.config import ConfigError
from training.trainer import TrainingDiverged, train_and_evaluate

__all__ = ["ConfigError", "TrainingDiverged", "train_and_evaluate"]
