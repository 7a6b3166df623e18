"""The quantized dot: ``fp4jax.dot_general`` / ``fp4jax.dot``, spec §6 as a ``jax.custom_vjp``.

Axis legend: M tokens (every free axis of lhs, flattened), K the contraction (every contracting axis,
flattened), N output features (every free axis of rhs, flattened), B the dot_general batch axes.
lhs is the activation x_MxK, rhs the weight w_KxN. The three GEMMs of y = x·w and their operands:

  fprop  y_MxN  = x · w      x 1x16 along K, nearest;  w 16x16 tiles (``weight_2d``) or 1x16 along K
  dgrad  dx_MxK = dy · wᵀ    dy 1x16 along N, stochastic;  w: the fprop tiles transposed (no new
                             quantization) with ``weight_2d``, else w quantized 1x16 along N
  wgrad  dw_KxN = xᵀ · dy    RHT(xᵀ) and RHT(dyᵀ) along M, then 1x16 along M; dy stochastic

(16 for nvfp4; mxfp4 uses 1x32 blocks and no 2D tiles; fp8 1x128 blocks, 128x128 weight tiles, no
stochastic rounding and no RHT.) That is the paper's table; every recipe is such a table of six role
quantizers (``Recipe.roles``, fp4jax.quantizers: 4/6, Quartet II's MS-EDEN backward, TetraJet-v2's DBQ),
and this one custom_vjp runs them all. A GEMM whose roles are None is a plain ``lax.dot_general`` of
the unquantized operands. The residuals are FP4: the quantized wgrad x and dgrad w, or the fprop tiles,
or the forward-quantized x̂ and ŵ that Quartet II and TetraJet-v2 re-quantize; an unquantized operand
is saved only when a GEMM in "bf16" needs it. All three GEMMs accumulate in float32
(``fp4jax.gemm.matmul``); dx and dw come back in the dtypes of x and w.

Shapes that are not multiples of the blocks (and of ``rht_size`` along M) are zero-padded in whole
elements before quantization. Zeros change neither a tensor's amax nor any block's or tile's amax, so
every real element is quantized exactly as it would be without the padding, and padded elements
quantize to zero and contribute nothing; the result is sliced back to the unpadded shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp4jax import api, derivatives, eager, gemm, prequantized
from fp4jax.numerics import eden
from fp4jax.api import check_dot_inputs, transpose_tiles
from fp4jax.numerics.layout import pad_to_multiple
from fp4jax.primitives import sharding as shd
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import TRANSPOSED, Roles, shared_amaxes
from fp4jax.recipes import as_recipe

MISSING_KEY_MESSAGE = (
    "stochastic rounding of the gradients (Recipe.stochastic_grad=True) needs random bits, and no key "
    "was given. Pass key=jax.random.key(...) to fp4jax.dot / fp4jax.dot_general; with the Flax modules "
    "provide the 'fp4' rng stream: linen model.apply(variables, x, rngs={'fp4': key}), NNX "
    "Fp4DotGeneralNNX(recipe, rngs=nnx.Rngs(fp4=seed)). Or use a recipe with stochastic_grad=False.")
MISSING_KEY_REASON_MESSAGE = (
    "the backward pass of recipe {name!r} draws random bits ({why}), and no key was given. Pass "
    "key=jax.random.key(...) to fp4jax.dot / fp4jax.dot_general (a different key per call site and "
    "step); with the Flax modules provide the 'fp4' rng stream, e.g. model.apply(variables, x, "
    "rngs={{'fp4': key}}).")


def needs_key(recipe) -> bool:
  """Whether the backward pass of ``recipe`` draws random bits (stochastic rounding, random signs)."""
  return recipe.needs_key


def _exact(a, b, dims, precision):
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def values(t):
  """The forward-quantized values the backward pass re-quantizes (float32): x̂, ŵ, or x, w unquantized."""
  return api.dequantize(t) if isinstance(t, QTensor) else t.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------------
# The custom_vjp on aligned 2-D operands x_MxK, w_KxN, for any Roles
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("key", "w_saved", "x_saved", "groups", "amaxes"),
                   meta_fields=("x_dtype", "w_dtype"))
@dataclasses.dataclass(frozen=True)
class Residuals:
  """What the forward pass saves: the FP4 operands the backward pass reads, never x or w unquantized
  unless a GEMM that needs them runs in bf16. ``save`` builds it; ``w_dgrad`` and ``x_wgrad`` read it."""
  key: Any        # None unless the backward pass draws random bits
  w_saved: Any    # ``w_dgrad`` as saved: its amax in ``amaxes`` where they are one array
  x_saved: Any    # ``x_wgrad`` as saved, likewise
  x_dtype: Any
  w_dtype: Any
  groups: Any = None   # the layout's traced operand (fp4jax.grouped: the group sizes); None for one dot
  amaxes: Any = None   # float32 (2,): the tensor amaxes of w_dgrad and x_wgrad, or None (each in its QTensor)

  @classmethod
  def save(cls, key, w_dgrad, x_wgrad, x_dtype, w_dtype, groups=None):
    """The residuals, the two operands' tensor amaxes (where both are float32 scalars) in one array named as
    the FP4 operands are (``api.FP4_OPERAND``): a scanned layer saves one amax array, not two, each of which
    was a write per layer in the forward loop and a read per layer in the backward one (docs/PERF.md, "The
    kernel count of the proved step")."""
    scalar = lambda t: isinstance(t, QTensor) and t.amax is not None and jnp.shape(t.amax) == () and \
        jnp.result_type(t.amax) == jnp.float32
    if not (scalar(w_dgrad) and scalar(x_wgrad)):
      return cls(key, w_dgrad, x_wgrad, x_dtype, w_dtype, groups)
    amaxes = checkpoint_name(jnp.stack([w_dgrad.amax, x_wgrad.amax]), api.FP4_OPERAND)
    return cls(key, _without_amax(w_dgrad), _without_amax(x_wgrad), x_dtype, w_dtype, groups, amaxes)

  @property
  def w_dgrad(self):
    """QTensor (K, N) along N (the weight tiles themselves when ``tiles_in_place``); or the fprop QTensor
    (N, K) (tiles to transpose, or ŵ to re-quantize); or w (dgrad in bf16; wᵀ when fprop is bf16 and dgrad
    re-quantizes)."""
    return self.w_saved if self.amaxes is None else dataclasses.replace(self.w_saved, amax=self.amaxes[0])

  @property
  def x_wgrad(self):
    """QTensor (K, M) along M; or the fprop QTensor x̂ (M, K) to re-quantize; or x."""
    return self.x_saved if self.amaxes is None else dataclasses.replace(self.x_saved, amax=self.amaxes[1])

  @property
  def nbytes(self) -> int:
    leaves = jax.tree.leaves((self.w_saved, self.x_saved, self.amaxes))
    return sum(int(a.size) * a.dtype.itemsize for a in leaves)


def _without_amax(q: QTensor) -> QTensor:
  return dataclasses.replace(q, amax=None)


def gemm_keys(key, rht_size):
  """(signs, key of the first operand, key of the second) of one backward GEMM: with a random
  transform its signs and both operands' bits come from one three-way split; else the gradient
  operand rounds with the GEMM's key itself."""
  if rht_size is None:
    return None, key, key
  k_sign, k_a, k_b = jax.random.split(key, 3)
  return eden.random_signs(k_sign, rht_size), k_a, k_b


class Dense:
  """The operands of one dot: x (M, K), w (K, N), each one tensor, and the six operations the role logic
  below runs on them. ``fp4jax.grouped`` gives the same operations for E experts' groups of rows (its
  ``Experts``), so both run the one custom_vjp ``_qdot``. ``bind(groups, m)``: the operations for the
  traced ``groups`` (None here) and m rows."""

  def bind(self, groups, m):
    del groups, m
    return self

  def rows(self, q, t_RxC, key=None, signs=None, amax=None):    # t (R, C) along C: x, dy
    return q(t_RxC, key, signs, amax)

  def tokens(self, q, t_TxC, key=None, signs=None, amax=None):  # tᵀ (C, T) along the tokens T: x, dy of wgrad
    return q.quantize_t(t_TxC, key, signs, amax)

  def amaxes(self, q_rows, q_tokens, t_TxC):             # both tensor amaxes of t from one read of it
    return shared_amaxes(q_rows, q_tokens, t_TxC)

  def weight(self, q, w, key=None, signs=None):          # w along its last axis
    return q(w, key, signs)

  def weight_t(self, q, w, key=None, signs=None):        # wᵀ along its first axis (ŵ re-quantized)
    return q.quantize_t(w, key, signs)

  def transpose(self, w):
    return w.T

  def transpose_tiles(self, q_w):
    """The tiles transposed, whole along their first axis first on a mesh: it becomes the transposed codes' last
    axis, which the next GEMM contracts and needs whole. Gathered after the transpose, along that minor axis,
    the partitioner transposes the codes to make it major, gathers, and transposes back (fprop's tiles (K, N)
    under FSDP, which shards K: two passes over the codes and one over the scales more per fprop)."""
    whole = dataclasses.replace(q_w, data=shd.whole_along_first(q_w.data), scale=shd.whole_along_first(q_w.scale))
    return transpose_tiles(whole)

  def values(self, t):
    return values(t)

  def weight_values(self, t):
    return values(t)

  def gemm(self, q_a, q_b, out_dtype):                   # rows of a times b, contracting both last axes
    return gemm.matmul(q_a, q_b, out_dtype=out_dtype)

  def gemm_tokens(self, q_a, q_b, out_dtype):            # wgrad: both operands along the tokens
    return gemm.matmul(q_a, q_b, out_dtype=out_dtype)

  def exact(self, a, b, gemm_name, precision):
    dims = {"fprop": ((1,), (0,)), "dgrad": ((1,), (1,)), "wgrad": ((0,), (0,))}[gemm_name]
    return _exact(a, b, dims, precision)

  def split(self, key):
    key_d, key_w = jax.random.split(key)   # independent streams for the two GEMMs
    return key_d, key_w

  def gemm_keys(self, key, rht_size):
    return (None, None, None) if key is None else gemm_keys(key, rht_size)


DENSE = Dense()


@jax.named_scope("fprop")
def _fprop(roles: Roles, precision, out_dtype, ops, x_MxK, w_KxN, q_x=None, amax_x=None, q_w=None):
  """y and the fprop-quantized operands (None when fprop runs unquantized; w's tiles (K, N) when
  ``tiles_in_place``, else (N, K) as fprop reads them). ``q_x``: x already
  quantized as ``roles.fprop_x`` quantizes it (a ``PreQuantized`` input), used instead of quantizing;
  ``amax_x``: x's tensor amax, when ``_shared_amaxes`` read it with the wgrad's; ``q_w``: w already quantized
  as ``fprop_weight`` quantizes it, used instead of quantizing."""
  if roles.fprop_x is None:
    return ops.exact(x_MxK, w_KxN, "fprop", precision).astype(out_dtype), None, None
  q_x = ops.rows(roles.fprop_x, x_MxK, amax=amax_x) if q_x is None else q_x
  q_w = fprop_weight(roles, ops, w_KxN) if q_w is None else q_w
  if tiles_in_place(roles):   # w's tiles along N, as dgrad reads them; fprop reads their transpose
    return ops.gemm(q_x, ops.transpose_tiles(q_w), out_dtype), q_x, q_w
  return ops.gemm(q_x, q_w, out_dtype), q_x, q_w


def fprop_weight(roles: Roles, ops, w_KxN):
  """w quantized for the fprop GEMM: its tiles in w's own layout (K, N) when ``tiles_in_place``, else wᵀ
  (N, K) along K. ``ops``: ``DENSE``, or fp4jax.grouped's experts (their weight operations need no groups)."""
  if tiles_in_place(roles):
    return ops.weight(roles.fprop_w, w_KxN)                                          # (K, N)
  return ops.weight(roles.fprop_w, ops.transpose(w_KxN))                             # (N, K)


def weight_read_by_fprop_only(roles: Roles) -> bool:
  """Whether the dot reads w only through ``fprop_weight``'s codes: fprop quantized, and dgrad quantized with
  the fprop tiles transposed or ŵ re-quantized. Then w may arrive already quantized (``quantized_dot``'s
  ``pre_w``) and its values are never read; wgrad (xᵀ · dy) reads no w."""
  return (roles.fprop_x is not None and roles.fprop_w is not None and roles.dgrad_dy is not None
          and (roles.dgrad_w == TRANSPOSED or roles.requantize))


def tiles_in_place(roles: Roles) -> bool:
  """Whether the dot quantizes w's weight tiles in w's own layout (K, N), packed along N as dgrad reads them,
  and hands fprop their transpose (``transpose_tiles``), instead of quantizing wᵀ for fprop and transposing the
  tiles for dgrad. Either way every code and scale is the same: a square tile's amax, its scale and each
  element's nearest code do not depend on the tile's orientation (``Quantizer.tiles_transpose``). In place,
  no transposed copy of w is written (a kernel cannot fuse the transpose of its operand) and the codes are
  transposed once, in the forward pass (docs/DESIGN.md, "Weight tiles quantized in w's own layout")."""
  return roles.dgrad_w == TRANSPOSED and roles.fprop_w.tiles_transpose


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _qdot(roles, precision, out_dtype, layout, x_MxK, w_KxN, key, groups, pre_x, pre_w, pre_amax_xt):
  del key, pre_amax_xt
  return _fprop(roles, precision, out_dtype, layout.bind(groups, x_MxK.shape[0]), x_MxK, w_KxN, pre_x,
                q_w=pre_w)[0]


def _shared_amaxes(ops, gemm_name, q_rows, q_tokens, t_TxC):
  """(amax of the rows quantize, amax of the wgrad's RHT quantize) of one operand (x, dy) from one read of
  it, or (None, None) (``quantizers.shared_amaxes``): the wgrad pass then reads the operand once. Named as
  the rows quantize (``gemm_name``: fprop for x, dgrad for dy), the pass whose own amax read it replaces."""
  with jax.named_scope(gemm_name), jax.named_scope("fp4jax/quantize"):
    return ops.amaxes(q_rows, q_tokens, t_TxC)


def _qdot_fwd(roles, precision, out_dtype, layout, x_MxK, w_KxN, key, groups, pre_x, pre_w, pre_amax_xt):
  """``pre_amax_xt``: with ``pre_x``, the amax of the wgrad quantize of x that its producer read
  (``prequantized.wgrad_amax``), or None."""
  # Differentiated again only by a second derivative, which the rounding would make zero (fp4jax.derivatives).
  x_MxK, w_KxN = derivatives.refuse_tangents((x_MxK, w_KxN), _second_order(roles))
  ops = layout.bind(groups, x_MxK.shape[0])
  if pre_x is not None or roles.requantize:
    amax_x, amax_xt = None, pre_amax_xt
  else:
    amax_x, amax_xt = _shared_amaxes(ops, "fprop", roles.fprop_x, roles.wgrad_x, x_MxK)
  y_MxN, q_x, q_wt = _fprop(roles, precision, out_dtype, ops, x_MxK, w_KxN, pre_x, amax_x, pre_w)
  if roles.dgrad_dy is None:
    w_dgrad = w_KxN
  elif roles.dgrad_w == TRANSPOSED or roles.requantize:
    w_dgrad = ops.transpose(w_KxN) if q_wt is None else q_wt   # transposed, or re-quantized, in backward
  else:
    w_dgrad = ops.weight(roles.dgrad_w, w_KxN)                                       # (K, N) along N
  with jax.named_scope("wgrad"):
    if roles.wgrad_x is None:
      x_wgrad = x_MxK
    elif roles.requantize:
      x_wgrad = x_MxK if q_x is None else q_x
    else:
      x_wgrad = ops.tokens(roles.wgrad_x, x_MxK, amax=amax_xt)                       # (K, M) along M
  res = Residuals.save(key if roles.needs_key else None, w_dgrad, x_wgrad, x_MxK.dtype, w_KxN.dtype, groups)
  return y_MxN, res


def _qdot_bwd(roles, precision, out_dtype, layout, res, dy_MxN):
  del out_dtype
  res, dy_MxN = derivatives.refuse_tangents((res, dy_MxN), _second_order(roles))
  ops = layout.bind(res.groups, dy_MxN.shape[0])
  key_d = key_w = None
  if roles.needs_key:
    if res.key is None:
      raise ValueError(MISSING_KEY_MESSAGE if roles.key_reason is None else
                       MISSING_KEY_REASON_MESSAGE.format(name=roles.name, why=roles.key_reason))
    key_d, key_w = ops.split(res.key)
  amax_dy, amax_dyt = (None, None) if roles.requantize or roles.dgrad_rht or roles.wgrad_rht else _shared_amaxes(
      ops, "dgrad", roles.dgrad_dy, roles.wgrad_dy, dy_MxN)
  # Dgrad dx = dy · wᵀ, contracting N.
  with jax.named_scope("dgrad"):   # inside "fp4jax/dot" (the caller's scope)
    if roles.dgrad_dy is None:
      dx_MxK = ops.exact(dy_MxN, res.w_dgrad, "dgrad", precision)
    else:
      signs, k_dy, k_w = ops.gemm_keys(key_d, roles.dgrad_rht)
      if roles.dgrad_w == TRANSPOSED:                                                # (K, N)
        q_w = res.w_dgrad if tiles_in_place(roles) else ops.transpose_tiles(res.w_dgrad)
      elif roles.requantize:
        q_w = ops.weight_t(roles.dgrad_w, ops.weight_values(res.w_dgrad), k_w, signs)   # ŵ (N, K) -> (K, N)
      else:
        q_w = res.w_dgrad
      q_dy = ops.rows(roles.dgrad_dy, dy_MxN, k_dy, signs, amax_dy)
      dx_MxK = ops.gemm(q_dy, q_w, res.x_dtype)
  # Wgrad dw = xᵀ · dy, both operands along the tokens.
  with jax.named_scope("wgrad"):
    if roles.wgrad_x is None:
      dw_KxN = ops.exact(res.x_wgrad, dy_MxN, "wgrad", precision)
    else:
      signs, k_x, k_dy = ops.gemm_keys(key_w, roles.wgrad_rht)
      if roles.requantize:
        q_xt = ops.tokens(roles.wgrad_x, ops.values(res.x_wgrad), k_x, signs)        # x̂ (M, K) -> (K, M)
      else:
        q_xt = res.x_wgrad
      q_dyt = ops.tokens(roles.wgrad_dy, dy_MxN, k_dy, signs, amax_dyt)              # (N, M)
      dw_KxN = ops.gemm_tokens(q_xt, q_dyt, res.w_dtype)
  # The GEMMs return dx and dw in the inputs' dtypes (the float32 result rounded once, as a cast after them
  # would: fp4jax.gemm), and the cast comes before the barrier: on the GPU it then fuses into the GEMM's
  # epilogue instead of a separate float32 pass after the barrier (1.5 GiB less at 8192³).
  dx_MxK, dw_KxN = dx_MxK.astype(res.x_dtype), dw_KxN.astype(res.w_dtype)
  if roles.release_dx_with_dw:
    # dx is released only together with dw. Without this the scheduler runs the input-gradient chain through
    # every earlier layer first and keeps each layer's wgrad operands live until its deferred wgrad GEMM
    # (docs/PERF.md, "The 12B on a simulated CPU mesh": the 12B step on 64 devices 36.3 -> 23.1 GiB). The
    # barrier changes no value; without it (Recipe.release_dx_with_dw) XLA can pipeline dw's reduction.
    dx_MxK, dw_KxN = lax.optimization_barrier((dx_MxK, dw_KxN))
  return dx_MxK, dw_KxN, None, None, None, None, None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _second_order(roles) -> str:
  return derivatives.DOT_MESSAGE.format(name=roles.name, what=derivatives.SECOND_ORDER)


def quantized_dot(roles: Roles, layout, x, w, key=None, groups=None, *, precision=None, out_dtype, pre_w=None):
  """The custom_vjp on aligned operands, for ``layout``'s operands (``DENSE``, or fp4jax.grouped's
  experts with their traced ``groups``): the one role logic of every quantized dot. ``pre_w``: w's
  ``fprop_weight`` codes, made by the caller (``weight_read_by_fprop_only`` roles only); w then gives the
  gradient's dtype and receives dw, and its values are not read."""
  derivatives.check_not_forward_mode(roles.name, x, w)
  if pre_w is not None and not weight_read_by_fprop_only(roles):
    raise ValueError(f"Roles {roles.name!r} read the weight itself in a GEMM besides fprop's codes; pass the "
                     "weight, not its quantization")
  return _qdot(roles, precision, jnp.dtype(out_dtype), layout, x, w, key, groups, None, pre_w, None)


def residuals(recipe, x_MxK, w_KxN, key=None) -> Residuals:
  """What the forward pass saves for the backward pass on aligned operands (byte counts, tests)."""
  return _qdot_fwd(as_recipe(recipe).roles, None, x_MxK.dtype, DENSE, x_MxK, w_KxN, key, None, None, None,
                   None)[1]


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def _dot_2d(roles, precision, out_dtype, x_MxK, w_KxN, key, pre_x=None, pre_amax_xt=None, pre_w=None):
  derivatives.check_not_forward_mode(roles.name, x_MxK, w_KxN)
  return _dot_2d_checked(roles, precision, out_dtype, x_MxK, w_KxN, key, pre_x, pre_amax_xt, pre_w)


@eager.compiled_when_eager(static_argnums=(0, 1, 2))
def _dot_2d_checked(roles, precision, out_dtype, x_MxK, w_KxN, key, pre_x, pre_amax_xt, pre_w):
  m, k = x_MxK.shape
  n = w_KxN.shape[1]
  align_m, align_k, align_n = roles.alignment()
  x_MxK = pad_to_multiple(pad_to_multiple(x_MxK, 0, align_m), 1, align_k)
  w_KxN = pad_to_multiple(pad_to_multiple(w_KxN, 0, align_k), 1, align_n)
  if pre_x is not None:
    pre_x = prequantized.pad_rows(pre_x, x_MxK.shape[0])
  return _qdot(roles, precision, out_dtype, DENSE, x_MxK, w_KxN, key, None, pre_x, pre_w, pre_amax_xt)[:m, :n]


# The Flax variable collection of weights quantized ahead of their layers: at a layer's path, "kernel" holds the
# fprop QTensor of its kernel (``quantize_weight``; the experts' ``fp4jax.grouped.quantize_experts``), which the
# layer reads instead of quantizing the kernel (``fp4jax.flax.Dense``, ``models.moe``'s experts).
PREQUANTIZED = "prequantized"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A weight w (K, N) with ``q``, its fprop quantization as ``fp4jax.dot`` makes it (``quantize_weight``):
  the codes and scales of its tiles (16x16 for NVFP4) and its tensor amax. ``dot`` and ``dot_general`` read
  the codes in place of quantizing w and give w the gradient; w's values are not read, so a weight quantized
  once (ahead of a layer scan, or before a gather across devices) is not quantized again per use."""

  w: Any
  q: QTensor
  recipe: Any = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    return self.w.shape

  @property
  def dtype(self):
    return self.w.dtype

  @property
  def ndim(self):
    return self.w.ndim


def can_quantize_weight(recipe) -> bool:
  """Whether ``recipe``'s dot reads the weight only through its fprop codes (``weight_read_by_fprop_only``:
  NVFP4's 16x16 tiles, transposed for dgrad, and the recipes that re-quantize ŵ), so that ``quantize_weight``
  can quantize it ahead of the dot."""
  recipe = as_recipe(recipe)
  return recipe.quantizes_anything and weight_read_by_fprop_only(recipe.roles)


def quantize_weight(w_KxN, *, recipe) -> QuantizedWeight:
  """w (K, N) with its fprop quantization for ``dot(..., recipe=recipe)``: bit for bit the codes the dot
  computes from w itself (w padded to the recipe's alignment as the dot pads it; one tensor amax)."""
  recipe = as_recipe(recipe)
  if not can_quantize_weight(recipe):
    raise ValueError(f"recipe {recipe.name!r} reads the weight itself in a GEMM besides fprop's codes "
                     "(fp4jax.can_quantize_weight); pass the weight to the dot as it is")
  w_KxN = jnp.asarray(w_KxN)
  if w_KxN.ndim != 2:
    raise ValueError(f"fp4jax.quantize_weight takes a 2-D weight w [K, N]; got shape {w_KxN.shape}")
  _, align_k, align_n = recipe.roles.alignment()
  w_p = pad_to_multiple(pad_to_multiple(w_KxN, 0, align_k), 1, align_n)
  return QuantizedWeight(w_KxN, fprop_weight(recipe.roles, DENSE, lax.stop_gradient(w_p)), recipe)


def _unwrap_weight(rhs, recipe, dimension_numbers):
  """(w, its fprop codes or None) of ``dot_general``'s rhs."""
  if not isinstance(rhs, QuantizedWeight):
    return rhs, None
  if rhs.recipe != recipe:
    raise ValueError(f"fp4jax.dot_general: the weight was quantized for recipe {rhs.recipe.name!r}, the dot runs "
                     f"{recipe.name!r}; quantize it with the dot's recipe (fp4jax.quantize_weight)")
  (_, rc), (lb, rb) = dimension_numbers
  if rhs.w.ndim != 2 or tuple(int(a) % 2 for a in rc) != (0,) or tuple(lb) or tuple(rb):
    raise ValueError(f"fp4jax.dot_general: a QuantizedWeight is a weight w [K, N] contracted along K, with no "
                     f"batch dimensions; got dimension_numbers {dimension_numbers} for w {rhs.w.shape}")
  want = jax.eval_shape(lambda w: quantize_weight(w, recipe=recipe).q,
                        jax.ShapeDtypeStruct(rhs.w.shape, rhs.w.dtype))
  leaves = lambda t: [(a.shape, jnp.dtype(a.dtype)) for a in jax.tree.leaves(t)]
  if jax.tree.structure(want) != jax.tree.structure(rhs.q) or leaves(want) != leaves(rhs.q):
    raise ValueError(f"fp4jax.dot_general: the weight's codes are not those {recipe.name!r} makes for a {rhs.w.dtype} "
                     f"w {rhs.w.shape} (got {jax.tree.structure(rhs.q)} {leaves(rhs.q)}); make them with "
                     "fp4jax.quantize_weight(w, recipe=...) from the weight as the dot receives it")
  return rhs.w, rhs.q


@jax.named_scope("fp4jax/dot")   # names every op of the three GEMMs in XLA profiles
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                recipe, key=None, out_sharding=None):
  """``lax.dot_general`` with the three GEMMs of training quantized as ``recipe`` says (spec §6).

  lhs is treated as the activation (1D blocks along its contracting axes), rhs as the weight (2D tiles
  with ``recipe.weight_2d``). Batch dimensions give independent GEMMs (each with its own tensor amax).
  recipe: an ``fp4jax.Recipe`` or a preset name ("nvfp4", "mxfp4", "fp8", "bf16", ...), or a table of six
    role quantizers (``fp4jax.quantizers.Roles``, e.g. a recipe's ``.roles`` with one role replaced).
  key: a ``jax.random`` key for stochastic rounding in the backward pass; needed only when the
    gradient is taken with a recipe that rounds stochastically. Use a different key per call site
    and step.
  Output dtype: ``preferred_element_type`` if given, else ``recipe.out_dtype``, else that of
  ``lax.dot_general(lhs, rhs)``. ``precision`` applies to the GEMMs that run unquantized.
  A recipe that quantizes nothing is exactly ``lax.dot_general`` (values and gradients).
  """
  recipe = as_recipe(recipe)
  rhs, pre_w = _unwrap_weight(rhs, recipe, dimension_numbers)
  if isinstance(lhs, prequantized.PreQuantized):
    return _dot_prequantized(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe, key,
                             out_sharding, pre_w)
  lhs, rhs = check_dot_inputs(lhs, rhs, dimension_numbers, preferred_element_type, key,
                              recipe.quantizes_anything)
  if preferred_element_type is None and recipe.out_dtype is not None:
    preferred_element_type = recipe.out_dtype
  sharding_kw = {} if out_sharding is None else {"out_sharding": out_sharding}
  if not recipe.quantizes_anything:
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **sharding_kw)
  # lax validates the dimension numbers and tells us the output shape and dtype.
  out = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                                         preferred_element_type=preferred_element_type), lhs, rhs)
  (lc, rc), (lb, rb) = [[tuple(int(a) % arr.ndim for a in axes) for axes, arr in zip(pair, (lhs, rhs))]
                        for pair in dimension_numbers]
  lhs_free = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
  rhs_free = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
  b = math.prod(lhs.shape[a] for a in lb)
  k = math.prod(lhs.shape[a] for a in lc)
  m = math.prod(lhs.shape[a] for a in lhs_free)
  n = math.prod(rhs.shape[a] for a in rhs_free)
  x_BxMxK = jnp.transpose(lhs, (*lb, *lhs_free, *lc)).reshape(b, m, k)
  w_BxKxN = jnp.transpose(rhs, (*rb, *rc, *rhs_free)).reshape(b, k, n)
  if key is not None and not needs_key(recipe):
    key = None
  dot_2d = functools.partial(_dot_2d, recipe.roles, precision, out.dtype)
  if not lb:
    y_BxMxN = dot_2d(x_BxMxK[0], w_BxKxN[0], key, pre_w=pre_w)[None]
  elif key is None:
    y_BxMxN = jax.vmap(lambda x, w: dot_2d(x, w, None))(x_BxMxK, w_BxKxN)
  else:
    y_BxMxN = jax.vmap(dot_2d)(x_BxMxK, w_BxKxN, jax.random.split(key, b))
  y = y_BxMxN.reshape(out.shape)
  if out_sharding is not None:
    y = lax.with_sharding_constraint(y, out_sharding)
  return y


