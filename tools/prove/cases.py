"""The proof's inputs and comparisons: exactly-summable GEMM operands, quantize cases over many binades
and the special values, and the bit-for-bit and bounded comparisons of kernel and XLA outputs."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import api, formats, verdicts
from fp4jax.numerics.hadamard import rht
from fp4jax.qtensor import QTensor
from fp4jax.quantizers import Quantizer
from tools.prove.variants import Variant

Array = jax.Array
U = 2.0 ** -24               # float32 unit roundoff
F32_TINY = 2.0 ** -149       # float32's smallest subnormal


def compare_within(got, want, names, tol: float) -> dict:
  """Each output's largest |kernel - XLA| / the XLA output's largest magnitude; a mismatch is an output
  beyond ``tol`` or not finite."""
  if len(got) != len(want) or any(np.shape(g) != np.shape(w) for g, w in zip(got, want)):
    return dict(mismatches=max(len(want), 1), compared=len(want), tolerance=tol, max_error=float("nan"),
                errors={}, worst="", first=f"outputs differ in number or shape: kernel "
                f"{[np.shape(g) for g in got]}, XLA {[np.shape(w) for w in want]}")
  errs = []
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    errs.append(float(np.max(np.abs(g - w), initial=0) / max(float(np.max(np.abs(w), initial=0)), 1e-30)))
  bad = [i for i, e in enumerate(errs) if not e <= tol]
  worst = max(range(len(errs)), key=lambda i: (not np.isfinite(errs[i]), np.nan_to_num(errs[i])))
  return dict(mismatches=len(bad), compared=len(errs), tolerance=tol, max_error=errs[worst],
              errors=dict(zip(names, errs)), worst=names[worst],
              first=f"{names[worst]} {errs[worst]:.1e} of its largest magnitude > tol {tol:.0e}" if bad else "")


# ------------------------------------------------------------------------------------------ inputs

def many_binades(shape, seed: int) -> Array:
  """bf16 values over many binades, the first row's first 16 E2M1 ties and grid points (on the device)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(jax.random.uniform(k2, shape, jnp.float32, -4, 4))
  ties = jnp.asarray([0, .25, -.75, 1.25, 1.75, -2.5, 3.5, 5, 6, -6, .5, 1, 2, 3, 4, -1.5], jnp.float32)
  return x.at[0, :16].set(ties[:min(16, shape[1])]).astype(jnp.bfloat16)


def _with_specials(x: Array) -> Array:
  """x with NaN, +inf and -inf in blocks of their own and one block of NaN, inf and finite values."""
  r, c = x.shape
  at = [(1, 3, jnp.nan), (2 % r, 20 % c, jnp.inf), (3 % r, 40 % c, -jnp.inf), (5 % r, 64 % c, jnp.nan),
        (5 % r, 65 % c, jnp.inf), (r - 1, c - 1, jnp.nan)]
  for i, j, v in at:
    x = x.at[i, j].set(v)
  return x


def _quantize_cases(v: Variant, shape) -> list[tuple[str, Array, Array]]:
  """(case, x, amax): the tensor amax as training computes it (of RHT(x) for rht_t), or extreme."""
  x = many_binades(shape, 11)
  special = _with_specials(x)

  def amax_of(t):
    t = t.astype(jnp.float32)
    t = rht(t.T, axis=-1) if v.op == "quantize_rht_t" else t
    return jnp.max(jnp.where(jnp.isfinite(t), jnp.abs(t), 0))

  cases = [("random", x, amax_of(x)),
           ("tiny 2^-120", (x.astype(jnp.float32) * 2.0 ** -120).astype(jnp.bfloat16), None),
           ("huge 2^118", (x.astype(jnp.float32) * 2.0 ** 118).astype(jnp.bfloat16), None),
           ("nan/inf, finite amax", special, amax_of(special)),
           ("nan/inf, amax inf", special, jnp.float32(jnp.inf)),
           ("amax nan", x, jnp.float32(jnp.nan)),
           ("zeros", jnp.zeros(shape, jnp.bfloat16), jnp.float32(0))]
  out = []
  for name, t, amax in cases:
    if v.fmt != "nvfp4":          # MXFP4 has no tensor amax: the amax cases are the same input
      if name.startswith("amax") or name.endswith("amax inf"):
        continue
      amax = jnp.float32(0)
    out.append((name, t, amax_of(t) if amax is None else jnp.asarray(amax, jnp.float32)))
  return out


