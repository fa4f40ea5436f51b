"""train.freshness one_step_off / async: the rollout stream, per-token versions across a weight update, refill,
bounded staleness, no group trained twice (also across SIGKILL and resume), and off-policy losses."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import envs
import models
from jaxagent import config as config_lib
from jaxagent import trajectory_store
from jaxagent.chat import ControlTokenChat
from jaxagent.evals import compare
from jaxagent.rollout.actors import SampledActions
from jaxagent.rollout.engine import EpisodeRules, RolloutEngine, RolloutStream
from jaxagent.rollout.sampler import Sampler, SamplingConfig
from jaxagent.train import freshness, loop
from jaxagent.train import metrics as metrics_lib
from tests.test_losses import policy_loss

ROOT = Path(__file__).resolve().parent.parent
FAULTS = envs.get("faults")
TOKENIZER = models.ByteTokenizer()
SMALL = models.ModelConfig(model_type="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16)
CHAT = ControlTokenChat(TOKENIZER, max_observation_tokens=24)
TINY = [
    "model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_hidden_layers=1",
    "model.init.num_attention_heads=2", "model.init.num_key_value_heads=1", "model.init.head_dim=16",
    "train.tasks_per_iteration=2", "train.group_size=4", "train.bc_steps=3", "train.bc_batch_size=8",
    "train.eval_episodes=0", "train.plots=false", "train.dynamic_sampling=false",
]


def _sampler(stops, max_new_tokens=8, seed=0):
  model = models.Transformer(SMALL, rngs=nnx.Rngs(seed))
  sampler = Sampler(model, cache_size=256, pad_id=TOKENIZER.pad_id, extend_buckets=(CHAT.frame_length,),
                    config=SamplingConfig(max_new_tokens=max_new_tokens, stop_sequences=stops))
  return sampler, nnx.split(model)[1]


def _stream(pool, sampler, params, *, track_cache=False, chunk=4):
  engine = RolloutEngine(pool, FAULTS, CHAT, EpisodeRules(max_turns=3))
  actor = SampledActions(sampler, params, jax.random.key(3), decode_chunk=chunk, track_cache=track_cache)
  return RolloutStream(engine, actor, group_size=2)


def _two_groups_in_flight(pool, sampler, params, *, track_cache):
  """A stream (decode chunks of 2) with two groups of 2 submitted and run for three loop steps: the prompts
  fed, every action a chunk or two in."""
  stream = _stream(pool, sampler, params, track_cache=track_cache, chunk=2)
  for i, task in enumerate(FAULTS.tasks("train", 2, 0)):
    stream.submit(i, task, [2 * i, 2 * i + 1])
  calls = itertools.count()
  stream.run(until=lambda: next(calls) >= 3)
  return stream


def test_a_stream_without_updates_samples_what_one_rollout_samples():
  # Episode keys are slot * G + k in the stream and the quota index in a rollout: the same episodes.
  stops = CHAT.stop_sequences + tuple((t,) for t in range(0, 256, 2))
  sampler, params = _sampler(stops)
  tasks = FAULTS.tasks("train", 4, 0)
  seeds = list(range(8))
  with envs.pool.make_pool(4, env="faults", kind="inprocess") as pool:
    engine = RolloutEngine(pool, FAULTS, CHAT, EpisodeRules(max_turns=3))
    ref, _ = engine.run(SampledActions(sampler, params, jax.random.key(3), decode_chunk=4), tasks, seeds,
                        group_size=2, policy_version=0)
    stream = _stream(pool, sampler, params)
    for i, task in enumerate(tasks):
      stream.submit(i, task, seeds[2 * i:2 * i + 2])
    stream.run(until=lambda: len(stream.complete) == 4)
  got = {slot: group for slot, group in stream.complete}
  assert sorted(got) == [0, 1, 2, 3] and stream.live == 0
  for i in range(4):
    for a, b in zip(ref[2 * i:2 * i + 2], got[i]):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5)  # other step batches
      np.testing.assert_array_equal(a.behavior_versions, b.behavior_versions)  # all 0: one version
      assert a.group_id == b.group_id and b.metadata["slot"] == i


@pytest.mark.parametrize("refill", [False, True])
def test_a_weight_update_reaches_actions_in_flight_and_every_token_records_its_version(refill):
  # No stop token: every action runs its 8-token budget in chunks of 2; the update lands mid-action.
  sampler, params = _sampler(CHAT.stop_sequences, max_new_tokens=8)
  _, new_params = _sampler(CHAT.stop_sequences, max_new_tokens=8, seed=1)
  with envs.pool.make_pool(4, env="faults", kind="inprocess") as pool:
    stream = _two_groups_in_flight(pool, sampler, params, track_cache=refill)
    assert stream.live == 4
    metrics = stream.set_params(new_params, 1, refill=refill)
    stream.run(until=lambda: len(stream.complete) == 2)
  trajs = [t for _, group in stream.complete for t in group]
  split = 0
  for t in trajs:
    for turn in t.turns:
      start, stop = turn.action.span
      v = t.behavior_versions[start:stop]
      assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {0, 1}
      assert turn.policy_version == v[0]  # a turn's version is its first token's
      split += len(set(v.tolist())) == 2
    assert (t.behavior_versions[~np.isfinite(t.behavior_logprobs)] == -1).all()
  assert split, "no action spans the update"
  if refill:
    assert metrics["refill_rows"] == 4 and metrics["refill_kl"] > 0  # other weights, other next-token logits
  else:
    assert metrics == {}


def test_refill_under_the_same_weights_recomputes_the_same_cache():
  sampler, params = _sampler(CHAT.stop_sequences, max_new_tokens=8)
  with envs.pool.make_pool(4, env="faults", kind="inprocess") as pool:
    stream = _two_groups_in_flight(pool, sampler, params, track_cache=True)
    metrics = stream.set_params(params, 1, refill=True)
    stream.drain()
  assert metrics["refill_rows"] == 4 and metrics["refill_kl"] < 1e-5  # the prefill equals the incremental cache


def _stored(run_dir):
  return list(trajectory_store.read(run_dir / "trajectories"))


def _check_versions_and_slots(run_dir, eta, batch_groups):
  trained = [t for t in _stored(run_dir) if t.metadata.get("trained", True)]
  assert trained
  for t in trained:
    v = t.behavior_versions[t.loss_mask]
    learner = t.metadata["trained_version"]
    assert ((learner - eta <= v) & (v <= learner)).all(), (learner, sorted(set(v.tolist())))
  slots = [t.metadata["slot"] for t in trained]
  counts = {s: slots.count(s) for s in set(slots)}
  assert set(counts.values()) == {4}, "a slot trained twice, or a group trained without all its members"
  return trained, sorted(counts)


@pytest.mark.parametrize("mode", ["async", "one_step_off"])
def test_training_keeps_the_staleness_bound_and_trains_no_group_twice(tmp_path, mode):
  config = config_lib.load("tiny_cpu", TINY + [f"run.root={tmp_path}", "train.iterations=4",
                                               f"train.freshness={mode}", "train.max_staleness=1",
                                               "env.pool.kind=inprocess", "algo.loss=decoupled_ppo"])
  loop.train(config, run_dir=tmp_path / "run")
  trained, slots = _check_versions_and_slots(tmp_path / "run", 1, 2)
  assert len(slots) == 4 * 2
  rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
          if "freshness/lag_mean" in r]
  assert len(rows) == 4
  # Each iteration's wall time (waiting for the batch, the update) is logged as sync runs log it, so `jaxagent
  # compare` counts the RL time of async runs too.
  assert all(r[metrics_lib.ITERATION_SECONDS] >= r["time/update_s"] > 0 for r in rows)
  assert compare.summary(tmp_path / "run")["stage_s"]["iterations"] == pytest.approx(
      sum(r[metrics_lib.ITERATION_SECONDS] for r in rows))
  lagged = [r for r in rows if r["freshness/lag_mean"] > 0]
  assert lagged, "no batch was trained off-policy"
  # The ratio is taken to the recorded behavior (and proximal) log-probs, never to recomputed ones: off-policy,
  # π_prox/μ is not 1 (recomputing μ with the learner's weights would make it exactly 1).
  assert all(r["behavior_weight_max"] > 1.0 + 1e-4 for r in lagged)
  if mode == "one_step_off":  # round 0 on-policy, every later round exactly one version late
    assert [r["freshness/lag_max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["freshness/lag_mean"] == 1.0 for r in rows[1:])


def _train_cmd(run_root: Path, *extra):
  overrides = TINY + [f"run.root={run_root}", "train.iterations=6", "train.checkpoint_every=2",
                      "train.freshness=async", "train.max_staleness=2", "env.pool.kind=local",
                      "env.pool.num_workers=2"]
  cmd = [sys.executable, "-m", "jaxagent", "train", "tiny_cpu"]
  for o in overrides:
    cmd += ["--set", o]
  return cmd + list(extra)


@pytest.mark.slow
def test_async_sigkill_then_resume_neither_loses_nor_repeats_a_group(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(_train_cmd(tmp_path), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 600
  killed = False
  while time.monotonic() < deadline and proc.poll() is None:
    if list(tmp_path.glob("*/checkpoints/2")):  # a finished step directory
      proc.send_signal(signal.SIGKILL)
      killed = True
      break
    time.sleep(0.02)
  assert proc.wait(timeout=60) == -signal.SIGKILL and killed, "the run was not killed mid-training"
  (run,) = tmp_path.iterdir()
  resumed = subprocess.run([sys.executable, "-m", "jaxagent", "train", "--resume", str(run)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout
  trained, slots = _check_versions_and_slots(run, 2, 2)
  assert len(slots) == 6 * 2
  # Every slot drawn so far is trained, in flight, queued or drawn-not-submitted at the end: none lost.
  meta = json.loads((run / "checkpoints" / "6" / "meta" / "metadata").read_text()) if (
      run / "checkpoints" / "6" / "meta" / "metadata").exists() else None
  if meta is None:  # orbax's JSON item layout
    (path,) = [p for p in (run / "checkpoints" / "6").rglob("*") if p.is_file() and p.name == "metadata"
               and "stream" in p.read_text()]
    meta = json.loads(path.read_text())
  stream = meta["stream"]
  rest = [d["id"] for key in ("pending", "queued", "drawn") for d in stream[key]]
  assert sorted(slots + rest) == list(range(stream["next_draw"] * 2))
  # The run's state carried the monitors' windows across the kill: one value per rl iteration, the ones from
  # before the kill included (a state that restarted them would hold 6 - 2).
  assert len(meta["monitors"]["history"]["entropy"]) == 6
  # Every rl iteration logs its wall time, and `jaxagent compare` counts it as the run's RL time.
  lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in lines if "freshness/lag_mean" in r]
  assert len(rl) == 6 and all(r["time/iteration_s"] > 0 for r in rl)
  assert compare.summary(run)["stage_s"]["iterations"] == pytest.approx(sum(r["time/iteration_s"] for r in rl))


def test_decoupled_ppo_weights_the_clipped_term_by_the_truncated_behavior_weight():
  logp = jnp.log(jnp.asarray([[0.5, 0.45, 0.3]]))
  prox = jnp.log(jnp.asarray([[0.5, 0.5, 0.3]]))
  mu = jnp.log(jnp.asarray([[0.5, 0.1, 0.3]]))      # token 1: π_prox/μ = 5, truncated at 2
  adv = jnp.asarray([[1.0, 1.0, -1.0]])
  mask = jnp.asarray([[True, True, True]])
  # With π_prox = μ it is PPO.
  ppo, _ = policy_loss(logp, mu, adv, mask, 3.0)
  same, _ = policy_loss(logp, mu, adv, mask, 3.0, behavior_logp_bt=mu)
  np.testing.assert_allclose(same, ppo, rtol=1e-6)
  loss, m = policy_loss(logp, prox, adv, mask, 3.0, behavior_logp_bt=mu, behavior_weight_cap=2.0)
  ratio = np.exp(np.asarray(logp - prox))[0]
  clipped = np.maximum(-np.asarray(adv)[0] * ratio, -np.asarray(adv)[0] * np.clip(ratio, 0.8, 1.2))
  weights = np.asarray([1.0, 2.0, 1.0])
  np.testing.assert_allclose(loss, (weights * clipped).sum() / 3.0, rtol=1e-5)
  np.testing.assert_allclose(m["behavior_weight_max"], 5.0, rtol=1e-5)
  np.testing.assert_allclose(m["truncated_fraction"], 1 / 3, rtol=1e-5)
  # The weight carries no gradient: d loss / d log π at token 1 is -w · ratio · A / 3 (inside the clip).
  g = jax.grad(lambda lp: policy_loss(lp, prox, adv, mask, 3.0, behavior_logp_bt=mu)[0])(logp)
  np.testing.assert_allclose(np.asarray(g)[0, 1], -2.0 * ratio[1] / 3.0, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["train.freshness=async"], "dynamic_sampling"),
    (["train.freshness=async", "train.dynamic_sampling=false", "rollout.schedule=lockstep"], "continuous"),
    (["train.freshness=one_step_off", "train.dynamic_sampling=false", "train.max_staleness=0"], "max_staleness"),
    (["rollout.on_weight_update=refill"], "applies to train.freshness=async"),
    (["algo.loss=tis", "algo.kl_coef=0.1"], "no reference-KL term"),
])
def test_freshness_settings_that_cannot_work_are_config_errors(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.load("tiny_cpu", overrides)


def test_oldest_version_reads_the_tokens():
  sampler, params = _sampler(CHAT.stop_sequences + tuple((t,) for t in range(0, 256, 2)))
  with envs.pool.make_pool(2, env="faults", kind="inprocess") as pool:
    stream = _stream(pool, sampler, params)
    stream.submit(0, FAULTS.tasks("train", 1, 0)[0], [0, 1])
    stream.run(until=lambda: len(stream.complete) == 1)
  (_, group), = stream.complete
  assert [freshness.oldest_version(t) for t in group] == [0, 0]
