"""The on-device proof (tools.prove) and its verdicts (fp4jax.verdicts), on the CPU.

A fake device table (``fake_gpu``: a fake device kind and driver, the Pallas kernels reported usable)
makes the prover run here, the kernels in Pallas interpret mode at tiny sizes. Timing on the CPU says
nothing about a GPU, so tests that need a "faster" verdict replace ``prove.time_pair``; exactness is
never faked: a deliberately wrong kernel is monkeypatched in and must be refused.
"""
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
from fp4jax import dispatch, native, verdicts
from fp4jax import target as target_lib
from fp4jax.kernels import quantize_1d as k1d
from fp4jax.primitives import quantize_last
from tools import prove

FAKE = prove.Device("Fake GPU 9000", "999.99 CUDA 99.9")
OP, FMT = "quantize_1d", "nvfp4"


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
  """This process looks like a GPU to the prover; verdicts go to tmp_path; nothing forced."""
  for name in (dispatch.DEFAULT_IMPL_ENV, verdicts.PROOF_ENV):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv(verdicts.DIR_ENV, str(tmp_path))
  monkeypatch.setenv(verdicts.BUDGET_ENV, "600")
  monkeypatch.setattr(prove, "this_device", lambda: FAKE)
  # The program's devices (fp4jax.target) are this fake GPU too: the kernels can run, the verdicts apply.
  monkeypatch.setattr(target_lib.Target, "here", classmethod(lambda cls: target_lib.Target("gpu", FAKE.kind, (9, 0))))
  previous = verdicts.register(prove.DeviceProver())
  verdicts.forget()
  yield tmp_path
  verdicts.forget()
  verdicts.register(previous)


@pytest.fixture
def kernel_faster(monkeypatch):
  """Timings as if the kernel took half the XLA path's time (exactness is still checked for real)."""
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (1e-3, 2e-3))


def _count_proofs(monkeypatch):
  calls = []
  real = prove.prove

  def counted(op, fmt, **kw):
    calls.append((op, fmt))
    return real(op, fmt, **kw)
  monkeypatch.setattr(prove, "prove", counted)
  return calls


def _file(tmp_path):
  files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
  assert len(files) == 1, files
  return tmp_path / files[0]


def _wrong_on_tiny_amax(monkeypatch):
  """quantize_1d that flips code bits whenever the tensor amax is below 2^-100 (a wrong kernel that
  only the extreme-amax case catches)."""
  real = k1d.quantize_1d

  def wrong(x, amax, bits=None, **kw):
    q, s = real(x, amax, bits, **kw)
    return jnp.where(jnp.asarray(amax) < 2.0 ** -100, q ^ 0x11, q), s
  monkeypatch.setattr(k1d, "quantize_1d", wrong)


def test_no_gpu_no_proof(monkeypatch, tmp_path):
  """On the CPU, without the fake table, impl=None stays on the XLA path and nothing is proved."""
  monkeypatch.setenv(verdicts.DIR_ENV, str(tmp_path))
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  calls = _count_proofs(monkeypatch)
  verdicts.forget()
  assert prove.device_key() is None
  assert dispatch.default_impl(OP, FMT) == "xla" and dispatch.native_default(FMT) is None
  assert verdicts.decide(OP, FMT) is None and not calls and not os.listdir(tmp_path)


