"""Terminal env: real shell commands in the bubblewrap sandbox; the verifier checks the resulting state."""

import pytest

import envs
from envs import pool as pool_lib
from tests._sandbox import require_bwrap

SPEC = envs.get("terminal")


def test_demos_pass_and_wrong_state_fails_inprocess():
  for split in envs.SPLITS:
    for i, task in enumerate(SPEC.tasks(split, 4, 0)):
      env = SPEC.make()
      env.reset(task, i)
      results = [env.step(a) for a in SPEC.demo(task, i)]
      assert results[-1].termination == "completed" and results[-1].info["passed"], (task, results)
      env.reset(task, i)
      assert env.step("done").info["passed"] is False   # nothing done: the verifier says so
      env.close()


def test_runs_sandboxed_with_full_replay():
  require_bwrap()
  tasks = SPEC.tasks("train", 4, 0)
  traces = []
  with pool_lib.make_pool(4, env="terminal", kind="local", sandbox="bwrap") as p:
    for _ in range(2):
      p.reset_many(range(4), tasks, range(4))
      first = p.step_many(range(4), ["sh ls -R | sort"] * 4)
      rest = [p.step_many(range(4), [SPEC.demo(t)[j] for t in tasks]) for j in range(2)]
      traces.append([r.observation.text for r in first] + [r.observation.text for rs in rest for r in rs])
      assert all(r.info["passed"] for r in rest[-1])
  assert traces[0] == traces[1]
  assert "exit 0" in traces[0][0]
