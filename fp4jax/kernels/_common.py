"""Kernel-friendly numerics shared by the Pallas kernels, and tile fitting.

Inside a Triton kernel there is no float8 type to cast through, no frexp/ldexp and no exact float32
division, so the block scales are computed here from integer bit operations. Each function equals the
reference in ``fp4jax.nvfp4`` / ``fp4jax.mxfp4`` / ``fp4jax.e2m1`` bit for bit on finite inputs (the
tests check that on dense sweeps). The E2M1 encodes work on the float's exponent and mantissa bits
(about a dozen ops per element, no chain of seven threshold comparisons) and equal ``fp4jax.e2m1`` on
every float32, NaN and infinities included. NaN: Triton's float min/max drop NaN where XLA's propagate it, so NaN inputs give
implementation-defined (but non-crashing) codes and scales in compiled kernels.

Scales leave the kernels as raw bytes (uint8): E4M3 for NVFP4, E8M0 (biased exponent) for MXFP4.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp4jax import _pallas_compat as plc
from fp4jax import random_bits
from fp4jax.numerics import nvfp4
from fp4jax._pallas_compat import precise_div
from fp4jax.numerics.scales import E4M3_MAX, FLT_MAX

_MIN_NORMAL_E4M3 = 2.0 ** -6


def _f32_bits(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def _f32_from_bits(b):
  return lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def clip(v, lo, hi):
  """``jnp.clip(v, lo, hi)`` that keeps NaN on the GPU too: Triton lowers a float max/min to maxnum/minnum,
  which return the number, so a clipped NaN element would become a bound (and its code differ from the
  XLA twin's). Comparisons are false for NaN, so these selects pass it through."""
  return jnp.where(v < lo, lo, jnp.where(v > hi, hi, v))


# ---------------------------------------------------------------- E4M3 (NVFP4 block scales)

def e4m3_byte(v):
  """E4M3 byte of float32 ``v`` >= 0: round to nearest even, saturate at 448, NaN -> 0x7F.

  Equals ``bitcast(e4m3_rne_satfinite(v), uint8)`` for v >= 0. Returns int32 in [0, 127].
  """
  is_nan = v != v
  v = jnp.where(v > E4M3_MAX, jnp.float32(E4M3_MAX), v)   # a select, not Triton's NaN-dropping minnum
  # Normal range: round the float32 mantissa to 3 bits, ties to even, carrying into the exponent.
  bits = _f32_bits(v)
  rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
  normal = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7)
  # Subnormal range: multiples of 2^-9; v·512 is exact, round it to an integer, ties to even
  # (8 is the smallest normal, byte 0x08, so the same formula covers the boundary).
  y = v * jnp.float32(512.0)
  fl = y.astype(jnp.int32)                      # y >= 0: truncation is floor
  frac = y - fl.astype(jnp.float32)
  up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
  sub = fl + up.astype(jnp.int32)
  byte = jnp.where(v < jnp.float32(_MIN_NORMAL_E4M3), sub, normal)
  return jnp.where(is_nan, 0x7F, byte)


def e4m3_value(byte):
  """float32 value of E4M3 bytes (int32 or uint8), exact."""
  b = byte.astype(jnp.int32)
  exp = (b >> 3) & 15
  mant = b & 7
  normal = _f32_from_bits(((exp + 120) << 23) | (mant << 20))
  sub = mant.astype(jnp.float32) * jnp.float32(2.0 ** -9)
  mag = jnp.where(exp == 0, sub, normal)
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def nvfp4_block_encode(amax_b, s_enc6, s_dec, *, interpret):
  """E4M3 scale bytes (int32) and float32 encode factors of blocks, spec §2 order.

  s_enc6 = S_enc · f32(1/6) and s_dec = 1 / S_enc are computed once per tensor outside the kernel
  (exactly as ``nvfp4.block_scales`` does) and passed in.
  """
  prod = amax_b * s_enc6
  byte = e4m3_byte(jnp.where(prod > FLT_MAX, jnp.float32(FLT_MAX), prod))   # NaN passes (comparisons are false)
  s_b = e4m3_value(byte)
  enc = precise_div(jnp.float32(1.0), s_b * s_dec, interpret=interpret)
  enc = jnp.where(enc > FLT_MAX, jnp.float32(FLT_MAX), enc)
  return byte, enc


