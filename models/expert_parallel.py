"""Expert parallelism: the routed experts split over the ``expert`` mesh axis, dropless, by all-to-all.

Where: the logical axis ``experts`` (the experts' leading axis) maps to the mesh axes of EP (the rules table,
``training.sharding``: ``experts -> expert``); those axes must also split the batch (``activation_batch``), so
each device of an EP group holds its own tokens and E / P of the experts. Inside ``shard_map`` (every mesh
axis manual), per device, with T its tokens and P the EP size:

  1. Sort its (token, choice) pairs by expert (stable: token order inside an expert): one slice per expert,
     slice e going to device e // (E / P).
  2. All-gather the pair counts (P, E): every device then knows the layout everywhere. On device j, expert
     e's segment holds the pairs of source 0, then source 1, ... (so the global token order, the 1-device
     order), and is padded with zero rows to the recipe's alignment; the segments of j's experts follow each
     other. Each source writes its slice straight at its place in that layout.
  3. Exchange (``exchange``): ``jax.lax.ragged_all_to_all`` where the backend has it; XLA:CPU has not
     ("HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter", jax 0.10.2), and there it is
     ``dense_ragged_all_to_all``, its twin on ``jax.lax.all_to_all`` with a fixed capacity per (sender,
     receiver) pair. The capacity is the worst case, so no pair is ever dropped: a token's R choices are R
     distinct experts, so it sends at most min(R, E / P) pairs to one device; capacity = T · min(R, E / P).
  4. Each device runs its experts' MLP (``fp4jax.grouped_dot``, its local group sizes) on the received rows:
     expert e's rows, order and zero padding are those of one device, and its key is fold_in(key, e) for
     the global e, so each expert's output is the 1-device per-expert dot, bit for bit (docs/NUMERICS.md's
     per-expert contract holds unchanged).
  5. The reverse exchange sends each output row back to its pair's place in the source's sorted order; the
     source un-sorts them to (T, R), and the caller weights and sums them as on one device.

The receive buffer is static: S = P · T · min(R, E / P) + (E / P)(A - 1) rows (rounded up to A), the worst
case of one device receiving every pair it can (dropless, the default). With a receive factor f
(``ModelConfig.moe_receive_factor``) a device takes at most B = ceil(f · T · R) pairs, f times its average
traffic, and S = min(B, the worst case) + (E / P)(A - 1), rounded up to A. Which pairs a device drops when more
than B are sent to it (``keep``, before the sort, so the rest of the exchange is the dropless one on the kept
pairs): the lowest-ranked choices first (rank = the column of the router's top-k, best first), all of rank 0
before any of rank 1, ...; inside the rank where the budget ends, the pairs of source 0 first, then source 1,
..., each source's in token order. A dropped pair's expert output is zero (it is never sent; its combine
weight multiplies a zero row), and the count of dropped pairs of the whole batch is returned (the train step's
metric ``moe/<block>/dropped``). Data parallelism outside the EP group (``data``, ``fsdp``) keeps each
replica's tokens apart: an expert's rows there are the replica's, quantized with their own amax.

Axis legend: T tokens (of this device inside shard_map), R = num_experts_per_tok, E experts, P EP size,
Q expert input width, S received rows, C capacity rows per (sender, receiver), B the receive budget (pairs).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import fp4jax


@dataclasses.dataclass(frozen=True)
class Layout:
  """The mesh axes of EP and of the batch, as the rules table maps ``experts`` and ``activation_batch``."""
  expert_axes: tuple[str, ...]
  batch_axes: tuple[str, ...]
  size: int

  @property
  def axis(self):
    return self.expert_axes[0] if len(self.expert_axes) == 1 else self.expert_axes


def _mesh_axes(logical: str) -> tuple[str, ...]:
  try:
    spec = nn.logical_to_mesh_axes((logical,))
  except ValueError:
    return ()
  axes = spec[0] if len(spec) else None
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def layout(n_experts: int, tokens: int) -> Layout | None:
  """The EP layout of the current trace (the ``jax.set_mesh`` mesh and flax's logical rules), or None when
  the experts are not split: no mesh, their mesh axes have size 1, or the batch axes do not divide the
  ``tokens`` (the one sequence that initializes the parameters, sampling): then the 1-device code runs,
  partitioned by GSPMD, with the 1-device values."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  expert_axes = tuple(a for a in _mesh_axes("experts") if a in mesh.axis_names)
  size = math.prod(mesh.shape[a] for a in expert_axes)
  if size == 1:
    return None
  batch_axes = tuple(a for a in _mesh_axes("activation_batch") if a in mesh.axis_names)
  if not set(expert_axes) <= set(batch_axes):
    raise ValueError(f"expert parallelism over mesh axes {expert_axes} needs them to split the batch too "
                     f"(activation_batch maps to {batch_axes}); add them to the batch axes of the rules table")
  if n_experts % size:
    raise ValueError(f"n_routed_experts={n_experts} is not divisible by the expert-parallel size {size} "
                     f"(mesh axes {expert_axes}); choose an expert mesh size that divides {n_experts}")
  if tokens % math.prod(mesh.shape[a] for a in batch_axes):
    return None
  return Layout(expert_axes, batch_axes, size)


# ---------------------------------------------------------------------------------------------------
# The exchange: lax.ragged_all_to_all, and its dense twin
# ---------------------------------------------------------------------------------------------------

def _slice_of_row(sizes_PxK, c: int):
  """For each destination (or source) p and row c < C of its packed block: the slice k the row is in
  (slices packed back to back in order), the row's index inside that slice, and whether it is a real row."""
  ends_PxK = jnp.cumsum(sizes_PxK, axis=1)
  rows_C = jnp.arange(c, dtype=jnp.int32)
  k_PxC = jax.vmap(lambda e: jnp.searchsorted(e, rows_C, side="right"))(ends_PxK)
  k_PxC = jnp.minimum(k_PxC, sizes_PxK.shape[1] - 1)
  within_PxC = rows_C - jnp.take_along_axis(ends_PxK - sizes_PxK, k_PxC, axis=1)
  valid_PxC = rows_C < ends_PxK[:, -1:]
  return k_PxC, within_PxC, valid_PxC


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                            axis_name, capacity: int):
  """``jax.lax.ragged_all_to_all``'s result from a dense ``jax.lax.all_to_all``: each sender packs the
  slices for each destination back to back into ``capacity`` rows (zeros after), the blocks are exchanged,
  and each receiver writes every received slice at the offset its sender chose. Exact (moves values only);
  ``capacity`` must be at least the rows any sender sends to one destination (rows past it are lost)."""
  p = jax.lax.axis_size(axis_name)
  k = send_sizes.shape[0] // p
  rest = operand.shape[1:]
  # 1. Pack: row c of the block for destination j is row (c - start of its slice) of that slice.
  send_PxK = send_sizes.reshape(p, k)
  kk, within, valid = _slice_of_row(send_PxK, capacity)
  src_PxC = jnp.take_along_axis(input_offsets.reshape(p, k), kk, axis=1) + within
  src_PxC = jnp.where(valid, src_PxC, 0)
  packed = jnp.where(valid.reshape(p, capacity, *(1,) * len(rest)), operand[src_PxC], 0).astype(operand.dtype)
  # 2. Exchange the blocks, and the offsets the senders chose for this device's slices.
  received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=False)
  offsets_PxK = jax.lax.all_to_all(output_offsets.reshape(p, k), axis_name, 0, 0, tiled=False)
  # 3. Write each real received row at its slice's offset plus its index in the slice.
  kk, within, valid = _slice_of_row(recv_sizes.reshape(p, k), capacity)
  dst_PxC = jnp.take_along_axis(offsets_PxK, kk, axis=1) + within
  dst_PxC = jnp.where(valid, dst_PxC, output.shape[0])       # out of bounds: dropped
  return output.at[dst_PxC.reshape(-1)].set(received.reshape(-1, *rest), mode="drop")


