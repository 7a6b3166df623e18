"""The primitives under an 8-device CPU mesh: results equal single-device results, and a row-sharded
quantize compiles without gathering the activation (only the scalar amax is all-reduced).

Runs in a subprocess because the device count must be set before jax initializes.
"""
import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(r"""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import fp4jax
    from fp4jax.api import quantize_rht_transposed, scaled_matmul

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    raw = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)
    same = lambda q, r: all(np.array_equal(raw(u), raw(v)) for u, v in
                            zip(jax.tree.leaves(q), jax.tree.leaves(r)))
    def hlo(f, *args):
      return f.lower(*args).compile().as_text()
    out = {"devices": len(jax.devices())}
    x = jnp.asarray(rng.standard_normal((256, 512)) * np.exp(rng.uniform(-3, 3, (256, 1))), jnp.bfloat16)

    for impl in ("xla", "pallas"):
      ref = fp4jax.quantize(x, "nvfp4", impl="xla")
      f = jax.jit(lambda x: fp4jax.quantize(x, "nvfp4", impl=impl))
      for name, spec in (("rows", ("data", None)), ("rows_cols", ("data", "model"))):
        xs = put(x, *spec)
        text = hlo(f, xs)
        q = f(xs)
        out[f"quantize_{name}_{impl}"] = dict(
            equal=same(q, ref), all_gather="all-gather" in text, all_reduce="all-reduce" in text,
            data_spec=str(q.data.sharding.spec))

    xs = put(x, "data", "model")
    bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint8)
    for name, fn in (
        ("sr_mxfp4", lambda x, b: fp4jax.quantize(x, "mxfp4", rounding="stochastic", bits=b, impl="pallas")),
        ("tile", lambda x, b: fp4jax.quantize(x, "nvfp4", tile=(16, 16), impl="pallas")),
        ("rht_t", lambda x, b: quantize_rht_transposed(x, "nvfp4", rounding="stochastic", bits=b.T, impl="pallas")),
    ):
      f = jax.jit(fn)
      bs = put(bits, "data", "model")
      out[name] = dict(equal=same(f(xs, bs), jax.jit(fn)(x, bits)),
                       all_gather="all-gather" in hlo(f, xs, bs))

    # vmapped (fp4jax.grouped's chunks): the leading axis keeps x's sharding, each chunk's amax its own
    xb = jnp.asarray(rng.standard_normal((4, 64, 512)), jnp.bfloat16)
    fb = jax.jit(jax.vmap(lambda x: quantize_rht_transposed(x, "nvfp4", impl="pallas")))
    xbs = put(xb, "data", None, "model")
    out["rht_t_vmap"] = dict(equal=same(fb(xbs), fb(xb)), all_gather="all-gather" in hlo(fb, xbs))

    # SR bits hashed in the kernel from the key: each shard's counters are global (KeyedBits' rows and
    # cols shard with x), so the sharded kernel equals the single-device XLA path.
    key = jax.random.key(3)
    keyed = lambda x, k, impl: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=k, impl=impl)
    f = jax.jit(lambda x, k: keyed(x, k, "pallas"))
    out["sr_key"] = dict(equal=same(f(xs, key), jax.jit(lambda x, k: keyed(x, k, "xla"))(x, key)),
                         all_gather="all-gather" in hlo(f, xs, key))
    # The packed layout (one hash per 8 columns): each shard loads its global column counters, cols[::8].
    packed = lambda x, k, impl: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=k, impl=impl,
                                                sr_bits="packed")
    f = jax.jit(lambda x, k: packed(x, k, "pallas"))
    out["sr_packed"] = dict(equal=same(f(xs, key), jax.jit(lambda x, k: packed(x, k, "xla"))(x, key)),
                            all_gather="all-gather" in hlo(f, xs, key))

    q = fp4jax.quantize(x, "nvfp4", impl="xla")
    f = jax.jit(lambda q: fp4jax.dequantize(q, impl="pallas"))
    qs = jax.tree.map(lambda a: put(a, "data", "model") if a.ndim == 2 else a, q)
    out["dequantize"] = dict(equal=bool(jnp.array_equal(f(qs), fp4jax.dequantize(q))),
                             all_gather="all-gather" in hlo(f, qs))

    a = fp4jax.quantize(jnp.asarray(rng.standard_normal((128, 256)), jnp.float32), "nvfp4", impl="xla")
    w = fp4jax.quantize(jnp.asarray(rng.standard_normal((64, 256)), jnp.float32), "nvfp4",
                        tile=(16, 16), impl="xla")
    ref = np.asarray(scaled_matmul(a, w, impl="xla"))
    for name, sa, sw in (("m", ("data", None), (None, None)), ("m_n", ("data", None), ("model", None)),
                         ("k", (None, "model"), (None, "model")), ("m_k", ("data", "model"), (None, "model"))):
      f = jax.jit(lambda a, w: scaled_matmul(a, w, impl="pallas"))
      a_s = jax.tree.map(lambda t: put(t, *sa) if t.ndim == 2 else t, a)
      w_s = jax.tree.map(lambda t: put(t, *sw) if t.ndim == 2 else t, w)
      got = np.asarray(f(a_s, w_s))
      text = hlo(f, a_s, w_s)
      out[f"matmul_{name}"] = dict(rel_err=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                                   all_gather="all-gather" in text, all_reduce="all-reduce" in text)
    print("RESULT" + json.dumps(out))
""")


