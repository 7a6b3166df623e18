"""The Pallas SSD kernels (models/ssd_pallas.py) in the Pallas interpreter, against ``ssd_chunked``,
``ssd_naive_reference`` and a float64 recurrence; their Triton lowering; the impl switch.

The tolerance: both float32 forms (the kernel and ``ssd_chunked``) are compared with the same recurrence
computed in float64, and the kernel's largest error must stay within ERR_RATIO times ``ssd_chunked``'s
plus FLOOR times the largest magnitude (the floor covers a tensor that ``ssd_chunked`` happens to
get nearly exact). Both differ from float64 only by float32 rounding in different summation orders, so
their errors are of one size; a wrong term (a missing decay, a lost gradient path) is orders larger.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
from fp4jax import pallas_compat as plc
from fp4jax import dispatch
import packed
from models import segments, ssd, ssd_pallas

ERR_RATIO = 8.0
FLOOR = 2e-6
TILES = ssd_pallas.SsdTiles(chunk=16, state_p=16)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
NAMES = ("x", "dt", "a", "b", "c", "d", "s0")


def _inputs(seed, B=2, L=40, H=4, P=16, G=2, N=16, with_state=True, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 7)
  x = inputs.normal(k[0], (B, L, H, P)).astype(dtype)
  dt = jax.nn.softplus(inputs.normal(k[1], (B, L, H)) - 1.0)
  a = -jnp.exp(inputs.uniform(k[2], (H,), minval=-1.0, maxval=1.5))
  b = inputs.normal(k[3], (B, L, G, N)).astype(dtype)
  c = inputs.normal(k[4], (B, L, G, N)).astype(dtype)
  d = inputs.normal(k[5], (H,))
  s0 = inputs.normal(k[6], (B, H, P, N)) if with_state else None
  return x, dt, a, b, c, d, s0


def _recurrence(x, dt, a, b, c, d, s0, start=None):
  """y = SSD + D x by the recurrence, in the inputs' dtype (float64 under enable_x64); ``start`` (B, L)
  bool: documents' first steps, where the state restarts from zero."""
  B, L, H, P = x.shape
  G, N = b.shape[2:]
  heads = jnp.arange(H) // (H // G)
  bh, ch = b[:, :, heads], c[:, :, heads]
  state = jnp.zeros((B, H, P, N), x.dtype) if s0 is None else s0
  ys = []
  for t in range(L):
    if start is not None:
      state = jnp.where(start[:, t, None, None, None], 0.0, state)
    state = (jnp.exp(dt[:, t] * a)[:, :, None, None] * state
             + (dt[:, t, :, None] * x[:, t])[..., None] * bh[:, t, :, None, :])
    ys.append(jnp.einsum("bhpn,bhn->bhp", state, ch[:, t]) + d[:, None] * x[:, t])
  return jnp.stack(ys, axis=1), state


def _kernel(x, dt, a, b, c, d, s0):
  return ssd_pallas.ssd_pallas(x, dt, a, b, c, d_H=d, initial_state_BxHxPxN=s0, tiles=TILES,
                               interpret=True)


def _chunked(x, dt, a, b, c, d, s0):
  return ssd_pallas.ssd(x, dt, a, b, c, chunk_size=TILES.chunk, d_H=d, initial_state_BxHxPxN=s0,
                        impl="xla")


def _vjp(fn_, args, seed=11):
  """(y, final) and the VJP w.r.t. every input (the initial state when given) for random cotangents."""
  fn = fn_
  if args[-1] is None:
    fn, args = (lambda *a: fn_(*a, None)), args[:-1]   # pylint: disable=unnecessary-lambda-assignment
  (y, final), pullback = jax.vjp(fn, *args)
  k1, k2 = jax.random.split(jax.random.key(seed))
  cot = (inputs.normal(k1, y.shape).astype(y.dtype), inputs.normal(k2, final.shape).astype(final.dtype))
  return y, final, pullback(cot)


