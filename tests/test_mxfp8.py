"""MXFP8 (fp4jax.numerics.mxfp8) and its native GEMM (fp4jax.native) on the CPU, against numpy transcriptions
of docs/NUMERICS.md ("MXFP8") written from the contract, compared with ``==``.

- The test vectors of docs/NUMERICS.md, both scale rules ("rceil", the recipe's; "floor", OCP MX v1.0's
  conversion), and random blocks over many binades with a zero, a tiny, a huge and an infinite block.
- The operands the native path feeds the block-scaled GEMM in the three GEMMs of ``fp4jax.dot`` (recorded
  at the GEMM) are the emulated path's bytes: E4M3 elements and E8M0 scale bytes of each operand in its
  GEMM's orientation (x, w along K; dy, w along N; xᵀ, dyᵀ along the tokens).
- The native result (the twin on the CPU) equals the XLA path bit for bit, dense and grouped (the MoE
  experts' work items, with padding and rows past the last group), through value_and_grad.
- The selection: off by default on compute capability 10.x until a device verdict says "faster".
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import inputs
import fp4jax
from fp4jax import gemm, grouped, native
from fp4jax import dispatch
from fp4jax import verdicts
from fp4jax.numerics import mxfp8
from fp4jax.quantizers import Quantizer
from test_recipes_mxfp8_row_scaled import _exact_operands, e4m3_rne, mx_scale_byte

F32 = np.float32


# ------------------------------------------------------------------------------------ numpy transcriptions

def floor_byte(amax):
  """OCP MX v1.0: the E8M0 byte of 2^(floor(log2 amax) - 8), clamped to [0, 254]; 0 for amax 0; 254 for inf."""
  a = np.asarray(amax, np.float64)
  out = np.zeros(a.shape, np.int64)
  nz = a > 0
  with np.errstate(divide="ignore"):
    out[nz] = np.clip(np.floor(np.log2(a[nz])) - 8 + 127, 0, 254)
  return out


def rceil_byte(amax):
  """The recipe's rule: amax/448 (float32 quotient) rounded up to a power of two; 254 for inf."""
  a = np.asarray(amax, F32)
  return np.where(np.isinf(a), 254, mx_scale_byte(np.where(np.isinf(a), 0, a)))


def quantize_np(t, rule):
  """(E4M3 elements as float32, scale bytes) of t (R, C) in blocks of 32 along C."""
  t = np.asarray(t, F32)
  blocks = t.reshape(t.shape[0], -1, 32)
  amax = np.max(np.abs(blocks), axis=-1)
  byte = rceil_byte(amax) if rule == "rceil" else floor_byte(amax)
  with np.errstate(over="ignore", invalid="ignore"):
    scaled = (blocks.astype(np.float64) * 2.0 ** (127 - byte)[..., None]).astype(F32)
  return e4m3_rne(np.clip(scaled, -448, 448)).reshape(t.shape), byte   # satfinite: ±inf -> ±448


