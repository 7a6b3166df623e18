"""fp4jax.flax: linen Fp4DotGeneral and NNX Fp4DotGeneralNNX inside ordinary Flax layers."""
import functools
import os
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import inputs
import fp4jax
import fp4jax.flax
from fp4jax import recipes
from fp4jax.flax import Fp4DotGeneral, Fp4DotGeneralNNX, dot_general_cls

D_IN, D_OUT, N = 32, 8, 128


def _regression():
  kx, kw = jax.random.split(jax.random.key(0))
  x = inputs.normal(kx, (N, D_IN))
  return x, x @ inputs.normal(kw, (D_IN, D_OUT))


def test_linen_dense_trains():
  x, y = _regression()
  model = nn.Dense(D_OUT, dot_general_cls=dot_general_cls("nvfp4"))
  params = jax.jit(model.init)(jax.random.key(1), x)   # init needs no 'fp4' rng
  opt = optax.adam(3e-2)

  @jax.jit
  def step(params, opt_state, key):
    loss_fn = lambda p: jnp.mean((model.apply(p, x, rngs={"fp4": key}) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = opt.init(params), []
  for i in range(60):
    params, opt_state, loss = step(params, opt_state, jax.random.key(i))
    losses.append(float(loss))
  assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_linen_dense_general_is_fp4jax_dot_general():
  """DenseGeneral with two contracting axes and a batch axis calls dot_general with them."""
  x = inputs.normal(jax.random.key(0), (3, 10, 4, 8))
  model = nn.DenseGeneral((5, 2), axis=(-2, -1), batch_dims=(0,), use_bias=False,
                          dot_general_cls=functools.partial(Fp4DotGeneral, recipe="nvfp4"))
  params = jax.jit(model.init)(jax.random.key(1), x)
  kernel = params["params"]["kernel"]                  # (3, 4, 8, 5, 2)
  y = jax.jit(model.apply)(params, x)
  dims = (((2, 3), (1, 2)), ((0,), (0,)))
  np.testing.assert_array_equal(y, jax.jit(functools.partial(fp4jax.dot_general, dimension_numbers=dims,
                                                             recipe="nvfp4"))(x, kernel))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x, rngs={"fp4": jax.random.key(2)}) ** 2)))(params)
  assert grads["params"]["kernel"].shape == kernel.shape


def test_linen_rng_stream():
  x = jnp.ones((16, D_IN))
  model = nn.Dense(D_OUT, dot_general_cls=dot_general_cls("nvfp4"))
  params = jax.jit(model.init)(jax.random.key(1), x)
  jax.jit(model.apply)(params, x)                      # evaluation needs no random bits
  with pytest.raises(ValueError, match=r"rngs=\{'fp4': key\}"):
    jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x))))(params)
  # Without stochastic rounding no stream is needed at all.
  plain = nn.Dense(D_OUT, dot_general_cls=dot_general_cls(recipes.nvfp4(stochastic_grad=False)))
  jax.jit(jax.grad(lambda p: jnp.sum(plain.apply(p, x))))(params)

  class TwoSites(nn.Module):
    @nn.compact
    def __call__(self):
      r = recipes.nvfp4()
      return Fp4DotGeneral(r)._key(r), Fp4DotGeneral(r)._key(r)

  data = lambda k: jax.random.key_data(k)
  a, b = TwoSites().apply({}, rngs={"fp4": jax.random.key(0)})
  c, _ = TwoSites().apply({}, rngs={"fp4": jax.random.key(1)})
  assert not np.array_equal(data(a), data(b))          # different call sites, different bits
  assert not np.array_equal(data(a), data(c))          # different steps, different bits
  with pytest.raises(ValueError, match="unknown recipe"):
    nn.Dense(D_OUT, dot_general_cls=functools.partial(Fp4DotGeneral, recipe="fp3")).init(jax.random.key(0), x)


@pytest.mark.slow   # a Linen scan over remat blocks: test_models_lm.py's test_scan_matches_the_unrolled_model
def test_linen_scan_over_remat_layers():
  layers = 3

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      dense = nn.Dense(D_IN, use_bias=False, dot_general_cls=dot_general_cls("nvfp4"),
                       kernel_init=nn.initializers.normal(D_IN ** -0.5))
      return jnp.tanh(dense(h)), None

  stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True, "fp4": True},
                  length=layers)
  x = inputs.normal(jax.random.key(0), (4, 16, D_IN))
  params = jax.jit(stack().init)(jax.random.key(1), x, None)
  assert params["params"]["Dense_0"]["kernel"].shape == (layers, D_IN, D_IN)
  loss = lambda p, key: jnp.mean(stack().apply(p, x, None, rngs={"fp4": key})[0] ** 2)
  grad = jax.jit(jax.grad(loss))
  g1 = grad(params, jax.random.key(2))["params"]["Dense_0"]["kernel"]
  g2 = grad(params, jax.random.key(3))["params"]["Dense_0"]["kernel"]
  assert np.all(np.isfinite(g1)) and not np.array_equal(g1, g2)


