"""The Mamba-2 SSD scan as four Pallas kernels (Triton backend), forward and backward: ``ssd_pallas``.

The same function as ``models.ssd.ssd_chunked`` (its twin, the CPU path and the default) plus the
mixer's D skip, y = SSD(x, dt, a, B, C) + D x, with an initial and a final state. ``ssd(..., impl=)``
is the one switch the mixer calls. Per chunk of C steps (cs = the within-chunk cumulative sum of
dt a, computed in XLA, which also differentiates it back to dt and a):

  forward   1. states   sequential over chunks, one program per (batch, head, block of P): the state
                        entering every chunk, S_{q+1} = exp(cs_end) S_q + (x dt exp(cs_end - cs))ᵀ B
                        (chunk state and state passing in one pass), and the final state
            2. scan     one program per (batch, group, chunk), a loop over the group's heads, C·Bᵀ
                        computed once per group: y = (C·Bᵀ ∘ exp(cs_l - cs_s) ∘ dt_s) x     intra-chunk
                                                   + exp(cs) C Sᵀ                         state to output
                                                   + D x                                  skip
  backward  1. states   again (recomputed, not saved: the residuals are the inputs only)
            3. dstates  sequential over chunks in reverse: the gradient of the state leaving every
                        chunk, dS_q = exp(cs_end) dS_{q+1} + (dy exp(cs))ᵀ C, and d initial state
            4. dchunk   one program per (batch, group, chunk), a loop over the group's heads: dx, ddt
                        (through x dt), dcs, dD and dB, dC summed over the group's heads in registers
The kernel's chunk is a tile (``SsdTiles.chunk``), not the model's ``chunk_size``: every chunk length
gives the same function, and the chunk-by-chunk matrices (C x C float32) must fit in registers.
Everything computes in float32 (the dots' inputs at TF32 by default, as XLA's float32 dots on a GPU,
or IEEE float32: ``SsdTiles.precision``); x, B and C may be bfloat16. With segment ids (document masking)
cs restarts at each document's first step and every kernel also takes each step's document within its
chunk, zeroing each decay across a document start (``_doc_masks``).

Axis legend: B batch, L sequence (Lp padded to a multiple of C), H SSM heads, P head dim, G groups,
R heads per group (H = G R), N state size, Q chunks, C chunk length, Pb a block of P.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import pallas_compat as plc
from fp4jax import target as fp4_target
from fp4jax import dispatch
from models import segments
from models import ssd as ssd_xla

IMPLS = ("xla", "pallas")
KERNEL_NAMES = ("ssd_states", "ssd_scan", "ssd_dstates", "ssd_dchunk")


@dataclasses.dataclass(frozen=True)
class SsdTiles:
  chunk: int = 64          # C: the kernel's chunk (power of two >= 16)
  state_p: int = 32        # Pb: P per program of the sequential kernels (states, dstates)
  num_warps: int = 4
  num_stages: int = 2
  # The dots' input precision: "tf32" (tensor cores, as XLA runs the float32 einsums of ssd_chunked
  # on a GPU by default) or "ieee" (full float32 products, CUDA cores). The interpreter is exact.
  precision: str = "tf32"


DEFAULT_TILES = SsdTiles()
_f32 = jnp.float32
pl_ds = plc.ds


PRECISIONS = {"tf32": lax.Precision.DEFAULT, "ieee": lax.Precision.HIGHEST}


def _dots(precision: str):
  """a @ b, a @ bᵀ and aᵀ @ b of 2-D float32 tiles, float32 accumulation, at ``precision``."""
  prec = PRECISIONS[precision]
  dot = lambda a, b, dims: lax.dot_general(a, b, (dims, ((), ())), precision=prec,
                                           preferred_element_type=_f32)
  return (lambda a, b: dot(a, b, ((1,), (0,))), lambda a, b: dot(a, b, ((1,), (1,))),
          lambda a, b: dot(a, b, ((0,), (0,))))


def _causal_decay(cs_Cx1, doc_Cx1=None):
  """exp(cs_l - cs_s) for s <= l, else 0: the decay from step s to step l of one chunk (C x C); with the
  steps' documents within the chunk (``doc_Cx1``), also 0 between two documents."""
  c = cs_Cx1.shape[0]
  seg_CxC = cs_Cx1 - cs_Cx1.reshape(1, c)
  causal = lax.broadcasted_iota(jnp.int32, (c, c), 0) >= lax.broadcasted_iota(jnp.int32, (c, c), 1)
  if doc_Cx1 is not None:
    causal = causal & (doc_Cx1 == doc_Cx1.reshape(1, c))
  return jnp.where(causal, jnp.exp(jnp.minimum(seg_CxC, 0.0)), 0.0)