def _dot_prequantized(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe, key,
                      out_sharding, pre_w=None):
  """``dot_general`` of a ``PreQuantized`` activation: its fprop codes go into the fprop GEMM as they are
  (no second quantization of x), its wgrad amax (where it carries one for this recipe) into the wgrad
  quantize of x, and its x into the backward pass, exactly as an unfused call would."""
  x = lhs.x
  prequantized.check(lhs, recipe.roles, dimension_numbers, rhs)
  lhs_, rhs = check_dot_inputs(x, rhs, dimension_numbers, preferred_element_type, key, True)
  if preferred_element_type is None and recipe.out_dtype is not None:
    preferred_element_type = recipe.out_dtype
  out = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                                         preferred_element_type=preferred_element_type), lhs_, rhs)
  rc = int(dimension_numbers[0][1][0]) % rhs.ndim
  w_KxN = jnp.moveaxis(rhs, rc, 0).reshape(rhs.shape[rc], -1)
  if key is not None and not needs_key(recipe):
    key = None
  y_MxN = _dot_2d(recipe.roles, precision, out.dtype, lhs_.reshape(-1, x.shape[-1]), w_KxN, key, lhs.q,
                  prequantized.wgrad_amax(lhs, recipe.roles), pre_w)
  y = y_MxN.reshape(out.shape)
  if out_sharding is not None:
    y = lax.with_sharding_constraint(y, out_sharding)
  return y


def dot(x, w, *, recipe, key=None, preferred_element_type=None):
  """x [..., K] · w [K, N] -> [..., N], quantized as ``recipe`` says (see ``dot_general``). x may be an
  ``fp4jax.PreQuantized`` (``fp4jax.prequantize``, or a producer kernel's output): its fprop codes are
  used as they are, bit-identical to quantizing its x here. w may be an ``fp4jax.QuantizedWeight``
  (``fp4jax.quantize_weight``, the same recipe): its codes likewise, bit-identical to quantizing w here."""
  x = x if isinstance(x, prequantized.PreQuantized) else jnp.asarray(x)
  w = w if isinstance(w, QuantizedWeight) else jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"fp4jax.dot takes a 2-D weight w [K, N]; got shape {w.shape}. "
                     "Use fp4jax.dot_general for other layouts")
  return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                     preferred_element_type=preferred_element_type, recipe=recipe, key=key)
