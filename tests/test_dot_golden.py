"""fp4jax.dot / dot_general reproduce, bit for bit, the values and both gradients recorded from the code
before the one-quantized-dot redesign (scripts/dot_golden.py, tests/data/dot_golden.npz): every preset
of fp4jax.recipes and OutControl's dot, on shapes that need padding, with K > 128, leading and batch
axes, float32 and bfloat16 operands, jitted and eager. The default run checks every case jitted on the
small shape and every case of a few presets; ``-m slow`` checks all of them."""
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


@pytest.mark.parametrize("recipe, shape, mode", CASES)
def test_dot_matches_the_recorded_bits(recipe, shape, mode):
  name = dot_golden.case_name(recipe, shape, mode)
  got = dot_golden.compute(recipe, shape, mode)
  for tag, a in zip(("y", "dx", "dw"), got):
    key = f"{name}/{tag}"
    if key in GOLDEN:
      want = GOLDEN[key]
      np.testing.assert_array_equal(a.astype(np.float32), want, err_msg=key)
    assert dot_golden.digest(a) == str(GOLDEN[f"{key}/sha256"]), key


def test_every_preset_is_recorded():
  recorded = {k.split("/")[0] for k in GOLDEN.files}
  assert recorded == {c[0] for c in dot_golden.cases()}
