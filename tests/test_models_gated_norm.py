"""The gated RMSNorm kernels (models/gated_norm.py) in the Pallas interpreter against their twin
(``gated_norm_reference``, the mixer's former ops, differentiated by jax); their Triton lowering; the switch.

The tolerance: the kernels compute every value in float32 as the twin does, but sum a row's g² (and, in the
backward, dh·g, and dw over rows) in another order, so a float32 result may differ from the twin's by
float32 rounding: F32_TOL, 1e-5 of the tensor's largest magnitude (about 170 float32 ulps there; a wrong term
is orders larger). A result rounded to bf16 (the output, bf16 inputs' gradients) may land on the other side of
a bf16 rounding boundary: one bf16 ulp, 2^-7 relative, on top.
"""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
from fp4jax import pallas_compat as plc
from fp4jax import dispatch
from models import gated_norm

F32_TOL = 1e-5
BF16_ULP = 2.0 ** -7
EPS = 1e-5
# small tiles, so that small shapes cover several programs, several blocks per backward program and padding
TILES = gated_norm.GatedNormTiles(elements=256, bwd_blocks=2)


def _inputs(seed, B, L, G, RP, dtype):
  k = jax.random.split(jax.random.key(seed), 4)
  y = (2.0 * inputs.normal(k[0], (B, L, G, RP))).astype(dtype)
  z = (2.0 * inputs.normal(k[1], (B, L, G, RP))).astype(jnp.bfloat16 if dtype == jnp.float32 else dtype)
  w = 1.0 + 0.2 * inputs.normal(k[2], (G, RP))
  dout = inputs.normal(k[3], (B, L, G, RP))
  return y, z, w, dout


def _run(impl, y, z, w, dout, out_dtype):
  """out and the gradients of y, z and the scale for the cotangent dout."""
  f = functools.partial(gated_norm.gated_norm, eps=EPS, out_dtype=out_dtype, impl=impl, tiles=TILES,
                        interpret=True if impl == "pallas" else None)
  out, vjp = jax.vjp(f, y, z, w)
  return (out, *vjp(dout.astype(out_dtype)))


def _compare(case, out_dtype=jnp.bfloat16):
  B, L, G, RP, dtype = case
  args = _inputs(0, B, L, G, RP, dtype)
  got = jax.jit(functools.partial(_run, "pallas", out_dtype=out_dtype))(*args)
  want = jax.jit(functools.partial(_run, "xla", out_dtype=out_dtype))(*args)
  for name, g, w, arg in zip(("out", "dy", "dz", "dscale"), got, want, (None, *args[:3])):
    assert arg is None or g.dtype == arg.dtype, name   # gradients in the inputs' dtypes
    assert g.dtype == w.dtype and g.shape == w.shape, name
    g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
    rtol = BF16_ULP if g.dtype == jnp.bfloat16 else 0.0   # one bf16 rounding apart at most
    np.testing.assert_allclose(g32, w32, rtol=rtol, atol=F32_TOL * float(np.max(np.abs(w32))), err_msg=name)


# (B, L, G, RP, y's dtype). T = B L = 63 is no multiple of the tiles (padded to 64: blocks of 8 rows, 16 rows
# and two blocks per backward program); RP = 24 is read as two pieces, 16 + 8.
DEFAULT_CASE = (7, 9, 2, 24, jnp.float32)
SLOW_CASES = [(2, 40, 2, 1280, jnp.bfloat16),   # the 12B's row (1024 + 256), bf16 y and z
              (2, 64, 4, 64, jnp.float32),      # one power-of-two piece, G = 4, no padding
              (1, 7, 1, 40, jnp.bfloat16)]      # one group, T = 7 < a block


class TestAgainstTheTwin:

  def test_forward_and_gradients(self):
    _compare(DEFAULT_CASE)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"B{c[0]}_L{c[1]}_G{c[2]}_RP{c[3]}_{c[4].__name__}")
  def test_more_shapes_and_dtypes(self, case):
    _compare(case)

  @pytest.mark.slow
  def test_float32_output(self):
    _compare(DEFAULT_CASE, out_dtype=jnp.float32)

  def test_the_tiles_are_fit_without_padding_where_they_divide(self):
    assert gated_norm._fit_rows(8192, 1280, gated_norm.DEFAULT_TILES) == (4, 8192)   # the 12B per GPU: no copy
    assert gated_norm._fit_rows(63, 24, TILES) == (8, 64)   # no divisor near 8: padded by at most 1/8
    assert gated_norm._pieces(1280) == ((0, 1024), (1024, 256))
    assert gated_norm._pieces(24) == ((0, 16), (16, 8))


class TestSwitch:

  def test_the_default_is_the_twin_until_a_device_run(self):
    assert gated_norm.VERIFIED is None
    assert gated_norm.default_impl(platform="cuda") == "xla"
    assert not gated_norm.can_use_pallas(platform="cpu")
    y, z, w, _ = _inputs(1, 1, 4, 2, 16, jnp.float32)
    np.testing.assert_array_equal(
        gated_norm.gated_norm(y, z, w, eps=EPS, out_dtype=jnp.bfloat16, impl="auto"),
        gated_norm.gated_norm_reference(y, z, w, eps=EPS, out_dtype=jnp.bfloat16))

  def test_forced_pallas_is_chosen_where_it_can_run(self, monkeypatch):
    monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
    assert gated_norm.default_impl(platform="cuda") == ("pallas" if plc.has_triton() else "xla")
    assert gated_norm.default_impl(platform="cpu") == "xla"

  def test_bad_impls_and_shapes_say_what_to_do(self):
    y, z, w, _ = _inputs(2, 1, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="impl='fast'"):
      gated_norm.gated_norm(y, z, w, eps=EPS, out_dtype=jnp.float32, impl="fast")
    with pytest.raises(ValueError, match=r"must be \(B, L, G, RP\)"):
      gated_norm.gated_norm(y, z, w[:1], eps=EPS, out_dtype=jnp.float32, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="gate_norm_impl"):
      from models.config import ModelConfig   # pylint: disable=import-outside-toplevel
      ModelConfig(gate_norm_impl="fast")


