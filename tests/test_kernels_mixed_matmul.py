"""The mixed-input GEMM (fp4jax.kernels.mixed_matmul: decoded in the K loop) against the XLA path.

The kernel and ``reference.scaled_matmul_reference`` multiply the same exact bf16 products and sum them
in float32 in different orders. So: bit for bit (``==``) on exactly-summable operands (random codes,
scales 0.5 or 1: every partial sum is a multiple of 2^-4 far below 2^24, exact in any order), including
the extreme tensor amaxes where the factor is split into powers of two; on general operands within
the float32 summation bound of the exact (float64) sum. The classes run the kernel in the Pallas
interpreter (INTERPRET = True).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import api, dispatch, formats, primitives
from tools import prove
from fp4jax.kernels import mixed_matmul as MM
from fp4jax.qtensor import QTensor
from fp4jax.reference import scaled_matmul_reference, tensor_factor_parts

TILE = (16, 16)
U = 2.0 ** -24


def _bytes(s):
  return jax.lax.bitcast_convert_type(s, jnp.uint8)


def exact_operand(shape, fmt, tile, seed, amax=None):
  """``tools.prove.cases.exact_operand`` (random codes, scales 0.5 or 1: every float32 partial sum of a GEMM of
  two of them is exact in any order) of ``shape``; ``tile``: the format's 2D tile, or None for 1D blocks."""
  assert tile in (None, formats.TILE.get(fmt))
  return prove.cases.exact_operand(*shape, fmt, tile is not None, seed, amax=amax)