def _run_script():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):]


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
  """The script's results, run once per test session: pytest-xdist's workers (each would run a
  module-scoped fixture itself) share them through a file in the session's temporary root."""
  if "PYTEST_XDIST_WORKER" not in os.environ:
    return json.loads(_run_script())
  root = tmp_path_factory.getbasetemp().parent   # this session's, shared by its workers
  path = root / "sharding_mesh_results.json"
  with open(root / "sharding_mesh_results.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      path.write_text(_run_script(), encoding="utf-8")
  return json.loads(path.read_text(encoding="utf-8"))


def test_eight_devices(mesh_results):
  assert mesh_results["devices"] == 8


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("layout", ["rows", "rows_cols"])
def test_row_sharded_quantize_is_local(mesh_results, layout, impl):
  r = mesh_results[f"quantize_{layout}_{impl}"]
  assert r["equal"], "sharded quantize differs from the single-device result"
  assert not r["all_gather"], "the activation was gathered"
  assert r["all_reduce"], "expected the scalar amax all-reduce"
  assert "data" in r["data_spec"]


@pytest.mark.parametrize("name", ["sr_mxfp4", "tile", "rht_t", "rht_t_vmap", "sr_key", "sr_packed", "dequantize"])
def test_other_ops_stay_sharded(mesh_results, name):
  r = mesh_results[name]
  assert r["equal"] and not r["all_gather"]


@pytest.mark.parametrize("name,psum", [("m", False), ("m_n", False), ("k", True), ("m_k", True)])
def test_scaled_matmul_follows_dot_sharding(mesh_results, name, psum):
  r = mesh_results[f"matmul_{name}"]
  assert r["rel_err"] <= 1e-6
  assert not r["all_gather"]
  assert r["all_reduce"] == psum   # a sharded contraction reduces partial sums, nothing else does


_RHT_KEYED_SCRIPT = textwrap.dedent(r"""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from fp4jax.api import quantize_rht_transposed

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 512)), jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    key = jax.random.key(3)
    fn = lambda x, k, impl: quantize_rht_transposed(x, "nvfp4", rounding="stochastic", key=k, impl=impl)
    f = jax.jit(lambda x, k: fn(x, k, "pallas"))
    got, want = f(xs, key), jax.jit(lambda x, k: fn(x, k, "xla"))(x, key)
    raw = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)
    equal = all(np.array_equal(raw(u), raw(v)) for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print("RESULT" + json.dumps(dict(equal=equal,
                                     all_gather="all-gather" in f.lower(xs, key).compile().as_text())))
""")


@pytest.mark.slow   # the keyed 1d quantize above is the default representative
def test_keyed_rht_t_stays_sharded():
  """The RHT-transposed quantize with its SR bits hashed in the kernel, x sharded over (tokens, channels):
  KeyedBits' rows (C, 4) and cols (T, 2) shard with the output's axes, so the global counters match the
  single-device XLA path, without gathering x."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _RHT_KEYED_SCRIPT], capture_output=True, text=True, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  r = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
  assert r["equal"] and not r["all_gather"]
