"""OutControl (TetraJet-v2): the input channels with the largest activation norms run in MXFP8.

For one linear layer y = x·w (x_MxK, w_KxN; K the input channels):
1. Calibrate: during a window of training steps, ``acc[c] += ‖x[:, c]‖₂`` over each step's tokens
   (float32; sum the accumulators over data-parallel replicas before finalizing).
2. Finalize once: ``perm = argsort(acc, descending)``; the first k8 channels are "FP8", the rest "FP4",
   both kept in descending-norm order, fixed for the rest of training. Before finalizing every channel
   is FP4.
3. Forward: y = DBQ(x[:, C4]) · DBQ(w[C4, :]) + MXFP8(x[:, C8]) · MXFP8(w[C8, :]), one float32 sum;
   the FP4 blocks (16, 128) run over the gathered C4 channels in their descending-norm order.
4. Backward (``dot``): dgrad in FP4 for all channels: ŵ assembled from the dequantized FP8 and FP4
   parts, RHT-16 along N with fresh signs of it and of dy, SR DBQ; wgrad of the C4 rows as TetraJet-v2's
   (RHT-16 along tokens of x̂4 and dy, SR DBQ), of the C8 rows in MXFP8 along tokens without RHT from
   the forward's dequantized FP8 activations x̂8 and dy.
k8 = min(⌊K/128⌋·128, ⌈⌊K·ratio⌋/128⌉·128): a multiple of 128 and at least 128 once K·ratio >= 1.
The plan (``perm``, ``k8``) is plain data: it lives in the train state and the checkpoint.
Axis legend: M tokens, K input channels, N output features.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import gemm
from fp4jax._exact import product
from fp4jax.api import dequantize
from fp4jax.numerics import dbq, eden, mxfp8
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.quantizers import Quantizer

DEFAULT_RATIO = 0.1


def k8(in_features: int, ratio: float = DEFAULT_RATIO) -> int:
  """How many input channels run in MXFP8 (static)."""
  if not 0 <= ratio <= 1:
    raise ValueError(f"OutControl ratio={ratio!r} must be in [0, 1] (the configs use 0.1)")
  aligned = (in_features // 128) * 128
  wanted = -(-int(in_features * ratio) // 128) * 128
  return min(aligned, wanted)


def calibration_init(in_features: int):
  """The accumulator of channel norms: float32 zeros (K,)."""
  return jnp.zeros((in_features,), jnp.float32)


def calibration_accumulate(acc_K, x_MxK):
  """acc + ‖x[:, c]‖₂ per input channel c, over this step's tokens (leading axes flattened)."""
  x = x_MxK.reshape(-1, x_MxK.shape[-1]).astype(jnp.float32)
  return acc_K + jnp.sqrt(jnp.sum(product(x, x), axis=0))   # each square rounded before the sum


def calibration_finalize(acc_K):
  """perm (K,) int32: channels by descending accumulated norm (ties: lower index first)."""
  return jnp.argsort(-acc_K, stable=True).astype(jnp.int32)


def split_fprop(x_MxK, w_KxN, perm_K, n_fp8: int):
  """y (M, N) float32 of the OutControl forward GEMM; n_fp8 = k8(K, ratio), static.

  The channels are gathered by ``perm``: the first n_fp8 run in MXFP8 (quantized along K in blocks of
  32), the rest in DBQ NVFP4 (blocks of 16 and 128 along K, zero-padded to a multiple of 128).
  """
  return _forward(x_MxK, w_KxN, perm_K, n_fp8)[0]


# ---------------------------------------------------------------------------------------------------
# The OutControl linear layer as a custom_vjp (TetraJet-v2 with a fixed channel split). Its operands are
# QTensors from fp4jax.quantizers and its GEMMs fp4jax.gemm's; it stays its own custom_vjp because the
# split is per channel of K with a permutation from the train state, and its wgrad quantizes dy twice
# (MXFP8 along the tokens for the C8 rows, RHT-16 DBQ for the C4 rows): docs/DOT.md.
# ---------------------------------------------------------------------------------------------------

_DBQ, _DBQ_SR, _MXFP8 = (Quantizer("nvfp4_dbq"), Quantizer("nvfp4_dbq", stochastic=True),
                         Quantizer("mxfp8"))


