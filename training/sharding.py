"""Mesh, logical-axis rules and array placement. Every version-specific JAX sharding call lives here.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters and optimizer state
sharded along it), ``expert`` (expert parallel: the routed experts split along it, exchanged tokens by
all-to-all, ``models.expert_parallel``; for every other layer a data-parallel axis), ``tensor`` (model
parallel). The batch is split over ``(data, fsdp, expert)``.

Weights gathered per step (``config.mesh.fsdp_gather``): "per_layer" (the default) gathers each layer's weights over
``fsdp`` where the layer runs, in every micro-batch (three times with full remat); "per_step" gathers them over
``fsdp`` once per optimizer step, ahead of the micro-batches (``StepGather``), and the layers run under
``rules_without(("fsdp",))``: their weights arrive whole along ``fsdp``, while each gradient is still reduced to
its ``fsdp`` shard as the backward completes it, in every micro-batch.

Gradients reduced per step (``config.mesh.grad_reduce``, with micro-batches and ``fsdp_gather`` "per_step"):
"per_micro_batch" (the default) reduces each gradient over every batch axis in every micro-batch, as above;
"per_step" accumulates the micro-batches' gradients unreduced over ``data`` and ``fsdp`` (``UNREDUCED_AXES``, the
axes a multi-node layout puts across the nodes) and reduces them over those axes once, after the last
micro-batch: the micro-batches run inside a ``shard_map`` manual over those axes (``StepGather.unreduced``),
each device's share of the batch its own, under ``manual_rules``; the reductions within the other axes
(``expert``, ``tensor``: inside a node) stay per micro-batch. The float32 sum is then whole along ``fsdp`` on
every device: memory for traffic (docs/TRAINING.md, "Gradients reduced once per step").

Nodes: ``config.mesh.<axis>`` is an axis's size; ``config.mesh.dcn_<axis>`` (default 1) is how many nodes it
spans, its across-node factor, so its within-node factor is ``<axis> / dcn_<axis>``. With a factor set, the mesh
is laid out in nodes (``mesh_devices``): along each axis, index ``j = node_index * within + position_in_node``, so
the within-node factors of every axis are neighbours inside one node (NVLink) and only the across-node factors
reach over the network. Without one, the mesh is ``jax.make_mesh``'s flat one (devices in id order).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from models import axes as axes_lib
from training.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")
FSDP_GATHERS = ("per_layer", "per_step")   # config.mesh.fsdp_gather: when the weights are gathered over fsdp
GRAD_REDUCES = ("per_micro_batch", "per_step")   # config.mesh.grad_reduce: when gradients are reduced over nodes
UNREDUCED_AXES = ("data", "fsdp")   # the batch axes a "per_step" reduction defers (expert parallel: per layer)
NODE_KEYS = tuple(f"dcn_{a}" for a in MESH_AXES)   # each axis's across-node factor
BATCH_AXES = ("data", "fsdp", "expert")

# The one rules table: each logical axis name the model uses -> mesh axes (None: replicated).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters: matrices split along d_model over fsdp and over expert (which is data-parallel for every
    # layer but the routed experts: without it each expert rank kept a whole copy of the dense layers' state,
    # 9.9 of Super's 31.4 GiB per GPU), over tensor along their other axis. The stored experts come first:
    # their leading axis takes expert and fsdp, so their d_model (non-latent experts) stays whole.
    ("expert_kernels", ("expert", "fsdp")),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("qkv", "tensor"),
    ("heads", "tensor"),
    ("ssm_in", "tensor"),
    ("ssm_conv", "tensor"),
    ("conv_width", None),
    ("ssm_inner", "tensor"),
    ("ssm_heads", "tensor"),
    ("experts", "expert"),
    # The latent width: fsdp where no other axis of the array took it (fc1/fc2_latent_proj's embed does, and
    # the stored experts' leading axis does: their (E, Q, F) kernels are gathered over fsdp per layer along
    # E, the major axis, and their gradients reduce-scattered along it; this saves no memory: the float32
    # (Q, R, E, F) buffers at the peak are the backward's gradient accumulators, not transposed kernel copies:
    # docs/DESIGN.md, "Super's memory: what is live at the peak, XLA's budget, the state over every GPU").
    ("moe_latent", "fsdp"),
    # Activations: the batch over (data, fsdp, expert), model axes over tensor, d_model whole.
    ("activation_batch", BATCH_AXES),
    ("activation_seq", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_head_dim", None),
    ("activation_vocab", "tensor"),
    ("activation_ssm_heads", "tensor"),
    ("activation_ssm_groups", None),
    ("activation_ssm_state", None),
)


def _drop(axes, mesh_axes):
  """A dimension's mesh axes (None, a name or a tuple of names) without ``mesh_axes``."""
  kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in mesh_axes)
  return kept[0] if len(kept) == 1 else kept or None


