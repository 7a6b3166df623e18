"""Scaled matmul kernels (dequantize-to-bf16 pass, bf16 GEMM) against the reference.

The dequantize kernel is compared bit for bit (``==``) with the reference's e2m1 · scale in bf16 over
every code and every scale byte. The GEMM sums exact bf16 products in float32 in its own order, so
it equals the reference bit for bit where every partial sum is exact (operands whose scales are 0.5 or
1: all products are multiples of 2^-4 below 2^24 · 2^-4 in sum), and within relative error 1e-6 of
dequantize-then-jnp.dot in float32 on general operands. The classes run the kernels in the Pallas
interpreter (INTERPRET = True); tests/test_kernels_gpu.py subclasses them with INTERPRET = False.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import formats
from fp4jax.kernels import scaled_matmul as KM
from fp4jax.qtensor import QTensor
from fp4jax.reference import (scaled_codes_bf16, scaled_matmul_reference, tensor_factor,
                              tensor_factor_parts)

REL_TOL = {jnp.float32: 1e-6, jnp.bfloat16: 2 ** -8}   # bf16 output: one rounding of the result
TILE = (16, 16)


def _operands(m, n, k, fmt, a_tile, b_tile, seed=0, lead=()):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(lead + (m, k)) * np.exp(rng.uniform(-2, 2, (m, 1))),
                  jnp.float32)
  w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
  a = fp4jax.quantize(x, fmt, tile=a_tile, impl="xla")
  b = fp4jax.quantize(w, fmt, tile=b_tile, impl="xla")
  return a, b


def _bytes(s):
  return jax.lax.bitcast_convert_type(s, jnp.uint8)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


class _ScaledMatmulCases:
  INTERPRET = True

  @pytest.mark.parametrize("m,n,k,a_tile,b_tile", [   # untiled and b-tiled by default: test_equals_reference_bit_for_bit
      pytest.param(16, 16, 16, None, None, marks=pytest.mark.slow),
      pytest.param(304, 304, 304, None, TILE, marks=pytest.mark.slow),
      pytest.param(256, 512, 1024, None, TILE, marks=pytest.mark.slow),
      (48, 80, 96, TILE, TILE), (304, 304, 304, TILE, None)])
  def test_nvfp4_vs_dequantized_dot(self, m, n, k, a_tile, b_tile):
    self._check("nvfp4", m, n, k, a_tile, b_tile, jnp.float32)

  @pytest.mark.parametrize("m,n,k", [pytest.param(16, 16, 32, marks=pytest.mark.slow), (304, 304, 320),
                                     pytest.param(256, 512, 1024, marks=pytest.mark.slow)])
  def test_mxfp4_vs_dequantized_dot(self, m, n, k):
    self._check("mxfp4", m, n, k, None, None, jnp.float32)

  def test_bf16_output_and_leading_axes(self):
    self._check("nvfp4", 32, 48, 64, None, TILE, jnp.bfloat16, lead=(2,))

  @pytest.mark.slow
  @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("m,n,k", [(16, 16, 64), (304, 304, 320), (256, 1024, 256), (1024, 256, 512),
                                     (96, 160, 2048)])
  @pytest.mark.parametrize("fmt,a_tile,b_tile", [("nvfp4", None, None), ("nvfp4", None, TILE),
                                                 ("nvfp4", TILE, TILE), ("mxfp4", None, None)])
  def test_sweep(self, fmt, a_tile, b_tile, m, n, k, out_dtype):
    self._check(fmt, m, n, k, a_tile, b_tile, out_dtype)

  def _check(self, fmt, m, n, k, a_tile, b_tile, out_dtype, lead=()):
    a, b = _operands(m, n, k, fmt, a_tile, b_tile, lead=lead)
    got = KM.pallas_matmul(a.data, _bytes(a.scale), b.data, _bytes(b.scale), tensor_factor(a, b),
                           fmt=fmt, a_tiled=a_tile is not None, b_tiled=b_tile is not None,
                           out_dtype=out_dtype, interpret=self.INTERPRET)
    assert got.shape == lead + (m, n) and got.dtype == out_dtype
    want = jnp.einsum("...mk,nk->...mn", fp4jax.dequantize(a, impl="xla"),
                      fp4jax.dequantize(b, impl="xla"), precision="highest")
    assert rel_err(got, want) <= REL_TOL[out_dtype]
    ref = scaled_matmul_reference(a, b, out_dtype)
    assert rel_err(got, ref) <= REL_TOL[out_dtype]


def exact_operand(shape, fmt, tile, seed):
  """A QTensor with random codes and scales 0.5 or 1 (E4M3 0x30/0x38, E8M0 126/127): every partial
  sum of a GEMM of two of them is exact in float32 for K <= 2^13, whatever the order."""
  rng = np.random.default_rng(seed)
  r, k = shape
  data = jnp.asarray(rng.integers(0, 256, (r, k // 2)), jnp.uint8)
  s_shape = (r // tile[0], k // tile[1]) if tile else (r, k // formats.BLOCK[fmt])
  choices = np.array([0x30, 0x38] if fmt == "nvfp4" else [126, 127], np.uint8)
  scale = jax.lax.bitcast_convert_type(jnp.asarray(rng.choice(choices, s_shape)),
                                       formats.SCALE_DTYPE[fmt])
  amax = jnp.float32(rng.uniform(1, 100)) if fmt == "nvfp4" else None
  return QTensor(data, scale, amax, fmt, -1, None if tile else formats.BLOCK[fmt], tile,
                 jnp.dtype(jnp.float32), "rceil" if fmt == "mxfp4" else None)


class _ScaledMatmulExactCases:
  INTERPRET = True

  @pytest.mark.parametrize("fmt,a_tile,b_tile,m,n,k", [
      ("nvfp4", None, TILE, 48, 80, 1024), ("nvfp4", TILE, None, 304, 16, 64),
      ("nvfp4", None, None, 16, 272, 256),
      # mxfp4 by default: test_mxfp4_vs_dequantized_dot and test_dequantize_kernel_every_code_and_scale[mxfp4-None]
      pytest.param("mxfp4", None, None, 32, 48, 512, marks=pytest.mark.slow)])
  def test_equals_reference_bit_for_bit(self, fmt, a_tile, b_tile, m, n, k):
    a = exact_operand((m, k), fmt, a_tile, 0)
    b = exact_operand((n, k), fmt, b_tile, 1)
    for out_dtype in (jnp.float32, jnp.bfloat16):
      got = KM.pallas_matmul(a.data, _bytes(a.scale), b.data, _bytes(b.scale), tensor_factor(a, b),
                             fmt=fmt, a_tiled=a_tile is not None, b_tiled=b_tile is not None,
                             out_dtype=out_dtype, interpret=self.INTERPRET)
      want = scaled_matmul_reference(a, b, out_dtype)
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                    np.asarray(want.astype(jnp.float32)))

  @pytest.mark.parametrize("fmt,tile", [("nvfp4", None), ("nvfp4", TILE), ("mxfp4", None)])
  def test_dequantize_kernel_every_code_and_scale(self, fmt, tile):
    """All 256 code bytes against all 256 scale bytes (NaN scales included), == the reference."""
    r, k = (256, 512) if tile is None else (256, 4096)
    data = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (r, k // 512))
    n_scales = r * k // (256 if tile else formats.BLOCK[fmt])
    s_bytes = jnp.tile(jnp.arange(256, dtype=jnp.uint8), n_scales // 256)
    s_shape = (r // 16, k // 16) if tile else (r, k // formats.BLOCK[fmt])
    scale = jax.lax.bitcast_convert_type(s_bytes.reshape(s_shape), formats.SCALE_DTYPE[fmt])
    q = QTensor(data, scale, jnp.float32(1.0) if fmt == "nvfp4" else None, fmt, -1,
                None if tile else formats.BLOCK[fmt], tile, jnp.dtype(jnp.float32),
                "rceil" if fmt == "mxfp4" else None)
    got = KM.dequantize_bf16(data, _bytes(scale), fmt=fmt, tiled=tile is not None,
                             interpret=self.INTERPRET)
    want = scaled_codes_bf16(q)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))


def test_extreme_amaxes_follow_the_reference():
  """amax products beyond float32 (the reference's power-of-two rescaling) give the same bits."""
  a = exact_operand((32, 256), "nvfp4", None, 0)
  b = exact_operand((16, 256), "nvfp4", TILE, 1)
  for amax_a, amax_b in ((1e20, 3e19), (1e-30, 2e-25), (5.0, 7.0)):
    qa = dataclasses.replace(a, amax=jnp.float32(amax_a))
    qb = dataclasses.replace(b, amax=jnp.float32(amax_b))
    got = KM.pallas_matmul(qa.data, _bytes(qa.scale), qb.data, _bytes(qb.scale),
                           tensor_factor_parts(qa, qb), fmt="nvfp4", b_tiled=True, interpret=True)
    want = scaled_matmul_reference(qa, qb, jnp.float32)
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class TestScaledMatmulInterpret(_ScaledMatmulCases):
  INTERPRET = True


class TestScaledMatmulExactInterpret(_ScaledMatmulExactCases):
  INTERPRET = True