def e4m3_bytes(elements_f32):
  return np.asarray(elements_f32, F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _raw(a):
  return np.asarray(jax.device_get(a)).view(np.uint8)


# ------------------------------------------------------------------------------------ docs/NUMERICS.md vectors

# (block amax a, rule, scale byte, the E4M3 element of a, its dequantized value): docs/NUMERICS.md, "MXFP8".
VECTORS = [
    (0.0, "rceil", 0, 0.0, 0.0), (0.0, "floor", 0, 0.0, 0.0),
    (1.0, "rceil", 119, 256.0, 1.0), (1.0, "floor", 119, 256.0, 1.0),
    (255.0, "rceil", 127, 256.0, 256.0), (255.0, "floor", 126, 448.0, 224.0),
    (448.0, "rceil", 127, 448.0, 448.0), (448.0, "floor", 127, 448.0, 448.0),
    (449.0, "rceil", 128, 224.0, 448.0), (449.0, "floor", 127, 448.0, 448.0),
    (500.0, "rceil", 128, 256.0, 512.0), (500.0, "floor", 127, 448.0, 448.0),
    (float(np.nextafter(F32(448), F32(0))), "rceil", 127, 448.0, 448.0),
    (float(np.nextafter(F32(448), F32(0))), "floor", 127, 448.0, 448.0),
    (float(np.nextafter(F32(448), F32(1e9))), "rceil", 128, 224.0, 448.0),
    (float(np.nextafter(F32(448), F32(1e9))), "floor", 127, 448.0, 448.0),
    (2.0 ** -120, "rceil", 0, 128.0, 2.0 ** -120), (2.0 ** -120, "floor", 0, 128.0, 2.0 ** -120),
    (float("inf"), "rceil", 254, 448.0, float("inf")), (float("inf"), "floor", 254, 448.0, float("inf")),
]


@pytest.mark.parametrize("amax, rule, byte, element, value", VECTORS)
def test_docs_vectors(amax, rule, byte, element, value):
  """A block of 32 holding a (first) and seven of its smaller neighbours: the byte, a's element and value
  as docs/NUMERICS.md lists them, and the numpy transcription agrees."""
  block = np.zeros((1, 32), F32)
  block[0, 0] = amax
  block[0, 1:8] = np.float32(amax) * F32(0.25) if np.isfinite(amax) else 1.0
  q = jax.jit(mxfp8.quantize, static_argnums=1)(jnp.asarray(block), rule)
  assert int(q.scale[0, 0]) == byte
  assert float(q.data[0, 0].astype(jnp.float32)) == element
  assert float(mxfp8.dequantize(q)[0, 0]) == value
  elems, want_byte = quantize_np(block, rule)
  assert want_byte[0, 0] == byte and elems[0, 0] == element


def test_nearest_even_inside_a_block():
  """Scale byte 127 (amax 448): 17 -> 16 and 19 -> 20 (ties to the even mantissa), 2^-10 -> 0 (a tie with
  the smallest subnormal 2^-9), 3·2^-11 -> 2^-9, -0.0 keeps its sign."""
  block = np.zeros((1, 32), F32)
  block[0, :6] = [448.0, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -11, -0.0]
  for rule in mxfp8.SCALE_RULES:
    q = mxfp8.quantize(jnp.asarray(block), rule)
    assert int(q.scale[0, 0]) == 127
    np.testing.assert_array_equal(np.asarray(q.data[0, :6].astype(jnp.float32)),
                                  F32([448.0, 16.0, 20.0, 0.0, 2.0 ** -9, -0.0]))
    assert np.signbit(np.asarray(q.data[0, 5].astype(jnp.float32)))


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_equals_the_transcription(rule):
  """Random blocks over many binades, a zero block, a tiny (1e-30) and a huge (1e30) block, a block with
  +inf and one with -inf: elements and scale bytes bit for bit."""
  k1, k2 = jax.random.split(jax.random.key(11))
  x = inputs.normal(k1, (24, 128)) * jnp.exp2(jax.random.randint(k2, (24, 1), -20, 20).astype(jnp.float32))
  x = x.at[1, :32].set(0.0).at[2, 32:64].multiply(1e-30).at[3, 64:96].multiply(1e30)
  x = x.at[4, 5].set(jnp.inf).at[5, 100].set(-jnp.inf)
  q = jax.jit(mxfp8.quantize, static_argnums=1)(x, rule)
  elems, byte = quantize_np(np.asarray(x), rule)
  np.testing.assert_array_equal(_raw(q.data), e4m3_bytes(elems))
  np.testing.assert_array_equal(np.asarray(q.scale), byte)
  deq = np.asarray(mxfp8.dequantize(q))
  assert np.isposinf(deq[4, 5]) and np.isneginf(deq[5, 100])   # an infinity is never silently finite
  assert np.sum(~np.isfinite(deq)) == 2


def test_scale_byte_255_is_nan_and_rules_are_checked():
  q = mxfp8.Mxfp8(jnp.ones((1, 64), jnp.float8_e4m3fn), jnp.asarray([[255, 127]], jnp.uint8))
  deq = np.asarray(mxfp8.dequantize(q))
  assert np.isnan(deq[0, :32]).all() and (deq[0, 32:] == 1.0).all()
  with pytest.raises(ValueError, match="unknown MXFP8 scale rule 'ceil'"):
    mxfp8.quantize(jnp.ones((1, 32)), "ceil")


def test_quantizer_takes_the_floor_rule():
  x = jnp.full((2, 32), 255.0)
  assert int(jax.lax.bitcast_convert_type(Quantizer("mxfp8")(x).scale, jnp.uint8)[0, 0]) == 127
  assert int(jax.lax.bitcast_convert_type(Quantizer("mxfp8", scale_rule="floor")(x).scale, jnp.uint8)[0, 0]) == 126


# ------------------------------------------------------------------------------------ native operands

M, K, N = 64, 96, 160   # every GEMM's operand pair has its own shapes


def test_native_operands_are_the_emulated_bytes(monkeypatch):
  """Each block-scaled GEMM of value_and_grad(fp4jax.dot, recipe="mxfp8") on the native path receives
  float8_e4m3fn values and float8_e8m0fnu scales (R, C/32), row-major (XLA swizzles them for the tensor
  cores), that are the numpy transcription's bytes of the operand in its GEMM's orientation."""
  seen = []
  gemm_fn = native.block_scaled_matmul

  def record(a, b):
    assert a.values.dtype == b.values.dtype == jnp.float8_e4m3fn
    assert a.scales.dtype == b.scales.dtype == jnp.float8_e8m0fnu
    jax.debug.callback(lambda *t: seen.append(t), a.values, a.scales, b.values, b.scales)
    return gemm_fn(a, b)

  monkeypatch.setattr(native, "block_scaled_matmul", record)
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  x = inputs.normal(jax.random.key(0), (M, K)) * 3
  x = x.at[3, :32].set(0.0).at[5, 40].set(1e4).at[7, 64:].multiply(1e-30)
  w = inputs.normal(jax.random.key(1), (K, N))
  dy = inputs.normal(jax.random.key(2), (M, N)) * 1e-3

  @jax.jit
  def step(x, w, dy):
    y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe="mxfp8"), x, w)
    return (y, *vjp(dy))

  jax.block_until_ready(step(x, w, dy))
  x, w, dy = (np.asarray(t) for t in (x, w, dy))
  want = {"fprop": (x, w.T), "dgrad": (dy, w), "wgrad": (x.T, dy.T)}   # (lhs, rhs), each along its last axis
  by_shape = {(a.shape, b.shape): (a, b) for a, b in want.values()}
  assert len(seen) == 3 and {(t[0].shape, t[2].shape) for t in seen} == set(by_shape)
  for a_vals, a_scales, b_vals, b_scales in seen:
    for vals, scales, t in ((a_vals, a_scales, by_shape[(a_vals.shape, b_vals.shape)][0]),
                            (b_vals, b_scales, by_shape[(a_vals.shape, b_vals.shape)][1])):
      elems, byte = quantize_np(t, "rceil")
      np.testing.assert_array_equal(np.asarray(vals).view(np.uint8), e4m3_bytes(elems))
      np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), byte)


