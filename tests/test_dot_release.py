"""fp4jax.dot's backward releases dx together with dw (one optimization barrier, for the schedule's memory):
loss and gradients of a quantized model equal those without the barrier bit for bit, unrolled and scanned.
Compiled as bench/scale.py compiles (CPU barrier expansion off), so the barrier is in the compiled program."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from models import LanguageModel, get_model_config, moe, policy

CASES = [("M-*-M-", False), ("M-M-M-", True)]


def _count_barriers(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "optimization_barrier"
    for sub in jax.core.jaxprs_in_params(eqn.params):
      n += _count_barriers(sub)
  return n


def _value_and_grads(config):
  model = LanguageModel(config, recipe="nvfp4")   # stochastic rounding in the backward pass
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, config.vocab_size)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  params = jax.jit(model.init)({"params": jax.random.key(0), "fp4": jax.random.key(0)}, inputs)["params"]
  loss = lambda p, key: model.apply({"params": p}, inputs, targets_BxL=targets, rngs={"fp4": key})
  grad_fn = jax.value_and_grad(loss)
  barriers = _count_barriers(jax.make_jaxpr(grad_fn)(params, jax.random.key(7)).jaxpr)
  return barriers, jax.jit(grad_fn)(params, jax.random.key(7))


def _compare(pattern, scan_blocks):
  config = get_model_config("tiny", pattern=pattern, chunk_size=8, bf16_last_blocks=0, remat=True,
                            scan_blocks=scan_blocks)
  barriers, (value, grads) = _value_and_grads(config)
  barrier = jax.lax.optimization_barrier
  jax.lax.optimization_barrier = lambda operands: operands
  try:
    barriers_off, (value_off, grads_off) = _value_and_grads(config)
  finally:
    jax.lax.optimization_barrier = barrier
  assert barriers_off < barriers, (barriers_off, barriers)   # the comparison really ran without it
  assert np.isfinite(value)
  np.testing.assert_array_equal(value, value_off)
  jax.tree.map(np.testing.assert_array_equal, grads, grads_off)


def _dot_grads(recipe):
  x = jax.random.normal(jax.random.key(0), (64, 96), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (96, 48), jnp.float32).astype(jnp.bfloat16)
  loss = lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(2)).astype(jnp.float32) ** 2)
  grad_fn = jax.grad(loss, argnums=(0, 1))
  return _count_barriers(jax.make_jaxpr(grad_fn)(x, w).jaxpr), jax.jit(grad_fn)(x, w)


def test_release_apart_changes_no_value():
  """Recipe.release_dx_with_dw=False takes the barrier out of the backward pass and nothing else."""
  together, grads = _dot_grads(fp4jax.recipes.nvfp4())
  apart, grads_apart = _dot_grads(fp4jax.recipes.nvfp4(release_dx_with_dw=False))
  assert apart == together - 1, (together, apart)
  jax.tree.map(np.testing.assert_array_equal, grads, grads_apart)


def test_model_config_releases_apart():
  """models' release_dx_with_dw=False reaches every quantized layer's and expert GEMM's recipe; True keeps the
  preset's."""
  dense = lambda **kw: policy.dot_general_cls(get_model_config("tiny", **kw), "nvfp4",
                                              "blocks_0/mixer/in_proj").keywords["recipe"]
  experts = lambda **kw: moe.expert_recipe(get_model_config("moe_tiny", bf16_last_blocks=0, **kw), "nvfp4",
                                           ("blocks_1", "mixer", "experts", "up"))
  for recipe in (dense, experts):
    assert recipe() == fp4jax.recipes.nvfp4()
    apart = recipe(release_dx_with_dw=False)
    assert not apart.release_dx_with_dw and apart.replace(release_dx_with_dw=True) == fp4jax.recipes.nvfp4()


@pytest.mark.slow
def test_release_barrier_changes_no_value():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_disable_hlo_passes=cse_barrier_expander", JAX_PLATFORMS="cpu",
             PYTHONPATH=root)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True,
                        cwd=root, env=env, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.stdout.count("equal") == len(CASES)


if __name__ == "__main__":
  for case in CASES:
    _compare(*case)
    print(case, "equal", flush=True)