def nvfp4_tensor_params(amax_g, *, interpret):
  """(S_enc · f32(1/6), 1 / S_enc, p) of tensor amaxes (any shape), inside a kernel, from the amax the kernel
  reads (``amax_operand``): no pass of their own before it.

  p = ``nvfp4.encode_shift(amax_g)`` (2^64 for a tensor amax below 2^-64, else 1): the kernel
  multiplies x by p, and S_enc is that of amax_g · p, as ``nvfp4.quantize_blocks`` does. Both divisions are
  correctly rounded (``precise_div``), as XLA's are in ``nvfp4.block_scales``: the same bits.
  """
  divide = lambda a, b: precise_div(a, b, interpret=interpret)
  p = nvfp4.encode_shift(amax_g)
  s_enc = nvfp4.global_encode_scale(amax_g * p, divide)
  return s_enc * jnp.float32(1.0 / 6.0), divide(jnp.float32(1.0), s_enc), p   # as nvfp4.block_scales


def amax_operand(amax, rows_shape, rows: int):
  """A kernel's NVFP4 tensor amax operand, float32 (A, 1): (1, 1) for one amax (every program reads it: no
  pass writes anything for it), else the amax of each of the kernel's rows (``rows_shape``, the rows' leading
  axes; amax of shape rows_shape[:n], one per vmapped slice), zero-padded to ``rows``. MXFP4 reads none:
  pass zeros."""
  amax = jnp.asarray(amax, jnp.float32)
  if amax.ndim == 0:
    return amax.reshape(1, 1)
  a = amax.reshape(amax.shape + (1,) * (len(rows_shape) - amax.ndim))
  return pad_axis(jnp.broadcast_to(a, tuple(rows_shape)).reshape(-1, 1), 0, rows)


def amax_spec(amax_Ax1, block_rows: int, row_block):
  """The BlockSpec of ``amax_operand``'s result: the one amax for every program, or the program's rows
  (``row_block``: grid indices -> the index of its block of ``block_rows`` rows)."""
  if amax_Ax1.shape == (1, 1):
    return plc.BlockSpec((1, 1), lambda *g: (0, 0))
  return plc.BlockSpec((block_rows, 1), lambda *g: (row_block(*g), 0))


# ---------------------------------------------------------------- E8M0 (MXFP4 block scales)

def e8m0_block_encode(amax_b, rule: str):
  """E8M0 scale bytes (int32), the exact float32 factors 2^-exp (2^-126 for exp 127) and the
  exponents (int32) of MXFP4 blocks (spec §3)."""
  bits = _f32_bits(amax_b)
  if rule == "floor":
    exp = ((bits >> 23) & 0xFF) - 127 - 2
    exp = jnp.where(((bits >> 23) & 0xFF) == 0, -127, exp)      # zero / subnormal amax
  elif rule == "rceil":
    y = amax_b * jnp.float32(1.0 / 6.0)
    ybits = _f32_bits(y)
    e_field = (ybits >> 23) & 0xFF
    pow2 = (ybits & 0x7FFFFF) == 0
    exp = jnp.where(pow2, e_field - 127, e_field - 126)
    # y subnormal: ceil(log2 y) is -126 above 2^-127, else clipped to -127 below.
    exp = jnp.where(e_field == 0, jnp.where(y > jnp.float32(2.0 ** -127), -126, -127), exp)
  else:
    raise ValueError(f"unknown MXFP4 scale rule {rule!r}; use 'rceil' or 'floor'")
  exp = jnp.clip(exp, -127, 127)
  exp = jnp.where(amax_b == 0, -127, exp)
  exp = jnp.where(amax_b == jnp.float32(jnp.inf), 127, exp)
  byte = jnp.where(amax_b != amax_b, 0xFF, exp + 127)
  inv = _f32_from_bits((jnp.maximum(-exp, -126) + 127) << 23)
  return byte, inv, exp


