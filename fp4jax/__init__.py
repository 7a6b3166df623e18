"""fp4jax: NVFP4 / MXFP4 / FP8 quantized training for JAX and Flax."""
from fp4jax import recipes
from fp4jax.recipe import Recipe

__version__ = "0.1.0"