def test_native_gemm_equals_the_xla_path_bit_for_bit():
  """The native GEMM (its twin on the CPU: the dequantized values in one float32 GEMM) is the XLA path's
  mxfp8.gemm, bit for bit, eagerly and under jit, for float32 and bfloat16 outputs."""
  q = Quantizer("mxfp8")
  a = q(inputs.normal(jax.random.key(3), (48, 256)) * 7)
  b = q(inputs.normal(jax.random.key(4), (40, 256)) * 1e-3)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    want = gemm.matmul(a, b, out_dtype=out_dtype, impl="xla")
    for fn in (gemm.matmul, jax.jit(gemm.matmul, static_argnames=("out_dtype", "impl"))):
      got = fn(a, b, out_dtype=out_dtype, impl="native")
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(_raw(got), _raw(want))


def test_dot_value_and_grad_native_equals_xla(monkeypatch):
  """y, dx and dw of fp4jax.dot(recipe="mxfp8") with every GEMM native equal the XLA path's bit for bit on
  order-free data (every product and partial sum exact), with E4M3 rounding in the operands."""
  x, w, dy = map(jnp.asarray, _exact_operands())

  def run():
    def f(x, w, dy):
      y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe="mxfp8"), x, w)
      return (y, *vjp(dy))
    return jax.jit(f)(x, w, dy)

  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  want = run()
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  assert "scaled_matmul" in str(jax.make_jaxpr(lambda a, b: fp4jax.dot(a, b, recipe="mxfp8"))(x, w))
  got = run()
  for g, w_ in zip(got, want):
    np.testing.assert_array_equal(_raw(g), _raw(w_))


