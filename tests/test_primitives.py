"""The fp4jax primitives: names in jaxprs, the impl switch, vmap, autodiff, the public API routes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax import dispatch
from fp4jax.api import quantize_rht_transposed, scaled_matmul, transpose_tiles
from fp4jax.reference import dequantize_reference, scaled_matmul_reference
from fp4jax.reference import quantize_reference as _quantize_reference

# One compiled reference per configuration (eager op-by-op dispatch is what makes CPU tests slow).
_jit_ref = jax.jit(_quantize_reference, static_argnames=("fmt", "axis", "tile", "scale_rule", "scaling"))


def quantize_reference(x, fmt, **kw):
  if "amax" in kw and kw["amax"] is not None:
    kw["amax"] = jnp.asarray(kw["amax"], jnp.float32)
  return _jit_ref(x, fmt, **kw)


def _x(shape, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape)), dtype)


def _raw(a):
  if a is None:
    return None
  a = jnp.asarray(a)
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)


def assert_same_qtensor(q, ref):
  assert (q.fmt, q.axis, q.block, q.tile, q.dtype, q.scale_rule) == (
      ref.fmt, ref.axis, ref.block, ref.tile, ref.dtype, ref.scale_rule)
  for a, b in ((q.data, ref.data), (q.scale, ref.scale), (q.amax, ref.amax)):
    if b is None:
      assert a is None
    else:
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(_raw(a), _raw(b))


def _primitive_names(fn, *args):
  return {str(e.primitive) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_jaxpr_shows_the_primitives(impl):
  x = _x((32, 64))
  names = _primitive_names(lambda x: fp4jax.quantize(x, "nvfp4", impl=impl), x)
  assert "fp4jax_quantize" in names
  names = _primitive_names(lambda x: quantize_rht_transposed(x, "nvfp4", impl=impl), x)
  assert "fp4jax_quantize_rht_t" in names
  q = fp4jax.quantize(x, "nvfp4", impl="xla")
  assert "fp4jax_dequantize" in _primitive_names(lambda q: fp4jax.dequantize(q, impl=impl), q)
  assert "fp4jax_scaled_matmul" in _primitive_names(
      lambda a, b: scaled_matmul(a, b, impl=impl), q, q)


def test_impl_switch_and_can_use_pallas():
  assert dispatch.can_use_pallas("nvfp4", platform="cuda")
  assert not dispatch.can_use_pallas("fp8", platform="cuda")
  assert not dispatch.can_use_pallas("nvfp4", platform="cpu")
  if jax.default_backend() == "cpu":
    assert dispatch.default_impl("scaled_matmul", "nvfp4") == "xla"
  assert dispatch.choose("quantize_1d", "mxfp4", "pallas") == "pallas"
  assert dispatch.choose("scaled_matmul", "fp8") == "xla" and dispatch.choose("quantize_1d", "fp8") == "xla"
  with pytest.raises(ValueError, match="impl="):
    fp4jax.quantize(_x((16, 16)), "nvfp4", impl="triton")
  with pytest.raises(ValueError, match="no Pallas kernels for fmt='fp8'"):
    fp4jax.quantize(_x((16, 128)), "fp8", impl="pallas")


def _impls_in_jaxpr(fn, *args):
  """{primitive name: impl param} of the fp4jax primitives ``fn`` binds (traced afresh: a new lambda
  each time, since jax caches traces per function)."""
  return {str(e.primitive): e.params["impl"] for e in jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr.eqns
          if str(e.primitive).startswith("fp4jax_")}


def _every_op(x):
  """One call of each kernel-backed op, impl=None."""
  a = fp4jax.quantize(x, "nvfp4")
  b = fp4jax.quantize(x, "nvfp4", tile=(16, 16))
  r = quantize_rht_transposed(x, "nvfp4")
  return a, b, r, scaled_matmul(a, b)


@pytest.fixture
def fake_gpu(monkeypatch):
  """The program is traced for an H200 with Triton (nothing is compiled: make_jaxpr only traces)."""
  monkeypatch.setattr(plc, "has_triton", lambda: True)
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  with fp4jax.target.use(fp4jax.target.Target("gpu", "NVIDIA H200", (9, 0))):
    yield


def test_default_on_gpu_is_xla_until_a_kernel_is_verified(fake_gpu, monkeypatch):
  x = _x((32, 64))
  assert dispatch.can_use_pallas("nvfp4")
  assert dispatch.VERIFIED_KERNELS == {}   # no device run has verified a kernel yet
  assert set(_impls_in_jaxpr(_every_op, x).values()) == {"xla"}
  for op in dispatch.KERNEL_OPS:
    assert dispatch.default_impl(op, "nvfp4") == "xla"
  evidence = dispatch.Evidence("2026-12-01", "NVIDIA H200", jax.__version__, 1.3)
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("quantize_2d", "nvfp4"), evidence)
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("scaled_matmul", "nvfp4"), evidence)
  impls = [e.params["impl"] for e in jax.make_jaxpr(lambda x: _every_op(x))(x).jaxpr.eqns
           if str(e.primitive).startswith("fp4jax_")]
  # quantize 1x16, quantize 16x16, rht_t, scaled_matmul, in binding order
  assert impls == ["xla", "pallas", "xla", "pallas"]
  assert dispatch.default_impl("scaled_matmul", "mxfp4") == "xla"   # verified per format
  assert dispatch.default_impl("quantize_2d", "nvfp4", platform="cpu") == "xla"


def test_default_impl_env_override(fake_gpu, monkeypatch):
  x = _x((32, 64))
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  assert set(_impls_in_jaxpr(_every_op, x).values()) == {"pallas"}
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("quantize_1d", "nvfp4"),
                      dispatch.Evidence("2026-12-01", "NVIDIA H200", jax.__version__, 1.3))
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert set(_impls_in_jaxpr(_every_op, x).values()) == {"xla"}
  assert dispatch.choose("quantize_1d", "nvfp4", "pallas") == "pallas"   # an explicit impl wins
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "triton")
  with pytest.raises(ValueError, match="FP4JAX_DEFAULT_IMPL"):
    fp4jax.quantize(x, "nvfp4")


def test_default_on_cpu_is_xla(monkeypatch):
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("quantize_1d", "nvfp4"),
                      dispatch.Evidence("2026-12-01", "NVIDIA H200", jax.__version__, 1.3))
  with fp4jax.target.use(fp4jax.target.Target("cpu", "cpu")):
    assert set(_impls_in_jaxpr(_every_op, _x((32, 64))).values()) == {"xla"}


CASES = [
    dict(fmt="nvfp4"),
    dict(fmt="nvfp4", axis=0),
    dict(fmt="nvfp4", tile=(16, 16)),
    dict(fmt="nvfp4", tile=(16, 16), axis=-2, rounding="stochastic"),
    dict(fmt="nvfp4", amax=3.0, rounding="stochastic"),
    dict(fmt="mxfp4", axis=1),
    dict(fmt="mxfp4", scale_rule="floor", rounding="stochastic"),
]


# By default one axis case (nvfp4 2D tiles along axis -2); axis=0 and mxfp4 axis=1 are slow (~15 s each), and so
# are plain nvfp4 and its tiles (covered by the stochastic cases with an amax and along axis -2).
_SLOW_CASES = (dict(fmt="nvfp4", axis=0), dict(fmt="mxfp4", axis=1), dict(fmt="nvfp4"),
               dict(fmt="nvfp4", tile=(16, 16)))


@pytest.mark.parametrize("case,impl", [pytest.param(c, "pallas", marks=pytest.mark.slow) if c in _SLOW_CASES
                                       else (c, "pallas") for c in CASES] + [(CASES[3], "xla")],
                         ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()))
def test_api_quantize_dequantize_equal_reference(case, impl):
  x = _x((32, 64, 96) if case.get("fmt") == "mxfp4" else (32, 48, 64), dtype=jnp.bfloat16)
  kw = dict(case)
  fmt = kw.pop("fmt")
  bits = None
  if kw.pop("rounding", "nearest") == "stochastic":
    bits = jax.random.bits(jax.random.key(1), x.shape, jnp.uint8)
    kw["rounding"] = "stochastic"
  q = fp4jax.quantize(x, fmt, bits=bits, impl=impl, **kw)
  kw.pop("rounding", None)
  ref = quantize_reference(x, fmt, bits=bits, **kw)
  assert_same_qtensor(q, ref)
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q, jnp.bfloat16, impl=impl)),
                                np.asarray(dequantize_reference(ref, jnp.bfloat16)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_api_rht_transposed_equals_reference(fmt):
  from fp4jax.numerics.hadamard import rht
  x = _x((64, 48), dtype=jnp.bfloat16)
  bits = jax.random.bits(jax.random.key(2), (48, 64), jnp.uint8)
  ref = quantize_reference(rht(x.T, axis=-1), fmt, axis=-1, bits=bits)
  for impl in ("xla", "pallas"):
    q = quantize_rht_transposed(x, fmt, rounding="stochastic", bits=bits, impl=impl)
    assert_same_qtensor(q, ref)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_api_scaled_matmul(impl):
  a = fp4jax.quantize(_x((2, 48, 64)), "nvfp4", impl="xla")
  w = fp4jax.quantize(_x((64, 32), seed=1), "nvfp4", tile=(16, 16), impl="xla")
  out = scaled_matmul(a, transpose_tiles(w), out_dtype=jnp.bfloat16, impl=impl)
  ref = scaled_matmul_reference(a, transpose_tiles(w), jnp.bfloat16)
  assert out.shape == (2, 48, 32) and out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2 ** -8,
                             atol=1e-6 * float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))


def test_vmap_xla():
  xs = _x((3, 32, 64))
  qs = jax.vmap(lambda x: fp4jax.quantize(x, "nvfp4", impl="xla"))(xs)
  assert_same_qtensor(jax.tree.map(lambda t: t[1], qs), quantize_reference(xs[1], "nvfp4"))


@pytest.mark.slow   # covered by test_vmap_xla and test_api_quantize_dequantize_equal_reference's pallas cases
def test_vmap_pallas():
  impl = "pallas"
  xs = _x((3, 32, 64))
  qs = jax.vmap(lambda x: fp4jax.quantize(x, "nvfp4", impl=impl))(xs)   # one amax per slice
  assert qs.amax.shape == (3,)
  for i in range(3):
    assert_same_qtensor(jax.tree.map(lambda t: t[i], qs), quantize_reference(xs[i], "nvfp4"))
  deq = jax.vmap(lambda q: fp4jax.dequantize(q, impl=impl))(qs)
  np.testing.assert_array_equal(np.asarray(deq[1]),
                                np.asarray(dequantize_reference(quantize_reference(xs[1], "nvfp4"))))
  w = fp4jax.quantize(_x((16, 64), seed=3), "nvfp4", impl="xla")
  out = jax.vmap(lambda x: scaled_matmul(fp4jax.quantize(x, "nvfp4", impl=impl), w, impl=impl))(xs)
  np.testing.assert_allclose(np.asarray(out[2]),
                             np.asarray(scaled_matmul_reference(quantize_reference(xs[2], "nvfp4"), w)),
                             rtol=1e-6, atol=1e-6)
  rq = jax.vmap(lambda x: quantize_rht_transposed(x, "nvfp4", impl=impl))(xs)
  assert_same_qtensor(jax.tree.map(lambda t: t[0], rq), quantize_rht_transposed(xs[0], "nvfp4",
                                                                                impl="xla"))


def test_vmap_over_bits_and_nested():
  xs = _x((2, 2, 16, 32))
  bits = jax.random.bits(jax.random.key(0), xs.shape, jnp.uint8)
  f = lambda x, b: fp4jax.quantize(x, "mxfp4", rounding="stochastic", bits=b, impl="pallas")
  qs = jax.vmap(jax.vmap(f))(xs, bits)
  ref = quantize_reference(xs[1, 0], "mxfp4", bits=bits[1, 0])
  assert_same_qtensor(jax.tree.map(lambda t: t[1, 0], qs), ref)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_vmapped_rht_t_is_one_op_over_the_batch(impl):
  """vmap of the RHT-transposed quantize binds one fp4jax_quantize_rht_t with the vmapped axis in front (one
  kernel whose grid covers it: fp4jax.grouped's chunks of every expert in one launch), no loop over the
  slices; each slice quantized as alone, with its own amax and its own key's bits hashed in the kernel."""
  xs = _x((3, 32, 48), dtype=jnp.bfloat16)
  keys = jax.random.split(jax.random.key(5), 3)
  f = lambda x, k: quantize_rht_transposed(x, "nvfp4", rounding="stochastic", key=k, impl=impl)
  text = str(jax.make_jaxpr(jax.vmap(f))(xs, keys))
  assert text.count("fp4jax_quantize_rht_t[") == 1 and "scan[" not in text and "while[" not in text
  qs = jax.jit(jax.vmap(f))(xs, keys)
  assert qs.data.shape == (3, 48, 16) and qs.amax.shape == (3,)
  for i in range(3):
    assert_same_qtensor(jax.tree.map(lambda t: t[i], qs), jax.jit(f)(xs[i], keys[i]))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_grad_through_the_primitive_is_refused_on_every_impl(impl):
  """The quantize primitive has no derivative (docs/NUMERICS.md, "Derivatives"): each impl refuses it alike."""
  x = _x((16, 32))
  loss = lambda v: jnp.sum(fp4jax.dequantize(fp4jax.quantize(v, "nvfp4", impl=impl), impl=impl))
  with pytest.raises(TypeError, match="fake_quantize"):
    jax.jit(jax.grad(loss))(x)


def test_jit_eager_and_impl_default_agree():
  x = _x((32, 64))
  eager = fp4jax.quantize(x, "nvfp4")
  jitted = jax.jit(lambda x: fp4jax.quantize(x, "nvfp4", impl="pallas"))(x)
  assert_same_qtensor(eager, jitted)