def test_exact_kernel_is_proved_cached_and_used(fake_gpu, kernel_faster, monkeypatch, capsys):
  calls = _count_proofs(monkeypatch)
  x = inputs.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  # impl=None asks while the program is traced: the proof runs then (on its own thread) ...
  jaxpr = jax.make_jaxpr(lambda x: quantize_last(x, jnp.max(jnp.abs(x)).astype(jnp.float32), fmt=FMT))(x)
  assert calls == [(OP, FMT)]
  assert "impl='pallas'" in str(jaxpr) or 'impl=pallas' in str(jaxpr)
  data = json.loads(_file(fake_gpu).read_text())
  assert data["key"] == prove.device_key(FAKE) and data["key"]["device"] == FAKE.kind
  assert set(data["key"]) == {"device", "driver", "jax", "jaxlib", "fp4jax"}
  entry = data["verdicts"][f"{OP}/{FMT}"]
  assert entry["verdict"] == "faster" and entry["attempts"] == 1 and entry["date"]
  cases = [c["case"] for v in entry["evidence"]["variants"] for c in v["cases"]]
  assert {"random", "tiny 2^-120", "huge 2^118", "nan/inf, finite amax", "nan/inf, amax inf", "amax nan",
          "zeros"} <= set(cases)
  assert [v["variant"] for v in entry["evidence"]["variants"]] == ["1x16", "1x16 SR", "1x16 SR packed", "1x16 SR philox"]
  assert all(c["mismatches"] == 0 and c["compared"] > 0 for v in entry["evidence"]["variants"] for c in v["cases"])
  # ... once: the same process asks again without proving again,
  assert dispatch.default_impl(OP, FMT) == "pallas" and calls == [(OP, FMT)]
  # and a new process (what it knows forgotten) reads the file instead of proving.
  verdicts.forget()
  assert dispatch.default_impl(OP, FMT) == "pallas" and calls == [(OP, FMT)]
  assert "differs" not in capsys.readouterr().err


def test_exact_but_slower_is_not_used_even_if_verified(fake_gpu, monkeypatch):
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (2e-3, 1e-3))
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, (OP, FMT), dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert dispatch.default_impl(OP, FMT) == "xla"
  assert verdicts.entry_for(OP, FMT)["verdict"] == "slower"


def test_wrong_kernel_is_refused_with_the_reproduction_command(fake_gpu, kernel_faster, monkeypatch, capsys):
  _wrong_on_tiny_amax(monkeypatch)
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, (OP, FMT), dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert dispatch.default_impl(OP, FMT) == "xla"        # "differs" revokes even a VERIFIED_KERNELS entry
  err = capsys.readouterr().err
  assert f"{OP}/{FMT} differs" in err and "tiny 2^-120" in err and FAKE.kind in err
  assert "Reproduce: python -m tools.prove --op quantize_1d --fmt nvfp4" in err
  assert dispatch.default_impl(OP, FMT) == "xla"
  assert capsys.readouterr().err == ""              # printed once per process
  entry = json.loads(_file(fake_gpu).read_text())["verdicts"][f"{OP}/{FMT}"]
  case = entry["evidence"]["variants"][0]["cases"][-1]
  assert entry["verdict"] == "differs" and case["case"] == "tiny 2^-120" and case["mismatches"] > 0
  assert case["first"].startswith("code byte")
  # the printed command reproduces it (in-process, so the wrong kernel is still patched in)
  assert prove.main(["--op", OP, "--fmt", FMT, "--no_save"]) == 1
  out = capsys.readouterr().out
  assert f"proof {OP}/{FMT}: differs" in out and "tiny 2^-120" in out


def test_budget_is_respected_and_undecided_falls_back(fake_gpu, monkeypatch):
  calls = _count_proofs(monkeypatch)
  monkeypatch.setenv(verdicts.BUDGET_ENV, "0")
  start = time.perf_counter()
  assert dispatch.default_impl(OP, FMT) == "xla"        # undecided, nothing verified: the XLA path
  assert time.perf_counter() - start < 5
  entry = verdicts.entry_for(OP, FMT)
  assert entry["verdict"] == "undecided" and "budget" in entry["summary"] and entry["attempts"] == 1
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, (OP, FMT), dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert dispatch.default_impl(OP, FMT) == "pallas"     # undecided: the lab evidence decides
  assert len(calls) == 1                            # not retried by the same process
  for attempt in (2, 3):                            # later processes retry, MAX_ATTEMPTS in all
    verdicts.forget()
    assert verdicts.entry_for(OP, FMT)["attempts"] == attempt
  verdicts.forget()
  assert verdicts.entry_for(OP, FMT)["attempts"] == 3 and len(calls) == 3


