"""fp4jax's NVFP4 GEMM on Mosaic GPU (fp4jax/kernels/mosaic_gemm.py), on the CPU: its twin is the XLA path
bit for bit (the result the kernel must give, up to the order of its float32 sums), the residual epilogue,
the tensor cores' scale layout, the CUDA lowering (one ``mosaic_gpu_v2`` custom call holding the
block-scaled MMA), the errors, and which GEMM impl="native" picks. The deviceless sm_100 compile, with its
PTX and SASS, is tests/test_gpu_aot_mosaic.py; the kernel's numbers only a device shows (tools.prove,
"mosaic_gemm/nvfp4")."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _mosaic_compat as mc
from fp4jax import api, dispatch, gemm, native, reference, verdicts
from fp4jax.kernels import mosaic_gemm as mg


def _pair(m=48, n=32, k=96):
  """x (m, k) quantized 1x16 and a (n, k) weight in 16x16 tiles: fprop's operands."""
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (n, k), jnp.bfloat16)
  return api.quantize(x, "nvfp4", impl="xla"), api.quantize(w, "nvfp4", tile=(16, 16), impl="xla")


def _bits(x):
  return np.asarray(x, np.float32).view(np.int32)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_twin_is_the_xla_path(out_dtype):
  a, b = _pair()
  want = gemm.matmul(a, b, out_dtype=out_dtype, impl="xla")
  got = native.matmul(a, b, out_dtype=out_dtype, kernel="mosaic")
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_twin_at_extreme_amaxes():
  """The four factor parts in the XLA path's order: amaxes whose product leaves float32's range."""
  a, b = _pair()
  for amax in (2.0 ** -100, 2.0 ** 100):
    a2, b2 = (dataclasses.replace(q, amax=jnp.float32(amax)) for q in (a, b))
    want = gemm.matmul(a2, b2, out_dtype=jnp.float32, impl="xla")
    np.testing.assert_array_equal(_bits(native.matmul(a2, b2, kernel="mosaic")), _bits(want))


def test_residual_is_added_in_float32_before_the_cast():
  a, b = _pair()
  oa, ob = native.operand(a), native.operand(b)
  r = jax.random.normal(jax.random.key(2), (48, 32), jnp.bfloat16) * 8
  got = mg.mosaic_gemm(oa.values, oa.scales, ob.values, ob.scales, reference.tensor_factor_parts(a, b), r)
  acc = gemm.matmul(a, b, out_dtype=jnp.float32, impl="xla")
  np.testing.assert_array_equal(_bits(got), _bits((acc + r.astype(jnp.float32)).astype(jnp.bfloat16)))
  words = reference.tensor_factor_parts(a, b, words=mg.FACTOR_WORDS)   # the factor as the kernel reads it
  np.testing.assert_array_equal(_bits(mg.mosaic_gemm(oa.values, oa.scales, ob.values, ob.scales, words, r)),
                                _bits(got))
  # one rounding, not two: differs from casting first somewhere
  twice = (acc.astype(jnp.bfloat16).astype(jnp.float32) + r.astype(jnp.float32)).astype(jnp.bfloat16)
  assert (_bits(got) != _bits(twice)).any()


