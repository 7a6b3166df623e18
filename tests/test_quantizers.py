"""One quantized type, quantizers per role, one GEMM (fp4jax.quantizers, fp4jax.gemm): every format is a
QTensor that dequantizes, validates and multiplies; every preset is a hashable table of six quantizers;
grouped GEMMs equal one GEMM per group."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import dispatch, formats, gemm, recipes
from fp4jax.numerics import dbq, eden, four_over_six as fos, mxfp8
from fp4jax.qtensor import validate
from fp4jax.quantizers import TRANSPOSED, Quantizer, Roles

X = inputs.normal(jax.random.key(0), (32, 256)) * jnp.exp2(jnp.arange(256.0) % 5 - 2)
W = inputs.normal(jax.random.key(1), (48, 256)) * 0.1

QUANTIZERS = {
    "nvfp4": Quantizer("nvfp4"), "nvfp4 tiles": Quantizer("nvfp4", tiled=True),
    "4/6": Quantizer("nvfp4", four_over_six=(256, "mse")),
    "4/6 tiles": Quantizer("nvfp4", tiled=True, four_over_six=(256, "mae")),
    "mxfp4": Quantizer("mxfp4"), "fp8": Quantizer("fp8"), "mxfp8": Quantizer("mxfp8"),
    "eden": Quantizer("nvfp4_eden"), "dbq": Quantizer("nvfp4_dbq"), "dbq sr": Quantizer("nvfp4_dbq", stochastic=True),
}


# Slow: 4/6 (tested in test_recipes_four_over_six); eden and dbq ("dbq sr" here, dbq's grouped GEMM below);
# mxfp8 (test_recipes_mxfp8_row_scaled); fp8 (test_numerics_quantize.py::test_shapes_and_dtypes). Each 15-60 s
# on 2 loaded cores.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n.startswith("4/6") or n in ("eden", "dbq", "mxfp8", "fp8") else n
                                  for n in QUANTIZERS])
def test_every_format_is_one_qtensor(name):
  q = QUANTIZERS[name]
  qx = q(X, jax.random.key(2))
  validate(qx, "test")
  assert qx.fmt in formats.TABLE and qx.shape == X.shape
  vals = fp4jax.dequantize(qx)
  assert vals.shape == X.shape and bool(jnp.all(jnp.isfinite(vals)))
  assert float(jnp.mean((vals - X) ** 2) / jnp.mean(X ** 2)) < 0.05
  y = gemm.matmul(qx, q(W, jax.random.key(3)))
  want = np.asarray(vals, np.float64) @ np.asarray(fp4jax.dequantize(q(W, jax.random.key(3))), np.float64).T
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  leaves, tree = jax.tree.flatten(qx)
  assert jax.tree.unflatten(tree, leaves).bound == qx.bound


def test_dequantize_is_each_module_s_own():
  """The numerics modules' own dequantize, bit for bit, from the QTensor's fields."""
  e = eden.quantize(eden.rht(X, eden.random_signs(jax.random.key(4))), eden.scale_bits(jax.random.key(5), X.shape))
  q = QUANTIZERS["eden"](X, jax.random.key(5), eden.random_signs(jax.random.key(4)))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q)), np.asarray(eden.dequantize(e.codes, e.scale, e.s_dec)))
  d = dbq.quantize(X)
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(QUANTIZERS["dbq"](X))), np.asarray(dbq.dequantize(d)))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(QUANTIZERS["mxfp8"](X))),
                                np.asarray(mxfp8.dequantize(mxfp8.quantize(X))))
  codes, scale, amax = fos.quantize(X, tiled=True, metric="mae")
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(QUANTIZERS["4/6 tiles"](X))),
                                np.asarray(fos.dequantize(codes, scale, amax, tiled=True)))


def test_transpose_tiles_keeps_the_four_over_six_bound():
  q = QUANTIZERS["4/6 tiles"](X)
  t = fp4jax.transpose_tiles(q)
  assert t.bound == 256
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(t)), np.asarray(fp4jax.dequantize(q)).T)


@pytest.mark.parametrize("change, match", [
    (lambda q: dataclasses.replace(q, scale2=None), "scale2 of a nvfp4_dbq tensor must be a float32"),
    (lambda q: dataclasses.replace(q, scale2=q.scale2[:, :1]), "needs one per 128"),
])
def test_validation_of_second_level_scales(change, match):
  with pytest.raises((TypeError, ValueError), match=match):
    validate(change(QUANTIZERS["dbq"](X)), "test")


def test_bad_quantizers_and_bounds_fail_at_construction():
  with pytest.raises(ValueError, match="no 2D tiles"):
    Quantizer("mxfp4", tiled=True)
  with pytest.raises(ValueError, match="Four Over Six"):
    Quantizer("mxfp4", four_over_six=(256, "mse"))
  with pytest.raises(ValueError, match="bound"):
    dataclasses.replace(QUANTIZERS["mxfp4"](X), bound=256)
  with pytest.raises(ValueError, match="one quantized operand"):
    Roles(Quantizer("nvfp4"), None, None, None, None, None)


def test_gemm_backends(monkeypatch):
  qx, qw = QUANTIZERS["eden"](X, jax.random.key(1)), QUANTIZERS["eden"](W, jax.random.key(2))
  # the native backend (on the CPU its exact twin): the XLA path's bits (tests/test_native.py)
  assert jnp.array_equal(gemm.matmul(qx, qw, impl="native"), gemm.matmul(qx, qw, impl="xla"))
  with pytest.raises(ValueError, match="no Pallas kernels"):
    gemm.matmul(qx, qw, impl="pallas")
  # the kernels as the default (FP4JAX_DEFAULT_IMPL=pallas) run a kernel where there is one, else the XLA path:
  # MS-EDEN and a Four Over Six pair (a producer's pre-quantized input, e.g. quartet2's) have none
  four_over_six = Quantizer("nvfp4", four_over_six=(256, "mse"))
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  for a, b in ((qx, qw), (four_over_six(X, None), four_over_six(W, None))):
    assert jnp.array_equal(gemm.matmul(a, b), gemm.matmul(a, b, impl="xla"))
  with pytest.raises(ValueError, match="share a format"):
    gemm.matmul(qx, QUANTIZERS["dbq"](W))


def _chunked(q, rows):
  """A (R, K) QTensor as (R / rows, rows, K) chunks, its tensor-level second level repeated per chunk."""
  u = q.data.shape[0] // rows
  split = lambda leaf: (jnp.broadcast_to(leaf, (u,)) if leaf.ndim == 0 else leaf.reshape(u, rows, *leaf.shape[1:]))
  return jax.tree.map(split, q)


@pytest.mark.parametrize("name", [pytest.param("4/6", marks=pytest.mark.slow), "dbq",
                                  pytest.param("eden", marks=pytest.mark.slow)])   # one format by default: dbq
def test_grouped_gemm_is_one_gemm_per_group(name):
  """gemm.grouped_matmul with traced group sizes (an empty group, rows past the last one): per group the
  dense GEMM of that group's rows, bit for bit on the CPU; zeros past the groups."""
  q = QUANTIZERS[name]
  sizes = (16, 0, 48, 16)
  xs = jnp.split(inputs.normal(jax.random.key(6), (80, 256)), np.cumsum(sizes)[:-1])
  ws = inputs.normal(jax.random.key(7), (4, 48, 256)) * 0.1
  parts = [q(x, jax.random.key(8)) for x in xs if x.shape[0]]
  past = _chunked(q(jnp.zeros((16, 256)), jax.random.key(8)), 16)   # one chunk past the last group
  a = jax.tree.map(lambda *l: jnp.concatenate(l), *[_chunked(p, 16) for p in parts], past)
  qw = [q(ws[g], jax.random.key(9 + g)) for g in range(4)]
  b = jax.tree.map(lambda *l: jnp.stack(l), *qw)
  run = jax.jit(lambda a, b, sizes: gemm.grouped_matmul(a, b, gemm.groups(sizes, 96, 16)))
  got = run(a, b, jnp.asarray(sizes, jnp.int32))
  want = jnp.concatenate([gemm.matmul(parts[i], qw[g]) for i, g in enumerate((0, 2, 3))])
  np.testing.assert_array_equal(np.asarray(got[:80]), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got[80:]), 0.0)


