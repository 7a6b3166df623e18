"""Every kernel lowers to Triton IR for CUDA, on a machine without a GPU.

``jax.export`` for platform "cuda" runs the Pallas->Triton lowering (the step that rejects unsupported
ops and non-power-of-two tensors inside kernels), with or without jax's CUDA plugin. The full GPU
compile (XLA's Triton pipeline, LLVM, ptxas) of every kernel for sm_90 and sm_100 is in
tests/test_gpu_aot.py (needs the plugin, no GPU); execution needs a GPU (tests/test_kernels_gpu.py). The public API with impl="pallas" is lowered end to end, so the CUDA
lowering rules of the primitives are exercised too.
"""
import jax
import jax.numpy as jnp
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax.api import quantize_rht_transposed, scaled_matmul

S = jax.ShapeDtypeStruct
pytestmark = pytest.mark.skipif(not plc.has_triton(), reason="jax without the Pallas Triton backend")


def _kernels_in(fn, *specs):
  return plc.export_for_cuda(fn, *specs).count(plc.TRITON_CUSTOM_CALL)


@pytest.mark.parametrize("fmt,shape,dtype", [("nvfp4", (304, 304), jnp.bfloat16),
                                             ("mxfp4", (256, 1024), jnp.float32)])
def test_quantize_1d_lowers(fmt, shape, dtype):
  key = jax.eval_shape(lambda: jax.random.key(0))
  fn = lambda x, k: fp4jax.quantize(x, fmt, rounding="stochastic", key=k, impl="pallas").data
  assert _kernels_in(fn, S(shape, dtype), key) == 1


def test_quantize_2d_lowers():
  # stochastic: the SR bits hashed in the kernel from the key (random_bits.KeyedBits), as in 1d above
  key = jax.eval_shape(lambda: jax.random.key(0))
  fn = lambda x, k: fp4jax.quantize(x, "nvfp4", tile=(16, 16), rounding="stochastic", key=k, impl="pallas").data
  assert _kernels_in(fn, S((304, 304), jnp.bfloat16), key) == 1


@pytest.mark.parametrize("fmt,rounding", [("nvfp4", "stochastic"), ("mxfp4", "nearest")])
def test_quantize_rht_t_lowers(fmt, rounding):
  key = jax.eval_shape(lambda: jax.random.key(0))
  fn = lambda x, k: quantize_rht_transposed(x, fmt, rounding=rounding,
                                            key=k if rounding == "stochastic" else None, impl="pallas").data
  assert _kernels_in(fn, S((1024, 256), jnp.bfloat16), key) == 1


@pytest.mark.parametrize("layout", ["packed", "philox"])
@pytest.mark.parametrize("op", ["1d", "2d", "rht_t"])
def test_packed_sr_bits_lower(op, layout):
  # the grouped layouts: one hash per 8 or 16 elements, its bytes spread over them (random_bits.group_bytes in
  # the 1d/2d kernels, group_byte row by row in the RHT kernel; philox's high products by inline PTX)
  key = jax.eval_shape(lambda: jax.random.key(0))
  if op == "rht_t":
    fn = lambda x, k: quantize_rht_transposed(x, "nvfp4", rounding="stochastic", key=k, impl="pallas",
                                              sr_bits=layout).data
  else:
    fn = lambda x, k: fp4jax.quantize(x, "nvfp4", tile=(16, 16) if op == "2d" else None, rounding="stochastic",
                                      key=k, impl="pallas", sr_bits=layout).data
  assert _kernels_in(fn, S((1024, 256) if op == "rht_t" else (304, 304), jnp.bfloat16), key) == 1


@pytest.mark.parametrize("fmt,w_tile", [("nvfp4", (16, 16)), ("mxfp4", None)])
def test_scaled_matmul_lowers(fmt, w_tile):
  def fn(x, w):
    a = fp4jax.quantize(x, fmt, impl="pallas")
    b = fp4jax.quantize(w, fmt, tile=w_tile, impl="pallas")
    return scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl="pallas")
  # quantize a, quantize b, then the scaled matmul's two dequantize passes and its GEMM
  assert _kernels_in(fn, S((2, 304, 320), jnp.bfloat16), S((4096, 320), jnp.bfloat16)) == 5


@pytest.mark.parametrize("fmt,w_tile", [("nvfp4", (16, 16)), ("mxfp4", None)])
def test_mixed_matmul_lowers(fmt, w_tile):
  from fp4jax import primitives   # pylint: disable=import-outside-toplevel
  def fn(x, w):
    a = fp4jax.quantize(x, fmt, impl="pallas")
    b = fp4jax.quantize(w, fmt, tile=w_tile, impl="pallas")
    return primitives.mixed_matmul(a, b, out_dtype=jnp.bfloat16)
  # quantize a, quantize b, then one GEMM that decodes as it loads (no dequantize pass)
  assert _kernels_in(fn, S((2, 304, 320), jnp.bfloat16), S((4096, 320), jnp.bfloat16)) == 3


def test_xla_impl_has_no_kernels():
  fn = lambda x: fp4jax.quantize(x, "nvfp4", impl="xla").data
  assert _kernels_in(fn, S((64, 64), jnp.float32)) == 0


def test_a_compiled_kernel_reads_its_operand_without_a_rounded_copy():
  """stored=True (fp4jax.dot's quantizers): XLA's ops read x through ``_exact.stored``, a compiled kernel
  reads x itself (its buffer holds the stored value), so no reduce_precision feeds the kernel and XLA writes
  no rounded copy of x for it. With the amax given there is no XLA op left to read x through it; without,
  the amax reads it so."""
  x = S((256, 256), jnp.bfloat16)
  given = [lambda x: fp4jax.quantize(x, "nvfp4", amax=1.0, impl="pallas", stored=True).data,
           lambda x: quantize_rht_transposed(x, "nvfp4", amax=1.0, impl="pallas", stored=True).data]
  for fn in given:
    assert "stablehlo.reduce_precision" not in plc.export_for_cuda(fn, x)
  own = lambda x: quantize_rht_transposed(x, "nvfp4", impl="pallas", stored=True).data
  assert plc.export_for_cuda(own, x).count("stablehlo.reduce_precision") == 1