def test_budget_stops_between_steps(fake_gpu, monkeypatch):
  """A budget that the first variant spends: the proof stops there, undecided, about on time."""
  assert len(prove.VARIANTS[("quantize_2d", FMT)]) > 1
  run_one = prove._prove_quantize
  deadline = time.perf_counter() + 0.5

  calls = []

  def first_variant_spends_the_budget(v, sizes, deadline_):
    calls.append(v)
    if len(calls) > 1:
      return run_one(v, sizes, deadline_)
    record = run_one(v, sizes, float("inf"))                       # the first finishes, however slow
    time.sleep(max(0.0, deadline - time.perf_counter()) + 0.01)   # ... or fast this machine is
    return record
  monkeypatch.setattr(prove, "_prove_quantize", first_variant_spends_the_budget)
  entry = prove.prove("quantize_2d", FMT, sizes=prove.TINY_SIZES, deadline=deadline)
  assert entry["verdict"] == "undecided" and len(entry["evidence"]["variants"]) == 1
  assert "budget ran out after 1 of" in entry["summary"]
  assert entry["evidence"]["seconds"] < 60        # one step (a compile) may overrun the deadline


def test_opt_out(fake_gpu, monkeypatch):
  calls = _count_proofs(monkeypatch)
  monkeypatch.setenv(verdicts.PROOF_ENV, "off")
  assert dispatch.default_impl(OP, FMT) == "xla" and verdicts.decide(OP, FMT) is None and not calls
  monkeypatch.setitem(dispatch.VERIFIED_KERNELS, (OP, FMT), dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert dispatch.default_impl(OP, FMT) == "pallas" and not calls
  monkeypatch.setenv(verdicts.PROOF_ENV, "maybe")
  with pytest.raises(ValueError, match="FP4JAX_PROOF='maybe'.*'off'"):
    dispatch.default_impl(OP, FMT)


def test_default_impl_env_wins(fake_gpu, kernel_faster, monkeypatch):
  _wrong_on_tiny_amax(monkeypatch)
  assert dispatch.default_impl(OP, FMT) == "xla"        # proved: differs
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  assert dispatch.default_impl(OP, FMT) == "pallas"     # forced, over the device's verdict


def test_default_impl_xla_wins_over_a_faster_verdict(fake_gpu, kernel_faster, monkeypatch):
  calls = _count_proofs(monkeypatch)
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert dispatch.default_impl(OP, FMT) == "xla" and not calls   # forced: nothing is even proved
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV)
  assert dispatch.default_impl(OP, FMT) == "pallas" and len(calls) == 1


@pytest.mark.parametrize("content", ["{not json", json.dumps({"schema": 1, "key": {"device": "other"},
                                                                "verdicts": {}}), "corrupt-entry"])
def test_corrupt_cache_file_is_ignored(fake_gpu, kernel_faster, monkeypatch, capsys, content):
  key = prove.device_key(FAKE)
  path = verdicts.path_for(key)
  if content == "corrupt-entry":   # the right key, but an entry no prover writes: a forged "faster"
    content = json.dumps({"schema": 1, "key": key, "verdicts": {f"{OP}/{FMT}": {"verdict": "faster"}}})
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(content)
  _wrong_on_tiny_amax(monkeypatch)
  calls = _count_proofs(monkeypatch)
  assert dispatch.default_impl(OP, FMT) == "xla" and calls == [(OP, FMT)]   # re-proved, never trusted
  assert "ignoring the kernel verdict file" in capsys.readouterr().err
  data = json.loads(open(path).read())
  assert data["key"] == key and data["verdicts"][f"{OP}/{FMT}"]["verdict"] == "differs"