def _masked_exp(log_decay, same_doc):
  """exp(log_decay) where ``same_doc`` (None: everywhere), else 0: a decay across no document start."""
  return jnp.exp(log_decay) if same_doc is None else jnp.where(same_doc, jnp.exp(log_decay), 0.0)


def _doc_masks(doc_refs, rows, end_row):
  """Of one chunk, from its steps' documents (counted from 0, the document the entering state belongs to):
  ``(doc_Cx1, from_start_Cx1, to_end_Cx1, whole_1x1)``, the documents, whether the entering state reaches
  each step, whether each step reaches the chunk's end, whether the state crosses the whole chunk; all None
  without document masking (no ``doc_refs``)."""
  if not doc_refs:
    return None, None, None, None
  doc_Cx1, doc_end_1x1 = doc_refs[0][rows, :], doc_refs[0][end_row, :]
  return doc_Cx1, doc_Cx1 == 0, doc_Cx1 == doc_end_1x1, doc_end_1x1 == 0


# ---------------------------------------------------------------------------------------- kernels

def _states_kernel(x_ref, dt_ref, cs_ref, b_ref, s0_ref, *refs, C, Q, precision):
  """Refs: x (Lp, Pb), dt/cs (Lp, 1), b (Lp, N), s0 (Pb, N)[, doc (Lp, 1)] -> st (Q, Pb, N) entering,
  final (Pb, N)."""
  *doc_refs, st_ref, final_ref = refs
  _, _, _dot_tn = _dots(precision)
  def chunk(q, s_PbxN):
    st_ref[pl_ds(q, 1)] = s_PbxN[None]
    rows, end_row = pl_ds(q * C, C), pl_ds(q * C + C - 1, 1)
    _, _, to_end_Cx1, whole_1x1 = _doc_masks(doc_refs, rows, end_row)
    cs_Cx1 = cs_ref[rows, :]
    cs_end_1x1 = cs_ref[end_row, :]
    w_Cx1 = _masked_exp(cs_end_1x1 - cs_Cx1, to_end_Cx1) * dt_ref[rows, :]
    xw_CxPb = x_ref[rows, :].astype(_f32) * w_Cx1
    return _masked_exp(cs_end_1x1, whole_1x1) * s_PbxN + _dot_tn(xw_CxPb, b_ref[rows, :].astype(_f32))
  final_ref[...] = lax.fori_loop(0, Q, chunk, s0_ref[...])


def _scan_kernel(x_ref, dt_ref, cs_ref, b_ref, c_ref, st_ref, d_ref, *refs, R, P, precision):
  """Refs: x (C, R P), dt/cs (C, R), b/c (C, N), st (R P, N), d (1, R P)[, doc (C, 1)] -> y (C, R P)."""
  *doc_refs, y_ref = refs
  _dot, _dot_nt, _ = _dots(precision)
  c_CxN = c_ref[...].astype(_f32)
  cb_CxC = _dot_nt(c_CxN, b_ref[...].astype(_f32))
  c = cb_CxC.shape[0]
  doc_Cx1, from_start_Cx1, _, _ = _doc_masks(doc_refs, slice(None), pl_ds(c - 1, 1))

  def head(r, carry):
    cols, col = pl_ds(plc.multiple_of(r * P, P), P), pl_ds(r, 1)
    cs_Cx1, dt_Cx1 = cs_ref[:, col], dt_ref[:, col]
    x_CxP = x_ref[:, cols].astype(_f32)
    scores_CxC = cb_CxC * _causal_decay(cs_Cx1, doc_Cx1) * dt_Cx1.reshape(1, c)
    in_Cx1 = _masked_exp(cs_Cx1, from_start_Cx1)
    y_CxP = (_dot(scores_CxC, x_CxP) + in_Cx1 * _dot_nt(c_CxN, st_ref[cols, :])
             + d_ref[:, cols] * x_CxP)
    y_ref[:, cols] = y_CxP.astype(y_ref.dtype)
    return carry
  lax.fori_loop(0, R, head, 0)


def _dstates_kernel(dy_ref, c_ref, cs_ref, dfinal_ref, *refs, C, Q, precision):
  """Refs: dy (Lp, Pb), c (Lp, N), cs (Lp, 1), dfinal (Pb, N)[, doc (Lp, 1)] -> dso (Q, Pb, N), the
  gradient of the state leaving each chunk, and ds0 (Pb, N), that of the initial state."""
  *doc_refs, dso_ref, ds0_ref = refs
  _, _, _dot_tn = _dots(precision)
  def chunk(i, ds_PbxN):
    q = Q - 1 - i
    dso_ref[pl_ds(q, 1)] = ds_PbxN[None]
    rows, end_row = pl_ds(q * C, C), pl_ds(q * C + C - 1, 1)
    _, from_start_Cx1, _, whole_1x1 = _doc_masks(doc_refs, rows, end_row)
    dyw_CxPb = dy_ref[rows, :].astype(_f32) * _masked_exp(cs_ref[rows, :], from_start_Cx1)
    return _masked_exp(cs_ref[end_row, :], whole_1x1) * ds_PbxN + _dot_tn(dyw_CxPb, c_ref[rows, :].astype(_f32))
  ds0_ref[...] = lax.fori_loop(0, Q, chunk, dfinal_ref[...])


