"""fp4jax's sharded ops in jax's persistent compilation cache.

Each fp4jax op lowers, on a mesh, to a ``custom_partitioning`` custom call whose ``backend_config`` is the id
of a Python object of the process that lowered it. jax's persistent compilation cache keys a program by its
HLO, so a program holding such an op gets a new key in every process: a resumed run, or a second process of
a run, compiles its step again even with the step's entry on disk. jax can leave that id out of the key
(``jax_remove_custom_partitioning_ptr_from_cache_key``), but the id is the only place the op's parameters are:
two programs that differ only in them (a format, a rounding, an impl) would then share one key.

So fp4jax puts what the id stands for into the op itself (``tag``): a frontend attribute with the per-shard
op's name, its operands' ranks, its parameters and a fingerprint of fp4jax's source (the partition callback
and the per-shard lowering are that code). ``compile`` then leaves the ids out of the key only for programs
whose every ``custom_partitioning`` call carries the attribute: a program with any other one (jax's cuDNN
attention, a user's) is keyed, and compiled, as jax does by default.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib

from jax.interpreters import mlir

from fp4jax._jax_compat import custom_partitioning_ids_out_of_cache_key

ATTRIBUTE = "fp4jax_partitioned"
CALL_TARGET = "CustomSPMDPartitioning"   # jax's custom_partitioning custom call


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
  """sha256 of fp4jax's Python source (every file's path and bytes), the code behind an op's partitioning."""
  root = pathlib.Path(__file__).resolve().parent
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    h.update(str(path.relative_to(root)).encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


def tag(results, name: str, ndims: tuple[int, ...], params_items: tuple) -> None:
  """Marks the custom_partitioning call that produced ``results`` (the lowering's outputs, ir values or
  sequences of them) with ``name``,
  ``ndims``, the parameters and ``source_fingerprint()``. The parameters' text must not name a Python object
  by address, or the key would still differ per process (safe, only not cached): the caller's tests check."""
  value = f"{name} ndims={ndims} {params_items!r} source={source_fingerprint()}"
  flat = [v for r in results for v in (r if isinstance(r, (list, tuple)) else (r,))]
  for op in {id(v.owner): v.owner for v in flat}.values():
    if _is_partitioned_call(op):
      op.attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get({ATTRIBUTE: mlir.ir.StringAttr.get(value)})


def _is_partitioned_call(op) -> bool:
  return (op.name == "stablehlo.custom_call"
          and mlir.ir.StringAttr(op.attributes["call_target_name"]).value == CALL_TARGET)


def all_tagged(module) -> bool:
  """Whether every custom_partitioning call of ``module`` (an ir.Module) carries fp4jax's attribute."""
  untagged = []

  def visit(op):
    op = op.operation if hasattr(op, "operation") else op
    if _is_partitioned_call(op):
      attrs = op.attributes["mhlo.frontend_attributes"] if "mhlo.frontend_attributes" in op.attributes else None
      if attrs is None or ATTRIBUTE not in mlir.ir.DictAttr(attrs):
        untagged.append(op)
    return mlir.ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  return not untagged


def compile(lowered, compiler_options: dict | None = None):   # pylint: disable=redefined-builtin
  """``lowered.compile(compiler_options)``, keyed in the persistent cache without the custom_partitioning ids
  when every such call in the program is fp4jax's (module docstring); as jax keys it otherwise."""
  if not all_tagged(lowered.compiler_ir("stablehlo")):
    return lowered.compile(compiler_options)
  with custom_partitioning_ids_out_of_cache_key():
    return lowered.compile(compiler_options)
