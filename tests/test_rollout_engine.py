"""Rollout engine edge cases that the trainer's end-to-end tests do not reach."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import envs
import models
from jaxagent import assembly
from jaxagent import trajectory as tr
from jaxagent import mesh_rules
from jaxagent.chat import ControlTokenChat
from jaxagent import config as config_lib
from jaxagent.rollout.actors import SampledActions
from jaxagent.rollout.engine import EpisodeRules, RolloutEngine
from jaxagent.rollout.sampler import Sampler, SamplingConfig
from tests.test_advantages import estimate

FAULTS = envs.get("faults")


def test_failed_reset_ends_the_episode_before_any_turn_and_is_never_trained():
  tokenizer = models.ByteTokenizer()
  config = models.ModelConfig(model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16)
  model = models.Transformer(config, rngs=nnx.Rngs(0))
  chat = ControlTokenChat(tokenizer, max_observation_tokens=24)
  sampler = Sampler(model, cache_size=128, config=SamplingConfig(max_new_tokens=8, stop_sequences=chat.stop_sequences),
                    pad_id=tokenizer.pad_id, buckets=(32, 64, 128), extend_buckets=(chat.frame_length,))
  tasks = FAULTS.tasks("train", 2, 0)
  tasks[1] = dataclasses.replace(tasks[1], payload={"reset": "raise"})
  with envs.pool.make_pool(4, env="faults", kind="inprocess") as pool:
    engine = RolloutEngine(pool, FAULTS, chat, EpisodeRules(max_turns=2))
    source = SampledActions(sampler, nnx.split(model)[1], jax.random.key(0))
    trajs, stats = engine.run(source, tasks, [0, 1, 2, 3], group_size=2, policy_version=0)

  ok, failed = trajs[:2], trajs[2:]
  for t in failed:
    assert t.termination == envs.Termination.ENV_ERROR and not t.turns
    assert "injected reset fault" in t.metadata["reset_error"]
    assert t.reward.total == 0 and not t.loss_mask.any() and not (t.roles == tr.Role.POLICY).any()
  for t in ok:
    assert t.turns and (t.roles == tr.Role.POLICY).any() and "reset_error" not in t.metadata
  assert stats.env_steps <= 2 * 2  # only the two healthy episodes ever stepped

  # GRPO leaves the failed group out: no valid step, so no advantage and no member of any group statistic.
  rewards, mask, groups = assembly.advantage_inputs(trajs, steps=2)
  assert not mask[2:].any()
  adv = estimate("grpo", jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups))
  np.testing.assert_array_equal(np.asarray(adv.advantages)[2:], 0.0)


# ------------------------------------------------------------------------------------------------
# Rollout engine v2: per-row context, continuous batching, transports, per-trajectory timing.

TOKENIZER = models.ByteTokenizer()
SMALL = models.ModelConfig(model_type="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16)
CHAT = ControlTokenChat(TOKENIZER, max_observation_tokens=24)
# A random model rarely samples the newline that ends an action: half the byte values end it too (short actions).
SHORT_ACTIONS = CHAT.stop_sequences + tuple((t,) for t in range(0, 256, 2))


def _sampler(cache_size=256, max_new_tokens=8):
  model = models.Transformer(SMALL, rngs=nnx.Rngs(0))
  sampler = Sampler(model, cache_size=cache_size, pad_id=TOKENIZER.pad_id, extend_buckets=(CHAT.frame_length,),
                    config=SamplingConfig(max_new_tokens=max_new_tokens, stop_sequences=SHORT_ACTIONS))
  return sampler, nnx.split(model)[1]


def _run(sampler, params, tasks, *, slots, group_size=1, max_turns=3, schedule="continuous",
         transport="host_loop", seeds=None):
  seeds = list(range(len(tasks) * group_size)) if seeds is None else seeds
  with envs.pool.make_pool(slots, env="faults", kind="inprocess") as pool:
    engine = RolloutEngine(pool, FAULTS, CHAT, EpisodeRules(max_turns=max_turns, schedule=schedule,
                                                            transport=transport))
    return engine.run(SampledActions(sampler, params, jax.random.key(3), decode_chunk=4), tasks, seeds,
                      group_size=group_size, policy_version=0)


def test_one_row_exhausts_its_context_while_the_others_finish_with_their_own_terminations():
  sampler, params = _sampler(cache_size=160)
  tasks = FAULTS.tasks("train", 4, 0)
  tasks[1] = dataclasses.replace(tasks[1], id="long-" + "x" * 100)  # its prompt alone takes ~120 of 160 slots
  trajs, _ = _run(sampler, params, tasks, slots=4, max_turns=3)
  long_row, others = trajs[1], trajs[:1] + trajs[2:]
  assert long_row.termination == envs.Termination.CONTEXT_EXHAUSTED
  assert len(long_row.tokens) <= 160 and len(long_row.turns) >= 1
  for t in others:  # the long row ended alone: the others ran every turn their env allowed
    assert t.termination == envs.Termination.MAX_TURNS, t.termination
    assert len(t.turns) == 3


def test_same_trajectories_under_every_transport_schedule_and_slot_count():
  """Episode keys: what an episode samples does not depend on its slot, on which rows share its steps, on
  when its env answers, or on which transport carries its actions."""
  sampler, params = _sampler()
  tasks = FAULTS.tasks("train", 6, 0)
  runs = {(transport, schedule, slots): _run(sampler, params, tasks, slots=slots, group_size=2,
                                             schedule=schedule, transport=transport)[0]
          for transport in config_lib.TRANSPORTS for schedule, slots in (("continuous", 5), ("lockstep", 12))}
  reference = runs["host_loop", "continuous", 5]
  assert len({tuple(t.tokens) for t in reference}) > 6  # the G samples of a task differ
  for key, trajs in runs.items():
    assert len(trajs) == 12
    for a, b in zip(reference, trajs):
      np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=str(key))
      np.testing.assert_array_equal(a.roles, b.roles, err_msg=str(key))
      # Log-probs to float32 rounding: another batch shape (slots, a compacted feed) may change XLA's reduction
      # blocking by an ulp; the sampled tokens above are exact.
      np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, rtol=0, atol=1e-5, err_msg=str(key))
      assert (a.group_id, a.env.seed, a.termination) == (b.group_id, b.env.seed, b.termination), key
      assert [u.outcome for u in a.turns] == [u.outcome for u in b.turns], key


def test_callback_program_with_the_batch_sharded_over_devices_equals_host_loop():
  """The callback transport with the batch in 8 row blocks (one per device): the program calls the host once
  per block, concurrently; the blocks meet in one exchange (`actors._BlockExchange`) and get their own rows'
  feeds back. Same trajectories as host_loop on the same mesh."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(8, 1, 1), ("data", "fsdp", "tensor"))
  model = models.Transformer(SMALL, rngs=nnx.Rngs(0))
  sampler = Sampler(model, cache_size=256, pad_id=TOKENIZER.pad_id, extend_buckets=(CHAT.frame_length,),
                    config=SamplingConfig(max_new_tokens=8, stop_sequences=SHORT_ACTIONS), mesh=mesh,
                    rules=mesh_rules.REPLICATED_RULES)
  assert sampler.batch_shards(8)[1] == 8
  params = jax.device_put(nnx.split(model)[1], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  tasks = FAULTS.tasks("train", 6, 0)
  host, callback = (_run(sampler, params, tasks, slots=8, group_size=2, transport=t)[0]
                    for t in ("host_loop", "callback"))
  assert len({len(t.turns) for t in host}) >= 1 and sum(len(t.turns) for t in host) > 12
  for a, b in zip(host, callback):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert [u.outcome for u in a.turns] == [u.outcome for u in b.turns]


@pytest.mark.alone  # CPU-bound decoding raced against a 1 s env: not beside other xdist workers' tests
def test_a_slow_env_holds_only_its_own_episode_and_timings_are_per_trajectory():
  sampler, params = _sampler()
  tasks = FAULTS.tasks("train", 8, 0)
  _run(sampler, params, tasks, slots=3, max_turns=3)  # compiles what the measured run needs
  # 1 s per step: the seven fast episodes take ~1 s on an idle 2-core machine and ~1.2 s under CI's load.
  slow = FAULTS.tasks("train", 1, 0, latency_median_s=1.0)[0]
  tasks[0] = dataclasses.replace(slow, id="slow")
  trajs, stats = _run(sampler, params, tasks, slots=3, max_turns=3)
  slow, fast = trajs[0], trajs[1:]
  assert slow.termination == envs.Termination.MAX_TURNS and len(slow.turns) == 3
  assert slow.timing.env_s >= 3 * 1.0 * 0.9 and all(t.timing.env_s < 1.0 for t in fast)
  # The two other slots ran all seven fast episodes while the slow one waited on its env.
  assert max(t.timing.ended_s for t in fast) < slow.timing.ended_s / 2
  assert {t.metadata["slot"] for t in fast} == {1, 2} and slow.metadata["slot"] == 0
  for t in trajs:
    timing = t.timing
    assert 0 <= timing.admitted_s <= timing.ended_s <= stats.wall_s
    assert timing.decode_s > 0 and timing.reset_s > 0
    assert timing.env_s == pytest.approx(sum(u.t_env_s for u in t.turns))
  assert stats.wall_s > 0 and 0 <= stats.idle_s <= stats.wall_s
  assert stats.env_steps == sum(len(t.turns) for t in trajs)


def test_lockstep_waits_for_the_slowest_env_of_its_wave():
  sampler, params = _sampler()
  tasks = FAULTS.tasks("train", 3, 0)
  _run(sampler, params, tasks, slots=3, max_turns=2, schedule="lockstep")  # compiles
  tasks[0] = dataclasses.replace(FAULTS.tasks("train", 1, 0, latency_median_s=0.2)[0], id="slow")
  trajs, _ = _run(sampler, params, tasks, slots=3, max_turns=2, schedule="lockstep")
  # Every episode of the wave ends after the slow one's two steps: the barrier is per turn.
  assert min(t.timing.ended_s for t in trajs) >= 2 * 0.2 * 0.9


def test_fault_env_latency_is_validated():
  with pytest.raises(ValueError, match="latency_median_s=-1"):
    FAULTS.tasks("train", 1, 0, latency_median_s=-1)


def test_slots_must_shard_evenly_over_the_rollout_batch_axes(tmp_path):
  from jaxagent import config as config_lib
  from jaxagent.train.run import build_run
  from tests.test_train import TINY
  assert jax.device_count() == 8  # tests/conftest.py: the tiny_cpu mesh puts the batch over data=8
  config = config_lib.load("tiny_cpu", TINY + [f"run.root={tmp_path}", "rollout.slots=6"])
  with pytest.raises(config_lib.ConfigError, match=r"rollout.slots=6: must be divisible by the 8 devices"):
    build_run(config, tmp_path / "run")


def test_a_prompt_longer_than_the_context_ends_its_whole_group_before_any_turn():
  """The prefiller's last piece does not fit, and its group's forks (planned in the same feed) are refused on
  the device too: no episode decodes from a context it does not have."""
  sampler, params = _sampler(cache_size=64)
  tasks = FAULTS.tasks("train", 2, 0)
  tasks[0] = dataclasses.replace(tasks[0], id="long-" + "y" * 80)  # ~100 prompt tokens > 64 slots
  trajs, _ = _run(sampler, params, tasks, slots=4, group_size=2, max_turns=2)
  for t in trajs[:2]:
    assert t.termination == envs.Termination.CONTEXT_EXHAUSTED and not t.turns
    assert not (t.roles == tr.Role.POLICY).any() and len(t.tokens) <= 64
  for t in trajs[2:]:  # the other group had its prompt and acted (64 slots hold about one turn of it)
    assert t.turns and (t.roles == tr.Role.POLICY).any()


def test_a_row_left_waiting_for_a_prompt_copy_whose_source_ended_is_fed_in_the_same_call():
  """Regression (found by a one-turn env in CI): B waits to copy its group's prompt from A's row; A's whole
  episode ends in the same collect that admitted B, so no row holds or feeds the prompt any more. The next feed
  must carry B's prompt; a plan that noticed it only after building the feed came back empty and the host loop
  stopped with "rollout stalled"."""
  import types
  from jaxagent.rollout import episodes, scheduler
  fake_engine = types.SimpleNamespace(pool=types.SimpleNamespace(worker_pids=lambda: [None]),
                                      chat=types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad_id=0)),
                                      schedule="continuous", slots=2)
  actor = types.SimpleNamespace(width=16, width_for=lambda n: 16)
  waiting = episodes.Episode(index=1, task=None, seed=0, group_id="g", state=episodes.EpisodeState.FEEDING, slot=0,
                             prompt=(5, 6, 7))
  sched = scheduler.Scheduler(fake_engine, actor, [waiting], policy_version=0)
  sched.slot_episode[0] = waiting  # A (slot 1) ended: nothing resident, nothing prefilling
  feed, plan = sched._plan()
  assert feed is not None and [(kind, n) for _, kind, n in plan] == [("prompt", 3)]
  assert feed.tokens[0, :3].tolist() == [5, 6, 7] and bool(feed.reset[0]) and bool(feed.prompt_done[0])
  assert sched.prefilling[(5, 6, 7)] is waiting
