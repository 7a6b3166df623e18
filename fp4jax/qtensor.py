"""QTensor: a quantized tensor as a pytree (data and scales are leaves, the layout is static).

Plain data: the values it represents come from ``fp4jax.dequantize(q)`` (a layer above).

Validation comes in two parts. The static layout (fmt, axis, block, tile, dtype, scale_rule) is
checked when a QTensor is built, always. The leaves are checked by ``validate`` at the public entry
points (``fp4jax.dequantize``, ``scaled_matmul``, ``transpose_tiles``), not at construction, because
JAX rebuilds pytrees with placeholder leaves (shardings, in_axes, None) inside its transformations.
``validate`` reads shapes and dtypes only (static, so it works under jit, vmap and
custom_partitioning); the amax *value* is checked only when it is concrete (outside jit).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import formats

_HOW = "Build QTensors with fp4jax.quantize, or make this field fit the layout"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A tensor quantized along one axis (1D blocks) or over its last two axes (2D tiles).

  data:  uint8 for nvfp4/mxfp4, two E2M1 codes per byte along ``axis`` (even element in the low
         nibble), so that axis is half as long as in the original tensor; float8_e4m3fn for fp8.
  scale: one per block, blocks laid out like the tensor with the quantized axis divided by the block
         (1D) or the last two axes divided by the tile (2D). float8_e4m3fn (nvfp4), float8_e8m0fnu
         (mxfp4), float32 decode factors (fp8; per-tensor fp8 has shape ()).
  amax:  float32 scalar, the tensor amax the nvfp4 scales were computed with; None otherwise.
  scale2: the second-level scale of the formats that store it (formats.TABLE[fmt].second): float32
         s_dec () for nvfp4_eden, float32 per 1x128 block for nvfp4_dbq (laid out like ``scale`` with
         128 in place of the block); None otherwise.
  axis:  the quantized axis, stored negative (counted from the end) so added leading dims (vmap)
         keep it valid.
  block: elements per 1D block (16, 32, 128), or None with ``tile`` set, or 0 for per-tensor fp8.
  bound: nvfp4's tensor-scale bound B (the amax maps to 6·B): 448, or 256 with Four Over Six.
  """

  data: Any
  scale: Any
  amax: Any
  fmt: str
  axis: int
  block: int | None
  tile: tuple[int, int] | None
  dtype: Any
  scale_rule: str | None = None
  scale2: Any = None
  bound: int = formats.NVFP4_BOUND

  def __post_init__(self):
    _check_static(self)

  def tree_flatten(self):
    return (self.data, self.scale, self.amax, self.scale2), (self.fmt, self.axis, self.block, self.tile,
                                                             self.dtype, self.scale_rule, self.bound)

  @classmethod
  def tree_unflatten(cls, aux, children):
    data, scale, amax, scale2 = children
    fmt, axis, block, tile, dtype, scale_rule, bound = aux
    return cls(data, scale, amax, fmt, axis, block, tile, dtype, scale_rule, scale2, bound)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the original (dequantized) tensor."""
    shape = list(self.data.shape)
    if formats.TABLE[self.fmt].packed:
      shape[self.axis] *= 2
    return tuple(shape)

  @property
  def ndim(self) -> int:
    return len(self.data.shape)

  @property
  def row_scaled(self) -> bool:
    """nvfp4 with one tensor amax per row (the row-scaled activations of ``recipes.nvfp4(row_scaled_
    activation=True)``): amax has one axis fewer than the data; a leading chunk or group axis adds one
    to both."""
    return self.fmt == "nvfp4" and self.amax is not None and jnp.ndim(self.amax) == self.ndim - 1

  @property
  def nbytes(self) -> int:
    """Bytes of data, scales and amax: what storing this tensor costs."""
    leaves = [x for x in (self.data, self.scale, self.amax, self.scale2) if x is not None]
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves)


def along_last(data, scale, amax, *, fmt: str, tiled: bool, dtype=jnp.float32) -> QTensor:
  """The QTensor of codes packed along the last axis, in 1D blocks or the format's 2D tiles, as the
  primitives pass them around (amax is dropped for formats without a tensor scale)."""
  spec = formats.TABLE[fmt]
  return QTensor(data, scale, amax if fmt == "nvfp4" else None, fmt, -1,
                 None if tiled else spec.block, spec.tile if tiled else None, dtype)


# ------------------------------------------------------------------------------------ validation

def _layout_text(q: QTensor) -> str:
  if q.tile is not None:
    return f"{q.tile[0]}x{q.tile[1]} tiles"
  if q.block == 0:
    return "one scale per tensor"
  return f"1x{q.block} blocks along axis {q.axis}"


def _check_static(q: QTensor):
  """The layout fields, which are never placeholders: raise ValueError/TypeError if inconsistent."""
  if q.fmt not in formats.ALL:
    raise ValueError(f"QTensor.fmt={q.fmt!r} is not a format; use one of {formats.ALL}")
  if q.bound not in formats.BOUNDS or (q.fmt != "nvfp4" and q.bound != formats.NVFP4_BOUND):
    raise ValueError(f"QTensor.bound={q.bound!r}: nvfp4's tensor-scale bound is 448 (256 with Four Over "
                     f"Six); fmt={q.fmt!r} takes the default {formats.NVFP4_BOUND}")
  if not isinstance(q.axis, (int, np.integer)) or isinstance(q.axis, bool) or q.axis >= 0:
    raise ValueError(f"QTensor.axis={q.axis!r} must be a negative int (the quantized axis counted "
                     "from the end, e.g. -1), so that vmap's added leading axes keep it valid")
  spec = formats.TABLE[q.fmt]
  if spec.second in ("s_dec", "outer") and q.axis != -1:
    raise ValueError(f"QTensor.axis={q.axis} with fmt={q.fmt!r}: its scales are laid out along the last "
                     "axis; use axis=-1")
  if q.tile is not None:
    if q.fmt not in formats.TILE or tuple(q.tile) != formats.TILE[q.fmt]:
      allowed = ", ".join(f"{f} {t}" for f, t in formats.TILE.items())
      raise ValueError(f"QTensor.tile={q.tile!r} is not a tile of fmt={q.fmt!r}; 2D tiles are {allowed}")
    if q.block is not None:
      raise ValueError(f"QTensor has both tile={q.tile} and block={q.block}; a 2D-tiled tensor has "
                       "block=None")
    if q.axis not in (-1, -2):
      raise ValueError(f"QTensor.axis={q.axis} with tile={q.tile}: the packed axis of a tiled tensor "
                       "is -1 or -2")
  elif q.block == 0:
    if q.fmt != "fp8":
      raise ValueError(f"QTensor.block=0 (one scale per tensor) exists only for fp8; fmt={q.fmt!r} "
                       f"uses block={spec.block}")
  elif q.block != spec.block:
    raise ValueError(f"QTensor.block={q.block!r} does not fit fmt={q.fmt!r}, tile=None: use "
                     f"block={spec.block}" + (f", or tile={spec.tile} with block=None" if spec.tile else "")
                     + (", or block=0 for one scale per tensor" if q.fmt == "fp8" else ""))
  try:
    dtype = jnp.dtype(q.dtype)
  except TypeError:
    raise TypeError(f"QTensor.dtype={q.dtype!r} is not a dtype; it is the dtype of the tensor that "
                    "was quantized, e.g. jnp.float32") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"QTensor.dtype={dtype} must be a floating dtype (the quantized tensor's dtype)")
  if q.scale_rule is not None and q.scale_rule not in formats.SCALE_RULES:
    raise ValueError(f"QTensor.scale_rule={q.scale_rule!r}; use None or one of {formats.SCALE_RULES}")


def _is_array(v) -> bool:
  return hasattr(v, "shape") and hasattr(v, "dtype")


def _concrete(v):
  """v as a numpy array when its value is known now, else None (a tracer under jit or vmap)."""
  if isinstance(v, jax.core.Tracer):
    return None
  return np.asarray(v)


def validate(q, where: str, *, scalar_amax: bool = False) -> QTensor:
  """Check that the leaves of ``q`` fit its layout; raise TypeError/ValueError saying what does not.

  where: the public op, for the message (e.g. "fp4jax.dequantize"). scalar_amax: the op needs a
  scalar nvfp4 amax (vmapped QTensors carry one per leading slice otherwise).
  Checks: data and scale are arrays of the format's dtypes; the scale shape is exactly the block or
  tile grid of the tensor (no broadcasting); the quantized axis is a multiple of the block or tile;
  amax is a float32 array for nvfp4 (None for the other formats) whose shape is a prefix of the
  leading axes; and, when amax is concrete, it is not negative, and 0 only with all-zero scales
  (the quantization of an all-zero tensor). NaN and inf amaxes are allowed: quantizing a tensor
  that holds NaN or inf gives them, and they dequantize to NaN / inf, never to finite values.
  """
  if not isinstance(q, QTensor):
    raise TypeError(f"{where} takes a QTensor from fp4jax.quantize; got {type(q).__name__}")
  spec = formats.TABLE[q.fmt]
  for name in ("data", "scale"):
    v = getattr(q, name)
    if not _is_array(v):
      raise TypeError(f"{where}: QTensor.{name} must be an array; got {type(v).__name__}. {_HOW}")
  if q.data.dtype != spec.data_dtype:
    raise TypeError(f"{where}: QTensor.data has dtype {q.data.dtype}; fmt={q.fmt!r} stores "
                    f"{jnp.dtype(spec.data_dtype)}. {_HOW}")
  if q.scale.dtype != spec.scale_dtype:
    raise TypeError(f"{where}: QTensor.scale has dtype {q.scale.dtype}; fmt={q.fmt!r} stores "
                    f"{jnp.dtype(spec.scale_dtype)} scales. {_HOW}")
  nd = q.data.ndim
  if nd < (2 if q.tile is not None else 1) or q.axis < -nd:
    raise ValueError(f"{where}: QTensor.data has shape {q.data.shape}, too few axes for axis={q.axis}"
                     + (f" and tile={q.tile}" if q.tile is not None else "") + f". {_HOW}")
  shape = q.shape
  axis = q.axis % nd
  if q.tile is not None:
    (r, c), (m, k) = q.tile, shape[-2:]
    if m % r or k % c:
      raise ValueError(f"{where}: a {q.fmt} tensor of shape {shape} in {r}x{c} tiles needs the last "
                       f"two axes to be multiples of ({r}, {c}). {_HOW}")
    want = shape[:-2] + (m // r, k // c)
  elif q.block == 0:
    want = ()
  else:
    if shape[axis] % q.block:
      raise ValueError(f"{where}: axis {q.axis} of the {q.fmt} tensor has length {shape[axis]}, not a "
                       f"multiple of the block {q.block}. {_HOW}")
    want = shape[:axis] + (shape[axis] // q.block,) + shape[axis + 1:]
  if tuple(q.scale.shape) != want:
    raise ValueError(f"{where}: QTensor.scale has shape {tuple(q.scale.shape)}; a {q.fmt} tensor of "
                     f"shape {shape} in {_layout_text(q)} needs scale shape {want}. {_HOW}")
  _check_amax(q, where, scalar_amax, axis)
  _check_scale2(q, where, want)
  return q


def _check_scale2(q: QTensor, where: str, scale_shape):
  second = formats.TABLE[q.fmt].second
  if second in (None, "amax"):
    if q.scale2 is not None:
      raise ValueError(f"{where}: QTensor.scale2 is the stored second-level scale of nvfp4_eden and "
                       f"nvfp4_dbq; fmt={q.fmt!r} has none, so scale2 must be None")
    return
  if not _is_array(q.scale2) or q.scale2.dtype != jnp.float32:
    raise TypeError(f"{where}: QTensor.scale2 of a {q.fmt} tensor must be a float32 array; got "
                    f"{getattr(q.scale2, 'dtype', type(q.scale2).__name__)}. {_HOW}")
  if second == "s_dec":
    if q.scale2.ndim > len(scale_shape) - 1 or tuple(q.scale2.shape) != tuple(scale_shape[:q.scale2.ndim]):
      raise ValueError(f"{where}: QTensor.scale2 (s_dec) has shape {tuple(q.scale2.shape)}; it must be "
                       "() or one per vmapped slice")
    return
  per = formats.TABLE[q.fmt].outer // q.block
  want = tuple(scale_shape[:-1]) + (scale_shape[-1] // per,) if scale_shape else ()
  if scale_shape and scale_shape[-1] % per or tuple(q.scale2.shape) != want:
    raise ValueError(f"{where}: QTensor.scale2 has shape {tuple(q.scale2.shape)}; a {q.fmt} tensor with "
                     f"block scales {tuple(scale_shape)} needs one per {formats.TABLE[q.fmt].outer} "
                     f"elements: {want}. {_HOW}")


def _check_amax(q: QTensor, where: str, scalar_amax: bool, axis: int):
  if q.fmt != "nvfp4":
    if q.amax is not None:
      raise ValueError(f"{where}: QTensor.amax is the nvfp4 tensor amax; fmt={q.fmt!r} has none, so "
                       "amax must be None")
    return
  if q.amax is None:
    raise ValueError(f"{where}: an nvfp4 QTensor needs its tensor amax (float32 scalar), the one its "
                     "scales were computed with; got amax=None. " + _HOW)
  if not _is_array(q.amax):
    raise TypeError(f"{where}: QTensor.amax must be a float32 array; got {type(q.amax).__name__}. "
                    "Use jnp.float32(value)")
  if q.amax.dtype != jnp.float32:
    raise TypeError(f"{where}: QTensor.amax has dtype {q.amax.dtype}; it must be float32. "
                    "Use jnp.float32(value)")
  lead = q.amax.ndim
  max_lead = 0 if scalar_amax else (q.data.ndim - 2 if q.tile is not None else axis)
  if lead > max_lead or tuple(q.amax.shape) != tuple(q.data.shape[:lead]):
    need = "shape ()" if scalar_amax else f"shape () or a prefix of the leading axes {q.data.shape[:max_lead]}"
    raise ValueError(f"{where}: QTensor.amax has shape {tuple(q.amax.shape)}; it must have {need} "
                     "(one tensor amax per vmapped slice)")
  amax = _concrete(q.amax)
  if amax is None:
    return
  if np.any(amax < 0):
    raise ValueError(f"{where}: QTensor.amax={amax.tolist()} is negative; the tensor amax is max|x| "
                     ">= 0")
  if np.any(amax == 0):
    scale = _concrete(q.scale)
    # One amax per leading slice (vmapped, or row-scaled): each zero amax needs its own slice's scales 0.
    nonzero = None if scale is None else (scale.view(np.uint8) != 0).reshape(amax.shape + (-1,)).any(-1)
    if nonzero is not None and np.any(nonzero & (amax == 0)):
      raise ValueError(f"{where}: QTensor.amax is 0 but some block scales are not; amax 0 means an "
                       "all-zero tensor (all scales 0), and would dequantize every block to 0. Pass "
                       "the amax the scales were computed with")
