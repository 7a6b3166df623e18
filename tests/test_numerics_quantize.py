"""fp4jax.quantize / dequantize: layouts, idempotence, transforms, dtypes, edge cases and errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import random_bits
from fp4jax.numerics import nvfp4
from fp4jax.api import transpose_tiles
from fp4jax.reference import codes_of

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def bits_of(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_q_equal(a, b):
  assert (a.fmt, a.axis, a.block, a.tile) == (b.fmt, b.axis, b.block, b.tile)
  np.testing.assert_array_equal(bits_of(a.data), bits_of(b.data))
  np.testing.assert_array_equal(bits_of(a.scale), bits_of(b.scale))
  if a.amax is not None:
    np.testing.assert_array_equal(np.asarray(a.amax), np.asarray(b.amax))


def normal(shape, seed=0, dtype=jnp.float32, scale=1.0):
  return (scale * inputs.normal(jax.random.key(seed), shape)).astype(dtype)


@pytest.mark.parametrize("fmt, kw, data_shape, scale_shape", [
    ("nvfp4", {}, (64, 64), (64, 8)),
    ("nvfp4", {"tile": (16, 16)}, (64, 64), (4, 8)),
    # other axes: test_any_axis_equals_moving_it_last; fp8's tile and tensor scaling: test_fp8_block_and_tile_scaling
    pytest.param("nvfp4", {"axis": 0}, (32, 128), (4, 128), marks=pytest.mark.slow),
    ("mxfp4", {}, (64, 64), (64, 4)),
    pytest.param("mxfp4", {"axis": 0}, (32, 128), (2, 128), marks=pytest.mark.slow),
    ("fp8", {}, (64, 128), (64, 1)),
    pytest.param("fp8", {"tile": (128, 128)}, (64, 128), (1, 1), marks=pytest.mark.slow),
    pytest.param("fp8", {"scaling": "tensor"}, (64, 128), (), marks=pytest.mark.slow),
])
def test_shapes_and_dtypes(fmt, kw, data_shape, scale_shape):
  x = normal((64, 128))
  if kw.get("tile") == (128, 128):
    x = normal((128, 128))
    data_shape = (128, 128)
  q = fp4jax.quantize(x, fmt, **kw)
  assert q.data.shape == data_shape and q.scale.shape == scale_shape
  assert q.data.dtype == (jnp.float8_e4m3fn if fmt == "fp8" else jnp.uint8)
  assert q.scale.dtype == {"nvfp4": jnp.float8_e4m3fn, "mxfp4": jnp.float8_e8m0fnu,
                           "fp8": jnp.float32}[fmt]
  assert q.shape == x.shape
  assert fp4jax.dequantize(q).shape == x.shape
  assert fp4jax.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_any_axis_equals_moving_it_last():
  x = normal((3, 32, 48))
  for fmt in ("nvfp4", "mxfp4"):
    qa = fp4jax.quantize(x, fmt, axis=1)
    ql = fp4jax.quantize(jnp.moveaxis(x, 1, -1), fmt)
    np.testing.assert_array_equal(np.asarray(jnp.moveaxis(codes_of(qa), 1, -1)), np.asarray(codes_of(ql)))
    np.testing.assert_array_equal(bits_of(jnp.moveaxis(qa.scale, 1, -1)), bits_of(ql.scale))
    np.testing.assert_array_equal(np.asarray(jnp.moveaxis(fp4jax.dequantize(qa), 1, -1)),
                                  np.asarray(fp4jax.dequantize(ql)))


def test_tiles_are_16x16_blocks_with_one_scale():
  x = normal((32, 32), seed=3)
  q = fp4jax.quantize(x, "nvfp4", tile=(16, 16))
  # tile (i, j) equals an NVFP4 1-D quantization of that tile's 256 values with the same tensor amax
  for i in range(2):
    for j in range(2):
      t = x[16 * i:16 * i + 16, 16 * j:16 * j + 16].reshape(-1)
      amax_b = jnp.max(jnp.abs(t))
      # a 1-D block holding the tile amax reproduces the tile's scale
      b = fp4jax.quantize(jnp.full((16,), amax_b), "nvfp4", amax=q.amax)
      assert bits_of(q.scale)[i, j] == bits_of(b.scale)[0]


@pytest.mark.parametrize("shape", [(16, 16), pytest.param((48, 80), marks=pytest.mark.slow),   # several tiles:
                                   (5, 64, 32)])                                          # as (5, 64, 32)
def test_2d_transpose_gives_transposed_codes_and_scales(shape):
  w = normal(shape, seed=1, scale=3.0)
  wt = jnp.swapaxes(w, -1, -2)
  a = fp4jax.quantize(w, "nvfp4", tile=(16, 16))
  b = fp4jax.quantize(wt, "nvfp4", tile=(16, 16))
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(codes_of(a), -1, -2)), np.asarray(codes_of(b)))
  np.testing.assert_array_equal(bits_of(jnp.swapaxes(a.scale, -1, -2)), bits_of(b.scale))
  # 1x16 blocks generally do not have this property (spec §2): many codes differ.
  c = fp4jax.quantize(w, "nvfp4")
  d = fp4jax.quantize(wt, "nvfp4")
  assert (np.asarray(jnp.swapaxes(codes_of(c), -1, -2)) != np.asarray(codes_of(d))).mean() > 0.05


# fp8's tiles by default: test_fp8_block_and_tile_scaling
@pytest.mark.parametrize("fmt, tile, shape", [("nvfp4", (16, 16), (48, 80)),
                                              pytest.param("fp8", (128, 128), (128, 256), marks=pytest.mark.slow)])
def test_transpose_tiles_equals_quantizing_the_transpose(fmt, tile, shape):
  w = normal(shape, seed=6, scale=2.0)
  t = transpose_tiles(fp4jax.quantize(w, fmt, tile=tile))
  assert_q_equal(t, fp4jax.quantize(w.T, fmt, tile=tile))
  with pytest.raises(ValueError, match="tile="):
    transpose_tiles(fp4jax.quantize(w, fmt))


def test_transpose_packed_is_unpack_transpose_pack():
  """The one-pass nibble transpose (transpose_tiles' nvfp4 codes) against its twin, on every byte value in
  both rows of a pair and both nibbles of a byte."""
  from fp4jax.api import transpose_packed
  from fp4jax.numerics import e2m1
  every = np.arange(256, dtype=np.uint8)
  data = np.stack([np.repeat(every, 256), np.tile(every, 256)]).reshape(2, 512, 128)
  data = jnp.asarray(data.transpose(1, 0, 2).reshape(1024, 128))   # rows 2i, 2i+1: every pair of bytes
  np.testing.assert_array_equal(np.asarray(transpose_packed(data)), np.asarray(e2m1.pack(e2m1.unpack(data).T)))
  with pytest.raises(ValueError, match="even"):
    transpose_packed(data[:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, kw", [("nvfp4", {}), ("nvfp4", {"tile": (16, 16)}),
                                     ("mxfp4", {"scale_rule": "floor"}), ("nvfp4", {"axis": 0})])
def test_idempotence_bit_for_bit(fmt, kw, dtype):
  x = normal((64, 96), seed=2, dtype=dtype) * jnp.asarray(
      np.random.default_rng(0).lognormal(0, 2, (64, 1)), dtype)
  q = fp4jax.quantize(x, fmt, **kw)
  x_hat = fp4jax.dequantize(q)
  extra = {"amax": q.amax} if fmt == "nvfp4" else {}
  assert_q_equal(fp4jax.quantize(x_hat, fmt, **kw, **extra), q)


def test_mxfp4_rceil_idempotent_in_values():
  """RCEIL is idempotent in values, not in bits: a block whose largest code is 3 (amax/2^e in (3, 3.5))
  requantizes with a one-smaller exponent and doubled codes that represent the same numbers."""
  x = normal((64, 96), seed=5)
  q = fp4jax.quantize(x, "mxfp4", scale_rule="rceil")
  x_hat = fp4jax.dequantize(q)
  q2 = fp4jax.quantize(x_hat, "mxfp4", scale_rule="rceil")
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q2)), np.asarray(x_hat))
  changed = bits_of(q2.scale) != bits_of(q.scale)
  assert (bits_of(q2.scale)[changed] == bits_of(q.scale)[changed] - 1).all()


def test_amax_argument_and_amax_property():
  x = normal((32, 64))
  q = fp4jax.quantize(x, "nvfp4")
  assert float(q.amax) == float(jnp.max(jnp.abs(x)))
  q2 = fp4jax.quantize(x, "nvfp4", amax=2 * q.amax)
  assert float(q2.amax) == 2 * float(q.amax)
  assert (bits_of(q2.scale) != bits_of(q.scale)).any()
  # a shard quantized with the global amax equals the corresponding rows of the whole
  q_top = fp4jax.quantize(x[:16], "nvfp4", amax=q.amax)
  np.testing.assert_array_equal(bits_of(q_top.data), bits_of(q.data)[:16])
  np.testing.assert_array_equal(bits_of(q_top.scale), bits_of(q.scale)[:16])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_api(fmt):
  x = normal((64, 64), seed=9)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  q1 = fp4jax.quantize(x, fmt, rounding="stochastic", key=k1)
  q1b = fp4jax.quantize(x, fmt, rounding="stochastic", key=k1)
  q2 = fp4jax.quantize(x, fmt, rounding="stochastic", key=k2)
  assert_q_equal(q1, q1b)
  assert (bits_of(q1.data) != bits_of(q2.data)).any()
  # explicit bits reproduce the key path (its default stream, random_bits.DEFAULT)
  bits = random_bits.rounding_bits(k1, x.shape, -1, random_bits.DEFAULT)
  assert_q_equal(fp4jax.quantize(x, fmt, rounding="stochastic", bits=bits), q1)
  # scales do not depend on the rounding mode
  np.testing.assert_array_equal(bits_of(q1.scale), bits_of(fp4jax.quantize(x, fmt).scale))


@pytest.mark.parametrize("sr_bits", ["jax", "packed", "philox"])
def test_stochastic_rounding_unbiased_through_nvfp4(sr_bits):
  """The mean of dequantized SR draws converges to the scaled-and-saturated value (bound from the
  variance); every draw lies within one grid step of it; round-to-nearest is visibly further off. With
  every layout of the bits ("packed": 8 elements' bytes from one hash; "philox": 16)."""
  n = 2000
  x = normal((16, 32), seed=4)
  keys = jax.random.split(jax.random.key(0), n)
  deq = jax.jit(jax.vmap(lambda k: fp4jax.dequantize(fp4jax.quantize(x, "nvfp4", rounding="stochastic",
                                                                     key=k, sr_bits=sr_bits))))(keys)
  deq = np.asarray(deq, np.float64)
  # What SR is unbiased for: x scaled into [-6, 6] by its block's encode factor and saturated there.
  amax_g = nvfp4.tensor_amax(x)
  x_blk = x.reshape(16, 2, 16)
  s_b, enc_b = nvfp4.block_scales(jnp.max(jnp.abs(x_blk), -1), amax_g)
  factor = np.asarray(nvfp4.decode_factor(s_b, amax_g), np.float64)[..., None]
  target = (np.clip(np.asarray(x_blk * enc_b[..., None]), -6, 6) * factor).reshape(16, 32)
  step = 2.0 * np.broadcast_to(factor, (16, 2, 16)).reshape(16, 32)   # the largest E2M1 step
  assert np.all(np.abs(deq - target) <= step * (1 + 1e-6))
  err = deq.mean(0) - target
  sd = deq.std(0) / np.sqrt(n)
  assert np.all(np.abs(err) <= 5 * sd + step / 256 + 1e-6)
  nearest = np.asarray(fp4jax.dequantize(fp4jax.quantize(x, "nvfp4")), np.float64)
  assert np.abs(err).mean() < np.abs(nearest - target).mean() / 4


@pytest.mark.parametrize("dtype", [d if d == jnp.float32 else pytest.param(d, marks=pytest.mark.slow)
                                   for d in DTYPES])   # the other input dtypes: test_idempotence_bit_for_bit
def test_jit_and_vmap(dtype):
  x = normal((4, 32, 64), dtype=dtype)
  eager = fp4jax.quantize(x, "nvfp4")
  jitted = jax.jit(lambda v: fp4jax.quantize(v, "nvfp4"))(x)
  assert_q_equal(eager, jitted)
  # vmap over a leading axis: per-example tensor amax, so compare with a loop
  v = jax.vmap(lambda v: fp4jax.quantize(v, "nvfp4", tile=(16, 16)))(x)
  for i in range(x.shape[0]):
    qi = fp4jax.quantize(x[i], "nvfp4", tile=(16, 16))
    np.testing.assert_array_equal(bits_of(v.data[i]), bits_of(qi.data))
    np.testing.assert_array_equal(bits_of(v.scale[i]), bits_of(qi.scale))
    assert float(v.amax[i]) == float(qi.amax)
  roundtrip = jax.vmap(lambda v: fp4jax.dequantize(fp4jax.quantize(v, "mxfp4")))(x)
  assert roundtrip.shape == x.shape


def test_grad_through_quantize_is_a_clear_error():
  """Quantization is piecewise constant: its derivative would be a silent zero, so autodiff through it is refused
  with the straight-through alternative named (fp4jax.fake_quantize; docs/NUMERICS.md, "Derivatives")."""
  x = normal((16, 32))
  with pytest.raises(TypeError, match="fake_quantize"):
    jax.grad(lambda v: jnp.sum(fp4jax.dequantize(fp4jax.quantize(v, "nvfp4"))))(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values(dtype):
  x = jnp.zeros((4, 32), jnp.float32)
  x = x.at[1, :16].set(1e-30)   # a tiny block beside a normal one
  x = x.at[1, 16:].set(1.0)
  x = x.at[2, 3].set(1e30 if dtype == jnp.float32 else 1e4)
  x = x.astype(dtype)
  for fmt in ("nvfp4", "mxfp4", "fp8"):
    q = fp4jax.quantize(x, fmt, axis=-1) if fmt != "fp8" else fp4jax.quantize(x, fmt, scaling="tensor")
    d = np.asarray(fp4jax.dequantize(q))
    assert np.isfinite(d).all(), fmt
    np.testing.assert_array_equal(d[0], 0.0)   # all-zero blocks stay zero
  zeros = fp4jax.quantize(jnp.zeros((16, 16), dtype), "nvfp4")
  assert (bits_of(zeros.scale) == 0).all() and (bits_of(zeros.data) == 0).all()


def test_inf_and_nan_documented_behaviour():
  x = jnp.ones((2, 16), jnp.float32).at[0, 3].set(jnp.inf).at[0, 4].set(-jnp.inf)
  q = fp4jax.quantize(x, "nvfp4")
  codes = np.asarray(codes_of(q))
  assert codes[0, 3] == 7 and codes[0, 4] == 15          # saturate to ±6
  assert bits_of(q.scale)[0, 0] == 0x7E                  # block scale saturates at 448
  assert float(q.amax) == np.inf
  q = fp4jax.quantize(x.at[0, 3].set(jnp.nan).at[0, 4].set(1.0), "nvfp4")
  assert np.isnan(float(q.amax))
  assert np.isnan(np.asarray(fp4jax.dequantize(q))).all()   # NaN poisons the whole NVFP4 tensor
  qm = fp4jax.quantize(jnp.ones((2, 32)).at[0, 1].set(jnp.nan), "mxfp4")
  assert list(bits_of(qm.scale)[:, 0]) == [0xFF, 125]        # only the NaN block is NaN
  dm = np.asarray(fp4jax.dequantize(qm))
  assert np.isnan(dm[0]).all() and np.isfinite(dm[1]).all()


def test_fp8_block_and_tile_scaling():
  x = normal((256, 256), seed=7) * jnp.linspace(0.01, 100, 256)[:, None]
  for kw, rel in (({}, 1e-3), ({"tile": (128, 128)}, 1e-2), ({"scaling": "tensor"}, 1e-1)):
    q = fp4jax.quantize(x, "fp8", **kw)
    d = fp4jax.dequantize(q)
    rel_mse = float(jnp.mean((d - x) ** 2) / jnp.mean(x ** 2))
    assert rel_mse < rel, (kw, rel_mse)
    assert float(jnp.max(jnp.abs(d))) <= float(jnp.max(jnp.abs(x))) * (1 + 2 ** -3)
  # row blocks are independent: scaling one row leaves the others' data unchanged
  q1 = fp4jax.quantize(x, "fp8")
  q2 = fp4jax.quantize(x.at[0].multiply(1000), "fp8")
  np.testing.assert_array_equal(bits_of(q1.data)[1:], bits_of(q2.data)[1:])


def test_qtensor_is_a_pytree_through_jit():
  q = fp4jax.quantize(normal((32, 32)), "nvfp4", tile=(16, 16))
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3
  out = jax.jit(lambda q: q)(q)
  assert_q_equal(out, q)
  np.testing.assert_array_equal(np.asarray(jax.jit(fp4jax.dequantize)(q)), np.asarray(fp4jax.dequantize(q)))
  assert q.nbytes == 32 * 16 + 4 + 4


@pytest.mark.parametrize("call, error, match", [
    (lambda: fp4jax.quantize(jnp.ones((4, 24)), "nvfp4"), ValueError, r"axis 1 has length 24.*block 16"),
    (lambda: fp4jax.quantize(jnp.ones((4, 48)), "mxfp4"), ValueError, r"length 48.*block 32"),
    (lambda: fp4jax.quantize(jnp.ones((24, 32)), "nvfp4", tile=(16, 16)), ValueError, r"axis 0 has length 24"),
    (lambda: fp4jax.quantize(jnp.ones((4, 32), jnp.int32), "nvfp4"), TypeError, "floating-point"),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "int4"), ValueError, "unknown format"),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "nvfp4", rounding="stochastic"), ValueError, "key="),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "nvfp4", rounding="up"), ValueError, "rounding="),
    (lambda: fp4jax.quantize(jnp.ones((32, 32)), "mxfp4", tile=(16, 16)), ValueError, "no 2D tiles"),
    (lambda: fp4jax.quantize(jnp.ones((32, 32)), "nvfp4", tile=(32, 32)), ValueError, "tile="),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "mxfp4", amax=1.0), ValueError, "amax="),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "mxfp4", scale_rule="round"), ValueError, "scale_rule"),
    (lambda: fp4jax.quantize(jnp.ones((4, 32)), "nvfp4", axis=2), ValueError, "out of range"),
    (lambda: fp4jax.quantize(jnp.ones(()), "nvfp4"), ValueError, "scalar"),
    (lambda: fp4jax.quantize(jnp.ones((4, 128)), "fp8", rounding="stochastic", key=jax.random.key(0)),
     ValueError, "fp8"),
    (lambda: fp4jax.dequantize(jnp.ones(3)), TypeError, "QTensor"),
])
def test_clear_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()