def _dchunk_kernel(x_ref, dt_ref, cs_ref, b_ref, c_ref, st_ref, dso_ref, dy_ref, d_ref, *refs, R, P,
                   precision):
  """Refs: x/dy (C, R P), dt/cs (C, R), b/c (C, N), st/dso (R P, N), d (1, R P)[, doc (C, 1)] ->
  dx (C, R P), ddt/dcs/ddot (C, R), db/dc (C, N) summed over the group's R heads.

  Per head, with u = x dt, M = C·Bᵀ ∘ decay, w = exp(cs_end - cs):
    du = Mᵀ dy + w (B dSoᵀ);  dx = dt du + D dy;  ddt = Σ_p du x;  dM = dy uᵀ ∘ decay
    dC = dM B + exp(cs) dy S;  dB = dMᵀ C + w (u dSo)
    dcs_l = Σ_s T_ls - Σ_s T_sl + Σ_p dy (exp(cs) C Sᵀ) - g,  T = dy uᵀ ∘ M,  g = Σ_p u w (B dSoᵀ);
    the last position also takes exp(cs_end) <S, dSo> + Σ g (cs_end's share).
  With documents, each decay across a document start (in decay, w, exp(cs), exp(cs_end)) is the constant
  0: the same formulas with those factors zeroed.
  """
  *doc_refs, dx_ref, ddt_ref, dcs_ref, ddot_ref, db_ref, dc_ref = refs
  _dot, _dot_nt, _dot_tn = _dots(precision)
  c_CxN, b_CxN = c_ref[...].astype(_f32), b_ref[...].astype(_f32)
  cb_CxC = _dot_nt(c_CxN, b_CxN)
  c, n = cb_CxC.shape[0], b_CxN.shape[1]
  last_Cx1 = lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
  doc_Cx1, from_start_Cx1, to_end_Cx1, whole_1x1 = _doc_masks(doc_refs, slice(None), pl_ds(c - 1, 1))

  def head(r, acc):
    db_CxN, dc_CxN = acc
    cols, col = pl_ds(plc.multiple_of(r * P, P), P), pl_ds(r, 1)
    cs_Cx1, dt_Cx1 = cs_ref[:, col], dt_ref[:, col]
    cs_end_1x1 = cs_ref[pl_ds(c - 1, 1), col]
    x_CxP, dy_CxP = x_ref[:, cols].astype(_f32), dy_ref[:, cols].astype(_f32)
    s_PxN, dso_PxN = st_ref[cols, :], dso_ref[cols, :]
    u_CxP = x_CxP * dt_Cx1
    decay_CxC = _causal_decay(cs_Cx1, doc_Cx1)
    m_CxC = cb_CxC * decay_CxC
    w_Cx1 = _masked_exp(cs_end_1x1 - cs_Cx1, to_end_Cx1)
    in_Cx1 = _masked_exp(cs_Cx1, from_start_Cx1)
    bds_CxP = w_Cx1 * _dot_nt(b_CxN, dso_PxN)
    du_CxP = _dot_tn(m_CxC, dy_CxP) + bds_CxP
    dx_ref[:, cols] = (dt_Cx1 * du_CxP + d_ref[:, cols] * dy_CxP).astype(dx_ref.dtype)
    ddt_ref[:, col] = jnp.sum(du_CxP * x_CxP, axis=1, keepdims=True)
    ddot_ref[:, col] = jnp.sum(dy_CxP * x_CxP, axis=1, keepdims=True)
    dyu_CxC = _dot_nt(dy_CxP, u_CxP)
    dcb_CxC = dyu_CxC * decay_CxC
    dc_CxN = dc_CxN + _dot(dcb_CxC, b_CxN) + in_Cx1 * _dot(dy_CxP, s_PxN)
    db_CxN = db_CxN + _dot_tn(dcb_CxC, c_CxN) + w_Cx1 * _dot(u_CxP, dso_PxN)
    t_CxC = dyu_CxC * m_CxC
    yoff_CxP = in_Cx1 * _dot_nt(c_CxN, s_PxN)
    g_Cx1 = jnp.sum(u_CxP * bds_CxP, axis=1, keepdims=True)
    dcs_Cx1 = (jnp.sum(t_CxC, axis=1, keepdims=True) - jnp.sum(t_CxC, axis=0).reshape(c, 1)
               + jnp.sum(dy_CxP * yoff_CxP, axis=1, keepdims=True) - g_Cx1)
    end_1x1 = (_masked_exp(cs_end_1x1, whole_1x1) * jnp.sum(s_PxN * dso_PxN, keepdims=True)
               + jnp.sum(g_Cx1, keepdims=True))
    dcs_ref[:, col] = dcs_Cx1 + jnp.where(last_Cx1, end_1x1, 0.0)
    return db_CxN, dc_CxN

  zeros = jnp.zeros((c, n), _f32)
  db_CxN, dc_CxN = lax.fori_loop(0, R, head, (zeros, zeros))
  db_ref[...] = db_CxN
  dc_ref[...] = dc_CxN



