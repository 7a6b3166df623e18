"""The README's Python code blocks run as written (each in a fresh namespace, in order)."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
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


def _setup_commands() -> list[str]:
  text = open(README, encoding="utf-8").read()
  block = re.search(r"^## Set up on a fresh machine\n\n```bash\n(.*?)^```", text, re.M | re.S)
  assert block, "README.md lost its set-up block (## Set up on a fresh machine, then a bash block)"
  return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_the_readmes_setup_commands():
  """.ci/run installs and tests exactly as the README's two set-up commands say (as python3 -m ...)."""
  commands = _setup_commands()
  assert len(commands) == 2 and commands[0].startswith("pip install") and "-c constraints.txt" in commands[0]
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
  assert ["python3 -m " + c if c.startswith("pip ") else c.replace("python ", "python3 ", 1) for c in commands] \
      == [line for line in ci if "pip install" in line or "pytest" in line]


def _name(requirement: str) -> str:
  return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def test_constraints_pin_every_direct_dependency():
  """constraints.txt pins (==) each package pyproject.toml names in its dependencies and in the extras `dev`
  installs, so the README's install resolves to what CI tested."""
  tomllib = pytest.importorskip("tomllib")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  extras = project["optional-dependencies"]
  wanted, todo = list(project["dependencies"]), ["dev"]
  while todo:
    for req in extras[todo.pop()]:
      if req.startswith("fp4jax["):
        todo += re.match(r"fp4jax\[(.*)\]", req).group(1).split(",")
      else:
        wanted.append(req)
  with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as f:
    pins = {_name(line): line.strip() for line in f if line.strip() and not line.startswith("#")}
  assert all("==" in pin for pin in pins.values()), [p for p in pins.values() if "==" not in p]
  missing = sorted({_name(r) for r in wanted} - set(pins))
  assert not missing, f"constraints.txt pins no version of {missing}: add the version the suite passed with"
