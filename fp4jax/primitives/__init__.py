"""fp4jax's JAX primitives: quantize, RHT-transposed quantize, dequantize, scaled matmul, and the producers that
quantize their output (RMSNorm + quantize, relu² + quantize).

Each op is a pair of primitives built by ``pair.define`` from a short spec in its own module
(``quantize``, ``rht_t``, ``dequantize``, ``matmul``, ``producers``): ``fp4jax_<op>`` (what jaxprs show; batching,
JVP, custom_partitioning from ``sharding``) and ``fp4jax_<op>_local`` (the per-shard op: Pallas kernel
or reference, per platform). Static choices (format, tiles, scale rule, impl, output dtype) are
params; random bits and the NVFP4 tensor amax are operands. ``impl`` is ``fp4jax.dispatch``'s answer:
impl=None becomes a kernel only where ``dispatch.VERIFIED_KERNELS`` (or this device's proof) shows it
exact and faster.
"""
from fp4jax.primitives.dequantize import dequantize_last, dequantize_p
from fp4jax.primitives.matmul import fp4_matmul, mixed_matmul, scaled_matmul_p
from fp4jax.primitives.quantize import quantize_last, quantize_p
from fp4jax.primitives.producers import relu2_quantize_p, rmsnorm_quantize_p
from fp4jax.primitives.rht_t import quantize_rht_t, quantize_rht_t_p

__all__ = ["dequantize_last", "dequantize_p", "fp4_matmul", "mixed_matmul", "quantize_last", "quantize_p",
           "quantize_rht_t", "quantize_rht_t_p", "relu2_quantize_p", "rmsnorm_quantize_p",
           "scaled_matmul_p"]
