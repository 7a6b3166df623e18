"""Checkpoints (orbax): the train state (params, optimizer state, step, RNG, health counters) and the data
iterator's state, saved together under ``<workdir>/checkpoints/<step>``.

Saves are asynchronous (device -> host copy in the foreground, the write in the background) and atomic
(orbax writes a temporary directory and renames it), so an interrupted save never corrupts an earlier one;
the last ``keep`` checkpoints are kept.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """A thin wrapper over ``ocp.CheckpointManager`` with the two items ``state`` and ``data``."""

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> bool:
    """Starts saving ``state`` (a pytree of jax arrays) and ``data_state`` (JSON) as ``step``; False if it exists."""
    if step in self._manager.all_steps():
      return False
    return self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, step: int, abstract_state):
    """(state placed as ``abstract_state``'s shardings, data_state) of checkpoint ``step``."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs with the given shardings: the restore target of a tree of arrays."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
