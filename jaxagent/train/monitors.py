"""Training-health monitors: signals every rl iteration logs, watched for the two collapses RAGEN describes.

  task_identification(trajectories)   -> float   how well actions tell their tasks apart (0 chance, 1 perfect)
  Monitors(config).observe(it, m)     -> Monitors, [Alert]  echo trap / template collapse, once per onset

Echo trap (RAGEN, arXiv:2504.20073): the within-group reward std falls off a cliff, the entropy drops and the
gradient norm spikes; then the policy collapses. Template collapse (RAGEN-2): the entropy stays up while the
actions stop depending on the input, which entropy cannot see; a mutual-information proxy between task and
action can. Ours is leave-one-out retrieval: each trajectory's actions (as a set of character 3-grams) look for
their most similar other trajectory of the batch; the score is how often that one ran the same task, rescaled so
that 0 is chance (identical or input-independent actions) and 1 is always.

The thresholds are `train.monitors` (config.py: MonitorsConfig); windows are of `window` iterations, compared
with the best window so far. Host-side, no JAX. The history is checkpointed (`to_checkpoint`), so a resumed run watches
the same windows, and alerts or stops (`train.monitors.action: stop`) where the uninterrupted run would.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any, Mapping, Sequence

from jaxagent import trajectory as tr
from jaxagent.train import metrics as metrics_lib

TASK_IDENTIFICATION = "monitor/task_identification"
ECHO_TRAP = "monitor/echo_trap"
TEMPLATE_COLLAPSE = "monitor/template_collapse"


def _grams(text: str, n: int = 3) -> frozenset[str]:
  return frozenset(text[i:i + n] for i in range(max(1, len(text) - n + 1)))


def task_identification(trajectories: Sequence[tr.Trajectory]) -> float | None:
  """Leave-one-out nearest-neighbour task retrieval from the actions, rescaled: (accuracy − chance) / (1 − chance).

  A trajectory's actions are the character 3-grams of its action texts (joined); its neighbours are the other
  trajectories at the highest Jaccard similarity (ties share the credit); it scores the fraction of them that
  ran its task. Chance is the same fraction for neighbours drawn uniformly. None: fewer than two tasks, or no
  trajectory with a same-task partner.
  """
  tasks = [t.task.id for t in trajectories]
  grams = [_grams("\n".join(turn.action.text for turn in t.turns)) for t in trajectories]
  n = len(trajectories)
  if n < 3 or len(set(tasks)) < 2:
    return None
  counts = collections.Counter(tasks)
  hits, chance, used = 0.0, 0.0, 0
  for i in range(n):
    if counts[tasks[i]] < 2:
      continue
    sims = [(len(grams[i] & grams[j]) / max(len(grams[i] | grams[j]), 1)) if j != i else -1.0 for j in range(n)]
    best = max(sims)
    nearest = [j for j in range(n) if sims[j] == best]
    hits += sum(tasks[j] == tasks[i] for j in nearest) / len(nearest)
    chance += (counts[tasks[i]] - 1) / (n - 1)
    used += 1
  if not used:
    return None
  accuracy, chance = hits / used, chance / used
  return (accuracy - chance) / (1.0 - chance)


@dataclasses.dataclass(frozen=True)
class Alert:
  kind: str          # "echo_trap" | "template_collapse"
  iteration: int
  message: str


def _mean(xs) -> float:
  return sum(xs) / len(xs)


@dataclasses.dataclass(frozen=True)
class Monitors:
  """The watched series and the collapses reported and not yet cleared: a value in the run's state
  (`jaxagent.train.state.RunState.monitors`), checkpointed with it. `observe` returns the next value; each
  collapse is reported when it starts, not again until it has cleared, and `observe` adds the monitor's flags
  (0/1) to the metrics it is given."""
  config: Any                                             # jaxagent.config.MonitorsConfig
  history: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
  active: frozenset[str] = frozenset()

  def to_checkpoint(self) -> dict:
    """What a checkpoint stores (JSON)."""
    return {"history": {k: list(v) for k, v in self.history.items()}, "active": sorted(self.active)}

  @classmethod
  def from_checkpoint(cls, config, stored: Mapping | None) -> "Monitors":
    """The value `to_checkpoint` stored (None: a fresh run, or a checkpoint from before monitors)."""
    stored = stored or {}
    return cls(config, {str(k): tuple(float(v) for v in vs) for k, vs in dict(stored.get("history") or {}).items()},
               frozenset(str(k) for k in stored.get("active") or ()))

  def _series(self, key: str) -> tuple[float, ...]:
    return self.history.get(key, ())

  def _window_means(self, key: str) -> tuple[float, float] | None:
    """(the last window's mean, the best earlier window mean), or None before two windows."""
    xs, w = self._series(key), self.config.window
    if len(xs) < 2 * w:
      return None
    best = max(_mean(xs[i:i + w]) for i in range(0, len(xs) - w))
    return _mean(xs[-w:]), best

  def echo_trap(self) -> str | None:
    cfg, w = self.config, self.config.window
    std = self._window_means(metrics_lib.REWARD_STD_WITHIN_GROUP)
    ent = self._window_means("entropy")
    grads = self._series("grad_norm")
    if std is None or ent is None or len(grads) < 2 * w:
      return None
    (std_now, std_best), (ent_now, ent_best) = std, ent
    spike, base = max(grads[-w:]), statistics.median(grads[:-w])
    if std_now <= (1 - cfg.std_drop) * std_best and ent_now <= (1 - cfg.entropy_drop) * ent_best \
        and spike >= cfg.grad_spike * base:
      return (f"echo trap: within-group reward std {std_now:.3f} (best window {std_best:.3f}), entropy "
              f"{ent_now:.3f} (best {ent_best:.3f}), grad_norm peak {spike:.3g} = {spike / max(base, 1e-12):.1f}x "
              f"the median before ({base:.3g}), over the last {w} iterations")
    return None

  def template_collapse(self) -> str | None:
    cfg, w = self.config, self.config.window
    ident = self._window_means(TASK_IDENTIFICATION)
    ent = self._window_means("entropy")
    if ent is None or ident is None:
      return None
    (ident_now, ident_best), (ent_now, ent_best) = ident, ent
    if ident_now <= cfg.identification_floor and ident_best >= cfg.identification_peak \
        and ent_now > (1 - cfg.entropy_drop) * ent_best:
      return (f"template collapse: actions identify their task at {ident_now:.3f} (0 = chance, floor "
              f"{cfg.identification_floor}; best window {ident_best:.3f}) over the last {w} iterations while the "
              f"entropy stays at {ent_now:.3f} (best window {ent_best:.3f}): outputs no longer depend on the input")
    return None

  def observe(self, iteration: int, metrics: dict) -> tuple["Monitors", list[Alert]]:
    """Records `metrics` (an rl iteration's), checks both collapses, adds their flags to `metrics`; returns the
    next value and the collapses that start here."""
    history = dict(self.history)
    for key in (metrics_lib.REWARD_STD_WITHIN_GROUP, "entropy", "grad_norm", TASK_IDENTIFICATION):
      if metrics.get(key) is not None:
        history[key] = (*history.get(key, ()), float(metrics[key]))
    now = dataclasses.replace(self, history=history)
    active, alerts = set(self.active), []
    for kind, on, check, flag in (("echo_trap", self.config.echo_trap, now.echo_trap, ECHO_TRAP),
                                  ("template_collapse", self.config.template_collapse, now.template_collapse,
                                   TEMPLATE_COLLAPSE)):
      if not on:
        continue
      message = check()
      metrics[flag] = int(message is not None)
      if message is None:
        active.discard(kind)
      elif kind not in active:
        active.add(kind)
        alerts.append(Alert(kind, iteration, message))
    return dataclasses.replace(now, active=frozenset(active)), alerts

  def summary(self) -> Mapping[str, int]:
    return {k: int(k in self.active) for k in ("echo_trap", "template_collapse")}
