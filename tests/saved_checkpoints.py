"""Test helper: a train.py checkpoint read back directly from disk, as numpy."""
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def saved(workdir, step):
  """The state and data items of checkpoint ``step`` of ``workdir``, as numpy."""
  path = os.path.join(workdir, "checkpoints", str(step))
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(os.path.join(path, "state"))
  with open(os.path.join(path, "data", "metadata"), encoding="utf-8") as f:
    data_state = json.load(f)
  return jax.tree.map(np.asarray, state), data_state


def assert_same_checkpoint(workdir_a, workdir_b, step):
  """Checkpoint ``step`` of the two work directories: the same data position and the same state, bit for
  bit (tree structure and every leaf)."""
  (a, data_a), (b, data_b) = saved(workdir_a, step), saved(workdir_b, step)
  assert data_a == data_b
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  return a
