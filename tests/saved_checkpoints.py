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
