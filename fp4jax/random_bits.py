"""``bits(key, shape, dtype)``: the same bits as ``jax.random.bits(key, shape, dtype)``, drawn so that XLA cannot
hoist or share their counters.

``jax.random.bits`` with threefry (and ``jax_threefry_partitionable``, JAX's default) hashes the pair
``(key, counter)`` where the counter of element ``i`` is its row-major index as a 64-bit number in two uint32
arrays (high, low). The counters depend on the shape only, so XLA treats them as constants: it hoists them out
of while loops (a scanned model's backward pass) and merges those of equal shape, and then keeps two uint32
arrays per element of every stochastically rounded operand live for the whole backward pass (for the 12B
model, 6.8 GiB per device; docs/PERF.md). Here the counters are built from iotas plus a zero that XLA cannot
see is zero (``key ^ optimization_barrier(key)``): every counter depends on its key, so it is computed next to
its use, inside the loop, where XLA fuses it with the hash.

The arithmetic is threefry's own (``jax.extend.random.threefry2x32_p``, the primitive ``jax.random.bits``
binds) on the same counters, so the bits are identical (tests/test_random_bits.py checks shapes, dtypes, jit,
vmap and scan). ``KeyedBits`` describes such a draw without making it: a key and counters per row of the
array as a kernel sees it, a counter per column, so that a Pallas kernel hashes its own bits
(``threefry2x32``, the same arithmetic in plain uint32 ops) and no bits array reaches HBM. Whenever that
cannot be guaranteed (another PRNG implementation, a 64-bit width, ``jax_threefry_partitionable=False``, a
zero-size or symbolic shape, a JAX without the primitive) ``bits`` returns ``jax.random.bits`` itself. This module is the only place that relies on JAX's threefry layout.

Three layouts of stochastic-rounding bits (``SR_BITS``, chosen by ``Recipe.sr_bits`` / ``Quantizer.sr_bits`` /
``fp4jax.quantize(sr_bits=)``): "philox", the default (``DEFAULT``), one philox4x32-10 per 16 consecutive
elements along the quantized axis, all 128 bits used (the least integer work per element); "packed", one
threefry2x32 per 8, all 64 bits used; and "jax", the bytes of ``jax.random.bits(key, shape, uint8)`` (one
threefry2x32 per element, 8 of its 64 bits kept); the last two for runs recorded with them (``rounding_bits``;
the contract, with test vectors and the integer work of each, in docs/NUMERICS.md; the statistics in
tests/test_sr_stream.py).
The low-level functions here (``rounding_bits``, ``KeyedBits``) name their layout explicitly and read "jax"
when none is given.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:   # the primitive jax.random.bits binds for threefry keys; JAX's extension API
  from jax.extend.random import threefry2x32_p as _THREEFRY2X32_P
except ImportError:   # pragma: no cover - older/newer JAX without it: jax.random.bits everywhere
  _THREEFRY2X32_P = None

_U32 = jnp.uint32
_WIDTHS = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16, np.dtype(np.uint32): 32}
JAX, PACKED, PHILOX = "jax", "packed", "philox"
SR_BITS = (JAX, PACKED, PHILOX)   # layouts of stochastic-rounding bits (module docstring)
DEFAULT = PHILOX          # the stream of every recipe, quantizer and fp4jax.quantize that names none
GROUP = 8                 # "packed": elements per hash (8 bytes of its two uint32 words)
GROUPS = {PACKED: GROUP, PHILOX: 16}   # elements per hash of the grouped layouts (philox: 16 bytes of 4 words)


def group(layout: str) -> int:
  """Elements per hash: 1 for "jax", else the layout's group (``GROUPS``)."""
  return GROUPS.get(layout, 1)


