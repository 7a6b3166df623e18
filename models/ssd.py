"""The Mamba-2 state-space dual (SSD) scan as pure functions: chunked, recurrent, and one step.

Per head h with scalar decay rate a_h < 0 and step sizes dt_t > 0, state S_t (P x N):
  S_t = exp(dt_t a_h) S_{t-1} + dt_t x_t B_tᵀ,     y_t = S_t C_t
B and C are shared by the R = H / G heads of a group (head h uses group h // R).
The D skip connection and gating belong to the mixer, not to the scan.

``ssd_chunked`` is the training form; ``ssd_step`` the generation form; ``ssd_scan_reference``
(``lax.scan`` of the recurrence) and ``ssd_naive_reference`` (a Python loop) are the oracles.
All four compute in float32 and return ``(y, final_state)``; y has the dtype of x. With segment ids
(document masking, ``models.segments``) the state restarts at each document's first step: the decay into
it is 0, as if each document ran alone.

Axis legend: B batch, L sequence, H SSM heads, P head dim, G groups, R heads per group (H = G R),
N state size, Q chunks, C chunk length.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models import segments


def segsum(a_xC: jax.Array) -> jax.Array:
  """``out[..., i, j] = a[j+1] + ... + a[i]`` for i >= j, and -inf above the diagonal.

  Masked cumulative sums instead of differences of one cumulative sum, so no large partial sums
  cancel: exp(segsum) is the exact decay from step j to step i, and exactly 0 above the diagonal.
  """
  C = a_xC.shape[-1]
  a_xCxC = jnp.broadcast_to(a_xC[..., :, None], (*a_xC.shape, C))   # [..., k, j] = a[k]
  k_after_j = jnp.tril(jnp.ones((C, C), bool), k=-1)
  sums_xCxC = jnp.cumsum(jnp.where(k_after_j, a_xCxC, 0.0), axis=-2)
  return jnp.where(jnp.tril(jnp.ones((C, C), bool)), sums_xCxC, -jnp.inf)


def _check(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN):
  B, L, H, P = x_BxLxHxP.shape
  G, N = b_BxLxGxN.shape[-2:]
  if dt_BxLxH.shape != (B, L, H) or a_H.shape != (H,):
    raise ValueError(f"dt {dt_BxLxH.shape} and a {a_H.shape} must be {(B, L, H)} and {(H,)} "
                     f"for x of shape {x_BxLxHxP.shape}")
  if b_BxLxGxN.shape != (B, L, G, N) or c_BxLxGxN.shape != (B, L, G, N):
    raise ValueError(f"B {b_BxLxGxN.shape} and C {c_BxLxGxN.shape} must both be (B, L, G, N) = "
                     f"{(B, L, G, N)}")
  if H % G:
    raise ValueError(f"heads H={H} must be a multiple of groups G={G}")
  return B, L, H, P, G, N


def _decays(a_BxGxRxC, start_BxC):
  """The decays of one chunk from its log-decays a = dt A: (within the chunk ``decay_BxGxRxCxC[l, s]``
  from step s to step l, to its end from each step, over the whole chunk, from its start to each step).

  Without document starts, differences of one cumulative sum. With them (``start_BxC``), a document's first
  step has log-decay -inf, the decay from the step before it 0: every decay is the exp of a masked sum of
  ``segsum``, in which no step of another document takes part, so a document's decays are exactly those
  of its own steps."""
  if start_BxC is None:
    a_cumsum_BxGxRxC = jnp.cumsum(a_BxGxRxC, axis=-1)
    return (jnp.exp(segsum(a_BxGxRxC)), jnp.exp(a_cumsum_BxGxRxC[..., -1:] - a_cumsum_BxGxRxC),
            jnp.exp(a_cumsum_BxGxRxC[..., -1]), jnp.exp(a_cumsum_BxGxRxC))
  a_BxGxRxC = jnp.where(start_BxC[:, None, None, :], -jnp.inf, a_BxGxRxC)
  segsum_BxGxRxCxC = segsum(a_BxGxRxC)
  decay_in_BxGxRxC = jnp.exp(segsum_BxGxRxCxC[..., :, 0] + a_BxGxRxC[..., :1])
  return (jnp.exp(segsum_BxGxRxCxC), jnp.exp(segsum_BxGxRxCxC[..., -1, :]), decay_in_BxGxRxC[..., -1],
          decay_in_BxGxRxC)


def _chunk_step(a_GxR, precision, state_BxGxRxPxN, chunk):
  """One chunk of the SSD: its outputs from its own inputs and the state entering it, and the state it
  hands on. All four steps see one chunk only, so nothing is larger than B x H x C x C. ``chunk`` may end
  with the chunk's document starts (``start_BxC``, document masking)."""
  x_BxCxGxRxP, dt_BxCxGxR, b_BxCxGxN, c_BxCxGxN, *start = chunk
  # Every contraction has exactly two operands, in an order chosen so that no intermediate holds the
  # head dim P (or N) together with both within-chunk axes l and s.
  einsum = lambda spec, lhs, rhs: jnp.einsum(spec, lhs, rhs, precision=precision)
  a_BxGxRxC = jnp.einsum("bcgr,gr->bgrc", dt_BxCxGxR, a_GxR)
  decay_BxGxRxCxC, decay_to_end_BxGxRxC, chunk_decay_BxGxR, decay_in_BxGxRxC = _decays(
      a_BxGxRxC, start[0] if start else None)
  # dt folded into x once: the input injected at each step, shared by steps 1 and 2.
  xdt_BxCxGxRxP = x_BxCxGxRxP * dt_BxCxGxR[..., None]

  # 1. Intra-chunk: the quadratic (attention-like) form. Scores C·Bᵀ per group, masked by each head's
  #    decay, then a batched (l x s) @ (s x P) product per (b, g, r).
  cb_BxGxCxC = einsum("blgn,bsgn->bgls", c_BxCxGxN, b_BxCxGxN)
  scores_BxGxRxCxC = cb_BxGxCxC[:, :, None] * decay_BxGxRxCxC
  y_diag_BxCxGxRxP = einsum("bgrls,bsgrp->blgrp", scores_BxGxRxCxC, xdt_BxCxGxRxP)

  # 2. Chunk state: this chunk's contribution to the state at its end, starting from zero.
  xw_BxCxGxRxP = xdt_BxCxGxRxP * jnp.einsum("bgrs->bsgr", decay_to_end_BxGxRxC)[..., None]
  chunk_state_BxGxRxPxN = einsum("bsgrp,bsgn->bgrpn", xw_BxCxGxRxP, b_BxCxGxN)

  # 3. State passing: the entering state decayed over the whole chunk, plus the chunk's own.
  new_state_BxGxRxPxN = chunk_decay_BxGxR[..., None, None] * state_BxGxRxPxN + chunk_state_BxGxRxPxN

  # 4. State to output: the entering state read out through C, then decayed to each position.
  y_off_BxCxGxRxP = einsum("blgn,bgrpn->blgrp", c_BxCxGxN, state_BxGxRxPxN)
  y_off_BxCxGxRxP = y_off_BxCxGxRxP * jnp.einsum("bgrl->blgr", decay_in_BxGxRxC)[..., None]
  return new_state_BxGxRxPxN, y_diag_BxCxGxRxP + y_off_BxCxGxRxP