def _move(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, capacity: int,
          impl: str):
  if impl == "ragged":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
  if impl == "dense":
    return dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis_name, capacity=capacity)
  raise ValueError(f"exchange impl={impl!r}; use 'auto', 'ragged' or 'dense'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _move_and_back(axis_name, capacity, impl, rows, operand, output, offsets, back):
  """``_move`` with ``offsets`` whose gradient is ``_move`` of the cotangent with ``back`` (``exchange``'s
  ``reverse``); ``rows``: the operand's rows, for the zeros the reverse writes into."""
  del rows, back
  return _move(operand, output, *offsets, axis_name=axis_name, capacity=capacity, impl=impl)


def _move_and_back_fwd(axis_name, capacity, impl, rows, operand, output, offsets, back):
  del rows
  return _move(operand, output, *offsets, axis_name=axis_name, capacity=capacity, impl=impl), back


def _move_and_back_bwd(axis_name, capacity, impl, rows, back, ct):
  # The reverse writes into zeros typed as the cotangent (varying over the axes the rows vary over).
  zeros = jnp.zeros_like(ct, shape=(rows,) + ct.shape[1:])
  return _move(ct, zeros, *back, axis_name=axis_name, capacity=capacity, impl=impl), None, None, None


_move_and_back.defvjp(_move_and_back_fwd, _move_and_back_bwd)


def exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
             capacity: int, impl: str = "auto", reverse=None):
  """``jax.lax.ragged_all_to_all`` (impl "ragged") or its dense twin (impl "dense"); "auto": the twin on a
  CPU (XLA:CPU has no ragged all-to-all), else ragged (``fp4jax.target``: the program's devices).

  reverse: the (input_offsets, send_sizes, output_offsets, recv_sizes) of the exchange that sends every moved
  row back to where it came from, when the caller knows them on every device (``_local``: from the all-gathered
  counts). The gradient is then that exchange of the cotangent: the same rows moved, so the same values, without
  the two all-to-alls of the offsets that jax's own transpose of ragged_all_to_all issues to learn them (in
  Super's compiled step XLA held each of those open across the experts' backward; docs/PERF.md, "The exchange's
  gradient without its offsets' all-to-alls")."""
  if impl == "auto":
    impl = "dense" if fp4jax.target.current().platform == "cpu" else "ragged"
  offsets = (input_offsets, send_sizes, output_offsets, recv_sizes)
  if reverse is None:
    return _move(operand, output, *offsets, axis_name=axis_name, capacity=capacity, impl=impl)
  return _move_and_back(axis_name, capacity, impl, operand.shape[0], operand, output, offsets, tuple(reverse))