def exact_operand(rows: int, k: int, fmt: str, tiled: bool, seed: int, *, scales=None, amax=None) -> QTensor:
  """QTensor of random codes with scales 0.5 or 1 (``scales``: other scale bytes): every float32
  partial sum of a GEMM of two of them is exact (products are multiples of 2^-4, |sum| <= 36·K), so any
  summation order gives the same bits. ``amax``: the nvfp4 tensor amax (default random in [1, 100))."""
  rng = np.random.default_rng(seed)
  data = jnp.asarray(rng.integers(0, 256, (rows, k // 2)), jnp.uint8)
  tile = formats.TILE[fmt] if tiled else None
  s_shape = (rows // tile[0], k // tile[1]) if tiled else (rows, k // formats.BLOCK[fmt])
  choices = np.array(scales if scales is not None else [0x30, 0x38] if fmt == "nvfp4" else [126, 127], np.uint8)
  scale = jax.lax.bitcast_convert_type(jnp.asarray(rng.choice(choices, s_shape)), formats.SCALE_DTYPE[fmt])
  if fmt == "nvfp4":
    amax = jnp.float32(rng.uniform(1, 100) if amax is None else amax)
  else:
    amax = None
  return QTensor(data, scale, amax, fmt, -1, None if tiled else formats.BLOCK[fmt], tile,
                 jnp.dtype(jnp.float32), "rceil" if fmt == "mxfp4" else None)


def exact_native_operand(rows: int, k: int, q: Quantizer, seed: int, *, amax=None, scales=None) -> QTensor:
  """``exact_operand`` in q's format: 4/6 as bound 256, MS-EDEN with s_dec 0.5, DBQ with power-of-two
  outer scales, so that every float32 partial sum stays exact and any order gives the same bits. MXFP8:
  E4M3 integers in [-4, 4] with scales 0.5 or 1 (``scales``: other E8M0 bytes): products are multiples of
  2^-2 times the scales, at most 16 in magnitude, so sums over K <= 2^20 are exact."""
  if q.fmt == "mxfp8":
    rng = np.random.default_rng(seed)
    data = jnp.asarray(rng.integers(-4, 5, (rows, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    raw = rng.choice(np.array(scales if scales is not None else [126, 127], np.uint8), (rows, k // 32))
    scale = jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e8m0fnu)
    return QTensor(data, scale, None, "mxfp8", -1, 32, None, jnp.dtype(jnp.float32))
  base = exact_operand(rows, k, "nvfp4", q.tiled, seed, amax=amax)
  if q.fmt == "nvfp4":
    return base if q.four_over_six is None else dataclasses.replace(base, bound=q.four_over_six[0])
  rng = np.random.default_rng(seed + 100)
  if q.fmt == "nvfp4_eden":
    return QTensor(base.data, base.scale, None, "nvfp4_eden", -1, 16, None, base.dtype, scale2=jnp.float32(0.5))
  outer = jnp.asarray(rng.choice([0.25, 0.5, 1.0, 2.0], (rows, k // 128)), jnp.float32)
  return QTensor(base.data, base.scale, None, "nvfp4_dbq", -1, 16, None, base.dtype, scale2=outer)


def _with_nan_scales(q: QTensor) -> QTensor:
  nan = 0x7F if q.scale.dtype == jnp.float8_e4m3fn else 0xFF
  raw = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
  raw = raw.at[0, 0].set(nan).at[-1, -1].set(nan)
  return dataclasses.replace(q, scale=jax.lax.bitcast_convert_type(raw, q.scale.dtype))


def _gemm_cases(v: Variant, n: int) -> list[tuple[str, QTensor, QTensor]]:
  if v.op in (verdicts.NATIVE_OP, verdicts.MOSAIC_OP):
    qa, qb = v.pair
    make = lambda seed, q, **kw: exact_native_operand(n, n, q, seed, **kw)
    nvfp4 = v.fmt == "nvfp4"
    extremes = [("amax tiny 2^-100", 2.0 ** -100), ("amax huge 2^100", 2.0 ** 100),
                ("amax nan", float("nan"))] if nvfp4 else []
    cases = [("exact", make(3, qa), make(4, qb))]
    cases += [(name, make(3, qa, amax=a), make(4, qb, amax=a)) for name, a in extremes]
    if v.fmt == "mxfp8":   # E8M0 scales 2^±50 and 2^±51: still exact, far from 1
      cases += [(name, make(3, qa, scales=s), make(4, qb, scales=s))
                for name, s in (("scales 2^-50", [77, 76]), ("scales 2^50", [177, 178]))]
    return cases + [("nan scales", _with_nan_scales(cases[0][1]), cases[0][2])]
  (ta, tb), fmt = v.layout, v.fmt
  make = lambda seed, tiled, **kw: exact_operand(n, n, fmt, tiled, seed, **kw)
  cases = [("exact", make(3, ta), make(4, tb))]
  if fmt == "nvfp4":
    cases += [(name, make(3, ta, amax=a), make(4, tb, amax=a)) for name, a in
              (("amax tiny 2^-100", 2.0 ** -100), ("amax huge 2^100", 2.0 ** 100), ("amax nan", float("nan")))]
  else:   # E8M0 scales 2^±50 and 2^±51: still exact, far from 1
    cases += [(name, make(3, ta, scales=s), make(4, tb, scales=s))
              for name, s in (("scales 2^-50", [77, 76]), ("scales 2^50", [177, 178]))]
  return cases + [("nan scales", _with_nan_scales(cases[0][1]), cases[0][2])]


# ------------------------------------------------------------------------------------------ compare

def _bytes(a) -> np.ndarray:
  a = np.asarray(a)
  return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + ((a.dtype.itemsize,) if a.dtype.itemsize > 1 else ()))


def _nan_scale(scale_bytes: np.ndarray, fmt: str) -> np.ndarray:
  return (scale_bytes & 0x7F) == 0x7F if fmt == "nvfp4" else scale_bytes == 0xFF


def compare_quantized(got, want, v: Variant) -> dict:
  """Bytes of (codes, scales) that differ. Not compared (``dont_care``): the codes of a block whose
  scale byte is NaN on the XLA side (it dequantizes to NaN whatever they are). A block with a NaN input
  has the NaN scale byte on both sides (every block maximum keeps NaN: ``fp4jax.numerics.amax``)."""
  (gc, gs), (wc, ws) = (_bytes(t) for t in got), (_bytes(t) for t in want)
  if gc.shape != wc.shape or gs.shape != ws.shape:
    return dict(mismatches=max(wc.size, 1), dont_care=0, compared=int(wc.size + ws.size),
                first=f"shapes differ: kernel {gc.shape}/{gs.shape}, XLA {wc.shape}/{ws.shape}")
  nan = _nan_scale(ws, v.fmt)
  if v.op == "quantize_2d":    # (R/16, C/16) tiles over codes (R, C/2): 16 rows x 8 bytes each
    r, c2 = wc.shape
    care = ~np.repeat(np.repeat(nan, 16, axis=0), 8, axis=1)[:r, :c2]
  else:                        # one scale per B elements along the last axis: B/2 code bytes
    care = ~np.repeat(nan, formats.BLOCK[v.fmt] // 2, axis=-1)
  bad_codes = (gc != wc) & care
  bad_scales = gs != ws
  first = ""
  if bad_scales.any():
    i = tuple(int(t) for t in np.argwhere(bad_scales)[0])
    first = f"scale byte {i}: kernel {gs[i]:#04x}, XLA {ws[i]:#04x}"
  elif bad_codes.any():
    i = tuple(int(t) for t in np.argwhere(bad_codes)[0])
    first = f"code byte {i}: kernel {gc[i]:#04x}, XLA {wc[i]:#04x}"
  return dict(mismatches=int(bad_codes.sum() + bad_scales.sum()),
              dont_care=int((~care).sum()), compared=int(care.sum() + gs.size), first=first)


def compare_floats(got, want) -> dict:
  """Elements whose bits differ, a NaN matching any NaN."""
  g, w = np.asarray(got), np.asarray(want)
  if g.shape != w.shape or g.dtype != w.dtype:
    return dict(mismatches=max(w.size, 1), compared=int(w.size),
                first=f"kernel {g.dtype}{g.shape}, XLA {w.dtype}{w.shape}")
  gf, wf = g.astype(np.float32), w.astype(np.float32)
  bad = (_bytes(g) != _bytes(w)).reshape(g.shape + (-1,)).any(-1) & ~(np.isnan(gf) & np.isnan(wf))
  first = ""
  if bad.any():
    i = tuple(int(t) for t in np.argwhere(bad)[0])
    first = f"element {i}: kernel {gf[i]!r}, XLA {wf[i]!r}"
  return dict(mismatches=int(bad.sum()), compared=int(w.size), first=first)


@functools.partial(jax.jit, static_argnames="k")
def _bound_violations(got, want, abs_a, abs_b, *, k):
  """(elements beyond the summation-order bound, the relative Frobenius error) of a float32 GEMM output."""
  gamma = k * U / (1 - k * U)
  e = jax.lax.dot_general(abs_a, abs_b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  bound = 3 * gamma * e + 8 * U * jnp.abs(want) + F32_TINY
  ok = (jnp.abs(got - want) <= bound) | (got == want) | (jnp.isnan(got) & jnp.isnan(want))
  finite = jnp.isfinite(want) & jnp.isfinite(got)
  diff = jnp.where(finite, got - want, 0)
  rel = jnp.sqrt(jnp.sum(diff * diff)) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.where(finite, want * want, 0))), 1e-30)
  return jnp.sum(~ok), rel


BOUND = "|kernel - XLA| <= 3*gamma_K*(|A||B|^T) + 8u*|XLA| + 2^-149, float32 out, gamma_K = K*u/(1-K*u), u = 2^-24"


def bound_check(got, want, a: QTensor, b: QTensor) -> dict:
  """How many float32 outputs of a GEMM of (a, b) lie beyond the summation-order bound (docstring, 2)."""
  abs_a = jnp.abs(api.dequantize(a, jnp.float32, impl="xla"))
  abs_b = jnp.abs(api.dequantize(b, jnp.float32, impl="xla"))
  k = a.shape[-1]
  bad, rel = _bound_violations(jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32), abs_a, abs_b, k=k)
  return dict(bound=BOUND, k=k, gamma_k=k * U / (1 - k * U), violations=int(bad), rel_frobenius=float(rel))


