"""The programs the deviceless compile builds: one fp4jax op, the Mamba-2 SSD and gated RMSNorm kernels,
``fp4jax.dot`` forward and backward, and the batches the tests compile (every Pallas kernel, every op's
XLA composition, every recipe's dot), each as a ``deviceless.Program`` over abstract arguments."""
from __future__ import annotations

from bench.predict.deviceless import Program


def _spec(shape, dtype, sharding):
  import jax   # pylint: disable=import-outside-toplevel
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _with(sharding, tree):
  import jax   # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def op_program(what: str, shape, fmt: str, impl: str, sharding) -> Program:
  """One fp4jax op on bf16 inputs of ``shape`` ((M, K); (M, N, K) for scaled_matmul). An SR quantize op
  ending in ``_packed`` or ``_philox`` draws its bits in that layout (``sr_bits=``), else in "jax"'s."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  from fp4jax.api import quantize_rht_transposed   # pylint: disable=import-outside-toplevel
  key = _with(sharding, jax.eval_shape(lambda: jax.random.key(0)))
  kern = 1 if impl == "pallas" else 0
  tag = f"{what}_{fmt}_{impl or 'auto'}"
  sr_bits = next((g for g in ("packed", "philox") if what.endswith(f"_sr_{g}")), "jax")
  what = what.removesuffix(f"_{sr_bits}") if sr_bits != "jax" else what
  if what in ("quantize", "quantize_sr", "quantize_2d", "quantize_2d_sr"):
    m, k = shape
    tile = (16, 16) if what.startswith("quantize_2d") else None
    rounding = "stochastic" if what.endswith("_sr") else "nearest"
    kw = {"sr_bits": sr_bits} if rounding == "stochastic" else {}   # nearest: no stream to name
    def fn(x, key):
      q = fp4jax.quantize(x, fmt, tile=tile, rounding=rounding, key=key, impl=impl, **kw)
      return q.data, q.scale
    return Program(tag, fn, (_spec((m, k), jnp.bfloat16, sharding), key), kern)
  if what in ("quantize_rht_t", "quantize_rht_t_sr"):
    t, c = shape
    rounding = "stochastic" if what.endswith("_sr") else "nearest"
    size = 32 if fmt == "mxfp4" else 16
    kw = {"sr_bits": sr_bits} if rounding == "stochastic" else {}
    def fn(x, key):
      q = quantize_rht_transposed(x, fmt, rht_size=size, rounding=rounding, key=key, impl=impl, **kw)
      return q.data, q.scale
    return Program(tag, fn, (_spec((t, c), jnp.bfloat16, sharding), key), kern)
  if what == "dequantize":
    m, k = shape
    q = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, impl="xla"),
                                       jax.ShapeDtypeStruct((m, k), jnp.bfloat16)))
    return Program(tag, lambda q: fp4jax.dequantize(q, jnp.bfloat16, impl=impl), (q,), 0)
  if what in ("scaled_matmul", "mixed_matmul"):
    m, n, k = shape
    w_tile = (16, 16) if fmt == "nvfp4" else None
    qa = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, impl="xla"),
                                        jax.ShapeDtypeStruct((m, k), jnp.bfloat16)))
    qb = _with(sharding, jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, tile=w_tile, impl="xla"),
                                        jax.ShapeDtypeStruct((n, k), jnp.bfloat16)))
    if what == "mixed_matmul" and impl == "pallas":   # one kernel: the GEMM that decodes as it loads
      from fp4jax import primitives   # pylint: disable=import-outside-toplevel
      return Program(tag, lambda a, b: primitives.mixed_matmul(a, b, out_dtype=jnp.bfloat16), (qa, qb), 1)
    # the kernel path: its two dequantize passes and its GEMM are kernels
    return Program(tag, lambda a, b: fp4jax.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl),
                   (qa, qb), 3 * kern)
  if what == "ssd":
    return ssd_program(shape, impl, sharding)
  if what == "gated_norm":
    return gated_norm_program(shape, impl, sharding)
  raise ValueError(f"unknown op {what!r}")


SSD_12B_MIXER = (1, 8192, 160, 64, 8, 128)   # B, L, H, P, G, N of one 12B Mamba-2 mixer per GPU


def ssd_program(shape, impl: str, sharding, chunk_size: int = 256) -> Program:
  """The Mamba-2 SSD (``models.ssd_pallas.ssd``: y = SSD + D x) forward and backward, as the mixer
  calls it (float32 x, B, C after the conv), for a cotangent input: y, dx, ddt, da, dB, dC, dD.
  ``shape``: (B, L, H, P, G, N); impl "xla" is ``ssd_chunked`` at ``chunk_size`` (the 12B's 256)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from models import ssd_pallas   # pylint: disable=import-outside-toplevel
  b, l, h, p, g, n = shape or SSD_12B_MIXER

  def fn(x, dt, a, bm, cm, d, dy):
    def f(x, dt, a, bm, cm, d):
      return ssd_pallas.ssd(x, dt, a, bm, cm, chunk_size=chunk_size, d_H=d, impl=impl)[0]
    y, vjp = jax.vjp(f, x, dt, a, bm, cm, d)
    return (y, *vjp(dy))

  f32 = jnp.float32
  args = tuple(_spec(s, f32, sharding) for s in ((b, l, h, p), (b, l, h), (h,), (b, l, g, n), (b, l, g, n),
                                                 (h,), (b, l, h, p)))
  return Program(f"ssd_{impl}", fn, args, len(ssd_pallas.KERNEL_NAMES) + 1 if impl == "pallas" else 0)


GATED_NORM_12B_MIXER = (1, 8192, 8, 1280)   # B, L, G, R P of one 12B Mamba-2 mixer per GPU


def gated_norm_program(shape, impl: str, sharding) -> Program:
  """The mixer's gated RMSNorm (``models.gated_norm.gated_norm``) forward and backward as the mixer calls
  it (float32 y from the scan, bf16 z from in_proj, float32 scale, bf16 out), for a cotangent input:
  out, dy, dz, dscale. ``shape``: (B, L, G, RP)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from models import gated_norm   # pylint: disable=import-outside-toplevel
  b, l, g, rp = shape or GATED_NORM_12B_MIXER

  def fn(y, z, w, dout):
    out, vjp = jax.vjp(lambda y, z, w: gated_norm.gated_norm(y, z, w, eps=1e-5, out_dtype=jnp.bfloat16,
                                                             impl=impl), y, z, w)
    return (out, *vjp(dout))

  bf16, f32 = jnp.bfloat16, jnp.float32
  args = (_spec((b, l, g, rp), f32, sharding), _spec((b, l, g, rp), bf16, sharding),
          _spec((g, rp), f32, sharding), _spec((b, l, g, rp), bf16, sharding))
  return Program(f"gated_norm_{impl}", fn, args, len(gated_norm.KERNEL_NAMES) if impl == "pallas" else 0)


def dot_program(recipe: str, shape, sharding, sr_bits: str | None = None) -> Program:
  """``fp4jax.dot`` forward and backward (y, dx, dw for a cotangent dy, all inputs): value_and_grad
  of the layer, with no constant cotangent for XLA to fold. ``sr_bits``: the recipe's ``Recipe.sr_bits``
  instead of its own."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  m, k, n = shape
  rec = fp4jax.recipes.get(recipe)
  if sr_bits is not None:
    rec = rec.replace(sr_bits=sr_bits)

  def fn(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=rec, key=key), x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    return y, dx, dw

  key = _with(sharding, jax.eval_shape(lambda: jax.random.key(0)))
  args = (_spec((m, k), jnp.bfloat16, sharding), _spec((k, n), jnp.bfloat16, sharding),
          _spec((m, n), jnp.bfloat16, sharding), key)
  return Program(f"dot_{recipe}" + (f"_sr_{sr_bits}" if sr_bits else ""), fn, args, 0)


KERNEL_OPS = (("quantize", "nvfp4"), ("quantize_sr", "nvfp4"), ("quantize_2d", "nvfp4"),
              ("quantize", "mxfp4"), ("quantize_sr", "mxfp4"), ("quantize_rht_t", "nvfp4"),
              ("quantize_rht_t_sr", "nvfp4"), ("quantize_rht_t", "mxfp4"),
              ("scaled_matmul", "nvfp4"), ("scaled_matmul", "mxfp4"), ("mixed_matmul", "nvfp4"),
              ("mixed_matmul", "mxfp4"), ("quantize_sr_packed", "nvfp4"), ("quantize_2d_sr_packed", "nvfp4"),
              ("quantize_rht_t_sr_packed", "nvfp4"), ("quantize_sr_philox", "nvfp4"),
              ("quantize_2d_sr_philox", "nvfp4"), ("quantize_rht_t_sr_philox", "nvfp4"))
XLA_OPS = tuple(o for o in KERNEL_OPS if o[0] != "mixed_matmul") + (("dequantize", "nvfp4"), ("dequantize", "mxfp4"))


def batch_programs(what: str, sharding, small: bool = True) -> list[Program]:
  """The batches the tests compile: ``kernels`` (every Pallas kernel), ``ops`` (every op's XLA
  composition), ``dots`` (every recipe preset's dot). Small shapes: compile time, not size, is tested."""
  import fp4jax   # pylint: disable=import-outside-toplevel
  mk = (256, 512) if small else (8192, 8192)
  mnk = (256, 256, 512) if small else (8192, 8192, 8192)
  if what == "kernels":
    return [op_program(op, mnk if op.endswith("_matmul") else mk, fmt, "pallas", sharding)
            for op, fmt in KERNEL_OPS]
  if what == "ops":
    return [op_program(op, mnk if op.endswith("_matmul") else mk, fmt, "xla", sharding)
            for op, fmt in XLA_OPS]
  if what == "dots":
    return [dot_program(r, (256, 512, 256) if small else (8192, 8192, 8192), sharding)
            for r in fp4jax.recipes.NAMES]
  raise ValueError(what)


def combined(name: str, progs: list[Program]) -> Program:
  """One program that runs all of ``progs`` (one XLA module, one compile; identical kernels are
  compiled once)."""
  def fn(*args):
    out, i = [], 0
    for p in progs:
      out.append(p.fn(*args[i:i + len(p.args)]))
      i += len(p.args)
    return out
  return Program(name, fn, tuple(a for p in progs for a in p.args), sum(p.kernels for p in progs))
