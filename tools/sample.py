"""Sample from a trained run, or evaluate it on a held-out file.

  python sample.py --workdir runs/tiny --prompt "def fib("
  python sample.py --workdir runs/tiny --prompt "import " --max_tokens 400 --temperature 0.8 --top_p 0.95
  python sample.py --workdir runs/tiny --prompts_file prompts.txt --temperature 0     # a batch, greedy
  python sample.py --workdir runs/tiny --eval held_out.py                              # loss, bits/byte

Loads ``<workdir>/config.json`` and the latest checkpoint. Generation uses the model's decode cache: the
prompt goes through in one jitted call, then one token per jitted step; a single prompt streams to
stdout as it is written. Prompts of different lengths share the batch: every row runs from the shortest
prompt's length and is fed its own prompt tokens until they are used up, then its samples.
``--recipe`` picks the forward pass (default: the run's recipe, so the model sees the weights it was
trained with; ``bf16`` for the unquantized weights).

Exit status: 0 done; 2 a bad argument (--max_tokens below 1, --temperature, --top_p, a missing prompt or file) or
a run that cannot be loaded, with one ``error:`` line; argparse's own usage errors are 2 as well.

Legend: B prompts, T prompt tokens in one call, S cache length (longest prompt + max_tokens), V vocabulary.
"""
from __future__ import annotations

import argparse
import codecs
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

import fp4jax
from models import LanguageModel, init_cache
from tools import prove
from tools.runs import Run, RunError, load_run
from training import data as data_lib
from training import sharding


# ------------------------------------------------------------------------------------------- sampling

def sample_logits(logits_BxV, key, *, temperature: float, top_p: float):
  """One token per row: argmax when ``temperature == 0``, else nucleus sampling at ``temperature``
  from the smallest set of tokens whose probability reaches ``top_p`` (the most likely one always)."""
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV       # mass of the strictly better tokens
    kept_BxV = before_BxV < top_p
    cutoff_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV >= cutoff_Bx1, logits_BxV, -jnp.inf)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


class Generator:
  """Jitted prefill and decode steps of ``model`` over a cache of ``max_len`` positions. ``vocab``: draw only
  the ids below it (the tokenizer's size: the rows of a vocabulary padded past it are never a text's token);
  None: every id of the model."""

  def __init__(self, model: LanguageModel, params, *, temperature: float = 0.8, top_p: float = 0.95,
               vocab: int | None = None):
    if temperature < 0:
      raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p={top_p} must be in (0, 1]")
    self.model, self.params = model, params
    pick = functools.partial(sample_logits, temperature=temperature, top_p=top_p)

    def prefill(params, cache, tokens_BxT, key):
      logits_BxTxV, mut = model.apply({"params": params, "cache": cache}, tokens_BxT, decode=True,
                                      mutable=["cache"])
      return pick(logits_BxTxV[:, -1, :vocab], key), mut["cache"]

    def step(params, cache, token_B, key):
      logits_Bx1xV, mut = model.apply({"params": params, "cache": cache}, token_B[:, None], decode=True,
                                      mutable=["cache"])
      return pick(logits_Bx1xV[:, 0, :vocab], key), mut["cache"]

    self._prefill = jax.jit(prefill, donate_argnums=(1,))
    self._step = jax.jit(step, donate_argnums=(1,))

  def generate(self, prompts: list[np.ndarray], max_tokens: int, *, seed: int = 0, eos_id: int | None = None,
               on_token=None) -> list[np.ndarray]:
    """Up to ``max_tokens`` token ids after each prompt; a row ends early at ``eos_id`` (not included).
    ``on_token(row, token)`` sees every generated token as soon as it is made."""
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token; got an empty prompt")
    if max_tokens < 1:
      raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    lengths = np.array([len(p) for p in prompts])
    B, T, S = len(prompts), int(lengths.min()), int(lengths.max()) + max_tokens
    padded_BxS = np.zeros((B, S), np.int32)
    for row, p in enumerate(prompts):
      padded_BxS[row, :len(p)] = p
    cache = init_cache(self.model, B, S)
    key, sub = jax.random.split(jax.random.PRNGKey(seed))
    sampled_B, cache = self._prefill(self.params, cache, jnp.asarray(padded_BxS[:, :T]), sub)
    out = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    # Position t gets the row's prompt token while t is inside its prompt, else the token sampled at t - 1.
    for t in range(T, S):
      in_prompt_B = t < lengths
      fed_B = np.where(in_prompt_B, padded_BxS[:, t], np.asarray(sampled_B)).astype(np.int32)
      for row in np.flatnonzero(~in_prompt_B & ~done):
        token = int(fed_B[row])
        if token == eos_id:
          done[row] = True
          continue
        out[row].append(token)
        done[row] = len(out[row]) == max_tokens
        if on_token is not None:
          on_token(int(row), token)
      if done.all():
        break
      key, sub = jax.random.split(key)
      sampled_B, cache = self._step(self.params, cache, jnp.asarray(fed_B), sub)
    return [np.asarray(o, np.int32) for o in out]


