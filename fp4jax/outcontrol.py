"""OutControl (TetraJet-v2): the input channels with the largest activation norms run in MXFP8.

For one linear layer y = x·w (x_MxK, w_KxN; K the input channels):
1. Calibrate: during a window of training steps, ``acc[c] += ‖x[:, c]‖₂`` over each step's tokens
   (float32; sum the accumulators over data-parallel replicas before finalizing).
2. Finalize once: ``perm = argsort(acc, descending)``; the first k8 channels are "FP8", the rest "FP4",
   both kept in descending-norm order, fixed for the rest of training. Before finalizing every channel
   is FP4.
3. Forward: y = DBQ(x[:, C4]) · DBQ(w[C4, :]) + MXFP8(x[:, C8]) · MXFP8(w[C8, :]), one float32 sum;
   the FP4 blocks (16, 128) run over the gathered C4 channels in their descending-norm order.
k8 = min(⌊K/128⌋·128, ⌈⌊K·ratio⌋/128⌉·128): a multiple of 128 and at least 128 once K·ratio >= 1.
The plan (``perm``, ``k8``) is plain data: it lives in the train state and the checkpoint.
Axis legend: M tokens, K input channels, N output features.
"""
from __future__ import annotations

import jax.numpy as jnp

from fp4jax import dbq, mxfp8

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
  return acc_K + jnp.sqrt(jnp.sum(x * x, axis=0))


def calibration_finalize(acc_K):
  """perm (K,) int32: channels by descending accumulated norm (ties: lower index first)."""
  return jnp.argsort(-acc_K, stable=True).astype(jnp.int32)


def _pad_last(a, multiple):
  extra = -a.shape[-1] % multiple
  return a if not extra else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


def split_fprop(x_MxK, w_KxN, perm_K, n_fp8: int):
  """y (M, N) float32 of the OutControl forward GEMM; n_fp8 = k8(K, ratio), static.

  The channels are gathered by ``perm``: the first n_fp8 run in MXFP8 (quantized along K in blocks of
  32), the rest in DBQ NVFP4 (blocks of 16 and 128 along K, zero-padded to a multiple of 128).
  """
  x_g = jnp.take(x_MxK.astype(jnp.float32), perm_K, axis=1)
  w_g = jnp.take(w_KxN.astype(jnp.float32), perm_K, axis=0)
  y = jnp.zeros((x_MxK.shape[0], w_KxN.shape[1]), jnp.float32)
  if n_fp8 < x_MxK.shape[1]:
    x4, w4 = _pad_last(x_g[:, n_fp8:], dbq.OUTER), _pad_last(w_g[n_fp8:].T, dbq.OUTER)
    y = dbq.gemm(dbq.quantize(x4), dbq.quantize(w4))
  if n_fp8:
    y = y + mxfp8.gemm(mxfp8.quantize(x_g[:, :n_fp8]), mxfp8.quantize(w_g[:n_fp8].T))
  return y