def ssd_chunked(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, *, chunk_size: int,
                initial_state_BxHxPxN=None, precision=None, remat_chunks: bool = True, segment_ids_BxL=None):
  """Chunked SSD. L need not be a multiple of ``chunk_size``: the tail is padded with dt = 0,
  an identity step, so the final state is exact. Returns ``(y_BxLxHxP, final_state_BxHxPxN)``.
  ``segment_ids_BxL`` (document masking, ``models.segments``): the state restarts from zero at each
  document's first token, as mamba_ssm's ``seq_idx``; the initial state enters the window's first document.

  A ``lax.scan`` over the chunks carries the state from one chunk to the next. With ``remat_chunks``
  each chunk's step is rematerialized (``jax.checkpoint``), so the backward pass keeps only the Q
  entering states (B x H x P x N each) besides the inputs, and no temporary spans more than one chunk;
  without, the caller's remat policy decides (the mixer: a rematerialized block, ``models.remat``).
  """
  B, L, H, P, G, N = _check(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN)
  R, C = H // G, chunk_size
  out_dtype = x_BxLxHxP.dtype
  pad = -L % C
  Q = (L + pad) // C

  def chunked(t, *tail):
    """(B, L, ...) float32 -> (Q, B, C, *tail): the scan runs over the leading chunk axis."""
    t = t.astype(jnp.float32)
    t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
    return jnp.moveaxis(t.reshape(B, Q, C, *tail), 1, 0)

  chunks = (chunked(x_BxLxHxP, G, R, P), chunked(dt_BxLxH, G, R), chunked(b_BxLxGxN, G, N),
            chunked(c_BxLxGxN, G, N))
  if segment_ids_BxL is not None:
    start_BxL = segments.starts(segments.check(segment_ids_BxL, (B, L)))
    start_BxL = jnp.pad(start_BxL, [(0, 0), (0, pad)])
    chunks += (jnp.moveaxis(start_BxL.reshape(B, Q, C), 1, 0),)
  if initial_state_BxHxPxN is None:
    initial_BxGxRxPxN = jnp.zeros((B, G, R, P, N), jnp.float32)
  else:
    initial_BxGxRxPxN = initial_state_BxHxPxN.astype(jnp.float32).reshape(B, G, R, P, N)
  step = functools.partial(_chunk_step, a_H.astype(jnp.float32).reshape(G, R), precision)
  step = jax.checkpoint(step) if remat_chunks else step
  final_BxGxRxPxN, y_QxBxCxGxRxP = lax.scan(step, initial_BxGxRxPxN, chunks)
  y_BxLxHxP = jnp.moveaxis(y_QxBxCxGxRxP, 0, 1).reshape(B, Q * C, H, P)[:, :L]
  return y_BxLxHxP.astype(out_dtype), final_BxGxRxPxN.reshape(B, H, P, N)


