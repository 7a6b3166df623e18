"""Tokens to a target loss: where a recipe's final validation losses, measured at a few token budgets (one run
each), reach a target loss, and the mean over seeds of the tokens needed with a t-interval. Functions of
numbers only."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import stats

BRACKETED = "bracketed"   # two budgets enclose the crossing: ``tokens`` is interpolated between them
AT_MOST = "at_most"       # at or under the target already at the smallest budget: needs <= ``tokens``
MORE_THAN = "more_than"   # over the target at every budget: needs > ``tokens`` (the largest budget)


@dataclasses.dataclass(frozen=True)
class Match:
  """The tokens a recipe needs to reach the target loss: a value (``BRACKETED``) or a bound."""
  kind: str
  tokens: float


def tokens_to_target(tokens: Sequence[float], losses: Sequence[float], target: float) -> Match:
  """The fewest tokens at which the piecewise-linear curve through (``tokens``, ``losses``) reaches ``target``.

  ``tokens``: the budgets, strictly increasing; ``losses``: the final validation loss of each budget's run.
  The first budget at or under the target and the one before it bracket the crossing, interpolated linearly
  in tokens; a curve at or under the target at its first budget gives ``AT_MOST`` that budget, one over it
  at every budget ``MORE_THAN`` the last. A non-monotone curve (seed noise) gives its first crossing."""
  tokens, losses = [float(t) for t in tokens], [float(l) for l in losses]
  if not tokens or len(tokens) != len(losses):
    raise ValueError(f"tokens_to_target: {len(tokens)} budgets and {len(losses)} losses; give one loss per "
                     "budget, at least one")
  if not all(math.isfinite(v) for v in tokens + losses + [float(target)]):
    raise ValueError(f"tokens_to_target: non-finite input (tokens {tokens}, losses {losses}, target {target}); "
                     "leave out a diverged run's budget")
  if any(b <= a for a, b in zip(tokens, tokens[1:])):
    raise ValueError(f"tokens_to_target: budgets {tokens} must be strictly increasing")
  if losses[0] <= target:
    return Match(AT_MOST, tokens[0])
  for (t0, l0), (t1, l1) in zip(zip(tokens, losses), zip(tokens[1:], losses[1:])):
    if l1 <= target:   # l0 > target >= l1
      return Match(BRACKETED, t0 + (l0 - target) / (l0 - l1) * (t1 - t0))
  return Match(MORE_THAN, tokens[-1])


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
  """(mean, low, high): the two-sided Student-t interval of the mean of ``values``, mean ± t(n-1) s / sqrt(n)
  with s the sample standard deviation; low and high are NaN for fewer than two values."""
  if not 0 < confidence < 1:
    raise ValueError(f"t_interval: confidence={confidence} must be in (0, 1), e.g. 0.95")
  x = np.asarray(values, np.float64)
  if x.size == 0:
    return float("nan"), float("nan"), float("nan")
  mean = float(x.mean())
  if x.size < 2:
    return mean, float("nan"), float("nan")
  half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
  return mean, mean - half, mean + half


def mean_ratio(matches: Sequence[Match], reference_tokens: float, confidence: float = 0.95) -> dict:
  """The tokens needed over seeds, as a ratio to ``reference_tokens`` (one ``Match`` per seed).

  Every seed bracketed: ``kind`` ``BRACKETED``, ``mean`` with its t-interval ``low``..``high``. Otherwise the
  mean is a bound: the mean with each bounded seed at its bound, ``kind`` ``AT_MOST`` when the bounded seeds are
  all at-most ones (the true mean is <= it), ``MORE_THAN`` when they are all more-than ones (the true mean is
  > it), None when both kinds occur (no bound). ``ratios``: each seed's ratio or bound; ``bracketed``: how many
  seeds were."""
  ratios = [m.tokens / reference_tokens for m in matches]
  kinds = {m.kind for m in matches}
  bracketed = sum(m.kind == BRACKETED for m in matches)
  out = dict(ratios=ratios, kinds=[m.kind for m in matches], bracketed=bracketed, seeds=len(matches),
             confidence=confidence, mean=float("nan"), low=float("nan"), high=float("nan"), kind=None)
  if not matches:
    return out
  if kinds == {BRACKETED}:
    out["mean"], out["low"], out["high"] = t_interval(ratios, confidence)
    out["kind"] = BRACKETED
  elif kinds - {BRACKETED} in ({AT_MOST}, {MORE_THAN}):
    out["mean"] = float(np.mean(ratios))
    out["kind"] = (kinds - {BRACKETED}).pop()
  return out
