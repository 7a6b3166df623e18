"""Quantizers: how one operand of one GEMM is quantized, as a small frozen (hashable) dataclass, and
``Roles``: the six quantizers of a linear layer's three GEMMs, which ``fp4jax.dot`` runs.

A ``Quantizer`` takes a 2-D tensor (R, C) and returns the ``QTensor`` quantized along C, the contraction
axis of its GEMM: the format (a row of ``fp4jax.formats``), 1D blocks or 2D tiles, nearest or
stochastic rounding (random bits from a key), Four Over Six (the nvfp4 row with bound 256), a fixed
Hadamard transform along C (the paper's wgrad), MXFP4's scale rule or MS-EDEN's correction group, and the
layout of the stochastic-rounding bits (``sr_bits``: ``random_bits.SR_BITS``).
``quantize_t`` quantizes the transpose, (T, C) -> (C, T) along T: the wgrad operands, read along the
tokens (one fused primitive for the paper's RHT-16 wgrad).

The six roles of y = x·w (x_MxK, w_KxN), each GEMM contracting its operands' last axis:

  role       operand          quantized along   the paper's nvfp4        Quartet II          TetraJet-v2
  fprop_x    x (M, K)         K                 1x16 nearest             4/6 1x16            DBQ nearest
  fprop_w    wᵀ (N, K)        K                 16x16 tiles nearest      4/6 1x16            DBQ nearest
  dgrad_dy   dy (M, N)        N                 1x16 SR                  RHT-128, MS-EDEN    RHT-16, DBQ SR
  dgrad_w    w (K, N)         N                 the fprop tiles, ᵀ       ŵ: RHT-128, EDEN    ŵ: RHT-16, DBQ SR
  wgrad_x    xᵀ (K, M)        M                 RHT-16, 1x16 nearest     x̂: RHT-128, EDEN    x̂: RHT-16, DBQ SR
  wgrad_dy   dyᵀ (N, M)       M                 RHT-16, 1x16 SR          RHT-128, MS-EDEN    RHT-16, DBQ SR

x̂ and ŵ are the forward-quantized operands, dequantized and quantized again in the backward pass
(``Roles.requantize``); the random sign vectors of their transforms are drawn from the dot's key, one
per backward GEMM and shared by its two operands (``Roles.dgrad_rht``, ``Roles.wgrad_rht``). A role of
None runs its GEMM unquantized (a recipe's "bf16").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _exact, eager, formats, random_bits
from fp4jax.numerics import dbq, e2m1, eden, four_over_six as fos, hadamard, mxfp8
from fp4jax.api import quantize, quantize_rht_transposed
from fp4jax.kernels import quantize_rht_t as rht_t
from fp4jax.primitives import sharding as shd
from fp4jax.qtensor import QTensor

TRANSPOSED = "fprop tiles, transposed"   # Roles.dgrad_w: dgrad reads the fprop weight tiles (spec §2)


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """One operand's quantization along its last axis (see the module docstring)."""

  fmt: str                              # a row of formats.TABLE
  tiled: bool = False                   # the format's 2D tiles over (R, C) instead of 1x blocks along C
  stochastic: bool = False              # stochastic rounding (random bits from the key)
  four_over_six: tuple[int, str] | None = None   # (bound, metric): NVFP4 with 4/6 block scales
  rht_size: int | None = None           # a fixed Hadamard transform along the quantized axis
  rht_seed: int | None = None           # its signs: None, the spec's fixed vector (size 16)
  scale_rule: str = "rceil"             # MXFP4's and MXFP8's E8M0 rule
  eden_group: int = 128                 # MS-EDEN's correction group
  row_scaled: bool = False              # nvfp4: one tensor amax per row (R,) instead of one per tensor
  sr_bits: str = random_bits.DEFAULT    # stochastic rounding's bits: "philox" (the default), "packed" or "jax"

  def __post_init__(self):
    if self.fmt not in formats.ALL:
      raise ValueError(f"Quantizer.fmt={self.fmt!r}; use one of {formats.ALL}")
    if self.tiled and self.fmt not in formats.TILE:
      raise ValueError(f"Quantizer(fmt={self.fmt!r}, tiled=True): the format has no 2D tiles")
    if self.four_over_six is not None and (self.fmt != "nvfp4" or self.stochastic):
      raise ValueError("Four Over Six chooses between two NVFP4 block scales with nearest rounding; "
                       f"got fmt={self.fmt!r}, stochastic={self.stochastic}")
    if self.row_scaled and (self.fmt != "nvfp4" or self.tiled or self.four_over_six is not None):
      raise ValueError("row_scaled=True is NVFP4 1x16 blocks with one amax per row (no tiles, no 4/6)")
    if self.stochastic and self.fmt in ("fp8", "mxfp8", "nvfp4_eden"):
      raise ValueError(f"fmt={self.fmt!r} rounds to nearest (MS-EDEN puts its randomness in the scales)")
    random_bits.check_layout(self.sr_bits)
    if self.sr_bits != random_bits.DEFAULT and not self.stochastic:
      raise ValueError(f"Quantizer(fmt={self.fmt!r}, sr_bits={self.sr_bits!r}): sr_bits chooses the bits of "
                       f"stochastic rounding; set stochastic=True or leave sr_bits={random_bits.DEFAULT!r}")

  @property
  def needs_key(self) -> bool:
    return self.stochastic or self.fmt == "nvfp4_eden"

  @property
  def block(self) -> int:
    """The multiple the quantized axis needs (both axes with tiles)."""
    spec = formats.TABLE[self.fmt]
    return math.lcm(spec.tile[0] if self.tiled else spec.block, spec.outer or 1)

  @eager.compiled_when_eager(static_argnums=0)
  def __call__(self, t_RxC, key=None, signs=None, amax=None) -> QTensor:
    """t (R, C) quantized along C; ``signs``: a random Hadamard transform along C first. ``amax``: the
    tensor amax of the transformed t to use instead of its own (nvfp4, nvfp4_eden; fp4jax.grouped passes
    an expert's amax to each piece of it). ``key`` may be a ``random_bits.Window``."""
    if signs is None and not self.rht_size:   # no transform: t goes to the quantize as it is, read as stored
      return self._quantize(t_RxC, key, amax, stored=True)
    return self._quantize(self.prepare(t_RxC, signs), key, amax)

  def prepare(self, t_RxC, signs=None):
    """What ``__call__`` quantizes: t after the random (``signs``) or fixed Hadamard transform along C. t is
    read as its dtype stores it (``_exact.stored``), however XLA fuses its producer."""
    return self._transform(_exact.stored(t_RxC), signs)

  def _transform(self, t_RxC, signs):
    """``prepare`` of a t already read as stored."""
    if signs is not None:
      return eden.rht(t_RxC, signs)
    if self.rht_size:
      return hadamard.rht(t_RxC.astype(jnp.float32), axis=-1, size=self.rht_size, seed=self.rht_seed)
    return t_RxC

  @property
  def tiles_transpose(self) -> bool:
    """Whether quantizing t in tiles and transposing the codes and scales (``fp4jax.transpose_tiles``) is
    quantizing tᵀ, bit for bit: square tiles (nvfp4 16x16, fp8 128x128), nearest rounding, no transform. A
    tile's amax is a max (any order) and each element's code depends on its value and the tile's scale only.
    Not with 4/6, whose choice between two scales sums the tile's errors (in the tile's order), nor with
    stochastic rounding (bits drawn in the operand's layout)."""
    return (self.tiled and self.fmt in ("nvfp4", "fp8") and self.four_over_six is None and not self.stochastic
            and not self.rht_size and not self.row_scaled)

  @property
  def has_tensor_amax(self) -> bool:
    """Whether the quantization reads one amax of the whole tensor (nvfp4, with or without 4/6; MS-EDEN)."""
    return self.fmt in ("nvfp4", "nvfp4_eden") and not self.row_scaled

  def fused_t(self, signs) -> bool:
    """Whether ``quantize_t`` is the fused RHT-and-transpose primitive (the paper's wgrad)."""
    return signs is None and bool(self.rht_size) and self.four_over_six is None and self.fmt in formats.FP4

  @eager.compiled_when_eager(static_argnums=0)
  def quantize_t(self, t_TxC, key=None, signs=None, amax=None) -> QTensor:
    """tᵀ (C, T) quantized along T (the wgrad operands, read along the tokens). ``amax``: the tensor amax
    of the transformed tᵀ to use instead of its own (``shared_amaxes``)."""
    if self.fused_t(signs):
      rounding = "stochastic" if self.stochastic else "nearest"
      kw = {"scale_rule": self.scale_rule} if self.fmt == "mxfp4" else {}
      if amax is not None:
        kw["amax"] = amax
      return quantize_rht_transposed(t_TxC, self.fmt, rht_size=self.rht_size, rht_seed=self.rht_seed,
                                     rounding=rounding, key=key if self.stochastic else None, stored=True,
                                     sr_bits=self.sr_bits, **kw)
    return self._quantize(self.prepare_t(t_TxC, signs), key, amax)

  def prepare_t(self, t_TxC, signs=None):
    """What ``quantize_t`` quantizes: tᵀ (C, T) after the transform along T, in its order (the fused
    primitive's: ``hadamard.rht`` of tᵀ, ``reference.quantize_rht_t_reference``); t read as stored."""
    t_TxC = _exact.stored(t_TxC)
    if self.fused_t(signs):
      return hadamard.rht(t_TxC.T, axis=-1, size=self.rht_size, seed=self.rht_seed)
    if self.four_over_six is not None or self.fmt not in formats.NAMES:
      t_TxC = t_TxC.astype(jnp.float32)
    return self._transform(t_TxC.T, signs)

  def quantize_prepared(self, t_RxC, key=None, amax=None) -> QTensor:
    """A prepared t (``prepare``, ``prepare_t``) quantized along its last axis: ``__call__`` without the
    transform (fp4jax.grouped quantizes each expert's pieces of a tensor, with the expert's ``amax``)."""
    return self._quantize(t_RxC, key, amax)

  def _quantize(self, t, key, amax=None, stored=False):
    """t quantized along its last axis; ``stored``: t is read as its dtype stores it (``_exact.stored``) here,
    where the plain formats' ``api.quantize`` does it itself (only its XLA side: a kernel's operand is read from
    memory, so no rounded copy of t is written for it, docs/DESIGN.md)."""
    fmt = self.fmt
    if amax is not None and not self.has_tensor_amax:
      raise ValueError(f"Quantizer(fmt={fmt!r}, row_scaled={self.row_scaled}) has no tensor amax to replace")
    if self.row_scaled:   # each row its own tensor: the second level is amax_row (R,)
      plain = dataclasses.replace(self, row_scaled=False)
      if not self.stochastic:
        return jax.vmap(lambda row: plain._quantize(row, None, stored=stored))(t)
      return jax.vmap(lambda row, k: plain._quantize(row, k, stored=stored))(   # one key per row
          t, jax.random.split(key, t.shape[0]))
    if fmt in formats.NAMES and self.four_over_six is None:
      rounding = "stochastic" if self.stochastic else "nearest"
      kw = {"scale_rule": self.scale_rule} if fmt == "mxfp4" else {}
      if amax is not None:
        kw["amax"] = amax
      return quantize(t, fmt, axis=-1, tile=formats.TILE[fmt] if self.tiled else None, rounding=rounding,
                      key=key if self.stochastic else None, stored=stored, sr_bits=self.sr_bits, **kw)
    t = _exact.stored(t) if stored else t
    t32 = t.astype(jnp.float32)
    block = None if self.tiled else formats.BLOCK[fmt]
    tile = formats.TILE[fmt] if self.tiled else None
    if fmt == "nvfp4":                   # Four Over Six
      bound, metric = self.four_over_six
      codes, scale, amax = fos.quantize(t32, tiled=self.tiled, bound=bound, metric=metric, amax=amax)
      return QTensor(e2m1.pack(codes), scale, amax, fmt, -1, block, tile, t.dtype, bound=bound)
    if fmt == "nvfp4_eden":
      e = eden.quantize(t32, eden.scale_bits(key, t.shape), group=self.eden_group, amax=amax)
      return QTensor(e2m1.pack(e.codes), e.scale, None, fmt, -1, block, None, t.dtype, scale2=e.s_dec)
    if fmt == "nvfp4_dbq":
      bits = random_bits.rounding_bits(key, t.shape, -1, self.sr_bits) if self.stochastic else None
      q = dbq.quantize(t32, bits=bits)
      return QTensor(e2m1.pack(q.codes), q.scale, None, fmt, -1, block, None, t.dtype, scale2=q.outer)
    if fmt == "mxfp8":
      q = mxfp8.quantize(t32, self.scale_rule)
      scale = lax.bitcast_convert_type(q.scale, jnp.float8_e8m0fnu)
      return QTensor(q.data, scale, None, fmt, -1, block, None, t.dtype)
    raise ValueError(f"no quantizer for fmt={fmt!r}")


