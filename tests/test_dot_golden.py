"""fp4jax.dot / dot_general reproduce, bit for bit, the recorded values of y and both gradients
(scripts/dot_golden.py, tests/data/dot_golden.npz): every preset of fp4jax.recipes and OutControl's dot, on
shapes that need padding, with K > 128, leading and batch axes, float32 and bfloat16 operands, jitted and
eager. The default run checks a few presets; ``-m slow`` checks all of them.

The recorded values are order-free, so every check runs on every CPU (none skips). The inputs are drawn with
numpy (scripts/dot_golden.py), the stochastic-rounding bits are integer hashes, and XLA's float code is the
same with and without FMA where fp4jax's arithmetic guards it (fp4jax._exact); checked with
``XLA_FLAGS=--xla_cpu_max_isa=AVX`` and ``SSE4_2`` standing in for other CPUs:
1. The program with every sum exact (scripts/order_free.py: each GEMM's products summed exactly, rounded
   once; every other operation fp4jax's own) gives the recorded bits. This pins every code, scale and amax
   of every GEMM operand, the tensor factors and the output casts: a change of one bit anywhere but in the
   order of a GEMM's sum changes a recorded SHA-256.
2. The program itself (jitted: XLA's dots, summing in the order this CPU's instruction set picks) is within
   the bound float32 accumulation allows of those values: gamma_K * sum_k |a_k b_k| per GEMM output, carried
   through the operations after it, plus one unit in the last place per rounding (order_free.evaluate).
3. In this process: eager equals jit, and the bf16 recipe equals ``lax.dot_general``, bit for bit.
"""
import functools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import dot_golden  # noqa: E402

GOLDEN = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dot_golden.npz"))
# One case of each kind of program, in the default suite: a GEMM per role (nvfp4), padding and K > 128
# (Quartet II), a dot_general batch axis (TetraJet-v2), bf16 operands with leading axes (4/6), OutControl,
# and the unquantized dot.
QUICK = {("nvfp4", "small", "jit"), ("quartet2", "pad", "jit"), ("tetrajet2", "batch", "jit"),
         ("nvfp4_4over6", "lead", "jit"), ("outcontrol", "pad", "jit"), ("bf16", "small", "jit"),
         ("nvfp4", "small", "eager")}
CASES = [pytest.param(*c, id=dot_golden.case_name(*c), marks=() if c in QUICK else pytest.mark.slow)
         for c in dot_golden.cases()]


@functools.cache
def _order_free(recipe, shape):
  return dot_golden.order_free_values(recipe, shape)


@functools.cache
def _jitted(recipe, shape):
  return dot_golden.compute(recipe, shape, "jit")


def check_recorded(recipe, shape, outs):
  """Each order-free output's SHA-256 (and, for the small shape, its values) as recorded."""
  for tag, a in zip(("y", "dx", "dw"), outs):
    key = f"{recipe}/{shape}/{tag}"
    if key in GOLDEN:
      np.testing.assert_array_equal(a.astype(np.float32), GOLDEN[key], err_msg=key)
    assert dot_golden.digest(a) == str(GOLDEN[f"{key}/sha256"]), key


def check_within_bound(name, got, outs, bounds):
  for tag, a, exact, bound in zip(("y", "dx", "dw"), got, outs, bounds):
    assert a.dtype == exact.dtype and a.shape == exact.shape, f"{name}/{tag}"
    assert np.all(np.isfinite(bound)), f"{name}/{tag}: no finite bound (scripts/order_free.py's rules)"
    diff = np.abs(a.astype(np.float64) - exact.astype(np.float64))
    worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
    assert np.all(diff <= bound), (f"{name}/{tag}: {a[worst]} vs the exact sums' {exact[worst]} at {worst}, "
                                   f"beyond float32 accumulation's bound {bound[worst]}")


@pytest.mark.parametrize("recipe, shape, mode", CASES)
def test_dot_matches_the_recorded_bits(recipe, shape, mode):
  name = dot_golden.case_name(recipe, shape, mode)
  jitted = _jitted(recipe, shape)
  if mode == "eager":      # the same-process twin: the same sums on the same machine
    for tag, a, b in zip(("y", "dx", "dw"), dot_golden.compute(recipe, shape, "eager"), jitted):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}/{tag} eager vs jit")
    return
  if recipe == "bf16":     # the recipe that quantizes nothing is exactly lax.dot_general
    for tag, a, b in zip(("y", "dx", "dw"), jitted, dot_golden.plain(shape)):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}/{tag} vs lax.dot_general")
  outs, bounds = _order_free(recipe, shape)
  check_recorded(recipe, shape, outs)
  check_within_bound(name, jitted, outs, bounds)


def test_every_preset_is_recorded():
  recorded = {k.split("/")[0] for k in GOLDEN.files}
  assert recorded == {c[0] for c in dot_golden.cases()}
  assert {f"{r}/{s}/{t}/sha256" for r, s, m in dot_golden.cases() if m == "jit" for t in ("y", "dx", "dw")} \
      <= set(GOLDEN.files)