class _MixedMatmulCases:
  INTERPRET = True

  def _run(self, a, b, out_dtype, tiles=MM.DEFAULT_TILES):
    return MM.mixed_matmul(a.data, _bytes(a.scale), b.data, _bytes(b.scale), tensor_factor_parts(a, b),
                           fmt=a.fmt, a_tiled=a.tile is not None, b_tiled=b.tile is not None,
                           out_dtype=out_dtype, tiles=tiles, interpret=self.INTERPRET)

  def _assert_equal(self, got, want):
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))

  # M, N not multiples of the output tile (padded inside), K not a multiple of bk (a smaller bk).
  @pytest.mark.parametrize("fmt,a_tile,b_tile,m,n,k", [
      ("nvfp4", None, TILE, 48, 80, 1024),     # fprop: x 1x16, w 16x16 tiles
      ("nvfp4", None, None, 40, 24, 96),       # wgrad: both 1x16
      ("nvfp4", TILE, None, 304, 16, 64),
      ("nvfp4", TILE, TILE, 32, 48, 160),
      ("mxfp4", None, None, 20, 48, 512)])
  def test_equals_xla_path_bit_for_bit(self, fmt, a_tile, b_tile, m, n, k):
    a = exact_operand((m, k), fmt, a_tile, 0)
    b = exact_operand((n, k), fmt, b_tile, 1)
    for out_dtype in (jnp.float32, jnp.bfloat16):
      got = self._run(a, b, out_dtype)
      assert got.shape == (m, n) and got.dtype == out_dtype
      self._assert_equal(got, scaled_matmul_reference(a, b, out_dtype))

  def test_transposed_tiles_as_the_dgrad_reads_them(self):
    """dgrad: dy (M, N) 1x16 times the fprop weight's tiles transposed (api.transpose_tiles)."""
    w = exact_operand((64, 96), "nvfp4", TILE, 2)          # the fprop weight (N_out, K_in), tiled
    wt = api.transpose_tiles(w)                            # (K_in, N_out): what the dgrad GEMM takes
    dy = exact_operand((48, 64), "nvfp4", None, 3)
    self._assert_equal(self._run(dy, wt, jnp.bfloat16), scaled_matmul_reference(dy, wt, jnp.bfloat16))

  @pytest.mark.parametrize("amax,amax_b", [(2.0 ** -100, None), (2.0 ** 100, None), (2.0 ** -49, 2.0 ** -52),
                                           (3e19, None), (float("inf"), None), (float("nan"), None),
                                           (0.0, None), (2.0 ** 70, 2.0 ** -60)])
  def test_extreme_amaxes(self, amax, amax_b):
    """Where amax_a · amax_b under- or overflows, the reference splits the factor into powers of two;
    the kernel's epilogue applies the same four parts in the same order."""
    a = exact_operand((32, 64), "nvfp4", None, 4, amax=amax)
    b = exact_operand((16, 64), "nvfp4", TILE, 5, amax=amax if amax_b is None else amax_b)
    for out_dtype in (jnp.bfloat16, jnp.float32):
      got, want = self._run(a, b, out_dtype), scaled_matmul_reference(a, b, out_dtype)
      self._assert_equal(got, want)
    if amax == 2.0 ** -49:   # amax_a · amax_b = 2^-101: split; most results are float32 normals
      assert np.mean(np.asarray(got) != 0) > 0.5

  def test_nan_scale_bytes_give_nan_rows(self):
    a = exact_operand((32, 64), "nvfp4", None, 6)
    raw = _bytes(a.scale).at[3, 1].set(0x7F)
    a = dataclasses.replace(a, scale=jax.lax.bitcast_convert_type(raw, a.scale.dtype))
    b = exact_operand((16, 64), "nvfp4", None, 7)
    got = np.asarray(self._run(a, b, jnp.float32))
    want = np.asarray(scaled_matmul_reference(a, b, jnp.float32))
    assert np.isnan(got[3]).all() and np.isnan(want[3]).all()
    self._assert_equal(got[np.arange(32) != 3], want[np.arange(32) != 3])

  @pytest.mark.parametrize("fmt,b_tile", [("nvfp4", TILE), ("nvfp4", None), ("mxfp4", None)])
  def test_general_operands_within_the_summation_bound(self, fmt, b_tile):
    """Quantized random data: the float32 sums are inexact, so the two orders may differ, but each
    lies within γ_K·Σ|products| of the exact sum (the factor adds a few roundings: 8u·|exact|)."""
    m, n, k = 48, 32, 512
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    a = fp4jax.quantize(x, fmt, impl="xla")
    b = fp4jax.quantize(w, fmt, tile=b_tile, impl="xla")
    got = np.asarray(self._run(a, b, jnp.float32), np.float64)
    da = np.asarray(fp4jax.dequantize(a, impl="xla"), np.float64)
    db = np.asarray(fp4jax.dequantize(b, impl="xla"), np.float64)
    exact, size = da @ db.T, np.abs(da) @ np.abs(db).T
    gamma = k * U / (1 - k * U)
    assert np.all(np.abs(got - exact) <= gamma * size + 8 * U * np.abs(exact) + 2.0 ** -149)
    assert not np.array_equal(got, np.zeros_like(got))

  def test_leading_axes_and_small_tiles(self):
    a = exact_operand((2 * 24, 128), "nvfp4", None, 9)
    b = exact_operand((32, 128), "nvfp4", TILE, 10)
    a3 = QTensor(a.data.reshape(2, 24, 64), a.scale.reshape(2, 24, 8), a.amax, a.fmt, -1, a.block, None, a.dtype)
    tiles = MM.MixedMatmulTiles(bm=16, bn=16, bk=32)      # several programs and K steps
    got = self._run(a3, b, jnp.float32, tiles)
    assert got.shape == (2, 24, 32)
    self._assert_equal(got.reshape(48, 32), scaled_matmul_reference(a, b, jnp.float32))


class TestMixedMatmulInterpret(_MixedMatmulCases):
  INTERPRET = True


