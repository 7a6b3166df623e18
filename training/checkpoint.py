"""Checkpoints (orbax): the train state (params, optimizer state, step, RNG, health counters) and the data
iterator's state, saved together under ``<workdir>/checkpoints/<step>``.

Saves are asynchronous (device -> host copy in the foreground, the write in the background) and atomic
(orbax writes ``<step>.orbax-checkpoint-tmp`` and renames it when complete), so an interrupted save never
touches an earlier checkpoint; the last ``keep`` are kept. A save that fails (no space left, I/O error)
removes its temporary directory and raises ``StorageError``: a foreground failure at once, a background write's
failure at the first step after it has ended (``check_background_save``, single-process runs; else at the next
save). The temporary folders of saves interrupted by a kill go at the next start (``remove_leftovers``).

Orbax does not notice bytes that change on disk after the write, so each checkpoint's data item also holds
a checksum per state leaf (a position-weighted sum of the leaf's bit patterns, mod 2^32, computed on the
devices); ``restore`` recomputes them. A checkpoint that cannot be read raises ``CheckpointReadError`` with
its step and a reason told apart: "truncated" (a file missing or cut short), "corrupt" (its bytes differ
from what was written) or "incompatible" (its arrays do not fit this config's model or optimizer).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

from training import peers
from training import sharding
from training.errors import CheckpointError, StorageError

TMP_SUFFIX = ".orbax-checkpoint-tmp"
_LEFTOVER = re.compile(r"^\d+" + re.escape(TMP_SUFFIX) + r"(-\d+)?$")   # an interrupted save's folder
REASONS = {
    "truncated": "truncated (a file is missing or shorter than when it was written)",
    "corrupt": "corrupt (its bytes differ from what was written)",
    "incompatible": "incompatible with this config (its arrays do not fit this model or optimizer)",
}
_TRUNCATED_MARKS = ("OUT_OF_RANGE", "Truncated", "does not match actual length", "NOT_FOUND", "was not found",
                    "No such file", "Unknown key")


class CheckpointReadError(CheckpointError, ValueError):
  """Checkpoint ``step`` could not be restored; ``reason`` is a key of ``REASONS``."""

  def __init__(self, directory: str, step: int, reason: str, detail: str):
    self.step, self.reason, self.detail = step, reason, detail
    super().__init__(f"checkpoint {directory}/{step} is {REASONS[reason]}: {detail}")


class Checkpoints:
  """A thin wrapper over ``ocp.CheckpointManager`` with the two items ``state`` and ``data``."""

  def __init__(self, directory: str, *, keep: int | None, async_save: bool = True, create: bool = True):
    """``keep``: how many of the latest checkpoints a save leaves (None: all, for reading another run's)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=create)
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=dict(
        state=ocp.StandardCheckpointHandler(), data=ocp.JsonCheckpointHandler()))
    self._saving = None  # the step whose write may still be running
    self.last_save_seconds: float | None = None  # of the latest save() call (with async_save: the foreground part)
    self._closed = False

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def reload(self) -> None:
    """Re-reads the list of steps from disk (after a checkpoint was moved away)."""
    self._manager.reload()

  # Save ---------------------------------------------------------------------------------------------

  def save(self, step: int, state, data_state: dict) -> bool:
    """Starts saving ``state`` (a pytree of jax arrays) and ``data_state`` (JSON) as ``step``; False if it exists.

    Raises StorageError when this save or the previous (background) one failed.
    """
    if step in self._manager.all_steps():
      return False
    self.wait()  # the previous save's background write: a failure there is reported as that step's
    data_state = dict(data_state, state_checksums=checksums(state))
    start = time.monotonic()
    self._saving = step
    try:
      started = self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)
    self.last_save_seconds = time.monotonic() - start
    return started

  def wait(self) -> None:
    """Blocks until every started save is on disk; StorageError (naming the failed step) if one failed."""
    if self._closed:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(self._saving, e)
    self._saving = None

  def check_background_save(self) -> None:
    """StorageError now, naming the step, when the background write of the latest save has ended in a failure;
    a save still being written is left alone (no wait). Single-process runs: in a multi-process run a failure
    is reported at the next save, where every process waits for the write together."""
    if self._saving is None or self._closed or jax.process_count() > 1:
      return
    if not self._manager.is_saving_in_progress():   # ended: waiting for it returns at once, or raises
      self.wait()

  def remove_leftovers(self) -> list[str]:
    """Removes the temporary folders (``<step>.orbax-checkpoint-tmp...``) that interrupted saves left in the
    checkpoint directory, and returns their names. No checkpoint depends on one: orbax renames a save's folder
    to ``<step>`` only when it is complete, and reads nothing else; the complete checkpoints, and any other
    folder (``unreadable_checkpoints``), stay. Call it only while no save of this directory runs: at the start
    of the run that holds the work directory."""
    removed = []
    for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
      path = os.path.join(self.directory, name)
      if _LEFTOVER.match(name) and os.path.isdir(path):
        shutil.rmtree(path)
        removed.append(name)
    return removed

  def on_disk(self) -> list[int]:
    """The steps whose checkpoint directory is complete on disk now (read from the directory, not from
    orbax's bookkeeping): ``<step>/`` renamed from its temporary name, holding both items."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted(int(n) for n in names if n.isdigit() and all(
        os.path.isdir(os.path.join(self.directory, n, item)) for item in ("state", "data")))

  def close(self) -> None:
    if self._closed:
      return
    try:
      self.wait()
    finally:
      if not self._closed:  # (a failed save has closed it already)
        self._closed = True
        self._manager.close()

  def _failed(self, step, error: Exception) -> None:
    if jax.process_count() > 1 and peers.is_peer_failure(error):
      raise error  # a lost peer, not the storage: its temporary directory stays (the other processes' part)
    for finish in (self._manager.wait_until_finished, self._manager.close):
      try:  # let every background write of the failed save end before its directory is removed
        finish()
      except Exception:  # pylint: disable=broad-except  (the same failure, reported below)
        pass
    _join_orbax_threads(timeout_s=60.0)  # a save that failed in the foreground leaves writer threads running
    self._closed = True
    removed = []
    for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
      if TMP_SUFFIX in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        removed.append(name)
    self._saving = None
    intact = [s for s in self.on_disk() if s != step]
    raise StorageError(
        f"writing checkpoint {step} to {self.directory} failed: {_os_reason(error)}. "
        + (f"The temporary directory {', '.join(removed)} was removed. " if removed else "")
        + (f"The checkpoints on disk, {intact}, are intact; " if intact else "No other checkpoint is on disk; ")
        + "free space or fix the storage, then run the same command again to resume"
        + (f" from step {intact[-1]}." if intact else ".")) from error

  # Restore ------------------------------------------------------------------------------------------

  def restore(self, step: int, abstract_state):
    """(state placed as ``abstract_state``'s shardings, data_state) of checkpoint ``step``.

    Raises CheckpointReadError (truncated / corrupt / incompatible) when it cannot be read as such.
    """
    self._check_fits(step, abstract_state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore raise many kinds)
      raise CheckpointReadError(self.directory, step, *_classify(e)) from e
    state, data_state = restored["state"], restored["data"]
    if not isinstance(data_state, dict):
      raise CheckpointReadError(self.directory, step, "truncated", "its data item (the iterator state) is empty")
    expected = data_state.pop("state_checksums", None)
    if expected is not None:
      bad = [name for name, a, b in zip(_leaf_names(state), checksums(state), expected) if a != b]
      if bad:
        raise CheckpointReadError(self.directory, step, "corrupt",
                                  f"the checksums of {len(bad)} array(s) differ, e.g. {', '.join(bad[:3])}")
    return state, data_state

  def restore_params(self, step: int, abstract_params):
    """Only the ``params`` of checkpoint ``step``'s state, placed as ``abstract_params``' shardings."""
    path = os.path.join(self.directory, str(step), "state")
    self._check_fits(step, {"params": abstract_params}, part="params")
    restore_args = ocp.checkpoint_utils.construct_restore_args({"params": abstract_params})
    try:
      with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args=restore_args, partial_restore=True))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointReadError(self.directory, step, *_classify(e)) from e
    return restored["params"]

  def _check_fits(self, step: int, abstract, part: str | None = None) -> None:
    """Compares the stored arrays' shapes and dtypes with ``abstract`` before reading any array data."""
    try:
      stored = self._manager.item_metadata(step)["state"]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointReadError(self.directory, step, *_classify(e)) from e
    if stored is None:
      raise CheckpointReadError(self.directory, step, "truncated", f"its array metadata "
                                f"({self.directory}/{step}/state/_METADATA) is unreadable: cut short or missing")
    stored = _shapes(dict(stored) if part is None else {part: dict(stored).get(part, {})})
    wanted = _shapes(abstract)
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted)) if part is None else []
    changed = sorted(k for k in set(wanted) & set(stored) if wanted[k] != stored[k])
    if missing or extra or changed:
      lines = ([f"{k}: stored {stored[k]}, this config {wanted[k]}" for k in changed[:3]]
               + [f"{k}: not in the checkpoint" for k in missing[:3]]
               + [f"{k}: not in this config" for k in extra[:3]])
      raise CheckpointReadError(
          self.directory, step, "incompatible",
          f"{len(changed)} array(s) differ in shape or dtype, {len(missing)} missing, {len(extra)} unexpected "
          f"({'; '.join(lines)})")