@functools.cache
def _float64(seed, L, G, with_state):
  args = _inputs(seed, L=L, G=G, with_state=with_state)
  with jax.enable_x64(True):
    args64 = tuple(None if t is None else np.asarray(t, np.float64) for t in args)
    args64 = tuple(None if t is None else jnp.asarray(t, jnp.float64) for t in args64)
    y, final, grads = _vjp(_recurrence, args64)
    return tuple(np.asarray(t) for t in (y, final, *grads))


def _err(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


def _assert_as_close_as_chunked(name, got, chunked, want):
  err, ref_err = _err(got, want), _err(chunked, want)
  bound = ERR_RATIO * ref_err + FLOOR * float(np.max(np.abs(want)))
  assert err <= bound, f"{name}: kernel error {err:.3g} > {bound:.3g} (ssd_chunked's {ref_err:.3g})"


CASES = [pytest.param(dict(L=40, G=2, with_state=True), marks=pytest.mark.slow),  # L not a multiple of the
         # chunk; G < H; initial state (~18 s idle: by default L=9 covers a partial chunk, G < H and the state)
         pytest.param(dict(L=32, G=1, with_state=False), marks=pytest.mark.slow),  # whole chunks, one group, no
         # initial state (~35 s on 2 loaded cores; by default test_forward_matches_the_naive_loop runs L=40:
         # two whole chunks and a partial one)
         dict(L=9, G=2, with_state=True)]      # shorter than one chunk, G < H, initial state


class TestAgainstReferences:

  @pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c['L']}_G{c['G']}_s0{int(c['with_state'])}")
  def test_forward_gradients_and_final_state(self, case):
    args = _inputs(0, **case)
    want = _float64(0, case["L"], case["G"], case["with_state"])
    got = jax.jit(functools.partial(_vjp, _kernel))(args)
    via_xla = jax.jit(functools.partial(_vjp, _chunked))(args)
    flat = lambda r: (r[0], r[1], *r[2])
    names = ("y", "final") + NAMES[:len(want) - 2]
    for name, g, x, w in zip(names, flat(got), flat(via_xla), want):
      assert g.shape == w.shape and g.dtype == x.dtype, name
      _assert_as_close_as_chunked(name, g, x, w)

  def test_forward_matches_the_naive_loop(self):
    x, dt, a, b, c, d, s0 = _inputs(1)
    y, final = jax.jit(_kernel)(x, dt, a, b, c, d, s0)
    y_loop, final_loop = jax.jit(ssd.ssd_naive_reference)(x, dt, a, b, c, initial_state_BxHxPxN=s0)
    np.testing.assert_allclose(y, y_loop + d[:, None] * x, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(final, final_loop, rtol=2e-5, atol=2e-5)

  @pytest.mark.slow   # ~15 s loaded; by default the kernel runs with its D term (the scan plus D * x)
  def test_without_d_is_the_scan_alone(self):
    x, dt, a, b, c, _, s0 = _inputs(2, L=20)
    y, final = ssd_pallas.ssd_pallas(x, dt, a, b, c, initial_state_BxHxPxN=s0, tiles=TILES,
                                     interpret=True)
    y_ref, final_ref = ssd.ssd_chunked(x, dt, a, b, c, chunk_size=8, initial_state_BxHxPxN=s0)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(final, final_ref, rtol=2e-5, atol=2e-5)

  @pytest.mark.slow   # covered by test_forward_matches_the_naive_loop
  def test_bf16_inputs_compute_in_f32(self):
    args = _inputs(3, dtype=jnp.bfloat16)
    y, final, grads = jax.jit(functools.partial(_vjp, _kernel))(args)
    assert y.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert [g.dtype for g in grads] == [t.dtype for t in args]
    # the same values in float32: only y's final rounding to bf16 differs
    args32 = tuple(t.astype(jnp.float32) for t in args)
    y32, final32 = jax.jit(_kernel)(*args32)
    np.testing.assert_allclose(final, final32, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y.astype(jnp.float32), y32, rtol=1e-2, atol=1e-2)   # bf16 rounding
    y_x, final_x, grads_x = jax.jit(functools.partial(_vjp, _chunked))(args)
    np.testing.assert_allclose(y.astype(jnp.float32), y_x.astype(jnp.float32), **BF16_TOL)
    for name, g, gx in zip(NAMES, grads, grads_x):
      scale = float(jnp.abs(gx.astype(jnp.float32)).max())
      np.testing.assert_allclose(g.astype(jnp.float32), gx.astype(jnp.float32), rtol=2e-2,
                                 atol=2e-2 * scale, err_msg=name)

  def test_strong_decay_stays_finite_with_finite_gradients(self):
    x, dt, a, b, c, d, _ = _inputs(4, with_state=False)
    dt, a = dt * 300.0, a * 10.0   # dt a down to about -3000 per step

    def loss(fn, dt, a):
      y, final = fn(x, dt, a, b, c, d, None)
      return jnp.sum(y ** 2) + jnp.sum(final ** 2)

    value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, _kernel), argnums=(0, 1)))(dt, a)
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    ref = jax.jit(jax.value_and_grad(functools.partial(loss, _chunked), argnums=(0, 1)))(dt, a)
    np.testing.assert_allclose(value, ref[0], rtol=1e-5)
    for g, gr in zip(grads, ref[1]):
      np.testing.assert_allclose(g, gr, rtol=1e-4, atol=1e-4 * float(jnp.abs(gr).max()))