def test_flax_dense_is_the_dot():
  """A linen nn.Dense with fp4jax.flax.dot_general_cls("mxfp8") gives fp4jax.dot's y and gradients bit for
  bit (no rng stream: nearest rounding everywhere)."""
  import flax.linen as nn   # pylint: disable=import-outside-toplevel
  from fp4jax.flax import dot_general_cls   # pylint: disable=import-outside-toplevel
  x, w, dy = map(jnp.asarray, _exact_operands())
  model = nn.Dense(w.shape[1], use_bias=False, dot_general_cls=dot_general_cls("mxfp8"))
  params = {"params": {"kernel": w}}
  y, vjp = jax.vjp(lambda p, x: model.apply(p, x), params, x)
  g_params, g_x = vjp(dy)
  y_ref, vjp_ref = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe="mxfp8"), x, w)
  g_x_ref, g_w_ref = vjp_ref(dy)
  for got, want in ((y, y_ref), (g_x, g_x_ref), (g_params["params"]["kernel"], g_w_ref)):
    np.testing.assert_array_equal(_raw(got), _raw(want))


# ------------------------------------------------------------------------------------ grouped (MoE experts)

def _grouped_operands(seed, e, rows):
  """x (S, 64), w (E, 64, 32), dy (S, 32) exact in any summation order (each 32-block holds a ±4, the rest
  integers/64: every scale 2^-6, every product a multiple of 2^-12), group sizes with an empty group, S
  with rows past the last group (non-zero in x and dy)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 4, e) * rows
  sizes[1] = 0
  s = int(sizes.sum()) + rows

  def operand(shape):
    t = rng.integers(-255, 256, shape) / 64
    i = np.arange(shape[-1])
    return np.where(i % 32 == 0, 4.0, t).astype(F32)
  return (jnp.asarray(operand((s, 64))), jnp.asarray(operand((e, 32, 64))).swapaxes(1, 2),
          jnp.asarray(operand((s, 32))), jnp.asarray(sizes, jnp.int32))


@pytest.mark.parametrize("tiling", [pytest.param("one tile", marks=pytest.mark.slow),
                                    "tiles of 96 rows"])   # tiles of 96: S = 256 rows padded to 288
def test_grouped_dot_native_equals_xla(tiling, monkeypatch):
  """y, dx, dw of grouped_dot(recipe="mxfp8") with the grouped GEMMs native (the work items of
  fp4jax.native: the tokens padded to whole tiles, MXFP8's pad scale byte 0, rows outside an item masked
  by zero elements) equal the XLA path's (lax.ragged_dot) bit for bit on order-free data; rows past the
  last group give zeros and an empty expert dw = 0."""
  monkeypatch.setattr(native, "TILING", native.Tiling(one_tile_groups=1 << 30) if tiling == "one tile"
                      else native.Tiling(one_tile_groups=0, rows=96))
  a = grouped.alignment("mxfp8")
  x, w, dy, sizes = _grouped_operands(5, 4, a)

  def run():
    def f(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: grouped.grouped_dot(x, w, sizes, recipe="mxfp8"), x, w)
      return (y, *vjp(dy))
    return f

  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  want = jax.jit(run())(x, w, dy)
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  jaxpr = str(jax.make_jaxpr(run())(x, w, dy))
  assert jaxpr.count("scaled_matmul") >= 3 and "ragged_dot" not in jaxpr
  got = jax.jit(run())(x, w, dy)
  for g, w_ in zip(got, want):
    assert np.all(np.isfinite(np.asarray(g, F32)))
    np.testing.assert_array_equal(_raw(g), _raw(w_))
  n_rows = int(sizes.sum())
  np.testing.assert_array_equal(np.asarray(got[0], F32)[n_rows:], 0.0)
  np.testing.assert_array_equal(np.asarray(got[2], F32)[1], 0.0)
  assert np.count_nonzero(np.asarray(got[2], F32)) > 0


def test_pad_rows_keeps_mxfp8_scales_finite():
  """A float 0 cast to float8_e8m0fnu is its NaN byte 0xFF: the work items' zero padding writes byte 0."""
  op = native.Operand(jnp.ones((2, 64), jnp.float8_e4m3fn), jnp.full((2, 2), 1.0, jnp.float8_e8m0fnu))
  padded = native._pad_rows(op, 128, 1)   # pylint: disable=protected-access
  np.testing.assert_array_equal(_raw(padded.scales)[:, 2:], 0)
  padded = native._pad_rows(op, 4, 0)     # pylint: disable=protected-access
  np.testing.assert_array_equal(_raw(padded.scales)[2:], 0)