# ---------------------------------------------------------------------------------------------------
# Dispatch, the experts, combine
# ---------------------------------------------------------------------------------------------------

def budget(t: int, r: int, n_experts: int, size: int, factor: float | None) -> int:
  """B: the pairs one device takes (module docstring): every pair it can receive (factor None or 0), else
  ceil(factor · T · R), at most that worst case."""
  worst = size * t * min(r, n_experts // size)
  return worst if not factor else min(worst, math.ceil(factor * t * r))


def received_rows(t: int, r: int, n_experts: int, size: int, align: int, factor: float | None = None) -> int:
  """S: the static receive buffer of one device (module docstring): its budget of pairs, padded."""
  local = n_experts // size
  return -(-(budget(t, r, n_experts, size, factor) + local * (align - 1)) // align) * align


def keep(experts_TxR, *, n_experts: int, size: int, axis, limit: int):
  """(experts_TxR with each dropped pair's expert set to ``n_experts``, this device's dropped pairs): the
  pairs past each receiver's budget ``limit`` (B), by the module docstring's order: lower ranks (columns)
  first, then sources in order, then tokens in order. Every source computes every receiver's cut from the
  all-gathered (sources, receivers, ranks) pair counts, so no further exchange is needed."""
  t, r = experts_TxR.shape
  to_TxR = experts_TxR // (n_experts // size)
  onehot_TxRxP = (to_TxR[..., None] == jnp.arange(size, dtype=to_TxR.dtype)).astype(jnp.int32)
  sent_IxPxR = jax.lax.all_gather(jnp.sum(onehot_TxRxP, axis=0).T, axis, tiled=False)
  me = jax.lax.axis_index(axis)
  load_PxR = jnp.sum(sent_IxPxR, axis=0)
  ranks_before_PxR = jnp.cumsum(load_PxR, axis=1) - load_PxR            # pairs of better ranks, per receiver
  sources_before_PxR = (jnp.cumsum(sent_IxPxR, axis=0) - sent_IxPxR)[me]   # same rank, earlier sources
  quota_PxR = jnp.clip(limit - ranks_before_PxR - sources_before_PxR, 0, sent_IxPxR[me])
  index_TxR = jnp.take_along_axis(jnp.cumsum(onehot_TxRxP, axis=0), to_TxR[..., None], axis=-1)[..., 0] - 1
  kept_TxR = index_TxR < quota_PxR[to_TxR, jnp.arange(r)[None, :]]
  return jnp.where(kept_TxR, experts_TxR, n_experts), jnp.sum(~kept_TxR)


def _local(h_TxQ, experts_TxR, operands, *, experts_fn, n_experts: int, align: int, axis, size: int,
           expert_axes: tuple[str, ...], batch_axes: tuple[str, ...], impl: str, factor: float | None):
  """One device's part (module docstring, steps 1-5): its pairs' expert outputs, (T, R, Q), and the pairs
  dropped in the whole batch (a scalar; 0 when dropless)."""
  t, r = experts_TxR.shape
  local = n_experts // size
  me = jax.lax.axis_index(axis)
  limit = budget(t, r, n_experts, size, factor)
  dropped = jnp.zeros((), jnp.int32)
  if limit < size * t * min(r, local):   # 0. The pairs past the receivers' budgets: expert E, never sent.
    experts_TxR, dropped = keep(experts_TxR, n_experts=n_experts, size=size, axis=axis, limit=limit)
    dropped = jax.lax.psum(dropped, batch_axes)
  # 1. This device's pairs sorted by expert: slice e of the send buffer goes to device e // local.
  flat = experts_TxR.reshape(-1)
  order = jnp.argsort(flat, stable=True)   # dropped pairs (expert E) last
  send_SxQ = h_TxQ[order // r]
  counts_E = jnp.zeros(n_experts, jnp.int32).at[flat].add(1, mode="drop")
  send_start_E = jnp.cumsum(counts_E) - counts_E
  # 2. Every source's counts, so every device knows the layout of every device.
  counts_PxE = jax.lax.all_gather(counts_E, axis, tiled=False)
  sizes_E = (jnp.sum(counts_PxE, axis=0) + align - 1) // align * align
  sizes_PxL = sizes_E.reshape(size, local)
  segment_E = (jnp.cumsum(sizes_PxL, axis=1) - sizes_PxL).reshape(-1)   # each expert's start on its device
  before_PxE = jnp.cumsum(counts_PxE, axis=0) - counts_PxE              # rows of the sources before
  place_PxE = segment_E[None] + before_PxE                              # where source i's slice e lands
  mine = lambda a_PxE: jax.lax.dynamic_slice_in_dim(a_PxE, me * local, local, axis=1).reshape(-1)
  # 3. Dispatch: slice e (counts_E[e] rows from send_start_E[e]) to place_PxE[me, e] on its device.
  capacity = min(t * min(r, local), limit)
  s = received_rows(t, r, n_experts, size, align, factor)
  # The receive buffers are zeros_like the rows they receive: they vary over the mesh axes the rows vary
  # over, as lax.ragged_all_to_all's result takes its output buffer's type (a plain jnp.zeros varies over
  # none, and the grouped GEMM's custom_vjp then refuses its varying cotangent).
  # The combine's offsets (step 5) send every row back: the dispatch's gradient, and the dispatch's the combine's.
  start_PxE = jnp.cumsum(counts_PxE, axis=1) - counts_PxE
  dispatch = (send_start_E, counts_E, place_PxE[me], mine(counts_PxE))
  combine = (mine(place_PxE), mine(counts_PxE), mine(start_PxE), counts_E)
  recv_SxQ = exchange(send_SxQ, jnp.zeros_like(send_SxQ, shape=(s,) + send_SxQ.shape[1:]), *dispatch,
                      axis_name=axis, capacity=capacity, impl=impl, reverse=combine)
  # 4. This device's experts on their rows. The operands are made varying over the batch axes, as the rows
  #    are: the transpose of that cast sums their gradients over the data replicas (a custom_vjp's
  #    cotangent must have its primal's type, so the sum cannot be left to grouped_dot's backward).
  data_axes = tuple(a for a in batch_axes if a not in expert_axes)   # the operands vary over expert_axes only
  if data_axes:
    operands = jax.tree.map(lambda a: jax.lax.pcast(a, data_axes, to="varying"), operands)
  out_SxQ = experts_fn(recv_SxQ, jax.lax.dynamic_slice_in_dim(sizes_E, me * local, local), operands)
  # 5. Combine: the slices back to their sources, at their places in the sources' sorted order.
  back_SxQ = exchange(out_SxQ, jnp.zeros_like(out_SxQ, shape=(t * r,) + out_SxQ.shape[1:]), *combine,
                      axis_name=axis, capacity=capacity, impl=impl, reverse=dispatch)
  picked = jnp.zeros_like(back_SxQ).at[order].set(back_SxQ)   # a dropped pair's row: zero (never received)
  return picked.reshape(t, r, -1), dropped


def routed(h_TxQ, experts_TxR, operands: Any, operand_specs: Any, *, experts_fn: Callable, n_experts: int,
           align: int, where: Layout, impl: str = "auto"):
  """Each (token, choice) pair's expert output (T, R, Q), the experts split over ``where.expert_axes``,
  dropless (``routed_dropping``'s output with no receive factor)."""
  return routed_dropping(h_TxQ, experts_TxR, operands, operand_specs, experts_fn=experts_fn, n_experts=n_experts,
                         align=align, where=where, impl=impl)[0]


def routed_dropping(h_TxQ, experts_TxR, operands: Any, operand_specs: Any, *, experts_fn: Callable,
                    n_experts: int, align: int, where: Layout, impl: str = "auto",
                    receive_factor: float | None = None):
  """(each (token, choice) pair's expert output (T, R, Q), the experts split over ``where.expert_axes``;
  the pairs dropped, int32 scalar: 0 unless ``receive_factor`` caps the receive buffers, module docstring).

  experts_fn(rows_SxQ, sizes_E, operands) -> out_SxQ: the experts' MLP on one device's rows (its E / P
  experts, ``sizes_E`` their padded segments). operands: its arrays (the experts' kernels and keys), placed
  by ``operand_specs`` (a tree of PartitionSpecs over their leading expert axis, or P() replicated)."""
  batch = P(where.batch_axes, None)
  fn = lambda h, e, ops: _local(h, e, ops, experts_fn=experts_fn, n_experts=n_experts, align=align,
                                axis=where.axis, size=where.size, expert_axes=where.expert_axes,
                                batch_axes=where.batch_axes, impl=impl, factor=receive_factor)
  return jax.shard_map(fn, in_specs=(batch, batch, operand_specs),
                       out_specs=(P(where.batch_axes, None, None), P()))(h_TxQ, experts_TxR, operands)


def expert_spec(where: Layout, ndim: int) -> P:
  """The PartitionSpec of an array whose leading axis is the experts'."""
  return P(where.axis, *(None,) * (ndim - 1))
