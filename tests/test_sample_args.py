"""fp4jax-sample's arguments: a bad one is one ``error:`` line and exit 2, before any model is built."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from models import LanguageModel, ModelConfig
from tools import runs
from tools import sample

CLEAR = "clear error"
# test name -> (case, expected verdict, exit code of fp4jax-sample); in docs/RELIABILITY.md's training matrix
CASES = {
    "test_max_tokens_below_one": ("fp4jax-sample --max_tokens 0 or -5: one line", CLEAR, 2),
}

CONFIG = ModelConfig(vocab_size=256, d_model=32, pattern="M*-", mlp_dim=64, n_heads=2, n_kv_heads=1, head_dim=16,
                     d_state=8, ssm_head_dim=16, chunk_size=16, dtype=jnp.float32)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sample_run"))
  model = LanguageModel(CONFIG)
  init = jax.jit(lambda key: nn.unbox(model.init({"params": key}, jnp.zeros((1, 8), jnp.int32))["params"]))
  runs.write_run(workdir, runs.training_config(CONFIG, name="sample_args"), init(jax.random.key(0)))
  return workdir


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_tokens_below_one(run_dir, capsys, value):
  assert sample.main(["--workdir", run_dir, "--prompt", "x", "--max_tokens", value, "--compilation_cache="]) == 2
  captured = capsys.readouterr()
  assert captured.err == f"error: --max_tokens {value} must be >= 1 (the number of tokens to generate)\n"
  assert captured.out == ""