def test_every_preset_is_a_hashable_table_of_six_quantizers():
  for name in recipes.NAMES:
    roles = recipes.get(name).roles
    hash(roles)
    assert roles == recipes.get(name).roles
  nv = recipes.nvfp4().roles
  assert nv.dgrad_w == TRANSPOSED and nv.fprop_w.tiled and nv.dgrad_dy.stochastic
  assert nv.wgrad_x.rht_size == 16 and not nv.wgrad_x.stochastic and nv.wgrad_dy.stochastic
  q2 = recipes.quartet2().roles
  assert q2.requantize and q2.dgrad_rht == q2.wgrad_rht == 128 and q2.dgrad_dy.fmt == "nvfp4_eden"
  assert q2.fprop_x.four_over_six == (256, "mse")
  tj = recipes.tetrajet2().roles
  assert tj.requantize and tj.dgrad_rht == 16 and tj.wgrad_dy == Quantizer("nvfp4_dbq", stochastic=True)
  assert recipes.get("nvfp4_bf16_fprop").roles.fprop_x is None
  assert recipes.bf16().roles.quantizes_anything is False


def test_every_recipe_releases_dx_with_dw():
  x, w = jnp.ones((128, 128)), jnp.ones((128, 128))
  for name in ("nvfp4", "nvfp4_4over6", "quartet2", "tetrajet2", "mxfp4", "fp8"):
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp4jax.dot(x, w, recipe=name, key=jax.random.key(0)).sum(),
                                    (0, 1)))(x, w)
    assert "optimization_barrier" in str(jaxpr), name


