"""Recipe and presets: the switches, the ablations by keyword, names, validation."""
import jax.numpy as jnp
import pytest

import inputs
import fp4jax
from fp4jax import random_bits, recipes
from fp4jax.dot import needs_key
from fp4jax.quantizers import Quantizer


def test_paper_recipe():
  r = recipes.nvfp4()
  assert (r.fprop, r.dgrad, r.wgrad) == ("nvfp4",) * 3
  assert r.weight_2d and r.stochastic_grad and r.rht and r.rht_size == 16
  assert r.quantizes_anything and needs_key(r)


@pytest.mark.parametrize("switch", ["rht", "stochastic_grad", "weight_2d"])
def test_ablations_turn_off_one_switch(switch):
  r = recipes.nvfp4(**{switch: False})
  base = recipes.nvfp4()
  assert getattr(r, switch) is False
  assert r.replace(**{switch: True}, name=base.name) == base


def test_presets():
  assert recipes.mxfp4().rht_size == 32 and recipes.mxfp4().fprop == "mxfp4"
  fp8 = recipes.fp8()
  assert fp8.fprop == "fp8" and not needs_key(fp8) and not fp8.rht
  bf16 = recipes.bf16()
  assert not bf16.quantizes_anything and not needs_key(bf16)
  assert not needs_key(recipes.nvfp4(stochastic_grad=False))
  assert not needs_key(recipes.nvfp4(dgrad="bf16", wgrad="fp8"))
  assert recipes.nvfp4(dgrad="bf16").needs_key and not recipes.mxfp4(stochastic_grad=False).needs_key


def test_names_and_hashable():
  for name in recipes.NAMES:
    r = recipes.get(name)
    assert isinstance(r, fp4jax.Recipe)
    hash(r)
  assert recipes.get(recipes.fp8()) == recipes.fp8()
  assert recipes.get("nvfp4_bf16_fprop").fprop == "bf16"
  assert recipes.nvfp4(out_dtype="bfloat16").out_dtype == jnp.bfloat16


def test_bad_recipes_say_what_to_do():
  with pytest.raises(ValueError, match="is not a format"):
    recipes.nvfp4(dgrad="int4")
  with pytest.raises(ValueError, match="power of two"):
    recipes.nvfp4(rht_size=12)
  with pytest.raises(ValueError, match="unknown recipe 'nvfp8'"):
    recipes.get("nvfp8")
  with pytest.raises(ValueError, match="mxfp4_scale_rule"):
    recipes.mxfp4(mxfp4_scale_rule="up")


def test_sr_bits_reach_every_stochastic_rounding_and_only_those():
  r = recipes.nvfp4(sr_bits="jax")
  q = r.roles
  assert q.dgrad_dy.sr_bits == q.wgrad_dy.sr_bits == "jax" and q.dgrad_dy.stochastic
  assert all(x.sr_bits == "philox" for x in (q.fprop_x, q.fprop_w, q.wgrad_x))   # nearest: the default's name
  # The default stream is philox's (spec §4: the cheapest uniform, independent stream).
  assert recipes.nvfp4().roles.wgrad_dy.sr_bits == "philox" and recipes.nvfp4().sr_bits == "philox"
  assert random_bits.DEFAULT == "philox" and Quantizer("nvfp4", stochastic=True).sr_bits == "philox"
  assert recipes.tetrajet2(sr_bits="jax").roles.dgrad_dy.sr_bits == "jax"
  assert recipes.mxfp4(sr_bits="jax").roles.wgrad_dy.sr_bits == "jax"
  assert r != recipes.nvfp4() and hash(r) != hash(recipes.nvfp4())


def test_sr_bits_named_where_nothing_rounds_stochastically():
  # A recipe names the stream its stochastic rounding would draw; where nothing rounds stochastically either
  # name is accepted (a run recorded with "jax" resumes with any recipe) and every quantizer is the same.
  for make in (lambda **k: recipes.nvfp4(stochastic_grad=False, **k), recipes.fp8, recipes.quartet2, recipes.bf16):
    assert make(sr_bits="jax").roles == make(sr_bits="packed").roles == make(sr_bits="philox").roles
  with pytest.raises(ValueError, match="sr_bits='per_group'"):
    recipes.nvfp4(sr_bits="per_group")
  # A quantizer and fp4jax.quantize refuse a stream other than the default where they do not round stochastically.
  with pytest.raises(ValueError, match="set stochastic=True or leave sr_bits='philox'"):
    Quantizer("nvfp4", sr_bits="jax")
  x = jnp.ones((4, 32))
  with pytest.raises(ValueError, match="needs rounding='stochastic'"):
    fp4jax.quantize(x, "nvfp4", sr_bits="jax")
  with pytest.raises(ValueError, match="not bits="):
    fp4jax.quantize(x, "nvfp4", rounding="stochastic", bits=jnp.zeros((4, 32), jnp.uint8), sr_bits="jax")


@pytest.mark.parametrize("layout", ["packed", "philox"])
def test_dot_with_packed_sr_bits_hashes_them_in_its_kernels(monkeypatch, layout):
  """With the kernels, the dot's two SR quantizes (dgrad dy 1x16, wgrad dy RHT-16 transposed) get a grouped
  layout's KeyedBits; on the XLA path its gradients differ from the "jax" layout's (the bits are really used)."""
  import jax   # pylint: disable=import-outside-toplevel
  x = inputs.normal(jax.random.key(0), (32, 64), jnp.float32)
  w = inputs.normal(jax.random.key(1), (64, 32), jnp.float32)
  dy = inputs.normal(jax.random.key(3), (32, 32), jnp.float32)
  key = jax.random.key(2)

  def grads(recipe):
    return jax.grad(lambda x, w: (fp4jax.dot(x, w, recipe=recipe, key=key) * dy).sum(), argnums=(0, 1))(x, w)
  packed = recipes.nvfp4(sr_bits=layout)
  dx, dw = jax.jit(lambda: grads(packed))()
  dx0, dw0 = jax.jit(lambda: grads(recipes.nvfp4(sr_bits="jax")))()
  assert not jnp.array_equal(dx, dx0) and not jnp.array_equal(dw, dw0)
  assert float(jnp.abs(dx - dx0).max()) < 0.5 * float(jnp.abs(dx0).max())
  monkeypatch.setenv("FP4JAX_DEFAULT_IMPL", "pallas")
  eqns = jax.make_jaxpr(lambda x, w: grads(packed))(x, w).eqns

  def keyed(eqns):   # every fp4jax quantize op's layout, sub-jaxprs (custom_vjp, pjit) included
    for e in eqns:
      if str(e.primitive).startswith("fp4jax_quantize"):
        yield str(e.primitive), e.params["keyed"]
      for v in e.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            yield from keyed(inner.eqns)
  found = set(keyed(eqns))
  assert ("fp4jax_quantize", layout) in found and ("fp4jax_quantize_rht_t", layout) in found
  assert all(k in (False, layout) for _, k in found)
