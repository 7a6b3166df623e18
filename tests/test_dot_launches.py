"""The quantized dot launches few kernels besides its GEMMs (docs/PERF.md, "The kernel count of the proved step"), with the same bits.

What the census of a compiled program counts (``bench.predict.launches``), and the changes that cut the proved
B200 step's launches, each checked where it shows:
- the native GEMM reads the packed E2M1 codes as float4_e2m1fn by bitcasts (no pass unpacking them), and the
  bitcast is never folded at compile time (XLA's constant folder gets 4-bit arrays wrong);
- the tensor factor's four parts are one array (one pass per GEMM, not four);
- every quantize kernel reads the tensor amax itself (no pass broadcasting its factors per row before it);
- the kernels whose power-of-two blocks run past a row's end (rmsnorm_quantize's D, the 1D and 2D quantize's
  last column block) mask it: no padded copy of x before them, no slice of their results after;
- the dgrad weight's and the wgrad x's tensor amaxes are saved as one array (one residual per layer, not two);
- the fprop weight tiles are gathered along K before they are transposed on an FSDP mesh (no transposes around
  the gather, no GEMM over a shard of K with partial sums);
- the value_and_grad of one nvfp4 dot compiled for a B200 with every kernel proved (slow; needs jax's CUDA
  plugin, no GPU): the SR kernels count their key rows from the first (no XLA pass writing them);
- the RMSNorm + quantize producer's amax pass takes the norm's factor from a kernel (one pass over x, not XLA's
  two fusions) and reduces x's amaxes in two launches (slow, as above).
"""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from configs import shrunken
from fp4jax import _native_compat as nc
from fp4jax import _platform, native, random_bits, reference
from fp4jax.kernels import quantize_1d, quantize_2d, quantize_rht_t, relu2_quantize, rmsnorm_quantize
from fp4jax.numerics import e2m1
from fp4jax.quantizers import Quantizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- the census

_MODULE = """HloModule m

%fused_reduce (p0: f32[64,32]) -> f32[64] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[64]{0} reduce(%p0, %c), dimensions={1}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_scalar (p0: f32[64]) -> f32[4] {
  %p0 = f32[64]{0} parameter(0)
  %s = f32[4]{0} slice(%p0), slice={[0:4]}
  ROOT %m = f32[4]{0} multiply(%s, %s)
}

%fused_unpack (p0: u8[64,16]) -> u8[64,16,2] {
  %p0 = u8[64,16]{1,0} parameter(0)
  %k = u8[] constant(4)
  %kb = u8[64,16]{1,0} broadcast(%k), dimensions={}
  %hi = u8[64,16]{1,0} shift-right-logical(%p0, %kb)
  %a = u8[64,16,1]{2,1,0} bitcast(%p0)
  %b = u8[64,16,1]{2,1,0} bitcast(%hi)
  ROOT %c = u8[64,16,2]{2,1,0} concatenate(%a, %b), dimensions={2}
}

%fused_transpose (p0: f32[64,32]) -> f32[32,64] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %t = f32[32,64]{1,0} transpose(%p0), dimensions={1,0}
}

ENTRY %main (x: f32[64,32], q: u8[64,16]) -> (f32[64], f32[4], u8[64,16,2], f32[32,64], f32[64,32]) {
  %x = f32[64,32]{1,0} parameter(0)
  %q = u8[64,16]{1,0} parameter(1)
  %r = f32[64]{0} fusion(%x), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(f)/fp4jax/quantize/reduce_max"}
  %s = f32[4]{0} fusion(%r), kind=kLoop, calls=%fused_scalar, metadata={op_name="jit(f)/fp4jax/dot/fprop/stack"}
  %u = u8[64,16,2]{2,1,0} fusion(%q), kind=kLoop, calls=%fused_unpack, metadata={op_name="jit(f)/fp4jax/dot/dgrad/convert_element_type"}
  %t = f32[32,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_transpose, metadata={op_name="jit(f)/models/linear/up/transpose"}
  %g = f32[64,32]{1,0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %out = (f32[64]{0}, f32[4]{0}, u8[64,16,2]{2,1,0}, f32[32,64]{1,0}, f32[64,32]{1,0}) tuple(%r, %s, %u, %t, %g)
}
"""


def test_census_counts_launches_by_part_and_work():
  from bench.predict import launches   # pylint: disable=import-outside-toplevel
  rows = {(r["part"], r["work"]): r["launches"] for r in launches.census(_MODULE)}
  assert rows == {("quantize", "reduce"): 1, ("fprop/other", "scalar"): 1, ("dgrad/other", "pack"): 1,
                  ("linear", "transpose"): 1, ("collective", "all-reduce"): 1}, rows
  twin = [dict(part="linear", work="transpose", launches=1), dict(part="linear", work="GEMM", launches=3)]
  diff = launches.compare(launches.census(_MODULE), twin)
  assert diff[-1] == ("linear", "GEMM", 0, 3) and ("linear", "transpose", 1, 1) in diff


# ------------------------------------------------------------------------------- the GEMM's operands

def test_packed_float4_is_the_unpacked_codes_constant_or_not():
  """Every byte value, as an argument and as a constant of the compiled program (which XLA's constant folder
  would evaluate wrongly without the barrier: nibbles 1 3 for bytes 0x21 0x43), against the unpacked codes."""
  packed = np.arange(256, dtype=np.uint8).reshape(8, 32)
  want = np.asarray(nc.to_float4(e2m1.unpack(jnp.asarray(packed))).astype(jnp.float32))
  as_f32 = lambda p: nc.packed_float4(p).astype(jnp.float32)
  for got in (jax.jit(as_f32)(packed), jax.jit(lambda: as_f32(jnp.asarray(packed)))(), as_f32(packed)):
    got = np.asarray(got)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))   # -0 (code 8) too


