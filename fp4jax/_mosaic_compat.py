"""Every jax-version-specific piece of Pallas's Mosaic GPU backend that fp4jax uses, in one place.

Written against jax 0.10.2, whose ``jax.experimental.pallas.mosaic_gpu`` (``plgpu``) has the Blackwell
block-scaled MMA: ``plgpu.tcgen05_mma(acc, a, b, barrier, a_scale=, b_scale=, accumulate=)`` with E2M1
operands in shared memory and E4M3 scales per 16 in tensor memory (``plgpu.TMEM(..., layout=
plgpu.TMEMLayout.SCALES_LAYOUT)``, filled by ``plgpu.async_copy_scales_to_tmem``), which lowers to PTX
``tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X`` (jax/experimental/mosaic/gpu/
tcgen05.py, ``mma``).

Where a Mosaic GPU kernel is compiled (docs/KERNELS.md, "What a Mosaic GPU kernel shows without a GPU"):
lowering, in Python, turns the kernel into an MLIR module (Mosaic GPU's dialects, with the tcgen05
instructions as inline PTX) serialized into the ``mosaic_gpu_v2`` custom call's backend config; XLA's
compile then runs the custom call's FFI "instantiate" stage, which compiles that module for the target's
compute capability (MLIR passes, LLVM NVPTX, ptxas: sm_100a), also on a machine without a GPU. The
environment variables below make that stage write what it produced.
"""
from __future__ import annotations

import contextlib
import functools


@functools.lru_cache(maxsize=None)
def plgpu():
  """``jax.experimental.pallas.mosaic_gpu``, imported on first use (0.4 s: not on ``import fp4jax``), or None
  for a jax without it. Present in jax's CPU wheels too: lowering needs no GPU."""
  try:
    from jax.experimental.pallas import mosaic_gpu   # pylint: disable=import-outside-toplevel
  except ImportError:   # pragma: no cover - a jax without Mosaic GPU
    return None
  return mosaic_gpu

MOSAIC_CUSTOM_CALL = "mosaic_gpu_v2"    # the custom call a Mosaic GPU kernel lowers to (jax 0.10)
# Read by the custom call's compile (jaxlib/mosaic/gpu/dump.cc): a directory for every artifact of each
# kernel it compiles (<name>.mlir-passes.log, .ptx, .ptxas, and .sass_ctrl when nvdisasm is on the CUDA
# path: the nvidia-cuda-nvdisasm wheel), or "-" for stdout.
DUMP_ENV = "MOSAIC_GPU_DUMP_TO"


@functools.lru_cache(maxsize=None)
def has_block_scaled_mma() -> bool:
  """Whether this jax's Mosaic GPU backend has the block-scaled tcgen05 MMA (E2M1 with E4M3 scales)."""
  mgpu = plgpu()
  if mgpu is None or not hasattr(mgpu, "async_copy_scales_to_tmem"):
    return False
  try:
    from jax.experimental.mosaic.gpu import tcgen05   # pylint: disable=import-outside-toplevel
  except ImportError:   # pragma: no cover
    return False
  return hasattr(tcgen05, "create_scaled_f4_instr_descriptor") and hasattr(mgpu.TMEMLayout, "SCALES_LAYOUT")


@contextlib.contextmanager
def lowering_arch(capability: tuple[int, int]):
  """Lower Mosaic GPU kernels for ``capability`` inside the block. jax 0.10.2 records the architecture in a
  kernel's module from the default device (``jax.experimental.mosaic.gpu.core._infer_arch``), which in a
  deviceless process is a CPU: it then records 9.0, whatever the compile targets. Python-side branches of
  Mosaic GPU read it (docs/KERNELS.md, "What a Mosaic GPU kernel shows without a GPU")."""
  from jax.experimental.mosaic.gpu import core   # pylint: disable=import-outside-toplevel
  original = core._infer_arch   # pylint: disable=protected-access
  core._infer_arch = lambda: tuple(capability)   # pylint: disable=protected-access
  try:
    yield
  finally:
    core._infer_arch = original   # pylint: disable=protected-access
