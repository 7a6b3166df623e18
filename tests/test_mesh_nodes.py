"""A mesh laid out in nodes (``config.mesh.dcn_<axis>``, training/sharding.py): the placement agrees with jax's
``create_hybrid_device_mesh``, bad layouts are refused with the fix, and on 8 simulated CPU devices in 2 "nodes"
of 4 the compiled train step's collectives (read from its HLO: replica groups mapped through the mesh's device
order, as the ruler maps them) span the nodes as the layout says.

The recommended layout (data across the nodes, fsdp and expert within) is the flat mesh's device order too:
``data`` is the mesh's major axis. The layout with fsdp across the nodes is not; there the compiled weight
gathers must cross the nodes, and with the flat mesh they would not (the test that fails without the layout).
"""
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.experimental import mesh_utils

from bench.predict import cluster, hlo_text, hlo_walk
from configs import shrunken
from training import config as config_lib
from training import sharding
from training.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class _Device:
  """What the placement reads of a device: its id and process (a GPU's kind, so jax applies no TPU layout)."""
  id: int
  process_index: int
  platform: str = "gpu"
  device_kind: str = "NVIDIA B200"


def _ids(grid) -> np.ndarray:
  return np.vectorize(lambda d: d.id)(grid)


def _layouts(sizes, nodes):
  """Every split of ``sizes`` into across-node factors that multiply to ``nodes``."""
  options = [[n for n in range(1, s + 1) if s % n == 0] for s in sizes]
  return [dcn for dcn in itertools.product(*options) if math.prod(dcn) == nodes]


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (4, 2, 2, 1), (1, 4, 4, 1), (2, 1, 8, 1)])
def test_node_grid_is_create_hybrid_device_mesh_with_a_node_as_its_granule(sizes):
  devices = [_Device(i, i // 4) for i in range(16)]   # 4 processes of 4: each process a node
  for dcn in _layouts(sizes, 4):
    within = [s // n for s, n in zip(sizes, dcn)]
    want = mesh_utils.create_hybrid_device_mesh(within, dcn, devices, process_is_granule=True)
    np.testing.assert_array_equal(_ids(sharding.node_grid(devices, sizes, dcn, 4)), _ids(want), err_msg=str(dcn))


def test_each_node_holds_the_within_node_factors_and_the_across_node_factors_span_the_nodes():
  """data 2 x fsdp 4 over 2 nodes of 4, fsdp across them (2) and within (2): moving along data or along fsdp's
  within-node part stays in a node; fsdp's across-node part changes it."""
  devices = [_Device(i, 0) for i in range(8)]   # one process: the nodes are runs of 4 ids
  node_BxF = _ids(sharding.node_grid(devices, (2, 4, 1, 1), (1, 2, 1, 1), 4))[:, :, 0, 0] // 4
  np.testing.assert_array_equal(node_BxF, [[0, 0, 1, 1], [0, 0, 1, 1]])


def test_processes_that_are_nodes_and_simulated_nodes_place_alike():
  config = dict(data=2, fsdp=4, expert=2, tensor=1, dcn_fsdp=2, devices_per_node=8)
  by_process = sharding.mesh_devices(config, [_Device(i, i // 8) for i in range(16)])   # create_hybrid_device_mesh
  simulated = sharding.mesh_devices(config, [_Device(i, 0) for i in range(16)])          # node_grid
  np.testing.assert_array_equal(_ids(by_process), _ids(simulated))
  np.testing.assert_array_equal(_ids(sharding.mesh_devices(dict(config, devices_per_node=0),
                                                           [_Device(i, i // 8) for i in range(16)])),
                                _ids(by_process))   # 0: a node is a process's devices


@pytest.mark.parametrize("config, devices, phrase", [
    (dict(data=2, fsdp=4, dcn_fsdp=3, devices_per_node=4), 8, r"dcn_fsdp=3 does not divide config.mesh.fsdp=4"),
    (dict(data=2, fsdp=4, dcn_data=2, dcn_fsdp=2, devices_per_node=4), 8,
     r"multiply to 4 nodes, but the 8 devices are 2 node\(s\) of 4; make dcn_data x dcn_fsdp"),
    (dict(data=8, dcn_data=2), 8, r"2 nodes, but the 8 devices are 1 node\(s\) of 8.*devices_per_node"),
    (dict(data=8, dcn_data=2, devices_per_node=3), 8, r"devices_per_node=3 does not divide the 8 devices"),
])
def test_a_layout_that_does_not_fit_the_nodes_is_refused(config, devices, phrase):
  with pytest.raises(ConfigError, match=phrase):
    sharding.mesh_devices(config, [_Device(i, 0) for i in range(devices)])


@pytest.mark.parametrize("overrides, phrase", [
    ({"mesh.dcn_data": 0}, r"config.mesh.dcn_data=0 must be a positive integer"),
    ({"mesh.data": 4, "mesh.dcn_data": 3}, r"config.mesh.dcn_data=3 does not divide config.mesh.data=4"),
    ({"mesh.devices_per_node": -1}, r"config.mesh.devices_per_node=-1 must be the devices of one node"),
    ({"mesh.fsdp_gather": "per_micro_batch"}, r"config.mesh.fsdp_gather='per_micro_batch' must be one of"),
    ({"mesh.grad_reduce": "per_layer"}, r"config.mesh.grad_reduce='per_layer' must be one of"),
    ({"mesh.grad_reduce": "per_step"}, r"grad_reduce='per_step' needs config.mesh.fsdp_gather='per_step'"),
    ({"mesh.grad_reduce": "per_step", "mesh.fsdp_gather": "per_step", "recipe": "nvfp4"},
     r"grad_reduce='per_step' with the nvfp4 recipe: .* use the bf16 recipe or set config.mesh.grad_reduce="),
    ({"mesh.grad_reduce": "per_step", "mesh.fsdp_gather": "per_step", "model.attention_impl": "cudnn"},
     r"grad_reduce='per_step' with cuDNN attention: .* set config.model.attention_impl='chunked'"),
])
def test_the_config_check_refuses_bad_node_factors(overrides, phrase):
  with pytest.raises(ConfigError, match=phrase):
    config_lib.validate(shrunken.shrunken_config(**overrides))


def test_super_keeps_the_experts_in_a_node_and_spans_the_nodes_with_fsdp():
  """configs/nemotron3_super.py on 8 HGX nodes of 8 (one process each): each expert group (the all-to-all's) is one
  node's 8 GPUs; each fsdp group takes one GPU of each of the 8 nodes."""
  from test_train_config import _load   # pylint: disable=import-outside-toplevel,import-error
  c = _load(os.path.join(ROOT, "configs", "nemotron3_super.py"))
  config_lib.validate(c)
  grid = _ids(sharding.mesh_devices(c.mesh, [_Device(i, i // 8) for i in range(64)]))
  assert grid.shape == (1, 8, 8, 1)
  node_FxE = grid[0, :, :, 0] // 8
  assert all(len(set(row)) == 1 for row in node_FxE)      # an expert group: one node
  assert all(len(set(col)) == 8 for col in node_FxE.T)    # an fsdp group: every node
  assert sharding.describe_nodes(c.mesh, dict(zip(sharding.MESH_AXES, grid.shape))) == \
      "8 nodes of 8 devices: within a node expert 8; across nodes fsdp 8"


# moe_tiny's E block alone, 4 experts, 2 per token, in bf16, 2 micro-batches; one expert group, as Super's router
# (group-limited routing's scatter of the chosen groups is gathered over the batch by XLA's partitioner).
SHRUNKEN_MOE_E = dict(d_model=32, pattern="E", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
                      ssm_head_dim=16, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, moe_latent_size=16,
                      n_group=1, topk_group=1, bf16_first_blocks=0, bf16_last_blocks=0)
# Two of them scanned (models.lm's scan_blocks), as Super's blocks are: a layer's weights are sliced out of the
# stacked ones inside the loop over blocks, so XLA cannot hoist their gathers out of the micro-batches' loop (it
# does hoist those of an unscanned layer's small weights by itself).
SCANNED_MOE_E = dict(SHRUNKEN_MOE_E, pattern="EE", scan_blocks=True)


def node_collectives(text: str, order: list[int], node) -> list[dict]:
  """Each collective of a compiled module's text: its kind, whether its groups span nodes of the cluster
  ``node`` (partitions placed on the devices ``order``), its op_name and shape, and how many times it runs per
  step (its computation's executions: loop trips included)."""
  mod = hlo_walk.Module(text)
  runs = mod.multipliers()
  rows = []
  for comp, instrs in mod.comps.items():
    for ins in instrs:
      kind = hlo_text.collective(ins)
      if kind is not None:
        where = cluster.placement(cluster.replica_groups(ins.attrs, len(order)), node, order)
        rows.append(dict(kind=kind, crosses=where.crosses_nodes, op=ins.op_name, shape=ins.shape[:80],
                         runs=runs.get(comp, 0)))
  return rows


NODE = 4
LAYOUTS = {   # data 2 x fsdp 2 x expert 2 over 2 nodes of 4, one factor across them
    "data_across": {"mesh.dcn_data": 2},
    "fsdp_across": {"mesh.dcn_fsdp": 2},
    "fsdp_across_per_step": {"mesh.dcn_fsdp": 2, "mesh.fsdp_gather": "per_step"},
    "fsdp_across_reduced_per_step": {"mesh.dcn_fsdp": 2, "mesh.fsdp_gather": "per_step", "mesh.grad_reduce": "per_step"},
}
MICRO_BATCHES = 2   # the driver's step: 16 rows in 2 micro-batches

_DRIVER = r"""
import json, os, sys
sys.path.insert(0, {root!r})
from bench import scale
from bench.predict import cluster
from configs import shrunken
from training import sharding
sys.path.insert(0, os.path.join({root!r}, "tests"))
from test_mesh_nodes import node_collectives

node = cluster.Cluster("simulated", {node}, 1.0, 1.0, 0.0, 0.0)
out = {{}}
for name, layout in {layouts!r}.items():
  fields = {{"data.seq_len": 32, "batch_size": 16, "micro_batches": {micro}, "mesh.data": 2, "mesh.fsdp": 2,
            "mesh.expert": 2, "mesh.tensor": 1, "mesh.devices_per_node": {node}}}
  c = shrunken.shrunken_config(steps=2, recipe={recipe!r}, **dict(fields, **layout))
  c.model.preset = "moe_tiny"
  for k, v in {model!r}.items():
    c.model[k] = v
  mesh = sharding.make_mesh(c.mesh)
  built = scale.build_step(c, mesh, 1)
  with sharding.mesh_context(mesh):
    text = built["step_fn"].lower(built["state_in"], built["batch_in"]).compile().as_text()
  order = [d.id for d in mesh.devices.flat]
  out[name] = dict(order=order, collectives=node_collectives(text, order, node))
print("RESULT " + json.dumps(out))
"""


def _compiled_collectives(layouts=None, recipe="bf16"):
  env = dict(os.environ, **shrunken.compilation_cache_env(), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 " + shrunken.READ_ONLY_COMPILE_XLA_FLAGS)
  code = _DRIVER.format(root=ROOT, node=NODE, layouts=layouts or LAYOUTS, model=SCANNED_MOE_E, micro=MICRO_BATCHES,
                        recipe=recipe)
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
  return json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])


def _reduction(c) -> bool:
  """A collective that sums gradients (or statistics) over the batch: an all-reduce, or the exchange XLA makes
  of the embedding table's gradient (the backward of the token lookup, a scatter-add over the batch's tokens)."""
  return c["kind"] == "all-reduce" or ("transpose(" in c["op"] and "embed/jit(_take)/scatter-add" in c["op"])


def _cpu_top_k(c) -> bool:
  """The router's top-k on the CPU: XLA's CPU partitioner gathers the TopK custom call's operand over the batch
  (the GPU sorts each device's rows where they are: bench/predict/gpu_aot.py's 16-GPU compile has no such
  gather, tests/test_gpu_aot_nodes.py)."""
  return c["kind"] == "all-gather" and "moe_router/top_k" in c["op"]


@pytest.fixture(scope="module")
def compiled():
  return _compiled_collectives()


def test_with_data_across_the_nodes_only_reductions_cross_them(compiled):
  """Per layer the step gathers weights over fsdp and expert and sends tokens to their experts by all-to-all:
  with data across the nodes every such collective stays in a node. What crosses is the gradient reduction
  over data (and the loss's and MoE loads' sums)."""
  rows = compiled["data_across"]["collectives"]
  assert compiled["data_across"]["order"] == list(range(8))   # data is the major axis: the flat order
  crossing = [c for c in rows if c["crosses"]]
  assert [c for c in crossing if not (_reduction(c) or _cpu_top_k(c))] == []
  assert any(c["kind"] == "all-reduce" and "transpose(" in c["op"] for c in crossing), crossing   # the gradients
  inside = [c for c in rows if not c["crosses"]]
  assert any(c["kind"] == "all-gather" and "dot_general" in c["op"] for c in inside)          # weight gathers
  assert any(c["kind"] == "reduce-scatter" for c in inside) or any(c["kind"] == "all-reduce" for c in inside)
  dispatch = [c for c in rows if c["kind"] in ("all-to-all", "ragged-all-to-all") and "blocks_0/mixer" in c["op"]]
  assert dispatch and not any(c["crosses"] for c in dispatch)                                 # expert exchange


def test_with_fsdp_across_the_nodes_the_weight_gathers_cross_them(compiled):
  """The same step with fsdp across the nodes and data within: the mesh's devices are not in id order, and the
  weight gathers over fsdp now span both nodes (with the flat mesh of the same shape they would not: data would
  span them)."""
  layout = compiled["fsdp_across"]
  assert layout["order"] == [0, 1, 4, 5, 2, 3, 6, 7]
  weight_gathers = [c for c in layout["collectives"] if c["kind"] == "all-gather" and not _cpu_top_k(c)
                    and ("dot_general" in c["op"] or "rmsnorm" in c["op"])]
  assert weight_gathers and any(c["crosses"] for c in weight_gathers), weight_gathers
  dispatch = [c for c in layout["collectives"] if c["kind"] in ("all-to-all", "ragged-all-to-all")
              and "blocks_0/mixer" in c["op"]]
  assert dispatch and not any(c["crosses"] for c in dispatch)


def _weight_gathers(rows) -> list[dict]:
  """The all-gathers of weights (floats or codes): not the tokens' (s32), not the CPU's top-k."""
  return [c for c in rows if c["kind"] == "all-gather" and not _cpu_top_k(c) and not c["shape"].startswith("s32")]


def test_weights_gathered_per_step_cross_the_nodes_once_per_step(compiled):
  """With fsdp across the nodes, ``mesh.fsdp_gather`` "per_layer" (the default) gathers each layer's weights over
  the network inside the loops over micro-batches and scanned blocks, once per micro-batch and block or more
  (full remat gathers again in the backward); "per_step" on the same layout gathers them across the nodes once
  per optimizer step, ahead of the micro-batches (the step's ``gather_weights`` scope, run once), and inside the
  micro-batches no weight gather crosses them (the gradients' reductions still do). The expert exchange stays
  in the node."""
  per_layer = [c for c in _weight_gathers(compiled["fsdp_across"]["collectives"]) if c["crosses"]]
  assert any(c["runs"] >= 2 * MICRO_BATCHES and "dot_general" in c["op"] for c in per_layer), per_layer
  rows = compiled["fsdp_across_per_step"]["collectives"]
  assert compiled["fsdp_across_per_step"]["order"] == compiled["fsdp_across"]["order"]
  crossing = [c for c in _weight_gathers(rows) if c["crosses"]]
  assert crossing and all(c["runs"] == 1 and "gather_weights" in c["op"] for c in crossing), crossing
  in_loop = [c for c in rows if c["crosses"] and "forward_backward/while" in c["op"]]
  assert _weight_gathers(in_loop) == [] and any(_reduction(c) for c in in_loop), in_loop
  dispatch = [c for c in rows if c["kind"] in ("all-to-all", "ragged-all-to-all") and "blocks_0/mixer" in c["op"]]
  assert dispatch and not any(c["crosses"] for c in dispatch)


@pytest.mark.slow
def test_nvfp4_experts_gathered_per_step_cross_the_nodes_as_codes():
  """NVFP4 experts (their GEMMs read the weight only through its fprop codes) with the weights gathered once per
  step: each device quantizes its own experts ahead of the gather (``models.lm.quantize_experts_ahead``), so what
  crosses the nodes for them is codes and scales (uint8), not the stacked kernels (the compute dtype: float32 in
  this shrunken config, bf16 in Super's). The dense layers' weights still cross as they are."""
  rows = _compiled_collectives({"per_step": LAYOUTS["fsdp_across_per_step"]}, "nvfp4")["per_step"]["collectives"]
  ahead = [c for c in _weight_gathers(rows) if c["crosses"] and "gather_weights" in c["op"] and c["runs"] == 1]
  rank = lambda c: c["shape"].split("]")[0].count(",") + 1
  assert [c for c in ahead if rank(c) == 4 and c["shape"].startswith(("f32", "bf16"))] == [], ahead
  assert any(rank(c) == 4 and c["shape"].startswith("u8") and "moe_experts" in c["op"] for c in ahead), ahead
  assert any(rank(c) < 4 and c["shape"].startswith("f32") for c in ahead), ahead   # the dense layers' weights


def test_gradients_reduced_per_step_cross_the_nodes_once_per_step(compiled):
  """With fsdp across the nodes and the weights gathered per step, ``mesh.grad_reduce`` "per_micro_batch" (the
  default) reduces the gradients across the nodes inside the loop over micro-batches, in every one of them;
  "per_step" sums them unreduced over data and fsdp through the loop and reduces them once, after it (the
  step's ``reduce_gradients`` scope): no collective inside the micro-batches crosses the nodes, and every one
  that does runs once per step. The expert exchange stays in the node."""
  per_micro_batch = [c for c in compiled["fsdp_across_per_step"]["collectives"]
                     if c["crosses"] and _reduction(c) and "forward_backward/while" in c["op"]]
  assert per_micro_batch and all(c["runs"] >= MICRO_BATCHES for c in per_micro_batch), per_micro_batch
  layout = compiled["fsdp_across_reduced_per_step"]
  assert layout["order"] == compiled["fsdp_across"]["order"]
  crossing = [c for c in layout["collectives"] if c["crosses"]]
  assert [c for c in crossing if c["runs"] != 1 or "/while" in c["op"]] == [], crossing
  reduced = [c for c in crossing if "reduce_gradients" in c["op"]]
  assert any(_reduction(c) for c in reduced), crossing
  dispatch = [c for c in layout["collectives"] if c["kind"] in ("all-to-all", "ragged-all-to-all")
              and "blocks_0/mixer" in c["op"]]
  assert dispatch and not any(c["crosses"] for c in dispatch)