def test_native_default_confirmed_or_revoked(fake_gpu, monkeypatch, capsys):
  """The native GEMM's default on cc 10.x: kept when this device proves it exact and faster, revoked
  when slower or when it differs (here its CPU twin, made wrong by one element)."""
  fmt = "nvfp4_eden"
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (1e-3, 2e-3))
  assert dispatch.native_default(fmt, capability=(10, 0)) == "native"
  entry = verdicts.entry_for(verdicts.NATIVE_OP, fmt)
  assert entry["verdict"] == "faster"
  bound = entry["evidence"]["variants"][0]["cases"][-1]
  assert bound["case"].startswith("random") and bound["violations"] == 0 and bound["k"] == prove.TINY_SIZES.gemm

  verdicts.forget()
  os.remove(_file(fake_gpu))
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (2e-3, 1e-3))
  assert dispatch.native_default(fmt, capability=(10, 0)) is None     # exact but slower here

  verdicts.forget()
  os.remove(_file(fake_gpu))
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (1e-3, 2e-3))
  real = native._twin
  # one element off by 1% + 1: visible in a bf16 output whatever its value
  monkeypatch.setattr(native, "_twin", lambda *a: (lambda r: r.at[0, 0].set(r[0, 0] * 1.01 + 1))(real(*a)))
  assert dispatch.native_default(fmt, capability=(10, 0)) is None
  err = capsys.readouterr().err
  assert f"native_gemm/{fmt} differs" in err and "--op native_gemm --fmt nvfp4_eden" in err
  assert dispatch.native_default(fmt, capability=(8, 0)) is None      # not Blackwell: never native


def test_compare_quantized_ignores_codes_under_a_nan_scale():
  v = prove.Variant("quantize_1d", "mxfp4", "1x32")
  codes = np.zeros((2, 32), np.uint8)
  scales = np.array([[0xFF, 127], [127, 127]], np.uint8)      # block (0, 0) is NaN
  other = codes.copy()
  other[0, 3] = 0x88                                          # under the NaN scale: don't care
  compare_quantized = prove.compare_quantized
  got = compare_quantized((other, scales), (codes, scales), v)
  assert got["mismatches"] == 0 and got["dont_care"] == 16
  other[1, 20] = 0x01                                         # a real difference
  got = compare_quantized((other, scales), (codes, scales), v)
  assert got["mismatches"] == 1 and got["first"] == "code byte (1, 20): kernel 0x01, XLA 0x00"
  bad_scales = scales.copy()
  bad_scales[1, 1] = 126
  assert compare_quantized((codes, bad_scales), (codes, scales), v)["first"].startswith("scale byte (1, 1)")


def test_compare_floats_nan_equals_nan():
  a = np.array([1.0, np.nan, np.inf], np.float32)
  b = np.array([1.0, -np.nan, np.inf], np.float32)
  assert prove.compare_floats(a, b)["mismatches"] == 0
  b[0] = np.nextafter(np.float32(1), np.float32(2))
  assert prove.compare_floats(a, b)["mismatches"] == 1