class TestDecodeHandOff:

  def test_prefill_with_the_kernel_then_steps(self):
    """The final state of a kernel prefill carries into ssd_step as the XLA prefill's does."""
    x, dt, a, b, c, d, _ = _inputs(5, L=24)
    prompt = lambda t: t[:, :20]
    _, state_k = jax.jit(_kernel)(*map(prompt, (x, dt)), a, *map(prompt, (b, c)), d, None)
    _, state_x = jax.jit(_chunked)(*map(prompt, (x, dt)), a, *map(prompt, (b, c)), d, None)
    np.testing.assert_allclose(state_k, state_x, rtol=2e-5, atol=2e-5)
    step = jax.jit(ssd.ssd_step)
    for t in range(20, 24):
      y_k, state_k = step(state_k, x[:, t], dt[:, t], a, b[:, t], c[:, t])
      y_x, state_x = step(state_x, x[:, t], dt[:, t], a, b[:, t], c[:, t])
      np.testing.assert_allclose(y_k, y_x, rtol=2e-5, atol=2e-5)
    y_all, final_all = jax.jit(_chunked)(x, dt, a, b, c, d, None)
    np.testing.assert_allclose(state_k, final_all, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y_k + d[:, None] * x[:, 23], y_all[:, 23], rtol=2e-5, atol=2e-5)


class TestSwitch:

  def test_the_default_is_xla_until_a_device_run(self):
    assert ssd_pallas.VERIFIED is None
    assert ssd_pallas.default_impl((1, 64, 4, 64), (1, 64, 1, 128), platform="cuda") == "xla"
    assert not ssd_pallas.can_use_pallas((1, 64, 4, 64), (1, 64, 1, 128), platform="cpu")

  def test_forced_pallas_is_chosen_where_it_can_run(self, monkeypatch):
    monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
    expected = "pallas" if plc.has_triton() else "xla"
    assert ssd_pallas.default_impl((1, 64, 4, 64), (1, 64, 1, 128), platform="cuda") == expected
    assert ssd_pallas.default_impl((1, 64, 4, 24), (1, 64, 1, 128), platform="cuda") == "xla"

  def test_unsupported_shapes_and_impls_say_what_to_do(self):
    x, dt, a, b, c, d, _ = _inputs(6, P=24)
    with pytest.raises(ValueError, match="head dim P=24 must be a power of two"):
      ssd_pallas.ssd_pallas(x, dt, a, b, c, tiles=TILES, interpret=True)
    with pytest.raises(ValueError, match="impl='fast'"):
      ssd_pallas.ssd(x, dt, a, b, c, chunk_size=8, impl="fast")
    with pytest.raises(ValueError, match="ssd_impl"):
      from models.config import ModelConfig   # pylint: disable=import-outside-toplevel
      ModelConfig(ssd_impl="fast")

  def test_the_xla_impl_is_ssd_chunked_plus_the_skip(self):
    x, dt, a, b, c, d, s0 = _inputs(7)
    y, final = ssd_pallas.ssd(x, dt, a, b, c, chunk_size=8, d_H=d, initial_state_BxHxPxN=s0, impl="xla")
    y_ref, final_ref = ssd.ssd_chunked(x, dt, a, b, c, chunk_size=8, initial_state_BxHxPxN=s0)
    np.testing.assert_array_equal(y, y_ref + d[:, None] * x)
    np.testing.assert_array_equal(final, final_ref)


