"""Expert parallelism (models.expert_parallel) on 8 simulated CPU devices, in a subprocess
(XLA_FLAGS=--xla_force_host_platform_device_count=8), against 1 device.

1. The exchange: ``dense_ragged_all_to_all`` (the CPU twin; XLA:CPU has no ragged all-to-all) gives the
   result of ``jax.lax.ragged_all_to_all``'s documented example, and moves random ragged slices as the
   definition says (checked against a numpy loop over senders and slices).
2. The routed experts (dispatch, two grouped GEMMs, combine), EP=8 (mesh expert 8) and EP x data (data 2 x
   expert 4), nvfp4 and bf16, unbalanced routing: each pair's expert output y and the gradient of the tokens
   dh equal 1 device bit for bit (each expert's rows, order, padding and key are those of one device, so the
   per-expert dot is the same; the combine sums in the same order). The weights' gradient dw[e] is the same
   float32 sum over expert e's rows in another order: XLA:CPU's grouped wgrad blocks the token sum by the
   segment's place in the row buffer (measured: padding the 1-device buffer to the EP size removes part of
   the differences, the rest follows the segment offsets), so dw is compared within ``DW_RTOL`` of its
   largest element (measured, jax 0.10.2: at most 3.4e-7 in nvfp4, 2.8e-7 in bf16). Under EP x data each data
   replica is its own set of tokens (its experts' rows quantized with their own amax), so the reference is
   the 1-device function on each replica's tokens, dw summed over the two.
3. The whole MoE block (router, latent projections, shared expert; as ``blocks_0/mixer``, where the policy
   quantizes it), EP=8 vs 1 device: every output and gradient within ``BLOCK_RTOL`` of its largest element.
   The differences are float32 sums over the tokens (the dense layers' wgrads, and in bf16 their forward),
   which change with the batch split whether or not the experts are split (measured: the same counts and
   sizes with mesh data 8 and no EP). Measured, jax 0.10.2: nvfp4 y bit-exact, the gradients at most 3.3e-7
   of their largest element (the router's); bf16 at most 6.1e-7 (the shared expert's up).
4. A moe_tiny train step (2 steps, nvfp4) on mesh expert 8 gives the 1-device train losses within
   ``LOSS_RTOL`` (measured: step 1's loss, a forward pass of the initial params, bit-exact; step 2's 8.6e-8),
   and the validation loss after the two updates within ``VALIDATION_RTOL`` (measured 3.0e-4, not analysed
   further: the updated params differ by float32 ulps, from the gradients above, which FP4 rounding of the
   next forward can amplify; measured 4.85e-5 for tetrajet2 on the dense toy without EP).

Recorded values: none; every comparison is between two runs on this machine.

Axis legend: T tokens, R choices per token, E experts, Q expert width.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import shrunken
from training import sharding
from training.errors import ConfigError
from models import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 1500
DW_RTOL = 2e-6      # measured 3.4e-7 (nvfp4) and 2.8e-7 (bf16) of max|dw|: float32 summation order only
BLOCK_RTOL = 1e-5   # measured at most 6.1e-7 of the largest element, the same with EP off (data 8)
LOSS_RTOL = 1e-5    # the 2 train losses: measured 0 and 8.6e-8
VALIDATION_RTOL = 2e-3   # the validation loss after 2 updates: measured 3.0e-4

_DRIVER = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
import flax.linen as nn
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax import grouped, recipes
from models import ModelConfig, expert_parallel, moe
from training import sharding

out = {{"devices": jax.device_count()}}

def compare(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return {{"differ": int((a != b).sum()), "size": int(a.size), "max_abs": float(np.abs(a - b).max()),
           "max_ref": float(np.abs(a).max())}}

def make_mesh(shape):
  return jax.make_mesh(shape, sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)

# 1. The exchange.
mesh2 = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
example = dict(operand=[[1, 2, 2, 0], [3, 4, 0, 0]], output=[[0] * 4] * 2, input_offsets=[[0, 1], [0, 1]],
               send_sizes=[[1, 2], [1, 1]], output_offsets=[[0, 0], [1, 2]], recv_sizes=[[1, 1], [2, 1]])
args = [jnp.asarray(example[k], jnp.int32).reshape(-1) for k in ("operand", "output", "input_offsets", "send_sizes",
                                                               "output_offsets", "recv_sizes")]
f = jax.shard_map(lambda *a: expert_parallel.dense_ragged_all_to_all(*a, axis_name="x", capacity=4),
                  mesh=mesh2, in_specs=(P("x"),) * 6, out_specs=P("x"))
out["example"] = np.asarray(jax.jit(f)(*[jax.device_put(a, NamedSharding(mesh2, P("x"))) for a in args])).tolist()

p, k, rows, cap = 8, 2, 64, 24
rng = np.random.default_rng(0)
send = rng.integers(0, 4, (p, p * k))
recv = np.stack([send[:, j * k:(j + 1) * k].reshape(-1) for j in range(p)])   # recv[j][i*k+s] = send[i][j*k+s]
in_off = np.stack([rng.permutation(rows // 4)[:p * k] * 4 for _ in range(p)])   # disjoint slices of 4 rows
out_off = np.zeros((p, p * k), np.int64)
for j in range(p):   # receiver j: the slices from sender i, slice s at a random free place
  starts = rng.permutation(rows // 4)[:p * k] * 4
  for i in range(p):
    out_off[i, j * k:(j + 1) * k] = starts[i * k:(i + 1) * k]
operand = rng.standard_normal((p, rows, 3)).astype(np.float32)
want = np.full((p, rows, 3), -1.0, np.float32)
for i in range(p):
  for n in range(p * k):
    j = n // k
    want[j, out_off[i, n]:out_off[i, n] + send[i, n]] = operand[i, in_off[i, n]:in_off[i, n] + send[i, n]]
mesh8 = jax.make_mesh((p,), ("x",))
f = jax.shard_map(lambda o, out, a, b, c, d: expert_parallel.dense_ragged_all_to_all(
    o[0], out[0], a[0], b[0], c[0], d[0], axis_name="x", capacity=cap)[None], mesh=mesh8, in_specs=(P("x"),) * 6,
    out_specs=P("x"))
put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh8, P("x")))
got = jax.jit(f)(put(operand), put(np.full_like(operand, -1.0)), *[put(a.astype(np.int32))
                                                                 for a in (in_off, send, out_off, recv)])
out["random_exchange"] = compare(want, got)

# 2. The routed experts.
E, R, T, Q, F = 8, 2, 256, 64, 64
kh, ke, ku, kd, kc = jax.random.split(jax.random.key(0), 5)
h = jax.random.normal(kh, (T, Q)) * jnp.exp2(jnp.arange(T)[:, None] % 5 - 2.0)
logits = jax.random.normal(ke, (T, E)) + jnp.linspace(0.0, 2.0, E)   # unbalanced: 18 to 146 pairs per expert
experts = jax.lax.top_k(logits, R)[1].astype(jnp.int32)
w_up = jax.random.normal(ku, (E, Q, F)) * 0.1
w_down = jax.random.normal(kd, (E, F, Q)) * 0.1
ct = jax.random.normal(kc, (T, R, Q))

for name in {recipes!r}:
  recipe = recipes.get(name)
  align = grouped.alignment(recipe)
  keys = jax.random.split(jax.random.key(7)) if recipe.needs_key else (None, None)
  gemms = lambda w_up, w_down: (moe.ExpertGemm(w_up, keys[0], recipe, jnp.float32),
                                moe.ExpertGemm(w_down, keys[1], recipe, jnp.float32))

  def one_device(h, w_up, w_down, experts):
    rows, position, sizes, _ = moe.dispatch(experts, E, align)
    h_S = jnp.concatenate([h, jnp.zeros((1, Q), h.dtype)])[rows]
    return moe.mlp(h_S, sizes, gemms(w_up, w_down))[position]

  def split(h, w_up, w_down, experts):
    where = expert_parallel.layout(E, h.shape[0])
    g = tuple(x.per_expert_keys() for x in gemms(w_up, w_down))
    specs = jax.tree.map(lambda a: expert_parallel.expert_spec(where, a.ndim), g)
    return expert_parallel.routed(h, experts, g, specs, experts_fn=moe.mlp, n_experts=E, align=align, where=where)

  def with_grads(f, replicas=1):
    def g(h, w_up, w_down, ct):
      parts = []
      for r in range(replicas):   # each data replica's tokens apart (replicas > 1: the EP x data reference)
        rows = slice(r * T // replicas, (r + 1) * T // replicas)
        y, vjp = jax.vjp(lambda h, u, d: f(h, u, d, experts[rows]), h[rows], w_up, w_down)
        parts.append((y,) + vjp(ct[rows]))
      cat = lambda i: jnp.concatenate([q[i] for q in parts])
      return cat(0), cat(1), sum(q[2] for q in parts), sum(q[3] for q in parts)
    return g

  for mesh_name, shape, replicas in (("ep8", (1, 1, 8, 1), 1), ("data2_ep4", (2, 1, 4, 1), 2)):
    ref = jax.jit(with_grads(one_device, replicas))(h, w_up, w_down, ct)
    mesh = make_mesh(shape)
    with sharding.mesh_context(mesh):
      bs, es = NamedSharding(mesh, P(sharding.BATCH_AXES)), NamedSharding(mesh, P("expert"))
      fn = jax.jit(lambda h, u, d, ct: with_grads(split)(h, u, d, ct))
      args = (jax.device_put(h, bs), jax.device_put(w_up, es), jax.device_put(w_down, es), jax.device_put(ct, bs))
      got = fn(*args)
      hlo = fn.lower(*args).compile().as_text()
    out[f"experts/{{name}}/{{mesh_name}}"] = {{n: compare(a, b) for n, a, b in
                                              zip(("y", "dh", "dw_up", "dw_down"), ref, got)}}
    out[f"experts/{{name}}/{{mesh_name}}"]["all_to_all_ops"] = hlo.count(" all-to-all(")

# 3. The whole block.
cfg = ModelConfig(vocab_size=32, d_model=64, pattern="E", dtype=jnp.float32, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=32,
                  moe_latent_size=32)
x = jax.random.normal(jax.random.key(0), (8, 32, 64))
cx = jax.random.normal(jax.random.key(2), x.shape)
class Holder(nn.Module):
  recipe: str
  @nn.compact
  def __call__(self, x):
    return moe.MoE(cfg, self.recipe, name="mixer")(x)

class Block(nn.Module):   # the MoE as the mixer of blocks_0, where the precision policy quantizes it
  recipe: str
  @nn.compact
  def __call__(self, x):
    return Holder(self.recipe, name="blocks_0")(x)

for name in {recipes!r}:
  block = Block(name)
  params = nn.unbox(block.init({{"params": jax.random.key(1)}}, x))
  def f(params, x):
    def loss(params, x):
      y = block.apply(params, x, rngs={{"fp4": jax.random.key(3)}})
      return jnp.sum(y * cx), y
    return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)[::-1]
  ref = jax.jit(f)(params, x)
  # bf16 on fsdp 2 x expert 4 (the stored experts gathered over fsdp along E; with nothing quantized the
  # two expert groups' sum is the one device's), nvfp4 on expert 8 (with fsdp 2 each group would quantize
  # its own tokens of an expert: the EP x data reference of the routed-experts test above)
  mesh = make_mesh((1, 2, 4, 1) if name == "bf16" else (1, 1, 8, 1))
  with sharding.mesh_context(mesh):
    abstract = jax.eval_shape(lambda: block.init({{"params": jax.random.key(1)}}, x))
  shardings = sharding.logical_shardings(abstract, mesh)
  with sharding.mesh_context(mesh):
    got = jax.jit(f)(jax.device_put(params, shardings), jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES))))
  flat = lambda t: traverse_util.flatten_dict(t, sep="/")
  res = {{"y": compare(ref[0], got[0]), "dx": compare(ref[1][1], got[1][1])}}
  res.update({{k: compare(v, flat(got[1][0])[k]) for k, v in flat(ref[1][0]).items()}})
  res["expert_kernel_spec"] = str(shardings["params"]["blocks_0"]["mixer"]["experts"]["up"]["kernel"].spec)
  out[f"block/{{name}}"] = res
print("RESULT " + json.dumps(out))
"""

