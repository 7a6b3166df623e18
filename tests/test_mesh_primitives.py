"""The primitives on a 4-device mesh (a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4):

1. A sharded input whose quantized axis holds one block (K = 16 in NVFP4, 32 in MXFP4) or whose shards hold
   less than a block (mxfp4's wgrad quantizes 64 tokens in blocks of 32 over 4 shards of 16): quantize and
   fp4jax.dot on row-sharded x, forward and gradients, equal the unsharded results. The Shardy rule of such an
   axis has no block-count factor of size 1, and a sharding that splits a mesh axis inside a block is read as
   replicated (``fp4jax.primitives.sharding.fit_rule``, ``fp4jax._jax_compat.named_or_replicated``).
2. The kernels inside ``shard_map(check_vma=True)``: the quantize primitive with impl="pallas" (the interpreter
   on CPU) equals the XLA path bit for bit, and a kernel called directly lowers for CUDA (its outputs vary over
   the manual axes its operands vary over: ``fp4jax._pallas_compat.varying_like``).
3. The grouped dot inside ``shard_map`` (an expert-parallel MoE's experts): tetrajet2's wgrad, a ``lax.scan`` over
   128-row chunks, starts from a carry that varies over the manual axes its chunks vary over
   (``fp4jax._native_compat.vary_like``), and each device's experts equal the unsharded result.
4. A kernel that does not lower for a layout runs as its XLA twin, with a warning (``fp4jax.primitives.pair``).
5. A contraction split over the mesh whose result is wanted split over the same axis (a weight gradient over token
   shards): its float32 partial products are reduce-scattered (``fp4jax.primitives.pair``), not all-reduced; a
   result split along its last dimension (a weight sharded along N) as the GEMM's transposed partials along their
   first, the dimension a reduce-scatter wants major (``OpSpec.transposed``).
6. fp4jax.dot on the native path with fp4jax's Mosaic GEMM (its twin on the CPU), row-sharded x: the three GEMMs
   are the partitioned op, forward and gradients equal the unsharded results; the wgrad's partials keep the GEMM's
   padded columns through the reduce-scatter, and only the shard is sliced (``OpSpec.padded``).

By default one layout of each of 1, 2, 3 and 5 (nvfp4 with K = 16, a weight sharded as its contraction); the slow
case adds the other layouts of 1 and 5 (N = 16, mxfp4; w sharded along N) and 6.
"""
import json
import os
import subprocess
import sys

import pytest

import inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DRIVER = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax import grouped
from fp4jax.kernels import quantize_1d
from fp4jax.primitives.quantize import quantize_last

mesh = jax.make_mesh((4,), ("x",))
rows = lambda a: jax.device_put(a, NamedSharding(mesh, P("x", None)))
out = {{}}

