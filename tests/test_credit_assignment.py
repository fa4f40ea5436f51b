"""Step-level credit: GiGPO's anchor-state step advantages, turn-level advantages, the envs' state keys."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.builtin import gridworld, guess
from jaxagent import algos
from jaxagent import trajectory as tj
from jaxagent.assembly import advantage_inputs, step_group_indices, turn_rewards
from tests import _trajectories
from tests.test_advantages import estimate


def _with_states(t: tj.Trajectory, keys, rewards, group_id) -> tj.Trajectory:
  """`t` with one turn per key (the helper's turns, repeated), those rewards and state keys."""
  base = t.turns
  turns = tuple(dataclasses.replace(base[i % len(base)], state_key=k, reward=r, reward_components={"outcome": r})
                for i, (k, r) in enumerate(zip(keys, rewards)))
  return dataclasses.replace(t, turns=turns, group_id=group_id,
                             reward=tj.Reward(total=sum(rewards), terminal=0.0))


def _example():
  """Task group g: three episodes from state a (hand-computed below); group h repeats key a (never pooled)."""
  t = _trajectories.make(turns=(("x", "o"), ("y", "o"), ("z", "o")))
  return [_with_states(t, "ab", [0, 1], "g"), _with_states(t, "acb", [0, 0, 1], "g"),
          _with_states(t, "acd", [0, 0, 0], "g"), _with_states(t, "a", [1], "h"),
          _with_states(t, "a", [0], "h")]


def test_gigpo_step_advantages_equal_a_hand_computed_example():
  trajs = _example()
  rewards, mask, groups = advantage_inputs(trajs, steps=3)
  steps = step_group_indices(trajs, steps=3)
  # a/g, b/g, c/g, d/g, a/h: five groups; keys of two task groups never share one.
  assert steps.tolist() == [[0, 1, -1], [0, 2, 1], [0, 2, 3], [4, -1, -1], [4, -1, -1]]
  out = estimate("gigpo", jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups),
                                     step_groups_ns=jnp.asarray(steps), step_gamma=0.5, step_weight=1.0,
                                     eps=1e-9)
  # Episode returns in g: 1, 1, 0 -> mean 2/3, std sqrt(2)/3: A_E = 1/sqrt2, 1/sqrt2, -sqrt2. In h: 1, 0 -> ±1.
  ae = [1 / math.sqrt(2), 1 / math.sqrt(2), -math.sqrt(2), 1.0, -1.0]
  # Step returns (γ = 0.5): [0.5, 1], [0.25, 0.5, 1], [0, 0, 0]; in h: [1], [0].
  # a/g {0.5, 0.25, 0}: mean 0.25, std sqrt(1/24) -> ±sqrt(1.5); b/g {1, 1}: equal -> 0; c/g {0.5, 0}: ±1;
  # d/g alone -> 0; a/h {1, 0}: ±1.
  a = math.sqrt(1.5)
  expected = [[ae[0] + a, ae[0] + 0.0, 0.0],
              [ae[1] + 0.0, ae[1] + 1.0, ae[1] + 0.0],
              [ae[2] - a, ae[2] - 1.0, ae[2] + 0.0],
              [ae[3] + 1.0, 0.0, 0.0],
              [ae[4] - 1.0, 0.0, 0.0]]
  np.testing.assert_allclose(np.asarray(out.advantages), expected, rtol=1e-5, atol=1e-6)
  stats = {k: float(v) for k, v in out.step_stats.items()}
  # Groups of >= 2 steps: a/g (3), b/g (2), c/g (2), a/h (2); 9 of the 10 valid steps are in one.
  assert stats == pytest.approx({"step_groups": 4, "grouped_step_fraction": 0.9, "step_group_size_mean": 2.25})
  # mean normalisation: R_t − mean, no std.
  plain = estimate("gigpo", jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups),
                                       step_groups_ns=jnp.asarray(steps), step_gamma=0.5, step_weight=2.0,
                                       scale_std=False)
  grpo_plain = estimate("grpo", jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups),
                                           scale_std=False)
  step = np.asarray(plain.advantages) - np.asarray(grpo_plain.advantages)
  np.testing.assert_allclose(step[:3], 2.0 * np.asarray([[0.25, 0, 0], [0, 0.25, 0], [-0.25, -0.25, 0]]),
                             atol=1e-6)


def test_gigpo_without_state_keys_is_grpo():
  t = _trajectories.make()
  trajs = [dataclasses.replace(t, group_id="g", reward=tj.Reward(total=r + 0.1, terminal=r)) for r in (1.0, 0.0, 0.5)]
  rewards, mask, groups = advantage_inputs(trajs)
  steps = step_group_indices(trajs)
  assert (steps == -1).all()  # the helper's turns name no state
  args = (jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups))
  gigpo = estimate("gigpo", *args, step_groups_ns=jnp.asarray(steps))
  np.testing.assert_array_equal(np.asarray(gigpo.advantages),
                                np.asarray(estimate("grpo", *args).advantages))
  assert float(gigpo.step_stats["step_groups"]) == 0