def test_bad_inputs_say_what_to_do():
  a = exact_operand((16, 32), "nvfp4", None, 0)
  b = exact_operand((16, 64), "nvfp4", None, 1)
  with pytest.raises(ValueError, match="share K"):
    MM.mixed_matmul(a.data, _bytes(a.scale), b.data, _bytes(b.scale), 1.0, interpret=True)
  with pytest.raises(ValueError, match="fmt in"):
    MM.mixed_matmul(a.data, _bytes(a.scale), a.data, _bytes(a.scale), 1.0, fmt="fp8", interpret=True)
  with pytest.raises(ValueError, match="must be a multiple of 16"):   # K = 40 with a 16x16-tiled b
    MM.mixed_matmul(jnp.zeros((16, 20), jnp.uint8), jnp.zeros((16, 2), jnp.uint8),
                    jnp.zeros((16, 20), jnp.uint8), jnp.zeros((1, 2), jnp.uint8), 1.0, b_tiled=True,
                    interpret=True)


def test_kernel_name_carries_the_gemm_shape():
  assert MM.kernel_name("nvfp4", False, True, 8192, 4096, 1024) == \
      "fp4jax_mixed_matmul_nvfp4_1x16_16x16_8192x4096x1024"
  assert MM.kernel_name("mxfp4", False, False, 16, 32, 64).endswith("_1x32_1x32_16x32x64")


# ------------------------------------------------------------------------------ the primitive's switch

def _impl_of(fn, *args):
  traced = lambda *a: fn(*a)   # a new function each time: jax caches the trace of one it has seen
  return [e.params["impl"] for e in jax.make_jaxpr(traced)(*args).jaxpr.eqns
          if str(e.primitive) == "fp4jax_scaled_matmul"]


def test_primitive_runs_the_mixed_kernel_bit_for_bit():
  a = exact_operand((48, 256), "nvfp4", None, 11)
  b = exact_operand((32, 256), "nvfp4", TILE, 12)
  run = lambda a, b: primitives.mixed_matmul(a, b, out_dtype=jnp.bfloat16)
  assert _impl_of(run, a, b) == ["mixed"]
  np.testing.assert_array_equal(np.asarray(run(a, b).astype(jnp.float32)),
                                np.asarray(api.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl="xla")
                                           .astype(jnp.float32)))


def test_the_proved_pallas_gemm_is_mixed_only_where_it_is_proved(monkeypatch):
  """impl=None and impl="pallas" run "mixed" where it is proved (a device verdict or VERIFIED_KERNELS, on a
  device where the kernels run compiled), else the pair ("pallas") or, for None, the XLA path;
  FP4JAX_DEFAULT_IMPL=pallas forces the pair, =xla the XLA path."""
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  a = exact_operand((16, 64), "nvfp4", None, 13)
  b = exact_operand((16, 64), "nvfp4", TILE, 14)
  none = lambda a, b: api.scaled_matmul(a, b, impl=None)
  pallas = lambda a, b: api.scaled_matmul(a, b, impl="pallas")
  assert _impl_of(none, a, b) == ["xla"] and _impl_of(pallas, a, b) == ["pallas"]   # CPU: nothing proved
  monkeypatch.setattr(dispatch, "can_use_pallas", lambda fmt, **_: True)          # a GPU, to the rule
  assert _impl_of(none, a, b) == ["xla"] and _impl_of(pallas, a, b) == ["pallas"]   # ... still nothing proved
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("mixed_matmul", "nvfp4"),
                      dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert _impl_of(none, a, b) == ["mixed"] and _impl_of(pallas, a, b) == ["mixed"]
  assert _impl_of(lambda a, b: api.scaled_matmul(a, b, impl="xla"), a, b) == ["xla"]
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert _impl_of(none, a, b) == ["xla"]
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  assert _impl_of(none, a, b) == ["pallas"]
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV)
  monkeypatch.delitem(dispatch.VERIFIED_KERNELS, ("mixed_matmul", "nvfp4"))
  assert _impl_of(none, a, b) == ["xla"]
  with pytest.raises(TypeError, match="kernel"):
    primitives.fp4_matmul(a, b, impl="pallas", kernel="mixed")   # pylint: disable=unexpected-keyword-arg


def test_mixed_matmul_is_a_kernel_op():
  assert "mixed_matmul" in dispatch.KERNEL_OPS
  assert dispatch.default_impl("mixed_matmul", "nvfp4") == "xla"     # no device run recorded
