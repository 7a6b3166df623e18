"""A config's blocks reordered into the fewest scan groups: the same step for the ruler, at a fraction of the compile.

With ``model.scan_blocks`` each repeated group of blocks (``models.lm.block_groups``) compiles once, as a loop
whose body the ruler charges once per trip (bench/predict/hlo_walk.py's trip counts), so a compile costs by the
distinct blocks of its groups, not by the depth. Nemotron 3 Super's irregular pattern (an attention block every
4 or 5 Mamba / MoE pairs, the last 14 blocks in bf16) makes 10 groups of 26 distinct blocks; reordered, the same
88 blocks make 6 groups of one block each:

  1. the blocks split into runs that the precision policy treats alike (equal ``policy.block_signature``: for
     Super the NVFP4 blocks 0-73 and the bf16 blocks 74-87);
  2. within a run, each kind's blocks back to back, the kinds in the order they first appear in the run.

Every block keeps its kind, its index's precision and its parameters, so the step has the same GEMMs, kernels,
collectives, parameters and optimizer state per GPU; only the order of the blocks changes, which the cost of a
block does not depend on (each reads and writes the B x L x D residual). What can move is what crosses a block
boundary: XLA's schedule (which collective overlaps which block) and the live ranges of temporaries, priced
against one full compile in docs/PERF.md ("A Super prediction in minutes").
"""
from __future__ import annotations

import itertools

from models import lm
from models import policy


def pattern(config) -> str:
  """``config.pattern`` (a ``models.ModelConfig``) reordered: per run of equal precision signature, each kind's
  blocks back to back (module docstring)."""
  signatures = [policy.block_signature(config, i) for i in range(config.n_blocks)]
  out, i = [], 0
  for _, run in itertools.groupby(signatures):
    kinds = config.pattern[i:i + len(list(run))]
    out.append("".join(k * kinds.count(k) for k in dict.fromkeys(kinds)))
    i += len(kinds)
  return "".join(out)


def regrouped(config):
  """``config`` (a ``models.ModelConfig`` with ``scan_blocks``) with its blocks reordered by ``pattern``; refused
  where the reorder would change a block's precision or save no compile."""
  if not config.scan_blocks:
    raise ValueError("regrouping the blocks saves compile time only where the repeated groups are scanned: set "
                     "--config.model.scan_blocks=True (the step's cost is the same), or compile without regrouping")
  out = config.replace(pattern=pattern(config))
  before = sorted((k, policy.block_signature(config, i)) for i, k in enumerate(config.pattern))
  after = sorted((k, policy.block_signature(out, i)) for i, k in enumerate(out.pattern))
  if before != after:   # a precision rule that names a block kind's place would make this another model
    raise ValueError(f"regrouping {config.pattern!r} as {out.pattern!r} changes which blocks run which precision; "
                     "compile without regrouping")
  return out


def describe(config) -> dict:
  """What regrouping ``config`` (a ``models.ModelConfig``) does: both patterns and their groups' distinct blocks."""
  out = regrouped(config)
  return dict(pattern=config.pattern, regrouped=out.pattern,
              groups=len(lm.block_groups(config)), distinct_blocks=sum(u for _, u, _ in lm.block_groups(config)),
              regrouped_groups=len(lm.block_groups(out)),
              regrouped_distinct_blocks=sum(u for _, u, _ in lm.block_groups(out)))
