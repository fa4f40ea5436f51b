"""Every seed the trainer derives from `run.seed`, each a named derivation in this one module.

A seed is `stable_seed(*parts)`: blake2b of the parts' repr, 31 bits, independent of Python's hash
randomization and of the process that computes it. Two places that must agree (the held-out task list that
`jaxagent train` evaluates on and the one `jaxagent tasks check` screens for contamination) call the same
function here instead of repeating its parts. Changing any derivation changes what a seeded run does: every
`make run` number and every resumed run's continuation.

Streams, by name (the first part after the run seed):
  env         per-episode env seeds of an rl iteration's rows (round 0, dynamic-sampling refills, rft rounds)
  eval        the held-out task list of a split, and the env seeds of its episodes
  eval-rng    the sampling key of each evaluation call
  stage       a curriculum stage's task supply / demonstrations (the stage named first keeps the run seed)
  demo, bc    scripted demonstrations and the behavior-cloning minibatch order
  data, rft   an sft/offline stage's example order; rft's kept-sample order per round
  frontier    the frontier sampler's draws
  lora        LoRA's initial adapter weights
  policy-filter, policy-filter-rng
              `jaxagent tasks filter --policy`: env seeds and sampling keys of the policy's samples
  pass-k, pass-k-rng
              an evaluation suite's k samples per task (pass@k, pass^k): env seeds and sampling keys

The rollout's JAX sampling key is `train/run.py:rollout_key` (folds of the train state's key), not a seed here.
This module imports nothing of jaxagent (docs/design.md §3.1).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence


def stable_seed(*parts: Any) -> int:
  """A stable 31-bit seed from any parts (independent of Python's hash randomization)."""
  digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


def held_out(seed: int, split: str) -> int:
  """The generator seed of `split`'s held-out task list (training's evaluation and `jaxagent tasks check`)."""
  return stable_seed(seed, "eval", split)


def episodes(seed: int, iteration: int, rows: int, process: int, *, kind: str | None = None,
             round_: int = 0) -> list[int]:
  """Env seeds of this process's `rows` rollout rows (global row index `process * rows + i`) in `iteration`.

  kind None: the iteration's first rl round; "refill": dynamic sampling's round `round_`; "rft": rejection
  sampling's round `round_`."""
  prefix = (seed, "env", iteration) if kind is None else (seed, "env", iteration, kind, round_)
  return [stable_seed(*prefix, process * rows + i) for i in range(rows)]


def eval_episodes(seed: int, split: str, start: int, rows: Sequence[int]) -> list[int]:
  """Env seeds of an evaluation call's rows: held-out task `start + i` for each global row `i`."""
  return [stable_seed(seed, "eval", split, start + i) for i in rows]


def eval_rng(seed: int, start: int) -> int:
  """The sampling seed of the evaluation call whose first task is `start`."""
  return stable_seed(seed, "eval-rng", start)


def stage(seed: int, index: int, first: int) -> int:
  """Curriculum stage `index`'s seed: the run seed itself for stage `first` (so a one-stage run draws what a
  run without a curriculum draws), a derived one for the others."""
  return seed if index == first else stable_seed(seed, "stage", index)


def demos(seed: int) -> int:
  return stable_seed(seed, "demo")


def bc_order(seed: int, step: int) -> int:
  """The behavior-cloning minibatch order from step `step` on (resumable: a function of the step)."""
  return stable_seed(seed, "bc", step)


def data_order(seed: int, stage_index: int) -> int:
  """An sft/offline stage's example order."""
  return stable_seed(seed, "data", stage_index)


def rft_order(seed: int, iteration: int) -> int:
  """The order of rft's kept samples at `iteration`."""
  return stable_seed(seed, "rft", iteration)


def frontier(seed: int, iteration: int, round_: int) -> int:
  return stable_seed(seed, "frontier", iteration, round_)


def lora(seed: int) -> int:
  return stable_seed(seed, "lora")


def policy_filter(seed: int, start: int, rows: Sequence[int]) -> list[int]:
  """`jaxagent tasks filter --policy`: env seeds of the call whose first task is `start`, for global rows `rows`."""
  return [stable_seed(seed, "policy-filter", start + i) for i in rows]


def policy_filter_rng(seed: int, start: int) -> int:
  return stable_seed(seed, "policy-filter-rng", start)


def pass_k(seed: int, split: str, start: int, rows: Sequence[int]) -> list[int]:
  """An evaluation suite's pass^k call whose first task is `start`: env seeds of global rows `rows`."""
  return [stable_seed(seed, "pass-k", split, start, i) for i in rows]


def pass_k_rng(seed: int, start: int) -> int:
  return stable_seed(seed, "pass-k-rng", start)