def _plain_nvfp4(q) -> bool:
  """An NVFP4 quantizer whose tensor amax is max |t| of what it quantizes (no 4/6, not row-scaled)."""
  return isinstance(q, Quantizer) and q.fmt == "nvfp4" and q.four_over_six is None and not q.row_scaled


def shared_amaxes(q_rows, q_tokens, t_TxC):
  """(amax of ``q_rows(t)``, amax of ``q_tokens.quantize_t(t)``) from one read of t (T, C), or (None, None)
  where the two cannot share it: the tensor amaxes of one operand's 1x16 quantize along C and its RHT
  quantize along the tokens (fprop x and wgrad x; dgrad dy and wgrad dy), each bit for bit what the
  quantizer would take itself (``kernels.quantize_rht_t.rht_amaxes``), so that the wgrad pass reads its
  operand once. Shared when q_rows is plain NVFP4 with no transform of its own, q_tokens the fused
  NVFP4 RHT quantize (``fused_t``; no random signs), and T a multiple of the RHT size <= 32."""
  if not (_plain_nvfp4(q_rows) and not q_rows.rht_size and _plain_nvfp4(q_tokens) and q_tokens.fused_t(None)
          and t_TxC.ndim == 2 and rht_t.shares_amaxes(t_TxC.shape, q_tokens.rht_size)):
    return None, None
  return rht_t.rht_amaxes(_exact.stored(t_TxC), rht_size=q_tokens.rht_size, rht_seed=q_tokens.rht_seed,
                          gather=shd.replicated)


