"""The Pallas shims of ``fp4jax._pallas_compat``, public for kernels outside the library.

``models.ssd_pallas`` (the Mamba-2 SSD kernels) lives in ``models/`` (it is a model's op, not an FP4
one) and uses fp4jax only through public modules; the jax-version-specific Pallas code stays in one
place, ``fp4jax._pallas_compat``, and this module names what a kernel written elsewhere may use.
"""
from fp4jax._pallas_compat import (TRITON_CUSTOM_CALL, BlockSpec, by_platform, ds, export_for_cuda, gpu_available,
                                   has_triton, multiple_of, pallas_call)
from fp4jax.kernels._common import fit

__all__ = ["TRITON_CUSTOM_CALL", "BlockSpec", "by_platform", "ds", "export_for_cuda", "fit", "gpu_available", "has_triton",
           "multiple_of", "pallas_call"]