def test_tensor_core_scale_layout():
  """Row r, scale column c of a (R, Kb) scale matrix sits at [r // 128, c // 4, r % 32, 4·((r // 32) % 4) + c % 4]."""
  s = np.arange(256 * 8).reshape(256, 8)
  out = np.asarray(mg.tensor_core_scales(jnp.asarray(s)))
  assert out.shape == (2, 2, 32, 16)
  for r in range(256):
    for c in range(8):
      assert out[r // 128, c // 4, r % 32, 4 * ((r // 32) % 4) + c % 4] == s[r, c]


def test_lowers_for_cuda_to_one_block_scaled_custom_call():
  """The CUDA lowering (Python, no GPU): one mosaic_gpu_v2 custom call whose module holds the NVFP4
  block-scaled tcgen05 MMA, named with its GEMM shape for the cost model."""
  S = jax.ShapeDtypeStruct
  args = [S((256, 512), jnp.float4_e2m1fn), S((256, 32), jnp.float8_e4m3fn), S((256, 512), jnp.float4_e2m1fn),
          S((256, 32), jnp.float8_e4m3fn), S((4,), jnp.float32), S((256, 256), jnp.bfloat16)]
  text = jax.jit(lambda *a: mg.mosaic_gemm(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(f"@{mc.MOSAIC_CUSTOM_CALL}(") == 1
  assert "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X" in text
  assert "fp4jax_mosaic_gemm_nvfp4_256x256x512" in text
  # a float32 result without a residual (the wgrad's, and a contraction split over devices) fits shared memory
  f32 = jax.jit(lambda *a: mg.mosaic_gemm(*a, out_dtype=jnp.float32)).trace(*args[:5])
  assert f32.lower(lowering_platforms=("cuda",)).as_text().count(f"@{mc.MOSAIC_CUSTOM_CALL}(") == 1


def test_codes_and_result_are_not_padded_to_whole_tiles():
  """M and N off the 128 x 256 tile (whole swizzle tiles: rows by 8, N by 32, as in_proj's 22,688 rows are): the
  kernel reads the codes as they are
  (its last tiles read zeros past their ends) and writes the result at its shape, so the lowering pads no codes
  and slices no result; only the scales are padded, in their layout pass."""
  S = jax.ShapeDtypeStruct
  args = [S((200, 512), jnp.float4_e2m1fn), S((200, 32), jnp.float8_e4m3fn), S((160, 512), jnp.float4_e2m1fn),
          S((160, 32), jnp.float8_e4m3fn), S((32,), jnp.float32)]
  lowered = jax.jit(lambda *a: mg.mosaic_gemm(*a)).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert lowered.out_info.shape == (200, 160)
  assert not [l for l in text.splitlines() if "stablehlo.pad" in l and "f4E2M1FN" in l], text
  assert "stablehlo.slice" not in text and "fp4jax_mosaic_gemm_nvfp4_256x256x512" in text


def test_padded_columns_are_zeros_beyond_n():
  """n_multiple: the columns padded with zeros (a reduce-scatter's partials, sliced as shards); the kernel's own
  tile columns need no slice on CUDA, a larger multiple pads further."""
  a, b = _pair()
  oa, ob = native.operand(a), native.operand(b)
  ops = (oa.values, oa.scales, ob.values, ob.scales, reference.tensor_factor_parts(a, b))
  got = mg.mosaic_gemm(*ops, out_dtype=jnp.float32, n_multiple=256)
  assert got.shape == (48, 256)
  np.testing.assert_array_equal(_bits(got[:, :32]), _bits(mg.mosaic_gemm(*ops, out_dtype=jnp.float32)))
  assert not np.asarray(got[:, 32:]).any()
  S = jax.ShapeDtypeStruct
  args = [S((256, 512), jnp.float4_e2m1fn), S((256, 32), jnp.float8_e4m3fn), S((200, 512), jnp.float4_e2m1fn),
          S((200, 32), jnp.float8_e4m3fn), S((4,), jnp.float32)]
  for n_multiple, cols in ((256, 256), (512, 512), (8, 200)):
    f = jax.jit(lambda *a: mg.mosaic_gemm(*a, out_dtype=jnp.float32, n_multiple=n_multiple))
    assert f.trace(*args).lower(lowering_platforms=("cuda",)).out_info.shape == (256, cols)
  with pytest.raises(ValueError, match="n_multiple must be >= 1"):
    mg.mosaic_gemm(*ops, n_multiple=0)


def test_bad_input_says_what_and_how():
  a, b = _pair()
  oa, ob = native.operand(a), native.operand(b)
  f = reference.tensor_factor_parts(a, b)
  with pytest.raises(ValueError, match="float4_e2m1fn operands"):
    mg.mosaic_gemm(oa.values.astype(jnp.bfloat16), oa.scales, ob.values, ob.scales, f)
  with pytest.raises(ValueError, match="K must agree"):
    mg.mosaic_gemm(oa.values[:, :64], oa.scales, ob.values, ob.scales, f)
  with pytest.raises(ValueError, match="residual must be"):
    mg.mosaic_gemm(oa.values, oa.scales, ob.values, ob.scales, f, jnp.zeros((32, 48), jnp.bfloat16))
  with pytest.raises(ValueError, match="tensor_factor_parts"):
    mg.mosaic_gemm(oa.values, oa.scales, ob.values, ob.scales, f[:1])
  with pytest.raises(ValueError, match="tn 128 or 256"):
    mg.GemmTiles(tn=192)
  with pytest.raises(ValueError, match="kernel='triton'"):
    native.matmul(a, b, kernel="triton")


def test_native_kernel_choice(monkeypatch):
  """cuDNN's GEMM unless forced or proved; the Mosaic kernel only for plain nvfp4 on 10.x."""
  monkeypatch.delenv(dispatch.NATIVE_KERNEL_ENV, raising=False)
  monkeypatch.setenv(verdicts.PROOF_ENV, "off")
  b200 = fp4jax.target.Target("gpu", "NVIDIA B200", (10, 0))
  h200 = fp4jax.target.Target("gpu", "NVIDIA H200", (9, 0))
  assert dispatch.native_kernel("nvfp4", target=b200) == "cudnn"   # no device run yet
  evidence = dispatch.Evidence("2026-12-01", "NVIDIA B200", jax.__version__, 1.2)
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, (dispatch.MOSAIC_GEMM, "nvfp4"), evidence)
  assert dispatch.native_kernel("nvfp4", target=b200) == "mosaic"
  assert dispatch.native_kernel("nvfp4", target=h200) == "cudnn"
  assert dispatch.native_kernel("mxfp8", target=b200) == "cudnn"
  mesh = jax.sharding.AbstractMesh((2,), ("fsdp",))
  with jax.sharding.use_abstract_mesh(mesh):   # an fp4jax op: on a mesh each device runs it on its shards
    assert dispatch.native_kernel("nvfp4", target=b200) == "mosaic"
  monkeypatch.setattr(mc, "has_block_scaled_mma", lambda: False)
  assert dispatch.native_kernel("nvfp4", target=b200) == "cudnn"
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, "mosaic")
  assert dispatch.native_kernel("nvfp4", target=h200) == "mosaic"
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, "triton")
  with pytest.raises(ValueError, match="FP4JAX_NATIVE_KERNEL='triton'"):
    dispatch.native_kernel("nvfp4")