def bits(key, shape, dtype=jnp.uint32):
  """Uniform random bits of ``shape`` and unsigned ``dtype`` (uint8, uint16, uint32), equal to
  ``jax.random.bits(key, shape, dtype)`` bit for bit. ``key``: one typed key (``jax.random.key``) or a legacy
  uint32 key (``jax.random.PRNGKey``); or a ``Window``: then its rectangle of a larger draw."""
  shape = tuple(shape)
  if isinstance(key, Window):
    return key.bits(shape, dtype)
  key_data = _threefry_key_data(key)
  if key_data is None or not _tied_form_applies(shape, dtype):
    return jax.random.bits(key, shape, dtype)
  k1, k2 = key_data[0], key_data[1]
  counts_hi, counts_lo = _counters(shape, _opaque_zero(k1, k2))
  bits1, bits2 = _THREEFRY2X32_P.bind(k1, k2, counts_hi, counts_lo)
  mixed = bits1 ^ bits2
  return mixed if np.dtype(dtype) == np.dtype(np.uint32) else lax.convert_element_type(mixed, dtype)


def rounding_bits(key, shape, axis: int = -1, layout: str = JAX):
  """8 random bits (uint8, ``shape``) per element for stochastic rounding along ``axis``, in ``layout``.

  "jax": ``bits(key, shape, uint8)``, the bytes of ``jax.random.bits``. "packed": view x with ``axis`` moved
  last, (..., K), and its groups of GROUP = 8 consecutive elements along K as an array (..., K/8); group g's
  counter is its row-major index in that array (a 64-bit number, high and low uint32 words), its hash the
  two words (w0, w1) of threefry2x32(key, counter), and element 8g + e takes byte e of the 64-bit w0 | w1 <<
  32 (``packed_bytes``). K must be a multiple of 8. "philox": the same with groups of 16 and philox4x32-10
  (``philox4x32``) of the key's two words and the counter (low, high, 0, 0); element 16g + e takes byte e % 4
  of word e // 4 (``group_bytes``); K a multiple of 16. ``key``: one threefry2x32 key, or a ``Window`` (its
  rectangle along its last axis; its column start and width multiples of the group)."""
  shape = tuple(shape)
  check_layout(layout)
  if layout == JAX:
    return bits(key, shape, jnp.uint8)
  axis = _check_grouped(shape, axis, layout)
  moved = shape[:axis] + shape[axis + 1:] + (shape[axis] // group(layout),)
  if isinstance(key, Window):
    if axis != len(shape) - 1:
      raise ValueError(f"sr_bits={layout!r} of a Window draws along its last axis; got axis={axis} of {shape}")
    words = key.words(moved, layout)
  else:
    data = _grouped_key_data(key, layout)
    if math.prod(shape) == 0:
      return jnp.zeros(shape, jnp.uint8)
    if not _tied_form_applies(moved, jnp.uint8):
      raise ValueError(f"sr_bits={layout!r} needs a static shape with each axis below 2**32; got {shape}")
    hi, lo = _counters(moved, _opaque_zero(data[0], data[1]))
    words = group_words(layout, data[0], data[1], hi, lo)
  return jnp.moveaxis(group_bytes(words).astype(jnp.uint8), -1, axis)


def check_layout(layout):
  if layout not in SR_BITS:
    raise ValueError(f"sr_bits={layout!r}; use one of {SR_BITS} ('philox': one philox4x32-10 per 16 elements, "
                     "the default; 'packed': one threefry2x32 per 8 elements; 'jax': jax.random.bits' bytes, one "
                     "threefry2x32 per element; docs/NUMERICS.md)")


def _check_grouped(shape, axis: int, layout: str = PACKED) -> int:
  """``axis`` normalized, after checking that the grouped ``layout`` applies to ``shape``."""
  if not shape:
    raise ValueError(f"sr_bits={layout!r} draws along an axis; got a scalar shape")
  axis, n = axis % len(shape), group(layout)
  if shape[axis] % n:
    raise ValueError(f"sr_bits={layout!r} takes {n} consecutive elements along the quantized axis from one "
                     f"hash; axis {axis} of {shape} has length {shape[axis]}, not a multiple of {n}: pad it "
                     "(fp4jax.dot pads to the block) or use sr_bits='jax'")
  return axis


def _grouped_key_data(key, layout: str = PACKED):
  """The key's two uint32 words for a grouped layout (threefry2x32 keys only), else a ValueError."""
  data = _threefry_key_data(key, partitionable=False)
  if data is None:
    raise ValueError(f"sr_bits={layout!r} hashes the two words of a threefry2x32 key: pass one "
                     "jax.random.key(seed) (or a legacy PRNGKey) of the default threefry2x32 implementation, or "
                     "use sr_bits='jax'")
  return data


def packed_bytes(w0, w1):
  """The packed layout's bytes, uint32 < 256 (..., 8·G), of hash words (..., G): element 8g + e takes byte e of
  the 64-bit w0 | w1 << 32, low byte first (bytes 0-3 from w0, 4-7 from w1). Plain uint32 ops, so the same
  function runs in a kernel body and in XLA."""
  e = lax.broadcasted_iota(jnp.int32, (1,) * w0.ndim + (GROUP,), w0.ndim)
  word = jnp.where(e < 4, w0[..., None], w1[..., None])
  b = (word >> ((e & 3) * 8).astype(_U32)) & _U32(0xFF)
  return b.reshape(w0.shape[:-1] + (w0.shape[-1] * GROUP,))


def group_bytes(words):
  """A grouped layout's bytes, uint32 < 256 (..., 4n·G), of its n hash words (a tuple of arrays (..., G)):
  element 4n·g + e of the group takes byte e % 4 of word e // 4, low byte first ("packed", n = 2:
  ``packed_bytes``; "philox", n = 4). The words are first laid side by side (..., G, n) (a select per word
  position), then each byte is a shift and a mask. Plain uint32 ops: a kernel body or XLA."""
  if len(words) == 2:
    return packed_bytes(*words)
  n, w0 = len(words), words[0]
  i = lax.broadcasted_iota(jnp.int32, (1,) * w0.ndim + (n,), w0.ndim)
  word = words[-1][..., None]
  for j in range(n - 2, -1, -1):
    word = jnp.where(i == j, words[j][..., None], word)
  e = lax.broadcasted_iota(jnp.int32, (1,) * word.ndim + (4,), word.ndim)
  b = (word[..., None] >> (e * 8).astype(_U32)) & _U32(0xFF)
  return b.reshape(w0.shape[:-1] + (w0.shape[-1] * 4 * n,))


def group_byte(words, e: int):
  """Byte ``e`` (a Python int) of a group's hash words, as ``group_bytes`` takes it (uint32 < 256)."""
  return (words[e // 4] >> _U32(8 * (e % 4))) & _U32(0xFF)


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)   # philox4x32's multipliers (Salmon et al. 2011, Random123)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)   # its key schedule's increments (golden ratio, sqrt(3) - 1)
PHILOX_ROUNDS = 10


def _mulhi(a, b):
  """The high word of the 64-bit product of uint32 arrays: the product in uint64 (64-bit types for these three
  ops only, ``jax.enable_x64``), shifted. Not ``lax.mulhi``: its CHLO op does not survive the partitioner's
  round trip of a custom-partitioned op on a mesh (jax 0.10: "Unable to convert MHLO to StableHLO")."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, _U32), jnp.asarray(b, _U32))
  with jax.enable_x64(True):
    wide = lax.convert_element_type(a, jnp.uint64) * lax.convert_element_type(b, jnp.uint64)
    return lax.convert_element_type(wide >> jnp.uint64(32), _U32)


def philox4x32(k0, k1, x0, x1, x2, x3, mulhi=_mulhi):
  """philox4x32-10 (Salmon et al. 2011, Random123; the generator of cuRAND's Philox4_32_10 and of jax's
  "philox4x32" PRNG) of the counter words (x0, x1, x2, x3) under the key (k0, k1): four uint32 words.
  ``mulhi(a, b)``: the high word of the 64-bit product of uint32 arrays (``_mulhi``, a uint64 product; a
  compiled kernel passes PTX's mul.hi.u32, ``fp4jax._pallas_compat.mulhi``). Per counter 80 uint32 ops: 10
  rounds of two products (low and high words) and four xors; the key's increments are per key, not per
  counter."""
  m0, m1 = _U32(_PHILOX_M[0]), _U32(_PHILOX_M[1])
  for r in range(PHILOX_ROUNDS):
    if r:
      k0, k1 = k0 + _U32(_PHILOX_W[0]), k1 + _U32(_PHILOX_W[1])
    lo0, hi0 = x0 * m0, mulhi(x0, m0)
    lo1, hi1 = x2 * m1, mulhi(x2, m1)
    x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
  return x0, x1, x2, x3


def _group_hash(layout: str, k1, k2, hi, lo, mulhi=_mulhi):
  """The hash words of a grouped layout at the 64-bit counters (hi, lo) under the key (k1, k2): threefry2x32's
  two ("packed"; plain uint32 ops, as a kernel runs them) or philox4x32-10's four of the counter (lo, hi, 0, 0)
  ("philox")."""
  if layout == PHILOX:
    zero = jnp.zeros_like(lo)
    return philox4x32(k1, k2, lo, hi, zero, zero, mulhi)
  return threefry2x32(k1, k2, hi, lo)


def group_words(layout: str, k1, k2, hi, lo):
  """``_group_hash`` drawn in XLA: "packed" through jax's threefry2x32 primitive (the bits ``jax.random.bits``
  would make there), "philox" in plain uint32 ops."""
  if layout == PACKED:
    return tuple(_THREEFRY2X32_P.bind(k1, k2, hi, lo))
  return _group_hash(layout, k1, k2, hi, lo)


def _threefry_key_data(key, partitionable: bool = True):
  """The key's two uint32 words when ``jax.random.bits`` would hash with threefry2x32 (``partitionable``: with
  its partitionable counters), else None."""
  if _THREEFRY2X32_P is None or (partitionable and not jax.config.jax_threefry_partitionable):
    return None
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != () or str(jax.random.key_impl(key)) != "threefry2x32":
      return None
    return jax.random.key_data(key)
  # A legacy raw key is read with the default implementation, as jax.random.bits does.
  if key.dtype != jnp.uint32 or key.shape != (2,) or str(jax.config.jax_default_prng_impl) != "threefry2x32":
    return None
  return key


def _tied_form_applies(shape, dtype) -> bool:
  if np.dtype(dtype) not in _WIDTHS or not shape:
    return False
  if not all(isinstance(d, (int, np.integer)) for d in shape):
    return False
  return 0 < math.prod(shape) < 2 ** 64 and max(shape) < 2 ** 32


def _opaque_zero(k1, k2):
  """uint32 zero computed from the key through an optimization barrier: XLA cannot fold it (nor anything
  built from it) into a constant, so it cannot hoist the counters out of a loop over keys."""
  b1, b2 = lax.optimization_barrier((k1, k2))
  return (b1 ^ k1) | (b2 ^ k2)


def _counters(shape, zero, strides=None):
  """(high, low) uint32 words of the row-major index of every element of ``shape``: what
  ``jax.random.bits`` hashes, each dimension's iota offset by the opaque ``zero``. The sum of index x stride
  runs in 64 bits on uint32 pairs (no x64 mode needed); each per-dimension iota keeps the SPMD partitioner's
  sharding of the counters (as JAX's own lowering does). ``strides``: those of another layout (a larger
  array's, whose axes these are), default row-major of ``shape``."""
  if strides is None:
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  hi = lo = None
  for d, stride in enumerate(strides):
    if shape[d] == 1:
      continue
    i = lax.broadcasted_iota(_U32, shape, d) + zero
    term = _mul_u32_by_const(i, stride)
    hi, lo = term if lo is None else _add_u64((hi, lo), term)
  if lo is None:   # every dimension is 1: the single counter 0
    lo = jnp.broadcast_to(zero, shape)
    hi = lo
  return hi, lo


def _mul_u32_by_const(i, c: int):
  """(high, low) of the 64-bit product ``i * c`` for uint32 ``i`` and a Python int ``0 <= c < 2**64``
  (here the product is an element index, below 2**64, so the high word never wraps)."""
  c_hi, c_lo = c >> 32, c & 0xFFFFFFFF
  if c_lo == 1:
    lo, hi = i, jnp.zeros_like(i)
  elif c_lo < 2 ** 16 and c_hi == 0:
    # i < 2**32 and c_lo < 2**16: the 48-bit product from 16-bit halves of i.
    p_low = (i & _U32(0xFFFF)) * _U32(c_lo)
    p_high = (i >> _U32(16)) * _U32(c_lo)
    mid = (p_low >> _U32(16)) + (p_high & _U32(0xFFFF))
    lo = (p_low & _U32(0xFFFF)) | (mid << _U32(16))
    hi = (p_high >> _U32(16)) + (mid >> _U32(16))
  else:
    i_lo16, i_hi16 = i & _U32(0xFFFF), i >> _U32(16)
    c_lo16, c_hi16 = _U32(c_lo & 0xFFFF), _U32(c_lo >> 16)
    p0, p1, p2, p3 = i_lo16 * c_lo16, i_lo16 * c_hi16, i_hi16 * c_lo16, i_hi16 * c_hi16
    mid = (p0 >> _U32(16)) + (p1 & _U32(0xFFFF)) + (p2 & _U32(0xFFFF))
    lo = (p0 & _U32(0xFFFF)) | (mid << _U32(16))
    hi = p3 + (p1 >> _U32(16)) + (p2 >> _U32(16)) + (mid >> _U32(16))
  if c_hi:
    hi = hi + i * _U32(c_hi)
  return hi, lo


def _add_u64(a, b):
  (a_hi, a_lo), (b_hi, b_lo) = a, b
  lo = a_lo + b_lo
  carry = (lo < a_lo).astype(_U32)
  return a_hi + b_hi + carry, lo


# ---------------------------------------------------------------------------------------------------
# A rectangle of a larger draw, with traced sizes (fp4jax.grouped: one expert's tensor inside the sorted rows)
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("key_data", "full", "start"),
                   meta_fields=("shape",))
@dataclasses.dataclass(frozen=True)
class Window:
  """Stands for a key: ``bits(window, shape, dtype)`` is the rectangle ``[start : start + shape]`` of
  ``jax.random.bits(key, full, dtype)``, bit for bit, where ``full`` and ``start`` may be traced (a
  segment of dynamic length). 2-D: ``key_data`` the key's two uint32 words, ``full`` and ``start`` two
  integers each, ``shape`` the static rectangle. A request of shape (R, C / r) (one draw per r elements
  along the last axis, as MS-EDEN's scale bits) reads the same rectangle of ``full`` (R_full, C_full / r)."""

  key_data: Any
  full: Any
  start: Any
  shape: tuple[int, int]

  @classmethod
  def of(cls, key, full, start, shape):
    data = _threefry_key_data(key)
    if data is None:
      raise ValueError("random_bits.Window needs threefry2x32 keys with jax_threefry_partitionable=True "
                       "(JAX's default): the counters of another PRNG do not cut into rectangles")
    as_u32 = lambda v: jnp.stack([jnp.asarray(x).astype(_U32) for x in v])
    return cls(data, as_u32(full), as_u32(start), tuple(int(d) for d in shape))

  def bits(self, shape, dtype=jnp.uint32):
    if np.dtype(dtype) not in _WIDTHS:
      raise ValueError(f"a Window draws uint8/16/32 bits; got {np.dtype(dtype).name}")
    bits1, bits2 = self.words(shape)
    mixed = bits1 ^ bits2
    return mixed if np.dtype(dtype) == np.dtype(np.uint32) else lax.convert_element_type(mixed, dtype)

  def words(self, shape, layout: str = PACKED):
    """The hash words at each counter of a (rows, cols / r) request: threefry2x32's two (``bits`` xors them;
    the packed layout, r = 8, keeps both), or ``layout`` "philox"'s four (r = 16)."""
    shape = tuple(int(d) for d in shape)
    rows, cols = self.shape
    if len(shape) != 2 or shape[0] != rows or cols % shape[1]:
      raise ValueError(f"a Window of shape {self.shape} draws (rows, cols / r); got {shape}")
    r = cols // shape[1]
    full_c, start_r, start_c = self.full[1] // _U32(r), self.start[0], self.start[1] // _U32(r)
    i = lax.broadcasted_iota(_U32, shape, 0) + start_r
    j = lax.broadcasted_iota(_U32, shape, 1) + start_c
    hi, lo = _add_u64(_mul_u32(i, full_c), (jnp.zeros_like(j), j))
    return group_words(layout, self.key_data[0], self.key_data[1], hi, lo)

  def keyed(self, layout: str = JAX):
    """``KeyedBits`` of the rectangle. "jax" (one draw per element): row r's counter (start_r + r)·full_c +
    start_c under the window's key, column k's counter k. "packed" ("philox"): the same of the (rows, cols / n)
    group grid, n = 8 (16), column k's counter k // n."""
    rows, cols = self.shape
    full_c, start_c, j = self.full[1], self.start[1], jnp.arange(cols, dtype=_U32)
    if layout != JAX:
      n = _U32(group(layout))
      full_c, start_c, j = full_c // n, start_c // n, j // n
    i = lax.broadcasted_iota(_U32, (rows,), 0) + self.start[0]
    hi, lo = _add_u64(_mul_u32(i, full_c), (jnp.zeros_like(i), jnp.broadcast_to(start_c, (rows,))))
    return KeyedBits(_rows(self.key_data, hi, lo), jnp.stack([jnp.zeros_like(j), j], axis=-1), layout)


def _mul_u32(i, c):
  """(high, low) of the 64-bit product of uint32 arrays ``i`` and ``c`` (traced), from 16-bit halves."""
  c = jnp.broadcast_to(c, i.shape)
  i_lo16, i_hi16 = i & _U32(0xFFFF), i >> _U32(16)
  c_lo16, c_hi16 = c & _U32(0xFFFF), c >> _U32(16)
  p0, p1, p2, p3 = i_lo16 * c_lo16, i_lo16 * c_hi16, i_hi16 * c_lo16, i_hi16 * c_hi16
  mid = (p0 >> _U32(16)) + (p1 & _U32(0xFFFF)) + (p2 & _U32(0xFFFF))
  lo = (p0 & _U32(0xFFFF)) | (mid << _U32(16))
  hi = p3 + (p1 >> _U32(16)) + (p2 >> _U32(16)) + (mid >> _U32(16))
  return hi, lo


# ---------------------------------------------------------------------------------------------------
# The draw as a kernel makes it: threefry2x32 in plain uint32 ops, and the counters it hashes
# ---------------------------------------------------------------------------------------------------

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# uint32 ops ``hashed_bits`` spends per element, as written: the 64-bit counter sum (5), threefry's key
# schedule and first injection (4), 20 rounds of add, rotate (shift, shift, or) and xor (100), 5 injections
# (15), the output xor (1) and the byte mask of ``kernels._common.keyed_bits`` (1). A GPU rotates with one
# funnel shift, so it issues about 40 fewer; what the cost model charges a kernel that hashes (bench/predict/hlo_cost.py).
HASH_OPS = 126
# The packed layout: per group of GROUP elements the 64-bit counter sum (5) and threefry2x32 (119), both words
# kept; per element the byte's word select, shift and mask of ``packed_bytes`` (3): 18.5 per element.
PACKED_GROUP_OPS, PACKED_BYTE_OPS = 124, 3
# The philox layout: per group of 16 the 64-bit counter sum (5), philox4x32-10 (80) and the four words laid
# side by side (3 selects per word position: 12); per element the byte's shift and mask of ``group_bytes``
# (2): 8.1 per element.
PHILOX_GROUP_OPS, PHILOX_BYTE_OPS = 97, 2
_GROUP_OPS = {PACKED: (PACKED_GROUP_OPS, PACKED_BYTE_OPS), PHILOX: (PHILOX_GROUP_OPS, PHILOX_BYTE_OPS)}


def hash_ops(layout: str, elements: int) -> int:
  """uint32 ops spent hashing the rounding bits of ``elements`` elements in ``layout``, as written."""
  if layout in _GROUP_OPS:
    per_group, per_byte = _GROUP_OPS[layout]
    return elements // group(layout) * per_group + elements * per_byte
  return elements * HASH_OPS
_KS_PARITY = 0x1BD11BDA   # threefry's key-schedule constant (Salmon et al. 2011, Random123)


def _rotl(v, r: int):
  return (v << _U32(r)) | (v >> _U32(32 - r))


def threefry2x32(k1, k2, x0, x1):
  """threefry2x32 (20 rounds) of the counter words (x0, x1) under the key (k1, k2), in uint32 adds, shifts,
  ors and xors only, so that it runs inside a Pallas kernel body as well as in XLA. All arguments uint32
  arrays that broadcast together. Equals ``jax.extend.random.threefry2x32_p`` (tests/test_random_bits.py).
  119 uint32 ops per counter: the key schedule and first injection (4), 20 rounds of add, rotate (two shifts
  and an or) and xor (100), 5 key injections of three adds (15)."""
  ks = (k1, k2, k1 ^ k2 ^ _U32(_KS_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for block in range(5):
    for r in _ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(block + 1) % 3]
    x1 = x1 + ks[(block + 2) % 3] + _U32(block + 1)
  return x0, x1


def hashed_bits(k1, k2, row_hi, row_lo, col_hi, col_lo):
  """The uint32 bits ``jax.random.bits`` gives the element whose counter is row + col (64-bit sums of
  (high, low) uint32 words): threefry2x32 of (high, low), its two outputs xored. Plain uint32 ops on arrays
  that broadcast together (a kernel passes a row column and a column row); the low 8 bits are the uint8
  draw."""
  b1, b2 = hashed_words(k1, k2, row_hi, row_lo, col_hi, col_lo)
  return b1 ^ b2


def hashed_words(k1, k2, row_hi, row_lo, col_hi, col_lo, layout: str = PACKED, mulhi=_mulhi):
  """The hash words at the 64-bit counter row + col: threefry2x32's two (``hashed_bits`` before its xor, and a
  group's hash in the packed layout, ``packed_bytes``), or with ``layout`` "philox" philox4x32-10's four
  (``group_bytes``; ``mulhi`` as ``philox4x32`` takes it)."""
  hi, lo = _add_u64((row_hi, row_lo), (col_hi, col_lo))
  return _group_hash(layout, k1, k2, hi, lo, mulhi)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("rows", "cols"),
                   meta_fields=("layout", "row_stride"))
@dataclasses.dataclass(frozen=True)
class KeyedBits:
  """The draw ``rounding_bits`` would make for an array x (..., K), unmade: element (r..., k) of x gets the bits
  of counter ``rows[r..., 2:4] + cols[k]`` under key ``rows[r..., 0:2]``: in ``layout`` "jax" the low byte of
  the xor of threefry2x32's two words (``hashed_bits``, what ``bits`` draws), in "packed" byte k % 8 of the
  two words (``packed_bytes``), the 8 elements of a group sharing their counter, in "philox" byte k % 16 of
  philox4x32's four words (``group_bytes``), 16 elements per counter.

  rows: uint32 (..., 4) = (k1, k2, counter high, counter low) per row of x; cols: uint32 (K, 2) = (counter
  high, low) per column. 12 bytes per row and 8 per column describe R·K elements: a kernel loads its tile of
  each and hashes (``hashed_bits``; grouped: ``hashed_words`` once per group of columns, ``cols[::n]``). The columns
  are constants of the shape (never vmapped: a window's start or a vmapped key lives in ``rows``), so they
  shard along K as x does and carry global counters. ``make(dtype)`` draws the same bits in XLA (the twin's
  side).

  row_stride: where not None, every row has the same key and row r of the rows flattened counts
  ``rows[0, 2:4] + r·row_stride`` (``of`` along the last axis): a kernel then takes the first row alone and
  counts the others itself (``row_counters``), so no (R, 4) array is written for it. Any run of consecutive
  rows keeps the property (a shard of them: its own first row)."""

  rows: Any
  cols: Any
  layout: str = JAX
  row_stride: int | None = None

  @classmethod
  def of(cls, key, shape, axis: int = -1, layout: str = JAX):
    """The bits of ``moveaxis(rounding_bits(key, shape, axis, layout), axis, -1)``: what a kernel quantizing
    along ``axis`` sees. ``key``: one threefry key, or a ``Window`` (its shape, along the last axis). None
    where ``bits`` itself would not use threefry2x32's partitionable counters ("jax"), or for another
    rectangle of a Window (the caller then draws with ``rounding_bits``)."""
    shape = tuple(int(d) for d in shape)
    check_layout(layout)
    axis = axis % len(shape) if layout == JAX else _check_grouped(shape, axis, layout)
    if isinstance(key, Window):   # its own rectangle, along its last axis; else the caller draws
      return key.keyed(layout) if shape == key.shape and axis == 1 else None
    data = _threefry_key_data(key) if layout == JAX else _grouped_key_data(key, layout)
    if data is None or not _tied_form_applies(shape, jnp.uint8):
      return None
    lead = tuple(d for d in range(len(shape)) if d != axis)
    lead_shape = tuple(shape[d] for d in lead)
    # "jax": the row-major strides of shape; "packed": those of the group grid lead_shape + (K/8,)
    grid = shape if layout == JAX else lead_shape + (shape[axis] // group(layout),)
    strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    lead_strides = [strides[d] for d in lead] if layout == JAX else strides[:-1]
    hi, lo = _counters(lead_shape, _U32(0), lead_strides) if lead_shape else (
        jnp.zeros((), _U32), jnp.zeros((), _U32))
    if layout == JAX:
      col_hi, col_lo = _mul_u32_by_const(jnp.arange(shape[axis], dtype=_U32), strides[axis])
    else:
      col_lo = jnp.arange(shape[axis], dtype=_U32) // _U32(group(layout))
      col_hi = jnp.zeros_like(col_lo)
    row_stride = lead_strides[-1] if lead_shape and axis == len(shape) - 1 else None
    return cls(_rows(data, hi, lo), jnp.stack([col_hi, col_lo], axis=-1), layout, row_stride)

  def make(self, dtype=jnp.uint8):
    """The bits as an array (..., K) of ``dtype``, drawn in XLA: equal to ``rounding_bits`` moved as ``of``
    says (tests/test_random_bits.py); "jax" draws 32 bits per element (``bits``), the grouped layouts 8."""
    r = self.rows
    cols = self.cols[::group(self.layout)]   # the grouped layouts: one counter per group
    k = cols.shape[0]
    bcast = lambda v: jnp.broadcast_to(v[..., None], r.shape[:-1] + (k,))
    hi, lo = _add_u64((bcast(r[..., 2]), bcast(r[..., 3])), (cols[:, 0], cols[:, 1]))
    if self.layout == JAX:   # KeyedBits exist only with jax's threefry2x32 primitive
      b1, b2 = _THREEFRY2X32_P.bind(bcast(r[..., 0]), bcast(r[..., 1]), hi, lo)
      mixed = b1 ^ b2
    else:
      mixed = group_bytes(group_words(self.layout, bcast(r[..., 0]), bcast(r[..., 1]), hi, lo))
    return mixed if np.dtype(dtype) == np.dtype(np.uint32) else lax.convert_element_type(mixed, dtype)


def drawn(bits, dtype=jnp.uint8):
  """The bits as an array: a ``KeyedBits`` made (``make``), anything else (an array, None) as it is."""
  return bits.make(dtype) if isinstance(bits, KeyedBits) else bits


def row_counters(base_hi, base_lo, r, stride: int):
  """(high, low) uint32 words of the 64-bit counter base + r·stride (r uint32, ``stride`` a Python int):
  the counter of row r of a ``KeyedBits`` with ``row_stride`` from its first row's (base), as ``of`` counts
  it (the same exact integers: the bits do not change)."""
  return _add_u64((base_hi, base_lo), _mul_u32_by_const(r, stride))


def _rows(key_data, hi, lo):
  """(k1, k2, hi, lo) uint32 per row of the counters' shape."""
  return jnp.stack([jnp.broadcast_to(key_data[0], hi.shape), jnp.broadcast_to(key_data[1], hi.shape), hi, lo],
                   axis=-1)