def _forward(x_MxK, w_KxN, perm_K, n_fp8):
  x_g = jnp.take(x_MxK.astype(jnp.float32), perm_K, axis=1)
  w_g = jnp.take(w_KxN.astype(jnp.float32), perm_K, axis=0)
  y = jnp.zeros((x_MxK.shape[0], w_KxN.shape[1]), jnp.float32)
  q4x = q4w = q8x = q8w = None
  if n_fp8 < x_MxK.shape[1]:
    q4x = _DBQ(pad_to_multiple(x_g[:, n_fp8:], 1, dbq.OUTER))
    q4w = _DBQ(pad_to_multiple(w_g[n_fp8:].T, 1, dbq.OUTER))                    # (N, K4)
    y = gemm.matmul(q4x, q4w)
  if n_fp8:
    q8x, q8w = _MXFP8(x_g[:, :n_fp8]), _MXFP8(w_g[:n_fp8].T)                   # (M, k8), (N, k8)
    y = y + gemm.matmul(q8x, q8w)
  return y, (q4x, q4w, q8x, q8w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dot(x_MxK, w_KxN, perm_K, n_fp8, key):
  del key
  return _forward(x_MxK, w_KxN, perm_K, n_fp8)[0]


def _dot_fwd(x_MxK, w_KxN, perm_K, n_fp8, key):
  y, quantized = _forward(x_MxK, w_KxN, perm_K, n_fp8)
  dtypes = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))   # residuals must be arrays
  return y, (quantized, perm_K, key, dtypes)


def _scatter(t_g, perm_K, axis):
  """Inverse of the gather by perm along ``axis``."""
  inv = jnp.argsort(perm_K)
  return jnp.take(t_g, inv, axis=axis)


def _dot_bwd(n_fp8, res, dy_MxN):
  (q4x, q4w, q8x, q8w), perm_K, key, (x_like, w_like) = res
  x_dtype, w_dtype = x_like.dtype, w_like.dtype
  k_in = perm_K.shape[0]
  dy = dy_MxN.astype(jnp.float32)
  key_d, key_w = jax.random.split(key)
  # Dgrad: the whole gathered ŵ (N, K) in FP4 after RHT-16 along N.
  parts = ([dequantize(q8w)] if n_fp8 else []) + ([dequantize(q4w)] if q4w is not None else [])
  wt_hat = jnp.concatenate(parts, axis=1)[:, :k_in]
  k_sign, k_a, k_b = jax.random.split(key_d, 3)
  s = eden.random_signs(k_sign, 16)
  dx_g = gemm.matmul(_DBQ_SR(dy, k_a, s), _DBQ_SR.quantize_t(wt_hat, k_b, s))    # (M, N) · (K, N)ᵀ
  # Wgrad, C8 rows: MXFP8 along tokens, no RHT, from the forward's FP8 activations; C4 rows:
  # TetraJet-v2's operands along tokens.
  k_sign, k_a, k_b = jax.random.split(key_w, 3)
  s = eden.random_signs(k_sign, 16)
  parts = []
  if n_fp8:
    parts.append(gemm.matmul(_MXFP8.quantize_t(dequantize(q8x)), _MXFP8.quantize_t(dy)))
  if q4x is not None:
    parts.append(gemm.matmul(_DBQ_SR.quantize_t(dequantize(q4x), k_a, s),             # (K4, M)
                                    _DBQ_SR.quantize_t(dy, k_b, s)))                         # (N, M)
  dw_g = jnp.concatenate(parts, axis=0)[:k_in]
  dx = _scatter(dx_g, perm_K, 1)
  dw = _scatter(dw_g, perm_K, 0)
  dx, dw = lax.optimization_barrier((dx, dw))   # released together, as fp4jax.dot's (dx, dw)
  perm_ct = jnp.zeros(perm_K.shape, jax.dtypes.float0)
  return dx.astype(x_dtype), dw.astype(w_dtype), perm_ct, None


_dot.defvjp(_dot_fwd, _dot_bwd)


def dot(x_MxK, w_KxN, perm_K, n_fp8: int, *, key):
  """y = x·w as TetraJet-v2's linear layer with OutControl: the first ``n_fp8`` channels of ``perm``
  in MXFP8, the rest in DBQ NVFP4 (see the module docstring for the backward pass). Pads M to 128
  and N to 128; ``key`` gives the backward pass's signs and stochastic rounding."""
  m, n = x_MxK.shape[0], w_KxN.shape[1]
  if n_fp8 % mxfp8.BLOCK or not 0 <= n_fp8 <= x_MxK.shape[1]:
    raise ValueError(f"n_fp8={n_fp8} must be a multiple of 32 between 0 and K={x_MxK.shape[1]}; "
                     "use k8(K, ratio)")
  x_p = pad_to_multiple(x_MxK, 0, dbq.OUTER)
  w_p = pad_to_multiple(w_KxN, 1, dbq.OUTER)
  return _dot(x_p, w_p, perm_K.astype(jnp.int32), n_fp8, key)[:m, :n]
