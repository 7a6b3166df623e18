"""The Mamba-2 conv + SiLU's recompute gradient (``models.mamba2.conv1d_silu(vjp="recompute")``) against jax's
gradient of the same ops (``conv1d_silu_reference``): the forward bit for bit, the gradients within float32
rounding (they sum the same products in another order); document masking, each document as if alone."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inputs
import packed
from models import lm, mamba2, presets
from models.config import ModelConfig

def _inputs(shape, width, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = inputs.normal(k[0], shape, jnp.float32).astype(dtype)
  w = inputs.normal(k[1], (width, shape[-1])) * 0.5
  b = inputs.normal(k[2], (shape[-1],)) * 0.1
  dy = inputs.normal(k[3], shape)
  return x, w, b, dy


@pytest.mark.parametrize("shape,width,dtype,bias", [
    ((2, 37, 24), 4, jnp.bfloat16, True),
    pytest.param((1, 3, 16), 4, jnp.float32, False, marks=pytest.mark.slow),   # L < W, no bias
    pytest.param((3, 20, 8), 2, jnp.float32, True, marks=pytest.mark.slow)])
def test_recompute_equals_autodiff(shape, width, dtype, bias):
  x, w, b, dy = _inputs(shape, width, dtype)
  b = b if bias else None
  outs = {}
  for vjp in ("autodiff", "recompute"):
    def run(x, w, b, dy, vjp=vjp):
      y, f = jax.vjp(lambda x, w, b: mamba2.conv1d_silu(x, w, b, vjp=vjp), x, w, b)
      return y, f(dy)
    outs[vjp] = jax.jit(run)(x, w, b, dy)
  (y0, g0), (y1, g1) = outs["autodiff"], outs["recompute"]
  assert y1.dtype == jnp.float32 and np.array_equal(np.asarray(y0), np.asarray(y1))
  assert g1[0].dtype == x.dtype and g1[1].dtype == w.dtype
  assert (g1[2] is None) == (b is None)
  for a, r in zip(g1, g0):
    if r is None:
      continue
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    # bf16 dx: the two float32 sums round to bf16 (8 bits) apart by at most one bf16 ulp of the largest value
    tol = 2.0 ** -7 if a.shape == x.shape and dtype == jnp.bfloat16 else 1e-6
    assert np.abs(a - r).max() <= tol * np.abs(r).max(), np.abs(a - r).max() / np.abs(r).max()


def test_bad_names_are_refused():
  x, w, b, _ = _inputs((1, 8, 16), 4, jnp.bfloat16)
  with pytest.raises(ValueError, match="conv vjp"):
    mamba2.conv1d_silu(x, w, b, vjp="pallas")
  with pytest.raises(ValueError, match="conv_vjp"):
    ModelConfig(conv_vjp="fused")


@pytest.mark.slow
def test_model_gradients_with_the_recompute_vjp():
  """The tiny hybrid's loss is the same bits with either gradient; its gradients agree within float32 rounding."""
  cfg = presets.get_model_config("tiny")
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
  key = jax.random.key(0)
  out = {}
  for vjp in ("autodiff", "recompute"):
    model = lm.LanguageModel(dataclasses.replace(cfg, conv_vjp=vjp), "bf16")
    params = model.init({"params": key, "fp4": key}, tokens[:, :-1])["params"]
    loss = lambda p: model.apply({"params": p}, tokens[:, :-1], targets_BxL=tokens[:, 1:], rngs={"fp4": key})
    out[vjp] = jax.jit(jax.value_and_grad(loss))(params)
  (l0, g0), (l1, g1) = out["autodiff"], out["recompute"]
  assert np.asarray(l0) == np.asarray(l1)
  for a, r in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    a, r = np.asarray(a), np.asarray(r)
    assert np.abs(a - r).max() <= 1e-5 * max(np.abs(r).max(), 1e-30)


@pytest.mark.parametrize("vjp", mamba2.CONV_VJPS)
def test_documents_equal_each_document_alone(vjp):
  """Document masking (tests/packed.py's rows): no tap reads an input of another document, so each document's
  output is the same ops on the same values as the document alone (zero inputs before its start), bit for
  bit, with either gradient. Its x gradient too, within one float32 rounding (XLA may fuse a multiply-add of
  the recomputed backward into one FMA for one length and not another); w's and b's gradients sum over the
  documents."""
  seg = jnp.asarray(packed.segment_ids())
  x, w, b, dy = _inputs((2, seg.shape[1], 8), 4, jnp.float32, seed=5)

  def run(x, dy, seg):
    y, f = jax.vjp(lambda x, w, b: mamba2.conv1d_silu(x, w, b, vjp=vjp, segment_ids_BxL=seg), x, w, b)
    return y, f(dy)

  y, (dx, dw, db) = jax.jit(run)(x, dy, seg)
  alone = jax.jit(lambda x, dy: run(x, dy, None))
  sums = [jnp.zeros_like(dw), jnp.zeros_like(db)]
  for doc in packed.documents():
    y_doc, (dx_doc, dw_doc, db_doc) = alone(packed.alone(x, doc), packed.alone(dy, doc))
    np.testing.assert_array_equal(packed.alone(y, doc), y_doc, err_msg=str(doc))
    np.testing.assert_allclose(packed.alone(dx, doc), dx_doc, rtol=2e-7, atol=2e-7 * float(jnp.abs(dx).max()),
                               err_msg=str(doc))
    sums = [sums[0] + dw_doc, sums[1] + db_doc]
  np.testing.assert_allclose(dw, sums[0], rtol=1e-5, atol=1e-5 * float(jnp.abs(dw).max()))
  np.testing.assert_allclose(db, sums[1], rtol=1e-5, atol=1e-5 * float(jnp.abs(db).max()))