def mxfp4_scaled(x_f32, inv, exp):
  """x / 2^exp clipped like ``mxfp4.quantize_blocks``: (x · inv) · 2^min(126 - exp, 0), then clipped
  to ±6, or to ±3 (exp 126) and ±1.5 (exp 127), the largest codes whose values stay finite; ±inf
  elements keep ±6. ``inv`` and ``exp`` broadcast against x."""
  rest = jnp.where(exp >= 127, jnp.float32(0.5), jnp.float32(1.0))
  limit = jnp.where(exp >= 127, jnp.float32(1.5), jnp.where(exp == 126, jnp.float32(3.0),
                                                             jnp.float32(6.0)))
  limit = jnp.where(jnp.abs(x_f32) == jnp.float32(jnp.inf), jnp.float32(6.0), limit)
  return clip((x_f32 * inv) * rest, -limit, limit)


def e8m0_value(byte):
  """float32 2^(byte - 127) of E8M0 bytes (byte 0 -> 2^-127, a subnormal; 0xFF -> NaN)."""
  b = byte.astype(jnp.int32)
  val = jnp.where(b == 0, _f32_from_bits(jnp.full(b.shape, 0x00400000, jnp.int32)),
                  _f32_from_bits(b << 23))
  return jnp.where(b == 255, jnp.float32(jnp.nan), val)


# ---------------------------------------------------------------- E2M1 elements

_ONE_BITS = 0x3F800000           # float32 1.0
_TWO_POW_22 = 4194304.0          # x + 2^22 rounds x to a multiple of 0.5, ties to even (RNE adder)
_TWO_POW_22_BITS = 0x4A800000    # its float32 bits (a literal: Triton cannot bitcast a constant)


def _sign_code(xbits):
  """8 for a set float32 sign bit (also for -0 and -NaN), else 0."""
  return (xbits >> 28) & 8


def encode_rne_bits(x_f32):
  """E2M1 codes (int32) of float32 values, round to nearest even, from the float's bits.

  Equals ``e2m1.encode_rne`` on every float32 (saturation at ±6, -0 for small negatives, NaN -> ±0).
  |x| >= 1: rounding the 23-bit mantissa to 1 bit (ties to even, carry into the exponent) turns the
  bits >> 22 into (biased exponent, mantissa bit) = code + 252. |x| < 1: the grid is 0, 0.5, 1, and
  one RNE float add against 2^22 (ulp 0.5 there) rounds |x| to it, ties to even. About 12 integer
  and float ops per element, no threshold chain.
  """
  xbits = lax.bitcast_convert_type(x_f32.astype(jnp.float32), jnp.int32)
  mbits = xbits & 0x7FFFFFFF
  mag = lax.bitcast_convert_type(mbits, jnp.float32)
  normal = ((mbits + 0x1FFFFF + ((mbits >> 22) & 1)) >> 22) - 252
  small = _f32_bits(mag + jnp.float32(_TWO_POW_22)) - _TWO_POW_22_BITS
  code = jnp.where(mbits < _ONE_BITS, small, jnp.minimum(normal, 7))
  code = jnp.where(mbits > 0x7F800000, 0, code)                     # NaN -> ±0, as the reference
  return code | _sign_code(xbits)


def encode_sr_bits(x_f32, bits):
  """E2M1 codes (int32) with stochastic rounding (8 random bits per element), from the float's bits.

  Equals ``e2m1.encode_stochastic``: t = |x| + u·step(|x|) with u = bits/256 and step = 2^(e-1)
  (0.5 below 1) taken from the exponent field; t computed as one float add like the reference. Then
  the code is t truncated to one mantissa bit ((bits(t) >> 22) - 252) for t >= 1, else t >= 0.5.
  The exact sum needs no FMA: u·step has at most 8 significant bits.
  """
  xbits = lax.bitcast_convert_type(x_f32.astype(jnp.float32), jnp.int32)
  mbits = xbits & 0x7FFFFFFF
  mag = lax.bitcast_convert_type(mbits, jnp.float32)
  step = _f32_from_bits(jnp.maximum(mbits & 0x7F800000, _ONE_BITS) - 0x00800000)
  u = (bits.astype(jnp.int32) & 0xFF).astype(jnp.float32) * jnp.float32(1.0 / 256.0)
  t = mag + u * step
  tbits = _f32_bits(t)
  code = jnp.where(tbits < _ONE_BITS, (t >= jnp.float32(0.5)).astype(jnp.int32),
                   jnp.minimum((tbits >> 22) - 252, 7))
  code = jnp.where(mbits > 0x7F800000, 0, code)
  return code | _sign_code(xbits)