def same(a, b):
  return all(bool(np.array_equal(np.asarray(u), np.asarray(v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

def close(a, b):   # float32 sums of sharded partials (psum) run in another order: 1e-5 of the largest magnitude
  return all(bool(np.max(np.abs(np.asarray(u) - np.asarray(v))) <= 1e-5 * np.max(np.abs(np.asarray(v))))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

x = jax.random.normal(jax.random.key(0), (64, 16))
q = lambda a: jax.tree.leaves(fp4jax.quantize(a, "nvfp4"))
out["quantize nvfp4 (64, 16) rows"] = same(jax.jit(q)(rows(x)), jax.jit(q)(x))
for recipe, k, n in (("nvfp4", 16, 64),) + ((("nvfp4", 64, 16), ("mxfp4", 16, 64)) if {slow!r} else ()):
  x = jax.random.normal(jax.random.key(1), (64, k))
  w = jax.random.normal(jax.random.key(2), (k, n))
  f = lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(3))
  g = jax.jit(lambda x, w: (f(x, w), jax.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)))
  out[f"dot {{recipe}} K={{k}} N={{n}} rows, forward and gradients"] = close(g(rows(x), w), g(x, w))


e = jax.make_mesh((4,), ("e",))
xe = jax.device_put(jax.random.normal(jax.random.key(4), (4, 32, 64)), NamedSharding(e, P("e")))
body = lambda impl: lambda x: quantize_last(x[0], jnp.max(jnp.abs(x)), fmt="nvfp4", impl=impl)
run = lambda impl: jax.jit(jax.shard_map(body(impl), mesh=e, in_specs=P("e"), out_specs=P("e")))(xe)
out["shard_map quantize nvfp4 pallas == xla"] = same(run("pallas"), run("xla"))
direct = jax.shard_map(lambda x: quantize_1d.quantize_1d(x, jnp.max(jnp.abs(x))), mesh=e, in_specs=P("e"),
                       out_specs=P("e"))
spec = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(e, P("e")))
out["shard_map kernel lowers for cuda"] = plc.TRITON_CUSTOM_CALL in plc.export_for_cuda(direct, spec)

# tetrajet2's grouped wgrad scans 128-row chunks into a zero carry: inside shard_map each device's expert equals the
# unsharded grouped_dot's (each expert its own key), forward and gradients.
xg = jax.random.normal(jax.random.key(5), (4 * 128, 32))
wg = jax.random.normal(jax.random.key(6), (4, 32, 32))
keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(4))
def experts(x, w, k):
  f = lambda x, w: grouped.grouped_dot(x, w, jnp.full((w.shape[0],), 128), recipe="tetrajet2", key=k)
  return f(x, w), jax.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
put = lambda a: jax.device_put(a, NamedSharding(e, P("e")))
sharded = jax.jit(jax.shard_map(experts, mesh=e, in_specs=P("e"), out_specs=P("e")))(put(xg), put(wg), put(keys))
out["shard_map grouped_dot tetrajet2, forward and gradients"] = close(sharded, jax.jit(experts)(xg, wg, keys))
# a contraction split over the mesh (a wgrad over token shards) whose result is wanted split over the same axis
# (sharded as its weight): the float32 partial products are reduce-scattered, not all-reduced and sliced
import re
from fp4jax import api
auto = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
cols = lambda a: jax.device_put(a, NamedSharding(auto, P(None, "x")))
def wgrad_like(a, b):
  y = fp4jax.scaled_matmul(api.quantize(a, "nvfp4"), api.quantize(b, "nvfp4"), out_dtype=jnp.float32)
  return jax.lax.with_sharding_constraint(y, NamedSharding(auto, P("x", None)))
a, b = jax.random.normal(jax.random.key(10), (64, 256)), jax.random.normal(jax.random.key(11), (32, 256))
with jax.sharding.set_mesh(auto):
  hlo = jax.jit(wgrad_like).lower(cols(a), cols(b)).compile().as_text()
  got = jax.jit(wgrad_like)(cols(a), cols(b))
out["contraction over the shards reduce-scattered"] = (
    re.findall(r"= (\S+) reduce-scatter(?:-start)?\(", hlo) == ["f32[16,32]{{1,0}}"]
    and not re.findall(r"= f32\[64,32\]\S* all-reduce", hlo) and close(got, jax.jit(wgrad_like)(a, b)))
if {slow!r}:   # the other layouts of the wgrad and the Mosaic GEMM's partitioned op: the slow part
  # fp4jax.dot's weight gradient with w (K, N) sharded along N and x along the tokens: the wgrad GEMM's partials are
  # computed transposed, dwᵀ (N, K), and reduce-scattered along N, their first dimension (no transpose of the whole
  # partial on a GPU, whose reduce-scatter wants its dimension major)
  x, w = jax.random.normal(jax.random.key(12), (64, 64)), jax.random.normal(jax.random.key(13), (64, 128))
  dw = lambda x, w: jax.grad(lambda w: (fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(3)) ** 2).sum())(w)
  by_cols = NamedSharding(auto, P(None, "x"))
  xs, ws = jax.device_put(x, NamedSharding(auto, P("x", None))), jax.device_put(w, by_cols)
  with jax.sharding.set_mesh(auto):
    hlo = jax.jit(dw, out_shardings=by_cols).lower(xs, ws).compile().as_text()
    got = jax.jit(dw, out_shardings=by_cols)(xs, ws)
  scattered = re.findall(r"= (f32\[[\d,]+\])\S* reduce-scatter(?:-start)?\(.*?dimensions=\{{(\d+)\}}", hlo)
  out["wgrad of a weight sharded along N reduce-scattered along N of dwᵀ"] = (
      scattered == [("f32[32,64]", "0")] and close(got, jax.jit(dw)(x, w)))

  # fp4jax's Mosaic GEMM (its twin on the CPU) as the native path's GEMM: a partitioned op, so row-sharded x stays
  # sharded through fprop, dgrad and wgrad (a K-sharded contraction: float32 partials summed across the shards).
  import os
  os.environ.update(FP4JAX_DEFAULT_IMPL="native", FP4JAX_NATIVE_KERNEL="mosaic")
  x = jax.random.normal(jax.random.key(8), (64, 64))
  w = jax.random.normal(jax.random.key(9), (64, 32))
  f = lambda x, w: fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(3))
  g = jax.jit(lambda x, w: (f(x, w), jax.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)))
  out["dot nvfp4 on the Mosaic GEMM op, rows, forward and gradients"] = (
      str(jax.make_jaxpr(g)(x, w)).count("impl=mosaic") == 4 and close(g(rows(x), w), g(x, w)))   # 2 fprops
  # its wgrad over token shards keeps the GEMM's padded columns (N = 32 -> 256, zeros) through the reduce-scatter and
  # slices only the shard (``OpSpec.padded``), for w sharded along K and, computed transposed (dwᵀ: K = 64 -> 256),
  # along N
  xs = jax.device_put(x, NamedSharding(auto, P("x", None)))
  for name, spec, want in (("K", P("x", None), ("f32[16,256]", "0")), ("N", P(None, "x"), ("f32[8,256]", "0"))):
    by = NamedSharding(auto, spec)
    with jax.sharding.set_mesh(auto):
      hlo = jax.jit(dw, out_shardings=by).lower(xs, jax.device_put(w, by)).compile().as_text()
      got = jax.jit(dw, out_shardings=by)(xs, jax.device_put(w, by))
    scattered = re.findall(r"= (f32\[[\d,]+\])\S* reduce-scatter(?:-start)?\(.*?dimensions=\{{(\d+)\}}", hlo)
    out[f"Mosaic wgrad, w sharded along {{name}}: padded partials reduce-scattered"] = (
        scattered == [want] and close(got, jax.jit(dw)(x, w)))