def test_turn_advantages_normalise_each_turn_over_the_group():
  t = _trajectories.make(turns=(("x", "o"), ("y", "o")))
  def with_components(comps, gid):
    turns = tuple(dataclasses.replace(t.turns[i], reward_components=c) for i, c in enumerate(comps))
    return dataclasses.replace(t, turns=turns, group_id=gid)
  trajs = [with_components([{"validity": 0.0}, {"progress": 1.0, "outcome": 1.0}], "g"),
           with_components([{"validity": -0.5}, {"progress": 0.0}], "g"),
           with_components([{"validity": -0.5}, {"progress": 0.0, "outcome": 5.0}], "h")]
  r = turn_rewards(trajs)
  np.testing.assert_array_equal(r, [[0.0, 1.0], [-0.5, 0.0], [-0.5, 0.0]])  # the outcome is left out
  _, mask, groups = advantage_inputs(trajs)
  adv = np.asarray(algos.turn_advantages(jnp.asarray(r), jnp.asarray(mask), jnp.asarray(groups), eps=1e-9))
  # g: turn 0 {0, -0.5} -> ±1, turn 1 {1, 0} -> ±1; h alone -> 0.
  np.testing.assert_allclose(adv, [[1, 1], [-1, -1], [0, 0]], atol=1e-6)


def test_envs_name_their_anchor_states():
  grid = gridworld.GridEnv()
  task = gridworld.tasks("train", 1, 0)[0]
  first = grid.reset(task, 0)
  assert first.state_key is not None and len(first.state_key) == 16
  moves = gridworld.demo(task)
  there = grid.step(moves[0])
  assert there.observation.state_key not in (None, first.state_key)
  grid.reset(task, 1)
  back = grid.step("move nowhere")  # an invalid action leaves A where it was
  assert back.outcome == envs.Outcome.INVALID_ACTION_CONTINUED and back.observation.state_key == first.state_key
  # Wire round trip keeps the key.
  assert envs.StepResult.from_wire(there.to_wire()).observation.state_key == there.observation.state_key
  # Guess: the same replies in another order reach the same state; another secret is another state.
  g = guess.GuessEnv()
  t = guess.tasks("train", 1, 0)[0]
  seed = next(s for s in range(100) if 6 < guess.secret(t, s) < 12)
  g.reset(t, seed)
  a = [g.step(x).observation.state_key for x in ("guess 3", "guess 14")][-1]
  g.reset(t, seed)
  b = [g.step(x).observation.state_key for x in ("guess 14", "guess 3")][-1]
  assert a == b
  other = next(s for s in range(100) if 6 < guess.secret(t, s) < 12 and guess.secret(t, s) != guess.secret(t, seed))
  g.reset(t, other)
  c = [g.step(x).observation.state_key for x in ("guess 3", "guess 14")][-1]
  assert c != a


def test_trajectory_records_keep_state_keys():
  t = _example()[1]
  back = tj.Trajectory.from_dict(t.to_dict())
  assert [x.state_key for x in back.turns] == ["a", "c", "b"]
  old = t.to_dict()
  old["schema"] = 4
  for turn in old["turns"]:
    del turn["state_key"]
  assert all(x.state_key is None for x in tj.Trajectory.from_dict(old).turns)


def test_gigpo_run_on_sokoban_groups_steps_by_anchor_state(tmp_path):
  """A tiny GiGPO run: stored turns carry state keys, the step groups are logged, turn rewards and the variance
  filter apply, and the monitors log their signals."""
  import json
  from jaxagent import config as config_lib
  from jaxagent import trajectory_store
  from jaxagent.train import loop
  from tests.test_train import TINY
  config = config_lib.load("sokoban_cpu", TINY + [
      f"run.root={tmp_path}", "train.iterations=2", "train.eval_episodes=0", "train.plots=false",
      "algo.turn_reward_weight=0.5", "tasks.variance_filter=0.5", "env.max_turns=4", "rollout.max_context=256",
      "rollout.branch.at=[0]", "rollout.branch.k=2", "tasks.train_size=2000"])
  loop.train(config, run_dir=tmp_path / "run")
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if "reward_mean" in r]
  assert len(rl) == 2
  for r in rl:
    assert r["gigpo/step_groups"] >= 1 and 0 < r["gigpo/grouped_step_fraction"] <= 1
    # 2 tasks x 1 parent x 2 branches from its first action, each branch pair its own group
    assert r["branch/trajectories"] == 4 and r["branch/diverged"] == 0 and r["branch/replayed_steps"] == 0
    assert r["variance_filter/dropped_trajectories"] >= 2  # at least one of the >= 2 groups dropped
    assert -1 <= r["monitor/task_identification"] <= 1 and r["monitor/echo_trap"] == 0
  stored = list(trajectory_store.read(tmp_path / "run" / "trajectories"))
  assert all(turn.state_key is not None for t in stored for turn in t.turns)
  assert sum(t.metadata.get("excluded") == "variance_filter" for t in stored) == sum(
      r["variance_filter/dropped_trajectories"] for r in rl)
  branches = [t for t in stored if "branch" in t.metadata]
  assert len(branches) == sum(r["branch/trajectories"] for r in rl)
  assert all(not t.loss_mask[:t.turns[0].action.span[0]].any() and t.loss_mask.any() for t in branches)
  # The first action of every episode of a task starts from the same anchor state.
  firsts = {}
  for t in stored:
    if "branch" in t.metadata:
      continue
    if t.turns:
      firsts.setdefault(t.task.id, set()).add(t.turns[0].state_key)
  assert all(len(keys) == 1 for keys in firsts.values())