@dataclasses.dataclass(frozen=True)
class Roles:
  """The six quantizers of y = x·w and where the backward operands come from (module docstring).

  A GEMM whose two roles are None runs unquantized (``lax.dot_general`` with the dot's precision).
  dgrad_w: a Quantizer of w (K, N) along N, or ``TRANSPOSED`` (the fprop tiles read transposed, no new
    quantization). requantize: the backward pass re-quantizes the forward-quantized x̂ and ŵ (Quartet II,
    TetraJet-v2) instead of quantizing x and w in the forward pass. dgrad_rht / wgrad_rht: the size of a
    random Hadamard transform of both operands of that GEMM, its signs drawn from the key.
  """

  fprop_x: Quantizer | None
  fprop_w: Quantizer | None
  dgrad_dy: Quantizer | None
  dgrad_w: Quantizer | str | None
  wgrad_x: Quantizer | None
  wgrad_dy: Quantizer | None
  requantize: bool = False
  dgrad_rht: int | None = None
  wgrad_rht: int | None = None
  key_reason: str | None = None          # what the key is for, in the missing-key error (None: SR)
  align: tuple[int, int, int] | None = None   # (M, K, N) multiples to pad to; None: from the roles
  release_dx_with_dw: bool = True        # as Recipe.release_dx_with_dw
  name: str = "custom"
  out_dtype: Any = None                  # as Recipe.out_dtype

  def __post_init__(self):
    for gemm, pair in (("fprop", (self.fprop_x, self.fprop_w)), ("dgrad", (self.dgrad_dy, self.dgrad_w)),
                       ("wgrad", (self.wgrad_x, self.wgrad_dy))):
      if (pair[0] is None) != (pair[1] is None):
        raise ValueError(f"Roles {self.name!r}: the {gemm} GEMM has one quantized operand; quantize both "
                         "or neither")
    if self.dgrad_w == TRANSPOSED and (self.fprop_w is None or not self.fprop_w.tiled):
      raise ValueError(f"Roles {self.name!r}: dgrad_w=TRANSPOSED reads the fprop weight tiles; fprop_w "
                       "must be a tiled quantizer")
    if self.requantize and self.dgrad_w == TRANSPOSED:
      raise ValueError(f"Roles {self.name!r}: requantize=True re-quantizes ŵ; dgrad_w cannot be TRANSPOSED")

  @property
  def roles(self) -> "Roles":
    """Itself: ``fp4jax.dot`` takes a Roles wherever it takes a Recipe."""
    return self

  @property
  def quantizers(self):
    return tuple(q for q in (self.fprop_x, self.fprop_w, self.dgrad_dy, self.dgrad_w, self.wgrad_x,
                             self.wgrad_dy) if isinstance(q, Quantizer))

  @property
  def quantizes_anything(self) -> bool:
    return bool(self.quantizers)

  @property
  def needs_key(self) -> bool:
    """Whether the backward pass draws random bits (stochastic rounding, MS-EDEN scales, random signs)."""
    backward = (self.dgrad_dy, self.dgrad_w, self.wgrad_x, self.wgrad_dy)
    return (self.dgrad_rht is not None or self.wgrad_rht is not None
            or any(isinstance(q, Quantizer) and q.needs_key for q in backward))

  def alignment(self):
    """Multiples (M, K, N) the operands of all three GEMMs need (``fp4jax.dot`` zero-pads to them)."""
    if self.align is not None:
      return self.align
    m = k = n = 1
    def q_block(q):
      return q.block if isinstance(q, Quantizer) else 1
    if self.fprop_x is not None:
      k = math.lcm(k, q_block(self.fprop_x), q_block(self.fprop_w))
      if self.fprop_w.tiled:
        n = math.lcm(n, self.fprop_w.block)
    if self.dgrad_dy is not None:
      n = math.lcm(n, q_block(self.dgrad_dy), q_block(self.dgrad_w), self.dgrad_rht or 1)
      if isinstance(self.dgrad_w, Quantizer) and self.dgrad_w.tiled:
        k = math.lcm(k, self.dgrad_w.block)
    if self.wgrad_x is not None:
      m = math.lcm(m, q_block(self.wgrad_x), q_block(self.wgrad_dy), self.wgrad_rht or 1,
                   self.wgrad_x.rht_size or 1, self.wgrad_dy.rht_size or 1)
    if self.requantize:   # the backward pass re-quantizes x̂ (M, K) and ŵ (N, K) along M and N
      k = math.lcm(k, q_block(self.wgrad_x) if self.wgrad_x else 1, q_block(self.dgrad_w))
    return m, k, n
