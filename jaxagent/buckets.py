"""Length buckets: the few static widths that jitted code compiles for, and the rule that picks one.

A batch or prompt is padded up to the smallest bucket that holds it, so a run compiles a handful of shapes instead
of one per length. One home for the lists (the sampler's prompt and observation widths, the learner's batch
lengths) and for the rule; a length above the largest bucket is an error, never a truncation. Imports nothing of
jaxagent (docs/design.md §3.1).
"""

from __future__ import annotations

from typing import Sequence


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2 lo, ..., up to hi (both powers of two)."""
  out = [lo]
  while out[-1] < hi:
    out.append(out[-1] * 2)
  return tuple(out)


PREFILL = powers_of_two(16, 32768)   # the sampler's prompt widths
EXTEND = powers_of_two(4, 4096)      # observation chunks: short, and every slot is one of the shared cache
BATCH = powers_of_two(128, 32768)    # assembled training batches (jaxagent/assembly.py)
BATCH_MIN = 32                       # the shortest update batch of a run (`batch_lengths`)


def up_to(limit: int, *, lo: int = 16, hi: int = 2048) -> tuple[int, ...]:
  """A run's prompt widths: the powers of two from `lo` below `limit` (at most `hi`), then `limit` itself (a
  prompt longer than `hi` pads to the context length)."""
  return tuple(b for b in powers_of_two(lo, hi) if b < limit) + (limit,)


def batch_lengths(limit: int) -> tuple[int, ...]:
  """A run's update-batch lengths: 32, 48, 64, 96, ... (powers of two from `BATCH_MIN` and 1.5 times each)
  below `limit` (the context length), then `limit` itself. A batch pads at most a third of its length (above
  the shortest), and a run compiles at most 2 ceil(log2(limit / 32)) + 1 update shapes, each the first time a
  batch needs it."""
  steps = powers_of_two(BATCH_MIN, max(limit, BATCH_MIN))
  return tuple(sorted({b for p in steps for b in (p, p * 3 // 2) if b < limit})) + (limit,)


def fit(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= length; ValueError when none is."""
  fits = [b for b in sorted(buckets) if b >= length]
  if not fits:
    raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}; raise the bucket or the "
                     "context budget (trajectories are never truncated here)")
  return fits[0]