_TRAIN_DRIVER = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax
from configs import moe_tiny
from training import trainer
c = moe_tiny.get_config()
c.steps, c.batch_size, c.data.seq_len, c.log_every = 2, 8, 64, 1
c.optim.warmup_steps, c.eval.every_steps, c.eval.batches, c.checkpoint.every_steps = 1, 2, 1, 2
c.mesh.data, c.mesh.expert = {data}, {expert}
summary = trainer.train_and_evaluate(c, {workdir!r})
print("RESULT " + json.dumps(dict(summary, devices=jax.device_count())))
"""


def _run(code, devices=8):
  env = dict(os.environ, **shrunken.compilation_cache_env(),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=TIMEOUT_S)
  assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-5000:]
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


# One subprocess per recipe (each compiles 5 sharded programs): bf16's is slow, nvfp4's runs by default.
@pytest.fixture(scope="module")
def nvfp4_result():
  return _run(_DRIVER.format(root=ROOT, recipes=("nvfp4",)))


@pytest.fixture(scope="module")
def bf16_result():
  return _run(_DRIVER.format(root=ROOT, recipes=("bf16",)))


# Each recipe's fixture is one subprocess compiling 9 sharded programs (~65 s idle for nvfp4): slow. By default
# the expert axis checks below and tests/test_moe_ep_trace.py (the sharded traces) run.
RECIPES = [pytest.param("nvfp4", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)]


@pytest.mark.slow
def test_dense_twin_is_ragged_all_to_all(nvfp4_result):
  result = nvfp4_result
  assert result["devices"] == 8
  assert result["example"] == [1, 3, 0, 0, 2, 2, 4, 0]   # jax.lax.ragged_all_to_all's docstring example
  assert result["random_exchange"]["differ"] == 0, result["random_exchange"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mesh", ["ep8", "data2_ep4"])
def test_routed_experts_equal_one_device(request, recipe, mesh):
  r = request.getfixturevalue(f"{recipe}_result")[f"experts/{recipe}/{mesh}"]
  print(recipe, mesh, json.dumps(r))
  assert r["all_to_all_ops"] >= 4, r   # dispatch and combine, forward and backward
  for name in ("y", "dh"):
    assert r[name]["differ"] == 0, (name, r[name])
  for name in ("dw_up", "dw_down"):
    assert r[name]["max_abs"] <= DW_RTOL * r[name]["max_ref"], (name, r[name])


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_block_equals_one_device(request, recipe):
  r = request.getfixturevalue(f"{recipe}_result")[f"block/{recipe}"]
  print(recipe, json.dumps(r))
  # the stored experts over (expert, fsdp) on their leading axis, the latent width whole (training.sharding;
  # a mesh axis of size 1 is left out of the spec)
  want = "P(('expert', 'fsdp'), None, 'tensor')" if recipe == "bf16" else "P('expert', None, 'tensor')"
  assert r.pop("expert_kernel_spec") == want
  for name, c in r.items():
    assert c["max_abs"] <= BLOCK_RTOL * c["max_ref"], (name, c)


@pytest.mark.slow   # ~4.5 min: two moe_tiny train runs; the block-level equalities above run by default
def test_moe_tiny_train_step_equals_one_device(tmp_path):
  one = _run(_TRAIN_DRIVER.format(root=ROOT, data=1, expert=1, workdir=str(tmp_path / "one")), devices=1)
  ep = _run(_TRAIN_DRIVER.format(root=ROOT, data=1, expert=8, workdir=str(tmp_path / "ep8")))
  assert ep["devices"] == 8
  losses = lambda d: [json.loads(l)["last_loss"] for l in open(os.path.join(d, "metrics.jsonl"), encoding="utf-8")
                      if json.loads(l)["kind"] == "train"]
  a, b = np.asarray(losses(tmp_path / "one")), np.asarray(losses(tmp_path / "ep8"))
  print("train losses", a.tolist(), b.tolist(), "summaries", one, ep)
  assert a.shape == b.shape == (2,)
  np.testing.assert_allclose(b, a, rtol=LOSS_RTOL)
  np.testing.assert_allclose(ep["validation_loss"], one["validation_loss"], rtol=VALIDATION_RTOL)


def test_expert_axis_is_checked():
  moe = ModelConfig(pattern="E", n_routed_experts=8)
  sharding.check_experts({"expert": 4}, moe)
  with pytest.raises(ConfigError, match=r"does not divide n_routed_experts=8.*\[1, 2, 4, 8\]"):
    sharding.check_experts({"expert": 3}, moe)
  with pytest.raises(ConfigError, match="no MoE"):
    sharding.check_experts({"expert": 2}, ModelConfig(pattern="M-"))
  assert sharding.mesh_shape({"data": -1, "expert": 4}, 8) == (2, 1, 4, 1)


# ---------------------------------------------------------------------------------------------------
# The receive factor (ModelConfig.moe_receive_factor): a receive buffer of f x the average traffic
# ---------------------------------------------------------------------------------------------------

_DROP_DRIVER = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax import grouped, recipes
from models import expert_parallel, moe
from training import sharding

E, R, T, Q, F = 16, 3, 256, 64, 64   # 8 devices of 2 experts; 32 tokens and 96 pairs per device
kh, ke, ku, kd, kc = jax.random.split(jax.random.key(0), 5)
h = jax.random.normal(kh, (T, Q))
logits = jax.random.normal(ke, (T, E)) + jnp.linspace(0.0, 3.0, E)   # unbalanced: the last devices overloaded
experts = jax.lax.top_k(logits, R)[1].astype(jnp.int32)
w_up = jax.random.normal(ku, (E, Q, F)) * 0.1
w_down = jax.random.normal(kd, (E, F, Q)) * 0.1
ct = jax.random.normal(kc, (T, R, Q))
mesh = jax.make_mesh((1, 1, 8, 1), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)

def run(name, factor):
  recipe = recipes.get(name)
  align = grouped.alignment(recipe)
  keys = jax.random.split(jax.random.key(7)) if recipe.needs_key else (None, None)
  def split(h, u, d):
    g = (moe.ExpertGemm(u, keys[0], recipe, jnp.float32), moe.ExpertGemm(d, keys[1], recipe, jnp.float32))
    where = expert_parallel.layout(E, h.shape[0])
    g = tuple(x.per_expert_keys() for x in g)
    specs = jax.tree.map(lambda a: expert_parallel.expert_spec(where, a.ndim), g)
    return expert_parallel.routed_dropping(h, experts, g, specs, experts_fn=moe.mlp, n_experts=E, align=align,
                                           where=where, receive_factor=factor)
  def f(h, u, d, ct):
    (y, dropped), vjp = jax.vjp(split, h, u, d)
    return (y, dropped, *vjp((ct, np.zeros((), jax.dtypes.float0))))
  with sharding.mesh_context(mesh):
    bs, es = NamedSharding(mesh, P(sharding.BATCH_AXES)), NamedSharding(mesh, P("expert"))
    args = (jax.device_put(h, bs), jax.device_put(w_up, es), jax.device_put(w_down, es), jax.device_put(ct, bs))
    return [np.asarray(a) for a in jax.jit(f)(*args)]

out = {{"experts": np.asarray(experts).tolist()}}
for name, factor in {cases!r}:
  got = run(name, factor)
  out[f"{{name}}/{{factor}}"] = {{"y": got[0].tolist(), "dropped": int(got[1]), "dh": got[2].tolist(),
                                "dw_up": got[3].tolist(), "dw_down": got[4].tolist()}}
np.savez({path!r}, h=np.asarray(h), w_up=np.asarray(w_up), w_down=np.asarray(w_down), ct=np.asarray(ct))
print("RESULT " + json.dumps(out))
"""
DROP_T, DROP_E, DROP_P = 256, 16, 8


