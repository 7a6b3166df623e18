"""fp4jax: NVFP4 / MXFP4 / FP8 quantized training for JAX and Flax."""
from fp4jax import hadamard, recipes
from fp4jax.api import dequantize, quantize
from fp4jax.hadamard import rht
from fp4jax.qtensor import QTensor
from fp4jax.recipe import Recipe

__version__ = "0.1.0"

__all__ = ["QTensor", "Recipe", "dequantize", "hadamard", "quantize", "recipes", "rht"]
