"""fp4jax's JAX primitives: quantize, RHT-transposed quantize, dequantize, scaled matmul.

Each op is a pair of primitives built by ``pair.define`` from a short spec in its own module
(``quantize``, ``rht_t``, ``dequantize``, ``matmul``): ``fp4jax_<op>`` (what jaxprs show; batching,
JVP, custom_partitioning from ``sharding``) and ``fp4jax_<op>_local`` (the per-shard op: Pallas kernel
or reference, per platform). Static choices (format, tiles, scale rule, impl, output dtype) are
params; random bits and the NVFP4 tensor amax are operands. ``impl`` holds the switch: impl=None
becomes a kernel only where ``VERIFIED_KERNELS`` records a device run that showed it exact and faster.
"""
from fp4jax.primitives.dequantize import dequantize_last, dequantize_p
from fp4jax.primitives.impl import (DEFAULT_IMPL_ENV, IMPLS, KERNEL_OPS, VERIFIED_KERNELS, Evidence,
                                    can_use_pallas, default_impl, resolve_impl)
from fp4jax.primitives.matmul import fp4_matmul, scaled_matmul_p
from fp4jax.primitives.quantize import quantize_last, quantize_p
from fp4jax.primitives.rht_t import quantize_rht_t, quantize_rht_t_p

__all__ = ["DEFAULT_IMPL_ENV", "IMPLS", "KERNEL_OPS", "VERIFIED_KERNELS", "Evidence", "can_use_pallas",
           "default_impl", "dequantize_last",
           "dequantize_p", "quantize_last", "quantize_p", "quantize_rht_t", "quantize_rht_t_p",
           "resolve_impl", "fp4_matmul", "scaled_matmul_p"]