def _kept_by_rule(experts_TxR, factor):
  """The pairs each receiver keeps (expert_parallel's order: ranks, then sources, then tokens), in numpy."""
  t, r = experts_TxR.shape
  per_source, local = t // DROP_P, DROP_E // DROP_P
  limit = int(np.ceil(factor * per_source * r))
  kept = np.zeros((t, r), bool)
  taken = np.zeros(DROP_P, int)
  for rank in range(r):
    for source in range(DROP_P):
      for tok in range(source * per_source, (source + 1) * per_source):
        to = experts_TxR[tok, rank] // local
        if taken[to] < limit:
          kept[tok, rank] = True
          taken[to] += 1
  return kept


def _drop_run(tmp_path, cases):
  path = str(tmp_path / "inputs.npz")
  return _run(_DROP_DRIVER.format(root=ROOT, cases=cases, path=path)), np.load(path)


@pytest.mark.slow   # covered by test_moe.py::test_dropped_pairs_are_a_metric_and_a_log_line
def test_receive_factor_drops_by_rank_and_the_dropped_add_nothing(tmp_path):
  """factor 1.25 (a budget of 120 of a device's 96-pair average; the skewed routing sends some devices
  more): the drop count and the dropped pairs are those of the rule (numpy), a dropped pair's output is
  exactly zero, and y and the gradients equal the per-pair MLP of the kept pairs only (float32 dots: within
  float32 summation error of their largest element)."""
  r, inputs = _drop_run(tmp_path, (("bf16", 1.25),))
  experts_TxR = np.asarray(r["experts"])
  kept = _kept_by_rule(experts_TxR, 1.25)
  got = r["bf16/1.25"]
  assert got["dropped"] == int((~kept).sum()) > 0, (got["dropped"], int((~kept).sum()))
  y = np.asarray(got["y"], np.float32)
  assert not y[~kept].any()                                    # dropped: exactly zero
  assert (np.abs(y[kept]).max(axis=-1) > 0).all()

  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  hi = jax.lax.Precision.HIGHEST

  def reference(h, u, d):   # each kept pair's expert MLP, the dropped pairs zero
    up = jnp.einsum("tq,tqf->tf", jnp.repeat(h, 3, axis=0), u[experts_TxR.reshape(-1)], precision=hi)
    y = jnp.einsum("tf,tfq->tq", jnp.square(jax.nn.relu(up)), d[experts_TxR.reshape(-1)], precision=hi)
    return jnp.where(jnp.asarray(kept.reshape(-1, 1)), y, 0.0).reshape(kept.shape + (-1,))
  want, vjp = jax.vjp(reference, *(jnp.asarray(inputs[k]) for k in ("h", "w_up", "w_down")))
  want = (want, *vjp(jnp.asarray(inputs["ct"])))
  for name, w in zip(("y", "dh", "dw_up", "dw_down"), want):
    g, w = np.asarray(got[name], np.float32), np.asarray(w)
    assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, np.abs(g - w).max(), np.abs(w).max())


@pytest.mark.slow   # ~100 s: two nvfp4 programs of forward and backward on 8 devices
def test_receive_factor_large_enough_equals_dropless(tmp_path):
  """factor 4 (a budget of 384 pairs per device: more than any device receives, less than the worst case
  of 768): nothing dropped, and y, dh equal the dropless exchange bit for bit (each expert's rows, order,
  padding and key are unchanged; only the buffer is shorter), dw within DW_RTOL (the grouped wgrad's
  float32 sum blocks by the segment's place in the buffer, as above)."""
  r, _ = _drop_run(tmp_path, (("nvfp4", None), ("nvfp4", 4.0)))
  ref, got = r["nvfp4/None"], r["nvfp4/4.0"]
  assert ref["dropped"] == got["dropped"] == 0
  for name in ("y", "dh"):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ref[name]), err_msg=name)
  for name in ("dw_up", "dw_down"):
    g, w = np.asarray(got[name]), np.asarray(ref[name])
    assert np.abs(g - w).max() <= DW_RTOL * np.abs(w).max(), name
