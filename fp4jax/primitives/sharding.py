"""Sharding of the fp4jax primitives: Shardy rules and per-shard partitioning decisions.

Used by the primitive pairs (``fp4jax.primitives.pair``) through ``jax.experimental.custom_partitioning``. The rules say which
tensor dimensions share a factor; quantized axes are compound factors (blocks x elements per block)
so a sharded quantized axis is cut at block boundaries. The partition callbacks then keep every
sharding under which each shard's work is local (whole blocks, whole 2D tiles), replicate the
rest, and add the one collective a sharded contraction needs (a psum of float32 partial products).
A row-sharded quantize therefore needs no communication except the scalar tensor amax, which the
caller reduces before the primitive (a max over a sharded array is an all-reduce of one float).
A quantized axis of a single block has no block count to cut: ``fit_rule`` writes the rule for the operands'
shapes without it (Shardy refuses a factor of size 1 in a compound dimension).

``block`` is the 1D block length; ``tile`` the side of the square 2D tiles, or None for 1D blocks.
"""
from __future__ import annotations

import math
import re

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def _names(n: int, prefix: str = "d") -> list[str]:
  return [f"{prefix}{i}" for i in range(n)]


def _join(*dims) -> str:
  return " ".join(dims)


# ------------------------------------------------------------------------------------- rules

