"""The Mamba-2 mixer's gated RMSNorm, per group, as two Pallas kernels (Triton backend): ``gated_norm``.

  g = y · silu(z);   out = cast( g · r · w ),   r = 1 / sqrt( mean over the group's R P channels of g² + eps )

Its twin, ``gated_norm_reference``, is the ops the mixer ran before (the CPU path and the default: the same
bits). In XLA's GPU program the forward is two passes over y and z (the row reduction, then the
normalization: a reduction does not fuse with a consumer that rereads its input) and the backward three
(docs/PERF.md, "The gated RMSNorm as Pallas kernels"). The kernels make it one pass each way:

  forward   one program per (block of tokens, group): loads the rows of y and z once, sums g² in
            registers, stores out.
  backward  one program per (chunk of tokens, group), a loop over blocks of its rows: recomputes g and r
            from y, z (the residuals are the inputs only), then with dh = dout · w
              dg = r dh - g r³ mean(dh g);   dy = dg silu(z);   dz = dg y silu'(z)
            and dw = Σ_rows dout g r accumulated in registers: one row per program, summed over the
            programs by XLA (a (tokens / chunk) x G x R P float32 partial, ~1/256 of y's bytes for the 12B).
Tokens that no power-of-two tile divides are padded with zero rows (``pallas_compat.fit``: at most 1/8
more); a zero row's output and gradients are zero.
A group's row (R P channels: 1280 for the 12B) need not be a power of two: the kernels read it in static
power-of-two column pieces (1024 + 256). Everything computes in float32; y and z may be bf16 or float32.
The row sums run in another order than XLA's, so the kernel agrees with the twin to float32 rounding,
not bit for bit (tests/test_models_gated_norm.py states the tolerance).

Axis legend: B batch, L sequence, T tokens (B L, Tp padded), G groups, RP a group's channels (R heads x P).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import pallas_compat as plc
from fp4jax import target as fp4_target
from fp4jax import dispatch
from models import ssd_pallas

IMPLS = ("xla", "pallas")
KERNEL_NAMES = ("gated_norm_fwd", "gated_norm_bwd")
_f32 = jnp.float32
pl_ds = plc.ds


@dataclasses.dataclass(frozen=True)
class GatedNormTiles:
  elements: int = 8192     # rows per block = elements / (RP rounded up to a power of two), 1 to 32
  bwd_blocks: int = 64     # blocks of rows per backward program (its dw partial is one row)
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_TILES = GatedNormTiles()


def gated_norm_reference(y_BxLxGxRP, z_BxLxGxRP, scale_GxRP, *, eps: float, out_dtype):
  """The twin: y · silu(z), normalized by each group's root mean square, times the scale, in float32, cast
  to ``out_dtype``: the mixer's ops, differentiated by jax."""
  g_BxLxGxRP = y_BxLxGxRP * jax.nn.silu(z_BxLxGxRP.astype(_f32))
  g_BxLxGxRP = g_BxLxGxRP * lax.rsqrt(jnp.mean(jnp.square(g_BxLxGxRP), -1, keepdims=True) + eps)
  return (g_BxLxGxRP * scale_GxRP.astype(_f32)).astype(out_dtype)


# ---------------------------------------------------------------------------------------- kernels

def _pieces(n: int) -> tuple[tuple[int, int], ...]:
  """(start, width) of power-of-two column pieces covering [0, n), widest first: 1280 -> 1024 + 256."""
  out, start = [], 0
  for bit in reversed(range(n.bit_length())):
    if n >> bit & 1:
      out.append((start, 1 << bit))
      start += 1 << bit
  return tuple(out)


def _silu_parts(z):
  sig = jax.nn.sigmoid(z)
  return z * sig, sig


def _rows(ref, rows, c0, cw):
  return ref[rows, pl_ds(c0, cw)].astype(_f32)


def _fwd_kernel(y_ref, z_ref, w_ref, o_ref, *, n, eps):
  """Refs: y, z (Tb, RP), w (RP,) -> out (Tb, RP)."""
  rows = slice(None)
  gs, ss_Tbx1 = [], 0.0
  for c0, cw in _pieces(n):
    g_TbxW = _rows(y_ref, rows, c0, cw) * _silu_parts(_rows(z_ref, rows, c0, cw))[0]
    ss_Tbx1 = ss_Tbx1 + jnp.sum(g_TbxW * g_TbxW, axis=1, keepdims=True)
    gs.append(g_TbxW)
  r_Tbx1 = lax.rsqrt(ss_Tbx1 / n + eps)
  for (c0, cw), g_TbxW in zip(_pieces(n), gs):
    o_ref[:, pl_ds(c0, cw)] = (g_TbxW * r_Tbx1 * w_ref[pl_ds(c0, cw)].astype(_f32)[None]).astype(o_ref.dtype)


