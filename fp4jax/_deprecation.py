"""Former public names: each still resolves, for one release, with a DeprecationWarning naming its
replacement. A module lists its own as ``__getattr__ = former_names(__name__, {"old": "new", ...})``."""
from __future__ import annotations

import sys
import warnings


def former_names(module: str, renamed: dict[str, str]):
  """A module ``__getattr__`` that maps each former name to the module's attribute of its new name."""

  def __getattr__(name: str):   # pylint: disable=invalid-name
    if name not in renamed:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = renamed[name]
    warnings.warn(f"{module}.{name} is deprecated and goes away in the next release; use {module}.{new}",
                  DeprecationWarning, stacklevel=2)
    return getattr(sys.modules[module], new)
  return __getattr__


def former_argument(where: str, name: str, new: str):
  """The DeprecationWarning of a renamed keyword argument."""
  warnings.warn(f"{where}({name}=...) is deprecated and goes away in the next release; pass {new}=...",
                DeprecationWarning, stacklevel=3)