@pytest.mark.skipif(not plc.has_triton(), reason="jax without the Pallas Triton backend")
@pytest.mark.parametrize("documents", [False, True])
def test_forward_and_backward_lower_to_triton_for_cuda(documents):
  """Five kernels: states and scan forward; states (recomputed), dstates and dchunk backward; with document
  masking too (the kernels' document input)."""
  S = jax.ShapeDtypeStruct
  B, L, H, P, G, N = 1, 200, 8, 64, 2, 128

  def fn(x, dt, a, b, c, d, s0, seg):
    def loss(*args):
      y, final = ssd_pallas.ssd_pallas(*args[:5], d_H=args[5], initial_state_BxHxPxN=args[6],
                                       segment_ids_BxL=seg)
      return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)
    return jax.value_and_grad(loss, argnums=tuple(range(7)))(x, dt, a, b, c, d, s0)

  text = plc.export_for_cuda(fn, S((B, L, H, P), jnp.bfloat16), S((B, L, H), jnp.float32),
                             S((H,), jnp.float32), S((B, L, G, N), jnp.bfloat16),
                             S((B, L, G, N), jnp.bfloat16), S((H,), jnp.float32),
                             S((B, H, P, N), jnp.float32), S((B, L), jnp.int32) if documents else None)
  assert text.count(plc.TRITON_CUSTOM_CALL) == 5
  for name in ssd_pallas.KERNEL_NAMES:
    assert f"models_{name}_" in text, name


class TestInTheMixer:

  # ~65 s on 2 loaded cores. By default the kernel's values and gradients against the references
  # (TestAgainstReferences) and its prefill handing over to decode steps (TestDecodeHandOff).
  @pytest.mark.slow
  def test_the_mixer_with_the_kernel_matches_xla_prefill_decode_and_gradients(self):
    """ModelConfig(ssd_impl="pallas") in the Mamba-2 mixer (the interpreter on the CPU): the output and
    the parameter gradients equal the XLA path's within float32 tolerance, and so does decoding two
    tokens with ssd_step after a kernel prefill."""
    import dataclasses   # pylint: disable=import-outside-toplevel
    from models import presets   # pylint: disable=import-outside-toplevel
    from models.mamba2 import Mamba2   # pylint: disable=import-outside-toplevel
    cfg = presets.get_model_config("tiny", n_groups=2)
    u = inputs.normal(jax.random.key(0), (2, 21, cfg.d_model))
    params = Mamba2(cfg).init(jax.random.key(1), u)
    outs = {}
    for impl in ("xla", "pallas"):
      m = Mamba2(dataclasses.replace(cfg, ssd_impl=impl))
      loss = lambda p, m=m: jnp.sum(m.apply(p, u).astype(jnp.float32) ** 2)
      value, grads = jax.jit(jax.value_and_grad(loss))(params)
      md = Mamba2(dataclasses.replace(cfg, ssd_impl=impl), decode=True)
      cache = md.init(jax.random.key(1), u[:, :19])["cache"]
      y, state = md.apply({"params": params["params"], "cache": cache}, u[:, :19], mutable=["cache"])
      ys = [y]
      for t in (19, 20):
        y, state = md.apply({"params": params["params"], **state}, u[:, t:t + 1], mutable=["cache"])
        ys.append(y)
      outs[impl] = (value, grads, jnp.concatenate(ys, axis=1))
    (v_x, g_x, y_x), (v_k, g_k, y_k) = outs["xla"], outs["pallas"]
    np.testing.assert_allclose(v_k, v_x, rtol=1e-5)
    np.testing.assert_allclose(y_k, y_x, rtol=1e-4, atol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_k), jax.tree.leaves(g_x)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()),
                                 err_msg=jax.tree_util.keystr(path))


