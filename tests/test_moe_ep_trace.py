"""The expert-parallel MoE step's GPU paths, traced on a CPU (one device, a 1x1x1x1 mesh: ``shard_map``'s
varying-axes types do not depend on the axis sizes). Both failed to trace in the 64-GPU Nemotron 3 Super
compile (docs/PERF.md, "nemotron3_super on 64 GPUs"), which no CPU test had reached:

1. ``lax.ragged_all_to_all`` (the exchange off the CPU) with an nvfp4 ``grouped_dot`` on the received rows:
   the receive buffer was a plain ``jnp.zeros``, varying over no mesh axis, so the grouped GEMM's custom_vjp
   refused its varying cotangent ("the manual axis types do not match").
2. The native block-scaled GEMM (sm_100) inside ``shard_map``: jax 0.10.2's ``scaled_matmul`` result varies
   over no axis, its twin's over the operands', and ``lax.platform_dependent`` refused the two branches.
3. The H200's path with a receive factor: the drop (``expert_parallel.keep``), the ragged exchange and the
   tiled grouped GEMMs (``fp4jax.tiles``, a GPU target's choice) inside ``shard_map``, nvfp4 and bf16.
4. fp4jax's grouped Mosaic GEMM (forced) on each device's rows inside ``shard_map``, lowered for CUDA.
5. The exchanges' gradients without the offsets' all-to-alls.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pytest

import fp4jax
from fp4jax import _mosaic_compat as mc
from fp4jax import _native_compat as nc
from fp4jax import grouped, native, recipes
from models import expert_parallel, moe
from training import sharding

E, T, R, Q, F = 4, 32, 2, 64, 128


def _mesh():
  return jax.make_mesh((1,) * len(sharding.MESH_AXES), sharding.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(sharding.MESH_AXES))


def test_ragged_exchange_with_nvfp4_experts_traces_value_and_grad():
  _trace("nvfp4")


def test_the_exchanges_gradient_sends_no_offsets():
  """The dispatch's and the combine's gradients are each other's exchange (``expert_parallel.exchange``'s
  ``reverse``): no all-to-all of the offsets, which jax's own transpose of ragged_all_to_all issues."""
  prims = _trace("nvfp4")
  assert "all_to_all" not in prims and "all_gather" in prims


@pytest.mark.parametrize("recipe", ["nvfp4", "bf16"])
def test_receive_factor_and_tiled_gemms_trace_for_an_h200(recipe):
  with fp4jax.target.use(fp4jax.target.Target("gpu", "NVIDIA H200", (9, 0))):
    prims = _trace(recipe, receive_factor=0.5)
  assert "ragged_dot_general" not in prims and "all_gather" in prims


def test_grouped_mosaic_gemm_runs_on_each_devices_rows(monkeypatch):
  """The experts' rows GEMMs on fp4jax's grouped Mosaic GEMM (FP4JAX_NATIVE_KERNEL=mosaic, a B200 target): inside the
  fully manual shard_map each device's kernel takes its local rows; the kernel's result (varying over no mesh axis)
  is typed as its twin's, so value_and_grad traces and lowers: up and down, fprop and dgrad, four kernels."""
  monkeypatch.setenv("FP4JAX_DEFAULT_IMPL", "native")
  monkeypatch.setenv("FP4JAX_NATIVE_KERNEL", "mosaic")
  with fp4jax.target.use(fp4jax.target.Target("gpu", "NVIDIA B200", (10, 0))), mc.lowering_arch((10, 0)):
    text = _trace("nvfp4", lower=True)
  assert text.count("@mosaic_gpu_v2(") == 4 and "fp4jax_mosaic_grouped_gemm_nvfp4_4x128x256x256" in text


def _trace(name, receive_factor=None, lower=False):
  recipe = recipes.get(name)
  align = grouped.alignment(recipe)
  where = expert_parallel.Layout(("expert",), sharding.BATCH_AXES, 1)
  experts = jnp.asarray(np.random.default_rng(0).permutation(np.tile(np.arange(E), T * R // E)).reshape(T, R) % E,
                        jnp.int32)

  def loss(h, w_up, w_down):
    keys = jax.random.split(jax.random.key(0))
    gemms = tuple(moe.ExpertGemm(w, key, recipe, jnp.float32).per_expert_keys() for w, key in zip((w_up, w_down), keys))
    specs = jax.tree.map(lambda a: expert_parallel.expert_spec(where, a.ndim), gemms)
    out, dropped = expert_parallel.routed_dropping(h, experts, gemms, specs, experts_fn=moe.mlp, n_experts=E,
                                                   align=align, where=where, impl="ragged",
                                                   receive_factor=receive_factor)
    return jnp.sum(out) + dropped

  shapes = (jax.ShapeDtypeStruct((T, Q), jnp.float32), jax.ShapeDtypeStruct((E, Q, F), jnp.float32),
            jax.ShapeDtypeStruct((E, F, Q), jnp.float32))
  if lower:   # the CUDA lowering's text
    with jax.set_mesh(_mesh()):
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*shapes).lower(
          lowering_platforms=("cuda",)).as_text()
  with jax.set_mesh(_mesh()):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*shapes)
  prims = {e.primitive.name for e in jaxpr.jaxpr.eqns for e in _walk(e)}
  assert "ragged_all_to_all" in prims
  return prims


def _walk(eqn):
  yield eqn
  for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else _params_jaxprs(eqn):
    for e in sub.eqns:
      yield from _walk(e)


def _params_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(j, "jaxpr", j)
      if hasattr(inner, "eqns"):
        yield inner


def test_native_batched_gemm_traces_inside_shard_map_with_varying_operands():
  b, m, n, k = 2, 16, 16, 32
  a = jax.ShapeDtypeStruct((b, m, k), jnp.float4_e2m1fn)
  w = jax.ShapeDtypeStruct((b, n, k), jnp.float4_e2m1fn)
  sa = jax.ShapeDtypeStruct((b, m, k // 16), jnp.float8_e4m3fn)
  sw = jax.ShapeDtypeStruct((b, n, k // 16), jnp.float8_e4m3fn)
  batch = P(sharding.BATCH_AXES)

  def f(a, w, sa, sw):
    out = native.batched_block_scaled_matmul(native.Operand(a, sa), native.Operand(w, sw))
    assert nc.varying_axes(out) == frozenset(sharding.BATCH_AXES)
    return out

  with jax.set_mesh(_mesh()):
    jaxpr = jax.make_jaxpr(jax.shard_map(f, in_specs=(batch, P(), batch, P()), out_specs=batch))(a, w, sa, sw)
  assert jaxpr.out_avals[0].shape == (b, m, n)