def e2m1_value(codes):
  """float32 values of E2M1 codes (int32/uint8, low nibble), built from bits: the sign, then for
  magnitude codes >= 2 the 2-bit exponent and 1-bit mantissa shifted into place (+ bias 126), codes
  0 and 1 (0 and 0.5) by one select. Equals ``e2m1.decode``."""
  c = codes.astype(jnp.int32)
  mag = c & 7
  normal = (mag << 22) + 0x3F000000
  small = jnp.where(mag == 1, 0x3F000000, 0)
  return _f32_from_bits(jnp.where(mag < 2, small, normal) | ((c & 8) << 28))


def dequantize_tile(p, s, *, fmt: str, tiled: bool, tile: int = 16):
  """float32 (R, K) of e2m1(code) · block scale (exact) from packed codes p (R, K/2, low nibble first)
  and scale bytes s (R, K/B), or (R/tile, K/tile) with ``tiled``: the decode both Pallas GEMM designs
  run (``scaled_matmul``'s dequantize pass, once per element; ``mixed_matmul``'s K loop, per tile)."""
  p = p.astype(jnp.int32)
  r, k2 = p.shape
  k = 2 * k2
  codes = jnp.stack([p & 0xF, (p >> 4) & 0xF], axis=-1).reshape(r, k)
  vals = e2m1_value(codes)
  s = e4m3_value(s) if fmt == "nvfp4" else e8m0_value(s)
  if tiled:
    g, nb = s.shape
    s_full = jnp.broadcast_to(s[:, None, :, None], (g, tile, nb, tile)).reshape(r, k)
  else:
    nb = s.shape[1]
    s_full = jnp.broadcast_to(s[:, :, None], (r, nb, k // nb)).reshape(r, k)
  return vals * s_full


def encode(scaled_f32, bits):
  """E2M1 codes (int32) of values scaled into [-6, 6]; ``bits`` None = nearest even, else stochastic."""
  if bits is None:
    return encode_rne_bits(scaled_f32)
  return encode_sr_bits(scaled_f32, bits)


# ---------------------------------------------------------------- stochastic-rounding bits

def sr_mode(bits):
  """How a kernel gets its rounding bits: None (nearest even), "bits" (a uint8 array of x's shape, loaded),
  "key" (``random_bits.KeyedBits`` in the "jax" layout: two small operands, rows (R, 4) and cols (K, 2),
  one hash per element in the kernel; no bits array in HBM), or a grouped layout's name, "packed" or "philox"
  (KeyedBits in that layout: rows (R, 4) and cols (K/n, 2), one hash per n = 8 or 16 elements)."""
  if bits is None:
    return None
  if not isinstance(bits, random_bits.KeyedBits):
    return "bits"
  return "key" if bits.layout == random_bits.JAX else bits.layout


def grouped(mode) -> bool:
  """Whether ``sr_mode`` is a grouped layout (one hash per group of columns)."""
  return mode in random_bits.GROUPS


def group_hash(mode, *args, interpret: bool):
  """The hash words of grouped layout ``mode`` at (k1, k2, row_hi, row_lo, col_hi, col_lo), inside a kernel:
  ``random_bits.hashed_words``, compiled with PTX's high-word product (``plc.mulhi``)."""
  if interpret:
    return random_bits.hashed_words(*args, layout=mode)
  return random_bits.hashed_words(*args, layout=mode, mulhi=plc.mulhi())


def keyed_bits(k1, k2, row_hi, row_lo, col_hi, col_lo):
  """8 random bits (uint32 < 256) per element of the broadcast of a row column and a column row,
  hashed in the kernel: the low byte of ``jax.random.bits`` at counter row + col (``random_bits``)."""
  return random_bits.hashed_bits(k1, k2, row_hi, row_lo, col_hi, col_lo) & jnp.uint32(0xFF)


def counted_stride(bits, flat: bool):
  """The row step with which a kernel counts its rows' counters itself from the first row's
  (``random_bits.KeyedBits.row_stride``), or None where it loads each row's: bits not KeyedBits, no row_stride,
  or x's rows not ``flat`` (one run of rows: the kernel's x (R, K) is the op's, not vmapped slices stacked)."""
  if not flat or not isinstance(bits, random_bits.KeyedBits):
    return None
  return bits.row_stride


def key_rows(rows_ref, first_row=None, stride=None):
  """(k1, k2, counter high, counter low), each (R, 1) uint32, of a block of R rows: loaded from rows_ref (R, 4),
  or with ``stride`` counted from the first row of the array (rows_ref (1, 4)): the block's rows are
  ``first_row`` (traced) + 0..R-1, R the caller's block (``random_bits.row_counters``; the same integers)."""
  col = lambda i: rows_ref[:, i][:, None]
  if stride is None:
    return col(0), col(1), col(2), col(3)
  return (col(0), col(1)) + random_bits.row_counters(col(2), col(3), first_row, stride)


def block_rows(first_row, rows: int):
  """uint32 (rows, 1): the indices of a block's rows, ``first_row`` (traced: program id · block) onwards."""
  return first_row.astype(jnp.uint32) + lax.broadcasted_iota(jnp.uint32, (rows, 1), 0)


def tile_bits(mode, refs, width=None, *, interpret: bool, rows=None, stride=None):
  """The rounding bits of a (R, K) tile: None, the loaded tile (``mode`` "bits": refs = (bits_ref,)), or
  hashed from refs = (rows_ref (R, 4), cols_ref (K, 2)) (``mode`` "key"), or (rows_ref (R, 4), cols_ref
  (K/n, 2)) (a grouped ``mode``: one hash per n columns, its bytes spread over them). Ref reads, not register
  slices (Triton has no slice). ``width``: the tile's columns inside the array (``plc.load_columns``), None for
  all: the loaded bits of the columns past it are zeros (never stored; KeyedBits' cols are padded whole,
  ``bits_operands``). ``stride`` (``counted_stride``): rows_ref is the array's first row (1, 4) and ``rows``
  the tile's row indices (``block_rows``), from which ``key_rows`` counts."""
  if mode is None:
    return None
  if mode == "bits":
    return refs[0][...] if width is None else plc.load_columns(refs[0], width)
  rows_ref, cols_ref = refs
  args = key_rows(rows_ref, rows, stride) + (cols_ref[:, 0][None, :], cols_ref[:, 1][None, :])
  if grouped(mode):
    return random_bits.group_bytes(group_hash(mode, *args, interpret=interpret))
  return keyed_bits(*args)


def int_ops_suffix(mode, elements: int) -> str:
  """``_<n>iop`` for a kernel that hashes its bits (``mode`` "key" or a grouped layout), n =
  ``random_bits.hash_ops`` of ``elements``, else "": appended to the pallas_call name, it tells
  bench/predict/hlo_kernels.py the integer work the kernel does beside its bytes (the Triton backend drops
  ``pl.CostEstimate``)."""
  if mode != "key" and not grouped(mode):
    return ""
  return f"_{random_bits.hash_ops(random_bits.JAX if mode == 'key' else mode, elements)}iop"


def packed_cols(bits):
  """The column counters a grouped-layout kernel loads: one per group of n columns (``cols[::n]``)."""
  return bits.cols[::random_bits.group(bits.layout)]


def bits_operands(bits, rows: int, cols: int, row_pad: int, col_pad: int, row_block: int, col_block: int,
                  index, masked: bool = False, stride=None):
  """(operands, BlockSpecs) of the rounding bits of an x viewed as (rows, cols) in (row_block, col_block)
  blocks on the grid position ``index(i, j) -> (row block, col block)``, zero-padded to (row_pad, col_pad):
  nothing (RNE), the uint8 bits, or KeyedBits' rows (rows, 4) and cols (cols, 2) (grouped: (cols / n, 2);
  col_block and col_pad are multiples of n there). ``masked``: the kernel masks its last column block
  (``tile_bits``' width), so the uint8 bits keep their cols; KeyedBits' cols are padded still (the counters'
  own fusion writes them, a few bytes per column). ``stride`` (``counted_stride``): KeyedBits' first row
  alone, (1, 4), whole in every program (the kernel counts the others: no (rows, 4) array written for it)."""
  mode = sr_mode(bits)
  if mode is None:
    return [], []
  if mode == "bits":
    b = pad_axis(pad_axis(bits.reshape(rows, cols), 0, row_pad), 1, cols if masked else col_pad)
    return [b], [plc.BlockSpec((row_block, col_block), index)]
  g = random_bits.group(bits.layout)
  c = pad_axis(packed_cols(bits), 0, col_pad // g)
  if stride is not None:
    return [bits.rows.reshape(rows, 4)[:1], c], [plc.BlockSpec((1, 4), lambda i, j: (0, 0)),
                                              plc.BlockSpec((col_block // g, 2), lambda i, j: (index(i, j)[1], 0))]
  r = pad_axis(bits.rows.reshape(rows, 4), 0, row_pad)
  return [r, c], [plc.BlockSpec((row_block, 4), lambda i, j: (index(i, j)[0], 0)),
                  plc.BlockSpec((col_block // g, 2), lambda i, j: (index(i, j)[1], 0))]


# ---------------------------------------------------------------- tiles

def fit(dim: int, pref: int) -> tuple[int, int]:
  """(block, padded_dim): a power-of-two block <= ``pref`` for an axis of length ``dim``.

  Triton tensors need power-of-two sizes. Prefer a divisor of ``dim`` (no padding, no copy) when it is
  at least pref/4; otherwise the largest block that wastes at most 1/8 in padding.
  """
  pref = max(1, pref)
  d = 1
  while d * 2 <= pref and dim % (d * 2) == 0:
    d *= 2
  if d >= max(1, pref // 4) or d >= dim:
    return d, dim
  best = 1
  b = 1
  while b <= pref:
    padded = -(-dim // b) * b
    if (padded - dim) * 8 <= dim:
      best = b
    b *= 2
  return best, -(-dim // best) * best


MIN_DOT = 16   # tl.dot needs every dimension >= 16


def fit_dot(dim: int, pref: int) -> tuple[int, int]:
  """``fit`` for a GEMM axis: a block of at least MIN_DOT (padding up when the dimension is small)."""
  b, padded = fit(dim, pref)
  if b < MIN_DOT:
    b = MIN_DOT
    padded = -(-dim // b) * b
  return b, padded


def block_columns(ref, cols: int | None):
  """The columns of this program's block that lie inside an array of ``cols`` columns, the grid's second
  axis running over column blocks (traced: the last block's are fewer); the block's width for None (every
  block whole)."""
  width = ref.shape[-1]
  if cols is None:
    return width
  return cols - plc.program_id(1) * width


def pad_axis(x, axis: int, new_len: int):
  """Zero-pad ``x`` along ``axis`` to ``new_len`` (no-op when already that long)."""
  if x.shape[axis] == new_len:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, new_len - x.shape[axis])
  return jnp.pad(x, widths)


def pack_pairs(codes):
  """uint8 bytes of codes (..., P, 2): element 0 in the low nibble, element 1 in the high."""
  c = codes.astype(jnp.int32)
  shift = lax.broadcasted_iota(jnp.int32, (1,) * (c.ndim - 1) + (2,), c.ndim - 1) * 4
  return jnp.sum(c << shift, axis=-1).astype(jnp.uint8)
