"""Router replay end to end: the sampler's KV cache records the experts every token used, forks copy them, the
engine attaches them to the trajectory (schema 7, stored and read back), assembly lays them out for the learner
(refusing routes of another model by name), and the learner's policy forward replays them. On a tiny mixture
whose routing is made fragile, the first update's ratio π/μ is 1 within the dense tolerance with replay and far
from it without."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from jaxagent import assembly
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.rollout.sampler import Feed, Sampler, SamplingConfig
from jaxagent.train.run import build_run
from tests import _iterate
from tests.test_kv_cache import MOE_CONFIG, decisive_routers
from tests.test_train import TINY

# The byte-tokenizer tiny run with mixture-of-experts MLPs: 2 sparse layers of 6 experts, top-2.
MOE = ["model.init.model_type=qwen3_moe", "model.init.qk_norm=true", "model.init.num_experts=6",
       "model.init.num_experts_per_tok=2", "model.init.moe_intermediate_size=16", "model.init.norm_topk_prob=true",
       "model.init.num_hidden_layers=2"]
ON_POLICY_TOL = 1e-4  # the dense models' first-update ratio tolerance (test_train.py)


def _fragile(params, seed=0):
  """Routers whose experts come in triples with router columns 1e-7 apart: which two of a triple a token takes
  is decided by float rounding, so the sampler's cached decode and the learner's full forward disagree on some
  tokens; the experts' weights are large enough that the choice changes the next token's probability."""
  rng = np.random.default_rng(seed)

  def change(path, x):
    name = jax.tree_util.keystr(path)
    if "w_router_de" in name:
      *layers, d, e = x.shape  # a layer stack's routers: [L, D, E]
      base = rng.normal(0, 0.5, (*layers, d, e // 3))
      tied = np.stack([base + 1e-7 * rng.normal(size=base.shape) for _ in range(3)], -1)
      return jnp.asarray(tied.reshape(*layers, d, e), x.dtype)
    if any(k in name for k in ("w_gate_edf", "w_up_edf", "w_down_efd")):
      return jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype)
    return x

  changed = jax.tree_util.tree_map_with_path(change, params)
  return jax.device_put(changed, jax.tree.map(lambda a: a.sharding, params))


def _first_update(tmp_path: Path, replay: bool, *extra: str, check_run=None):
  cfg = config_lib.load("tiny_cpu", TINY + MOE + [f"run.root={tmp_path}", "train.bc_steps=0", "train.eval_episodes=0",
                                                   f"model.moe.router_replay={str(replay).lower()}", *extra])
  run = build_run(cfg, tmp_path / "run")
  try:
    state = run.policy.init_state()
    if check_run:
      check_run(run, state)
    progress = run.new_state(state.replace(params=_fragile(state.params)))
    with trajectory_store.TrajectoryWriter(tmp_path / "stored") as writer:
      _, m = _iterate.rl_iteration(run, progress, writer)
  finally:
    run.close()
  return m, list(trajectory_store.read(tmp_path / "stored"))


@pytest.mark.slow
def test_router_replay_makes_the_first_update_on_policy_where_fragile_routing_breaks_it(tmp_path):
  without, plain = _first_update(tmp_path / "off", replay=False)
  with_replay, stored = _first_update(tmp_path / "on", replay=True)
  print(f"first update's ratio: without replay [{without['ratio_min']:.4f}, {without['ratio_max']:.4f}], "
        f"with replay [{with_replay['ratio_min']:.7f}, {with_replay['ratio_max']:.7f}]")
  assert without["loss_tokens"] > 0 and with_replay["loss_tokens"] > 0
  assert "moe/load_balance" not in with_replay and "moe/router_z" not in with_replay  # router losses: off by default
  assert max(abs(without["ratio_min"] - 1), abs(without["ratio_max"] - 1)) > 0.05
  assert max(abs(with_replay["ratio_min"] - 1), abs(with_replay["ratio_max"] - 1)) < ON_POLICY_TOL
  # The routes travel in the stored trajectories: every token the sampler computed has its experts.
  assert all(t.expert_routes is None for t in plain)
  for t in stored:
    assert t.schema == tr.SCHEMA_VERSION and t.expert_routes.shape == (len(t), 2, 2)
    assert (t.expert_routes[t.loss_mask] >= 0).all() and (t.expert_routes[:5] >= 0).all()
    assert (t.expert_routes < 6).all()


@pytest.mark.slow
def test_router_replay_holds_on_an_expert_parallel_mesh(tmp_path):
  """The same fragile run on 8 devices with the experts split over `mesh.ici.expert=2` (data 4 x expert 2: the
  sampler and the update both dispatch across devices, each holding 3 of the 6 experts): replayed routes keep
  the first update on policy."""
  assert jax.device_count() == 8, "tests/conftest.py must give 8 CPU devices"

  def experts_split(run, state):
    assert dict(run.policy.layout.mesh.shape) == {"data": 4, "fsdp": 1, "expert": 2, "tensor": 1}
    gate = state.params["policy"]["layer_stacks"][0]["mlp"]["w_gate_edf"][...]  # [L, E, D, F]
    assert {shard.data.shape[1] for shard in gate.addressable_shards} == {3}

  m, _ = _first_update(tmp_path, True, "mesh.ici.expert=2", check_run=experts_split)
  print(f"first update's ratio with replay, expert-parallel: [{m['ratio_min']:.7f}, {m['ratio_max']:.7f}]")
  assert m["loss_tokens"] > 0
  assert max(abs(m["ratio_min"] - 1), abs(m["ratio_max"] - 1)) < ON_POLICY_TOL


@pytest.mark.parametrize("extra, message", [
    (MOE + ["mesh.ici.expert=4"], r"expert axis of 4 devices .* does not divide the policy's 6 experts; use one of "
                                  r"\[2, 3, 6\]"),
    (["mesh.ici.expert=2"], r"expert axis of 2 devices .* the policy \(llama\) has no mixture-of-experts layer")])
def test_an_expert_axis_that_cannot_split_the_experts_is_refused_by_name(tmp_path, extra, message):
  cfg = config_lib.load("tiny_cpu", TINY + extra + [f"run.root={tmp_path}"])
  with pytest.raises(config_lib.ConfigError, match=message):
    build_run(cfg, tmp_path / "run")


def test_the_sampler_records_the_routes_of_the_full_forward_and_forks_copy_them():
  """A prompt fed, an action decoded and an observation fed: the cache's routes are the routes a full forward of
  the row's tokens takes; a fork carries the prompt's routes; a sampler not asked to record keeps none."""
  model = decisive_routers(models.Transformer(MOE_CONFIG, rngs=nnx.Rngs(3)))
  params = nnx.state(model)
  config = SamplingConfig(temperature=1.0, max_new_tokens=5)
  sampler = Sampler(model, cache_size=32, config=config, pad_id=0, record_routes=True, extend_buckets=(8,))
  prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
  state = sampler.prefill(params, prompts, jax.random.key(0))
  state, out = sampler.generate(params, state)
  state, _ = sampler.extend(params, state, [[3, 4], [21, 22, 23]])
  n = np.asarray(out.lengths)
  rows = [p + np.asarray(out.tokens)[r, :n[r]].tolist() + obs for r, (p, obs) in
          enumerate(zip(prompts, [[3, 4], [21, 22, 23]]))]
  recorded = sampler.routes(state, [0, 1], [len(r) for r in rows])
  for row, got in zip(rows, recorded):
    _, _, want = model.features(jnp.asarray([row]), return_routes=True)
    np.testing.assert_array_equal(got, np.asarray(want[0]))
  # A fork (GRPO's group members share their prompt's slots) copies the prompt's routes with its keys and values.
  f = Feed.empty(2, 8, 0)
  f.tokens[0, :5], f.lengths[0], f.reset[:], f.episode[:] = prompts[0], 5, True, [0, 1]
  f.prompt_done[0], f.fork[1] = True, 0
  forked, ok = sampler.feed(params, sampler.init(2, jax.random.key(1)), f)
  assert np.asarray(ok).all()
  first, copy = sampler.routes(forked, [0, 1], [5, 5])
  np.testing.assert_array_equal(copy, first)
  np.testing.assert_array_equal(first, recorded[0][:5])
  assert recorded[0].dtype == np.int16 and recorded[0].shape[1:] == (1, MOE_CONFIG.num_experts_per_tok)  # one sparse layer
  assert Sampler(model, cache_size=32, config=config, pad_id=0).init(2, jax.random.key(0)).cache.routes is None


def _trajectory(routes=None, n=6):
  return tr.Trajectory(
      task=tr.TaskRecord(id="t"), env=tr.EnvInfo(name="e", version="1", seed=0), policy_version=0,
      termination=tr.Termination.COMPLETED,
      reward=tr.Reward(total=0.0), turns=(), tokens=np.arange(n), roles=np.zeros(n, np.int8),
      loss_mask=np.zeros(n, bool), behavior_logprobs=np.full(n, np.nan, np.float32), expert_routes=routes)


def test_routes_round_trip_in_both_stored_forms_and_bad_ones_are_refused():
  routes = np.random.default_rng(0).integers(-1, 6, (6, 3, 2)).astype(np.int16)
  t = _trajectory(routes)
  for form in ("bytes", "lists"):
    back = tr.Trajectory.from_dict(t.to_dict(arrays_as=form))
    np.testing.assert_array_equal(back.expert_routes, routes)
  old = t.to_dict()
  del old["expert_routes"]
  assert tr.Trajectory.from_dict(dict(old, schema=6)).expert_routes is None  # schema 6: none recorded
  with pytest.raises(tr.TrajectoryFormatError, match=r"expert_routes: shape \(5, 3, 2\), expected \[6 tokens"):
    _trajectory(routes[:5])
  with pytest.raises(tr.TrajectoryFormatError, match="expert id -2"):
    _trajectory(np.full((6, 3, 2), -2))
  with pytest.raises(tr.TrajectoryFormatError, match="expert_routes.ids: 10 bytes is not a multiple of 12"):
    tr.Trajectory.from_dict(dict(t.to_dict(), expert_routes={"shape": [3, 2], "ids": b"\0" * 10}))


def test_assembly_lays_out_routes_and_refuses_those_of_another_model_by_name():
  shape = assembly.RouteShape(sparse_layers=3, experts_per_token=2, experts=6, model="qwen3_moe")
  routes = np.random.default_rng(1).integers(0, 6, (6, 3, 2)).astype(np.int16)
  batch = assembly.assemble([_trajectory(routes), _trajectory(None, n=4)],
                           shape=assembly.BatchShape(length=8, routes=shape))
  assert batch.expert_routes.shape == (2, 8, 3, 2) and batch.expert_routes.dtype == np.int16
  np.testing.assert_array_equal(batch.expert_routes[0, :6], routes)
  assert (batch.expert_routes[0, 6:] == -1).all() and (batch.expert_routes[1] == -1).all()
  # Replay off: none carried.
  assert assembly.assemble([_trajectory(routes)], shape=assembly.BatchShape(length=8)).expert_routes is None
  with pytest.raises(ValueError, match=r"2 sparse layers x top-2 .*this policy \(qwen3_moe\) has 3 sparse layers "
                                       r"x top-2 of 6 experts"):
    assembly.assemble([_trajectory(routes[:, :2])], shape=assembly.BatchShape(length=8, routes=shape))
  with pytest.raises(ValueError, match=r"largest expert id 9"):
    assembly.assemble([_trajectory(np.full((6, 3, 2), 9))], shape=assembly.BatchShape(length=8, routes=shape))
  assert assembly.RouteShape.of(MOE_CONFIG).sparse_layers == 1 and assembly.RouteShape.of(
      dataclasses.replace(MOE_CONFIG, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)) is None


def test_router_replay_needs_the_host_loop_transport(tmp_path):
  cfg = config_lib.load("tiny_cpu", TINY + MOE + [f"run.root={tmp_path}", "rollout.env_transport=callback"])
  with pytest.raises(config_lib.ConfigError, match="env_transport=callback with a mixture of experts.*router_replay"):
    build_run(cfg, tmp_path / "run")


@pytest.mark.slow
def test_router_losses_are_in_the_loss_and_logged_when_on_and_refused_for_a_dense_policy(tmp_path):
  """With both weights on, the update's loss is the policy loss plus exactly the weighted router losses it logs
  (so they are in the gradient); off by default, nothing is logged (the first-update test's runs)."""
  cfg = config_lib.load("tiny_cpu", TINY + MOE + [f"run.root={tmp_path}", "train.bc_steps=0", "train.eval_episodes=0",
                                                   "algo.moe_load_balance_coef=1.0", "algo.moe_router_z_coef=0.1"])
  run = build_run(cfg, tmp_path / "run")
  try:
    with trajectory_store.TrajectoryWriter(tmp_path / "stored") as writer:
      _, m = _iterate.rl_iteration(run, run.new_state(), writer)
  finally:
    run.close()
  assert 0.5 < m["moe/load_balance"] < 6 and m["moe/router_z"] > 0  # E = 6 experts: 1 when balanced
  np.testing.assert_allclose(m["loss"] - m["pg_loss"], 1.0 * m["moe/load_balance"] + 0.1 * m["moe/router_z"],
                             rtol=1e-4)
  with pytest.raises(config_lib.ConfigError, match="has no mixture-of-experts layer; set both to 0"):
    build_run(config_lib.load("tiny_cpu", TINY + [f"run.root={tmp_path}", "algo.moe_router_z_coef=0.1"]),
              tmp_path / "dense")
