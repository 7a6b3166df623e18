"""The quantized dot for the recipes beyond the NVFP4 paper: NVFP4 with Four Over Six, Quartet II and
TetraJet-v2, as one ``jax.custom_vjp`` on aligned 2-D operands x_MxK, w_KxN.

Axis legend: M tokens, K input features (the fprop contraction), N output features.

  scheme     fprop y = x·w                      dgrad dx = dy·wᵀ                  wgrad dw = xᵀ·dy
  nvidia     x 1x16, w 16x16 tiles (or 1x16)   dy 1x16 along N, SR;              RHT-16(xᵀ), RHT-16(dyᵀ)
  + 4/6      nearest; 4/6 per role              w: the fprop tiles transposed      along M, 1x16; dy SR;
                                                (or w 1x16 along N)               x with 4/6 if activations
  quartet2   x, w 1x16 along K, nearest        RHT-128 along N of dy and of the    RHT-128 along M of the
             or 4/6                            forward-quantized ŵ, MS-EDEN       forward-quantized x̂ and dy
  tetrajet2  x, w DBQ along K, nearest         RHT-16 along N of dy and ŵ, SR DBQ  RHT-16 along M of x̂, dy, SR DBQ

The signs of Quartet II's and TetraJet-v2's transforms are drawn from the dot's key, one vector per
GEMM (so per layer, step and GEMM when every call site gets its own key), shared by the GEMM's two
operands so that the transform cancels. Every operand is a GEMM-ready quantized tensor (``Operand``):
E2M1 codes packed two per byte, E4M3 scales, a float32 tensor-level number; the residuals saved for
the backward pass are such operands (FP4), never the unquantized inputs, unless a GEMM runs in bf16.
A GEMM multiplies the exact bf16 products e2m1·scale with float32 accumulation and then applies the
format's tensor factor: (amax_A·amax_B)/(36·B_A·B_B) for NVFP4 (B = 448) and 4/6 (B = 256 or 448),
s_dec_A·s_dec_B for MS-EDEN, and one float32 rescale per 128-chunk for DBQ.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import dbq, e2m1, eden, four_over_six as fos, hadamard, nvfp4, random_bits
from fp4jax._exact import product

SCHEMES = ("nvidia", "quartet2", "tetrajet2")
_PLAIN_BOUND = 448


# ---------------------------------------------------------------------------------------------------
# Quantized operands
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("packed", "scale", "tensor"),
                   meta_fields=("kind", "bound", "tiled"))
@dataclasses.dataclass(frozen=True)
class Operand:
  """A 2-D tensor (R, C) quantized along C, the contraction axis of its GEMM.

  packed: uint8 (R, C/2), two E2M1 codes per byte, even element in the low nibble.
  scale:  float8_e4m3fn (R, C/16), or (R/16, C/16) with ``tiled`` (16x16 tiles).
  tensor: float32: the tensor amax ("nvfp4", with the 4/6 bound ``bound``; 448 is plain NVFP4),
          s_dec ("eden"), or the per-128 scales (R, C/128) ("dbq").
  """
  packed: Any
  scale: Any
  tensor: Any
  kind: str
  bound: int = _PLAIN_BOUND
  tiled: bool = False

  @property
  def nbytes(self) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in (self.packed, self.scale, self.tensor))

  def codes(self):
    return e2m1.unpack(self.packed)

  def scaled_values(self):
    """e2m1val · f32(block scale), float32 (R, C), exact in bfloat16."""
    if self.tiled:
      s = jnp.repeat(jnp.repeat(self.scale.astype(jnp.float32), 16, axis=-2), 16, axis=-1)
    else:
      s = jnp.repeat(self.scale.astype(jnp.float32), 16, axis=-1)
    return e2m1.decode(self.codes()) * s

  def dequantize(self):
    """float32 values in each format's own order (§2, §9.6, §10.3, §11.2)."""
    if self.kind == "dbq":
      return dbq.dequantize(dbq.Dbq(self.codes(), self.scale, self.tensor))
    if self.kind == "eden":
      return eden.dequantize(self.codes(), self.scale, self.tensor)
    return fos.dequantize(self.codes(), self.scale, self.tensor, tiled=self.tiled, bound=self.bound)

  def transpose_tiles(self) -> "Operand":
    """The same quantized tensor read along the other axis (16x16 tiles only: no requantization)."""
    codes = self.codes().T
    return dataclasses.replace(self, packed=e2m1.pack(codes), scale=self.scale.T)


