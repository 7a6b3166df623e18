"""What the train step's weight gathers move: never a float32 master weight that the model computes in a
narrower type (the cast runs on each device's shard, before the gather: ``models.axes.as_param``), and for a
weight the recipe quantizes, its FP4 codes and E4M3 scales rather than the weight (the dense layers' quantize
runs on the shard, ``fp4jax.primitives.sharding``; the experts' through ``fp4jax.grouped.quantize_experts``).

A subprocess on 8 simulated CPU devices (fsdp 4 x expert 2, Super's layout in small) compiles the trainer's step
(bench/scale.py's ``build_step``) of a shrunken moe_tiny whose two E blocks are scanned and rematerialized
(``scan_blocks``, remat "full": the program shape in which the experts' cast used to follow their gather), and
reads its HLO right after SPMD partitioning: the program's own dtypes. (The CPU compiler then widens every bf16
and FP8 collective to f32/f16 (``float-normalization-bf16``), a CPU artifact a GPU does not have: the optimized
CPU HLO cannot tell the program's wire types; docs/PERF.md, "The 12B on a simulated CPU mesh".)

A weight's gather is recognized by its shape: a GEMM weight's per-layer shape (K, N) or (N, K), or an expert
kernel's (E, K, N) with E whole or split over the expert axis; the model's dimensions are chosen so that no
activation or other parameter of the step has such a shape. The router's kernel (float32 by definition) and
vectors (norm scales, float32) are not GEMM weights.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from configs import shrunken

# Slow (one 8-device NVFP4 step compiled, ~45 s): by default the weights' gathers are read from compiled steps in
# tests/test_mesh_nodes.py (test_weights_gathered_per_step_cross_the_nodes_once_per_step).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERT = 2
# Two E blocks of 8 experts (4 per expert rank), latent 32, expert width 48: every weight shape is distinct
# from the step's activations (32 tokens per device, 256 in all).
MODEL = dict(d_model=64, pattern="EE", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, d_state=8,
             ssm_head_dim=16, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
             moe_shared_expert_intermediate_size=80, moe_latent_size=32, n_group=2, topk_group=2,
             bf16_first_blocks=0, bf16_last_blocks=0, dtype="bfloat16", scan_blocks=True, remat="full")

_SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    sys.path.insert(0, {root!r})
    import jax
    from flax import traverse_util
    from bench import scale
    from bench.predict import hlo_text
    from configs import shrunken
    from models import policy
    from training import sharding

    c = shrunken.shrunken_config(steps=2, recipe={recipe!r}, **{{"data.seq_len": 32, "batch_size": 8,
        "mesh.data": 1, "mesh.fsdp": 4, "mesh.expert": {expert}, "mesh.tensor": 1}})
    c.model.preset = "moe_tiny"
    for k, v in {model!r}.items():
      c.model[k] = v
    mesh = sharding.make_mesh(c.mesh)
    built = scale.build_step(c, mesh, 1)
    with sharding.mesh_context(mesh):
      built["step_fn"].lower(built["state_in"], built["batch_in"]).compile()
    dump = {dump!r}
    name = sorted(n for n in os.listdir(dump) if "train_step" in n and "after_spmd-partitioning" in n)[-1]
    comps, _ = hlo_text.parse_module(open(os.path.join(dump, name), encoding="utf-8").read())
    gathers = [[dtype, list(dims), ins.op_name] for body in comps.values() for ins in body
               if hlo_text.collective(ins) == "all-gather" for dtype, dims in hlo_text.arrays(ins.shape)]
    weights = []
    for path, leaf in traverse_util.flatten_dict(built["abstract"]["params"]).items():
      if path[-1] in ("kernel", "embedding") and "router" not in path:
        expert = "experts" in path
        shape = list(leaf.shape[-3:] if expert else leaf.shape[-2:])
        weights.append(["/".join(path), shape, expert,
                        policy.layer_precision(built["model_config"], built["recipe"], path[:-1])])
    print("RESULT " + json.dumps(dict(gathers=gathers, weights=weights, devices=jax.device_count())))
""")


def compile_gathers(tmp_path, recipe: str) -> dict:
  """``{gathers: [[dtype, shape, op_name]], weights: [[path, per-layer shape, is_expert, precision]]}`` of the
  step compiled for ``recipe`` (the module docstring)."""
  dump = str(tmp_path / "dump")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} "
                        "--xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=.*train_step.* "
                        + shrunken.READ_ONLY_COMPILE_XLA_FLAGS))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # a cached program is not compiled, and dumps nothing
  code = _SCRIPT.format(root=ROOT, recipe=recipe, expert=EXPERT, model=MODEL, dump=dump)
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
  out = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
  assert out["devices"] == 8
  return out


def weight_forms(shape, expert: bool) -> set[tuple[int, ...]]:
  """The shapes a gather of a weight of per-layer ``shape`` can have (leading 1s stripped)."""
  if expert:
    e, k, n = shape
    return {(e, k, n), (e // EXPERT, k, n)}
  k, n = shape
  return {(k, n), (n, k)}


def _strip(dims) -> tuple[int, ...]:
  dims = list(dims)
  while len(dims) > 1 and dims[0] == 1:
    dims.pop(0)
  return tuple(dims)


def weight_gathers(out) -> list[tuple[str, str, str]]:
  """(weight path, gathered dtype, op_name) of every all-gather whose shape is a weight's."""
  forms = {}
  for path, shape, expert, _ in out["weights"]:
    for form in weight_forms(shape, expert):
      forms.setdefault(form, path)
  return [(forms[_strip(dims)], dtype, op) for dtype, dims, op in out["gathers"] if _strip(dims) in forms]


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
  return compile_gathers(tmp_path_factory.mktemp("nvfp4"), "nvfp4")


def test_no_float32_weight_is_gathered(nvfp4):
  """Every weight the step gathers crosses the wire in its compute dtype (or as codes), none as its float32
  master copy: on today's main the scanned E blocks gathered the experts' float32 kernels and cast them after."""
  found = weight_gathers(nvfp4)
  assert any("experts" in path for path, _, _ in found) or expert_codes_gathered(nvfp4), "no expert gather found"
  wide = [g for g in found if g[1] == "f32"]
  assert not wide, f"float32 weight gathers: {wide}"


def test_quantized_weights_cross_the_wire_as_codes(nvfp4):
  """Every weight in NVFP4 (here all of them: the experts, the shared expert, the latent projections) is gathered
  as uint8 codes and float8_e4m3fn scales only: no gather of one of them in bf16 or f32. On today's main the
  experts were gathered in bf16 (or f32) and quantized after the gather, on every device, in full."""
  quantized = {path for path, _, _, precision in nvfp4["weights"] if precision == "nvfp4"}
  assert any("experts" in p for p in quantized) and any("experts" not in p for p in quantized), quantized
  wide = [g for g in weight_gathers(nvfp4) if g[0] in quantized]
  assert not wide, f"quantized weights gathered unquantized: {wide}"
  assert expert_codes_gathered(nvfp4)


def expert_codes_gathered(out) -> bool:
  """Whether every expert kernel's codes are gathered: (E / expert, K, N / 2) uint8 (tiles packed along N)."""
  codes = {_strip(dims) for dtype, dims, _ in out["gathers"] if dtype == "u8"}
  return all((shape[0] // EXPERT, shape[1], shape[2] // 2) in codes
             for _, shape, expert, _ in out["weights"] if expert)
