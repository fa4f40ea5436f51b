"""Which train tasks each rollout round draws: the shuffled stream (`UniformTasks`) or a frontier curriculum
(`FrontierTasks`). Both are deterministic functions of (config, state): the state goes into every checkpoint and
a resumed run draws the same task sequence as an uninterrupted one.

The source of tasks is one grain pipeline over the train split's task indices, shuffled and repeated: the uniform
supply batches it, the frontier refills its active set from it (one index at a time).

Frontier (docs/design.md §2.7: tasks always or never solved give GRPO no signal). Each active task i keeps a Beta
posterior of its success rate under the current policy:

    a_i = a0 + Σ decayed successes,  b_i = b0 + Σ decayed failures,  p_i = a_i / (a_i + b_i)

with the prior a0 = prior · strength, b0 = (1 − prior) · strength. After every rollout round all evidence decays
(a ← a0 + decay · (a − a0), the same for b), so estimates follow the moving policy, and the round's outcomes are
added. A round draws B distinct active tasks with probability

    q_i = (1 − ε) · p_i (1 − p_i) / Σ_j p_j (1 − p_j)  +  ε / N

(p(1−p) is the variance of a task's reward, the GRPO signal; ε explores). A task retires when mastered (p_i ≥
`mastered` after `min_attempts` samples), when never solved in `unsolved_attempts` samples, or after `max_draws`
draws (measured: without that bound the default run trained on 73 distinct tasks in 125 iterations, memorized
them, 58 % train success, and its held-out success stalled at 11 % where uniform sampling was at 20 %); the
stream refills the set. Only trained outcomes count (an infrastructure failure says nothing about the task).

Multi-process: every process holds the same state, draws the same global batch and keeps its contiguous slice;
`record` gathers every process's outcomes first, so the state stays identical everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Protocol, Sequence

import grain
import numpy as np

import envs
from jaxagent import multihost, seeds
from jaxagent.config import ConfigError, TasksConfig


# Cumulative frontier counters among `record`'s metrics (a later round's values replace an earlier round's).
COUNTER_METRICS = ("curriculum/added", "curriculum/skipped", "curriculum/retired_mastered",
                   "curriculum/retired_unsolved", "curriculum/retired_used")


def list_identity(task_list: Sequence[envs.Task]) -> dict[str, Any]:
  """What a supply state's indices refer to: the list's length and a digest of its (id, version) pairs."""
  h = hashlib.blake2b(digest_size=8)
  for t in task_list:
    h.update(f"{t.id}\0{t.version}\n".encode())
  return {"count": len(task_list), "digest": h.hexdigest()}


def _check_identity(state: Mapping[str, Any], now: Mapping[str, Any]) -> None:
  stored = state.get("task_list")
  if stored is None:  # a checkpoint from before the identity was stored
    return
  if dict(stored) != dict(now):
    raise ConfigError(f"the checkpoint's task supply indexes another train task list ({stored['count']} tasks, "
                      f"digest {stored['digest']}) than this run's ({now['count']}, {now['digest']}): the "
                      "tasks.train_file, env.options or the env's task generator changed since; resuming would "
                      "draw other tasks than the uninterrupted run")


def stream(num_tasks: int, seed: int):
  """The train stream: task indices, shuffled once per epoch (grain), repeated forever."""
  return grain.MapDataset.range(num_tasks).shuffle(seed=seed).repeat()


class TaskSupply(Protocol):
  """What the loop asks of a task supply."""

  def draw(self, iteration: int, round_: int) -> list[envs.Task]:
    """This process's slice of the round's global batch of train tasks."""

  def record(self, tasks: Sequence[envs.Task], passed: np.ndarray, counted: np.ndarray) -> dict[str, float]:
    """The round's outcomes: `passed`/`counted` are [local tasks, G] (counted: a trained sample). Returns
    metrics."""

  def get_state(self) -> dict[str, Any]: ...

  def set_state(self, state: Mapping[str, Any]) -> None: ...

  def horizon(self, iterations: int, rounds: int) -> list[int]:
    """Indices (into the task list) of every train task a run of `iterations` can draw (contamination check)."""


class UniformTasks:
  """The shuffled train stream in batches of B (the data order of every run before the frontier existed)."""

  kind = "uniform"

  def __init__(self, task_list: Sequence[envs.Task], *, seed: int, batch: int, process: int, num_processes: int):
    self.task_list, self.seed = task_list, seed
    self._identity = list_identity(task_list)  # hashed once, stored with every checkpoint
    self._iter = iter(stream(len(task_list), seed).batch(batch, batch_fn=list))
    self._batch, self._local, self._process = batch, batch // num_processes, process

  def draw(self, iteration: int, round_: int) -> list[envs.Task]:
    del iteration, round_  # the stream's position is the state
    batch = next(self._iter)
    return [self.task_list[i] for i in batch[self._process * self._local:(self._process + 1) * self._local]]

  def record(self, tasks, passed, counted) -> dict[str, float]:
    return {}

  def get_state(self) -> dict[str, Any]:
    return {**self._iter.get_state(), "task_list": self._identity}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if isinstance(state, Mapping) and state.get("kind", self.kind) != self.kind:
      raise ConfigError(f"the checkpoint's task supply is tasks.sampler={state.get('kind')!r}, this run's is "
                        f"{self.kind!r}: resume with --set tasks.sampler={state.get('kind')}")
    _check_identity(state, self._identity)
    self._iter.set_state({k: v for k, v in state.items() if k not in ("task_list", "kind")})

  def horizon(self, iterations: int, rounds: int) -> list[int]:
    ds = stream(len(self.task_list), self.seed)
    return sorted({int(ds[i]) for i in range(min(len(self.task_list), iterations * rounds * self._batch))})


@dataclasses.dataclass(eq=False)  # compared by identity: two tasks may hold equal counts
class _Entry:
  """One active task: its index in the task list, Beta pseudo-counts and raw sample counts."""
  index: int
  a: float
  b: float
  attempts: int = 0
  successes: int = 0
  draws: int = 0

  @property
  def p(self) -> float:
    return self.a / (self.a + self.b)


class FrontierTasks:
  """The frontier curriculum (see the module docstring)."""

  kind = "frontier"

  def __init__(self, task_list: Sequence[envs.Task], config: TasksConfig, *, seed: int, batch: int, process: int,
               num_processes: int):
    self.task_list, self.config, self.seed = task_list, config, seed
    self._identity = list_identity(task_list)  # hashed once, stored with every checkpoint
    self._batch, self._local, self._process = batch, batch // num_processes, process
    self._a0, self._b0 = config.prior * config.prior_strength, (1 - config.prior) * config.prior_strength
    self._source = iter(stream(len(task_list), seed))
    self.active: list[_Entry] = []
    self.families: dict[str, list[float]] = {}  # tasks.family: a Beta [a, b] per family, decayed like a task's
    self.counters = dict(added=0, skipped=0, retired_mastered=0, retired_unsolved=0, retired_used=0, rounds=0)
    self._refill()
    self._last: list[int] = []  # positions in `active` of the last draw (global batch order)

  def _refill(self) -> None:
    held = {e.index for e in self.active}
    skips = 0
    while len(self.active) < self.config.active:
      index = int(next(self._source))
      if index in held:  # the stream came round to a task still active (more active tasks than the list)
        if len(held) >= len(self.task_list):
          break
        continue
      entry = _Entry(index, self._a0, self._b0)
      if skips < self.config.active and self._flat_family(entry):
        skips += 1  # its family is (for now) mastered or hopeless; decay lets the family back in later
        self.counters["skipped"] += 1
        continue
      held.add(index)
      self.active.append(entry)
      self.counters["added"] += 1

  def _flat_family(self, e: _Entry) -> bool:
    family = self._family(e)
    if family is None or family not in self.families:
      return False
    fa, fb = self.families[family]
    if fa + fb - self._a0 - self._b0 < self.config.min_attempts:  # too little (decayed) evidence to judge
      return False
    rate = fa / (fa + fb)
    return rate >= self.config.mastered or rate <= 1 - self.config.mastered

  def _family(self, e: _Entry) -> str | None:
    key = self.config.family
    return None if key is None else str(self.task_list[e.index].payload.get(key, ""))

  def estimate(self, e: _Entry) -> float:
    """The task's success estimate: its Beta mean, or with `tasks.family` its own (decayed) outcomes shrunk
    toward its family's current rate with `tasks.family_strength` pseudo-samples (a new task starts at its
    family's rate, not at the prior)."""
    family = self._family(e)
    if family is None:
      return e.p
    fa, fb = self.families.get(family, (self._a0, self._b0))
    s = self.config.family_strength
    wins, losses = e.a - self._a0, e.b - self._b0
    return (wins + s * fa / (fa + fb)) / (wins + losses + s)

  def probabilities(self) -> np.ndarray:
    p = np.asarray([self.estimate(e) for e in self.active], np.float64)
    w = p * (1 - p)
    eps = self.config.exploration
    return (1 - eps) * w / w.sum() + eps / len(w)

  def draw(self, iteration: int, round_: int) -> list[envs.Task]:
    rng = np.random.default_rng(seeds.frontier(self.seed, iteration, round_))
    picks = rng.choice(len(self.active), size=self._batch, replace=False, p=self.probabilities())
    self._last = [int(i) for i in picks]
    mine = self._last[self._process * self._local:(self._process + 1) * self._local]
    return [self.task_list[self.active[i].index] for i in mine]

  def record(self, tasks, passed, counted) -> dict[str, float]:
    passed = multihost.host_gather(np.asarray(passed, np.int64) * np.asarray(counted, np.int64))
    counted = multihost.host_gather(np.asarray(counted, np.int64))
    if len(passed) != len(self._last):
      raise AssertionError(f"record: {len(passed)} task outcomes for a draw of {len(self._last)}")
    cfg, a0, b0 = self.config, self._a0, self._b0
    drawn_p = [self.estimate(self.active[i]) for i in self._last]
    for e in self.active:
      e.a, e.b = a0 + cfg.decay * (e.a - a0), b0 + cfg.decay * (e.b - b0)
    for f in self.families.values():
      f[0], f[1] = a0 + cfg.decay * (f[0] - a0), b0 + cfg.decay * (f[1] - b0)
    for i, k, n in zip(self._last, passed.sum(axis=1), counted.sum(axis=1)):
      e = self.active[i]
      e.a, e.b = e.a + float(k), e.b + float(n - k)
      family = self._family(e)
      if family is not None:
        f = self.families.setdefault(family, [a0, b0])
        f[0], f[1] = f[0] + float(k), f[1] + float(n - k)
      e.attempts, e.successes, e.draws = e.attempts + int(n), e.successes + int(k), e.draws + 1
    keep = []
    for e in self.active:
      if e.attempts >= cfg.min_attempts and self.estimate(e) >= cfg.mastered:
        self.counters["retired_mastered"] += 1
      elif e.successes == 0 and e.attempts >= cfg.unsolved_attempts:
        self.counters["retired_unsolved"] += 1
      elif e.draws >= cfg.max_draws:
        self.counters["retired_used"] += 1
      else:
        keep.append(e)
    self.active, self._last = keep, []
    self.counters["rounds"] += 1
    self._refill()
    p = np.asarray([self.estimate(e) for e in self.active])
    return {"curriculum/drawn_p_mean": float(np.mean(drawn_p)),
            "curriculum/drawn_signal": float(np.mean([q * (1 - q) for q in drawn_p])),
            "curriculum/active_p_mean": float(p.mean()),
            **{f"curriculum/{k}": float(v) for k, v in self.counters.items() if k != "rounds"}}

  def get_state(self) -> dict[str, Any]:
    if self._last:
      raise AssertionError("a frontier state is taken between rounds (a draw is waiting for its record)")
    return {"kind": self.kind, "task_list": self._identity, "source": self._source.get_state(),
            "counters": dict(self.counters), "families": {k: list(v) for k, v in sorted(self.families.items())},
            "active": [[e.index, e.a, e.b, e.attempts, e.successes, e.draws] for e in self.active]}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or state.get("kind") != self.kind:
      kind = state.get("kind", "uniform") if isinstance(state, Mapping) else type(state).__name__
      raise ConfigError(f"the checkpoint's task supply is tasks.sampler={kind!r}, this run's is 'frontier': "
                        f"resume with --set tasks.sampler={kind}")
    _check_identity(state, self._identity)
    self._source.set_state(dict(state["source"]))
    self.counters = {**dict.fromkeys(self.counters, 0), **{k: int(v) for k, v in state["counters"].items()}}
    self.families = {str(k): [float(a), float(b)] for k, (a, b) in dict(state.get("families") or {}).items()}
    self.active = [_Entry(int(i), float(a), float(b), int(n), int(k), int(d)) for i, a, b, n, k, d in state["active"]]
    self._last = []

  def horizon(self, iterations: int, rounds: int) -> list[int]:
    # Every draw retires at most its B tasks, so the stream gives at most `active` + B per round, plus at most
    # `active` skipped tasks per refill (one refill per round) with tasks.family.
    ds = stream(len(self.task_list), self.seed)
    per_round = self._batch + (self.config.active if self.config.family is not None else 0)
    n = min(len(self.task_list), self.config.active + iterations * rounds * per_round)
    return sorted({int(ds[i]) for i in range(n)})


