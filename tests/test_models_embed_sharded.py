"""The embedding lookup under FSDP: on data 2 x fsdp 2 (4 host CPU devices, in a subprocess) the table is
split along d_model and the tokens along the batch; the compiled forward and backward of the model's loss
must not replicate the (B, L, D) cotangent of the lookup on every device (XLA's "Involuntary full
rematerialization", an all-gather of the whole float32 B x L x D), and XLA prints no such warning.

And ``lm._lookup_split``, the lookup's layout, on abstract meshes: the table's own d_model axes and the
batch axes they leave free, or None where the trainer leaves d_model whole.

Axis legend: B batch, L sequence, D model width.
"""
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from models import lm
from training import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, L, D = 8, 32, 32

_DRIVER = """
import sys
sys.path.insert(0, {root!r})
import flax.linen as nn, jax, jax.numpy as jnp
from configs import shrunken
from models import abstract_variables
from training import config as config_lib, sharding as sh, step

config = shrunken.shrunken_config(**{{"model.pattern": "-", "model.d_model": {d}}})
model = step.build_model(config_lib.resolve_model_config(config.model), "bf16")
mesh = jax.make_mesh(sh.mesh_shape(dict(data=2, fsdp=2), 4), sh.MESH_AXES,
                     axis_types=(jax.sharding.AxisType.Auto,) * len(sh.MESH_AXES))
with sh.mesh_context(mesh):
  boxed = abstract_variables(model)["params"]
params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed),
                      sh.logical_shardings(boxed, mesh))
assert params["embed"]["embedding"].sharding.spec[1] == "fsdp", params["embed"]   # (V, D): D split
with sh.mesh_context(mesh):
  tokens = jax.ShapeDtypeStruct(({b}, {l} + 1), jnp.int32, sharding=sh.batch_sharding(mesh))
  grad = jax.jit(jax.grad(lambda p, t: step.model_loss(model, p, t[:, :-1], t[:, 1:], jax.random.key(0))))
  print("HLO " + grad.lower(params, tokens).compile().as_text().replace(chr(10), " "))
"""


def test_lookup_backward_does_not_replicate_the_cotangent():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", _DRIVER.format(root=ROOT, b=B, l=L, d=D)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "Involuntary full rematerialization" not in p.stderr, p.stderr
  hlo = [l for l in p.stdout.splitlines() if l.startswith("HLO ")][-1]
  assert "all-to-all" in hlo   # the lookup's result moved from the table's layout to the residual's
  # No activation (B, L, any width) is all-gathered: neither the lookup's result nor its cotangent.
  assert not re.findall(rf"= (?:f32|bf16)\[{B},{L},\d+\]\S* all-gather\(", hlo), hlo


def _abstract_mesh(**sizes):
  shape = tuple(sizes.get(a, 1) for a in sharding.MESH_AXES)
  return AbstractMesh(shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("sizes, d_model, want", [
    (dict(data=2, fsdp=2), 32, ("data", "fsdp")),
    (dict(data=2, fsdp=4), 64, ("data", "fsdp")),
    (dict(fsdp=4), 64, (None, "fsdp")),
    (dict(data=2, fsdp=2, expert=2), 64, ("data", ("fsdp", "expert"))),
    (dict(data=2, fsdp=2, expert=2), 32, (("data", "expert"), "fsdp")),   # too narrow for fsdp x expert
    (dict(data=2, fsdp=4), 32, None),    # too narrow for fsdp: the trainer replicates the table
    (dict(data=4), 32, None),
])
def test_lookup_runs_in_the_tables_layout(sizes, d_model, want):
  with jax.sharding.use_abstract_mesh(_abstract_mesh(**sizes)), nn.logical_axis_rules(sharding.LOGICAL_RULES):
    assert lm._lookup_split(8, d_model) == want   # pylint: disable=protected-access