def test_bound_check_catches_a_wrong_element_not_an_order():
  """The summation-order bound passes a result summed in another order and refuses a 0.1% error."""
  n = 256
  a, b = prove._random_operands(prove.VARIANTS[("scaled_matmul", "nvfp4")][1], n)  # pylint: disable=protected-access
  want = jax.jit(lambda a, b: prove.api.scaled_matmul(a, b, out_dtype=jnp.float32, impl="xla"))(a, b)
  xa = prove.api.dequantize(a, jnp.float32, impl="xla")
  xb = prove.api.dequantize(b, jnp.float32, impl="xla")
  # another summation order: K in reverse, pairwise in halves
  other = xa[:, n // 2:][:, ::-1] @ xb[:, n // 2:][:, ::-1].T + xa[:, :n // 2] @ xb[:, :n // 2].T
  check = prove.bound_check(other, want, a, b)
  assert check["violations"] == 0 and check["k"] == n, check
  i = np.unravel_index(int(jnp.argmax(jnp.abs(want))), want.shape)
  assert prove.bound_check(want.at[i].multiply(1.001), want, a, b)["violations"] == 1


def test_no_verdict_for_a_program_compiled_for_other_devices(fake_gpu, kernel_faster, monkeypatch):
  """A program for another kind of device (a deviceless compile for a topology) is decided by the lab
  evidence alone: nothing is proved here for it, and this device's verdicts do not apply to it."""
  calls = _count_proofs(monkeypatch)
  other = target_lib.Target("gpu", "NVIDIA B200", (10, 0))
  assert dispatch.default_impl(OP, FMT, target=other) == "xla" and not calls
  assert dispatch.default_impl(OP, FMT) == "pallas" and calls == [(OP, FMT)]     # this device: proved, faster
  assert dispatch.default_impl(OP, FMT, target=other) == "xla"


def _matmul_impl(a, b):
  from fp4jax import api   # pylint: disable=import-outside-toplevel
  eqns = jax.make_jaxpr(lambda a, b: api.scaled_matmul(a, b, out_dtype=jnp.bfloat16))(a, b).jaxpr.eqns
  return [e.params["impl"] for e in eqns if str(e.primitive) == "fp4jax_scaled_matmul"]


def test_mixed_matmul_is_proved_and_then_chosen(fake_gpu, kernel_faster, monkeypatch):
  """The GEMM that decodes as it loads is a candidate; proved exact (and, with faked timings, faster),
  impl=None's scaled matmul runs it ("mixed") instead of the XLA path."""
  assert ("mixed_matmul", "nvfp4") in prove.candidates() and ("mixed_matmul", "mxfp4") in prove.candidates()
  calls = _count_proofs(monkeypatch)
  a = prove.cases.exact_operand(32, 64, "nvfp4", False, 1)
  b = prove.cases.exact_operand(32, 64, "nvfp4", True, 2)
  assert _matmul_impl(a, b) == ["mixed"]
  assert calls[0] == ("mixed_matmul", "nvfp4")
  entry = verdicts.entry_for("mixed_matmul", "nvfp4")
  assert entry["verdict"] == "faster"
  cases = {c["case"] for v in entry["evidence"]["variants"] for c in v["cases"]}
  assert {"exact", "amax tiny 2^-100", "amax huge 2^100", "amax nan", "nan scales",
          "random, summation-order bound"} <= cases
  assert [v["variant"] for v in entry["evidence"]["variants"]] == ["1x16.16x16", "1x16.1x16"]


def test_wrong_mixed_matmul_is_refused(fake_gpu, kernel_faster, monkeypatch, capsys):
  """A mixed kernel that drops NaN outputs (a NaN amax or scale byte gives 0, as a Triton max that
  ignores NaN would) is refused; the scaled matmul then runs what "scaled_matmul" proves (here the pair, exact, and
  faster with the faked timings)."""
  from fp4jax.kernels import mixed_matmul as km   # pylint: disable=import-outside-toplevel
  real = km.mixed_matmul

  def wrong(*args, **kw):
    out = real(*args, **kw)
    return jnp.where(jnp.isnan(out), jnp.zeros((), out.dtype), out)
  monkeypatch.setattr(km, "mixed_matmul", wrong)
  a = prove.cases.exact_operand(32, 64, "nvfp4", False, 1)
  b = prove.cases.exact_operand(32, 64, "nvfp4", True, 2)
  assert _matmul_impl(a, b) == ["pallas"]
  assert verdicts.entry_for("mixed_matmul", "nvfp4")["verdict"] == "differs"
  assert verdicts.entry_for("scaled_matmul", "nvfp4")["verdict"] == "faster"
  err = capsys.readouterr().err
  assert "mixed_matmul/nvfp4 differs" in err and "case 'amax nan'" in err   # the first NaN case
  assert "Reproduce: python -m tools.prove --op mixed_matmul --fmt nvfp4" in err


# ------------------------------------------------------------------------------- model kernels
# The model ops' kernels (models.gated_norm, models.ssd_pallas) offer their proof to tools.prove (which imports
# them): the kernel vs its XLA twin, forward and gradients, within the module's PROOF_TOL of each output's
# largest magnitude (tiny shapes, interpreted, here), then timed (faked, as above).

def _model(op):
  from models import gated_norm, ssd_pallas   # pylint: disable=import-outside-toplevel
  mod = {"ssd": ssd_pallas, "gated_norm": gated_norm}[op]
  if op == "ssd":
    return mod, lambda **kw: mod.default_impl((1, 64, 4, 64), (1, 64, 1, 128), **kw)
  return mod, mod.default_impl


def _wrong_dscale(monkeypatch):
  """The gated norm's backward kernel with dscale 3% off (forward and dy, dz right)."""
  gated_norm = _model("gated_norm")[0]
  real = gated_norm._bwd_call   # pylint: disable=protected-access
  monkeypatch.setattr(gated_norm, "_bwd_call", lambda *a: (lambda dy, dz, dw: (dy, dz, dw * 1.03))(*real(*a)))


def test_model_kernels_stay_xla_on_the_cpu(monkeypatch, tmp_path):
  monkeypatch.setenv(verdicts.DIR_ENV, str(tmp_path))
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV, raising=False)
  calls = _count_proofs(monkeypatch)
  verdicts.forget()
  for op in prove.MODEL_MODULES:
    module, default = _model(op)
    assert default() == "xla" and dispatch.model_kernel_default(op, module.VERIFIED) == "xla"
    assert verdicts.decide(op, verdicts.MODEL_FMT) is None
  assert not calls and not os.listdir(tmp_path)
  assert set(prove.model_candidates()) == {("ssd", verdicts.MODEL_FMT), ("gated_norm", verdicts.MODEL_FMT)}