def test_four_over_six_stays_on_cudnn():
  """A pair the kernel's epilogue does not compute (4/6's factor) runs cuDNN's GEMM (the XLA twin here)."""
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  q = fp4jax.quantizers.Quantizer("nvfp4", four_over_six=(256, "mse"))
  a = q(x, None)
  assert not native.mosaic_takes(a, a, jnp.bfloat16)
  np.testing.assert_array_equal(_bits(native.matmul(a, a, kernel="mosaic")), _bits(native.matmul(a, a)))


def test_forced_kernel_runs_the_three_gemms_of_the_dot(monkeypatch):
  """FP4JAX_NATIVE_KERNEL=mosaic with the native path: fprop, dgrad (the transposed tiles) and wgrad (the
  RHT'd, SR-quantized pair) of fp4jax.dot nvfp4 each hold the kernel (its CUDA branch, next to the twin)."""
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, "mosaic")
  x = jax.random.normal(jax.random.key(0), (128, 512), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (512, 256), jnp.bfloat16)
  loss = lambda x, w: fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(2)).astype(jnp.float32).sum()
  step = jax.value_and_grad(loss, argnums=(0, 1))
  assert str(jax.make_jaxpr(step)(x, w)).count("impl=mosaic") == 3   # three partitioned GEMM ops
  text = jax.jit(step).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  # M x N x K padded to the tiles: fprop x·wᵀ, dgrad dy·w, wgrad xᵀ·dyᵀ over the 128 tokens
  for mnk in ("128x256x512", "128x512x256", "512x256x256"):
    assert text.count(f"fp4jax_mosaic_gemm_nvfp4_{mnk}") >= 1, mnk
