"""fp4jax's grouped NVFP4 GEMM on Mosaic GPU (fp4jax/kernels/mosaic_gemm.py, ``mosaic_grouped_gemm``: the MoE
experts' rows GEMM, fprop and dgrad), on the CPU: its twin is today's native path bit for bit (``native.grouped_rows``
of the work items, then the epilogue and the cast as ``gemm.grouped_matmul`` applies them) for random groups (empty
ones, groups not whole row tiles, rows past the last group, one tile of all rows or many), ``grouped_dot``'s value
and gradients with the kernel forced, the CUDA lowering (one ``mosaic_gpu_v2`` custom call, no operand gathered per
item), the errors, and when ``gemm.grouped_matmul`` runs it (forced or proved, never by default). The deviceless
sm_100 compile is tests/test_gpu_aot_mosaic.py's."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _mosaic_compat as mc
from fp4jax import dispatch, gemm, grouped, native, verdicts
from fp4jax.kernels import mosaic_gemm as mg
from fp4jax.quantizers import Quantizer

A, E = 16, 5   # rows per chunk (each group a multiple), groups
TILINGS = {"one tile": native.Tiling(one_tile_groups=1 << 30),
           "tiles of 128": native.Tiling(one_tile_groups=0, rows=128)}


def _bits(x):
  return np.asarray(x, np.float32).view(np.int32)


def _rows_pair(seed, k=64, n=48, dgrad=False):
  """a (U, A, K) chunks quantized 1x16 with their group's amax (as ``fp4jax.grouped`` quantizes; dgrad: dy with
  stochastic rounding), b (E, N, K) per group (dgrad: each group's fprop tiles transposed), groups of random sizes
  (one empty, most not whole 128-row tiles) and two chunks of non-zero rows past the last group."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, 12, E) * A
  sizes[rng.integers(E)] = 0
  s = int(sizes.sum()) + 2 * A
  g = gemm.groups(jnp.asarray(sizes, jnp.int32), s, A)
  x_UxAxK = jnp.asarray(rng.standard_normal((s, k)) * np.exp(rng.standard_normal((s, 1))), jnp.float32
                        ).reshape(-1, A, k)
  amax_U = grouped._segment_amax(jnp.max(jnp.abs(x_UxAxK), axis=(1, 2)), g)   # pylint: disable=protected-access
  if dgrad:
    keys = jax.random.split(jax.random.key(seed), x_UxAxK.shape[0])
    a_U = jax.vmap(lambda t, key, am: Quantizer("nvfp4", stochastic=True)(t, key, amax=am))(x_UxAxK, keys, amax_U)
    w = jnp.asarray(rng.standard_normal((E, k, n)) * 0.1, jnp.float32)
    b_E = jax.vmap(fp4jax.transpose_tiles)(jax.vmap(Quantizer("nvfp4", tiled=True))(w))
  else:
    a_U = jax.vmap(lambda t, am: Quantizer("nvfp4")(t, amax=am))(x_UxAxK, amax_U)
    b_E = jax.vmap(Quantizer("nvfp4", tiled=True))(jnp.asarray(rng.standard_normal((E, n, k)) * 0.1, jnp.float32))
  return a_U, b_E, g


def _grouped(kernel, monkeypatch, out_dtype):
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, kernel)
  return jax.jit(lambda a, b, g: gemm.grouped_matmul(a, b, g, out_dtype=out_dtype, impl="native",
                                                     amax_per_group=True))


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("dgrad", [False, True], ids=["fprop", "dgrad"])
def test_twin_is_the_native_path_bit_for_bit(tiling, dgrad, monkeypatch):
  """The Mosaic route (factor per group and cast inside, bf16 (W, T, N), then the rows picked) against cuDNN's
  route (float32 (W, T, N), the rows picked, the factor per row, the cast): the same values, bit for bit, for a
  bf16 and a float32 result; the rows past the last group are zeros on both."""
  monkeypatch.setattr(native, "TILING", TILINGS[tiling])
  a_U, b_E, g = _rows_pair(3 + dgrad, dgrad=dgrad)
  s, end = a_U.shape[0] * A, int(np.sum(g.sizes))
  if tiling != "one tile":
    assert native.grouped_tile(s, E, A) == 128 < s and np.any(np.asarray(g.sizes) % 128)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    got = _grouped("mosaic", monkeypatch, out_dtype)(a_U, b_E, g)
    want = _grouped("cudnn", monkeypatch, out_dtype)(a_U, b_E, g)
    assert got.dtype == want.dtype == out_dtype and got.shape == (s, b_E.shape[1])
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert np.count_nonzero(np.asarray(want, np.float32)[:end]) > 0
    np.testing.assert_array_equal(np.asarray(got, np.float32)[end:], 0.0)


