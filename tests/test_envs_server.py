"""The worker's instance table (envs/server.py `Host`): every env it makes is closed exactly once.

Written against the Host API only (no typed StepResult fields), so it also runs on older trees.
"""

import pytest

import envs
from envs.server import Host, RequestError


class _CountedEnv(envs.Env):
  """Counts constructions and closes on the class: made - closed is the number of envs still open."""

  name = "counted"
  parser = envs.ActionParser(tools=("ok",))
  made = 0
  closed = 0

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    type(self).made += 1
    self._open = True

  def _reset(self, task, seed):
    if task.payload.get("fail"):
      raise envs.EnvError("this reset fails")
    return "ready"

  def _step(self, call):
    return envs.StepResult(envs.Observation("ok"), {}, False, None)

  def close(self):
    if self._open:
      self._open = False
      type(self).closed += 1


def _tasks(split, n, seed=0):
  return [envs.Task(f"counted-{i}", split, {}, "0") for i in range(n)]


SPEC = envs.EnvSpec(name="counted", description="counts open envs", make=_CountedEnv, tasks=_tasks,
                    demo=lambda task, seed=0: ["ok"], version_sources=(_CountedEnv,))
TASK = _tasks("train", 1)[0].to_wire()


@pytest.fixture
def host():
  _CountedEnv.made = _CountedEnv.closed = 0
  h = Host(f"{__name__}:SPEC", max_instances=2)
  yield h
  h.close_all()


def _open():
  return _CountedEnv.made - _CountedEnv.closed


def _reset(h, instance):
  return h.handle("reset", {"instance": instance, "task": TASK, "seed": 0, "options": {}})


def test_reset_refused_for_too_many_instances_makes_no_env_and_leaks_none(host):
  _reset(host, "a")
  _reset(host, "b")
  assert _open() == 2
  for _ in range(3):
    with pytest.raises(RequestError, match="2 instances") as err:
      _reset(host, "c")
    assert err.value.kind == "too_many_instances"
  # A refused reset is refused before an env is built (a full server under admission pressure refuses often):
  # only a and b were ever made and are open. (A reset that loses a race for the last place closes the env it
  # made: the table is checked again when it is entered.)
  assert (_CountedEnv.made, _open()) == (2, 2)
  # A full table still lets an existing instance start a new episode: the old env is closed, the new one kept.
  _reset(host, "a")
  assert (_CountedEnv.made, _open()) == (3, 2)
  assert host.handle("step", {"instance": "a", "action": "ok"})["observation"]["text"] == "ok"
  host.handle("close", {"instance": "b"})
  assert _open() == 1
  _reset(host, "c")
  assert _open() == 2
  host.close_all()
  assert _open() == 0


def test_a_failed_reset_holds_no_instance_and_closes_its_env(host):
  failing = dict(TASK, payload={"fail": True})
  for name in ("a", "b", "c"):   # more failures than the table has places
    with pytest.raises(envs.EnvError, match="this reset fails"):
      host.handle("reset", {"instance": name, "task": failing, "seed": 0, "options": {}})
  assert (_CountedEnv.made, _open()) == (3, 0)
  _reset(host, "a")
  _reset(host, "b")   # both places are free
  assert _open() == 2