class TestDocuments:
  """Document masking in the kernels (interpreted): the state restarts at each document's first step. The
  packed rows (tests/packed.py) put starts inside a kernel chunk of 16 and on a chunk's first step."""

  @staticmethod
  def _case():
    seg = jnp.asarray(packed.segment_ids())
    start = np.asarray(segments.starts(seg))
    return _inputs(12, L=seg.shape[1]), seg, start

  @staticmethod
  def _kernel_and_chunked(args, seg):
    kernel = functools.partial(_vjp, lambda *a: ssd_pallas.ssd_pallas(
        *a[:5], d_H=a[5], initial_state_BxHxPxN=a[6], tiles=TILES, interpret=True, segment_ids_BxL=seg))
    chunked = functools.partial(_vjp, lambda *a: ssd_pallas.ssd(
        *a[:5], chunk_size=TILES.chunk, d_H=a[5], initial_state_BxHxPxN=a[6], impl="xla", segment_ids_BxL=seg))
    flat = lambda r: (r[0], r[1], *r[2])
    return flat(jax.jit(kernel)(args)), flat(jax.jit(chunked)(args))

  def test_forward_gradients_and_final_state_match_ssd_chunked(self):
    """y, the final state and every gradient equal ``ssd_chunked``'s with the same segment ids (tested
    against the recurrences in tests/test_models_ssd.py) within float32 rounding of the largest magnitude."""
    args, seg, _ = self._case()
    for name, g, x in zip(("y", "final") + NAMES, *self._kernel_and_chunked(args, seg)):
      assert np.isfinite(g).all(), name
      np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5 * float(jnp.abs(x).max()), err_msg=name)

  @pytest.mark.slow   # ~20 s loaded (the float64 recurrence's gradient, eager); by default: against ssd_chunked
  def test_forward_gradients_and_final_state_against_float64(self):
    """y, the final state and every gradient as close to the float64 recurrence (state zeroed at each
    start) as ``ssd_chunked``'s with the same segment ids."""
    args, seg, start = self._case()
    got, via_xla = self._kernel_and_chunked(args, seg)
    with jax.enable_x64(True):
      args64 = tuple(jnp.asarray(np.asarray(t, np.float64)) for t in args)
      want = _vjp(lambda *a: _recurrence(*a, start=start), args64)
      want = tuple(np.asarray(t) for t in (want[0], want[1], *want[2]))
    for name, g, x, w in zip(("y", "final") + NAMES, got, via_xla, want):
      _assert_as_close_as_chunked(name, g, x, w)

  def test_other_documents_change_no_bit(self):
    """New inputs in row 0's first document leave the kernel's outputs for the other documents bit for bit."""
    (x, dt, a, b, c, d, s0), seg, _ = self._case()
    n = packed.LENGTHS[0][0]
    fn = jax.jit(lambda x, dt, b, c: ssd_pallas.ssd_pallas(x, dt, a, b, c, d_H=d, initial_state_BxHxPxN=s0,
                                                            tiles=TILES, interpret=True, segment_ids_BxL=seg))
    y, final = fn(x, dt, b, c)
    y2, final2 = fn(x.at[0, :n].set(1e4), dt.at[0, :n].set(3.0), b.at[0, :n].set(-50.0), c.at[0, :n].set(7.0))
    np.testing.assert_array_equal(y2[0, n:], y[0, n:])
    np.testing.assert_array_equal(y2[1], y[1])
    np.testing.assert_array_equal(final2, final)
