"""The chunked SSD scan against the lax.scan recurrence and a naive Python loop; the conv cache; document
masking (the state restarting at each document of a packed window)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import packed
from models import ssd
from models.mamba2 import causal_conv1d

chunked = jax.jit(ssd.ssd_chunked, static_argnames="chunk_size")
scan_reference = jax.jit(ssd.ssd_scan_reference)
naive_reference = jax.jit(ssd.ssd_naive_reference)

# Float32 throughout; the forms differ only in summation order.
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(seed, B=2, L=29, H=4, P=8, G=2, N=5, with_state=True):
  k = jax.random.split(jax.random.key(seed), 6)
  x = inputs.normal(k[0], (B, L, H, P))
  dt = jax.nn.softplus(inputs.normal(k[1], (B, L, H)) - 1.0)
  a = -jnp.exp(inputs.uniform(k[2], (H,), minval=-1.0, maxval=1.5))
  b = inputs.normal(k[3], (B, L, G, N))
  c = inputs.normal(k[4], (B, L, G, N))
  s0 = inputs.normal(k[5], (B, H, P, N)) if with_state else None
  return (x, dt, a, b, c), s0


@functools.cache
def _gradients(form, chunk_size):
  """VJP of (y, final_state) with fixed random cotangents, w.r.t. x, dt, a, B, C and the initial state."""
  args, s0 = _inputs(2, L=13)
  cotangents = (inputs.normal(jax.random.key(9), args[0].shape),
                inputs.normal(jax.random.key(10), s0.shape))
  fn = {"chunked": functools.partial(ssd.ssd_chunked, chunk_size=chunk_size),
        "scan": ssd.ssd_scan_reference, "naive": ssd.ssd_naive_reference}[form]

  @jax.jit
  def vjp(args, s0):
    _, pullback = jax.vjp(lambda *a: fn(*a[:5], initial_state_BxHxPxN=a[5]), *args, s0)
    return pullback(cotangents)

  return vjp(args, s0)


class TestSegsum:

  def test_matches_definition(self):
    a = inputs.normal(jax.random.key(0), (3, 6))
    out = np.asarray(ssd.segsum(a))
    a = np.asarray(a)
    for i in range(6):
      for j in range(6):
        want = a[:, j + 1:i + 1].sum(-1) if i >= j else -np.inf
        np.testing.assert_allclose(out[:, i, j], want, rtol=1e-6, atol=1e-6)

  def test_exp_is_exactly_zero_above_diagonal_and_one_on_it(self):
    decay = jnp.exp(ssd.segsum(jnp.full((5,), -3.0)))
    assert (decay[jnp.triu_indices(5, 1)] == 0).all()
    assert (jnp.diag(decay) == 1).all()


class TestChunkedScan:

  # chunk_size 1 (one step per chunk) under -m slow: the chunk boundaries are covered by 7, which does not divide L
  @pytest.mark.parametrize("chunk_size,with_state", [pytest.param(1, True, marks=pytest.mark.slow),
                                                     (7, False), (7, True), (16, True), (64, True)])
  def test_values_match_scan_and_naive_loop(self, chunk_size, with_state):
    args, s0 = _inputs(0, with_state=with_state)
    y, final = chunked(*args, chunk_size=chunk_size, initial_state_BxHxPxN=s0)
    y_scan, final_scan = scan_reference(*args, initial_state_BxHxPxN=s0)
    y_loop, final_loop = naive_reference(*args, initial_state_BxHxPxN=s0)
    np.testing.assert_allclose(y_scan, y_loop, **TOL[jnp.float32])
    np.testing.assert_allclose(final_scan, final_loop, **TOL[jnp.float32])
    np.testing.assert_allclose(y, y_scan, **TOL[jnp.float32])
    np.testing.assert_allclose(final, final_scan, **TOL[jnp.float32])

  @pytest.mark.parametrize("L", [1, 17])
  def test_lengths_around_the_chunk(self, L):
    args, s0 = _inputs(1, L=L, H=6, G=3, N=4)
    y, final = chunked(*args, chunk_size=16, initial_state_BxHxPxN=s0)
    y_ref, final_ref = scan_reference(*args, initial_state_BxHxPxN=s0)
    assert y.shape == y_ref.shape == args[0].shape
    np.testing.assert_allclose(y, y_ref, **TOL[jnp.float32])
    np.testing.assert_allclose(final, final_ref, **TOL[jnp.float32])

  @pytest.mark.parametrize("chunk_size", [4, 7])
  def test_gradients_match_scan_and_naive_loop(self, chunk_size):
    got = _gradients("chunked", chunk_size)
    via_scan = _gradients("scan", None)
    via_loop = _gradients("naive", None)
    for name, g, g_scan, g_loop in zip(["x", "dt", "a", "b", "c", "state"], got, via_scan, via_loop):
      scale = float(jnp.abs(g_loop).max())
      np.testing.assert_allclose(g_scan, g_loop, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
      np.testing.assert_allclose(g, g_loop, rtol=1e-4, atol=1e-5 * scale, err_msg=name)

  def test_strong_decay_stays_finite_with_finite_gradients(self):
    # dt * a down to about -3000 per step: naive cumsum differences would overflow exp().
    args, _ = _inputs(3, with_state=False)
    x, dt, a, b, c = args
    dt = dt * 300.0
    a = a * 10.0

    def loss(dt, a):
      y, final = ssd.ssd_chunked(x, dt, a, b, c, chunk_size=7)
      return jnp.sum(y ** 2) + jnp.sum(final ** 2)

    value, (g_dt, g_a) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(dt, a)
    assert np.isfinite(value) and np.isfinite(g_dt).all() and np.isfinite(g_a).all()
    y_ref, _ = scan_reference(x, dt, a, b, c)
    np.testing.assert_allclose(chunked(x, dt, a, b, c, chunk_size=7)[0], y_ref, **TOL[jnp.float32])

  def test_bf16_inputs_compute_in_f32_and_return_bf16(self):
    args, _ = _inputs(4)
    args16 = tuple(t.astype(jnp.bfloat16) if t.ndim > 1 else t for t in args)
    y16, final = chunked(*args16, chunk_size=8)
    assert y16.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    y_ref, _ = scan_reference(*(t.astype(jnp.float32) for t in args16))
    np.testing.assert_allclose(y16.astype(jnp.float32), y_ref, **TOL[jnp.bfloat16])

  def test_splitting_the_sequence_carries_the_state(self):
    args, s0 = _inputs(5)
    y, final = chunked(*args, chunk_size=7, initial_state_BxHxPxN=s0)
    first = tuple(t[:, :11] if t.ndim > 1 else t for t in args)
    rest = tuple(t[:, 11:] if t.ndim > 1 else t for t in args)
    y1, mid = chunked(*first, chunk_size=7, initial_state_BxHxPxN=s0)
    y2, final2 = chunked(*rest, chunk_size=7, initial_state_BxHxPxN=mid)
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y, **TOL[jnp.float32])
    np.testing.assert_allclose(final2, final, **TOL[jnp.float32])

  def test_bad_shapes_say_what_is_wrong(self):
    (x, dt, a, b, c), _ = _inputs(6, H=4, G=2)
    with pytest.raises(ValueError, match="multiple of groups"):
      chunked(x, dt, a, b[:, :, :1].repeat(3, 2), c[:, :, :1].repeat(3, 2), chunk_size=4)
    with pytest.raises(ValueError, match="dt"):
      chunked(x, dt[:, :-1], a, b, c, chunk_size=4)


  def test_temporaries_stay_small(self):
    # The head dim P must never be expanded against both within-chunk axes: the four-operand
    # einsums this replaced needed ~68x (forward) and ~138x (forward+backward) the bytes of x here;
    # two-operand contractions need ~5x and ~15x (XLA CPU, jax 0.10.2).
    B, L, H, P, G, N = 2, 128, 8, 32, 1, 64
    x, dt, a = jnp.zeros((B, L, H, P)), jnp.zeros((B, L, H)), jnp.zeros((H,))
    b = c = jnp.zeros((B, L, G, N))

    def loss(*args):
      y, final = ssd.ssd_chunked(*args, chunk_size=64)
      return jnp.sum(y) + jnp.sum(final)

    for fn, bound in ((lambda *args: ssd.ssd_chunked(*args, chunk_size=64), 16),
                      (jax.grad(loss, argnums=(0, 1, 2, 3, 4)), 32)):
      memory = jax.jit(fn).lower(x, dt, a, b, c).compile().memory_analysis()
      if memory is None:
        pytest.skip("no memory analysis on this backend")
      assert memory.temp_size_in_bytes < bound * x.nbytes, memory.temp_size_in_bytes / x.nbytes

  def test_no_temporary_spans_all_chunks(self):
    # The scan over chunks holds one chunk's C x C decay and scores at a time. All chunks' decay at
    # once is B x L x H x C floats (8 MiB here); the parallel form this replaced needed 46 MB of
    # temporaries for the gradient, the scan 2.1 MB (XLA CPU, jax 0.10.2).
    B, L, H, P, G, N, C = 1, 4096, 4, 8, 1, 8, 128
    x, dt, a = jnp.zeros((B, L, H, P)), jnp.zeros((B, L, H)), jnp.zeros((H,))
    b = c = jnp.zeros((B, L, G, N))
    all_chunks_decay = B * L * H * C * 4
    loss = lambda *args: jnp.sum(ssd.ssd_chunked(*args, chunk_size=C)[0])
    memory = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, dt, a, b, c).compile().memory_analysis()
    if memory is None:
      pytest.skip("no memory analysis on this backend")
    assert memory.temp_size_in_bytes < all_chunks_decay / 3, (memory.temp_size_in_bytes, all_chunks_decay)


class TestCausalConv:

  def test_matches_direct_sum_and_carries_state(self):
    k = jax.random.split(jax.random.key(0), 3)
    x = inputs.normal(k[0], (2, 11, 5))
    w = inputs.normal(k[1], (4, 5))
    bias = inputs.normal(k[2], (5,))
    out, state = causal_conv1d(x, w, bias)
    xp = np.pad(np.asarray(x), ((0, 0), (3, 0), (0, 0)))
    want = sum(np.asarray(w)[j] * xp[:, j:j + 11] for j in range(4)) + np.asarray(bias)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state, x[:, -3:])
    out1, s1 = causal_conv1d(x[:, :6], w, bias)
    out2, s2 = causal_conv1d(x[:, 6:], w, bias, s1)
    np.testing.assert_allclose(jnp.concatenate([out1, out2], 1), out, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s2, state)


class TestDocuments:
  """Document masking (segment ids): the state restarts at each document's first step."""

  @staticmethod
  def _packed():
    seg = jnp.asarray(packed.segment_ids())
    (x, dt, a, b, c), _ = _inputs(11, L=seg.shape[1])
    return (x, dt, a, b, c), seg

  # chunk 16 (~6 s loaded) puts a start on a chunk's first step; chunk 8 covers a chunk with two starts
  @pytest.mark.parametrize("chunk_size", [8, pytest.param(16, marks=pytest.mark.slow)])
  def test_each_document_equals_it_alone_and_the_references(self, chunk_size):
    """Every document's outputs equal the document run alone (float32: the chunks fall elsewhere, so only the
    summation order differs), and the recurrence with the state zeroed at each start (the lax.scan one;
    the naive loop in the slow case); the final state is the last document's alone."""
    args, seg = self._packed()
    y, final = chunked(*args, chunk_size=chunk_size, segment_ids_BxL=seg)
    references = (scan_reference,) + ((naive_reference,) if chunk_size == 16 else ())
    for reference in references:
      y_ref, final_ref = reference(*args, segment_ids_BxL=seg)
      np.testing.assert_allclose(y, y_ref, **TOL[jnp.float32])
      np.testing.assert_allclose(final, final_ref, **TOL[jnp.float32])
    x, dt, a, b, c = args
    for doc in packed.documents():
      y_alone, final_alone = chunked(*(packed.alone(t, doc) for t in (x, dt)), a,
                                     *(packed.alone(t, doc) for t in (b, c)), chunk_size=chunk_size)
      np.testing.assert_allclose(packed.alone(y, doc), y_alone, **TOL[jnp.float32], err_msg=str(doc))
      if doc[2] == seg.shape[1]:
        np.testing.assert_allclose(final[doc[0]], final_alone[0], **TOL[jnp.float32])

  def test_other_documents_change_no_bit(self):
    """New values in the first document of row 0 (huge inputs, other step sizes) leave the other documents'
    outputs bit for bit: nothing of a document enters another's arithmetic."""
    (x, dt, a, b, c), seg = self._packed()
    y, _ = chunked(x, dt, a, b, c, chunk_size=16, segment_ids_BxL=seg)
    first = jnp.arange(seg.shape[1]) < packed.LENGTHS[0][0]
    other = lambda t, v: t.at[0].set(jnp.where(first.reshape(-1, *([1] * (t.ndim - 2))), v, t[0]))
    y2, _ = chunked(other(x, 1e4), other(dt, 3.0), a, other(b, -50.0), other(c, 7.0), chunk_size=16,
                    segment_ids_BxL=seg)
    np.testing.assert_array_equal(y2[0, packed.LENGTHS[0][0]:], y[0, packed.LENGTHS[0][0]:])
    np.testing.assert_array_equal(y2[1], y[1])

  def test_gradients_match_the_references(self):
    args, seg = self._packed()
    cot = inputs.normal(jax.random.key(3), args[0].shape)

    def grads(fn):
      return jax.jit(jax.grad(lambda *p: jnp.sum(cot * fn(*p, segment_ids_BxL=seg)[0]), argnums=range(5)))(*args)

    got = grads(functools.partial(ssd.ssd_chunked, chunk_size=8))
    want = grads(ssd.ssd_scan_reference)
    for name, g, w in zip("x dt a b c".split(), got, want):
      assert np.isfinite(g).all(), name
      scale = float(jnp.abs(w).max())
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale, err_msg=name)
