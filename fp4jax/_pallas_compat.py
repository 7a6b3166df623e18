"""Every jax-version-specific piece of Pallas that fp4jax uses, in one place.

The kernels under ``fp4jax.kernels`` only use ``pl.BlockSpec``, ``pl.ds``, ``pl.program_id``, ref
indexing and plain jnp/lax ops inside kernels; the rest (which GPU backend compiles a pallas_call,
its compiler parameters, the exact division the Triton backend lacks, a block's columns read and written
under a mask, lowering a function for CUDA on a machine without a GPU) goes through here.

Written against jax 0.10 (Triton selected by passing ``triton.CompilerParams``; without it jax
picks Mosaic GPU on some versions).
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import export
from jax.experimental import pallas as pl

from fp4jax import _exact
from fp4jax._jax_compat import vma_checked
from fp4jax._native_compat import varying_axes

try:   # the Triton backend of Pallas; present in CPU wheels too (lowering needs no GPU)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:   # pragma: no cover - very old or stripped jax
  _pltriton = None

_MANUAL_AXIS_TYPE = getattr(jax.sharding, "ManualAxisType", None)   # jax 0.10; earlier: ShapeDtypeStruct(vma=)

BlockSpec = pl.BlockSpec
ds = pl.ds
program_id = pl.program_id
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


# jax >= 0.6 names it CompilerParams; older releases TritonCompilerParams.
_TritonParams = (getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams", None)
                 if _pltriton is not None else None)


def has_triton() -> bool:
  return _TritonParams is not None and hasattr(_pltriton, "elementwise_inline_asm")


def compiler_params(num_warps: int, num_stages: int):
  """Compiler parameters that select the Triton backend of Pallas."""
  return _TritonParams(num_warps=num_warps, num_stages=num_stages)


# jax 0.11 deprecates the Pallas Triton backend (Mosaic GPU is its successor) and warns each time a
# Triton kernel is lowered; the kernels here are written for Triton, so that one message is silenced.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


@functools.lru_cache(maxsize=None)
def _quiet_triton_deprecation():
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, interpret: bool, name: str,
                num_warps: int = 4, num_stages: int = 2):
  """``pl.pallas_call`` on the Triton backend (or the interpreter when ``interpret``). The outputs vary
  over the manual mesh axes that any operand varies over (``varying_like``), so a kernel runs inside
  ``shard_map`` with ``check_vma``."""
  params = None if interpret or not has_triton() else compiler_params(num_warps, num_stages)
  if params is not None:
    _quiet_triton_deprecation()

  def call(*args):
    return pl.pallas_call(kernel, out_shape=varying_like(out_shape, args), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name=name, compiler_params=params)(*args)
  return call


def varying_like(out_shape, args):
  """``out_shape`` (a ShapeDtypeStruct or a tuple of them) typed to vary over the union of the manual
  axes that ``args`` vary over: what ``shard_map(check_vma=True)`` needs of a pallas_call's outputs (a
  kernel's output block depends on its operands' blocks, so it varies wherever one of them does)."""
  if not vma_checked():
    return out_shape
  axes = frozenset().union(*map(varying_axes, jax.tree.leaves(args)))
  if _MANUAL_AXIS_TYPE is not None:
    typed = dict(manual_axis_type=_MANUAL_AXIS_TYPE(varying=axes))
  else:   # pragma: no cover - jax before the manual-axis type
    typed = dict(vma=axes)
  one = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, **typed)
  return tuple(one(s) for s in out_shape) if isinstance(out_shape, (tuple, list)) else one(out_shape)


def by_platform(call):
  """``call(interpret)`` chosen by the platform the program is lowered for (a deviceless CUDA compile
  included): the compiled kernel (interpret=False) for CUDA, the interpreter elsewhere."""
  return lambda *args: jax.lax.platform_dependent(*args, cuda=call(False), default=call(True))


def precise_div(a, b, *, interpret: bool):
  """a / b rounded to nearest even (IEEE), elementwise float32, inside a kernel.

  Triton lowers ``arith.divf`` on float32 to PTX ``div.full.f32`` (approximate, up to 2 ulp), so the
  compiled kernel asks for ``div.rn.f32`` explicitly. Interpreted under jit the kernel body is compiled
  by XLA, which rewrites divisions (``fp4jax._exact``); the interpreter therefore divides through
  ``_exact.div``.
  """
  if interpret:   # XLA compiles the interpreted kernel: guard the division from its rewrites
    return _exact.div(a, b)
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  (out,) = _pltriton.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return out


def mulhi():
  """``f(a, b)``: the high word of the 64-bit product of uint32 arrays, inside a compiled kernel: PTX
  ``mul.hi.u32`` (the Triton backend has no lowering of ``lax.mulhi``). An interpreted kernel uses the plain
  uint32 ops of ``random_bits`` instead."""

  def f(a, b):   # int32 in and out (Triton's integers are signless), the bits unchanged
    a, b = (jax.lax.bitcast_convert_type(v, jnp.int32)
            for v in jnp.broadcast_arrays(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)))
    (out,) = _pltriton.elementwise_inline_asm(
        "mul.hi.u32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(out, jnp.uint32)
  return f


def precise_sqrt(a, *, interpret: bool):
  """sqrt(a) rounded to nearest even (IEEE), elementwise float32, inside a kernel: PTX ``sqrt.rn.f32``
  asked for explicitly (Triton's own sqrt may lower to ``sqrt.approx``); the interpreter is exact."""
  if interpret:
    return jnp.sqrt(a)
  a = jnp.asarray(a, jnp.float32)
  (out,) = _pltriton.elementwise_inline_asm(
      "sqrt.rn.f32 $0, $1;", args=[a], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return out


def _below(ref, width, axis: int):
  """A mask of a block's indices below ``width`` along ``axis``, broadcastable to the block."""
  axis %= len(ref.shape)
  shape = tuple(n if a == axis else 1 for a, n in enumerate(ref.shape))
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis) < width


def _whole(ref, width, axis: int) -> bool:
  return isinstance(width, int) and width >= ref.shape[axis]


def load_columns(ref, width, axis: int = -1):
  """A kernel's block with only its first ``width`` indices along ``axis`` read, the rest zeros: a block that
  runs past its array's end (a power-of-two block over an axis that is not, or the last of a grid's blocks
  over it) reads no memory beyond, and the array needs no zero-padded copy. ``width``: a Python int, or
  traced (the valid part of this program's block). ``ref[...]`` when the block is ``width`` wide."""
  if _whole(ref, width, axis):
    return ref[...]
  return _pltriton.load(ref, mask=_below(ref, width, axis), other=0)


def store_columns(ref, value, width, axis: int = -1):
  """``ref[...] = value`` for the block's first ``width`` indices along ``axis`` only (``load_columns``'s
  store): the array ends there, so the kernel writes no padded columns that a slice would then drop."""
  if _whole(ref, width, axis):
    ref[...] = value
  else:
    _pltriton.store(ref, value, mask=_below(ref, width, axis))


def multiple_of(x, m: int):
  """Alignment hint for a dynamic offset inside a kernel."""
  return pl.multiple_of(x, m) if m > 1 else x


def dot_nt_f32(a, b):
  """a (m, k) · b (n, k)ᵀ with float32 accumulation, inside a kernel (tl.dot on GPU)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def gpu_available() -> bool:
  """True when the default backend is a CUDA GPU."""
  try:
    return jax.default_backend() == "gpu" and any(
        d.platform == "gpu" for d in jax.devices())
  except RuntimeError:   # pragma: no cover
    return False


def export_for_cuda(fn, *arg_specs) -> str:
  """StableHLO text of ``jax.jit(fn)`` lowered for CUDA, on any machine.

  Runs the Pallas->Triton lowering of every kernel in ``fn`` (so unsupported ops or non-power-of-two
  tensors inside kernels fail here), without compiling PTX. Used by the CPU tests.
  """
  exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*arg_specs)
  return exp.mlir_module()


@contextlib.contextmanager
def triton_module_texts():
  """The Triton IR (text) of every Pallas kernel lowered for CUDA inside the block, as a list filled while
  they lower. The custom call holds the module only as bytecode, so jax's lowering function is wrapped for
  the block's duration. For tests that read what the GPU will run (e.g. which max a kernel uses)."""
  from jax._src.pallas.triton import lowering   # pylint: disable=import-outside-toplevel
  texts: list[str] = []
  original = lowering.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    texts.append(result.module.operation.get_asm())
    return result

  lowering.lower_jaxpr_to_triton_module = recording
  try:
    yield texts
  finally:
    lowering.lower_jaxpr_to_triton_module = original


@functools.lru_cache(maxsize=None)
def jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
