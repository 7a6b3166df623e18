"""The weight-gradient operand path in one Pallas kernel: read x (T, C), apply the random Hadamard
transform along T, quantize along T, write the codes of RHT(x)ᵀ (C, T/2) packed along T.

Axis legend: T tokens (the reduction axis of the wgrad GEMM), C channels, n the RHT size, B the
quantization block (16 nvfp4, 32 mxfp4), L = max(n, B) rows handled as one unit.

The kernel reads x viewed as (T/L, L, C) and loads the L token rows of a tile one by one (each a
contiguous (chunks, C-tile) slab, transposed as it is loaded to a (C-tile, chunks) tile), so the
Walsh-Hadamard butterfly runs on a list of row tiles in exactly the order of
``fp4jax.hadamard.fwht_last`` (sign flip, log2 n stages of a+b / a-b, then one multiply by
f32(1/sqrt n)) and block amaxes are elementwise maxima across rows. Codes are packed eight to a 32-bit
word (element 0 in the low nibble, little-endian bytes = the packed layout); words, scale bytes and
random bits are already in the output's (C, T) orientation, so they are stored and loaded as they are
(or, as ``random_bits.KeyedBits``, hashed in the kernel from a key per channel and a counter per token; in the
packed layout one hash per 8 token rows, its 8 bytes taken row by row).
The tensor amax (taken after the transform) is a separate reduction before this pass.

Transpose only at the loads. The first version transposed each output word and scale tile in
registers, below the butterfly, the block amax and the encode; its GPU compile never finished (killed
after minutes at 8.6 GB, at every size): a stack of the stalled compiler sits in the greedy rewrite of
XLA's TritonXLAFoldTransposePass, materializing constants, which fits a pass that moves a transpose up
through the ops that produce it, one copy per use of a DAG whose paths multiply. Transposed right at the
16 (or 32) loads, with no transpose below, the kernel compiles in 4-25 s for sm_90 and sm_100.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import _pallas_compat as plc
from fp4jax import formats, random_bits, reference
from fp4jax.numerics import amax as amaxes
from fp4jax.numerics import e2m1, hadamard, nvfp4
from fp4jax.kernels import _common as C


@dataclasses.dataclass(frozen=True)
class QuantizeRhtTTiles:
  chunks: int = 4          # L-row chunks of T per program (power of two, fitted to T/L)
  cols: int = 64           # channels per program (power of two, fitted to C)
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_TILES = QuantizeRhtTTiles()


def _butterfly(rows, signs, scale):
  """RHT of a list of n row tiles: the float32 op order of ``hadamard.rht`` / ``fwht_last`` (scale
  None: without the final multiply by f32(1/sqrt n))."""
  n = len(rows)
  rows = [r * jnp.float32(s) for r, s in zip(rows, signs)]
  h = 1
  while h < n:
    out = list(rows)
    for g in range(0, n, 2 * h):
      for i in range(g, g + h):
        a, b = rows[i], rows[i + h]
        out[i], out[i + h] = a + b, a - b
    rows = out
    h *= 2
  return rows if scale is None else [r * jnp.float32(scale) for r in rows]


def _row_bits(sr, bits_refs, interpret, rows=None, stride=None):
  """Row i's rounding bits (C-tile, chunks) as a function of i: loaded from the (C-tile, chunks, L) bits
  tile, or hashed from the key rows (C-tile, 4) and the counter columns (chunks, L, 2) ("key"; a grouped
  layout of n: (chunks, L/n, 2), byte i % n of group i // n's hash). ``stride``: the key rows counted from
  the first (1, 4) at the C-tile's indices ``rows`` (``_common.key_rows``)."""
  if sr is None:
    return lambda i: None
  if sr == "bits":
    return lambda i: bits_refs[0][:, :, i]
  rows_ref, cols_ref = bits_refs
  k1, k2, hi, lo = C.key_rows(rows_ref, rows, stride)
  if sr == "key":
    return lambda i: C.keyed_bits(k1, k2, hi, lo, cols_ref[:, i, 0][None, :], cols_ref[:, i, 1][None, :])
  # grouped: cols (chunks, L/n, 2), one hash per n rows, hashed at the first of them (rows run in order)
  words = {}

  def hashed(i):
    g, e = divmod(i, random_bits.group(sr))
    if g not in words:
      words[g] = C.group_hash(sr, k1, k2, hi, lo, cols_ref[:, g, 0][None, :], cols_ref[:, g, 1][None, :],
                              interpret=interpret)
    return random_bits.group_byte(words[g], e)
  return hashed


def _quantize_rht_t_kernel(x_ref, a_ref, *refs, fmt, scale_rule, signs, rows_per_unit, sr, stride, interpret):
  *bits_refs, w_ref, s_ref = refs
  bc = x_ref.shape[2]
  rows = None if stride is None else C.block_rows(plc.program_id(1) * bc, bc)
  row_bits = _row_bits(sr, bits_refs, interpret, rows, stride)
  n, b, L = len(signs), formats.BLOCK[fmt], rows_per_unit
  scale = float(np.float32(1.0 / np.sqrt(n)))
  # 1. RHT of every n-row chunk, rows as (C-tile, chunks) float32 tiles (transposed at the load).
  rows = [x_ref[:, i, :].T.astype(jnp.float32) for i in range(L)]
  y = []
  for c0 in range(0, L, n):
    y += _butterfly(rows[c0:c0 + n], signs, scale)
  if fmt == "nvfp4":   # the tensor's factors from its amax (1, 1): no pass of their own before this one
    s_enc6, s_dec, p = C.nvfp4_tensor_params(a_ref[...], interpret=interpret)
    y = [r * p for r in y]                # p: 2^64 for a tensor amax below 2^-64, else 1 (exact)
  # 2. Quantize each block of B rows; 3. pack 8 codes per int32 word, store.
  for j in range(L // b):
    blk = y[j * b:(j + 1) * b]
    amax = amaxes.abs_max_of(*blk)
    if fmt == "nvfp4":
      byte, enc = C.nvfp4_block_encode(amax, s_enc6, s_dec, interpret=interpret)
      scaled = lambda v, enc=enc: C.clip(v * enc, -6.0, 6.0)
    else:
      byte, inv, exp = C.e8m0_block_encode(amax, scale_rule)
      scaled = lambda v, inv=inv, exp=exp: C.mxfp4_scaled(v, inv, exp)
    s_ref[:, :, j] = byte.astype(jnp.uint8)
    for w in range(b // 8):
      word = None
      for e in range(8):
        i = j * b + w * 8 + e
        code = C.encode(scaled(y[i]), row_bits(i)).astype(jnp.int32)
        word = code if word is None else word | (code << (4 * e))
      w_ref[:, :, (j * b + w * 8) // 8] = word


def _quantize_rht_t_call(x_TxC, amax_1x1, bits_CxT, *, fmt, scale_rule, signs, tiles, interpret):
  """Packed codes (C, T/2) uint8 and scale bytes (C, T/B) uint8 of RHT(x)ᵀ quantized along T.
  ``bits_CxT``: None, uint8 (C, T), or ``random_bits.KeyedBits`` with rows (C, 4) and cols (T, 2) (its first
  row only where the rows count by a ``row_stride``)."""
  t, c = x_TxC.shape
  b = formats.BLOCK[fmt]
  L = max(b, len(signs))
  u = t // L
  bu, up = C.fit(u, tiles.chunks)
  bc, cp = C.fit(c, tiles.cols)
  x_v = C.pad_axis(C.pad_axis(x_TxC.reshape(u, L, c), 0, up), 2, cp)
  ops = [x_v, amax_1x1]
  in_specs = [plc.BlockSpec((bu, L, bc), lambda i, j: (i, 0, j)), C.amax_spec(amax_1x1, 1, None)]
  sr = C.sr_mode(bits_CxT)
  stride = C.counted_stride(bits_CxT, True)   # vmapped slices: a kernel of their own each (jax.vmap's grid axis)
  if sr == "bits":
    ops.append(C.pad_axis(C.pad_axis(bits_CxT.reshape(c, u, L), 0, cp), 1, up))
    in_specs.append(plc.BlockSpec((bc, bu, L), lambda i, j: (j, i, 0)))
  elif sr == "key" or C.grouped(sr):   # grouped: one column counter per group of tokens
    g = random_bits.group(bits_CxT.layout)
    cols = C.packed_cols(bits_CxT)
    if stride is None:
      ops.append(C.pad_axis(bits_CxT.rows, 0, cp))
      in_specs.append(plc.BlockSpec((bc, 4), lambda i, j: (j, 0)))
    else:   # the first row: the kernel counts the others
      ops.append(bits_CxT.rows[:1])
      in_specs.append(plc.BlockSpec((1, 4), lambda i, j: (0, 0)))
    ops.append(C.pad_axis(cols.reshape(u, L // g, 2), 0, up))
    in_specs.append(plc.BlockSpec((bu, L // g, 2), lambda i, j: (i, 0, 0)))
  kernel = functools.partial(_quantize_rht_t_kernel, fmt=fmt, scale_rule=scale_rule,
                             signs=tuple(signs), rows_per_unit=L, sr=sr, stride=stride, interpret=interpret)
  words, s = plc.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((cp, up, L // 8), jnp.int32),
                 jax.ShapeDtypeStruct((cp, up, L // b), jnp.uint8)),
      grid=(up // bu, cp // bc), in_specs=in_specs,
      out_specs=(plc.BlockSpec((bc, bu, L // 8), lambda i, j: (j, i, 0)),
                 plc.BlockSpec((bc, bu, L // b), lambda i, j: (j, i, 0))),
      interpret=interpret, name=f"fp4jax_quantize_rht_t_{fmt}" + C.int_ops_suffix(sr, cp * up * L),
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)(*ops)
  q = lax.bitcast_convert_type(words[:c, :u], jnp.uint8).reshape(c, t // 2)
  return q, s[:c, :u].reshape(c, t // b)


_ONE_PASS_MAX = 32   # RHT sizes run as one unrolled pass of row slices (16: nvfp4's; 32: mxfp4's)


def _rht_rows(x_TxC, rht_size, rht_seed, rows_per_unit):
  """RHT along T of x (T, C) as ``rows_per_unit`` float32 row slices (T/L, C) of x viewed as
  (T/L, L, C): row i of unit u is token u·L + i. The butterfly is ``_butterfly`` (the op order of
  ``hadamard.rht``), so every value is bit for bit the element of ``hadamard.rht(x, axis=0)`` at the
  same place. The last multiply by f32(1/sqrt n) is plain here: ``hadamard.rht`` rounds it through
  ``fp4jax._exact.product`` so that a caller's sum cannot absorb it into an FMA, and no sum follows it
  here (only |y|, maxima and further multiplies by run-time values)."""
  t, c = x_TxC.shape
  n, L = rht_size, rows_per_unit
  x_UxLxC = jnp.asarray(x_TxC).astype(jnp.float32).reshape(t // L, L, c)
  signs = hadamard.signs(n, rht_seed)
  scale = float(np.float32(1.0 / np.sqrt(n)))
  y = []
  for c0 in range(0, L, n):
    y += _butterfly([x_UxLxC[:, c0 + i, :] for i in range(n)], signs, scale)
  return y


def rht_amax(x_TxC, *, rht_size=16, rht_seed=None, one_pass=False):
  """max |RHT(x) along T| (float32): the NVFP4 tensor amax the transposed quantize needs first.

  ``one_pass=False``: ``max |hadamard.rht(x, axis=0)|``, which the GPU compiler runs as a transpose and
  one materialized float32 tensor per butterfly stage (5.7 GiB moved at 8192², docs/PERF.md).

  ``one_pass=True`` (what ``fp4jax.api`` uses, for both impls): the n token rows of each chunk are
  strided slices of x viewed as (T/n, n, C), the butterfly runs on them as a list (``_rht_rows``), the
  n magnitudes are combined by an elementwise maximum and one max reduces the (T/n, C) result. The
  same values, and max is exact, so the same amax bit for bit, NaN included (a NaN input, or inf - inf
  in the butterfly): both forms take the maximum on the magnitudes' bits (``fp4jax.numerics.amax``),
  which keeps NaN (tests/test_gpu_aot_cuts.py). On the GPU it is one reduction fusion that reads x once (the
  kernel path's wgrad RHT: 1.19 -> 0.19 ms at 8192², docs/PERF.md). Sizes above 32 keep
  ``hadamard.rht`` (n slices unrolled compile slowly).
  """
  t, _ = x_TxC.shape
  n = rht_size
  if not one_pass or n > _ONE_PASS_MAX or t % n:
    return amaxes.abs_max(hadamard.rht(x_TxC, axis=0, size=n, seed=rht_seed))
  y = _rht_rows(x_TxC, n, rht_seed, n)
  return amaxes.abs_max(amaxes.abs_max_of(*y))


def shares_amaxes(shape, rht_size) -> bool:
  """Whether ``rht_amaxes`` takes x of this (T, C) shape: not empty, T a multiple of the RHT size, and a
  size that ``rht_amax`` runs as one pass."""
  t, c = shape
  return t * c > 0 and rht_size <= _ONE_PASS_MAX and t % rht_size == 0


_ROW_MAX = 16384   # XLA's GPU reduction emitter reduces rows of up to this many elements in one launch, longer in two


def _row_pieces(u: int, c: int) -> int:
  """k, the pieces (at most 8, each of at most ``_ROW_MAX`` channels) each of u chunks' C channels is reduced
  in: the most whose u·k partials one launch finishes, else the fewest (1 where C has no such divisor). More
  partials than chunks keep the first reduction fused with the maxima it reduces where a device holds few
  tokens: for 4,096 tokens of width 5,120 XLA's GPU compiler wrote the (u, C) maxima out in a pass of their
  own with one piece, not with eight."""
  pieces = [k for k in range(1, 9) if c % k == 0 and c // k <= _ROW_MAX]
  if not pieces:
    return 1
  within = [k for k in pieces if u * k <= _ROW_MAX]
  return max(within) if within else min(pieces)


def rht_amaxes(x_TxC, *, rht_size=16, rht_seed=None, gather=None):
  """(max |x|, max |RHT(x) along T|), float32 scalars, from one read of x (T, C): the NVFP4 tensor amaxes
  of x's 1x16 quantize along C (fprop x, dgrad dy) and of its transposed RHT quantize along T (the wgrad),
  so that the wgrad pass needs no read of its own for its amax (docs/DESIGN.md, "The wgrad's RHT quantize reads its operand once").

  Two variadic reductions (each a single reduce op: XLA cannot split one into two passes over x): the first
  reads x as two (T/n, C) operands, the elementwise maximum of |x| over the n token rows of each chunk and
  ``rht_amax``'s maximum of |y| over the n rows of the transform (``_rht_rows``, the same float32 ops), and
  reduces them along C to the chunks' partials (T/n, k), C in k pieces (``_row_pieces``: rows XLA reduces in
  one launch); the second reduces the partials. ``gather`` (None:
  none) is applied to the pair of partials between the two: ``fp4jax.primitives.sharding.replicated`` has a
  token-sharded x's partials gathered, so that one reduction finishes them on every device (a reduction to a
  scalar of the sharded partials would be a local reduction, a gather of each device's scalar and a
  reduction of those: a launch more). Max is exact in any order, so each amax is ``nvfp4.tensor_amax(x)`` and
  ``rht_amax(x, one_pass=True)`` bit for bit, a NaN in x making both NaN (the maxima are taken on the
  magnitudes' bits, ``fp4jax.numerics.amax``). T must be a multiple of n <= 32 (``shares_amaxes``)."""
  if not shares_amaxes(x_TxC.shape, rht_size):
    raise ValueError(f"rht_amaxes takes a non-empty x (T, C) with T a multiple of rht_size <= "
                     f"{_ONE_PASS_MAX}; got shape {x_TxC.shape}, rht_size={rht_size}: use "
                     "nvfp4.tensor_amax and rht_amax")
  t, c = x_TxC.shape
  n = rht_size
  x_UxNxC = jnp.asarray(x_TxC).astype(jnp.float32).reshape(t // n, n, c)
  a_UxC = amaxes.abs_max_of(*[x_UxNxC[:, i, :] for i in range(n)])
  r_UxC = amaxes.abs_max_of(*_rht_rows(x_TxC, n, rht_seed, n))
  zero = jnp.int32(0)
  pair_max = lambda p, q: (lax.max(p[0], q[0]), lax.max(p[1], q[1]))
  k = _row_pieces(t // n, c)
  bits_UxKxW = [amaxes.magnitude_bits(m).reshape(t // n, k, c // k) for m in (a_UxC, r_UxC)]
  partials_UxK = lax.reduce(tuple(bits_UxKxW), (zero, zero), pair_max, (2,))
  if gather is not None:
    partials_UxK = gather(partials_UxK)
  a, r = lax.reduce(partials_UxK, (zero, zero), pair_max, (0, 1))
  return amaxes.from_bits(a), amaxes.from_bits(r)


def quantize_rht_t_rows(x, amax, bits=None, *, rht_size=16, rht_seed=None):
  """NVFP4 codes (C, T/2) and E4M3 scales (C, T/16) of RHT(x)ᵀ quantized along T, x of shape (T, C):
  ``fp4jax.reference.quantize_rht_t_reference`` bit for bit, written for XLA's GPU fusion.

  The reference transposes x, runs ``hadamard.rht`` stage by stage and reduces each block along the
  minor axis; the GPU compiler materializes a float32 tensor per stage and a transpose (about 3 GiB
  per 128 MiB operand). Here everything runs on the L = max(16, rht_size) token rows of a unit as
  (T/L, C) slices (``_rht_rows``): the block amax is an elementwise maximum of 16 rows, the scales and
  encode factors are ``nvfp4.block_scales`` of it, each row is encoded with the reference's functions
  (``e2m1.encode_rne`` / ``encode_stochastic`` of clip(y·p·enc_b, ±6)), and only the packed bytes and
  the scales are stacked and transposed to the (C, T) orientation. The same operations on the same
  values: the same bits (tests/test_gpu_aot_cuts.py). bits: uint8 (C, T) or None (nearest).
  """
  t, c = x.shape
  b = formats.BLOCK["nvfp4"]
  L = max(b, rht_size)
  if t % L:
    raise ValueError(f"token axis T={t} must be a multiple of {L} (rht_size={rht_size}); pad it")
  u = t // L
  amax_g = jnp.asarray(amax, jnp.float32).reshape(())
  p = nvfp4.encode_shift(amax_g)
  y = _rht_rows(x, rht_size, rht_seed, L)
  bits_rows = None
  if bits is not None:
    bits_CxUxL = bits.reshape(c, u, L)
    bits_rows = [bits_CxUxL[:, :, i].T for i in range(L)]
  bytes_, scales = [], []
  for j in range(L // b):
    blk = range(j * b, (j + 1) * b)
    # max |y·p| = p · max |y| exactly (p is a power of two that cannot overflow here); written this way
    # the maximum is the one rht_amax forms for RHT-16, so XLA computes it once for both.
    amax_b = amaxes.abs_max_of(*[y[i] for i in blk]) * p
    s_b, enc_b = nvfp4.block_scales(amax_b, amax_g * p)
    codes = []
    for i in blk:
      scaled = jnp.clip((y[i] * p) * enc_b, -e2m1.MAX, e2m1.MAX)     # y·p exact, as the reference
      codes.append(e2m1.encode_rne(scaled) if bits_rows is None
                   else e2m1.encode_stochastic(scaled, bits_rows[i]))
    bytes_ += [(codes[k] & 0xF) | ((codes[k + 1] & 0xF) << 4) for k in range(0, b, 2)]
    scales.append(s_b)
  data = jnp.transpose(jnp.stack(bytes_, axis=1), (2, 0, 1)).reshape(c, t // 2)
  scale = jnp.transpose(jnp.stack(scales, axis=1), (2, 0, 1)).reshape(c, t // b)
  return data, scale


def quantize_rht_t(x, amax, bits=None, *, fmt="nvfp4", rht_size=16, rht_seed=None,
                   scale_rule="rceil", tiles=DEFAULT_TILES, interpret=False):
  """Codes (C, T/2) and scale bytes (C, T/B) of RHT(x)ᵀ quantized along T, x of shape (T, C).

  amax: float32 scalar, max |RHT(x)| (``rht_amax``); ignored for MXFP4. bits: uint8 (C, T),
  ``random_bits.KeyedBits`` of (C, T) (rows (C, 4): hashed in the kernel), or None. T must be a multiple
  of rht_size and of the block.
  """
  t, c = x.shape
  L = max(formats.BLOCK[fmt], rht_size)
  if t % L:
    raise ValueError(f"token axis T={t} must be a multiple of {L} (rht_size={rht_size}, block "
                     f"{formats.BLOCK[fmt]}); pad it")
  amax_1x1 = C.amax_operand(jnp.asarray(amax, jnp.float32).reshape(()) if fmt == "nvfp4" else 0.0, (), 1)
  signs = hadamard.signs(rht_size, rht_seed)
  return _quantize_rht_t_call(x, amax_1x1, bits, fmt=fmt, scale_rule=scale_rule, signs=signs,
                              tiles=tiles, interpret=interpret)


def quantize_rht_t_reference(x, amax, bits=None, *, fmt="nvfp4", rht_size=16, rht_seed=None,
                             scale_rule="rceil"):
  """The oracle: ``fp4jax.reference.quantize_rht_t_reference`` as (codes, scale bytes)."""
  q, s = reference.quantize_rht_t_reference(x, amax, random_bits.drawn(bits), fmt=fmt,
                                            rht_size=rht_size, rht_seed=rht_seed, scale_rule=scale_rule)
  return q, lax.bitcast_convert_type(s, jnp.uint8)