def quantize_rule(x_ndim: int, amax_ndim: int, has_bits, *, block: int, tile: int | None):
  """Shardy rule for quantize x (..., K) -> (packed (..., K/2), scales). ``has_bits``: False, True (uint8
  bits of x's shape) or "key" (``random_bits.KeyedBits``: rows (..., 4) with x's rows, cols (K, 2) with
  its last axis)."""
  tiled = tile is not None
  lead = _names(x_ndim - (2 if tiled else 1))
  m_in, m_s = "(m r)", "m"
  body = lead + ([m_in] if tiled else [])
  x = _join(*body, "(k i)")
  amax = _join(*lead[:amax_ndim])          # amax covers leading (vmapped) axes only
  data = _join(*body, "(k j)")
  scale = _join(*lead, *([m_s] if tiled else []), "k")
  if has_bits == "key":
    sr = [_join(*body, "w"), _join("(k i)", "v")]
  else:
    sr = [x] if has_bits else []
  operands = [x, amax] + sr
  sizes = dict(i=block, j=block // 2)
  if tiled:
    sizes["r"] = tile
  return f"{', '.join(operands)} -> {data}, {scale}", sizes


def dequantize_rule(ndim: int, amax_ndim: int, *, block: int, tile: int | None):
  """Shardy rule for dequantize (packed, scales, amax) -> x."""
  rule, sizes = quantize_rule(ndim, amax_ndim, False, block=block, tile=tile)
  ins, outs = rule.split(" -> ")
  x, amax = ins.split(", ")
  return f"{outs}, {amax} -> {x}", sizes


def producer_rule(x_ndim: int, *, with_scale: bool, block: int):
  """Shardy rule for a producer that quantizes its output (``primitives.producers``): x (..., C)[, scale (C,)],
  amax -> h (..., C), packed (..., C/2), scales (..., C/B)."""
  lead = _names(x_ndim - 1)
  x = _join(*lead, "(k i)")
  operands = [x] + (["(k i)"] if with_scale else []) + [""]
  return f"{', '.join(operands)} -> {x}, {_join(*lead, '(k j)')}, {_join(*lead, 'k')}", dict(i=block, j=block // 2)


def row_reduction_rule(x_ndim: int):
  """Shardy rule for a reduction of each row: x (..., C) -> (..., 1)."""
  lead = _names(x_ndim - 1)
  return f"{_join(*lead, 'c')} -> {_join(*lead, 'o')}", {}


def quantize_rht_t_rule(has_bits, *, rows: int, block: int, lead: int = 0):
  """Shardy rule for the RHT-transposed quantize x (..., T, C) -> (packed (..., C, T/2), scales (..., C, T/B)),
  ``lead`` leading (vmapped) axes shared by x, the amax (...) and the bits' rows.
  ``has_bits``: False, True (uint8 bits (..., C, T)) or "key" (KeyedBits rows (..., C, 4), cols (T, 2))."""
  per = rows // block
  b = _join(*_names(lead))
  with_b = lambda dims: _join(b, dims) if b else dims
  scale = with_b("c t" if per == 1 else "c (t v)")
  if has_bits == "key":
    sr = [with_b("c w"), "(t l) u"]
  else:
    sr = [with_b("c (t l)")] if has_bits else []
  ops = [with_b("(t l) c"), b] + sr
  sizes = dict(l=rows, j=rows // 2)
  if per > 1:
    sizes["v"] = per
  return f"{', '.join(ops)} -> {with_b('c (t j)')}, {scale}", sizes


def scaled_matmul_rule(a_ndim: int, *, block: int, a_tile: int | None, b_tile: int | None):
  """Shardy rule for the scaled matmul (a_data, a_scale, a_amax, b_data, b_scale, b_amax) -> out."""
  lead = _names(a_ndim - 2)
  m_d = "(m ra)" if a_tile else "m"
  n_d = "(n rb)" if b_tile else "n"
  unit = a_tile or b_tile or block
  k_d = "(k j)"
  ops = [_join(*lead, m_d, k_d), _join(*lead, "m", "k"), "",
         _join(n_d, k_d), _join("n", "k"), ""]
  sizes = dict(j=unit // 2)
  if a_tile:
    sizes["ra"] = a_tile
  if b_tile:
    sizes["rb"] = b_tile
  return f"{', '.join(ops)} -> {_join(*lead, m_d, n_d)}", sizes


_DIM = re.compile(r"\(([^)]*)\)|(\S+)")


def _dims(operand: str) -> list[list[str]]:
  """Factors of each dimension of one operand of a rule: "d0 (k i)" -> [["d0"], ["k", "i"]]."""
  return [(c or s).split() for c, s in _DIM.findall(operand)]


def _factor_sizes(dims, shapes, sizes: dict) -> dict:
  """Every factor's size: the given ``sizes``, a dimension's own size for a lone factor, and by division
  the one unknown factor of a compound dimension."""
  known = dict(sizes)
  changed = True
  while changed:
    changed = False
    for op_dims, shape in zip(dims, shapes):
      for factors, n in zip(op_dims, shape):
        unknown = [f for f in factors if f not in known]
        if len(unknown) == 1:
          known[unknown[0]] = n // math.prod(known[f] for f in factors if f in known)
          changed = True
  return known


def fit_rule(rule: str, sizes: dict, shapes) -> tuple[str, dict]:
  """The rule for operands and results of these ``shapes`` (in rule order), with no factor of size 1 in a
  compound dimension, which Shardy refuses ("dim mapping can't have a factor of size 1 if there are
  multiple factors"): a quantized axis of one block, "(k i)" with k = 1, becomes "i". Such a dimension
  holds no block count to cut, and the partition callbacks replicate it (a cut through a block).
  Sizes are kept for the factors still in a compound (Shardy refuses a size for a whole dimension)."""
  ins, outs = rule.split(" -> ")
  operands = ins.split(", ") + outs.split(", ")
  n_in = len(ins.split(", "))
  dims = [_dims(o) for o in operands]
  known = _factor_sizes(dims, shapes, sizes)

  def fitted(factors):
    kept = [f for f in factors if known.get(f) != 1] or factors[:1]
    return kept[0] if len(kept) == 1 else f"({' '.join(kept)})"

  text = [_join(*(fitted(f) if len(f) > 1 else f[0] for f in op_dims)) for op_dims in dims]
  compound = set(re.findall(r"\w+", " ".join(re.findall(r"\(([^)]*)\)", " ".join(text)))))
  return (f"{', '.join(text[:n_in])} -> {', '.join(text[n_in:])}",
          {k: v for k, v in sizes.items() if k in compound})


# ------------------------------------------------------------------------------------- partition

def spec_of(sharding, ndim: int) -> list:
  spec = list(getattr(sharding, "spec", P()))
  return spec + [None] * (ndim - len(spec))


def shards(mesh, entry) -> int:
  if entry is None:
    return 1
  axes = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[a] for a in axes)


def axes_of(entry) -> tuple:
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def scatter_dim(mesh, out_spec, wanted_spec, out_shape, contracted) -> int | None:
  """The dimension along which a contraction's float32 partial sums are reduce-scattered rather than all-reduced:
  the one the partitioner wants split over exactly the contracted mesh axes (a weight gradient summed over the
  token shards and sharded as its weight), unsplit in ``out_spec`` and divisible; None: all-reduce them."""
  for d, (have, want) in enumerate(zip(out_spec, wanted_spec)):
    if have is None and axes_of(want) == tuple(contracted) and out_shape[d] % shards(mesh, want) == 0:
      return d
  return None


def keep_if_divides(mesh, entry, length: int, unit: int):
  """``entry`` if every shard of an axis of ``length`` holds a whole number of ``unit``s, else None."""
  n = shards(mesh, entry)
  return entry if length % (n * unit) == 0 else None


def named(mesh, spec) -> NamedSharding:
  return NamedSharding(mesh, P(*spec))


def quantize_specs(mesh, x_shape, x_sharding, *, block: int, tile: int | None):
  """PartitionSpec entries (list) for x, valid for local quantization."""
  spec = spec_of(x_sharding, len(x_shape))
  spec[-1] = keep_if_divides(mesh, spec[-1], x_shape[-1], block)
  if tile:
    spec[-2] = keep_if_divides(mesh, spec[-2], x_shape[-2], tile)
  return spec


def quantize_rht_t_specs(mesh, x_shape, x_sharding, *, rows: int):
  """(leading entries, T entry, C entry) for x (..., T, C) of the RHT-transposed quantize: T cut into whole
  ``rows``; the leading (vmapped) axes keep x's."""
  *lead, t_e, c_e = spec_of(x_sharding, len(x_shape))
  t_e = keep_if_divides(mesh, t_e, x_shape[-2], rows)
  used = {a for e in lead for a in axes_of(e)}
  if set(axes_of(t_e)) & used:
    t_e = None
  if set(axes_of(c_e)) & (used | set(axes_of(t_e))):
    c_e = None
  return lead, t_e, c_e


def matmul_specs(mesh, a_shape, a_sharding, b_shape, b_sharding, *, block: int,
                 a_tile: int | None, b_tile: int | None):
  """(a spec, b spec, out spec, contraction mesh axes) for a local scaled matmul."""
  a_spec = spec_of(a_sharding, len(a_shape))
  b_spec = spec_of(b_sharding, 2)
  unit = a_tile or b_tile or block
  k = a_shape[-1]
  k_entry = keep_if_divides(mesh, a_spec[-1], k, unit) or keep_if_divides(mesh, b_spec[-1], k, unit)
  if a_tile:
    a_spec[-2] = keep_if_divides(mesh, a_spec[-2], a_shape[-2], a_tile)
  used = set()
  for e in a_spec[:-1]:
    used |= set(axes_of(e))
  if set(axes_of(k_entry)) & used:
    k_entry = None
  used |= set(axes_of(k_entry))
  n_entry = b_spec[0]
  if b_tile:
    n_entry = keep_if_divides(mesh, n_entry, b_shape[0], b_tile)
  if set(axes_of(n_entry)) & used:
    n_entry = None
  a_spec[-1] = k_entry
  b_spec = [n_entry, k_entry]
  out_spec = a_spec[:-1] + [n_entry]
  return a_spec, b_spec, out_spec, axes_of(k_entry)


# ------------------------------------------------------------------------------------- constraints

def whole_along_first(x):
  """x constrained to be whole along its first axis on the traced mesh's automatic axes, its other axes left
  to the partitioner; x itself without a mesh, where every mesh axis is manual (inside ``shard_map``), or on a
  mesh with explicit axes (whose shardings are the program's types: the caller's to choose). fp4jax.dot
  gathers the fprop weight tiles so, before transposing them (``dot.Dense.transpose_tiles``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual or mesh.explicit_axes:
    return x
  return lax.with_sharding_constraint(x, P(None, *([P.UNCONSTRAINED] * (x.ndim - 1))))


def replicated(x):
  """x (an array or a pytree of arrays) constrained to be whole on every device of the traced mesh's automatic
  axes; x itself where ``whole_along_first`` leaves it. The amaxes' per-chunk partials are gathered so
  (``kernels.quantize_rht_t.rht_amaxes``) before the one reduction that finishes them."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual or mesh.explicit_axes:
    return x
  return jax.tree.map(lambda a: lax.with_sharding_constraint(a, P()), x)