def _bwd_kernel(y_ref, z_ref, w_ref, do_ref, dy_ref, dz_ref, dw_ref, *, n, eps, rows, blocks):
  """Refs: y, z, dout (blocks rows, RP), w (RP,) -> dy, dz (blocks rows, RP), dw (RP,) this program's
  partial sum over its rows."""
  pieces = _pieces(n)
  w = [w_ref[pl_ds(c0, cw)].astype(_f32)[None] for c0, cw in pieces]

  def block(i, dw_acc):
    rs = pl_ds(plc.multiple_of(i * rows, rows), rows)
    ys, zs, gs, dhs = [], [], [], []
    ss_Rx1 = dot_Rx1 = 0.0
    for (c0, cw), w_1xW in zip(pieces, w):
      y_RxW, z_RxW = _rows(y_ref, rs, c0, cw), _rows(z_ref, rs, c0, cw)
      g_RxW = y_RxW * _silu_parts(z_RxW)[0]
      dh_RxW = _rows(do_ref, rs, c0, cw) * w_1xW
      ss_Rx1 = ss_Rx1 + jnp.sum(g_RxW * g_RxW, axis=1, keepdims=True)
      dot_Rx1 = dot_Rx1 + jnp.sum(dh_RxW * g_RxW, axis=1, keepdims=True)
      for keep, t in ((ys, y_RxW), (zs, z_RxW), (gs, g_RxW), (dhs, dh_RxW)):
        keep.append(t)
    r_Rx1 = lax.rsqrt(ss_Rx1 / n + eps)
    coef_Rx1 = r_Rx1 * r_Rx1 * r_Rx1 * (dot_Rx1 / n)
    out = []
    for (c0, cw), w_1xW, y_RxW, z_RxW, g_RxW, dh_RxW, acc_W in zip(pieces, w, ys, zs, gs, dhs, dw_acc):
      cols = pl_ds(c0, cw)
      dg_RxW = r_Rx1 * dh_RxW - g_RxW * coef_Rx1
      s_RxW, sig_RxW = _silu_parts(z_RxW)
      dy_ref[rs, cols] = (dg_RxW * s_RxW).astype(dy_ref.dtype)
      dz_ref[rs, cols] = (dg_RxW * y_RxW * sig_RxW * (1 + z_RxW * (1 - sig_RxW))).astype(dz_ref.dtype)
      # dout g r, not dh g r / w (no division): dout is read again, from cache (these rows were just read)
      out.append(acc_W + jnp.sum(_rows(do_ref, rs, c0, cw) * g_RxW * r_Rx1, axis=0))
    return tuple(out)

  dw = lax.fori_loop(0, blocks, block, tuple(jnp.zeros((cw,), _f32) for _, cw in pieces))
  for (c0, cw), dw_W in zip(pieces, dw):
    dw_ref[pl_ds(c0, cw)] = dw_W


# ---------------------------------------------------------------------------------------- calls