def make_supply(task_list: Sequence[envs.Task], config: TasksConfig, *, seed: int, batch: int, process: int,
                num_processes: int) -> TaskSupply:
  """The supply `config.sampler` names. The frontier needs at least B distinct tasks (it draws B distinct ones
  per round); its active set holds min(`tasks.active`, len(task_list))."""
  if config.sampler == "frontier":
    if len(task_list) < batch:
      raise ConfigError(f"tasks.sampler='frontier' draws train.tasks_per_iteration={batch} distinct tasks per "
                        f"round, but the train task list has {len(task_list)}; use more tasks or the uniform "
                        "sampler")
    config = dataclasses.replace(config, active=min(config.active, len(task_list)))
    if config.family is not None:
      missing = [t.id for t in task_list[:1000] if config.family not in t.payload]
      if missing:
        keys = sorted(task_list[0].payload) if task_list else []
        raise ConfigError(f"tasks.family={config.family!r}: not a payload key of task {missing[0]!r} (its keys: "
                          f"{keys})")
    return FrontierTasks(task_list, config, seed=seed, batch=batch, process=process, num_processes=num_processes)
  return UniformTasks(task_list, seed=seed, batch=batch, process=process, num_processes=num_processes)


class StageSupplies:
  """The task supply of each curriculum stage that samples (None for a stage that does not). A run's state owns
  one (`jaxagent.train.state.RunState.supplies`): their draw state advances with every round and is saved with
  the state's checkpoint."""

  def __init__(self, per_stage: Sequence[TaskSupply | None]):
    self.per_stage = tuple(per_stage)

  @property
  def first(self) -> TaskSupply | None:
    """The first sampling stage's supply (None: no stage samples)."""
    return next((s for s in self.per_stage if s is not None), None)

  def for_stage(self, stage: int) -> TaskSupply | None:
    """The supply stage `stage` draws from: its own; for a stage that does not sample, the first sampling
    stage's before it begins and the last one's once it is done."""
    sampling = [i for i, s in enumerate(self.per_stage) if s is not None]
    if not sampling:
      return None
    if stage in sampling:
      return self.per_stage[stage]
    return self.per_stage[sampling[0] if stage < sampling[0] else sampling[-1]]