def greedy_full_forward(model: LanguageModel, params, prompt: np.ndarray, max_tokens: int) -> np.ndarray:
  """Greedy decoding without a cache: the whole sequence through the model for every new token (padded
  to the final length, which a causal model ignores, so it compiles once)."""
  forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
  tokens_1xS = np.zeros((1, len(prompt) + max_tokens), np.int32)
  tokens_1xS[0, :len(prompt)] = prompt
  for n in range(len(prompt), tokens_1xS.shape[1]):
    tokens_1xS[0, n] = int(jnp.argmax(forward(params, jnp.asarray(tokens_1xS))[0, n - 1]))
  return tokens_1xS[0, len(prompt):].copy()


# ------------------------------------------------------------------------------------------ evaluation

def evaluate(model: LanguageModel, params, tokens: np.ndarray, *, seq_len: int, batch_size: int = 8):
  """(mean next-token loss in nats, number of predicted tokens) over non-overlapping windows of
  ``seq_len + 1`` tokens (the trainer's validation windows); a shorter tail is one last, shorter window."""
  if len(tokens) < 2:
    raise ValueError(f"the evaluation text has {len(tokens)} token(s); it needs at least 2")

  @jax.jit
  def summed_loss(params, window_BxW):   # nats, summed over every predicted token of the batch
    logits_BxLxV = model.apply({"params": params}, window_BxW[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, window_BxW[:, 1:]).sum()

  window = seq_len + 1
  full = list(range(0, len(tokens) - window + 1, seq_len))   # starts of the whole windows
  total, count = 0.0, 0
  for i in range(0, len(full), batch_size):
    batch_BxW = np.stack([tokens[s:s + window] for s in full[i:i + batch_size]]).astype(np.int32)
    total += float(summed_loss(params, jnp.asarray(batch_BxW)))
    count += batch_BxW.shape[0] * seq_len
  covered = full[-1] + seq_len if full else 0                # tokens[covered] is the last one used as input
  if covered < len(tokens) - 1:
    tail_1xT = tokens[covered:].astype(np.int32)[None]
    total += float(summed_loss(params, jnp.asarray(tail_1xT)))
    count += tail_1xT.shape[1] - 1
  return total / count, count


# ------------------------------------------------------------------------------------- text <-> tokens

class Codec:
  """Encodes prompts and decodes generated tokens with the run's tokenizer (``config.data.tokenizer``)."""

  def __init__(self, spec: str):
    self.spec = spec
    self._encoder = data_lib.make_tokenizer(spec)
    self.eos_id = self._encoder.eos_id
    self.vocab_size = self._encoder.vocab_size
    if spec == "byte":
      self._decode = lambda ids: bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    elif spec.endswith(".json"):
      import tokenizers  # pylint: disable=g-import-not-at-top  (optional; make_tokenizer checked it)
      tok = tokenizers.Tokenizer.from_file(spec)
      self._decode = lambda ids: tok.decode([int(i) for i in ids])
    else:
      import sentencepiece  # pylint: disable=g-import-not-at-top  (optional; make_tokenizer checked it)
      sp = sentencepiece.SentencePieceProcessor(model_file=spec)
      self._decode = lambda ids: sp.decode([int(i) for i in ids])

  def encode(self, text: str) -> np.ndarray:
    return self.encode_bytes(text.encode("utf-8"))

  def encode_bytes(self, data: bytes) -> np.ndarray:
    return np.asarray(self._encoder.encode(data), np.int64)

  def decode(self, ids) -> str:
    return self._decode(ids)

  def streamer(self, write):
    """``push(token_id)`` that writes text as soon as it is complete (UTF-8 bytes, or a growing decode)."""
    if self.spec == "byte":
      decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
      return lambda token: write(decoder.decode(bytes([int(token)])))
    seen: list[int] = []
    shown = [""]

    def push(token):
      seen.append(int(token))
      text = self.decode(seen)
      if not text.endswith("\ufffd"):
        write(text[len(shown[0]):])
        shown[0] = text
    return push


# --------------------------------------------------------------------------------------------- the CLI

def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="fp4jax-sample", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="work directory of a train.py run")
  p.add_argument("--prompt", help="text to continue")
  p.add_argument("--prompts_file", help="one prompt per line (\\n inside a line is a newline); sampled as a batch")
  p.add_argument("--eval", dest="eval_file", help="report loss and bits per byte on this text file instead")
  p.add_argument("--max_tokens", type=int, default=200)
  p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  p.add_argument("--top_p", type=float, default=0.95)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--recipe", default=None, help="forward-pass recipe (bf16, nvfp4, ...); default: the run's")
  p.add_argument("--step", type=int, default=None, help="checkpoint step; default: the latest")
  p.add_argument("--seq_len", type=int, default=None, help="--eval window; default: the run's data.seq_len")
  p.add_argument("--compilation_cache", default=os.path.join("~", ".cache", "fp4jax", "jax_compilation_cache"),
                 help="JAX's persistent compilation cache (shared with train.py), so that a second sample or "
                      "eval of the same run skips most of the compile; '' turns it off")
  return p


