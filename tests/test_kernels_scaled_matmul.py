"""Scaled matmul kernel against dequantize-then-jnp.dot in float32 (relative error <= 1e-6).

The class runs the kernel in the Pallas interpreter (INTERPRET = True); tests/test_kernels_gpu.py
subclasses it with INTERPRET = False.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.kernels import scaled_matmul as KM
from fp4jax.reference import scaled_matmul_reference, tensor_factor

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

  @pytest.mark.parametrize("m,n,k,a_tile,b_tile", [
      (16, 16, 16, None, None), (304, 304, 304, None, TILE), (256, 512, 1024, None, TILE),
      (48, 80, 96, TILE, TILE), (304, 304, 304, TILE, None)])
  def test_nvfp4_vs_dequantized_dot(self, m, n, k, a_tile, b_tile):
    self._check("nvfp4", m, n, k, a_tile, b_tile, jnp.float32)

  @pytest.mark.parametrize("m,n,k", [(16, 16, 32), (304, 304, 320), (256, 512, 1024)])
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
    got = KM.scaled_matmul(a.data, _bytes(a.scale), b.data, _bytes(b.scale), tensor_factor(a, b),
                           fmt=fmt, a_tiled=a_tile is not None, b_tiled=b_tile is not None,
                           out_dtype=out_dtype, interpret=self.INTERPRET)
    assert got.shape == lead + (m, n) and got.dtype == out_dtype
    want = jnp.einsum("...mk,nk->...mn", fp4jax.dequantize(a, impl="xla"),
                      fp4jax.dequantize(b, impl="xla"), precision="highest")
    assert rel_err(got, want) <= REL_TOL[out_dtype]
    ref = scaled_matmul_reference(a, b, out_dtype)
    assert rel_err(got, ref) <= REL_TOL[out_dtype]


class TestScaledMatmulInterpret(_ScaledMatmulCases):
  INTERPRET = True