@pytest.mark.skipif(not plc.has_triton(), reason="jax without the Pallas Triton backend")
def test_forward_and_backward_lower_to_triton_for_cuda():
  """Two kernels, the forward and the backward, at the 12B's row width and a token count no tile divides."""
  S = jax.ShapeDtypeStruct
  B, L, G, RP = 1, 200, 2, 1280

  def fn(y, z, w, dout):
    out, vjp = jax.vjp(lambda y, z, w: gated_norm.gated_norm(y, z, w, eps=EPS, out_dtype=jnp.bfloat16,
                                                             impl="pallas"), y, z, w)
    return (out, *vjp(dout))

  text = plc.export_for_cuda(fn, S((B, L, G, RP), jnp.float32), S((B, L, G, RP), jnp.bfloat16),
                             S((G, RP), jnp.float32), S((B, L, G, RP), jnp.bfloat16))
  assert text.count(plc.TRITON_CUSTOM_CALL) == 2
  for name in gated_norm.KERNEL_NAMES:
    assert f"models_{name}_ieee_" in text, name


@pytest.mark.slow
def test_the_mixer_with_the_kernels_matches_the_twin():
  """ModelConfig(gate_norm_impl="pallas") in the Mamba-2 mixer (the interpreter on the CPU), G = 2: the loss
  and every parameter gradient equal the twin's within the float32 tolerance, widened to 1e-4 relative for
  the bf16 rounding of the mixer's output (a few elements one bf16 ulp apart)."""
  import dataclasses   # pylint: disable=import-outside-toplevel
  from models import presets   # pylint: disable=import-outside-toplevel
  from models.mamba2 import Mamba2   # pylint: disable=import-outside-toplevel
  cfg = presets.get_model_config("tiny", n_groups=2)
  u = inputs.normal(jax.random.key(0), (2, 21, cfg.d_model))
  params = Mamba2(cfg).init(jax.random.key(1), u)
  outs = {}
  for impl in ("xla", "pallas"):
    m = Mamba2(dataclasses.replace(cfg, gate_norm_impl=impl))
    loss = lambda p, m=m: jnp.sum(m.apply(p, u).astype(jnp.float32) ** 2)
    outs[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (v_x, g_x), (v_k, g_k) = outs["xla"], outs["pallas"]
  np.testing.assert_allclose(v_k, v_x, rtol=1e-4)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_k), jax.tree.leaves(g_x)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=F32_TOL * float(jnp.abs(b).max()),
                               err_msg=jax.tree_util.keystr(path))


_SHARDED = """
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from models import gated_norm
from training import sharding as sh

mesh = jax.make_mesh(sh.mesh_shape(dict(data=1, fsdp=2, tensor=2), 4), sh.MESH_AXES,
                     axis_types=(jax.sharding.AxisType.Auto,) * len(sh.MESH_AXES))
B, L, G, RP = 2, 9, 2, 24
k = jax.random.split(jax.random.key(0), 4)
y, z = jax.random.normal(k[0], (B, L, G, RP)), jax.random.normal(k[1], (B, L, G, RP))
w, cot = 1 + 0.2 * jax.random.normal(k[2], (G, RP)), jax.random.normal(k[3], (B, L, G, RP))

def grads(impl):
  f = lambda y, z, w: jnp.sum(gated_norm.gated_norm(y, z, w, eps=1e-5, out_dtype=jnp.float32, impl=impl,
                                                    interpret=True) * cot)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

ref = grads("xla")(y, z, w)
put = lambda t, *spec: jax.device_put(t, NamedSharding(mesh, P(*spec)))
bat = ("data", "fsdp")
with sh.mesh_context(mesh):
  specs = gated_norm.partition_specs(B, G)
  res = grads("pallas")(put(y, bat, None, "tensor"), put(z, bat, None, "tensor"), put(w, "tensor"))
out = dict(devices=jax.device_count(), specs=str(specs))
for name, want, got in zip(("loss", "dy", "dz", "dw"), jax.tree.leaves(ref), jax.tree.leaves(res)):
  out[name] = float(np.abs(np.asarray(want) - np.asarray(got)).max() / np.abs(np.asarray(want)).max())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow   # a subprocess with 4 host devices
def test_sharded_kernels_equal_the_unsharded_twin():
  """Under a (fsdp 2, tensor 2) mesh the kernels run in a shard_map, batch over fsdp and groups over tensor:
  the loss and the gradients (dw summed over the batch shards) equal the unsharded twin's."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", _SHARDED.format(root=root)], cwd=root, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  res = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
  assert res["devices"] == 4 and "'tensor'" in res["specs"] and "'fsdp'" in res["specs"], res
  for name in ("loss", "dy", "dz", "dw"):
    assert res[name] <= F32_TOL, (name, res)