def test_twin_at_extreme_and_non_finite_amaxes(monkeypatch):
  """The factor parts per group in the XLA path's order (amaxes whose product leaves float32's range), and the
  rows past the last group: what their zero accumulator times their factor gives (NaN for an infinite amax),
  as on cuDNN's route."""
  monkeypatch.setattr(native, "TILING", TILINGS["tiles of 128"])
  a_U, b_E, g = _rows_pair(6)
  last_U = g.group == g.sizes.shape[0] - 1
  for amax in (2.0 ** -100, 2.0 ** 100, np.inf):
    a2 = dataclasses.replace(a_U, amax=jnp.where(last_U, jnp.float32(amax), a_U.amax))
    b2 = dataclasses.replace(b_E, amax=b_E.amax.at[0].set(amax if np.isfinite(amax) else 1.0))
    got = _grouped("mosaic", monkeypatch, jnp.float32)(a2, b2, g)
    want = _grouped("cudnn", monkeypatch, jnp.float32)(a2, b2, g)
    np.testing.assert_array_equal(_bits(got), _bits(want))
  assert np.isnan(np.asarray(got)[int(np.sum(g.sizes)):]).all()


def test_routes_differ_where_they_should(monkeypatch):
  """The forced kernel is the grouped Mosaic GEMM on CUDA (its lowering holds the kernel, cuDNN's route none), and
  the pairs it does not compute (4/6's factor) or a caller without one amax per group stay on cuDNN's route."""
  monkeypatch.setattr(native, "TILING", TILINGS["tiles of 128"])
  a_U, b_E, g = _rows_pair(5)

  def cuda_text(kernel, amax_per_group=True, a=a_U, b=b_E):
    monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, kernel)
    f = jax.jit(lambda a, b, g: gemm.grouped_matmul(a, b, g, out_dtype=jnp.bfloat16, impl="native",
                                                    amax_per_group=amax_per_group))
    with mc.lowering_arch((10, 0)):
      return f.trace(a, b, g).lower(lowering_platforms=("cuda",)).as_text()
  name = "fp4jax_mosaic_grouped_gemm_nvfp4_"
  assert name in cuda_text("mosaic") and name not in cuda_text("cudnn")
  assert name not in cuda_text("mosaic", amax_per_group=False)
  fos = Quantizer("nvfp4", four_over_six=(256, "mse"))
  a6 = jax.vmap(fos)(jnp.ones((a_U.shape[0], A, 64), jnp.float32))
  b6 = jax.vmap(dataclasses.replace(fos, tiled=True))(jnp.ones((E, 48, 64), jnp.float32))
  assert not native.mosaic_takes(a6, b6, jnp.bfloat16) and name not in cuda_text("mosaic", a=a6, b=b6)


def test_grouped_dot_value_and_gradients_with_the_kernel_forced(monkeypatch):
  """fp4jax.grouped_dot nvfp4 on the native path: y and dx (the two rows GEMMs) and dw with FP4JAX_NATIVE_KERNEL=
  mosaic equal cuDNN's route bit for bit on the CPU, and the CUDA lowering holds two grouped Mosaic GEMMs."""
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  monkeypatch.setattr(native, "TILING", TILINGS["tiles of 128"])
  rng = np.random.default_rng(9)
  sizes = jnp.asarray([48, 0, 160, 96], jnp.int32)
  s = int(sizes.sum()) + 32
  x = jnp.asarray(rng.standard_normal((s, 64)), jnp.bfloat16).at[int(sizes.sum()):].set(0)
  w = jnp.asarray(rng.standard_normal((4, 64, 48)) * 0.1, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((s, 48)), jnp.bfloat16)
  key = jax.random.key(1)

  def step(x, w):
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe="nvfp4", key=key), x, w)
    return (y, *vjp(dy))
  results = {}
  for kernel in ("mosaic", "cudnn"):
    monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, kernel)
    results[kernel] = jax.jit(step)(x, w)
  for got, want in zip(results["mosaic"], results["cudnn"]):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, "mosaic")
  with mc.lowering_arch((10, 0)):
    text = jax.jit(step).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  # fprop x·w[e]ᵀ (K 64 -> 256, N 48 -> 256) and dgrad dy·w[e] (K 48 -> 256, N 64 -> 256), W = 3 + 4 - 1 items
  assert sorted(set(re.findall(r"fp4jax_mosaic_grouped_gemm_nvfp4_(\d+x\d+x\d+x\d+)\b", text))) == ["6x128x256x256"]
  assert len(re.findall(r"@mosaic_gpu_v2\(", text)) == 2