def gemm(a: Operand, b: Operand):
  """a (Ra, C) · b (Rb, C)ᵀ -> (Ra, Rb) float32."""
  if a.kind == "dbq":
    return dbq.gemm(dbq.Dbq(a.codes(), a.scale, a.tensor), dbq.Dbq(b.codes(), b.scale, b.tensor))
  acc = lax.dot_general(a.scaled_values().astype(jnp.bfloat16), b.scaled_values().astype(jnp.bfloat16),
                        (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST)
  # The factor is not a power of two: the result is rounded before any sum the caller forms with it.
  if a.kind == "eden":
    return product(acc, a.tensor * b.tensor)
  return product(acc, fos.gemm_factor(a.tensor, b.tensor, a.bound, b.bound))


def quantize_nvfp4(x_RxC, *, tiled=False, bits=None) -> Operand:
  """Plain NVFP4 (§2): 1x16 blocks along C (or 16x16 tiles), nearest or SR with ``bits``."""
  x = x_RxC.astype(jnp.float32)
  amax = nvfp4.tensor_amax(x)
  if tiled:
    codes, scale = nvfp4.quantize_blocks(fos.to_tiles(x), amax)
    codes = fos.from_tiles(codes, x.shape)
  else:
    x_blk = x.reshape(x.shape[0], -1, 16)
    bits_blk = None if bits is None else bits.reshape(x_blk.shape)
    codes, scale = nvfp4.quantize_blocks(x_blk, amax, bits=bits_blk)
    codes = codes.reshape(x.shape)
  return Operand(e2m1.pack(codes), scale, amax, "nvfp4", _PLAIN_BOUND, tiled)


def quantize_fos(x_RxC, *, tiled=False, metric="mse", bound=256) -> Operand:
  """Four Over Six (§9) along C (or 16x16 tiles)."""
  codes, scale, amax = fos.quantize(x_RxC.astype(jnp.float32), tiled=tiled, bound=bound, metric=metric)
  return Operand(e2m1.pack(codes), scale, amax, "nvfp4", bound, tiled)


def quantize_eden(y_RxC, key, *, group=128) -> Operand:
  """MS-EDEN (§10.3) of already rotated values along C, one uint16 per scale from ``key``."""
  e = eden.quantize(y_RxC, eden.scale_bits(key, y_RxC.shape), group=group)
  return Operand(e2m1.pack(e.codes), e.scale, e.s_dec, "eden")


def quantize_dbq(x_RxC, *, key=None) -> Operand:
  """Double-block NVFP4 (§11.2) along C; stochastic rounding with 8 bits per element from ``key``."""
  bits = None if key is None else random_bits.bits(key, x_RxC.shape, jnp.uint8)
  q = dbq.quantize(x_RxC.astype(jnp.float32), bits=bits)
  return Operand(e2m1.pack(q.codes), q.scale, q.outer, "dbq")


# ---------------------------------------------------------------------------------------------------
# Which quantizer each operand gets
# ---------------------------------------------------------------------------------------------------

def _fos_on(recipe, role):
  return recipe.four_over_six in ("all", role)


def _forward_operand(recipe, t_RxC, role):
  """x (role "activations") or wᵀ (role "weights") for fprop, quantized along K."""
  tiled = role == "weights" and recipe.scheme == "nvidia" and recipe.weight_2d
  if recipe.scheme == "tetrajet2":
    return quantize_dbq(t_RxC)
  if _fos_on(recipe, role):
    return quantize_fos(t_RxC, tiled=tiled, metric=recipe.four_over_six_metric,
                        bound=recipe.four_over_six_bound)
  return quantize_nvfp4(t_RxC, tiled=tiled)


def alignment(recipe):
  """Multiples (M, K, N) that the operands of the three GEMMs need."""
  if recipe.scheme == "quartet2":
    return 128, 16, 128
  if recipe.scheme == "tetrajet2":
    return 128, 128, 128
  m = max(16, recipe.rht_size) if recipe.rht else 16
  return m, 16, 16


def _bits(key, shape):
  return random_bits.bits(key, shape, jnp.uint8)


MISSING_KEY_MESSAGE = (
    "the backward pass of recipe {name!r} draws random bits ({why}), and no key was given. Pass "
    "key=jax.random.key(...) to fp4jax.dot / fp4jax.dot_general (a different key per call site and "
    "step); with the Flax modules provide the 'fp4' rng stream, e.g. model.apply(variables, x, "
    "rngs={{'fp4': key}}).")


def _require_key(recipe, res):
  if res.key is None:
    why = {"quartet2": "RHT-128 signs and MS-EDEN scale rounding",
           "tetrajet2": "RHT-16 signs and stochastic rounding"}.get(recipe.scheme, "stochastic rounding")
    raise ValueError(MISSING_KEY_MESSAGE.format(name=recipe.name, why=why))


def check_recipe(recipe):
  """Raise a ValueError, at recipe construction, for a combination the methods do not define."""
  if recipe.scheme not in SCHEMES:
    raise ValueError(f"Recipe.scheme={recipe.scheme!r}; use one of {SCHEMES}")
  if recipe.four_over_six not in fos.ROLES:
    raise ValueError(f"Recipe.four_over_six={recipe.four_over_six!r}; use one of {fos.ROLES}")
  fos.check_options(recipe.four_over_six_bound, recipe.four_over_six_metric)
  if recipe.eden_group not in eden.GROUPS:
    raise ValueError(f"Recipe.eden_group={recipe.eden_group!r}; use 128 (the Quartet II reference) or 16 "
                     "(its CUDA kernels)")
  name = recipe.name
  if recipe.four_over_six != "off":
    if recipe.scheme == "tetrajet2":
      raise ValueError(f"recipe {name!r}: four_over_six={recipe.four_over_six!r} with scheme='tetrajet2': "
                       "TetraJet-v2's double-block format (nvfp4_dbq) has no 4/6 rule; use "
                       "four_over_six='off', or fp4jax.recipes.nvfp4/quartet2 for 4/6")
    if recipe.fprop != "nvfp4":
      raise ValueError(f"recipe {name!r}: four_over_six={recipe.four_over_six!r} needs fprop='nvfp4' (got "
                       f"{recipe.fprop!r}): 4/6 chooses between two E4M3 block scales of NVFP4; MXFP4's "
                       "power-of-two scales and FP8 have no map-to-4 candidate")
    if recipe.scheme == "nvidia" and not {recipe.dgrad, recipe.wgrad} <= {"nvfp4", "bf16"}:
      raise ValueError(f"recipe {name!r}: NVFP4 with 4/6 runs dgrad and wgrad in 'nvfp4' or 'bf16'; got "
                       f"dgrad={recipe.dgrad!r}, wgrad={recipe.wgrad!r}")
  if recipe.scheme != "nvidia":
    method = {"quartet2": "Quartet II", "tetrajet2": "TetraJet-v2"}[recipe.scheme]
    if recipe.fprop not in ("nvfp4", "bf16"):
      raise ValueError(f"recipe {name!r}: {method} runs fprop in 'nvfp4' (or 'bf16'); got {recipe.fprop!r}")
    if recipe.dgrad != "nvfp4" or recipe.wgrad != "nvfp4":
      raise ValueError(f"recipe {name!r}: {method}'s backward pass is its own NVFP4 quantizer; set "
                       f"dgrad='nvfp4' and wgrad='nvfp4' (got {recipe.dgrad!r}, {recipe.wgrad!r})")
    if recipe.weight_2d:
      raise ValueError(f"recipe {name!r}: {method} quantizes the weight in 1x16 blocks along K; set "
                       "weight_2d=False")


def uses_schemes(recipe) -> bool:
  """Whether ``fp4jax.dot`` runs this module's custom_vjp (else the paper's recipe in fp4jax.dot)."""
  return recipe.scheme != "nvidia" or recipe.four_over_six != "off"


def needs_key(recipe) -> bool:
  return recipe.scheme != "nvidia"


# ---------------------------------------------------------------------------------------------------
# The custom_vjp
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=("key", "x", "w", "w_dgrad", "x_wgrad"),
                   meta_fields=("x_dtype", "w_dtype"))
