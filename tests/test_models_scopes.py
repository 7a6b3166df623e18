"""The model's named parts (``models.scopes``): in the op_names of the compiled step, forward and backward,
read back by bench/predict/hlo_parts.py's ``part`` / ``by_part`` / ``columns``, and changing no operation."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from bench.predict import hlo_cost, hlo_parts
from models import lm, presets, scopes

TRAINED_PARTS = ("embed", "residual", "rmsnorm", "linear", "mamba2_split", "mamba2_conv_silu", "mamba2_dt",
                 "mamba2_ssd", "mamba2_gate_norm", "attention_rope", "attention_core", "mlp_act", "cross_entropy")


def _grad_fn(preset: str, recipe: str, **overrides):
  cfg = dataclasses.replace(presets.get_model_config(preset), **overrides)
  model = lm.LanguageModel(cfg, recipe)
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
  key = jax.random.key(0)
  params = model.init({"params": key, "fp4": key}, tokens[:, :-1])["params"]

  def loss(p):
    return model.apply({"params": p}, tokens[:, :-1], targets_BxL=tokens[:, 1:], rngs={"fp4": key})
  return jax.value_and_grad(loss), params


@pytest.mark.slow   # 30-100 s on the loaded 2-core VM; the default suite has the compiled-gradient test
@pytest.mark.parametrize("preset,recipe", [("tiny", "bf16"),
                                           pytest.param("tiny", "nvfp4", marks=pytest.mark.slow),
                                           pytest.param("moe_tiny", "bf16", marks=pytest.mark.slow)])
def test_scopes_change_no_operation(monkeypatch, preset, recipe):
  """The gradient's jaxpr, equation for equation, is the one traced with every part a no-op scope."""
  fn, params = _grad_fn(preset, recipe, rope=True)
  scoped = str(jax.make_jaxpr(fn)(params))
  monkeypatch.setattr(scopes, "part", lambda name: contextlib.nullcontext())
  assert str(jax.make_jaxpr(fn)(params)) == scoped


@pytest.mark.slow   # covered by test_profile_names.py::test_grad_of_dot_is_named
def test_parts_name_the_compiled_gradient():
  """Every part of a trained hybrid is in the compiled CPU HLO's op_names, forward and backward, and
  bench/predict/hlo_cost.py charges the non-GEMM work to them rather than to "unscoped"."""
  fn, params = _grad_fn("tiny", "bf16", rope=True, remat="full")
  text = jax.jit(fn).lower(params).compile().as_text()
  cost = hlo_cost.analyze(text, dict(flops={"f32": 1e14, "bf16": 1e15}, hbm=1e12))
  names = [o["op_name"] for o in cost["ops"]]
  for p in TRAINED_PARTS:
    assert any(f"models/{p}/" in n and "transpose(" not in n for n in names), f"{p} forward"
    if p != "residual":   # an add's gradient passes the cotangent on: no op of its own
      assert any(f"models/{p}/" in n and "transpose(" in n for n in names), f"{p} backward"
  assert any(hlo_parts.phase(n) == "remat" for n in names)
  rows = {r["part"]: r for r in hlo_parts.by_part(cost)}
  assert set(TRAINED_PARTS) - {"attention_core"} <= set(rows)   # the chunked attention: GEMMs + other
  total = sum(r["ms"] for r in rows.values())
  assert total == pytest.approx(cost["seconds"] * 1e3)
  assert sum(r["ms"] for k, r in rows.items() if k in ("unscoped", "", "copy:?")) < 0.1 * total
  cols = hlo_parts.columns(cost)
  assert sum(cols.values()) == pytest.approx(total)
  assert cols["linear_gemm"] > 0 and cols["other_gemm"] > 0 and cols["ssd"] > 0 and cols["quantize"] == 0


def test_part_phase_and_columns_read_the_op_name():
  pre = "jit(train_step)/forward_backward/"
  assert hlo_parts.part(pre + "jvp(LanguageModel)/blocks_0/mixer/models/mamba2_gate_norm/mul") == "mamba2_gate_norm"
  assert hlo_parts.part(pre + "jvp(LanguageModel)/blocks_0/mixer/models/linear/in_proj/jvp(fp4jax/dot)/fprop/"
                       "fp4jax/quantize/nvfp4_1x16/abs") == "fprop/quantize"
  assert hlo_parts.part(pre + "jvp(LanguageModel)/blocks_0/mixer/models/linear/in_proj/jvp(fp4jax/dot)/fprop/"
                       "transpose") == "fprop/other"
  assert hlo_parts.part("jit(train_step)/optimizer/mul") == "optimizer"
  assert hlo_parts.part(pre + "jvp(LanguageModel)/blocks_0/add") == "unscoped"
  assert hlo_parts.part("") == ""
  remat = pre + "transpose(jvp(LanguageModel))/blocks_0/checkpoint/rematted_computation/models/rmsnorm/mul"
  assert hlo_parts.phase(remat) == "remat"
  assert hlo_parts.phase(pre + "transpose(jvp(LanguageModel))/blocks_0/models/rmsnorm/mul") == "bwd"
  assert hlo_parts.phase(pre + "jvp(LanguageModel)/blocks_0/models/rmsnorm/mul") == "fwd"

  def op(op_name, kind="fusion", ms=1.0, origin=""):
    return dict(op_name=op_name, kind=kind, seconds=ms * 1e-3, bytes=2 ** 30, count=1, origin=origin)
  cost = dict(ops=[
      op(pre + "jvp(M)/b/models/linear/up/dot_general", "gemm", 10),
      op(pre + "jvp(M)/b/models/linear/up/jvp(fp4jax/dot)/fprop/fp4jax/quantize/x/abs", ms=2),
      op(pre + "jvp(M)/b/models/linear/up/jvp(fp4jax/dot)/fprop/fp4jax/dequantize/x/mul", ms=3),
      op(pre + "jvp(M)/models/cross_entropy/dot_general", "gemm", 4),
      op(pre + "jvp(M)/b/models/attention_core/fmha", "attention", 5),
      op(pre + "jvp(M)/b/models/mamba2_ssd/custom-call", "kernel", 6),
      op(pre + "transpose(jvp(M))/b/models/mamba2_gate_norm/mul", ms=7),
      op("", "copy", 8, origin=pre + "jvp(M)/b/models/mamba2_gate_norm/mul")])
  assert hlo_parts.columns(cost) == pytest.approx(dict(linear_gemm=10, other_gemm=4, attention=5, ssd=6,
                                                      quantize=2, other=18))
  rows = {r["part"]: r for r in hlo_parts.by_part(cost)}
  assert rows["mamba2_gate_norm"]["bwd"] == pytest.approx(7) and rows["mamba2_gate_norm"]["fwd"] == 0
  assert rows["copy:mamba2_gate_norm"]["fwd"] == pytest.approx(8)
  assert rows["linear"]["gemm_ms"] == pytest.approx(10) and rows["cross_entropy"]["gemm_ms"] == pytest.approx(4)
  assert rows["fprop/quantize"]["ms"] == pytest.approx(2)
