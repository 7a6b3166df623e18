"""``ModelConfig.remat`` as a policy (models.remat): every policy gives the loss and gradients of "none",
each re-runs what it says (counted in the gradient's jaxpr), and an unknown name is refused with the list."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import LanguageModel, get_model_config, remat

CONFIG = get_model_config("tiny", pattern="M*-", chunk_size=8, bf16_last_blocks=0)
KEY = jax.random.key(7)


def _loss_fn(config, recipe):
  model = LanguageModel(config, recipe=recipe)

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens, rngs={"fp4": KEY})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * logits.std())
  return model, loss


@pytest.fixture(scope="module")
def setup():
  model, _ = _loss_fn(CONFIG, "nvfp4")
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, CONFIG.vocab_size)
  params = jax.jit(model.init)({"params": jax.random.key(0), "fp4": KEY}, tokens)["params"]
  return params, tokens


@pytest.mark.slow   # ~70 s idle; by default each policy's saved names are checked below and the FP4 operands
# that save_linear_fp4 keeps by tests/test_dot_remat_names.py
@pytest.mark.parametrize("recipe", ["nvfp4"])
def test_every_policy_gives_the_loss_and_grads_of_none(setup, recipe):
  params, tokens = setup
  results = {}
  for name in remat.POLICIES:
    _, loss = _loss_fn(CONFIG.replace(remat=name), recipe)
    results[name] = jax.jit(jax.value_and_grad(loss))(params, tokens)
  loss0, grads0 = results["none"]
  for name, (loss, grads) in results.items():
    # The same operations on the same values: equal up to the order XLA sums in (its fusions of a
    # recomputation may differ from the forward's), far below any quantization step.
    np.testing.assert_allclose(loss, loss0, rtol=1e-6, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name),
                 grads, grads0)


def _counts(config, primitives, setup):
  """How often each primitive appears in the gradient's jaxpr (traced once)."""
  params, tokens = setup
  _, loss = _loss_fn(config, "nvfp4")
  text = str(jax.make_jaxpr(jax.grad(loss))(params, tokens))
  return [text.count(f"{primitive}[") for primitive in primitives]


def test_each_policy_re_runs_what_it_says(setup):
  """GEMMs of the quantized dots (fp4jax_scaled_matmul) and their quantize passes (fp4jax_quantize) in
  the gradient: "full" re-runs both, "save_linear" only quantize passes."""
  counts = {name: _counts(CONFIG.replace(remat=name), ("fp4jax_scaled_matmul", "fp4jax_quantize"), setup)
            for name in remat.POLICIES}
  gemms = {name: c[0] for name, c in counts.items()}
  quant = {name: c[1] for name, c in counts.items()}
  assert gemms["full"] > gemms["none"] and quant["full"] > quant["none"]
  assert gemms["save_linear"] == gemms["none"] and quant["save_linear"] > quant["none"]
  assert gemms["save_linear_fp4"] == gemms["none"] and quant["save_linear_fp4"] == quant["none"]


def test_the_ssd_checkpoints_its_chunks_only_outside_a_remat_block(setup):
  """One remat per block: a rematerialized block's scan does not checkpoint its chunks again (the
  forward's jaxpr holds one checkpoint per block, none nested); without block remat the scan keeps its
  own (one, in the Mamba block)."""
  params, tokens = setup
  counts = {}
  for name in ("none", "full", "save_linear", "save_linear_fp4"):
    model, _ = _loss_fn(CONFIG.replace(remat=name), "nvfp4")
    text = str(jax.make_jaxpr(lambda p, t, m=model: m.apply({"params": p}, t, rngs={"fp4": KEY}))(params, tokens))
    counts[name] = text.count("remat2[")   # jax.checkpoint in a jaxpr
  assert counts == {"none": 1, "full": 3, "save_linear": 3, "save_linear_fp4": 3}, counts


def test_remat_names_and_booleans():
  assert CONFIG.replace(remat=True).remat == "full" and CONFIG.replace(remat=False).remat == "none"
  assert get_model_config("tiny").remat == "none"
  with pytest.raises(ValueError, match=r"remat='fast'.*\['full', 'none', 'save_linear', 'save_linear_fp4'\]"):
    CONFIG.replace(remat="fast")
