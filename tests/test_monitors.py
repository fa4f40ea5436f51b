"""Training-health monitors: the echo-trap and template-collapse rules on metric series, the task-identification
proxy on trajectories, and the StarPO-S variance filter."""

import dataclasses
import random

import numpy as np
import pytest

from jaxagent import config as config_lib
from jaxagent.train import learner, monitors
from tests import _trajectories

CFG = config_lib.MonitorsConfig(window=3)


def _feed(series, cfg=CFG):
  mon, fired = monitors.Monitors(cfg), []
  for it, m in enumerate(series):
    m = dict(m)
    mon, alerts = mon.observe(it, m)
    fired += [(a.kind, it) for a in alerts]
  return fired, m


def _healthy(n):
  rng = np.random.default_rng(0)
  return [{"reward_std_within_group": 0.4 + 0.05 * rng.standard_normal(), "entropy": 1.0 + 0.05 * rng.standard_normal(),
           "grad_norm": 1.0 + 0.1 * rng.standard_normal(), monitors.TASK_IDENTIFICATION: 0.6} for _ in range(n)]


def test_echo_trap_fires_once_when_all_three_signals_turn_and_not_on_one_alone():
  collapse = [{"reward_std_within_group": 0.05, "entropy": 0.2, "grad_norm": 8.0,
               monitors.TASK_IDENTIFICATION: 0.6}] * 4
  fired, last = _feed(_healthy(9) + collapse)
  assert fired == [("echo_trap", 10)]  # the collapse began at 9: two of the 3-window suffice
  assert last[monitors.ECHO_TRAP] == 1 and last[monitors.TEMPLATE_COLLAPSE] == 0
  assert _feed(_healthy(30))[0] == []
  for keep in ("reward_std_within_group", "entropy", "grad_norm"):  # one signal stays healthy: no alarm
    partial = [{**c, keep: _healthy(1)[0][keep]} for c in collapse]
    assert _feed(_healthy(9) + partial)[0] == [], keep
  off = dataclasses.replace(CFG, echo_trap=False)
  assert _feed(_healthy(9) + collapse, off)[0] == []


@pytest.mark.parametrize("cut", [4, 10, 11])  # before the windows fill, inside the collapse, after its alert
def test_monitors_restored_from_a_checkpoint_alert_as_the_uninterrupted_run(cut):
  """A run checkpointed after `cut` iterations and resumed (its state through JSON, as checkpoint metadata)
  watches the same windows: the same alerts at the same iterations, the same flags, and an alert already
  reported before the checkpoint is not reported again."""
  import json
  series = _healthy(9) + [{"reward_std_within_group": 0.05, "entropy": 0.2, "grad_norm": 8.0,
                           monitors.TASK_IDENTIFICATION: 0.6}] * 4

  def run(mon, start, stop, fired, flags):
    for it in range(start, stop):
      m = dict(series[it])
      mon, alerts = mon.observe(it, m)
      fired += [(a.kind, it) for a in alerts]
      flags.append(m)
    return mon

  fired, flags = [], []
  run(monitors.Monitors(CFG), 0, len(series), fired, flags)
  before, resumed_fired, resumed_flags = monitors.Monitors(CFG), [], []
  before = run(before, 0, cut, resumed_fired, resumed_flags)
  after = monitors.Monitors.from_checkpoint(CFG, json.loads(json.dumps(before.to_checkpoint())))
  run(after, cut, len(series), resumed_fired, resumed_flags)
  assert fired == resumed_fired == [("echo_trap", 10)]
  assert flags == resumed_flags
  assert monitors.Monitors(CFG).to_checkpoint() == {"history": {}, "active": []}


def test_template_collapse_fires_when_actions_stop_naming_tasks_while_entropy_stays():
  blind = [{**m, monitors.TASK_IDENTIFICATION: 0.02} for m in _healthy(5)]
  fired, _ = _feed(_healthy(9) + blind)
  assert fired == [("template_collapse", 11)]
  low_entropy = [{**m, "entropy": 0.1} for m in blind]  # collapsed to one output: that is not this alarm
  assert ("template_collapse", 11) not in _feed(_healthy(9) + low_entropy)[0]
  # Actions that never told tasks apart (a small action vocabulary, an untrained policy) never fell: no alarm.
  assert _feed([{**m, monitors.TASK_IDENTIFICATION: 0.05} for m in _healthy(20)])[0] == []


def _traj(task, actions):
  t = _trajectories.make(task_id=task, turns=tuple((a, "ok") for a in actions))
  return dataclasses.replace(t, group_id=task)


def test_task_identification_is_high_for_task_dependent_actions_and_chance_otherwise():
  rng = random.Random(0)
  tasks = [f"t{i}" for i in range(8)]
  dependent = [_traj(t, [f"calc {i}*{i + 3}", f"answer {i * (i + 3)}"]) for i, t in enumerate(tasks) for _ in range(4)]
  same = [_traj(t, ["move up", "move up"]) for t in tasks for _ in range(4)]
  noise = [_traj(t, ["".join(rng.choice("abcdefgh") for _ in range(8))]) for t in tasks for _ in range(4)]
  assert monitors.task_identification(dependent) == pytest.approx(1.0)
  assert monitors.task_identification(same) == pytest.approx(0.0, abs=1e-9)
  assert abs(monitors.task_identification(noise)) < 0.15
  assert monitors.task_identification(same[:4]) is None  # one task: nothing to tell apart


def test_variance_filter_keeps_the_groups_whose_returns_vary_most():
  def group(name, totals):
    return [dataclasses.replace(_traj(name, ["x"]), reward=_trajectories.tj.Reward(total=r + 0.0, terminal=r))
            for r in totals]
  trajs = group("flat", [1, 1, 1]) + group("wide", [0, 1, 0]) + group("some", [0, 0, 0.5]) + group("zero", [0, 0, 0])
  train = np.ones(len(trajs), bool)
  kept = learner.variance_kept(0.5, trajs, train)
  assert [t.group_id for t, k in zip(trajs, kept) if k] == ["wide"] * 3 + ["some"] * 3
  assert learner.variance_kept(1.0, trajs, train).all()
  assert learner.variance_kept(0.1, trajs, train).sum() == 3  # at least one group