def rules_without(mesh_axes) -> tuple:
  """``LOGICAL_RULES`` with ``mesh_axes`` taken out of every parameter's rule (``models.axes.PARAM_AXIS_NAMES``;
  the activations' rules unchanged): the table the layers run under when their weights arrive gathered over
  ``mesh_axes`` (``StepGather``), so that no layer gathers them again."""
  return tuple((name, _drop(axes, mesh_axes) if name in axes_lib.PARAM_AXIS_NAMES else axes)
               for name, axes in LOGICAL_RULES)


def manual_rules(mesh_axes) -> tuple:
  """``LOGICAL_RULES`` with ``mesh_axes`` taken out of every rule, the activations' too: the table inside a
  ``shard_map`` manual over ``mesh_axes``, where each device's share of the batch is its own and no constraint
  may name them."""
  return tuple((name, _drop(axes, mesh_axes)) for name, axes in LOGICAL_RULES)


def without(named: NamedSharding, mesh_axes) -> NamedSharding:
  """``named`` with ``mesh_axes`` taken out of its spec: the same array whole along them."""
  return NamedSharding(named.mesh, P(*(_drop(a, mesh_axes) for a in named.spec)))


@dataclasses.dataclass(frozen=True)
class StepGather:
  """The weights gathered over the mesh axes ``axes`` once per optimizer step (``config.mesh.fsdp_gather``
  "per_step"): ``stored``, the parameters' NamedShardings (a tree like the params: where they and their
  gradients live), and ``gathered``, the same without ``axes`` (where the micro-batches read them).
  ``unreduced`` (``config.mesh.grad_reduce`` "per_step"; () otherwise): the mesh axes over which the
  micro-batches' gradients are summed unreduced, each device its own, and reduced once per step
  (``training.step.accumulate_gradients_unreduced``)."""
  axes: tuple[str, ...]
  stored: Any
  gathered: Any
  unreduced: tuple[str, ...] = ()

  def gather(self, params):
    """``params`` (in the compute dtype, placed as ``stored``) placed as ``gathered``: the gather, once."""
    return jax.tree.map(jax.lax.with_sharding_constraint, params, self.gathered)

  def gather_codes(self, codes):
    """``codes`` (``models.lm.quantize_experts_ahead``'s: at some kernels' paths, a tree of arrays whose leading
    axes are the kernel's but its last two, the codes' the kernel's rank) placed as their kernels are gathered
    along those leading axes and whole along the rest: the gather of codes and scales in place of the kernels'."""
    gathered = traverse_util.flatten_dict(self.gathered)

    def place(path, tree):
      named = gathered[path]
      spec = tuple(named.spec)[:max(a.ndim for a in jax.tree.leaves(tree)) - 2]   # the leading axes' entries
      return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
          a, NamedSharding(named.mesh, P(*(spec + (None,) * a.ndim)[:a.ndim]))), tree)

    return traverse_util.unflatten_dict({path: place(path, q) for path, q in traverse_util.flatten_dict(codes).items()})

  @property
  def rules(self) -> tuple:
    """The rules table the micro-batches run under: inside the ``shard_map`` (``manual_rules``) with
    ``unreduced``, else ``rules_without(axes)``."""
    return manual_rules(self.axes + self.unreduced) if self.unreduced else rules_without(self.axes)


def check_fsdp_gather(how) -> None:
  """A ConfigError unless ``how`` (``config.mesh.fsdp_gather``) is one of ``FSDP_GATHERS``."""
  if how not in FSDP_GATHERS:
    raise ConfigError(f"config.mesh.fsdp_gather={how!r} must be one of {FSDP_GATHERS}: when the weights are gathered "
                      "over fsdp (per_step: once per optimizer step, ahead of the micro-batches; docs/TRAINING.md, "
                      "\"Laying out a multi-node run\")")


def check_grad_reduce(how, fsdp_gather) -> None:
  """A ConfigError unless ``how`` (``config.mesh.grad_reduce``) is one of ``GRAD_REDUCES`` and, for "per_step",
  the weights are gathered per step (``fsdp_gather``): the micro-batches must find them whole along ``fsdp``."""
  if how not in GRAD_REDUCES:
    raise ConfigError(f"config.mesh.grad_reduce={how!r} must be one of {GRAD_REDUCES}: when the gradients are reduced "
                      "over data and fsdp (per_step: once per optimizer step, after the micro-batches; "
                      "docs/TRAINING.md, \"Gradients reduced once per step\")")
  if how == "per_step" and fsdp_gather != "per_step":
    raise ConfigError(f"config.mesh.grad_reduce='per_step' needs config.mesh.fsdp_gather='per_step' (got "
                      f"{fsdp_gather!r}): the micro-batches then run on weights gathered whole along fsdp once per "
                      "step; set both, or leave grad_reduce='per_micro_batch'")