def test_native_operand_is_the_packed_codes_bitcast():
  """No unpacking pass: the operand's values come from the packed bytes by bitcasts alone (no shift in the
  lowered program), and they are the QTensor's codes; a tiled weight's scales repeat over the tile's rows."""
  x = jax.random.normal(jax.random.key(0), (64, 128))
  for q in (Quantizer("nvfp4")(x), fp4jax.transpose_tiles(Quantizer("nvfp4", tiled=True)(x))):
    text = jax.jit(lambda q: native.operand(q).values).lower(q).as_text()
    assert "shift_right" not in text and "bitcast_convert" in text, text[:2000]
    op = native.operand(q)
    np.testing.assert_array_equal(np.asarray(op.values.astype(jnp.float32)),
                                  np.asarray(nc.to_float4(reference.codes_of(q)).astype(jnp.float32)))
    assert op.scales.shape == (q.shape[0], q.shape[1] // 16)


def test_tensor_factor_parts_are_one_array():
  """The four parts leave ``tensor_factor_parts`` as one (4,) array behind an optimization barrier, which XLA
  computes in one fusion (the slow test below counts it on the B200: one scalar pass per GEMM)."""
  a = Quantizer("nvfp4")(jax.random.normal(jax.random.key(1), (32, 64)))
  b = Quantizer("nvfp4")(jax.random.normal(jax.random.key(2), (16, 64)) * 1e30)
  jaxpr = jax.make_jaxpr(reference.tensor_factor_parts)(a, b)
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert [tuple(v.aval.shape) for e in barriers for v in e.outvars] == [(4,)], jaxpr
  # the Mosaic GEMM's 32 words: the same four, then zeros, behind the same one barrier (no pad after it)
  words = jax.make_jaxpr(lambda a, b: reference.tensor_factor_parts(a, b, words=32))(a, b)
  barriers = [e for e in words.eqns if e.primitive.name == "optimization_barrier"]
  assert [tuple(v.aval.shape) for e in barriers for v in e.outvars] == [(32,)], words
  four, padded = reference.tensor_factor_parts(a, b), reference.tensor_factor_parts(a, b, words=32)
  np.testing.assert_array_equal(np.asarray(padded), np.concatenate([np.asarray(four), np.zeros(28, np.float32)]))
  with pytest.raises(ValueError, match="words=3"):
    reference.tensor_factor_parts(a, b, words=3)
  acc = jnp.linspace(-3.0, 3.0, 16 * 32, dtype=jnp.float32).reshape(32, 16)
  want = acc * (np.float32(a.amax) * np.float32(b.amax) / np.float32(6 * 6 * 448 * 448))
  np.testing.assert_allclose(np.asarray(reference.apply_tensor_factor(acc, a, b)), want, rtol=1e-6)


# ----------------------------------------------------------------------------- the quantize kernels

def _pallas_calls(fn, *args):
  """Every pallas_call equation in the jaxpr of ``fn(*args)``, nested jaxprs included."""
  eqns, out = list(jax.make_jaxpr(fn)(*args).eqns), []
  while eqns:
    e = eqns.pop()
    if e.primitive.name == "pallas_call":
      out.append(e)
    for p in e.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", None)
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and hasattr(inner, "eqns"):
          eqns.extend(inner.eqns)
  return out


def _pallas_operands(fn, *args):
  """The operand shapes of every pallas_call in the jaxpr of ``fn(*args)``."""
  return [[tuple(v.aval.shape) for v in e.invars] for e in _pallas_calls(fn, *args)]


def test_quantize_kernels_read_the_tensor_amax_itself():
  """Each kernel takes the scalar amax as a (1, 1) operand and no per-row factors (R, 4): nothing runs between
  the amax's reduction and the kernel. A vmapped amax (one per slice) comes per row, (R, 1)."""
  x = jnp.ones((64, 128), jnp.bfloat16)
  amax = jnp.float32(1.0)
  calls = {
      "quantize_1d": (lambda x, a: quantize_1d.quantize_1d(x, a, interpret=True), x, amax),
      "quantize_2d": (lambda x, a: quantize_2d.quantize_2d(x, a, interpret=True), x, amax),
      "quantize_rht_t": (lambda x, a: quantize_rht_t.quantize_rht_t(x, a, interpret=True), x, amax),
      "relu2_quantize": (lambda x, a: relu2_quantize.relu2_quantize(x, a, interpret=True), x, amax),
      "rmsnorm_quantize": (lambda x, a: rmsnorm_quantize.rmsnorm_quantize(x, jnp.ones((128,)), a, eps=1e-5,
                                                                          interpret=True), x, amax),
      "quantize_1d, vmapped amax": (lambda x, a: quantize_1d.quantize_1d(x, a, interpret=True),
                                    x.reshape(4, 16, 128), jnp.ones((4,), jnp.float32)),
  }
  for name, (fn, *args) in calls.items():
    (operands,) = _pallas_operands(fn, *args)
    assert ((64, 1) if "vmapped" in name else (1, 1)) in operands, (name, operands)
    assert not [s for s in operands if len(s) == 2 and s[1] == 4], (name, operands)


def _masked_cases():
  """(name, kernel call, twin call, operand shapes the kernel reads, result shapes it writes): widths whose
  power-of-two blocks run past the row's end (D = 96: a 128-wide block; K = 304: 19 blocks of 16 in blocks of 4)."""
  key = jax.random.key(5)
  x96 = (jax.random.normal(jax.random.key(3), (8, 96)) * 3).astype(jnp.bfloat16)
  x304 = (jax.random.normal(jax.random.key(6), (48, 304)) * 3).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(jax.random.key(4), (96,))
  amax = jnp.float32(20.0)
  keyed, drawn = random_bits.KeyedBits.of(key, x304.shape, -1), jax.random.bits(key, x304.shape, jnp.uint8)
  h = rmsnorm_quantize.rmsnorm_reference(x96, scale, eps=1e-5, dtype=jnp.bfloat16)
  return {
      "rmsnorm_quantize": (lambda: rmsnorm_quantize.rmsnorm_quantize(x96, scale, amax, eps=1e-5, interpret=True),
                           lambda: (h, *quantize_1d.quantize_1d_reference(h, amax)),
                           [(8, 96), (1, 96)], [(8, 96), (8, 48), (8, 6)]),
      "quantize_1d, keyed SR": (lambda: quantize_1d.quantize_1d(x304, amax, keyed, interpret=True),
                                lambda: quantize_1d.quantize_1d_reference(x304, amax, drawn),
                                [(48, 304)], [(48, 152), (48, 19)]),
      "quantize_2d": (lambda: quantize_2d.quantize_2d(x304, amax, interpret=True),
                      lambda: quantize_2d.quantize_2d_reference(x304, amax), [(48, 304)], [(48, 152), (3, 19)]),
  }


@pytest.mark.parametrize("name", ["rmsnorm_quantize", "quantize_1d, keyed SR", "quantize_2d"])
def test_kernels_read_and_write_rows_unpadded(name):
  """The kernels' last column block is masked: they read x (and the norm's scale) as it is and write their
  results at their own widths, so nothing pads x before them or slices their results after (the 12B's
  rmsnorm_quantize pads D = 5120 to 8192: two pads and three slices per call; in_proj's 22,688 columns are
  1,418 blocks of 16, cut into blocks of 16 blocks: a pad and two slices per quantize). The bits are the twin's."""
  run, twin, reads, writes = _masked_cases()[name]
  (call,) = _pallas_calls(run)
  assert [tuple(v.aval.shape) for v in call.invars][:len(reads)] == reads, call.invars
  assert [tuple(v.aval.shape) for v in call.outvars] == writes, call.outvars
  outside = {e.primitive.name for e in jax.make_jaxpr(run)().eqns}
  assert not outside & {"pad", "slice", "dynamic_slice"}, outside
  for got, want in zip(run(), twin()):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


# ----------------------------------------------------------------------------------- the residuals

@pytest.mark.parametrize("remat", [False, True])
def test_the_two_tensor_amaxes_are_saved_as_one_array(remat):
  """What the backward pass keeps of one nvfp4 dot (plain, and under a remat policy that keeps the FP4 operands,
  as the 12B's save_linear_fp4): the codes and scales, and the tensor amaxes of the dgrad weight and the wgrad x
  as one float32 (2,) array, no float32 scalar. In a scanned model each saved array is a write per layer in the
  forward loop and a read per layer in the backward one: two arrays were 4 launches per quantized linear.
  Read back from the residuals they are each QTensor's own amax."""
  x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (128, 96), jnp.bfloat16) * 0.1
  f = lambda x, w: fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(2))
  if remat:
    f = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(fp4jax.FP4_OPERAND))
  leaves = jax.tree.leaves(jax.eval_shape(lambda x, w: jax.vjp(f, x, w)[1], x, w))
  floats = [tuple(l.shape) for l in leaves if l.dtype == jnp.float32]
  assert floats == [(2,)], floats
  res = sys.modules["fp4jax.dot"].residuals("nvfp4", x, w, jax.random.key(2))
  roles = fp4jax.recipes.get("nvfp4").roles
  assert float(res.w_dgrad.amax) == float(roles.fprop_w(w).amax)
  assert float(res.x_wgrad.amax) == float(roles.wgrad_x.quantize_t(x).amax)


