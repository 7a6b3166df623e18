"""fp4jax.target: every automatic choice is decided for the program's devices, not the process's.

Fake devices and targets (nothing is compiled): the Target read off devices, a Mesh and a Sharding;
which target a trace sees (``use``, then ``jax.set_mesh``'s mesh, then ``jax.devices()[0]``); and the
decisions made from it: the primitives' impl, whether Pallas can run, the native GEMM default, and the
model's attention kernel. The deviceless GPU compile that shows the HLO a GPU runs is in
tests/test_gpu_aot.py (test_12b_slice_compiles_with_cudnn_attention).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax import dispatch
from fp4jax.target import Target, capability
from models import get_model_config
from models.attention import resolve_attention_impl

H200 = Target("gpu", "NVIDIA H200", (9, 0))
B200 = Target("gpu", "NVIDIA B200", (10, 0))
T4 = Target("gpu", "Tesla T4", (7, 5))
CPU = Target("cpu", "cpu")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  platform: str
  device_kind: str
  compute_capability: str | None = None
  id: int = 0


def test_target_of_devices():
  assert Target.of(FakeDevice("gpu", "NVIDIA H200", "9.0")) == H200
  assert Target.of([FakeDevice("gpu", "NVIDIA B200", "10.0", i) for i in range(8)]) == B200
  assert Target.of(H200) is H200
  assert Target.of(jax.devices()[0]) == Target.here()
  assert Target.here().platform == jax.devices()[0].platform
  assert capability(FakeDevice("gpu", "AMD Instinct MI300X", "gfx942")) is None   # ROCm: not CUDA
  assert capability(FakeDevice("cpu", "cpu")) is None
  assert not Target.of(FakeDevice("gpu", "AMD Instinct MI300X", "gfx942")).cuda
  with pytest.raises(ValueError, match="one kind"):
    Target.of([FakeDevice("gpu", "NVIDIA H200", "9.0", 0), FakeDevice("gpu", "NVIDIA B200", "10.0", 1)])
  with pytest.raises(ValueError, match="no devices"):
    Target.of([])


def test_target_of_mesh_and_sharding():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
  assert Target.of(mesh) == Target.here()
  assert Target.of(jax.sharding.NamedSharding(mesh, jax.P())) == Target.here()


def test_capability_predicates():
  assert H200.cuda and H200.at_least(8, 0) and H200.at_least(9, 0) and not H200.at_least(10, 0)
  assert B200.at_least(10, 0) and not T4.at_least(8, 0)
  assert not CPU.cuda and not CPU.at_least(0, 0)


def test_use_nests_and_restores():
  outside = fp4jax.target.current()
  with fp4jax.target.use(H200) as t:
    assert t == H200 and fp4jax.target.current() == H200
    with fp4jax.target.use(FakeDevice("gpu", "NVIDIA B200", "10.0")):
      assert fp4jax.target.current() == B200
    with fp4jax.target.use(None):   # None: leaves the current one
      assert fp4jax.target.current() == H200
    assert fp4jax.target.current() == H200
  assert fp4jax.target.current() == outside


def test_a_trace_sees_use_then_the_set_mesh_mesh():
  seen = []

  def probe(x):
    seen.append(fp4jax.target.current())
    return x

  with fp4jax.target.use(B200):
    jax.make_jaxpr(probe)(1.0)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
  with jax.set_mesh(mesh):
    jax.jit(probe).lower(jax.ShapeDtypeStruct((2,), jnp.float32))   # inside jit: the set_mesh mesh
    with fp4jax.target.use(H200):                                    # use wins over the mesh
      jax.make_jaxpr(probe)(2.0)
  assert seen == [B200, Target.of(mesh), H200]


# ------------------------------------------------------------------------------ the decisions

@pytest.fixture
def no_env(monkeypatch):
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  monkeypatch.setattr(plc, "has_triton", lambda: True)


@pytest.mark.parametrize("target,pallas,gemm", [(H200, True, None), (B200, True, "native"),
                                                (T4, True, None), (CPU, False, None),
                                                (Target("gpu", "NVIDIA RTX 5090", (12, 0)), True, None)])
def test_fp4jax_decisions_follow_the_target(no_env, monkeypatch, target, pallas, gemm):
  assert dispatch.can_use_pallas("nvfp4", target=target) == pallas
  assert dispatch.native_default("nvfp4", target=target) == gemm
  assert dispatch.native_device(target=target) == (gemm == "native")
  assert dispatch.default_impl("quantize_1d", "nvfp4", target=target) == "xla"   # nothing verified
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, ("quantize_1d", "nvfp4"),
                      dispatch.Evidence("2026-12-01", "NVIDIA H200", jax.__version__, 1.3))
  assert dispatch.default_impl("quantize_1d", "nvfp4", target=target) == ("pallas" if pallas else "xla")
  with fp4jax.target.use(target):   # the same, read from the trace's target
    assert dispatch.can_use_pallas("nvfp4") == pallas
    assert dispatch.native_default("nvfp4") == gemm
    assert dispatch.default_impl("quantize_1d", "nvfp4") == ("pallas" if pallas else "xla")


def test_explicit_arguments_and_env_still_win(no_env, monkeypatch):
  assert not dispatch.can_use_pallas("nvfp4", platform="cpu", target=H200)   # platform says it
  assert dispatch.native_default("nvfp4", capability=(9, 0), target=B200) is None   # so does cc
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert dispatch.native_default("nvfp4", target=B200) is None
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "native")
  assert dispatch.native_default("nvfp4", target=CPU) == "native"


def test_the_dot_picks_its_gemm_backend_for_the_target(no_env):
  """Traced (not compiled) for a B200, the quantized dot's GEMMs take the native path (its block-scaled
  GEMM behind a platform switch); for an H200 or the CPU, the XLA path's fp4jax_scaled_matmul."""
  x, w = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)

  def jaxpr_text(target):
    with fp4jax.target.use(target):   # a new lambda per trace: jax caches traces per function
      return str(jax.make_jaxpr(lambda x, w: fp4jax.dot(x, w, recipe="nvfp4_no_rht"))(x, w))

  for xla_path in (CPU, H200):
    text = jaxpr_text(xla_path)
    assert "fp4jax_scaled_matmul" in text and "platform_index" not in text
  text = jaxpr_text(B200)
  assert "fp4jax_scaled_matmul" not in text and "platform_index" in text


@pytest.mark.parametrize("target,dtype,head_dim,want", [
    (H200, jnp.bfloat16, 128, "cudnn"), (B200, jnp.float16, 64, "cudnn"),
    (H200, jnp.float32, 128, "chunked"), (H200, jnp.bfloat16, 256, "chunked"),
    (T4, jnp.bfloat16, 128, "chunked"), (CPU, jnp.bfloat16, 128, "chunked")])
def test_attention_auto_follows_the_target(target, dtype, head_dim, want):
  config = get_model_config("tiny", head_dim=head_dim)
  assert resolve_attention_impl(config, dtype, target=target) == want
  with fp4jax.target.use(target):
    assert resolve_attention_impl(config, dtype) == want
  assert resolve_attention_impl(config.replace(attention_impl="xla"), dtype, target=target) == "xla"