def test_model_kernel_within_tolerance_and_faster_is_chosen(fake_gpu, kernel_faster, monkeypatch, capsys):
  gated_norm, default = _model("gated_norm")
  calls = _count_proofs(monkeypatch)
  assert default() == "pallas" and calls == [("gated_norm", verdicts.MODEL_FMT)]
  entry = json.loads(_file(fake_gpu).read_text())["verdicts"]["gated_norm/float32"]
  assert entry["verdict"] == "faster" and entry["tolerance"] == gated_norm.PROOF_TOL
  assert 0 <= entry["max_error"] < gated_norm.PROOF_TOL and "within tol 1e-02" in entry["summary"]
  case = entry["evidence"]["variants"][0]["cases"][0]
  assert set(case["errors"]) == set(gated_norm.PROOF_OUTPUTS) and case["mismatches"] == 0
  verdicts.forget()                                  # a new process reads the file
  assert default() == "pallas" and dispatch.model_kernel_default("gated_norm", None) == "pallas" and len(calls) == 1
  assert default(platform="cpu") == "xla"            # the caller's predicate still decides where it runs
  assert "differs" not in capsys.readouterr().err


def test_model_kernel_slower_is_not_used_even_if_verified(fake_gpu, monkeypatch):
  monkeypatch.setattr(prove, "time_pair", lambda *a, **k: (2e-3, 1e-3))
  monkeypatch.setattr(_model("gated_norm")[0], "VERIFIED", dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert _model("gated_norm")[1]() == "xla"
  assert verdicts.entry_for("gated_norm", verdicts.MODEL_FMT)["verdict"] == "slower"


def test_wrong_model_kernel_is_refused_with_the_reason(fake_gpu, kernel_faster, monkeypatch, capsys):
  _wrong_dscale(monkeypatch)
  monkeypatch.setattr(_model("gated_norm")[0], "VERIFIED", dispatch.Evidence("2026-01-01", "lab", "0", 1.5))
  assert _model("gated_norm")[1]() == "xla"          # "differs" revokes even recorded evidence
  err = capsys.readouterr().err
  assert "gated_norm/float32 differs" in err and "dscale 3.0e-02 of its largest magnitude > tol 1e-02" in err
  assert "Reproduce: python -m tools.prove --op gated_norm --fmt float32" in err
  entry = verdicts.entry_for("gated_norm", verdicts.MODEL_FMT)
  assert entry["verdict"] == "differs" and entry["tolerance"] == 1e-2 and 0.029 < entry["max_error"] < 0.031
  # the printed command reproduces it (in-process: the wrong kernel is still patched in)
  assert prove.main(["--op", "gated_norm", "--fmt", "float32", "--no_save"]) == 1
  assert "proof gated_norm/float32: differs" in capsys.readouterr().out
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "pallas")
  assert _model("gated_norm")[1]() == "pallas"      # forced, over the device's verdict


