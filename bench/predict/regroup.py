"""A config's blocks reordered into few scan loops: the same step for the ruler, at a fraction of the compile.

With ``model.scan_blocks`` each repeated group of blocks (``models.lm.block_groups``) compiles once, as a loop
whose body the ruler charges once per trip (bench/predict/hlo_walk.py's trip counts), so a compile costs by the
distinct blocks of its groups, not by the depth. Nemotron 3 Super's irregular pattern (an attention block every
4 or 5 Mamba / MoE pairs, the last 14 blocks in bf16) makes 10 groups of 26 distinct blocks; reordered, the same
88 blocks compile as 12:

  1. the blocks split into runs that the precision policy treats alike (equal ``policy.block_signature``: for
     Super the NVFP4 blocks 0-73 and the bf16 blocks 74-87);
  2. within a run, the blocks of the configured repeated groups as few loops: the kinds of equal count
     interleaved in one loop body (Super's 32 scanned NVFP4 Mamba and 32 MoE blocks as "ME" x 32, its 5
     attention blocks as "*" x 5), as the configured pattern interleaves them;
  3. after them the run's blocks that the configured grouping leaves unscanned (its groups repeated once), in
     an order that keeps them unscanned: an unscanned block costs more memory than a scanned one (one Super
     E block 3.4 GiB per GPU more), so the memory stays near the configured program's.

Every block keeps its kind, its index's precision, its parameters and whether it is scanned, so the step has
the same GEMMs, kernels, collectives, parameters and optimizer state per GPU; only the order of the blocks
changes, which the cost of a block does not depend on (each reads and writes the B x L x D residual). What can
move is what crosses a block boundary: XLA's schedule (which collective overlaps which block) and the live
ranges of temporaries, priced against one full compile in docs/PERF.md ("A Super prediction in minutes").
"""
from __future__ import annotations

import itertools

from models import lm
from models import policy


def pattern(config) -> str:
  """``config.pattern`` (a ``models.ModelConfig``) reordered run by run (module docstring)."""
  signatures = [policy.block_signature(config, i) for i in range(config.n_blocks)]
  unscanned_at = {i for start, unit, repeats in lm.block_groups(config) if repeats == 1
                  for i in range(start, start + unit)}
  out, i = "", 0
  for _, run in itertools.groupby(signatures):
    n = len(list(run))
    out += _run(config, out, range(i, i + n), unscanned_at)
    i += n
  return out


_MAX_TRIES = 5000   # orders of a run's unscanned blocks tried before giving up


def _run(config, before: str, run: range, unscanned_at: set) -> str:
  """The blocks of ``run``: its scanned blocks as loops (``_units``), then its unscanned blocks, in the first
  order (of the loops and of the unscanned blocks) whose grouping after ``before`` is exactly these loops."""
  scanned = "".join(config.pattern[j] for j in run if j not in unscanned_at)
  unscanned = "".join(config.pattern[j] for j in run if j in unscanned_at)
  units = _units(scanned)
  after = config.pattern[run.stop:]
  orders = ((unit_order, unscanned_order) for unit_order in itertools.permutations(units)
            for unscanned_order in _distinct(itertools.permutations(unscanned)))
  for unit_order, unscanned_order in itertools.islice(orders, _MAX_TRIES):
    blocks = "".join(unit * repeats for unit, repeats in unit_order) + "".join(unscanned_order)
    here = range(len(before), len(before) + len(blocks))
    groups = lm.block_groups(config.replace(pattern=before + blocks + after))
    loops = [(u, r) for s, u, r in groups if r > 1 and s in here and s + u * r <= here.stop]
    unscanned_here = {i for s, u, r in groups if r == 1 for i in range(s, s + u)} & set(here)
    if len(unscanned_here) == len(unscanned) and sorted(loops) == sorted((len(u), r) for u, r in units):
      return blocks
  raise ValueError(f"blocks {run.start}-{run.stop - 1} of {config.pattern!r} have no order that scans them in "
                   f"{[u for u, _ in units]} and keeps the {len(unscanned)} unscanned blocks unscanned; compile without "
                   "regrouping")


def _distinct(items):
  seen = set()
  for item in items:
    if item not in seen:
      seen.add(item)
      yield item


def _units(kinds: str) -> list[tuple[str, int]]:
  """``[(unit, repeats)]``: the kinds of equal count interleaved in one unit (in the order they first appear),
  repeated that count (Super's 32 Mamba and 32 MoE blocks: "ME" x 32, as the configured pattern alternates them)."""
  counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
  return [("".join(k for k in counts if counts[k] == c), c) for c in dict.fromkeys(counts.values())]


def regrouped(config):
  """``config`` (a ``models.ModelConfig`` with ``scan_blocks``) with its blocks reordered by ``pattern``; refused
  where the reorder would change a block (``blocks``) or save no compile."""
  if not config.scan_blocks:
    raise ValueError("regrouping the blocks saves compile time only where the repeated groups are scanned: set "
                     "--config.model.scan_blocks=True (the step's cost is the same), or compile without regrouping")
  out = config.replace(pattern=pattern(config))
  if blocks(out) != blocks(config):   # a precision rule that names a block kind's place would make another model
    raise ValueError(f"regrouping {config.pattern!r} as {out.pattern!r} changes which blocks run which precision "
                     "or which are scanned; compile without regrouping")
  return out


def blocks(config) -> list[tuple]:
  """``(kind, precision signature, scanned)`` of every block of ``config``, sorted: what regrouping keeps."""
  scanned = {i for start, unit, repeats in lm.block_groups(config) if repeats > 1
             for i in range(start, start + unit * repeats)}
  return sorted((k, policy.block_signature(config, i), i in scanned) for i, k in enumerate(config.pattern))


def describe(config) -> dict:
  """What regrouping ``config`` (a ``models.ModelConfig``) does: both patterns and their groups' distinct blocks."""
  out = regrouped(config)
  return dict(pattern=config.pattern, regrouped=out.pattern,
              groups=len(lm.block_groups(config)), distinct_blocks=sum(u for _, u, _ in lm.block_groups(config)),
              regrouped_groups=len(lm.block_groups(out)),
              regrouped_distinct_blocks=sum(u for _, u, _ in lm.block_groups(out)))