@dataclasses.dataclass(frozen=True)
class Residuals:
  key: Any        # the backward pass's random bits and signs
  x: Any          # quartet2/tetrajet2: the forward-quantized x (Operand (M, K)), or x (fprop in bf16)
  w: Any          # quartet2/tetrajet2: the forward-quantized wᵀ (Operand (N, K)), or w (fprop in bf16)
  w_dgrad: Any    # nvidia: Operand for dgrad, (N, K) tiles or (K, N) along N; w for a bf16 dgrad
  x_wgrad: Any    # nvidia: Operand (K, M) after the RHT along M; x for a bf16 wgrad
  x_dtype: Any
  w_dtype: Any

  @property
  def nbytes(self) -> int:
    leaves = jax.tree.leaves((self.x, self.w, self.w_dgrad, self.x_wgrad))
    return sum(int(a.size) * a.dtype.itemsize for a in leaves)


def _exact(a, b, dims, precision):
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _fprop(recipe, precision, out_dtype, x_MxK, w_KxN):
  if recipe.fprop == "bf16":
    y = _exact(x_MxK, w_KxN, ((1,), (0,)), precision)
    return y.astype(out_dtype), None, None
  q_x = _forward_operand(recipe, x_MxK, "activations")
  q_wt = _forward_operand(recipe, w_KxN.T, "weights")
  return gemm(q_x, q_wt).astype(out_dtype), q_x, q_wt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def qdot(recipe, precision, out_dtype, x_MxK, w_KxN, key):
  """y = x·w quantized as ``recipe`` says (aligned operands, see ``alignment``); ``precision`` applies
  to the GEMMs that run in bf16."""
  del key
  return _fprop(recipe, precision, out_dtype, x_MxK, w_KxN)[0]