def test_nnx_linear_trains():
  x, y = _regression()
  model = nnx.Linear(D_IN, D_OUT, dot_general=Fp4DotGeneralNNX("nvfp4", rngs=nnx.Rngs(fp4=0)),
                     preferred_element_type=jnp.float32, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(60)]
  assert losses[-1] < 0.1 * losses[0], losses[::10]
  assert model(x, out_sharding=None).dtype == jnp.float32


def test_nnx_rngs():
  dg = Fp4DotGeneralNNX(recipes.nvfp4(), rngs=nnx.Rngs(fp4=0))
  model = nnx.Linear(D_IN, D_OUT, dot_general=dg, rngs=nnx.Rngs(0))
  x = jnp.ones((16, D_IN))
  count = int(dg.rngs.count[...])
  model(x)
  assert int(dg.rngs.count[...]) == count + 1          # a fresh key per call
  bare = nnx.Linear(D_IN, D_OUT, dot_general=Fp4DotGeneralNNX("nvfp4"), rngs=nnx.Rngs(0))
  bare(x)
  with pytest.raises(ValueError, match="needs random bits"):
    nnx.grad(lambda m: jnp.sum(m(x)))(bare)
  with pytest.raises(TypeError, match="rngs must be"):
    Fp4DotGeneralNNX("nvfp4", rngs=0)


def _kernel_grad(model, x):
  return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model).kernel[...]


def test_nnx_rng_state_advances_under_nnx_jit_and_a_plain_jax_jit_that_drops_it_warns_once(monkeypatch):
  """nnx.jit writes the layer's RNG count back: new stochastic-rounding bits each call. A plain jax.jit of a
  function taking the model traces the count and drops it: the same bits each call, and one RngStateWarning."""
  monkeypatch.setattr(fp4jax.flax, "_warned_rng_state", False)
  x = inputs.normal(jax.random.key(1), (16, D_IN))
  make = lambda: nnx.Linear(D_IN, D_OUT, use_bias=False, rngs=nnx.Rngs(0),
                            dot_general=Fp4DotGeneralNNX("nvfp4", rngs=nnx.Rngs(fp4=0)))
  tracked, plain = make(), make()
  with warnings.catch_warnings():
    warnings.simplefilter("error", fp4jax.flax.RngStateWarning)
    step = nnx.jit(_kernel_grad)
    g1, g2 = step(tracked, x), step(tracked, x)
    assert int(tracked.dot_general.rngs.count[...]) == 2 and not np.array_equal(g1, g2)
    tracked(x)                                            # eager, and jax.jit without a gradient: no warning
    jax.jit(lambda m, x: m(x))(plain, x)
  step = jax.jit(_kernel_grad)
  with pytest.warns(fp4jax.flax.RngStateWarning, match=r"every call draws the same key.*Use nnx\.jit.*return "
                    r"nnx\.state\(model\)"):
    g1 = step(plain, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", fp4jax.flax.RngStateWarning)     # once per process
    g2 = jax.jit(lambda m, x: _kernel_grad(m, 2 * x))(plain, x)
  assert int(plain.dot_general.rngs.count[...]) == 0 and np.array_equal(g1, step(plain, x))


_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from fp4jax.flax import dot_general_cls
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    x = jax.random.normal(jax.random.key(0), (64, 48))
    model = nn.Dense(32, dot_general_cls=dot_general_cls("nvfp4"))
    params = model.init(jax.random.key(1), x)
    loss = lambda p, x: jnp.sum(model.apply(p, x, rngs={"fp4": jax.random.key(2)}) ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    ref = step(params, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    got = step(params, xs)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5)
    print("OK", got[1]["params"]["kernel"].sharding)
""")


@pytest.mark.slow   # ~24 s idle; sharded quantize/dot: tests/test_sharding_mesh.py by default
def test_sharded_inputs():
  """Tokens sharded over two (host) devices: same result as unsharded, up to summation order."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout
