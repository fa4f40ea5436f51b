"""Perturbed tools (envs/perturb.py): injected by the worker around an unedited env, deterministic per episode,
each kind doing what it says, through in-process and subprocess pools."""

from __future__ import annotations

import random
import re
import time

import pytest

import envs
from envs import perturb
from envs.builtin import calculator

TASK = calculator.tasks("train", 1, 0)[0]


def _episode(pool_kind: str, actions: list[str], seed: int = 3, max_turns: int = 6, **perturbation):
  with envs.pool.make_pool(1, env="calculator", kind=pool_kind, max_turns=max_turns,
                           perturb=perturbation or None) as pool:
    first = pool.reset(0, TASK, seed)
    return first, [pool.step_many([0], [a])[0] for a in actions]


def test_no_perturbation_is_the_env_itself():
  env = calculator.SPEC.make()
  assert perturb.wrap(env, None) is env and perturb.wrap(env, {}) is env
  assert envs.pool.PoolConfig(perturb={}).perturb is None and "perturb" not in envs.pool.PoolConfig().reset_options()


@pytest.mark.parametrize("bad, says", [
    ({"transient": 0.2}, "unknown key(s) ['transient']"), ({"transient_p": 1.0}, "transient_p=1.0"),
    ({"truncate_fraction": 0}, "truncate_fraction=0"), ({"latency_factor": 0.5}, "latency_factor=0.5"),
    ({"implicit_p": "often"}, "implicit_p='often'")])
def test_bad_perturbations_name_the_key_and_what_is_valid(bad, says):
  with pytest.raises(ValueError, match=re.escape(says)):
    envs.pool.PoolConfig(perturb=bad)


def test_down_tool_must_be_one_of_the_envs_tools():
  with pytest.raises(ValueError, match=r"down_tool='search'.*\['calc', 'answer'\]"):
    perturb.PerturbedEnv(calculator.SPEC.make(), perturb.Perturbation(down_tool="search"))


@pytest.mark.parametrize("kind", ["inprocess", "local"])
def test_a_down_tool_fails_every_call_and_the_env_never_runs_it(kind):
  q = TASK.payload["question"]
  first, steps = _episode(kind, [f"calc {q}", f"calc {q}", f"answer {calculator.safe_eval(q)}"], down_tool="calc")
  assert first.text == q
  assert [s.observation.text for s in steps[:2]] == [perturb.DOWN_REPLY.format(tool="calc")] * 2
  assert not steps[0].done and steps[2].done and steps[2].verdict.passed  # the other tool still works


def test_transient_failures_are_deterministic_per_episode_and_recover():
  q = TASK.payload["question"]
  actions = [f"calc {q}"] * 3
  runs = [[s.observation.text for s in _episode("inprocess", actions, seed=seed, max_turns=8, transient_p=0.5)[1]]
          for seed in range(12) for _ in range(2)]
  assert all(a == b for a, b in zip(runs[::2], runs[1::2]))  # the same episode meets the same faults
  answer, fault = str(calculator.safe_eval(q)), perturb.TRANSIENT_REPLY.format(tool="calc")
  flat = [t for r in runs for t in r]
  assert set(flat) == {answer, fault}  # a failed call is retried and may succeed: the env's state did not move
  assert 0.25 < flat.count(fault) / len(flat) < 0.75


def test_implicit_failures_change_one_digit_and_say_nothing():
  q = "12*7+5"
  task = envs.Task(id="c", split="train", payload=dict(TASK.payload, question=q), version="v")
  env = perturb.PerturbedEnv(calculator.SPEC.make(), perturb.Perturbation(implicit_p=1.0))
  env.reset(task, 0)
  obs = env.step("calc 12*7").observation
  assert obs.text != "84" and len(obs.text) == 2 and sum(a != b for a, b in zip(obs.text, "84")) == 1
  assert not obs.truncated and "error" not in obs.text
  rng = random.Random(0)
  assert perturb.corrupt("no digits", rng) is None
  for _ in range(50):  # a number keeps its length: no leading zero appears in a multi-digit one
    assert all(n == "0" or not n.startswith("0") for n in re.findall(r"\d+", perturb.corrupt("5 10 -31", rng)))


def test_truncation_cuts_tool_replies_not_the_task_and_flags_them():
  q = TASK.payload["question"]
  first, steps = _episode("inprocess", [f"calc {q}*1000"], truncate_fraction=0.5)
  assert first.text == q and not first.truncated
  full = str(calculator.safe_eval(f"{q}*1000"))
  obs = steps[0].observation
  assert obs.truncated and obs.text == full[:len(full) // 2] and obs.original_size == len(full)


def test_latency_multiplies_and_adds_a_capped_tail():
  env = perturb.PerturbedEnv(calculator.SPEC.make(), perturb.Perturbation(latency_median_s=0.05, latency_sigma=0.0,
                                                                          latency_cap_s=0.03))
  env.reset(TASK, 0)
  start = time.perf_counter()
  env.step("calc 1+1")
  assert 0.03 <= time.perf_counter() - start < 0.5  # the median (0.05) capped at 0.03


def test_the_verdict_and_state_keys_are_the_inner_envs():
  from envs.builtin import gridworld
  task = gridworld.tasks("train", 1, 0)[0]
  plain, wrapped = gridworld.SPEC.make(), perturb.PerturbedEnv(gridworld.SPEC.make(),
                                                               perturb.Perturbation(truncate_fraction=0.9))
  assert plain.reset(task, 0).state_key == wrapped.reset(task, 0).state_key
  for move in gridworld.demo(task):
    a, b = plain.step(move), wrapped.step(move)
    assert a.observation.state_key == b.observation.state_key and a.done == b.done
  assert a.verdict == b.verdict and b.verdict.passed
