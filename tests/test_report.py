"""bench/predict/report.py's table from its on-disk cache, without compiling: a row that failed to compile is
printed with its reason, a missing one says how to make it, a compiled one is priced by the ruler and
labelled a prediction, and the table replaces only its own block of docs/PERF.md."""
import gzip
import json

from bench.predict import report_cache
from bench.predict import report_rows
from bench.predict import report_table

HLO = """HloModule m, is_scheduled=true, num_partitions=8

%fused_neg (p0: f32[1048576]) -> f32[1048576] {
  %p0 = f32[1048576]{0} parameter(0)
  ROOT %n = f32[1048576]{0} negate(%p0)
}

ENTRY %main (a: f32[1048576]) -> f32[1048576] {
  %a = f32[1048576]{0} parameter(0)
  ROOT %r = f32[1048576]{0} fusion(%a), kind=kLoop, calls=%fused_neg
}
"""


def _put(cache, row, variant, meta, hlo=None):
  key = cache.key(row.argv(variant), row.target)
  meta_path, hlo_path = cache.paths(key)
  with open(meta_path, "w", encoding="utf-8") as f:
    json.dump(meta, f)
  if hlo is not None:
    with gzip.open(hlo_path, "wt", encoding="utf-8") as f:
      f.write(hlo)


def test_the_table_from_the_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(report_cache.Cache, "code", "fixed")     # no git call: the key's code part fixed
  cache = report_cache.Cache(str(tmp_path))
  row = report_rows.ROWS["llama8b_b200"]
  _put(cache, row, "mxfp8", dict(error="NotImplementedError: mxfp8 grouped GEMM", date="2026-12-03"))
  _put(cache, row, "bf16", dict(date="2026-12-03", results=[dict(
      tokens_per_device=8192, params=8.03e9, active_params=8.03e9, compile_s=1.0,
      memory=dict(argument_bytes=2 ** 33, temp_bytes=2 ** 34, output_bytes=0, alias_bytes=0))]), HLO)
  text = report_table.render(cache, [row])
  assert "| mxfp8 | does not compile: NotImplementedError: mxfp8 grouped GEMM |" in text
  assert "bench/predict/report.py --rows llama8b_b200 --variants nvfp4" in text          # not compiled yet
  assert "Predictions, not measurements" in text and "| 24.0 |" in text           # 8 + 16 GiB per GPU
  assert "tokens per GPU per step: 8,192 (Llama-3-8B shape, 8 B200)" in text     # the compiled rows' own
  bf16 = next(l for l in text.splitlines() if l.startswith("| Llama-3-8B shape, 8 B200 | bf16 |"))
  assert "(optimistic)" in bf16          # one fusion: far faster than torchtitan, so the bias is above 1
  perf = tmp_path / "PERF.md"
  perf.write_text("# Performance log\n\nolder entries\n")
  report_table.write_perf("first", str(perf))
  report_table.write_perf("second", str(perf))
  out = perf.read_text()
  assert out.count(report_table.BEGIN) == 1 and "second" in out and "first" not in out
  assert out.startswith("# Performance log") and out.endswith("older entries\n")


def test_rows_that_share_a_compile_are_priced_on_their_own_clusters(tmp_path, monkeypatch):
  """super_b200 and its one-NVLink-domain what-if are one compile, priced twice: on 8 HGX nodes and on NVL72."""
  from bench.predict import ruler   # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(report_cache.Cache, "code", "fixed")
  real = ruler.predict
  monkeypatch.setattr(ruler, "predict", lambda text, target, cluster, **kw: dict(
      real(text, target, "hgx_b200", **kw), step_s={"hgx_b200": 2.0, "gb200_nvl72": 1.0}[cluster]))
  cache = report_cache.Cache(str(tmp_path))
  hgx, nvl = report_rows.ROWS["super_b200"], report_rows.ROWS["super_b200_nvl"]
  assert cache.key(hgx.argv("bf16"), hgx.target) == cache.key(nvl.argv("bf16"), nvl.target)
  assert cache.key(hgx.argv("mxfp8"), hgx.target) == cache.key(nvl.argv("mxfp8"), nvl.target)
  assert hgx.argv("mxfp8")[-1] == "--config.micro_batches=8" and "--config.micro_batches=8" not in hgx.argv("nvfp4")
  _put(cache, hgx, "bf16", dict(date="2026-12-06", results=[dict(
      tokens_per_device=65536, params=1.2e11, active_params=1.2e10, compile_s=1.0,
      memory=dict(argument_bytes=2 ** 33, temp_bytes=2 ** 34, output_bytes=0, alias_bytes=0))]), HLO)
  assert report_table.priced(cache, hgx, "bf16")["step_ms"] == 2000.0
  assert report_table.priced(cache, nvl, "bf16")["step_ms"] == 1000.0
  assert report_table.priced(cache, hgx, "bf16")["step_ms"] == 2000.0   # each read back from its own entry


