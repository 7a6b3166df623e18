"""Recipe and presets: the switches, the ablations by keyword, names, validation."""
import jax.numpy as jnp
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.dot import needs_key


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
