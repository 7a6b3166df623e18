"""Flax models: the hybrid Mamba-2 / attention language model (Nemotron-H style) of the paper.

``LanguageModel(get_model_config("tiny"), recipe="nvfp4")``; which linear layers run the recipe's
quantized dot is decided by ``models.policy`` from each layer's path.
"""
from models.axes import LOGICAL_AXIS_NAMES
from models.config import ModelConfig
from models.lm import Block, LanguageModel, abstract_variables, count_params, init_cache
from models.policy import layer_precision
from models.presets import get_model_config
from models.report import describe_linear_layers

__all__ = [
    "LOGICAL_AXIS_NAMES", "Block", "LanguageModel", "ModelConfig", "abstract_variables", "count_params",
    "describe_linear_layers", "get_model_config", "init_cache", "layer_precision",
]
