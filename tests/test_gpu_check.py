"""scripts/gpu_check.py: the CPU rehearsal runs every row of the device flow, with only jax/numpy/flax/optax.

The rehearsal runs in a subprocess in which pytest, grain, jax-triton, ml_collections, tensorboardX and
matplotlib cannot be imported (the device image has none of them), so the first device run cannot die
on an import or a Python error. It takes about 45 s of CPU time (2-3 minutes on a loaded 2-core VM), plus
the on-device proof it prints first (tools.prove, every candidate at tiny sizes: about 2 minutes there).
"""
import json
import os
import subprocess
import sys

import jax
import pytest

from tools import prove

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
BLOCKED = ("pytest", "grain", "jax_triton", "ml_collections", "tensorboardX", "matplotlib")
ON_GPU = jax.default_backend() == "gpu"


def _run(args, timeout):
  code = ("import runpy, sys\n"
          f"for name in {BLOCKED!r}:\n"
          "  sys.modules[name] = None   # import raises ImportError, as on the device image\n"
          f"sys.argv = [{SCRIPT!r}] + {list(args)!r}\n"
          f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("OUT", None)
  env.pop("FP4JAX_DEFAULT_IMPL", None)
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_native_rows_say_not_blackwell_off_blackwell(tmp_path):
  """On a machine that is not Blackwell and not rehearsing, the native rows are reported as skipped
  (run in-process on the report object: no device needed)."""
  import runpy   # pylint: disable=import-outside-toplevel
  mod = runpy.run_path(SCRIPT)
  report = mod["Report"](str(tmp_path), mod["REHEARSE_SIZES"], rehearse=False, budget_s=float("inf"))
  mod["native_rows"](report, 1.0, {})
  assert len(report.rows) == len(mod["NATIVE_OPS"]) + 2
  assert all(r.status == "skipped" and r.exact == "skipped: not Blackwell" for r in report.rows)
  lines, _ = mod["gpu_check_report"].verdicts(report.rows, mod["QUANTIZE_OPS"], mod["MATMUL_OPS"], mod["NATIVE_OPS"])
  assert "GEMM native nvfp4 1x16.16x16: skipped: not Blackwell" in lines


@pytest.mark.skipif(ON_GPU, reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
  proc = _run([], timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "NO GPU" in proc.stderr and "--rehearse" in proc.stderr
  assert "section" not in proc.stdout     # not a single row ran


@pytest.mark.slow   # ~2 min on 2 cores; run with -m slow
def test_rehearsal_runs_every_row(tmp_path):
  proc = _run(["--rehearse", "--out", str(tmp_path)], timeout=900)
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
  report = json.loads((tmp_path / "gpu_check.json").read_text())
  rows = report["rows"]
  assert report["rehearse"] and not [r for r in rows if r["status"] != "ok"]
  keys = [(r["section"], r["name"], r["impl"]) for r in rows]
  native = sum(len(vs) for (op, _), vs in prove.VARIANTS.items() if op == "native_gemm") + 2   # + the dot rows
  assert [k[0] for k in keys] == (["yardstick"] * 2 + ["quantize"] * 5 + ["matmul"] * 3
                                  + ["quantize"] * 5 + ["matmul"] * 3 + ["native"] * native + ["ssd"] * 2
                                  + ["gated_norm"] * 2 + ["train"] * 3)
  assert [k[2] for k in keys[2:10]] == ["xla"] * 8 and [k[2] for k in keys[10:18]] == ["pallas"] * 8
  for r in rows[2:18]:                     # every kernel and XLA composition checked bit for bit
    assert "==" in r["exact"] and r["ms"] > 0, r
  end = 18 + native
  native_rows = rows[18:end]               # rehearsed through the native path's CPU twin
  for r in native_rows[:-2]:               # every pair: bit for bit vs the XLA path
    assert r["impl"] == "native" and "== XLA" in r["exact"] and r["ms"] > 0, r
  assert [r["name"] for r in native_rows[-2:]] == ["dot nvfp4 y,dx,dw, native", "dot bf16 y,dx,dw"]
  assert native_rows[-2]["exact"].startswith("vs XLA: rel ") and native_rows[-2]["ratio"] > 0
  assert any(v.startswith("dot nvfp4 native: ok") for v in report["verdicts"])
  ssd_xla, ssd_kernel = rows[end:end + 2]        # the Mamba-2 SSD fwd+bwd: XLA, then the Pallas kernels
  assert (ssd_xla["impl"], ssd_kernel["impl"]) == ("xla", "pallas") and ssd_xla["exact"] == "finite"
  assert ssd_kernel["exact"].startswith("vs XLA: ") and ssd_kernel["ratio"] > 0
  assert any(v.startswith("kernel ssd: ok") for v in report["verdicts"])
  gn_xla, gn_kernel = rows[end + 2:end + 4]          # the gated RMSNorm fwd+bwd: XLA, then the Pallas kernels
  assert (gn_xla["impl"], gn_kernel["impl"]) == ("xla", "pallas") and gn_xla["exact"] == "finite"
  assert gn_kernel["exact"].startswith("vs XLA: ") and gn_kernel["ratio"] > 0
  assert any(v.startswith("kernel gated_norm: ok") for v in report["verdicts"])
  assert [r["name"] for r in rows[end + 4:]] == ["train step bf16", "train step nvfp4",
                                            "train step nvfp4, kernels forced"]
  assert all(r["exact"].startswith("loss ") and r["ratio"] > 0 for r in rows[end + 4:])
  assert all(r["predicted_ms"] > 0 for r in rows), [r["name"] for r in rows if not r["predicted_ms"]]
  assert any(v.startswith("target small nvfp4 step") for v in report["verdicts"])
  assert "fp4jax gpu_check (CPU rehearsal)" in (tmp_path / "gpu_check.md").read_text()
  proof = report["proof"]                  # the proof: every candidate proved (kernels interpreted)
  assert len(proof) == len(prove.candidates(native=True)), sorted(proof)   # --rehearse proves native too
  assert all(e["verdict"] in ("faster", "slower") for e in proof.values()), proof
  assert "importing training.step without training/__init__" in proc.stdout   # grain was blocked
  printed = [line.split()[1:3] for line in proc.stdout.splitlines()
             if line.split() and line.split()[0] in ("yardstick", "quantize", "matmul", "native", "ssd", "gated_norm",
                                                            "train")]
  assert len(printed) == len(rows)         # each row printed as it finished