def test_cells_not_in_the_cache_keep_the_previous_tables_line(tmp_path, monkeypatch):
  """A rerun that compiles some rows keeps the others' lines of the table in docs/PERF.md, marked with the commit
  that compiled them; a cell the previous table lacks still says how to compile it."""
  monkeypatch.setattr(report_cache.Cache, "code", "fixed")
  cache = report_cache.Cache(str(tmp_path))
  row = report_rows.ROWS["llama8b_b200"]
  _put(cache, row, "bf16", dict(date="2026-12-03", results=[dict(
      tokens_per_device=8192, params=8.03e9, active_params=8.03e9, compile_s=1.0,
      memory=dict(argument_bytes=2 ** 33, temp_bytes=2 ** 34, output_bytes=0, alias_bytes=0))]), HLO)
  old = ("| Llama-3-8B shape, 8 B200 | mxfp8 | 454.2 | 18,035 | 30,559 | 38.6% | 6,749 | 6.6 (61.6) | 93.5 | 391.6 |\n"
         "| Llama-3-8B shape, 8 B200 | nvfp4 (2 kernel shapes ran their XLA twin) | 363.0 | 22,566 | 38,235 | 48.3% "
         "| 14,784 | 5.4 (42.5) | 85.6 | 324.2 |\n"
         "| Llama-3-8B shape, 8 B200 | bf16 | 999.9 | 1 | 1 | 1.0% | 1 | 1.0 (1.0) | 1.0 | 1.0 |\n")
  perf = tmp_path / "PERF.md"
  perf.write_text(f"# P\n\n{report_table.BEGIN}\n**Predictions**, 2026-12-06, commit 6379e54, jax\n\n{old}"
                  f"{report_table.END}\nrest\n")
  previous = report_table.previous_table(str(perf))
  assert len(previous) == 3 and {c for _, c in previous.values()} == {"6379e54"}
  text = report_table.render(cache, [row], previous=previous)
  lines = text.splitlines()
  mxfp8 = next(l for l in lines if l.startswith("| Llama-3-8B shape, 8 B200 | mxfp8 (kept from 6379e54) | 454.2 |"))
  assert mxfp8.endswith("| 38.6% | 6,749 | 6.6 (61.6) | 93.5 | 391.6 |")
  assert "30,559" not in mxfp8   # its ÷ bias cell divided by this table's bias, not the old one's
  assert any(l.startswith("| Llama-3-8B shape, 8 B200 | nvfp4 (2 kernel shapes ran their XLA twin) (kept from "
                          "6379e54) | 363.0 |") for l in lines)
  assert "--rows llama8b_b200 --variants nvfp4_proved" in text       # not in the previous table either
  bf16 = next(l for l in lines if l.startswith("| Llama-3-8B shape, 8 B200 | bf16 |"))
  assert "999.9" not in bf16                                           # the cache's own, not the old line
  assert '2 rows marked "kept from 6379e54" were not compiled again' in lines[0]
  assert "| nvfp4 | 30,029 | 22,566 |" in text   # a kept row is a calibration point with its old tokens/s
  assert report_table.previous_table(str(tmp_path / "none.md")) == {}
  # written and read again: a kept line keeps the commit that compiled it, not the newer table's
  report_table.write_perf(text, str(perf))
  again = report_table.previous_table(str(perf))
  assert again[("Llama-3-8B shape, 8 B200", "mxfp8")][1] == "6379e54"
  assert "(kept from 6379e54) (kept" not in report_table.render(cache, [row], previous=again)


def test_a_compile_takes_the_targets_xla_flags_not_the_callers(tmp_path, monkeypatch):
  """The key holds the target's XLA options only, so the compile must not inherit the shell's XLA_FLAGS (an H200
  row compiled with the B200's Triton workaround would be cached as the plain H200 program)."""
  seen = []

  def run(cmd, env, **_):
    seen.append(env["XLA_FLAGS"])
    return report_cache.subprocess.CompletedProcess(cmd, 1, "", "no compile here")
  monkeypatch.setattr(report_cache.subprocess, "run", run)
  monkeypatch.setattr(report_cache.Cache, "code", "fixed")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0")
  cache = report_cache.Cache(str(tmp_path))
  for target in ("h200", "b200"):
    cache.compile(["--target", target], target, timeout_s=10, log=lambda _: None)
  h200, b200 = seen
  assert "triton_gemm" not in h200 and "autotune_level" not in h200 and "--xla_dump_to=" in h200
  assert "--xla_gpu_enable_triton_gemm=false" in b200 and "autotune_level" not in b200