print("RESULT " + json.dumps(out))
"""


# By default one layout per check (~25 s); slow: every layout of the dot and the wgrad, and the Mosaic GEMM's op
# (~75 s: 12 compiles and runs on 4 devices).
@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "every_layout"])
def test_sharded_one_block_axes_and_kernels_in_shard_map(slow):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  env.pop("FP4JAX_DEFAULT_IMPL", None)
  p = subprocess.run([sys.executable, "-c", _DRIVER.format(root=ROOT, slow=slow)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
  results = json.loads(line[len("RESULT "):])
  assert len(results) == (12 if slow else 6)
  assert all(results.values()), {k: v for k, v in results.items() if not v}


def test_a_kernel_that_does_not_lower_falls_back_to_its_twin_with_a_warning(monkeypatch):
  """A kernel that fails to lower for a layout (here: made to raise) runs as its XLA twin, with a warning that
  names the kernel and the mesh, instead of stopping the program at start-up."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  import numpy as np   # pylint: disable=import-outside-toplevel
  from fp4jax.kernels import quantize_1d   # pylint: disable=import-outside-toplevel
  from fp4jax.primitives.quantize import quantize_last   # pylint: disable=import-outside-toplevel

  def broken(*args, **kwargs):
    raise NotImplementedError("no tiling for this shape")

  monkeypatch.setattr(quantize_1d, "quantize_1d", broken)
  x = inputs.normal(jax.random.key(0), (48, 80))
  run = lambda impl: jax.jit(lambda x: quantize_last(x, jnp.max(jnp.abs(x)), fmt="nvfp4", impl=impl))(x)
  with pytest.warns(RuntimeWarning, match=r"the quantize kernel \(impl='pallas', fmt='nvfp4'\) did not lower on "
                                          r"one device \(NotImplementedError: no tiling"):
    got = run("pallas")
  for a, b in zip(got, run("xla")):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rules_drop_a_block_count_of_one():
  """Shardy refuses a factor of size 1 in a compound dimension: the rule of a one-block axis names the block
  alone, and keeps a size only for a factor still in a compound."""
  from fp4jax.primitives import sharding as shd   # pylint: disable=import-outside-toplevel
  rule, sizes = shd.quantize_rule(2, 0, False, block=16, tile=None)
  assert (rule, sizes) == ("d0 (k i),  -> d0 (k j), d0 k", {"i": 16, "j": 8})
  assert shd.fit_rule(rule, sizes, [(64, 16), (), (64, 8), (64, 1)]) == ("d0 i,  -> d0 j, d0 k", {})
  assert shd.fit_rule(rule, sizes, [(64, 32), (), (64, 16), (64, 2)]) == (rule, sizes)
  rule, sizes = shd.scaled_matmul_rule(2, block=16, a_tile=None, b_tile=16)   # N = 16: one 16x16 tile
  shapes = [(64, 8), (64, 1), (), (16, 8), (16, 1), (), (64, 16)]
  assert shd.fit_rule(rule, sizes, shapes) == ("m j, m k, , rb j, n k,  -> m rb", {})