# ---------------------------------------------------------------------------------------- calls

def _dims(x_BxLpxHxP, b_BxLpxGxN, tiles):
  B, Lp, H, P = x_BxLpxHxP.shape
  G, N = b_BxLpxGxN.shape[2:]
  C = tiles.chunk
  return B, Lp, H, P, G, N, H // G, C, Lp // C, min(P, tiles.state_p)


def _call(kernel, name, grid, in_specs, out_specs, out_shape, tiles, interpret, dims):
  """The pallas_call, named ``models_<name>_<precision>_<flops>flop``: the HLO's op_name then carries
  the analytic FLOP count (``kernel_flops``) and the dots' precision that bench/predict/hlo_cost.py charges
  (the Triton backend drops ``pl.CostEstimate``)."""
  B, Lp, H, P, G, N, _, C, _, _ = dims
  flops = kernel_flops(name, B, Lp, H, P, G, N, C)
  call = lambda interpret: plc.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=interpret,
      name=f"models_{name}_{tiles.precision}_{flops}flop", num_warps=tiles.num_warps,
      num_stages=tiles.num_stages)
  return call(interpret) if interpret is not None else plc.by_platform(call)   # None: by the platform


def _sequential_specs(B, Lp, H, P, N, R, Q, Pb):
  """Block specs, outputs and grid of one (batch, head, block of P) program walking all chunks (states,
  dstates): x-like, dt-like, b-like, state-like and document inputs; per-chunk states (B, Q, H P, N) and
  one state (B, H P, N) out, float32."""
  nb = P // Pb
  spec = plc.BlockSpec
  state = spec((None, Pb, N), lambda i, h, p: (i, h * nb + p, 0))
  in_specs = (spec((None, Lp, Pb), lambda i, h, p: (i, 0, h * nb + p)),
              spec((None, Lp, 1), lambda i, h, p: (i, 0, h)),
              spec((None, Lp, N), lambda i, h, p: (i, 0, h // R)),
              state,
              spec((None, Lp, 1), lambda i, h, p: (i, 0, 0)))
  out_specs = (spec((None, Q, Pb, N), lambda i, h, p: (i, 0, h * nb + p, 0)), state)
  out_shape = (jax.ShapeDtypeStruct((B, Q, H * P, N), _f32), jax.ShapeDtypeStruct((B, H * P, N), _f32))
  return (*in_specs, out_specs, out_shape, (B, H, nb))


def _with_doc(specs, args, doc_spec, doc):
  """The kernel's inputs and their specs, with the documents (B, Lp, 1) last when given."""
  if doc is None:
    return list(specs), args
  return [*specs, doc_spec], (*args, doc)


def _states_call(x, dt, cs, b, s0, doc, tiles, interpret):
  """Entering states (B, Q, H P, N) and the final state (B, H P, N), float32."""
  dims = B, Lp, H, P, G, N, R, C, Q, Pb = _dims(x, b, tiles)
  xs, ts, bs, ss, docs, out_specs, out_shape, grid = _sequential_specs(B, Lp, H, P, N, R, Q, Pb)
  in_specs, args = _with_doc([xs, ts, ts, bs, ss], (x.reshape(B, Lp, H * P), dt, cs, b.reshape(B, Lp, G * N),
                                                    s0.reshape(B, H * P, N)), docs, doc)
  return _call(functools.partial(_states_kernel, C=C, Q=Q, precision=tiles.precision), "ssd_states", grid,
               in_specs, out_specs, out_shape, tiles, interpret, dims)(*args)


def _group_specs(B, Lp, H, P, G, N, R, C):
  """Block specs of one (batch, group, chunk) program: x-like, dt-like, b-like, state-like, d, documents."""
  spec = plc.BlockSpec
  return (spec((None, C, R * P), lambda i, g, q: (i, q, g)),
          spec((None, C, R), lambda i, g, q: (i, q, g)),
          spec((None, C, N), lambda i, g, q: (i, q, g)),
          spec((None, None, R * P, N), lambda i, g, q: (i, q, g, 0)),
          spec((1, R * P), lambda i, g, q: (0, g)),
          spec((None, C, 1), lambda i, g, q: (i, q, 0)))


def _scan_call(x, dt, cs, b, c, st, d_HxP, doc, tiles, interpret):
  """y (B, Lp, H P) in x's dtype."""
  dims = B, Lp, H, P, G, N, R, C, Q, _ = _dims(x, b, tiles)
  xs, ts, bs, ss, ds, docs = _group_specs(B, Lp, H, P, G, N, R, C)
  in_specs, args = _with_doc([xs, ts, ts, bs, bs, ss, ds], (
      x.reshape(B, Lp, H * P), dt, cs, b.reshape(B, Lp, G * N), c.reshape(B, Lp, G * N), st,
      d_HxP.reshape(1, H * P)), docs, doc)
  return _call(functools.partial(_scan_kernel, R=R, P=P, precision=tiles.precision), "ssd_scan", (B, G, Q),
               in_specs, xs, jax.ShapeDtypeStruct((B, Lp, H * P), x.dtype), tiles, interpret, dims)(*args)


def _dstates_call(dy, c, cs, dfinal, doc, tiles, interpret):
  """Gradients of the states leaving each chunk (B, Q, H P, N) and of the initial state (B, H P, N)."""
  dims = B, Lp, H, P, G, N, R, C, Q, Pb = _dims(dy, c, tiles)
  xs, ts, bs, ss, docs, out_specs, out_shape, grid = _sequential_specs(B, Lp, H, P, N, R, Q, Pb)
  in_specs, args = _with_doc([xs, bs, ts, ss], (dy.reshape(B, Lp, H * P), c.reshape(B, Lp, G * N), cs,
                                                dfinal.reshape(B, H * P, N)), docs, doc)
  return _call(functools.partial(_dstates_kernel, C=C, Q=Q, precision=tiles.precision), "ssd_dstates", grid,
               in_specs, out_specs, out_shape, tiles, interpret, dims)(*args)


def _dchunk_call(x, dt, cs, b, c, st, dso, dy, d_HxP, doc, tiles, interpret):
  """dx (B, Lp, H P) in x's dtype; ddt, dcs, ddot (B, Lp, H); db, dc (B, Lp, G N), float32."""
  dims = B, Lp, H, P, G, N, R, C, Q, _ = _dims(x, b, tiles)
  xs, ts, bs, ss, ds, docs = _group_specs(B, Lp, H, P, G, N, R, C)
  S = jax.ShapeDtypeStruct
  out_shape = (S((B, Lp, H * P), x.dtype), S((B, Lp, H), _f32), S((B, Lp, H), _f32),
               S((B, Lp, H), _f32), S((B, Lp, G * N), _f32), S((B, Lp, G * N), _f32))
  in_specs, args = _with_doc([xs, ts, ts, bs, bs, ss, ss, xs, ds], (
      x.reshape(B, Lp, H * P), dt, cs, b.reshape(B, Lp, G * N), c.reshape(B, Lp, G * N), st, dso,
      dy.reshape(B, Lp, H * P), d_HxP.reshape(1, H * P)), docs, doc)
  return _call(functools.partial(_dchunk_kernel, R=R, P=P, precision=tiles.precision), "ssd_dchunk", (B, G, Q),
               in_specs, (xs, ts, ts, ts, bs, bs), out_shape, tiles, interpret, dims)(*args)


# ------------------------------------------------------------------------------ the custom_vjp

@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _ssd_core(x, dt, cs, b, c, d_H, s0, doc, tiles, interpret):
  """Padded inputs (Lp a multiple of tiles.chunk; dt, cs float32; ``doc`` None or the int32 documents
  (B, Lp, 1) within each chunk, ``cs`` then restarting at each) -> y (B, Lp, H, P), final (B, H, P, N)."""
  return _ssd_fwd_impl(x, dt, cs, b, c, d_H, s0, doc, tiles, interpret)


def _ssd_fwd_impl(x, dt, cs, b, c, d_H, s0, doc, tiles, interpret):
  B, Lp, H, P = x.shape
  st, final = _states_call(x, dt, cs, b, s0, doc, tiles, interpret)
  d_HxP = jnp.broadcast_to(d_H[:, None], (H, P))
  y = _scan_call(x, dt, cs, b, c, st, d_HxP, doc, tiles, interpret)
  return y.reshape(B, Lp, H, P), final.reshape(s0.shape)


def _ssd_fwd(x, dt, cs, b, c, d_H, s0, doc, tiles, interpret):
  out = _ssd_fwd_impl(x, dt, cs, b, c, d_H, s0, doc, tiles, interpret)
  return out, (x, dt, cs, b, c, d_H, s0, doc)   # the states are recomputed in the backward


def _ssd_bwd(tiles, interpret, residuals, cotangents):
  x, dt, cs, b, c, d_H, s0, doc = residuals
  dy, dfinal = cotangents
  B, Lp, H, P = x.shape
  G, N = b.shape[2:]
  st, _ = _states_call(x, dt, cs, b, s0, doc, tiles, interpret)
  dso, ds0 = _dstates_call(dy, c, cs, dfinal.astype(_f32), doc, tiles, interpret)   # dy: x's dtype
  d_HxP = jnp.broadcast_to(d_H[:, None], (H, P))
  dx, ddt, dcs, ddot, db, dc = _dchunk_call(x, dt, cs, b, c, st, dso, dy, d_HxP, doc, tiles, interpret)
  return (dx.reshape(x.shape), ddt, dcs, db.reshape(b.shape).astype(b.dtype),
          dc.reshape(c.shape).astype(c.dtype), jnp.sum(ddot, axis=(0, 1)).astype(d_H.dtype),
          ds0.reshape(s0.shape).astype(s0.dtype), None)


_ssd_core.defvjp(_ssd_fwd, _ssd_bwd)


# ------------------------------------------------------------------------------- partitioning

def mesh_split(B: int, H: int, G: int):
  """(batch axes, head axes) to split a model kernel's operands over under the mesh being traced for, or
  None (no mesh, one device, nothing to split). A pallas_call does not partition itself: under jit with
  sharded inputs XLA would gather every operand onto each device. So each device runs the kernels on its
  shard: the batch over the mesh axes of the logical axis "activation_batch", the heads (and with them
  the groups, whose B and C the heads share) over those of "activation_ssm_heads", by the flax rules in
  force (training.sharding.LOGICAL_RULES). An axis whose size does not divide B (or H and G) is not split
  (None in its place)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  rules = nn.get_logical_axis_rules()
  batch, heads = nn.logical_to_mesh_axes(("activation_batch", "activation_ssm_heads"), rules) if rules \
      else (None, None)

  def fit(axes, *sizes):
    names = tuple(a for a in ((axes,) if isinstance(axes, str) else tuple(axes or ())) if a in mesh.shape)
    n = math.prod(mesh.shape[a] for a in names)
    return None if n == 1 or any(size % n for size in sizes) else (names[0] if len(names) == 1 else names)

  bat, hd = fit(batch, B), fit(heads, H, G)
  return None if bat is None and hd is None else (bat, hd)


def partition_specs(B: int, H: int, G: int, documents: bool = False):
  """(in_specs, out_specs) of the SSD kernels' ``shard_map``, split by ``mesh_split``, or None. The
  sequence is never split (every chunk needs the state of the one before); the documents (B, Lp, 1),
  when given, are split with the batch."""
  split = mesh_split(B, H, G)
  if split is None:
    return None
  bat, hd = split
  spec = jax.sharding.PartitionSpec
  x, t, st = spec(bat, None, hd, None), spec(bat, None, hd), spec(bat, hd, None, None)
  doc = (spec(bat, None, None),) if documents else ()
  return (x, t, t, x, x, spec(hd), st, *doc), (x, st)


# ------------------------------------------------------------------------------------- public

def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def unsupported(x_shape, b_shape, tiles: SsdTiles = DEFAULT_TILES) -> str | None:
  """Why the kernel cannot take these shapes, or None. Triton tensors need power-of-two sizes and its
  dots at least 16 rows and columns: P, N and the chunk powers of two >= 16."""
  P, N = x_shape[-1], b_shape[-1]
  for name, v in (("head dim P", P), ("state size N", N), ("tiles.chunk", tiles.chunk),
                  ("tiles.state_p", min(P, tiles.state_p))):
    if not _is_pow2(v) or v < 16:
      return f"{name}={v} must be a power of two >= 16 for the Pallas SSD kernel; use impl='xla'"
  if tiles.precision not in PRECISIONS:
    return f"tiles.precision={tiles.precision!r}; use one of {tuple(PRECISIONS)}"
  if P % min(P, tiles.state_p):
    return f"tiles.state_p={tiles.state_p} must divide the head dim P={P}"
  return None


def can_use_pallas(x_shape, b_shape, tiles: SsdTiles = DEFAULT_TILES, *, platform: str | None = None) -> bool:
  """Whether the kernel can run compiled for these shapes on the program's devices (``platform``, else
  ``fp4jax.target.current()``): a CUDA GPU with Pallas Triton and supported shapes. Says nothing about the default (``default_impl``); on the CPU impl="pallas"
  runs through the Pallas interpreter (tests)."""
  if unsupported(x_shape, b_shape, tiles) is not None or not plc.has_triton():
    return False
  return fp4_target.current().cuda if platform is None else platform in ("cuda", "gpu")


# The device run that put the kernels into the default (``fp4jax.dispatch.Evidence``), from a
# scripts/gpu_check.py report; None: the kernels compile deviceless for sm_90 and sm_100 (docs/PERF.md)
# but no device run is recorded.
VERIFIED: dispatch.Evidence | None = None


def default_impl(x_shape, b_shape, *, platform: str | None = None) -> str:
  """What impl=None runs: "pallas" where the kernel can run here and ``fp4jax.dispatch.
  model_kernel_default("ssd", VERIFIED)`` chooses it (this device proved it within ``PROOF_TOL`` and
  faster, or a recorded device run; today none), else "xla"."""
  if (can_use_pallas(x_shape, b_shape, platform=platform)
      and dispatch.model_kernel_default("ssd", VERIFIED) == "pallas"):
    return "pallas"
  return "xla"


# The on-device proof of the kernel (tools.prove, op "ssd"; scripts/gpu_check.py's rows run the same case):
# y = SSD + D x and dx, ddt, dA, dB, dC, dD, kernel vs ``ssd_chunked``, at the 12B mixer's shape
# (B, L, H, P, G, N) with its chunk of 256 on a device, a tiny shape (interpreted) elsewhere. Both paths
# run their float32 dots at TF32 on a GPU, in different orders, so each output of the kernel must be
# within PROOF_TOL x the largest magnitude of the XLA path's (exact float32 interpreted, far below it).
PROOF_SHAPES = {False: ((1, 8192, 160, 64, 8, 128), 256), True: ((1, 40, 4, 16, 2, 16), 16)}
PROOF_TOL = 1e-2
PROOF_OUTPUTS = ("y", "dx", "ddt", "dA", "dB", "dC", "dD")


def proof_case(tiny: bool):
  """(fn_of(impl) -> jitted fn(*args) = (y, *gradients), args, PROOF_OUTPUTS, "LxHxPxGxN")."""
  (B, L, H, P, G, N), chunk = PROOF_SHAPES[tiny]
  tiles = SsdTiles(chunk=16, state_p=16) if tiny else DEFAULT_TILES
  k = jax.random.split(jax.random.key(3), 7)
  args = (jax.random.normal(k[0], (B, L, H, P)), jax.nn.softplus(jax.random.normal(k[1], (B, L, H)) - 2.0),
          -jnp.exp(jax.random.uniform(k[2], (H,), minval=0.0, maxval=2.5)),
          jax.random.normal(k[3], (B, L, G, N)) / math.sqrt(N), jax.random.normal(k[4], (B, L, G, N)) / math.sqrt(N),
          jax.random.normal(k[5], (H,)), jax.random.normal(k[6], (B, L, H, P)))

  def fn_of(impl):
    def fn(x, dt, a, b, c, d, dy):
      f = lambda *p: ssd(*p[:5], chunk_size=chunk, d_H=p[5], impl=impl, tiles=tiles)[0]
      y, vjp = jax.vjp(f, x, dt, a, b, c, d)
      return (y, *vjp(dy))
    return jax.jit(fn)
  return fn_of, args, PROOF_OUTPUTS, "x".join(map(str, (L, H, P, G, N)))


def _segmented_cumsum(a_BxQxCxH, start_BxQxC):
  """The cumulative sum along each chunk that restarts at every document start (``start``): the sum
  of a over the steps of the step's own document up to it, no other document's steps taking part."""
  def combine(left, right):
    (sum_l, start_l), (sum_r, start_r) = left, right
    return jnp.where(start_r[..., None], sum_r, sum_l + sum_r), start_l | start_r
  return lax.associative_scan(combine, (a_BxQxCxH, start_BxQxC), axis=2)[0]


def ssd_pallas(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, *, d_H=None, initial_state_BxHxPxN=None,
               tiles: SsdTiles = DEFAULT_TILES, interpret: bool | None = None, segment_ids_BxL=None):
  """``ssd_chunked(...)`` + D x with the Pallas kernels. Returns ``(y_BxLxHxP, final_state_BxHxPxN)``:
  y in x's dtype, the state float32. L need not be a multiple of the chunk (padded with dt = 0, an
  identity step). ``interpret``: True the Pallas interpreter, False the compiled kernels, None the
  kernels where the program is lowered for CUDA and the interpreter elsewhere (``lax.platform_dependent``).
  ``segment_ids_BxL`` (document masking): the state restarts at each document's first step, as in
  ``ssd_chunked``; the kernels take each step's document within its chunk (0 for the steps the entering
  state reaches) and zero every decay across a document start, and cs restarts at each start."""
  B, L, H, P, G, N = ssd_xla._check(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN)
  why = unsupported(x_BxLxHxP.shape, b_BxLxGxN.shape, tiles)
  if why:
    raise ValueError(why)
  C = tiles.chunk
  pad = -L % C
  Q = (L + pad) // C
  padded = lambda t: t if not pad else jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
  dt = padded(dt_BxLxH.astype(_f32))
  a_BxQxCxH = (dt * a_H.astype(_f32)).reshape(B, Q, C, H)
  if segment_ids_BxL is None:
    doc = None
    cs = jnp.cumsum(a_BxQxCxH, axis=2).reshape(B, Q * C, H)
  else:
    start_BxQxC = padded(segments.starts(segments.check(segment_ids_BxL, (B, L)))).reshape(B, Q, C)
    cs = _segmented_cumsum(a_BxQxCxH, start_BxQxC).reshape(B, Q * C, H)
    doc = jnp.cumsum(start_BxQxC, axis=2, dtype=jnp.int32).reshape(B, Q * C, 1)
  d_H = jnp.zeros((H,), _f32) if d_H is None else jnp.asarray(d_H, _f32)
  s0 = (jnp.zeros((B, H, P, N), _f32) if initial_state_BxHxPxN is None
        else initial_state_BxHxPxN.astype(_f32))
  core = lambda *args: _ssd_core(*args, tiles, interpret)   # pylint: disable=unnecessary-lambda-assignment
  if doc is None:
    core = lambda *args, core=core: core(*args, None)   # pylint: disable=unnecessary-lambda-assignment
  args = (padded(x_BxLxHxP), dt, cs, padded(b_BxLxGxN), padded(c_BxLxGxN), d_H, s0) + (
      () if doc is None else (doc,))
  specs = partition_specs(B, H, G, documents=doc is not None)
  if specs is not None:
    core = jax.shard_map(core, in_specs=specs[0], out_specs=specs[1], check_vma=False)
  y, final = core(*args)
  return y[:, :L], final


def ssd(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, *, chunk_size: int, d_H=None,
        initial_state_BxHxPxN=None, impl: str | None = None, tiles: SsdTiles = DEFAULT_TILES,
        interpret: bool | None = None, remat_chunks: bool = True, segment_ids_BxL=None):
  """y = SSD(x, dt, a, B, C) + D x and the final state, by ``impl``: "xla" (``ssd_chunked`` at
  ``chunk_size``; ``remat_chunks``: its own per-chunk checkpoint), "pallas" (the kernels, at
  ``tiles.chunk``, whose backward recomputes the states anyway) or None / "auto" (``default_impl``).
  ``segment_ids_BxL``: document masking, the state restarting at each document (``models.segments``)."""
  if impl is None or impl == "auto":
    impl = default_impl(x_BxLxHxP.shape, b_BxLxGxN.shape)
  if impl == "pallas":
    return ssd_pallas(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, d_H=d_H,
                      initial_state_BxHxPxN=initial_state_BxHxPxN, tiles=tiles, interpret=interpret,
                      segment_ids_BxL=segment_ids_BxL)
  if impl != "xla":
    raise ValueError(f"ssd impl={impl!r}; use 'xla', 'pallas', 'auto' or None (the recorded default)")
  y, final = ssd_xla.ssd_chunked(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, chunk_size=chunk_size,
                                 initial_state_BxHxPxN=initial_state_BxHxPxN, remat_chunks=remat_chunks,
                                 segment_ids_BxL=segment_ids_BxL)
  if d_H is not None:
    y = y + d_H[:, None] * x_BxLxHxP
  return y, final


def kernel_flops(name: str, B: int, L: int, H: int, P: int, G: int, N: int, C: int) -> int:
  """The analytic FLOP count of one call of kernel ``name`` (KERNEL_NAMES) on padded length L with
  chunk C: 2 m n k per dot (the C x C, C x P and P x N products) plus the elementwise work of the
  same order (counted once per output element of each dot's epilogue). The cost model charges the
  kernels' custom calls by these and their operand bytes."""
  Q = L // C
  per_head_chunk = {
      "ssd_states": 2 * C * P * N + 3 * C * P + 2 * P * N,
      "ssd_scan": 2 * C * C * P + 2 * C * N * P + 4 * C * C + 4 * C * P,
      "ssd_dstates": 2 * C * P * N + 2 * C * P + 2 * P * N,
      "ssd_dchunk": 2 * C * C * (2 * P + 2 * N) + 2 * C * N * P * 4 + 12 * C * C + 16 * C * P + 2 * P * N,
  }[name]
  per_group_chunk = 2 * C * C * N if name in ("ssd_scan", "ssd_dchunk") else 0
  return B * Q * (H * per_head_chunk + G * per_group_chunk)

