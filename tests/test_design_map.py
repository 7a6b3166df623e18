"""docs/DESIGN.md's map of modules ("Layers: who may import whom") against the code's imports.

The map is a fenced block: top-level lines name the packages from the top (entry points) down, and the
lines under ``fp4jax/`` indented by two spaces name the library's modules from the top down. A unit may
import only units on lines below its own. Imports are read from the source (``ast``), every import in a
file, not only those at its top.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
PACKAGES = ("tools", "training", "configs", "models", "fp4jax")

# Arrows that point up, named in the map's text: none (the prover is tools.prove, above the library).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# What models may import of fp4jax besides the package itself (the map's models line names them).
MODELS_MAY_IMPORT = {"fp4jax", "flax", "grouped", "recipes", "quantizers", "outcontrol", "osci_reset", "fused",
                     "prequantized", "target", "formats", "pallas_compat", "dispatch"}


def _map_block() -> list[str]:
  text = DESIGN.read_text()
  section = text[text.index("### Layers: who may import whom"):]
  block = section[section.index("```\n") + 4:]
  return block[:block.index("```")].splitlines()


def _names(line: str) -> list[str]:
  """The names a map line starts with: its words up to the first run of two spaces."""
  return [t.rstrip("/") for t in re.split(r"\s{2,}", line.strip())[0].split()]


def _entries() -> list[tuple[str, str]]:
  """(kind, text) per entry of the map: "package" or "library", its line and its continuation lines."""
  entries, inside = [], False
  for line in _map_block():
    if not line.strip():
      continue
    if not line.startswith(" "):
      entries.append(("package", line))
      inside = _names(line) == ["fp4jax"]
    elif re.match(r"^  \S", line) and inside:
      entries.append(("library", line))
    else:
      kind, text = entries[-1]
      entries[-1] = (kind, text + "\n" + line)
  return entries


def map_levels():
  """(package levels, fp4jax levels): lists of name lists, top first."""
  packages = [[n for n in _names(t) if n in PACKAGES] for k, t in _entries() if k == "package"]
  library = [_names(t) for k, t in _entries() if k == "library"]
  return [p for p in packages if p], library


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
  rel = path.relative_to(root).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
  """Every module a file imports, absolute (relative imports resolved)."""
  me = _module_name(path, root)
  package = me if path.name == "__init__.py" else me.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      for alias in node.names:   # `from p import m`: the module p.m where m is one, else p itself
        sub = f"{module}.{alias.name}"
        where = root.joinpath(*sub.split("."))
        out.add(sub if where.with_suffix(".py").exists() or (where / "__init__.py").exists() else module)
  return out


def library_unit(module: str) -> str | None:
  """fp4jax.x.y -> "x" when x is a module or subpackage of fp4jax; "fp4jax" for the package; else None."""
  parts = module.split(".")
  if parts[0] != "fp4jax":
    return None
  if len(parts) == 1:
    return "fp4jax"
  if (ROOT / "fp4jax" / f"{parts[1]}.py").exists() or (ROOT / "fp4jax" / parts[1]).is_dir():
    return parts[1]
  return None   # a name imported from a module (fp4jax.api.quantize), counted through its module


def _library_units() -> set[str]:
  units = {p.stem for p in (ROOT / "fp4jax").glob("*.py") if p.name != "__init__.py"}
  units |= {p.name for p in (ROOT / "fp4jax").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
  return units


def _files(unit_dir: pathlib.Path, unit: str):
  single = unit_dir / f"{unit}.py"
  return [single] if single.exists() else sorted((unit_dir / unit).rglob("*.py"))


def test_the_map_names_every_library_module_once():
  _, library = map_levels()
  named = [n for level in library for n in level]
  assert len(named) == len(set(named)), f"named twice in the map: {sorted({n for n in named if named.count(n) > 1})}"
  assert set(named) == _library_units(), (
      f"missing from docs/DESIGN.md's map: {sorted(_library_units() - set(named))}; "
      f"in the map but not in fp4jax/: {sorted(set(named) - _library_units())}")


def test_every_library_import_points_down_the_map():
  _, library = map_levels()
  level = {n: i for i, names in enumerate(library) for n in names}
  upward = set()
  for unit in level:
    for path in _files(ROOT / "fp4jax", unit):
      for module in imports_of(path):
        dep = library_unit(module)
        if dep is None or dep == unit:
          continue
        if dep == "fp4jax" or level[dep] <= level[unit]:
          upward.add((unit, dep))
  assert upward == KNOWN_UPWARD, (
      f"imports that do not point down docs/DESIGN.md's map: {sorted(upward - KNOWN_UPWARD)}; "
      f"named as upward but gone (update the map's text and KNOWN_UPWARD): {sorted(KNOWN_UPWARD - upward)}")


def test_packages_import_only_packages_below_them():
  packages, _ = map_levels()
  order = [n for names in packages for n in names]
  assert sorted(order) == sorted(PACKAGES), f"the map's package lines name {order}, not each of {PACKAGES} once"
  wrong = []
  for i, package in enumerate(order):
    above = set(order[:i + 1]) - {package}
    for path in sorted((ROOT / package).rglob("*.py")):
      for module in imports_of(path):
        top = module.split(".")[0]
        if top in above:
          wrong.append(f"{path.relative_to(ROOT)} imports {module}")
  assert not wrong, "imports against docs/DESIGN.md's package order:\n" + "\n".join(sorted(set(wrong)))


def test_models_import_what_the_map_says_of_fp4jax():
  found = set()
  for path in sorted((ROOT / "models").rglob("*.py")):
    for module in imports_of(path):
      unit = library_unit(module)
      if unit is not None:
        found.add(unit)
  assert found <= MODELS_MAY_IMPORT, f"models import fp4jax modules the map does not name: {sorted(found - MODELS_MAY_IMPORT)}"
  models_text = next(t for k, t in _entries() if k == "package" and _names(t) == ["models"])
  for unit in MODELS_MAY_IMPORT & found - {"fp4jax"}:
    assert unit in models_text, f"the map's models lines do not name fp4jax.{unit}"


def test_the_reader_resolves_imports(tmp_path):
  """The reader itself: an absolute and a relative import, a name from a module read as its module."""
  (tmp_path / "pkg").mkdir()
  source = tmp_path / "pkg" / "mod.py"
  source.write_text("from fp4jax import gemm\nfrom . import sibling\nfrom ..fp4jax.api import quantize\n")
  (tmp_path / "pkg" / "sibling.py").write_text("")
  (tmp_path / "fp4jax" / "api").mkdir(parents=True)
  (tmp_path / "fp4jax" / "api" / "__init__.py").write_text("")
  assert imports_of(source, root=tmp_path) == {"fp4jax", "pkg.sibling", "fp4jax.api"}
  assert library_unit("fp4jax.api.quantize") == "api"
  assert library_unit("fp4jax") == "fp4jax"
  assert library_unit("jax.numpy") is None