def step_gather(mesh_config, param_shardings, micro_batches: int = 1) -> StepGather | None:
  """The ``StepGather`` of ``config.mesh.fsdp_gather`` "per_step" for parameters placed as ``param_shardings``,
  or None ("per_layer", or an ``fsdp`` axis of size 1 without unreduced axes: nothing to gather). With
  ``config.mesh.grad_reduce`` "per_step" and more than one micro-batch, its ``unreduced`` are the
  ``UNREDUCED_AXES`` of size > 1 (with one micro-batch every reduction is once per step already)."""
  how = mesh_config.get("fsdp_gather", "per_layer")
  check_fsdp_gather(how)
  reduce = mesh_config.get("grad_reduce", "per_micro_batch")
  check_grad_reduce(reduce, how)
  leaves = jax.tree.leaves(param_shardings)
  if not leaves:
    return None
  axes, unreduced = _step_axes(how, reduce, leaves[0].mesh.shape, micro_batches)
  if not axes and not unreduced:
    return None
  return StepGather(axes, param_shardings, jax.tree.map(lambda s: without(s, axes), param_shardings), unreduced)


def _step_axes(how, reduce, shape, micro_batches: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the axes the weights are gathered over once per step, the axes the gradients are reduced over once per
  step) of ``fsdp_gather`` ``how`` and ``grad_reduce`` ``reduce`` on a mesh of ``shape`` (axis -> size)."""
  if how == "per_layer":
    return (), ()
  axes = ("fsdp",) if shape["fsdp"] > 1 else ()
  unreduced = (tuple(a for a in UNREDUCED_AXES if shape[a] > 1)
               if reduce == "per_step" and micro_batches > 1 else ())
  return axes, unreduced


def describe_step(mesh_config, shape, micro_batches: int) -> str:
  """"" when every weight is gathered per layer and every gradient reduced per micro-batch; else what is done
  once per step (``step_gather``) on a mesh of ``shape`` (axis -> size)."""
  axes, unreduced = _step_axes(mesh_config.get("fsdp_gather", "per_layer"),
                               mesh_config.get("grad_reduce", "per_micro_batch"), shape, micro_batches)
  parts = ([f"weights gathered over {' x '.join(axes)} once per step"] if axes else []) + \
      ([f"gradients reduced over {' x '.join(unreduced)} once per step"] if unreduced else [])
  return "; ".join(parts)


def use_compilation_cache(path: str) -> None:
  """JAX's persistent compilation cache in ``path``: a rerun or a resume skips XLA compilation."""
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def mesh_shape(mesh_config, device_count: int) -> tuple[int, int, int, int]:
  """(data, fsdp, expert, tensor) sizes with a -1 axis filled in; a ConfigError unless they multiply to the
  devices. An axis the config does not name is 1 (run directories written before the ``expert`` axis)."""
  sizes = [mesh_config.get(a, 1) for a in MESH_AXES]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if device_count % known:
      raise ConfigError(f"config.mesh={dict(zip(MESH_AXES, sizes))}: the fixed axes ({known}) do not divide the "
                        f"{device_count} devices; choose sizes whose product divides {device_count}")
    sizes[sizes.index(-1)] = device_count // known
  if math.prod(sizes) != device_count:
    raise ConfigError(f"config.mesh={dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but "
                      f"{device_count} are available; make data * fsdp * expert * tensor = {device_count} "
                      "(or set one axis to -1)")
  return tuple(sizes)