# ------------------------------------------------------------------------------------ selection

@pytest.mark.parametrize("cc", [(10, 0), (10, 3), (9, 0), None])
def test_off_by_default_on_until_a_device_verdict(cc, monkeypatch):
  """No verdict: mxfp8 runs the XLA path everywhere (nvfp4 is native on 10.x); a "faster" verdict turns
  the dense and grouped GEMMs on, on compute capability 10.x only; "differs" keeps them off;
  FP4JAX_DEFAULT_IMPL=native forces them."""
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  native_cc = cc is not None and cc[0] == 10
  verdict = {}
  monkeypatch.setattr(verdicts, "decide", lambda op, fmt, device_kind=None: verdict.get((op, fmt)))
  assert dispatch.native_default("mxfp8", capability=cc) is None
  assert dispatch.native_grouped_default("mxfp8", capability=cc) is None
  assert dispatch.native_default("nvfp4", capability=cc) == ("native" if native_cc else None)
  verdict[(verdicts.NATIVE_OP, "mxfp8")] = True
  want = "native" if native_cc else None
  assert dispatch.native_default("mxfp8", capability=cc) == want
  assert dispatch.native_grouped_default("mxfp8", capability=cc) == want
  verdict[(verdicts.NATIVE_OP, "mxfp8")] = False
  assert dispatch.native_default("mxfp8", capability=cc) is None
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  assert dispatch.native_default("mxfp8", capability=cc) == "native"
  assert dispatch.native_grouped_default("mxfp8", capability=cc) == "native"


def test_the_proof_covers_mxfp8_and_passes_on_the_cpu():
  """tools.prove proves native_gemm/mxfp8 on a native device (it is a candidate though off by default);
  run here on the CPU at the tiny sizes, the native twin is exact against the XLA path on every case
  (order-free operands, scales 2^±50, NaN scale bytes) and the summation-order bound."""
  from tools import prove   # pylint: disable=import-outside-toplevel
  assert (verdicts.NATIVE_OP, "mxfp8") in prove.candidates(native=True)
  assert (verdicts.NATIVE_OP, "mxfp8") not in prove.candidates(native=False)
  entry = prove.prove(verdicts.NATIVE_OP, "mxfp8", sizes=prove.TINY_SIZES)
  assert entry["verdict"] in ("faster", "slower"), entry["summary"]
  cases = [c["case"] for c in entry["evidence"]["variants"][0]["cases"]]
  assert {"exact", "scales 2^-50", "scales 2^50", "nan scales"} <= set(cases)


# ------------------------------------------------------------------------------------ training

def _train_records(workdir):
  import json   # pylint: disable=import-outside-toplevel
  import os     # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.mark.slow   # shrunken: 80 s on two loaded cores (mostly compiles); moe_tiny: minutes
@pytest.mark.parametrize("config_name", ["shrunken", "moe_tiny"])
def test_trains_on_the_cpu(config_name, tmp_path):
  """The mxfp8 recipe trains: configs/tiny.py shrunken (24 steps) and configs/moe_tiny.py (its experts'
  grouped GEMMs in MXFP8; 4 short steps), loss finite and, for the dense model, falling."""
  from configs import moe_tiny, shrunken   # pylint: disable=import-outside-toplevel
  from training import sharding, trainer   # pylint: disable=import-outside-toplevel
  sharding.use_compilation_cache(shrunken.TEST_COMPILATION_CACHE)
  if config_name == "shrunken":
    config = shrunken.shrunken_config(steps=24, recipe="mxfp8", **{"optim.lr": 1e-2, "log_every": 8})
  else:
    config = moe_tiny.get_config()
    config.recipe, config.steps, config.batch_size, config.data.seq_len, config.log_every = "mxfp8", 4, 4, 64, 1
    config.optim.warmup_steps, config.eval.every_steps, config.checkpoint.every_steps = 1, 0, 0
  workdir = str(tmp_path / "run")
  summary = trainer.train_and_evaluate(config, workdir)
  train = _train_records(workdir)
  assert summary["status"] == "done" and summary["nonfinite_steps"] == 0
  assert all(r["recipe"] == "mxfp8" and np.isfinite(r["loss"]) for r in train), train
  if config_name == "shrunken":
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
