"""sample.py: decoding with the cache equals re-running the full forward pass; nucleus sampling; the CLI."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sample
from models import LanguageModel, ModelConfig
from tools import runs

# Every block kind, two Mamba groups, prompts that span several SSD chunks.
CONFIG = ModelConfig(vocab_size=256, d_model=32, pattern="M*-M", mlp_dim=64, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_groups=2, d_state=8, ssm_head_dim=8, expand=2, chunk_size=4,
                     dtype=jnp.float32)


def _params(config=CONFIG, seed=0):
  model = LanguageModel(config)
  params = nn.unbox(model.init({"params": jax.random.key(seed)}, jnp.zeros((1, 8), jnp.int32))["params"])
  # Larger weights than the init so the argmax is decided by the input, not by ties near uniform logits.
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim == 2 else p, params)
  return model, jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("prompt_len", [1, 7])
def test_greedy_with_cache_equals_full_forward(prompt_len):
  model, params = _params()
  prompt = np.random.default_rng(prompt_len).integers(1, 256, prompt_len).astype(np.int32)
  with_cache = sample.Generator(model, params, temperature=0.0).generate([prompt], 12)[0]
  without = sample.greedy_full_forward(model, params, prompt, 12)
  np.testing.assert_array_equal(with_cache, without)


def test_batch_of_unequal_prompts_equals_each_prompt_alone():
  model, params = _params()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 256, n).astype(np.int32) for n in (3, 9, 5)]
  generator = sample.Generator(model, params, temperature=0.0)
  together = generator.generate(prompts, 6)
  for prompt, out in zip(prompts, together):
    np.testing.assert_array_equal(out, sample.greedy_full_forward(model, params, prompt, 6))


def test_generation_stops_at_eos():
  model, params = _params()
  prompt = np.array([5, 6, 7], np.int32)
  full = sample.Generator(model, params, temperature=0.0).generate([prompt], 10)[0]
  cut = sample.Generator(model, params, temperature=0.0).generate([prompt], 10, eos_id=int(full[3]))[0]
  np.testing.assert_array_equal(cut, full[:list(full).index(full[3])])


def test_a_vocabulary_padded_past_the_tokenizer_never_samples_the_padding():
  model, params = _params()
  kernel = params["lm_head"]["kernel"]
  params = dict(params, lm_head={"kernel": kernel.at[:, :200].set(0.0)})   # ids >= 200 win the argmax
  prompt = np.array([5, 6, 7], np.int32)
  assert (jnp.argmax(model.apply({"params": params}, jnp.asarray(prompt[None])), axis=-1) >= 200).all()
  out = sample.Generator(model, params, temperature=1.0, top_p=1.0, vocab=200).generate([prompt], 6)[0]
  assert len(out) == 6 and (out < 200).all(), out


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = jax.vmap(lambda k: sample.sample_logits(logits, k, temperature=1.0, top_p=0.8)[0])(keys)
  counts = np.bincount(np.asarray(draw), minlength=4)
  assert counts[2] == counts[3] == 0          # 0.5 + 0.3 reaches 0.8: the tail is never drawn
  # Renormalized 0.5/0.8 = 0.625 for token 0; binomial std over 2000 draws is 0.011, bound 5 std.
  assert abs(counts[0] / 2000 - 0.625) < 5 * math.sqrt(0.625 * 0.375 / 2000)
  one = jax.vmap(lambda k: sample.sample_logits(logits, k, temperature=1.0, top_p=0.1)[0])(keys)
  assert set(np.asarray(one).tolist()) == {0}  # the most likely token is always kept


def test_greedy_is_argmax():
  logits = jnp.array([[0.1, 3.0, -1.0], [2.0, 0.0, 1.9]])
  np.testing.assert_array_equal(sample.sample_logits(logits, jax.random.key(0), temperature=0.0, top_p=0.9),
                                [1, 0])


def test_evaluate_matches_mean_cross_entropy():
  model, params = _params()
  tokens = np.random.default_rng(0).integers(0, 256, 2 * 8 + 1 + 5)   # two full windows and a tail
  loss, count = sample.evaluate(model, params, tokens, seq_len=8, batch_size=1)
  # The windows restart the model's context every 8 tokens: the same as running each window alone.
  expected = []
  for start in (0, 8, 16):
    window = jnp.asarray(tokens[None, start:start + 9], jnp.int32)
    lp = jax.nn.log_softmax(model.apply({"params": params}, window[:, :-1])[0], axis=-1)
    expected += [-lp[i, window[0, i + 1]] for i in range(window.shape[1] - 1)]
  assert count == len(tokens) - 1 == len(expected)
  np.testing.assert_allclose(loss, float(np.mean(expected)), rtol=1e-5)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  _, params = _params()
  config = runs.training_config(CONFIG, name="sample_test")
  config.recipe = "bf16"
  runs.write_run(workdir, config, jax.tree.map(lambda p: p.astype(jnp.float32), params))
  return workdir


def test_cli_generates_and_evaluates(run_dir, tmp_path, capsys):
  assert sample.main(["--workdir", run_dir, "--prompt", "def f(", "--max_tokens", "5", "--temperature", "0"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("def f(")
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("ab\nxyz\\nw\n")
  assert sample.main(["--workdir", run_dir, "--prompts_file", str(prompts), "--max_tokens", "3"]) == 0
  assert "=== 'xyz\\nw'" in capsys.readouterr().out
  held_out = tmp_path / "held_out.txt"
  held_out.write_text("print('hello')\n" * 20)
  assert sample.main(["--workdir", run_dir, "--eval", str(held_out)]) == 0
  assert "bits/byte" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--eval", "/nonexistent/file.txt"], "does not exist"),
])
def test_cli_bad_input(run_dir, capsys, args, message):
  assert sample.main(["--workdir", run_dir] + args) == 2
  assert message in capsys.readouterr().err


def test_cli_missing_run(tmp_path, capsys):
  assert sample.main(["--workdir", str(tmp_path / "nope"), "--prompt", "x"]) == 2
  assert "does not exist" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert sample.main(["--workdir", str(tmp_path / "empty"), "--prompt", "x"]) == 2
  assert "config.json is missing" in capsys.readouterr().err
  (tmp_path / "empty" / "config.json").write_text('{"model": {"preset": "tiny"}}')
  assert sample.main(["--workdir", str(tmp_path / "empty"), "--prompt", "x"]) == 2
  assert "saved no checkpoint" in capsys.readouterr().err


def test_cli_unknown_step(run_dir, capsys):
  assert sample.main(["--workdir", run_dir, "--prompt", "x", "--step", "7"]) == 2
  assert "has no checkpoint 7; it has steps [0]" in capsys.readouterr().err