def _fit_rows(T: int, n: int, tiles: GatedNormTiles) -> tuple[int, int]:
  """(rows per block, padded T) for the forward: a power of two from the elements budget."""
  return plc.fit(T, max(1, min(32, tiles.elements // _pow2(n))))


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def kernel_flops(name: str, T: int, G: int, RP: int) -> int:
  """The analytic FLOP count of one call of kernel ``name`` (KERNEL_NAMES) over T tokens: per element,
  the forward's silu (4: exp, add, divide, multiply), g, g², its sum, and the two products of the output
  (6 more); the backward recomputes those (7), then dh, dh g and its sum, dg (3), dy, dz (6) and dw (3)."""
  per_element = {"gated_norm_fwd": 10, "gated_norm_bwd": 24}[name]
  return per_element * T * G * RP


def _name(name: str, T: int, G: int, RP: int) -> str:
  """``models_<name>_ieee_<flops>flop``: the cost model charges the FLOPs at the float32 peak (no dots)."""
  return f"models_{name}_ieee_{kernel_flops(name, T, G, RP)}flop"


def _call(call, interpret):
  return call(interpret) if interpret is not None else plc.by_platform(call)


def _fwd_call(y_TxGxRP, z_TxGxRP, w_GxRP, out_dtype, eps, tiles, interpret):
  T, G, RP = y_TxGxRP.shape
  tb, Tp = _fit_rows(T, RP, tiles)
  pad = lambda t: t if Tp == T else jnp.pad(t, [(0, Tp - T), (0, 0), (0, 0)])
  spec = plc.BlockSpec((tb, None, RP), lambda t, g: (t, g, 0))
  call = lambda interpret: plc.pallas_call(
      functools.partial(_fwd_kernel, n=RP, eps=eps), out_shape=jax.ShapeDtypeStruct((Tp, G, RP), out_dtype),
      grid=(Tp // tb, G), in_specs=[spec, spec, plc.BlockSpec((None, RP), lambda t, g: (g, 0))],
      out_specs=spec, interpret=interpret, name=_name("gated_norm_fwd", Tp, G, RP),
      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
  return _call(call, interpret)(pad(y_TxGxRP), pad(z_TxGxRP), w_GxRP)[:T]


def _bwd_call(y_TxGxRP, z_TxGxRP, w_GxRP, do_TxGxRP, eps, tiles, interpret):
  """dy, dz in y's and z's dtypes; dw (G, RP) float32."""
  T, G, RP = y_TxGxRP.shape
  tb, _ = _fit_rows(T, RP, tiles)
  chunk, Tp = plc.fit(T, tb * tiles.bwd_blocks)
  tb = min(tb, chunk)
  pad = lambda t: t if Tp == T else jnp.pad(t, [(0, Tp - T), (0, 0), (0, 0)])
  spec = plc.BlockSpec((chunk, None, RP), lambda t, g: (t, g, 0))
  S = jax.ShapeDtypeStruct
  out_shape = (S((Tp, G, RP), y_TxGxRP.dtype), S((Tp, G, RP), z_TxGxRP.dtype), S((Tp // chunk, G, RP), _f32))
  call = lambda interpret: plc.pallas_call(
      functools.partial(_bwd_kernel, n=RP, eps=eps, rows=tb, blocks=chunk // tb), out_shape=out_shape,
      grid=(Tp // chunk, G), in_specs=[spec, spec, plc.BlockSpec((None, RP), lambda t, g: (g, 0)), spec],
      out_specs=(spec, spec, plc.BlockSpec((None, None, RP), lambda t, g: (t, g, 0))), interpret=interpret,
      name=_name("gated_norm_bwd", Tp, G, RP), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
  dy, dz, dw_parts = _call(call, interpret)(pad(y_TxGxRP), pad(z_TxGxRP), w_GxRP, pad(do_TxGxRP))
  return dy[:T], dz[:T], jnp.sum(dw_parts, axis=0)


# ------------------------------------------------------------------------------ the custom_vjp

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gated_norm_core(y, z, w, out_dtype, eps, tiles, interpret):
  """(B, L, G, RP) y and z, (G, RP) w -> (B, L, G, RP) in out_dtype."""
  B, L, G, RP = y.shape
  return _fwd_call(y.reshape(B * L, G, RP), z.reshape(B * L, G, RP), w, out_dtype, eps, tiles,
                   interpret).reshape(y.shape)


def _core_fwd(y, z, w, out_dtype, eps, tiles, interpret):
  return _gated_norm_core(y, z, w, out_dtype, eps, tiles, interpret), (y, z, w)


def _core_bwd(out_dtype, eps, tiles, interpret, residuals, dout):
  del out_dtype
  y, z, w = residuals
  B, L, G, RP = y.shape
  flat = lambda t: t.reshape(B * L, G, RP)
  dy, dz, dw = _bwd_call(flat(y), flat(z), w, flat(dout), eps, tiles, interpret)
  return dy.reshape(y.shape), dz.reshape(z.shape), dw.astype(w.dtype)


_gated_norm_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------- public

def partition_specs(B: int, G: int):
  """(in_specs, out_spec) of the kernels' ``shard_map`` under the mesh being traced for, or None: the
  batch and the groups split as the SSD kernels split them (``ssd_pallas.mesh_split``; a group's row is
  never split, the norm needs all of it)."""
  split = ssd_pallas.mesh_split(B, G, G)
  if split is None:
    return None
  bat, grp = split
  spec = jax.sharding.PartitionSpec
  x = spec(bat, None, grp, None)
  return (x, x, spec(grp, None)), x


def can_use_pallas(*, platform: str | None = None) -> bool:
  """Whether the kernels can run compiled on the program's devices (``platform``, else
  ``fp4jax.target.current()``): a CUDA GPU with Pallas Triton. Every shape is supported. On the CPU
  impl="pallas" runs through the Pallas interpreter (tests)."""
  if not plc.has_triton():
    return False
  return fp4_target.current().cuda if platform is None else platform in ("cuda", "gpu")


# The device run that put the kernels into the default (``fp4jax.dispatch.Evidence``), from a
# scripts/gpu_check.py report; None: compiled deviceless for sm_90 and sm_100, no device run recorded.
VERIFIED: dispatch.Evidence | None = None


def default_impl(*, platform: str | None = None) -> str:
  """What impl=None / "auto" runs: the SSD kernels' rule (``fp4jax.dispatch.model_kernel_default``,
  op "gated_norm"): "pallas" where the kernels can run here and this device proved them within
  ``PROOF_TOL`` and faster (or ``VERIFIED`` records a device run), else "xla"."""
  if can_use_pallas(platform=platform) and dispatch.model_kernel_default("gated_norm", VERIFIED) == "pallas":
    return "pallas"
  return "xla"


# The on-device proof (tools.prove, op "gated_norm"; scripts/gpu_check.py's rows run the same case): out,
# dy, dz, dscale, kernels vs ``gated_norm_reference``, at the 12B mixer's shape (B, L, G, R P) on a device,
# a tiny one elsewhere: float32 y, bf16 z, bf16 out as the mixer runs it. Both compute in float32 and differ
# in the order of the row sums (and the rsqrt), so the SSD's tolerance of the largest magnitude is far
# above their difference (bf16 rounding of out and dz, 2^-8) and far below a wrong term.
PROOF_SHAPES = {False: (1, 8192, 8, 1280), True: (2, 21, 2, 24)}
PROOF_TOL = ssd_pallas.PROOF_TOL
PROOF_OUTPUTS = ("out", "dy", "dz", "dscale")


def proof_case(tiny: bool):
  """(fn_of(impl) -> jitted fn(*args) = (out, *gradients) in float32, args, PROOF_OUTPUTS, "LxGxRP")."""
  B, L, G, RP = PROOF_SHAPES[tiny]
  k = jax.random.split(jax.random.key(4), 4)
  args = (jax.random.normal(k[0], (B, L, G, RP)), jax.random.normal(k[1], (B, L, G, RP)).astype(jnp.bfloat16),
          1.0 + 0.1 * jax.random.normal(k[2], (G, RP)), jax.random.normal(k[3], (B, L, G, RP)).astype(jnp.bfloat16))

  def fn_of(impl):
    def fn(y, z, w, dout):
      f = lambda y, z, w: gated_norm(y, z, w, eps=1e-5, out_dtype=jnp.bfloat16, impl=impl)
      out, vjp = jax.vjp(f, y, z, w)
      return tuple(t.astype(jnp.float32) for t in (out, *vjp(dout)))
    return jax.jit(fn)
  return fn_of, args, PROOF_OUTPUTS, "x".join(map(str, (L, G, RP)))


def gated_norm(y_BxLxGxRP, z_BxLxGxRP, scale_GxRP, *, eps: float, out_dtype, impl: str | None = None,
               tiles: GatedNormTiles = DEFAULT_TILES, interpret: bool | None = None):
  """``cast(rmsnorm_per_group(y · silu(z)) · scale)`` by ``impl``: "xla" (``gated_norm_reference``),
  "pallas" (the kernels; ``interpret``: True the Pallas interpreter, False the compiled kernels, None the
  kernels where the program is lowered for CUDA and the interpreter elsewhere) or None / "auto"
  (``default_impl``). y, z: (B, L, G, RP) float32 or bf16; scale (G, RP). The gradients come back in the
  inputs' dtypes."""
  if impl is None or impl == "auto":
    impl = default_impl()
  if impl == "xla":
    return gated_norm_reference(y_BxLxGxRP, z_BxLxGxRP, scale_GxRP, eps=eps, out_dtype=out_dtype)
  if impl != "pallas":
    raise ValueError(f"gated norm impl={impl!r}; use 'xla', 'pallas', 'auto' or None (the recorded default)")
  B, L, G, RP = y_BxLxGxRP.shape
  if z_BxLxGxRP.shape != y_BxLxGxRP.shape or scale_GxRP.shape != (G, RP):
    raise ValueError(f"gated norm: y {y_BxLxGxRP.shape}, z {z_BxLxGxRP.shape} and scale {scale_GxRP.shape} "
                     "must be (B, L, G, RP), (B, L, G, RP) and (G, RP)")
  core = lambda y, z, w: _gated_norm_core(y, z, w, jnp.dtype(out_dtype), float(eps), tiles, interpret)
  specs = partition_specs(B, G)
  if specs is not None:
    core = jax.shard_map(core, in_specs=specs[0], out_specs=specs[1], check_vma=False)
  return core(y_BxLxGxRP, z_BxLxGxRP, scale_GxRP)


__all__ = ["DEFAULT_TILES", "GatedNormTiles", "IMPLS", "KERNEL_NAMES", "can_use_pallas", "default_impl",
           "gated_norm", "gated_norm_reference", "kernel_flops", "partition_specs"]