def _join_orbax_threads(timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax"):
      thread.join(max(deadline - time.monotonic(), 0.0))


def _os_reason(error: Exception) -> str:
  """The operating system's words for a failed write (tensorstore reports them as ``[os_error_code='28']``)."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  match = re.search(r"os_error_code='?(\d+)", str(error))
  if match:
    return os.strerror(int(match.group(1)))
  lines = str(error).strip().splitlines()
  return lines[0][:300] if lines else type(error).__name__


def _classify(error: Exception) -> tuple[str, str]:
  """(reason, one-line detail) of an exception raised while orbax/tensorstore read a checkpoint."""
  chain, e = [], error
  while e is not None and len(chain) < 8:
    chain.append(e)
    e = e.__cause__ or e.__context__
  text = " | ".join(str(x) for x in chain)
  detail = next((line for x in chain for line in str(x).splitlines()
                 if any(m in line for m in _TRUNCATED_MARKS + ("DATA_LOSS", "compatible"))), str(error))
  detail = detail.strip()[:300]
  if any(isinstance(x, (json.JSONDecodeError, StopIteration)) for x in chain):
    return "truncated", f"a metadata file is cut short or empty ({detail})"
  if any(isinstance(x, (FileNotFoundError, KeyError)) for x in chain) or any(m in text for m in _TRUNCATED_MARKS):
    return "truncated", detail
  if "not compatible with the stored shape" in text or "dtype" in text and "stored" in text:
    return "incompatible", detail
  return "corrupt", detail


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _shapes(tree) -> dict[str, tuple]:
  """{"a/b/0": (shape, dtype name)} for every array leaf (named the same whether a node is a dict,
  list or namedtuple, as orbax's metadata and the live tree differ in container types)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {"/".join(_key_name(k) for k in path): (tuple(x.shape), np.dtype(x.dtype).name)
          for path, x in leaves if hasattr(x, "shape")}


def _leaf_names(tree) -> list[str]:
  return ["/".join(_key_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@jax.jit
def _checksums_on_device(leaves):
  sums = []
  for x in leaves:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      bits = x.astype(jnp.uint32)
    else:
      bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
      if x.dtype.itemsize == 8:
        bits = (bits & 0xFFFFFFFF) ^ (bits >> 32)
      bits = bits.astype(jnp.uint32)
    weight = 2 * lax.iota(jnp.uint32, max(x.size, 1))[:x.size].reshape(x.shape) + 1
    sums.append(jnp.sum(bits * weight, dtype=jnp.uint32))
  return sums


def checksums(state) -> list[int]:
  """One uint32 per leaf of ``state``: sum over elements of (bits x (2 * flat index + 1)), mod 2^32."""
  return [int(v) for v in sharding.to_host(_checksums_on_device(jax.tree.leaves(state)))]


def abstract_like(tree, shardings):
  """ShapeDtypeStructs with the given shardings: the restore target of a tree of arrays."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
