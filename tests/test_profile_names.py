"""fp4jax's work is named in XLA profiles: the op_name metadata of the optimized HLO.

A trace (``train.py --config.profile_steps``, ``jax.profiler``) labels each GPU kernel with the op_name
of the HLO instructions it runs, so these tests read that metadata from the compiled HLO on CPU.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import _pallas_compat as plc
from fp4jax.api import quantize_rht_transposed, scaled_matmul

_SKIPPED = ("parameter", "constant", "tuple", "get-tuple-element")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = [^=]*? ([a-z][a-z0-9\-]*)\(")


def op_names(fn, *args):
  """op_name (or None) of every instruction of the optimized HLO of ``jax.jit(fn)``, all computations
  (fused ones included) but parameters, constants, tuples and get-tuple-elements."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  names = []
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m or m.group(1) in _SKIPPED:
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    names.append(name.group(1) if name else None)
  return names


def named_fraction(names):
  return sum(1 for n in names if n and "fp4jax" in n) / len(names)


def _x(shape, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def test_grad_of_dot_is_named():
  """The acceptance check: >= 90% of the instructions of jit(grad(loss of fp4jax.dot)) carry fp4jax."""
  def loss(x, w, key):   # y is squared so that the fprop GEMM is not dead code in the gradient
    y = fp4jax.dot(x, w, recipe=fp4jax.recipes.nvfp4(), key=key).astype(jnp.float32)
    return jnp.sum(jnp.square(y))

  names = op_names(jax.grad(loss, argnums=(0, 1)), _x((64, 128)), _x((128, 96), 1), jax.random.key(0))
  assert len(names) > 200
  assert named_fraction(names) >= 0.9, named_fraction(names)
  joined = "\n".join(n for n in names if n)
  for gemm in ("fprop", "dgrad", "wgrad"):     # each GEMM and its quantizations by name
    assert re.search(rf"fp4jax/dot.*/{gemm}/fp4jax/scaled_matmul/nvfp4_", joined), gemm
  assert "fprop/fp4jax/quantize/nvfp4_1x16/fp4jax_quantize_xla" in joined
  assert "fprop/fp4jax/quantize/nvfp4_16x16/" in joined
  assert "dgrad/fp4jax/quantize/nvfp4_1x16_sr/" in joined
  assert "wgrad/fp4jax/quantize_rht_t/nvfp4_rht16_t_1x16_sr/" in joined
  assert re.search(r"fp4jax/quantize/[^\n]*reduce_max", joined)   # the tensor amax outside the primitive


def _op_cases(impl):
  """{expected name prefix: fn} for each kernel-backed op with this impl."""
  return {
      "fp4jax/quantize/nvfp4_1x16/fp4jax_quantize_": lambda x: fp4jax.quantize(x, "nvfp4", impl=impl).data,
      "fp4jax/quantize/nvfp4_16x16/fp4jax_quantize_": lambda x: fp4jax.quantize(
          x, "nvfp4", tile=(16, 16), impl=impl).data,
      "fp4jax/quantize/mxfp4_1x32/fp4jax_quantize_": lambda x: fp4jax.quantize(x, "mxfp4", impl=impl).data,
      "fp4jax/quantize_rht_t/nvfp4_rht16_t_1x16/fp4jax_quantize_rht_t_": lambda x: quantize_rht_transposed(
          x, "nvfp4", impl=impl).data,
      "fp4jax/scaled_matmul/nvfp4_1x16.nvfp4_1x16/fp4jax_scaled_matmul_": lambda x: scaled_matmul(
          fp4jax.quantize(x, "nvfp4", impl="xla"), fp4jax.quantize(x, "nvfp4", impl="xla"), impl=impl),
  }


def test_xla_path_of_each_op_is_named():
  x = _x((32, 64))
  for expected, fn in _op_cases("xla").items():
    names = op_names(fn, x)
    assert any(n and expected + "xla" in n for n in names), (expected, set(names))
    assert named_fraction(names) >= 0.9, (expected, named_fraction(names))


@pytest.mark.skipif(not plc.has_triton(), reason="jax without the Pallas Triton backend")
def test_kernels_are_named_in_the_cuda_lowering():
  """Each Triton kernel (one custom call in the CUDA lowering, one kernel in a GPU trace) carries the op's
  name; checked on the StableHLO locations, since a CPU cannot compile for CUDA."""
  spec = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
  for expected, fn in _op_cases("pallas").items():
    text = plc.export_for_cuda(fn, spec)
    locs = dict(re.findall(r"^(#loc\d+) = (.*)$", text, re.M))
    calls = [l for l in text.splitlines() if plc.TRITON_CUSTOM_CALL in l and "custom_call" in l]
    assert calls, expected
    for call in calls:
      loc = locs[re.search(r"loc\((#loc\d+)\)\s*$", call).group(1)]
      assert expected + "pallas/" in loc, (expected, loc)
