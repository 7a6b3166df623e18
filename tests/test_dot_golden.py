"""fp4jax.dot / dot_general reproduce, bit for bit, the values and both gradients recorded from the code
before the one-quantized-dot redesign (scripts/dot_golden.py, tests/data/dot_golden.npz): every preset
of fp4jax.recipes and OutControl's dot, on shapes that need padding, with K > 128, leading and batch
axes, float32 and bfloat16 operands, jitted and eager. The default run checks every case jitted on the
small shape and every case of a few presets; ``-m slow`` checks all of them.

Kinds of recorded value (issue 32): every array and SHA-256 of the file is a GEMM output (y, dx, dw), so
summation-order dependent. The quantizers before the GEMMs are order-free and the block products are exact,
but XLA's CPU dot sums them in an order its instruction set picks. Measured (jax 0.10.2, Intel Xeon dev
VM): ``--xla_cpu_max_isa=AVX`` changes y, dx or dw of nvfp4, bf16, fp8 and tetrajet2 by 1-2 ulps of max|y|
(one tetrajet2 code flips downstream); AVX-512 with 256- or 512-bit vectors, on 1 or 2 threads, reproduces
every bit, as did an AMD EPYC (issue 32). So the recorded bits are a contract only where the dots sum in
the recorded order, which ``lax.dot_general`` itself detects: computed without fp4jax on the bf16 cases'
inputs, it must give their recorded bits. Where it does not, the recorded comparisons are skipped, saying
why. Compared in this process on every machine: eager against jit, and the bf16 recipe against
``lax.dot_general``, bit for bit."""
import functools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import dot_golden  # noqa: E402

GOLDEN = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dot_golden.npz"))
QUICK = {("nvfp4", "pad", "jit"), ("quartet2", "pad", "jit"), ("tetrajet2", "batch", "jit"),
         ("nvfp4_4over6", "lead", "jit"), ("outcontrol", "pad", "jit")}


def _quick(case):
  return case in QUICK or (case[1] == "small" and case[2] == "jit")


CASES = [pytest.param(*c, id=dot_golden.case_name(*c),
                      marks=() if _quick(c) else pytest.mark.slow) for c in dot_golden.cases()]


def _recorded(got, name):
  return all(dot_golden.digest(a) == str(GOLDEN[f"{name}/{tag}/sha256"]) for tag, a in zip(("y", "dx", "dw"), got))


@functools.cache
def sums_in_the_recorded_order() -> bool:
  """Whether this machine's ``lax.dot_general`` (no fp4jax) reproduces the recorded bits of the bf16 recipe,
  which is exactly that dot, on every shape: the order canary."""
  return all(_recorded(dot_golden.plain(shape), dot_golden.case_name("bf16", shape, "jit"))
             for shape in dot_golden.SHAPES)


@pytest.mark.parametrize("recipe, shape, mode", CASES)
def test_dot_matches_the_recorded_bits(recipe, shape, mode):
  name = dot_golden.case_name(recipe, shape, mode)
  got = dot_golden.compute(recipe, shape, mode)
  if mode == "eager":      # the same-process twin: order-free (the same sums on the same machine)
    for tag, a, b in zip(("y", "dx", "dw"), got, dot_golden.compute(recipe, shape, "jit")):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}/{tag} eager vs jit")
  if recipe == "bf16" and mode == "jit":   # the recipe that quantizes nothing is exactly lax.dot_general
    for tag, a, b in zip(("y", "dx", "dw"), got, dot_golden.plain(shape)):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}/{tag} vs lax.dot_general")
  if not sums_in_the_recorded_order():
    pytest.skip("this CPU's XLA dots sum in another order than the recording machine's (lax.dot_general does "
                "not give the recorded bf16 bits): the recorded GEMM outputs are not a contract here")
  for tag, a in zip(("y", "dx", "dw"), got):
    key = f"{name}/{tag}"
    if key in GOLDEN:
      want = GOLDEN[key]
      np.testing.assert_array_equal(a.astype(np.float32), want, err_msg=key)
    assert dot_golden.digest(a) == str(GOLDEN[f"{key}/sha256"]), key


def test_every_preset_is_recorded():
  recorded = {k.split("/")[0] for k in GOLDEN.files}
  assert recorded == {c[0] for c in dot_golden.cases()}