def test_branches_continue_their_parent_and_equal_a_brute_force_replay():
  """A branch from turn t of a scripted sokoban episode: its prefix is the parent's (tokens as recorded, no
  loss), its env state the parent's at t, and its observations, rewards and return those of a fresh env that
  replays the parent's first t actions and then the branch's."""
  import models
  from envs.builtin import sokoban
  from jaxagent.chat import ControlTokenChat
  from jaxagent.rollout.actors import ScriptedActions
  from jaxagent.rollout.engine import EpisodeRules, RolloutEngine
  from jaxagent.rollout.episodes import Branch
  chat = ControlTokenChat(models.ByteTokenizer(), max_observation_tokens=40)
  spec = envs.get("sokoban")
  task = next(t for t in sokoban.tasks("train", 20, 0) if t.payload["moves"] >= 3)
  solution = sokoban.demo(task)
  wander = ["move up", "move left", "move down"]
  parent_actions = wander + solution  # wander first (invalid pushes included), then maybe solve
  probe = spec.make()
  probe.reset(task, 7)
  for a in wander[:2]:
    probe.step(a)
  p = task.payload
  from_two = [f"move {m}" for m in sokoban.solve(p["room"], probe.player, probe.boxes, p["goals"])]
  cont = [from_two, ["move right"] * 2 + solution]  # two continuations from turn 2: one solves it
  with envs.pool.make_pool(2, env="sokoban", kind="inprocess") as pool:
    engine = RolloutEngine(pool, spec, chat, EpisodeRules(max_turns=12))
    script = lambda acts: [chat.action_tokens(a) for a in acts]
    (parent,), _ = engine.run(ScriptedActions([script(parent_actions)], 1024), [task], [7], group_size=1,
                              policy_version=0)
    branches, _ = engine.run(ScriptedActions([script(c) for c in cont], 1024), [], [], group_size=1,
                             policy_version=0, branches=[Branch(task, parent, 2), Branch(task, parent, 2)])
  start = parent.turns[2].action.span[0]
  for b, actions in zip(branches, cont):
    assert b.metadata["branch"] == {"parent": parent.id, "turn": 2, "group": parent.group_id, "diverged": False}
    assert b.group_id == branches[0].group_id != parent.group_id and b.env.seed == parent.env.seed
    np.testing.assert_array_equal(b.tokens[:start], parent.tokens[:start])
    assert not b.loss_mask[:start].any() and b.loss_mask[start:].any()
    assert b.turns[:2] == parent.turns[:2] and b.turns[2].state_key == parent.turns[2].state_key
    # Brute force: a fresh env, the parent's first two actions, then the branch's.
    env = spec.make(max_turns=12)
    env.reset(task, 7)
    replay = [env.step(a) for a in parent_actions[:2] + actions]
    assert [t.action.text for t in b.turns] == parent_actions[:2] + actions[:len(b.turns) - 2]
    assert [t.reward for t in b.turns] == [r.reward for r in replay[:len(b.turns)]]
    assert [t.observation.text for t in b.turns if t.observation is not None] == \
        [r.observation.text for r in replay[:len(b.turns)] if not r.done]
    assert b.reward.total == pytest.approx(sum(r.reward for r in replay[:len(b.turns)]))
    verdicts = [r.verdict.passed for r in replay[:len(b.turns)] if r.verdict is not None]
    assert b.verifier.passed == (verdicts[-1] if verdicts else None)
  assert branches[0].verifier.passed and branches[0].termination == envs.Termination.COMPLETED
  # GiGPO puts the branches' steps in the parent's step groups: turn 2 of all three share an index.
  steps = step_group_indices([parent] + branches)
  assert steps[0, 2] == steps[1, 2] == steps[2, 2] >= 0