def _wgrad_rht(t_TxC, recipe):
  """nvidia: (C, T) = RHT of tᵀ along T with the recipe's fixed signs (or tᵀ without RHT)."""
  t_CxT = t_TxC.astype(jnp.float32).T
  if recipe.rht:
    return hadamard.rht(t_CxT, axis=-1, size=recipe.rht_size, seed=recipe.rht_seed)
  return t_CxT


def _qdot_fwd(recipe, precision, out_dtype, x_MxK, w_KxN, key):
  y, q_x, q_wt = _fprop(recipe, precision, out_dtype, x_MxK, w_KxN)
  x_res = w_res = w_dgrad = x_wgrad = None
  if recipe.scheme == "nvidia":
    if recipe.dgrad == "bf16":
      w_dgrad = w_KxN
    elif recipe.weight_2d:
      w_dgrad = q_wt                                      # transposed in the backward pass
    elif _fos_on(recipe, "weights"):
      w_dgrad = quantize_fos(w_KxN, metric=recipe.four_over_six_metric, bound=recipe.four_over_six_bound)
    else:
      w_dgrad = quantize_nvfp4(w_KxN)
    if recipe.wgrad == "bf16":
      x_wgrad = x_MxK
    elif _fos_on(recipe, "activations"):
      x_wgrad = quantize_fos(_wgrad_rht(x_MxK, recipe), metric=recipe.four_over_six_metric,
                             bound=recipe.four_over_six_bound)
    else:
      x_wgrad = quantize_nvfp4(_wgrad_rht(x_MxK, recipe))
  else:
    x_res = x_MxK if q_x is None else q_x
    w_res = w_KxN.T if q_wt is None else q_wt
  return y, Residuals(key, x_res, w_res, w_dgrad, x_wgrad, x_MxK.dtype, w_KxN.dtype)


def _forward_values(t):
  """The forward-quantized values the backward pass re-quantizes (float32)."""
  return t.dequantize() if isinstance(t, Operand) else t.astype(jnp.float32)