def test_default_impl_xla_wins_over_a_faster_model_verdict(fake_gpu, kernel_faster, monkeypatch):
  calls = _count_proofs(monkeypatch)
  monkeypatch.setenv(dispatch.DEFAULT_IMPL_ENV, "xla")
  assert _model("gated_norm")[1]() == "xla" and not calls
  monkeypatch.delenv(dispatch.DEFAULT_IMPL_ENV)
  assert _model("gated_norm")[1]() == "pallas" and len(calls) == 1


def test_no_model_verdict_for_a_deviceless_compile(fake_gpu, kernel_faster, monkeypatch):
  calls = _count_proofs(monkeypatch)
  other = target_lib.Target("gpu", "NVIDIA B200", (10, 0))
  assert dispatch.model_kernel_default("ssd", None, target=other) == "xla" and not calls
  assert dispatch.model_kernel_default("ssd", dispatch.Evidence("2026-01-01", "lab", "0", 1.5), target=other) == "pallas" and not calls   # the lab table decides


def test_model_proof_needs_its_module_and_fmt(monkeypatch):
  with pytest.raises(ValueError, match="fmt='float32'"):
    prove.prove("ssd", "nvfp4")
  with pytest.raises(ValueError, match="unknown model kernel op 'mlp'"):
    prove.model_proof("mlp")
  monkeypatch.setattr(_model("ssd")[0], "PROOF_TOL", 2)
  with pytest.raises(ValueError, match=r"models.ssd_pallas.PROOF_TOL=2.*\(0, 1\)"):
    prove.model_proof("ssd")


def test_import_fp4jax_and_models_loads_no_prover():
  """The library and the models import no prover and register none: only a process that asks
  (tools.prove.register(), the entry points) proves on its device."""
  code = ("import sys, fp4jax, fp4jax.gemm, fp4jax.dispatch, models, models.ssd_pallas, models.gated_norm\n"
          "from fp4jax import verdicts\n"
          "loaded = sorted(m for m in sys.modules if m.startswith('tools') or 'proof' in m or 'prove' in m)\n"
          "assert not loaded and verdicts._prover is None, loaded\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_ssd_kernel_proved_and_a_wrong_gradient_refused(fake_gpu, kernel_faster, monkeypatch, capsys):
  """The SSD kernel within tolerance (chosen), then with dB 5% off in its backward (refused)."""
  ssd_pallas, default = _model("ssd")
  assert default() == "pallas"
  entry = verdicts.entry_for("ssd", verdicts.MODEL_FMT)
  assert entry["verdict"] == "faster" and entry["max_error"] < ssd_pallas.PROOF_TOL
  verdicts.forget()
  os.remove(_file(fake_gpu))
  real = ssd_pallas._dchunk_call   # pylint: disable=protected-access
  monkeypatch.setattr(ssd_pallas, "_dchunk_call",
                      lambda *a: (lambda dx, ddt, dcs, ddot, db, dc: (dx, ddt, dcs, ddot, db * 1.05, dc))(*real(*a)))
  assert default() == "xla"
  err = capsys.readouterr().err
  assert "ssd/float32 differs" in err and "dB" in err and "python -m tools.prove --op ssd --fmt float32" in err
