"""The kernels compiled for a real GPU (Triton), against the reference, with pytest on a GPU machine.

The same test classes as the interpreted CPU tests, with INTERPRET = False, plus the public API with
impl="pallas" at training-like sizes. Skipped without a CUDA GPU. ``scripts/gpu_check.py`` is the
one-shot device check (no pytest needed); these tests are the finer-grained follow-up.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax import dispatch
from fp4jax.api import quantize_rht_transposed, scaled_matmul
from fp4jax.numerics.hadamard import rht
from fp4jax.reference import quantize_reference, scaled_matmul_reference
from test_kernels_quantize import (_Quantize1dCases, _Quantize2dCases, _QuantizeRhtTCases,
                                   make_bits, make_input)
from test_kernels_scaled_matmul import _ScaledMatmulCases, _ScaledMatmulExactCases, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not plc.gpu_available(), reason="needs a CUDA GPU")]


class TestQuantize1dGpu(_Quantize1dCases):
  INTERPRET = False


class TestQuantize2dGpu(_Quantize2dCases):
  INTERPRET = False


class TestQuantizeRhtTGpu(_QuantizeRhtTCases):
  INTERPRET = False


class TestScaledMatmulGpu(_ScaledMatmulCases):
  INTERPRET = False


class TestScaledMatmulExactGpu(_ScaledMatmulExactCases):
  INTERPRET = False


def _raw(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)


def test_default_impl_follows_the_verified_table():
  assert dispatch.can_use_pallas("nvfp4")
  for op in dispatch.KERNEL_OPS:
    verified = (op, "nvfp4") in dispatch.VERIFIED_KERNELS
    assert dispatch.default_impl(op, "nvfp4") == ("pallas" if verified else "xla")


@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1024)])
@pytest.mark.parametrize("kw", [dict(fmt="nvfp4"), dict(fmt="nvfp4", tile=(16, 16)),
                                dict(fmt="mxfp4"), dict(fmt="nvfp4", rounding="stochastic")])
def test_api_large_bit_exact(shape, kw):
  x = make_input(shape, jnp.bfloat16, seed=5)
  kw = dict(kw)
  fmt = kw.pop("fmt")
  bits = make_bits(shape) if kw.pop("rounding", None) else None
  extra = dict(rounding="stochastic", bits=bits) if bits is not None else {}
  q = jax.jit(lambda x: fp4jax.quantize(x, fmt, impl="pallas", **kw, **extra))(x)
  ref = jax.jit(lambda x: quantize_reference(x, fmt, bits=bits, **kw))(x)
  for a, b in ((q.data, ref.data), (q.scale, ref.scale)):
    np.testing.assert_array_equal(_raw(a), _raw(b))


def test_api_rht_transposed_large_bit_exact():
  x = make_input((8192, 1024), jnp.bfloat16, seed=6)
  bits = make_bits((1024, 8192))
  q = jax.jit(lambda x: quantize_rht_transposed(x, "nvfp4", rounding="stochastic", bits=bits,
                                                 impl="pallas"))(x)
  ref = jax.jit(lambda x: quantize_reference(rht(x.T, axis=-1), "nvfp4", bits=bits))(x)
  for a, b in ((q.data, ref.data), (q.scale, ref.scale), (q.amax, ref.amax)):
    np.testing.assert_array_equal(_raw(a), _raw(b))


def test_api_scaled_matmul_large():
  x = make_input((4096, 4096), jnp.bfloat16, seed=7)
  w = make_input((4096, 4096), jnp.bfloat16, seed=8)
  a = fp4jax.quantize(x, "nvfp4")
  b = fp4jax.quantize(w, "nvfp4", tile=(16, 16))
  got = jax.jit(lambda a, b: scaled_matmul(a, b, out_dtype=jnp.float32, impl="pallas"))(a, b)
  want = jax.jit(lambda a, b: scaled_matmul_reference(a, b, jnp.float32))(a, b)
  assert rel_err(got, want) <= 1e-6
