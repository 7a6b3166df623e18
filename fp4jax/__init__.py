"""fp4jax: NVFP4 / MXFP4 / FP8 quantized training for JAX and Flax."""
import importlib

from fp4jax import _platform

_platform.configure()   # before anything starts a backend: CPU-only jax where a CUDA plugin has no GPU

from fp4jax import recipes  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax import target
from fp4jax.api import FP4_OPERAND, dequantize, fake_quantize, quantize, scaled_matmul, transpose_tiles
from fp4jax.dot import PREQUANTIZED, QuantizedWeight, can_quantize_weight, dot, dot_general, quantize_weight
from fp4jax.prequantized import PreQuantized, prequantize
from fp4jax.numerics import hadamard
from fp4jax.numerics.hadamard import rht
from fp4jax.dispatch import can_use_pallas
from fp4jax.qtensor import QTensor
from fp4jax.recipes import Recipe

__version__ = "0.1.0"

__all__ = ["FP4_OPERAND", "QTensor", "Recipe", "can_use_pallas", "dequantize", "fake_quantize", "hadamard", "quantize", "recipes", "rht",
           "target"]
__all__ += ["PREQUANTIZED", "PreQuantized", "QuantizedWeight", "can_quantize_weight", "dot", "dot_general", "flax",
            "prequantize", "quantize_weight", "scaled_matmul", "transpose_tiles"]


def __getattr__(name):
  # fp4jax.flax (the Flax modules) loads on first use, so `import fp4jax` does not import Flax.
  if name == "flax":
    return importlib.import_module("fp4jax.flax")
  raise AttributeError(f"module 'fp4jax' has no attribute {name!r}")