def test_row_scaled_nvfp4_is_one_tensor_per_row():
  """Quantizer(row_scaled=True): every row quantized as its own NVFP4 tensor (its amax the row's), and
  the GEMM applies the tensor factor per output row: equal to one GEMM per row."""
  q, plain = Quantizer("nvfp4", row_scaled=True), Quantizer("nvfp4")
  x = X[:8] * jnp.exp2(jnp.arange(8.0) * 3 - 12)[:, None]
  qx = q(x)
  assert qx.amax.shape == (8,)
  np.testing.assert_array_equal(np.asarray(qx.amax), np.asarray(jnp.max(jnp.abs(x), axis=1)))
  rows = [plain(x[i:i + 1]) for i in range(8)]
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(qx)),
                                np.concatenate([np.asarray(fp4jax.dequantize(r)) for r in rows]))
  qw = plain(W)
  np.testing.assert_array_equal(np.asarray(gemm.matmul(qx, qw)),
                                np.concatenate([np.asarray(gemm.matmul(r, qw)) for r in rows]))


@pytest.mark.slow   # covered by test_dot.py::test_switching_one_gemm_to_bf16_changes_exactly_that_gemm
def test_dot_takes_a_table_of_roles_with_one_role_replaced():
  """A Recipe's roles are data: the same dot runs a table with one role swapped (a per-GEMM override),
  and the table of an unchanged recipe gives the recipe's bits."""
  x, w = X[:, :64], W[:, :64].T
  key = jax.random.key(3)
  vg = lambda r: jax.jit(jax.value_and_grad(lambda x, w: fp4jax.dot(x, w, recipe=r, key=key).sum(), (0, 1)))(x, w)
  for a, b in zip(jax.tree.leaves(vg("nvfp4")), jax.tree.leaves(vg(recipes.nvfp4().roles))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mixed = dataclasses.replace(recipes.nvfp4().roles, dgrad_dy=Quantizer("mxfp8"), dgrad_w=Quantizer("mxfp8"),
                              name="nvfp4, dgrad in mxfp8")
  value, (dx, dw) = vg(mixed)
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(vg("nvfp4")[1][1]))   # wgrad untouched
  assert not np.array_equal(np.asarray(dx), np.asarray(vg("nvfp4")[1][0]))


@pytest.mark.slow   # test_recipes_mxfp8_row_scaled tests the recipe by default
def test_mxfp8_recipe_is_a_table_of_six_mxfp8_quantizers():
  """recipes.mxfp8(): each operand in MXFP8 along its own GEMM's contraction, nearest, no RHT; the three
  GEMMs equal mxfp8.gemm of the numerics module's own quantization of each operand."""
  roles = recipes.mxfp8().roles
  assert {roles.fprop_x, roles.fprop_w, roles.dgrad_dy, roles.dgrad_w, roles.wgrad_x, roles.wgrad_dy} == {
      Quantizer("mxfp8")}
  assert not roles.needs_key
  x = X[:, :96]                                                        # (M, K) = (32, 96)
  w = inputs.normal(jax.random.key(4), (96, 64)) * 0.1              # (K, N)
  dy = inputs.normal(jax.random.key(5), (32, 64))
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipes.mxfp8()), x, w)
  dx, dw = vjp(dy)
  mm = lambda a, b: mxfp8.gemm(mxfp8.quantize(a), mxfp8.quantize(b))
  for got, want in ((y, mm(x, w.T)), (dx, mm(dy, w)), (dw, mm(x.T, dy.T))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
