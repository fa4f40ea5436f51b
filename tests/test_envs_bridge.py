"""The host-callback bridge on 8 fake CPU devices (tests/conftest.py): per-shard rows, order, while_loop."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
import models
from envs.pool import make_pool
from jaxagent.rollout import env_bridge

TOK = models.ByteTokenizer()


class RecordingPool:
  """Echoes each row's action back as `shard:row:action`; records exactly which rows each call received."""

  def __init__(self, shard):
    self.shard, self.calls, self.threads = shard, [], set()

  def step_many(self, slots, actions):
    self.calls.append((list(slots), list(actions)))
    self.threads.add(threading.get_ident())
    return [envs.StepResult(envs.Observation(f"{self.shard}:{s}:{a}"), {"progress": float(len(a))},
                            a.endswith("!"), envs.Termination.COMPLETED if a.endswith("!") else None)
            for s, a in zip(slots, actions)]


def _mesh(shape=(8,), names=("data",)):
  return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def _actions(texts, width):
  toks = np.zeros((len(texts), width), np.int32)
  for i, t in enumerate(texts):
    toks[i, :len(t)] = TOK.encode(t)
  return jnp.asarray(toks), jnp.asarray([len(t) for t in texts], jnp.int32)


def test_each_shard_gets_exactly_its_rows_in_order():
  assert jax.device_count() >= 8
  mesh = _mesh()
  pools = [RecordingPool(i) for i in range(8)]
  bridge = env_bridge.EnvBridge(pools, TOK, mesh, obs_len=16)
  texts = [f"a{i}" + ("!" if i % 3 == 0 else "") for i in range(16)]
  toks, lens = _actions(texts, 8)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  out = jax.block_until_ready(jax.jit(bridge.step)(jax.device_put(toks, sharding), jax.device_put(lens, sharding)))
  for shard, pool in enumerate(pools):
    assert pool.calls == [([0, 1], texts[2 * shard:2 * shard + 2])]
  obs, obs_len = np.asarray(out.obs_tokens), np.asarray(out.obs_lengths)
  got = [TOK.decode(obs[i, :obs_len[i]]) for i in range(16)]
  assert got == [f"{i // 2}:{i % 2}:{t}" for i, t in enumerate(texts)]
  np.testing.assert_array_equal(np.asarray(out.done), [t.endswith("!") for t in texts])
  np.testing.assert_array_equal(np.asarray(out.reward), [len(t) for t in texts])
  np.testing.assert_array_equal(np.asarray(out.outcome), [1 if t.endswith("!") else 0 for t in texts])
  assert out.obs_tokens.sharding.spec[0] == "data" and out.done.sharding.spec == jax.sharding.PartitionSpec("data")
  assert len(bridge.take_history()) == 8


def test_inside_while_loop_on_a_2d_mesh():
  mesh = _mesh((4, 2), ("data", "tensor"))
  pools = {i: RecordingPool(i) for i in range(4)}
  bridge = env_bridge.EnvBridge(pools, TOK, mesh, obs_len=12, keep_history=False)
  toks, lens = _actions(["x"] * 8, 4)

  @jax.jit
  def run(toks, lens):
    def body(carry):
      t, total, lens = carry
      out = bridge.step(toks, lens)
      return t + 1, total + out.obs_lengths, lens + 1
    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.zeros(8, jnp.int32), lens))[1]

  totals = run(toks, lens)
  # obs "s:r:x", "s:r:x\0", "s:r:x\0\0" (decoded lengths 1, 2, 3 of zero-padded actions): 5 + 6 + 7 each
  np.testing.assert_array_equal(np.asarray(totals), [18] * 8)
  assert all(len(p.calls) == 3 and [c[0] for c in p.calls] == [[0, 1]] * 3 for p in pools.values())


def test_bad_batch_and_axes_are_named():
  mesh = _mesh()
  with pytest.raises(ValueError, match="batch_axes"):
    env_bridge.EnvBridge([], TOK, mesh, obs_len=4, batch_axes="batch")
  bridge = env_bridge.EnvBridge([RecordingPool(i) for i in range(8)], TOK, mesh, obs_len=4)
  with pytest.raises(ValueError, match="batch 12 is not divisible by the 8 shards"):
    bridge.step(*_actions(["a"] * 12, 2))


def test_real_calculator_pools_per_shard():
  mesh = _mesh((2,), ("data",))
  spec = envs.get("calculator")
  tasks = spec.tasks("train", 4, 0)
  pools = [make_pool(2, env="calculator", kind="inprocess") for _ in range(2)]
  try:
    for shard, pool in enumerate(pools):
      pool.reset_many([0, 1], tasks[2 * shard:2 * shard + 2], [0, 1])
    bridge = env_bridge.EnvBridge(pools, TOK, mesh, obs_len=8)
    step = jax.jit(bridge.step)
    demos = [spec.demo(t) for t in tasks]
    for turn in range(3):
      out = step(*_actions([d[turn] for d in demos], 16))
    assert np.asarray(out.done).all() and np.asarray(out.reward).tolist() == [1.0] * 4
    assert np.asarray(out.outcome).tolist() == [envs.OUTCOME_CODES["completed"]] * 4
    again = step(*_actions(["calc 1+1"] * 4, 16))   # finished rows answer with no observation
    assert np.asarray(again.obs_lengths).tolist() == [0] * 4 and np.asarray(again.done).all()
  finally:
    for p in pools:
      p.close()
