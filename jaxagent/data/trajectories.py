"""Stored trajectories as training data, read through grain: select with a filter, then batches by step.

    selection = select(other_run / "trajectories", DataFilter(verified=True), exclude=("env_error", ...))
    examples = Examples(selection.fetch, len(selection), seed)
    trajectories = examples.batch(step, 32)    # a pure function of (seed, step): resume needs no iterator state

`select` reads every record once (grain's `ArrayRecordDataSource` over the store's finished shards), counts what
it keeps and why it drops the rest, and keeps the per-record facts the learners need (returns per turn, group,
behavior policy version); the records themselves stay on disk and are decoded again when a batch uses them. An
unreadable record (a damaged chunk, a malformed record) is counted and skipped, never fatal: the store's crash
rule is that damage stays local to the records it touches.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.config import DataFilter


def rejects(t: tr.Trajectory, data_filter: DataFilter, exclude: Sequence[str] = ()) -> str | None:
  """Why `t` is not selected (a short reason), or None when it is."""
  if t.termination.value in exclude:
    return "infrastructure_failure"
  if not t.turns:
    return "no_action"
  if data_filter.verified is not None and bool(t.verifier.passed) != data_filter.verified:
    return "verified" if t.verifier.passed else "not_verified"
  if data_filter.min_reward is not None and t.reward.total < data_filter.min_reward:
    return "reward_below_min"
  if data_filter.terminations is not None and t.termination.value not in data_filter.terminations:
    return "termination"
  if data_filter.splits is None and t.task.split != "train":
    return "held_out_split"  # tune / eval episodes train only when the filter names their split
  if data_filter.splits is not None and t.task.split not in data_filter.splits:
    return "split"
  return None


@dataclasses.dataclass(frozen=True)
class Selection:
  """The selected records of a store and their learner-side facts (arrays indexed by selected position).

  Attributes:
    fetch: position -> the decoded `Trajectory`.
    rewards: float32[N, S] per-turn rewards with the terminal reward on the last turn (`advantage_inputs`).
    mask: bool[N, S] valid turns.
    groups: int32[N] dense group index (records sharing a `group_id`: one task's samples).
    policy_versions: int32[N] the behavior policy's version.
    counts: read, kept, unreadable, and one `dropped/<reason>` per filter reason.
  """
  fetch: Callable[[int], tr.Trajectory]
  rewards: np.ndarray
  mask: np.ndarray
  groups: np.ndarray
  policy_versions: np.ndarray
  counts: dict[str, int]

  def __len__(self) -> int:
    return int(self.groups.shape[0])

  def line(self) -> str:
    dropped = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in sorted(self.counts.items()) if k.startswith("dropped/"))
    return (f"{self.counts['kept']} of {self.counts['read']} stored trajectories selected"
            + (f" (dropped: {dropped})" if dropped else "")
            + (f"; {self.counts['unreadable']} unreadable record(s) skipped" if self.counts["unreadable"] else ""))


def select(path, data_filter: DataFilter, *, exclude: Sequence[str] = (), max_turns: int | None = None,
           gamma: float = 1.0, max_length: int | None = None) -> Selection:
  """The records of the store at `path` (a directory of shards or one shard) that `data_filter` keeps; with
  `max_length`, longer ones are dropped (`too_long`: they do not fit the run's context)."""
  source = trajectory_store.data_source(path)
  kept: list[int] = []
  rewards, groups, versions = [], [], []
  counts: collections.Counter = collections.Counter()
  group_index: dict[str, int] = {}
  for i in range(len(source)):
    counts["read"] += 1
    try:
      t = trajectory_store.decode(source[i])
    except (tr.TrajectoryFormatError, RuntimeError, ValueError):
      counts["unreadable"] += 1
      continue
    reason = rejects(t, data_filter, exclude)
    if reason is None and max_length is not None and len(t) > max_length:
      reason = "too_long"
    if reason is not None:
      counts[f"dropped/{reason}"] += 1
      continue
    kept.append(i)
    per_turn = [turn.reward for turn in t.turns]
    per_turn[-1] += gamma * t.reward.terminal
    rewards.append(per_turn)
    groups.append(group_index.setdefault(t.group_id, len(group_index)))
    versions.append(t.policy_version)
  counts["kept"] = len(kept)
  counts.setdefault("unreadable", 0)
  steps = max([len(r) for r in rewards] + [max_turns or 1])
  rewards_ns = np.zeros((len(kept), steps), np.float32)
  mask_ns = np.zeros((len(kept), steps), bool)
  for k, r in enumerate(rewards):
    rewards_ns[k, :len(r)] = r
    mask_ns[k, :len(r)] = True
  kept_index = np.asarray(kept, np.int64)
  fetch = lambda position: trajectory_store.decode(source[int(kept_index[position])])
  return Selection(fetch=fetch, rewards=rewards_ns, mask=mask_ns, groups=np.asarray(groups, np.int32),
                   policy_versions=np.asarray(versions, np.int32), counts=dict(counts))


class Examples:
  """`n` examples in a grain `MapDataset` shuffled with `seed` and reshuffled every epoch: batch `step` is the
  examples at positions [step * size, (step + 1) * size) of that endless order, a pure function of (seed, step)."""

  def __init__(self, fetch: Callable[[int], Any], n: int, seed: int):
    import grain
    if n < 1:
      raise ValueError("no example to train on")
    self.n = n
    self._order = grain.MapDataset.range(n).shuffle(seed=seed).repeat()
    self._fetch = fetch

  def positions(self, step: int, size: int) -> list[int]:
    return [int(self._order[step * size + j]) for j in range(size)]

  def batch(self, step: int, size: int, *, part: tuple[int, int] = (0, 1)) -> tuple[list[int], list[Any]]:
    """Batch `step` of `size` examples; `part=(p, n)`: only the p-th of n equal slices (a process's rows).
    Returns the examples' positions and the examples."""
    positions = self.positions(step, size)
    p, n = part
    local = size // n
    mine = positions[p * local:(p + 1) * local]
    return mine, [self._fetch(i) for i in mine]