def _prompts(args) -> list[str]:
  if args.prompts_file:
    if not os.path.isfile(args.prompts_file):
      raise ValueError(f"--prompts_file {args.prompts_file!r} does not exist")
    with open(args.prompts_file, encoding="utf-8") as f:
      prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    if not prompts:
      raise ValueError(f"--prompts_file {args.prompts_file!r} holds no non-empty line")
    return prompts
  if args.prompt is None:
    raise ValueError("give --prompt TEXT, --prompts_file FILE or --eval FILE")
  if args.prompt == "":
    raise ValueError("--prompt is empty; give at least one character to continue")
  return [args.prompt]


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  logging.set_verbosity(logging.ERROR)   # orbax reports every restore at INFO/WARNING
  prove.register()   # impl=None proves the kernels it meets on this GPU (nothing to prove elsewhere)
  if args.compilation_cache:
    sharding.use_compilation_cache(args.compilation_cache)
  try:
    if args.eval_file is None and args.max_tokens < 1:
      raise ValueError(f"--max_tokens {args.max_tokens} must be >= 1 (the number of tokens to generate)")
    if args.eval_file is None:
      prompts = _prompts(args)
    elif not os.path.isfile(args.eval_file):
      raise ValueError(f"--eval {args.eval_file!r} does not exist")
    run: Run = load_run(args.workdir, args.step)
    recipe = fp4jax.recipes.get(args.recipe or run.config.recipe)
    codec = Codec(run.config.data.tokenizer)
  except (ValueError, RunError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  model = LanguageModel(run.model_config, recipe=recipe)
  print(f"# {run.workdir} step {run.step}, model '{run.model_config.pattern}' d_model "
        f"{run.model_config.d_model}, forward {recipe.name}", file=sys.stderr)

  if args.eval_file is not None:
    with open(args.eval_file, "rb") as f:
      text = f.read()
    tokens = codec.encode_bytes(text)
    seq_len = args.seq_len or int(run.config.data.seq_len)
    try:
      loss, count = evaluate(model, run.params, tokens, seq_len=seq_len)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    bpb = loss * len(tokens) / len(text) / math.log(2) if text else float("nan")
    print(f"eval {args.eval_file}: {count:,} predicted tokens ({len(text):,} bytes), loss {loss:.4f} nats/token, "
          f"{bpb:.4f} bits/byte")
    return 0

  encoded = [codec.encode(p) for p in prompts]
  if any(len(e) == 0 for e in encoded):
    print("error: a prompt encodes to no tokens", file=sys.stderr)
    return 2
  try:
    generator = Generator(model, run.params, temperature=args.temperature, top_p=args.top_p,
                          vocab=codec.vocab_size)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  start = time.perf_counter()
  if len(prompts) == 1:
    sys.stdout.write(prompts[0])
    push = codec.streamer(lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    outputs = generator.generate(encoded, args.max_tokens, seed=args.seed, eos_id=codec.eos_id,
                                 on_token=lambda row, token: push(token))
    sys.stdout.write("\n")
  else:
    outputs = generator.generate(encoded, args.max_tokens, seed=args.seed, eos_id=codec.eos_id)
    for prompt, out in zip(prompts, outputs):
      print(f"=== {prompt!r}\n{prompt}{codec.decode(out)}\n")
  seconds = time.perf_counter() - start
  made = sum(len(o) for o in outputs)
  print(f"# {made} tokens in {seconds:.2f} s ({made / seconds:.1f} tokens/s, compile included; compiled programs "
        f"are cached in {args.compilation_cache or 'nowhere (--compilation_cache=)'})", file=sys.stderr)
  return 0


def run() -> None:
  """The ``fp4jax-sample`` command."""
  sys.exit(main())


if __name__ == "__main__":
  run()
