"""The XLA path's tiled grouped GEMM (fp4jax.tiles.rows / tokens) against its twin, lax.ragged_dot(_general).

- Integer data (every product and every partial sum exact in float32, so any summation order gives the same
  float32): the tiled form equals the ragged one bit for bit, forward, both gradients and the wgrad GEMM, for
  three tilings, with empty groups and non-zero rows past the last group (which give zero output and zero
  gradient).
- Normal data: the two sum the same float32 products in another order (a batched dot per tile against a
  ragged dot; a group's tile partials added after), so they agree within the float32 summation bound
  K·2⁻²³·Σ|a||b| per element, never pinned.
- grouped_dot (nvfp4) traced for a GPU target takes the tiled GEMMs; its y, dx, dw equal the CPU's
  ragged ones within the same bound (the quantized operands are identical: the bf16 products are exact).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import gemm, grouped, tiles
from test_moe_ep_trace import _walk

S, E, K, N = 640, 8, 96, 48
TILINGS = {"tiles of 200": tiles.Tiling(one_tile_groups=0, rows=200), "tiles of 64": tiles.Tiling(one_tile_groups=0, rows=64),
           "one tile": tiles.Tiling(one_tile_groups=1 << 30)}


def _sizes(seed, total=S - 40, n_groups=E, multiple=1):
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(total // multiple, np.ones(n_groups) / n_groups) * multiple
  sizes[1] = 0
  sizes[-1] = 0
  return jnp.asarray(sizes, jnp.int32)


def _ints(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(-4, 5, shape), jnp.float32)


def _both(a, b, dy, sizes, tiling):
  ragged = lambda a, b: gemm.ragged_rows(a, b, sizes)   # the CPU: lax.ragged_dot
  tiled = lambda a, b: tiles.rows(a, b, sizes, tiling=tiling)
  out = {}
  for name, f in (("ragged", ragged), ("tiled", tiled)):
    y, vjp = jax.vjp(f, a, b)
    out[name] = (y, *vjp(dy))
  out["ragged"] += (gemm.ragged_tokens(a, dy, sizes),)
  out["tiled"] += (tiles.tokens(a, dy, sizes, tiling=tiling),)
  return out


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_tiled_equals_ragged_on_exact_data(tiling):
  sizes = _sizes(0)
  a, b, dy = _ints(1, (S, K)), _ints(2, (E, K, N)), _ints(3, (S, N))
  out = _both(a, b, dy, sizes, TILINGS[tiling])
  for name, r, t in zip(("y", "da", "db", "wgrad"), out["ragged"], out["tiled"]):
    assert r.dtype == t.dtype and r.shape == t.shape, name
    np.testing.assert_array_equal(np.asarray(t), np.asarray(r), err_msg=name)
  y, da = out["tiled"][:2]
  end = int(sizes.sum())
  assert not np.asarray(y[end:]).any() and not np.asarray(da[end:]).any()   # rows past the last group
  assert not np.asarray(out["tiled"][2][1]).any()                           # an empty group's dw


def test_tiled_within_summation_bound_bf16():
  sizes = _sizes(4)
  rng = np.random.default_rng(5)
  a = jnp.asarray(rng.standard_normal((S, K)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((E, K, N)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((S, N)), jnp.float32)
  out = _both(a, b, dy, sizes, TILINGS["tiles of 64"])
  bound = lambda x, y, k: k * 2.0 ** -23 * np.asarray(x)
  abs_y = gemm.ragged_rows(jnp.abs(a), jnp.abs(b), sizes)
  np.testing.assert_array_less(np.abs(np.asarray(out["tiled"][0] - out["ragged"][0])), bound(abs_y, None, K) + 1e-30)
  abs_w = gemm.ragged_tokens(jnp.abs(a).astype(jnp.float32), jnp.abs(dy), sizes)
  np.testing.assert_array_less(np.abs(np.asarray(out["tiled"][3] - out["ragged"][3])), bound(abs_w, None, S) + 1e-30)
  # the gradients are rounded once to their operand's dtype (bf16), as the ragged dot's transpose rounds them
  assert out["tiled"][1].dtype == out["tiled"][2].dtype == jnp.bfloat16


def test_bf16_result_is_the_float32_one_rounded_with_bf16_backward_gemms():
  """rows(out_dtype=bf16) is the float32 result rounded once, and its gradients equal those of the float32
  result cast to bf16 (the cast's cotangent is the same values in float32), on exact data; its backward's
  GEMMs read bf16 tiles of the bf16 cotangent (no float32 operand)."""
  sizes = _sizes(0)
  bf = lambda t: t.astype(jnp.bfloat16)
  a, b, dy = bf(_ints(1, (S, K))), bf(_ints(2, (E, K, N))), bf(_ints(3, (S, N)))
  tiling = TILINGS["tiles of 64"]
  cast = lambda a, b: tiles.rows(a, b, sizes, tiling=tiling).astype(jnp.bfloat16)
  direct = lambda a, b: tiles.rows(a, b, sizes, tiling=tiling, out_dtype=jnp.bfloat16)
  results = {}
  for name, f in (("cast", cast), ("direct", direct)):
    y, vjp = jax.vjp(f, a, b)
    results[name] = (y, *vjp(dy))
  for name, want, got in zip(("y", "da", "db"), results["cast"], results["direct"]):
    assert got.dtype == want.dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
  assert np.asarray(results["direct"][0], np.float32).any()
  jaxpr = jax.make_jaxpr(lambda a, b, g: jax.vjp(direct, a, b)[1](g))(a, b, dy)
  dots = [e for e in jaxpr.jaxpr.eqns for e in _walk(e) if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def _ragged_primitives(f, *args):
  return {e.primitive.name for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if "ragged" in e.primitive.name}


def test_tiled_for_a_gpu_target_ragged_elsewhere():
  """The comparisons above hold the CPU's ragged dot (the twin) against the tiles; a GPU target's trace
  has the tiles."""
  sizes = _sizes(0)
  a, b, dy = _ints(1, (S, K)), _ints(2, (E, K, N)), _ints(3, (S, N))
  rows = lambda: lambda a, b: gemm.ragged_rows(a, b, sizes)   # a new function per trace: jax caches traces
  tokens = lambda: lambda a, dy: gemm.ragged_tokens(a, dy, sizes)
  assert not gemm.on_gpu_target()   # the CPU
  assert _ragged_primitives(rows(), a, b) == {"ragged_dot_general"} == _ragged_primitives(tokens(), a, dy)
  with fp4jax.target.use(fp4jax.target.Target("gpu", "NVIDIA H200", (9, 0))):
    assert gemm.on_gpu_target()
    assert not _ragged_primitives(rows(), a, b) and not _ragged_primitives(tokens(), a, dy)


@pytest.mark.slow   # ~1.5 min on the 2-core VM: three traces of nvfp4 grouped_dot and its vjp
def test_grouped_dot_tiled_for_gpu_within_summation_bound():
  """nvfp4's grouped_dot (XLA path) traced for a GPU without CUDA capability (so nothing else switches:
  no Pallas, no native GEMM) takes the tiled GEMMs; the same quantized operands as on the CPU."""
  recipe = fp4jax.recipes.get("nvfp4")
  a_g = grouped.alignment(recipe)
  s, k, n = 1024, 128, 64
  sizes = _sizes(6, total=s - 3 * a_g, multiple=a_g)
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((s, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((E, k, n)) * 0.1, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((s, n)), jnp.float32)
  key = jax.random.key(3)

  def run():
    f = lambda x, w: grouped.grouped_dot(x, w, sizes, recipe=recipe, key=key)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy)), jax.make_jaxpr(f)(x, w)
  ref, ref_jaxpr = run()
  with fp4jax.target.use(fp4jax.target.Target("gpu", "a GPU without CUDA capability")):
    got, got_jaxpr = run()
  assert "ragged_dot" in str(ref_jaxpr) and "ragged_dot" not in str(got_jaxpr)
  # Σ|â||b̂| <= terms · max|â| · max|b̂|, and the quantized values are at most 2x the input's max (the
  # 16-point RHT of the wgrad operands at most 4x): a bound of terms² · 2⁻²³ · 8 · max|a| · max|b|.
  big = lambda t: float(np.abs(np.asarray(t)).max())
  for name, r, g, terms, pair in zip(("y", "dx", "dw"), ref, got, (k, n, s), ((x, w), (dy, w), (x, dy))):
    r, g = np.asarray(r), np.asarray(g)
    tol = terms * terms * 2.0 ** -23 * 8 * big(pair[0]) * big(pair[1])
    assert np.abs(r - g).max() <= tol, (name, np.abs(r - g).max(), tol)
