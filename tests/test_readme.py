"""The README's Python code blocks run as written (each in a fresh namespace, in order)."""
from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BLOCKS = re.findall(r"^```python\n(.*?)^```", open(README, encoding="utf-8").read(), re.M | re.S)


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2   # the Flax example and the quantize/dequantize example


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
  exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_points_inside_the_repository():
  text = open(README, encoding="utf-8").read()
  outside = re.findall(r"(?<![.\w])\.\./\S*", text)   # ../x, not the elided ".../runs/tiny"
  assert not outside, f"README.md points outside the repository: {outside}"