def _bwd_nvidia(recipe, precision, res, dy_MxN):
  key_d = key_w = None
  if recipe.needs_key:          # stochastic rounding of dy in an FP4 dgrad or wgrad
    _require_key(recipe, res)
    key_d, key_w = jax.random.split(res.key)
  if recipe.dgrad == "bf16":
    dx = _exact(dy_MxN, res.w_dgrad, ((1,), (1,)), precision)
  else:
    q_w = res.w_dgrad.transpose_tiles() if res.w_dgrad.tiled else res.w_dgrad      # (K, N)
    q_dy = quantize_nvfp4(dy_MxN, bits=None if key_d is None else _bits(key_d, dy_MxN.shape))
    dx = gemm(q_dy, q_w)
  if recipe.wgrad == "bf16":
    dw = _exact(res.x_wgrad, dy_MxN, ((0,), (0,)), precision)
  else:
    dyt = _wgrad_rht(dy_MxN, recipe)                                               # (N, M)
    q_dyt = quantize_nvfp4(dyt, bits=None if key_w is None else _bits(key_w, dyt.shape))
    dw = gemm(res.x_wgrad, q_dyt)
  return dx, dw


def _bwd_quartet2(recipe, precision, res, dy_MxN):
  """Both backward GEMMs: RHT-128 (fresh signs per GEMM) of both operands, then MS-EDEN."""
  del precision   # no GEMM of the backward pass runs unquantized
  _require_key(recipe, res)
  key_d, key_w = jax.random.split(res.key)
  x_hat, wt_hat = _forward_values(res.x), _forward_values(res.w)                  # (M, K), (N, K)
  dy = dy_MxN.astype(jnp.float32)
  group = recipe.eden_group
  # Dgrad dx = dy · ŵᵀ, contracting N.
  k_sign, k_a, k_b = jax.random.split(key_d, 3)
  s = eden.random_signs(k_sign)
  q_dy = quantize_eden(eden.rht(dy, s), k_a, group=group)                          # (M, N)
  q_w = quantize_eden(eden.rht(wt_hat.T, s), k_b, group=group)                     # (K, N)
  dx = gemm(q_dy, q_w)
  # Wgrad dw = x̂ᵀ · dy, contracting M.
  k_sign, k_a, k_b = jax.random.split(key_w, 3)
  s = eden.random_signs(k_sign)
  q_xt = quantize_eden(eden.rht(x_hat.T, s), k_a, group=group)                     # (K, M)
  q_dyt = quantize_eden(eden.rht(dy.T, s), k_b, group=group)                       # (N, M)
  return dx, gemm(q_xt, q_dyt)


def _bwd_tetrajet2(recipe, precision, res, dy_MxN):
  """Both backward GEMMs: RHT-16 (fresh signs per GEMM) of both operands, then DBQ with SR."""
  del precision
  _require_key(recipe, res)
  key_d, key_w = jax.random.split(res.key)
  x_hat, wt_hat = _forward_values(res.x), _forward_values(res.w)
  dy = dy_MxN.astype(jnp.float32)
  k_sign, k_a, k_b = jax.random.split(key_d, 3)
  s = eden.random_signs(k_sign, 16)
  dx = gemm(quantize_dbq(eden.rht(dy, s), key=k_a), quantize_dbq(eden.rht(wt_hat.T, s), key=k_b))
  k_sign, k_a, k_b = jax.random.split(key_w, 3)
  s = eden.random_signs(k_sign, 16)
  dw = gemm(quantize_dbq(eden.rht(x_hat.T, s), key=k_a), quantize_dbq(eden.rht(dy.T, s), key=k_b))
  return dx, dw


def _qdot_bwd(recipe, precision, out_dtype, res, dy_MxN):
  del out_dtype
  bwd = {"nvidia": _bwd_nvidia, "quartet2": _bwd_quartet2, "tetrajet2": _bwd_tetrajet2}[recipe.scheme]
  dx, dw = bwd(recipe, precision, res, dy_MxN)
  return dx.astype(res.x_dtype), dw.astype(res.w_dtype), None


qdot.defvjp(_qdot_fwd, _qdot_bwd)


def residuals(recipe, x_MxK, w_KxN, key) -> Residuals:
  """What the forward pass saves for the backward pass (for byte counts and tests)."""
  return _qdot_fwd(recipe, None, x_MxK.dtype, x_MxK, w_KxN, key)[1]