# ------------------------------------------------------------------------------ the weight on a mesh

_MESH_SCRIPT = textwrap.dedent(r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import fp4jax

    M, K, N = 256, 512, 384
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x1 = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)

    def rows(x, w):   # y and dx: row by row, no sum across the devices (whose order the mesh changes)
      y, vjp = jax.vjp(lambda x: fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(0)), x)
      return y, vjp(jnp.cos(y))[0]

    f = jax.jit(rows)
    with jax.set_mesh(mesh):
      x = jax.device_put(x1, NamedSharding(mesh, P("fsdp", None)))
      w = jax.device_put(w1, NamedSharding(mesh, P("fsdp", None)))   # FSDP: K over the devices
      text = f.lower(x, w).compile().as_text()
      got = f(x, w)
    want = f(x1, w1)
    shapes = lambda op: [s for result in re.findall(rf"= (.*?) {op}\(", text)
                         for s in re.findall(r"\w+\[[\d,]*\]", result)]
    print("RESULT" + json.dumps(dict(
        gathered=shapes("all-gather"), reduced=shapes("all-reduce") + shapes("reduce-scatter"),
        equal=all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))))))
""")


def test_fprop_tiles_are_gathered_whole_before_their_transpose():
  """On an 8-device FSDP mesh (w's K over the devices) the native path (the B200's; on the CPU its twin, the
  same program to the partitioner up to the GEMM) gathers the weight's tiles whole along K as they are quantized
  (codes u8 (K, N/2)) and transposes them after: not the transposed operand along its minor axis (on the CPU,
  where the twin decodes before its dot, that gathered float32 products, 8x the bytes), and no float32 (M, N)
  partial products summed across the devices. y and dx equal one device's, bit for bit."""
  env = dict(os.environ, **shrunken.compilation_cache_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, FP4JAX_DEFAULT_IMPL="native")
  proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
  assert "u8[512,192]" in out["gathered"], out["gathered"]              # the tiles (K, N/2), whole along K
  assert not {"f32[384,512]", "f32[512,384]"} & set(out["gathered"]), out["gathered"]
  assert not [s for s in out["reduced"] if s.startswith("f32[256,384]") or s.startswith("f32[32,384]")], out
  assert out["equal"], "y or dx on the mesh differ from one device's"


