"""`jaxagent plan --fit`: the largest rollout batch and the smallest micro-batch count that fit a topology.

Rows grow in steps of whole GRPO groups that every host and every rollout batch shard divide evenly (a batch the
shards do not divide would be replicated, which is never what a user wants); the search doubles the tasks per
iteration until the rollout programs stop fitting, then bisects. The micro-batch count is the smallest whose
micro-batches the learner's batch shards divide and whose train step fits. Every probe is a compile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxagent import config as config_lib
from jaxagent import multihost
from jaxagent import sharding as sharding_lib
from jaxagent.config import Config
from jaxagent.plan.planner import Plan, make_plan
from jaxagent.plan.topologies import GIB, Topology
from jaxagent.train import run as run_lib

MAX_TASKS = 1 << 14


@dataclasses.dataclass(frozen=True)
class Probe:
  setting: str          # "train.tasks_per_iteration" or "train.micro_batches"
  value: int
  fits: bool
  peak_bytes: int       # the largest program of the probe, per device


@dataclasses.dataclass(frozen=True)
class Fit:
  """The settings found, the step between row counts, every probe in order, and the plan at the settings."""
  tasks_per_iteration: int
  micro_batches: int
  task_step: int
  probes: tuple[Probe, ...]
  plan: Plan

  @property
  def overrides(self) -> list[str]:
    return [f"train.tasks_per_iteration={self.tasks_per_iteration}", f"train.micro_batches={self.micro_batches}"]

  def lines(self) -> list[str]:
    shown = ", ".join(f"{p.value}{'' if p.fits else ' (no)'}" for p in self.probes
                      if p.setting == "train.tasks_per_iteration")
    micro = ", ".join(f"{p.value}{'' if p.fits else ' (no)'}" for p in self.probes if p.setting == "train.micro_batches")
    return [f"fit: tasks per iteration tried {shown} (steps of {self.task_step}); micro-batches tried {micro}",
            "fit: " + " ".join(f"--set {o}" for o in self.overrides)]

  def to_json(self) -> dict:
    return {"tasks_per_iteration": self.tasks_per_iteration, "micro_batches": self.micro_batches,
            "task_step": self.task_step, "overrides": self.overrides,
            "probes": [dataclasses.asdict(p) for p in self.probes]}


def _shards(cfg: Config, topology: Topology, role: str) -> int:
  """How many blocks a large batch is split into on `role`'s mesh by its rules."""
  learner, rollout = sharding_lib.placement_meshes(cfg.mesh, topology.devices)
  mesh = rollout if role == "rollout" else learner
  return multihost.batch_shards(mesh.devices.size * 1024, mesh, sharding_lib.rules_for(role, cfg.mesh))[1]


def _with(cfg: Config, **train) -> Config:
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def fit(cfg: Config, topology: Topology, *, headroom: float = 0.1,
        progress: Callable[[str], None] | None = None) -> Fit:
  """Searches train.tasks_per_iteration (rollout rows, groups of train.group_size), then train.micro_batches.

  Raises:
    ConfigError: rollout.slots fixes the rows, or even the smallest batch (or the most micro-batches) does not fit.
  """
  if cfg.rollout.slots is not None:
    raise config_lib.ConfigError(f"--fit searches train.tasks_per_iteration, but rollout.slots={cfg.rollout.slots} "
                                 "fixes the rollout rows: set rollout.slots=null")
  group = cfg.train.group_size
  shards = _shards(cfg, topology, "rollout")
  step = math.lcm(topology.hosts, shards // math.gcd(shards, group))
  probes: list[Probe] = []
  fitting: dict[int, Plan] = {}  # tasks -> the rollout and reshard programs compiled at them

  def rollout_fits(tasks: int) -> bool:
    if progress:
      progress(f"fit: {tasks} tasks x {group} = {tasks * group} rollout rows")
    p = make_plan(_with(cfg, tasks_per_iteration=tasks), topology, headroom=headroom, groups=("reshard", "rollout"))
    probes.append(Probe("train.tasks_per_iteration", tasks, p.fits, p.worst.peak_bytes))
    if p.fits:
      fitting[tasks] = p
    return p.fits

  if not rollout_fits(step):
    raise config_lib.ConfigError(
        f"--fit: even {step} tasks x {group} rows do not fit {topology.name}: the rollout needs "
        f"{probes[-1].peak_bytes / GIB:.2f} GiB per device (of {topology.device_hbm / GIB:.1f}); a smaller "
        "rollout.max_context, more tensor parallelism (mesh.ici.tensor) or a larger slice")
  good, bad = 1, None
  while bad is None and good * step * 2 <= MAX_TASKS:
    if rollout_fits(good * 2 * step):
      good *= 2
    else:
      bad = good * 2
  while bad is not None and bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if rollout_fits(mid * step) else (good, mid)
  tasks = good * step

  sized = _with(cfg, tasks_per_iteration=tasks)
  train_rows = run_lib.train_rows(sized, tasks * group, len(topology.devices))
  learner_shards = _shards(cfg, topology, "learner")
  candidates = [m for m in range(1, train_rows + 1)
                if train_rows % m == 0 and (train_rows // m) % min(learner_shards, train_rows // m) == 0]
  micro, update = None, None
  for m in candidates:
    if progress:
      progress(f"fit: {train_rows} train rows in {m} micro-batch(es)")
    p = make_plan(_with(sized, micro_batches=m), topology, headroom=headroom, groups=("update",))
    probes.append(Probe("train.micro_batches", m, p.fits, p.worst.peak_bytes))
    if p.fits:
      micro, update = m, p
      break
  if micro is None:
    raise config_lib.ConfigError(
        f"--fit: {tasks} tasks fit the rollout, but no micro-batch count up to {candidates[-1]} fits the train step "
        f"({probes[-1].peak_bytes / GIB:.2f} GiB per device): train.remat=full, model.attention=chunked, "
        "train.logits_chunk, or a smaller rollout.max_context")
  final = make_plan(_with(sized, micro_batches=micro), topology, headroom=headroom, progress=progress,
                    compiled=update.programs + fitting[tasks].programs)
  return Fit(tasks_per_iteration=tasks, micro_batches=micro, task_step=step, probes=tuple(probes), plan=final)