def ssd_step(state_BxHxPxN, x_BxHxP, dt_BxH, a_H, b_BxGxN, c_BxGxN):
  """One recurrent step (generation). Returns ``(y_BxHxP, new_state_BxHxPxN)``; the state is float32."""
  H, G = x_BxHxP.shape[1], b_BxGxN.shape[1]
  f32 = lambda t: t.astype(jnp.float32)
  b_BxHxN = jnp.repeat(f32(b_BxGxN), H // G, axis=1)
  c_BxHxN = jnp.repeat(f32(c_BxGxN), H // G, axis=1)
  dt_BxH = f32(dt_BxH)
  decay_BxH = jnp.exp(dt_BxH * f32(a_H))
  state_BxHxPxN = (decay_BxH[:, :, None, None] * f32(state_BxHxPxN)
                   + jnp.einsum("bh,bhp,bhn->bhpn", dt_BxH, f32(x_BxHxP), b_BxHxN))
  y_BxHxP = jnp.einsum("bhpn,bhn->bhp", state_BxHxPxN, c_BxHxN)
  return y_BxHxP.astype(x_BxHxP.dtype), state_BxHxPxN


def ssd_scan_reference(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, *, initial_state_BxHxPxN=None,
                       segment_ids_BxL=None):
  """The recurrence as a ``lax.scan`` over time of ``ssd_step``; with ``segment_ids_BxL`` the state is
  zeroed before each document's first step."""
  B, L, H, P, G, N = _check(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN)
  state_BxHxPxN = (jnp.zeros((B, H, P, N), jnp.float32) if initial_state_BxHxPxN is None
                   else initial_state_BxHxPxN.astype(jnp.float32))
  start_BxL = (jnp.zeros((B, L), bool) if segment_ids_BxL is None
               else segments.starts(segments.check(segment_ids_BxL, (B, L))))

  def step(state, inputs):
    x, dt, b, c, start = inputs
    state = jnp.where(start[:, None, None, None], 0.0, state)
    y, state = ssd_step(state, x, dt, a_H, b, c)
    return state, y

  time_major = lambda t: jnp.moveaxis(t, 1, 0)
  final_BxHxPxN, y_LxBxHxP = lax.scan(
      step, state_BxHxPxN, tuple(map(time_major, (x_BxLxHxP, dt_BxLxH, b_BxLxGxN, c_BxLxGxN, start_BxL))))
  return jnp.moveaxis(y_LxBxHxP, 0, 1), final_BxHxPxN


def ssd_naive_reference(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN, *, initial_state_BxHxPxN=None,
                        segment_ids_BxL=None):
  """The recurrence as a Python loop over time, written out independently of ``ssd_step``; with
  ``segment_ids_BxL`` the decay into each document's first step is 0."""
  B, L, H, P, G, N = _check(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN)
  x, dt, a = (t.astype(jnp.float32) for t in (x_BxLxHxP, dt_BxLxH, a_H))
  group_of_head = jnp.arange(H) // (H // G)
  b_BxLxHxN = b_BxLxGxN.astype(jnp.float32)[:, :, group_of_head]
  c_BxLxHxN = c_BxLxGxN.astype(jnp.float32)[:, :, group_of_head]
  state = (jnp.zeros((B, H, P, N), jnp.float32) if initial_state_BxHxPxN is None
           else initial_state_BxHxPxN.astype(jnp.float32))
  seg = None if segment_ids_BxL is None else jnp.asarray(segment_ids_BxL)
  ys = []
  for t in range(L):
    decay = jnp.exp(dt[:, t] * a)[:, :, None, None]
    if seg is not None and t > 0:
      decay = jnp.where((seg[:, t] != seg[:, t - 1])[:, None, None, None], 0.0, decay)
    inject = (dt[:, t, :, None] * x[:, t])[..., None] * b_BxLxHxN[:, t, :, None, :]
    state = decay * state + inject
    ys.append((state * c_BxLxHxN[:, t, :, None, :]).sum(-1))
  return jnp.stack(ys, axis=1).astype(x_BxLxHxP.dtype), state