# ------------------------------------------------------------------- the dot compiled for a B200 (slow)

needs_plugin = pytest.mark.skipif(
    _platform.cuda_plugin() is None, reason="jax's CUDA plugin is not installed, so XLA's GPU compiler "
    "is absent (pip install -e '.[dev]' installs it)")

_B200_SCRIPT = textwrap.dedent(r"""
    import json, sys
    sys.path.insert(0, ROOT)
    from fp4jax import _platform
    _platform.enable_deviceless()
    import jax
    from bench.predict import deviceless, launches, peaks, programs
    from bench.predict.gpu_aot import assume_proved
    assume_proved(["all"])
    dev = deviceless.gpu_devices("b200", 1)[0]
    prog = programs.dot_program("nvfp4", (1024, 1024, 1024), jax.sharding.SingleDeviceSharding(dev))
    res = deviceless.compile_program(prog)
    if res.get("error"):
      print("RESULT" + json.dumps(dict(error=res["error"]))); sys.exit(0)
    print("RESULT" + json.dumps(launches.census(res["text"], peaks=peaks.peaks("b200"))))
""")


@needs_plugin
@pytest.mark.slow   # a deviceless compile for sm_100: ~20 s of CPU; by default the representatives above
@pytest.mark.parametrize("kernel", ["cudnn", "mosaic"])
def test_proved_b200_dot_launches(kernel):
  """value_and_grad of one nvfp4 dot (1024³), every kernel proved, on a B200: 32 launches on cuDNN's GEMM where
  the code before this test launched 53 (the bf16 twin: its 3 GEMMs), 27 on fp4jax's Mosaic GEMM (the float32
  epilogue pass inside the kernel; 32 while the kernel padded the tensor factor to its 32 words in a pass of its
  own, 29 while each SR quantize had XLA write its key rows). Per GEMM pass: one pass for the tensor factor, no
  pad, no pass unpacking codes; no pass between an amax and its quantize kernel; fprop's tiles transposed in
  one pass."""
  env = _platform.deviceless_env()
  env.pop("FP4JAX_DEFAULT_IMPL", None)
  env["FP4JAX_NATIVE_KERNEL"] = kernel
  proc = subprocess.run([sys.executable, "-c", _B200_SCRIPT.replace("ROOT", repr(ROOT))], env=env, capture_output=True,
                        text=True, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "did not lower" not in proc.stderr, proc.stderr[-4000:]   # every kernel ran, none as its XLA twin
  rows = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
  assert "error" not in rows, rows
  count = lambda part, work=None: sum(r["launches"] for r in rows
                                      if r["part"] == part and (work is None or r["work"] == work))
  factor = "scalar" if kernel == "cudnn" else "concatenate"   # the Mosaic GEMM's factor: 32 words, one pass
  for gemm in ("fprop", "dgrad", "wgrad"):
    assert count(f"{gemm}/other", "GEMM") == 1, rows
    assert count(f"{gemm}/other", factor) == 1, rows
    assert count(f"{gemm}/other", "pad") == 0, rows   # 1024 is whole tiles; the factor comes padded
  assert count("dgrad/other", "pack") == count("wgrad/other", "pack") == 0, rows
  # the scales into the tensor cores' layout: 2 passes on cuDNN's route (XLA's, inside its call), 1 on the Mosaic one
  swizzles = 2 if kernel == "cudnn" else 1
  assert count("fprop/other", "pack") + count("fprop/other", "transpose") - swizzles <= 1, rows
  quantize = [r for r in rows if r["part"].split("/")[-1] in ("quantize", "quantize_rht_t")]
  assert not [r for r in quantize if r["work"] == "broadcast"], quantize
  # the SR kernels count their key rows from the first (no (R, 4) pass each): the key's split and the two
  # first rows are one scalar pass
  assert not [r for r in quantize if r["work"] == "random"], quantize
  assert sum(r["launches"] for r in quantize if r["work"] == "scalar") <= 1, quantize
  if kernel == "mosaic":   # the tensor factor and the cast inside the kernel: no float32 (M, N) pass after it
    assert not [r for r in rows if r["part"].endswith("/other") and r["work"] == "elementwise"], rows
  total = sum(r["launches"] for r in rows if r["part"] != "collective")
  assert total <= {"cudnn": 32, "mosaic": 27}[kernel], (total, rows)


_B200_NORM_SCRIPT = textwrap.dedent(r"""
    import json, sys
    sys.path.insert(0, ROOT)
    from fp4jax import _platform
    _platform.enable_deviceless()
    import jax, jax.numpy as jnp
    from fp4jax import fused
    from bench.predict import deviceless, launches, peaks
    dev = deviceless.gpu_devices("b200", 1)[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    args = (jax.ShapeDtypeStruct((4096, 5120), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((5120,), jnp.float32, sharding=sh))
    f = jax.jit(lambda x, s: fused.rmsnorm_quantize(x, s, "nvfp4", eps=1e-5, impl="pallas"))
    text = f.lower(*args).compile().as_text()
    print("RESULT" + json.dumps(launches.census(text, peaks=peaks.peaks("b200"))))
""")


@needs_plugin
@pytest.mark.slow   # a deviceless compile for sm_100: ~30 s of CPU
def test_proved_b200_norm_producer_launches():
  """fp4jax.fused.rmsnorm_quantize's forward on a B200 (4096 tokens of the 12B's D = 5120): the norm's factor
  kernel, x's two amaxes in two reductions (the chunks' partials, then the partials) and the producer's kernel:
  4 launches where the code before launched 5 (the tree written at width 8 and the row finished in XLA)."""
  env = _platform.deviceless_env()
  proc = subprocess.run([sys.executable, "-c", _B200_NORM_SCRIPT.replace("ROOT", repr(ROOT))], env=env,
                        capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "did not lower" not in proc.stderr, proc.stderr[-4000:]
  rows = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
  count = lambda work: sum(r["launches"] for r in rows if r["part"] == "rmsnorm_quantize" and r["work"] == work)
  assert count("kernel") == 2 and count("elementwise") == 0 and count("reduce") == 2, rows
  assert sum(r["launches"] for r in rows if r["part"] != "collective") == 4, rows