def node_factors(mesh_config, sizes, devices_per_node: int, device_count: int) -> tuple[int, int, int, int]:
  """(data, fsdp, expert, tensor) across-node factors (``config.mesh.dcn_<axis>``, 1 where unset) of a mesh of
  ``sizes``; a ConfigError unless each divides its axis and together they span exactly the nodes of
  ``devices_per_node`` devices (so the within-node factors fill one node). All 1: no node layout (flat)."""
  dcn = tuple(mesh_config.get(k, 1) for k in NODE_KEYS)
  if dcn == (1,) * len(MESH_AXES):
    return dcn
  layout = ", ".join(f"{a}={s} (dcn_{a}={n})" for a, s, n in zip(MESH_AXES, sizes, dcn))
  for axis, size, n in zip(MESH_AXES, sizes, dcn):
    if size % n:
      raise ConfigError(f"config.mesh.dcn_{axis}={n} does not divide config.mesh.{axis}={size}: dcn_{axis} is the "
                        f"nodes the {axis} axis spans, its size = within-node x across-node factor; choose a "
                        f"dcn_{axis} that divides {size}")
  if device_count % devices_per_node:
    raise ConfigError(f"config.mesh.devices_per_node={devices_per_node} does not divide the {device_count} devices; "
                      "set it to the GPUs of one node (0: the devices of one process)")
  nodes = device_count // devices_per_node
  if math.prod(dcn) != nodes:
    raise ConfigError(f"config.mesh {layout}: the across-node factors multiply to {math.prod(dcn)} nodes, but the "
                      f"{device_count} devices are {nodes} node(s) of {devices_per_node}; make dcn_data x dcn_fsdp x "
                      f"dcn_expert x dcn_tensor = {nodes}, or set config.mesh.devices_per_node to the devices of one "
                      "node (0: the devices of one process)")
  return dcn


