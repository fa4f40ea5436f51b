"""Rollout engine edge cases that the trainer's end-to-end tests do not reach."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import envs
import models
from jaxagent import algos
from jaxagent import assembly
from jaxagent import trajectory as tr
from jaxagent.chat import ControlTokenChat
from jaxagent.rollout.engine import RolloutEngine, SampledActions
from jaxagent.rollout.sampler import Sampler, SamplingConfig

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
    engine = RolloutEngine(pool, FAULTS, chat, max_turns=2)
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
  adv = algos.get_advantage("grpo")(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups))
  np.testing.assert_array_equal(np.asarray(adv.advantages)[2:], 0.0)