def test_lowers_to_one_kernel_reading_each_weight_in_place():
  """The CUDA lowering (Python, no GPU): one mosaic_gpu_v2 custom call holding the block-scaled MMA, named with
  its W x T x N x K; no operand is gathered per item (the weights and a's rows are read in place by the
  kernel, from the item tables); the scales' layout passes are the only pads, and the factor's."""
  S = jax.ShapeDtypeStruct
  w, t, e, n, k, s = 7, 256, 4, 384, 512, 1000
  args = [S((s, k), jnp.float4_e2m1fn), S((s, k // 16), jnp.float8_e4m3fn), S((e, n, k), jnp.float4_e2m1fn),
          S((e, n, k // 16), jnp.float8_e4m3fn), S((e, 4), jnp.float32), S((w,), jnp.int32), S((w,), jnp.int32)]
  with mc.lowering_arch((10, 0)):
    lowered = jax.jit(lambda *a: mg.mosaic_grouped_gemm(*a, tile=t)).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert lowered.out_info.shape == (w, t, n) and lowered.out_info.dtype == jnp.bfloat16
  assert text.count(f"@{mc.MOSAIC_CUSTOM_CALL}(") == 1
  assert "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X" in text
  assert "fp4jax_mosaic_grouped_gemm_nvfp4_7x256x512x512" in text   # N 384 -> 512 (tn 256), K as it is
  assert "gather" not in text and "stablehlo.slice" not in text
  assert not [l for l in text.splitlines() if "stablehlo.pad" in l and "f4E2M1FN" in l]


def test_rows_not_whole_tiles():
  """One row tile of S = 200 rows (T = S, not whole 128-row tiles): the kernel computes 256 rows per item and
  stores the first 200 (TMA drops the rest); the twin equals the reference on the rows it has."""
  S = jax.ShapeDtypeStruct
  args = [S((200, 256), jnp.float4_e2m1fn), S((200, 16), jnp.float8_e4m3fn), S((3, 128, 256), jnp.float4_e2m1fn),
          S((3, 128, 16), jnp.float8_e4m3fn), S((3, 32), jnp.float32), S((3,), jnp.int32), S((3,), jnp.int32)]
  lowered = jax.jit(lambda *a: mg.mosaic_grouped_gemm(*a, tile=200)).trace(*args).lower(lowering_platforms=("cuda",))
  assert lowered.out_info.shape == (3, 200, 128)
  assert "fp4jax_mosaic_grouped_gemm_nvfp4_3x256x256x256" in lowered.as_text()


def test_bad_input_says_what_and_how():
  a_U, b_E, g = _rows_pair(0)
  s = a_U.shape[0] * A
  a = jnp.zeros((s, 64), jnp.float4_e2m1fn)
  sa = jnp.zeros((s, 4), jnp.float8_e4m3fn)
  b = jnp.zeros((E, 48, 64), jnp.float4_e2m1fn)
  sb = jnp.zeros((E, 48, 4), jnp.float8_e4m3fn)
  f = jnp.ones((E, 4), jnp.float32)
  it = jnp.zeros((3,), jnp.int32)
  with pytest.raises(ValueError, match="float4_e2m1fn operands"):
    mg.mosaic_grouped_gemm(a.astype(jnp.bfloat16), sa, b, sb, f, it, it, tile=128)
  with pytest.raises(ValueError, match="K must agree"):
    mg.mosaic_grouped_gemm(a, sa, b[..., :32], sb, f, it, it, tile=128)
  with pytest.raises(ValueError, match=r"factor_E must be \(E, 4\)"):
    mg.mosaic_grouped_gemm(a, sa, b, sb, f[:2], it, it, tile=128)
  with pytest.raises(ValueError, match=r"\(W,\) int32"):
    mg.mosaic_grouped_gemm(a, sa, b, sb, f, it.astype(jnp.uint32), it, tile=128)
  with pytest.raises(ValueError, match="multiple of 128"):
    mg.mosaic_grouped_gemm(a, sa, b, sb, f, it, it, tile=48)
  with pytest.raises(ValueError, match="writes"):
    mg.mosaic_grouped_gemm(a, sa, b, sb, f, it, it, tile=128, out_dtype=jnp.float16)
  assert not native.mosaic_grouped_takes(a_U, b_E, jnp.bfloat16, s, 48)   # whole scale tiles or one tile only
  assert native.mosaic_grouped_takes(a_U, b_E, jnp.bfloat16, s, s)


def test_never_chosen_by_default(monkeypatch):
  """The grouped kernel (``dispatch.native_kernel(grouped=True)``): cuDNN's route unless FP4JAX_NATIVE_KERNEL=mosaic
  forces it or a device run proved the grouped form (a VERIFIED_KERNELS entry); here (no device, nothing proved, nothing forced) the lowering holds no Mosaic kernel."""
  monkeypatch.delenv(dispatch.NATIVE_KERNEL_ENV, raising=False)
  monkeypatch.setenv(verdicts.PROOF_ENV, "off")
  monkeypatch.setattr(native, "TILING", TILINGS["tiles of 128"])
  a_U, b_E, g = _rows_pair(1)
  f = jax.jit(lambda a, b, g: gemm.grouped_matmul(a, b, g, out_dtype=jnp.bfloat16, impl="native",
                                                  amax_per_group=True))
  with mc.lowering_arch((10, 0)):
    text = f.trace(a_U, b_E, g).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" not in text and "fp4jax_mosaic" not in text
  b200 = fp4jax.target.Target("gpu", "NVIDIA B200", (10, 0))
  assert dispatch.native_kernel("nvfp4", target=b200) == "cudnn"


def test_the_dense_kernels_proof_does_not_choose_the_grouped_form(monkeypatch):
  """The grouped form runs code the dense kernel does not (the tables, one expert's slice of the weights): a
  device run of the dense Mosaic GEMM chooses that one alone; the grouped form needs its own entry."""
  monkeypatch.delenv(dispatch.NATIVE_KERNEL_ENV, raising=False)
  monkeypatch.setenv(verdicts.PROOF_ENV, "off")
  run = dispatch.Evidence(date="2026-12-08", device="NVIDIA B200", jax_version="0.10.2", speedup=1.5)
  b200 = fp4jax.target.Target("gpu", "NVIDIA B200", (10, 0))
  monkeypatch.setattr(dispatch, "VERIFIED_KERNELS", {(dispatch.MOSAIC_GEMM, "nvfp4"): run})
  assert dispatch.native_kernel("nvfp4", target=b200) == "mosaic"
  assert dispatch.native_kernel("nvfp4", target=b200, grouped=True) == "cudnn"
  monkeypatch.setattr(dispatch, "VERIFIED_KERNELS", {(dispatch.MOSAIC_GROUPED_GEMM, "nvfp4"): run})
  assert dispatch.native_kernel("nvfp4", target=b200, grouped=True) == "mosaic"
  monkeypatch.setenv(dispatch.NATIVE_KERNEL_ENV, "cudnn")
  assert dispatch.native_kernel("nvfp4", target=b200, grouped=True) == "cudnn"


def test_only_on_one_device_or_inside_a_manual_shard_map():
  """The kernel has no partitioning rule: it is taken with no mesh, or inside a shard_map manual over every axis
  (each device's experts on its local rows), never under an automatic mesh (GSPMD would gather its operands)."""
  a_U, b_E, _ = _rows_pair(2)
  s = a_U.shape[0] * A
  takes = lambda: native.mosaic_grouped_takes(a_U, b_E, jnp.bfloat16, s, 128)
  assert takes()
  auto = jax.sharding.AbstractMesh((2, 1), ("expert", "tensor"))
  manual = jax.sharding.AbstractMesh((2, 1), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Manual,) * 2)
  with jax.sharding.use_abstract_mesh(auto):
    assert not takes()
  with jax.sharding.use_abstract_mesh(manual):
    assert takes()