def node_grid(devices, sizes, dcn, devices_per_node: int) -> np.ndarray:
  """``devices`` as a mesh of ``sizes`` laid out in nodes: in (process, id) order each run of ``devices_per_node``
  is a node; node ``n`` (row-major over the ``dcn`` factors) holds, along each axis, the indices ``n_axis *
  within + i`` for ``i`` in ``range(within)``, its devices in order (row-major over the within-node factors).
  This is ``jax.experimental.mesh_utils.create_hybrid_device_mesh``'s arrangement with a node as its granule
  (tests/test_mesh_nodes.py checks that they agree), for devices that do not say their node: one process's
  simulated CPU devices, or a deviceless GPU topology's. Validated input (``node_factors``)."""
  within = [s // n for s, n in zip(sizes, dcn)]
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  k = len(dcn)
  grid = np.asarray(ordered, dtype=object).reshape(tuple(dcn) + tuple(within))
  interleaved = [i for axis in range(k) for i in (axis, k + axis)]   # (dcn_0, within_0, dcn_1, within_1, ...)
  return grid.transpose(interleaved).reshape(tuple(sizes))


def mesh_devices(mesh_config, devices) -> np.ndarray:
  """``devices`` arranged as the mesh of ``mesh_config``: flat (jax.make_mesh's order) without across-node
  factors; with them, nodes of ``config.mesh.devices_per_node`` devices (0: those of one process) laid out by
  ``create_hybrid_device_mesh`` where each process is one node, else by ``node_grid``."""
  sizes = mesh_shape(mesh_config, len(devices))
  per_process = collections.Counter(d.process_index for d in devices)
  devices_per_node = mesh_config.get("devices_per_node", 0) or per_process[devices[0].process_index]
  dcn = node_factors(mesh_config, sizes, devices_per_node, len(devices))
  if dcn == (1,) * len(MESH_AXES):
    return jax.make_mesh(sizes, MESH_AXES, devices=devices).devices
  if set(per_process.values()) == {devices_per_node}:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    within = [s // n for s, n in zip(sizes, dcn)]
    return mesh_utils.create_hybrid_device_mesh(within, dcn, devices, process_is_granule=True)
  return node_grid(devices, sizes, dcn, devices_per_node)


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """The mesh of ``mesh_config`` over ``devices`` (default: every device), laid out in nodes where the config
  gives across-node factors (``mesh_devices``)."""
  grid = mesh_devices(mesh_config, jax.devices() if devices is None else list(devices))
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def describe_nodes(mesh_config, shape) -> str:
  """"" for a flat mesh; else which factors of the mesh of ``shape`` (axis -> size) lie within a node and which
  across nodes."""
  dcn = [mesh_config.get(k, 1) for k in NODE_KEYS]
  if all(n == 1 for n in dcn):
    return ""
  nodes = math.prod(dcn)
  inside = " x ".join(f"{a} {shape[a] // n}" for a, n in zip(MESH_AXES, dcn) if shape[a] // n > 1) or "nothing"
  across = " x ".join(f"{a} {n}" for a, n in zip(MESH_AXES, dcn) if n > 1)
  return f"{nodes} nodes of {math.prod(shape.values()) // nodes} devices: within a node {inside}; across nodes {across}"


@contextlib.contextmanager
def mesh_context(mesh):
  """The mesh and the rules table, for tracing: the model's logical sharding constraints resolve here."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    yield


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_ways(mesh) -> int:
  """How many ways the batch is split: data * fsdp * expert."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_experts(mesh_config, model_config) -> None:
  """A ConfigError unless the ``expert`` mesh axis fits the model: 1, or a divisor of the routed experts of a
  model that has ``E`` blocks."""
  ep = mesh_config.get("expert", 1)
  if ep in (1, -1):
    return
  if "E" not in model_config.pattern:
    raise ConfigError(f"config.mesh.expert={ep} but the model's pattern {model_config.pattern!r} has no MoE "
                      "(E) block; set config.mesh.expert=1 and use config.mesh.data for data parallelism")
  if model_config.n_routed_experts % ep:
    divisors = [d for d in range(1, model_config.n_routed_experts + 1) if model_config.n_routed_experts % d == 0]
    raise ConfigError(f"config.mesh.expert={ep} does not divide n_routed_experts={model_config.n_routed_experts}"
                      f"; choose an expert-parallel size in {divisors}")


def batch_sharding(mesh) -> NamedSharding:
  """``tokens_BxW`` (and ``segment_ids_BxW``): rows split over (data, fsdp, expert), the sequence whole."""
  return NamedSharding(mesh, P(BATCH_AXES, None))


def _fit(spec: P, shape, mesh) -> P:
  """Drops mesh axes from dimensions they do not cut into whole 16-element units (``models.axes.fit_spec``).

  Matrices (rank >= 2) are sharded only where every shard holds whole multiples of 16 along the
  dimension, so NVFP4's 1x16 blocks and 16x16 weight tiles never straddle a shard boundary and each
  shard quantizes locally; vectors, and the leading axes of stacked matrices (the experts' (E, in, out)),
  only need divisibility. Tiny models on big meshes stay valid (the axes that do not fit are replicated).
  """
  return axes_lib.fit_spec(spec, shape, mesh.shape)


def logical_shardings(abstract_boxed, mesh):
  """NamedShardings for a tree whose leaves may carry logical axis names (``nn.with_logical_partitioning``)."""
  specs = nn.get_partition_spec(abstract_boxed)
  mesh_specs = nn.logical_to_mesh(specs, LOGICAL_RULES)
  abstract = nn.unbox(abstract_boxed)
  return jax.tree.map(lambda s, x: NamedSharding(mesh, _fit(s, x.shape, mesh)), mesh_specs, abstract,
                      is_leaf=lambda s: isinstance(s, P))


def host_batch_to_global(local_batch, mesh):
  """This process's rows -> global arrays split over the batch axes; the global batch is P times as tall.
  ``local_batch``: ``tokens_BxW``, or a dict of such arrays (the tokens and their segment ids)."""
  sharding = batch_sharding(mesh)

  def to_global(local_BxW: np.ndarray) -> jax.Array:
    shape = (local_BxW.shape[0] * jax.process_count(),) + local_BxW.shape[1:]
    return jax.make_array_from_process_local_data(sharding, local_BxW, shape)
  return jax.tree.map(to_global, local_batch)


def to_host(tree):
  """Fully replicated device values -> numpy on every process."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)


def any_process(flag: bool) -> bool:
  """Whether ``flag`` is true on any process (a collective: call it on all processes at the same step)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def train_state_shardings(abstract_state, tx, mesh):
  """``(abstract state with params unboxed, its NamedShardings)`` for the state of ``step.init_state``.

  ``abstract_state``: ``jax.eval_shape`` of ``init_state`` traced under ``mesh_context(mesh)`` (params still
  boxed with logical axis names). Parameters and the optimizer moments that mirror them follow the rules
  table, as does OsciReset's state (``osci_reset``, per tracked kernel three arrays of its shape); every
  other leaf (step, rng, counters, optimizer counts) is replicated.
  """
  repl = replicated(mesh)
  param_sh = logical_shardings(abstract_state["params"], mesh)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_state["opt_state"], param_sh,
                                 transform_non_params=lambda _: repl)
  state_sh = dict(step=repl, params=param_sh, opt_state=opt_sh, rng=repl, nonfinite_total=repl,
                  nonfinite_streak=repl)
  if "osci_reset" in abstract_state:
    flat_sh = traverse_util.flatten_dict(param_sh)
    state_sh["osci_reset"] = traverse_util.unflatten_dict(
        {path: jax.tree.map(lambda _, s=flat_sh[path]: s, leaf_state)
         for path, leaf_state in traverse_util.flatten_dict(abstract_state["osci_reset"]).items()})
  return dict(abstract_state, params=nn.unbox(abstract_state["params"])), state_sh
