"""`jaxagent train CONFIG`: behavior-cloning cold start, then GRPO over multi-turn env episodes.

Imperative shell around pure parts: the rollout engine produces `Trajectory` records, `assembly` turns them
into a fixed-shape `Batch`, `algos` computes advantages, the jitted `train_step` updates the `TrainState`.
Everything that decides the next step lives in one checkpoint (params, optimizer, step, policy version,
RNG, grain iterator state); env seeds and sampling keys are derived from (seed, iteration), so a resumed run
continues exactly where an uninterrupted one would be.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import envs
import envs.pool
import models
from jaxagent import algos, checkpoint
from jaxagent import config as config_lib
from jaxagent import sharding as sharding_lib
from jaxagent import trajectory as tr
from jaxagent.assembly import advantage_inputs, assemble
from jaxagent.config import Config
from jaxagent.rollout.engine import ChatFormat, RolloutEngine, RolloutStats
from jaxagent.rollout.sampler import Sampler, SamplingConfig
from jaxagent.train import checkpointing
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.state import TrainState, learning_rate_schedule, make_optimizer
from jaxagent.train.step import make_train_step, make_value_fn
from jaxagent.train.value import ValueHead, ValueTargets
from jaxagent import trajectory_store
from jaxagent.trajectory_store import TrajectoryWriter

log = logging.getLogger(__name__)
NUM_TRAIN_TASKS = 100_000


def _seed(*parts: Any) -> int:
  """A stable 31-bit seed from any parts (independent of Python's hash randomization)."""
  digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclasses.dataclass
class EvalResult:
  split: str
  episodes: int
  successes: int
  ci: tuple[float, float]
  terminations: dict[str, int]
  mean_reward: float

  @property
  def success_rate(self) -> float:
    return self.successes / max(self.episodes, 1)

  def line(self) -> str:
    lo, hi = self.ci
    return (f"{self.split} success {self.success_rate:.3f} ({self.successes}/{self.episodes}, "
            f"95% CI [{lo:.3f}, {hi:.3f}]), mean reward {self.mean_reward:.3f}")


class Trainer:
  """Holds the run's parts; `run()` trains, `evaluate()` measures held-out success."""

  def __init__(self, config: Config, run_dir: Path, *, resume: bool = False, echo: bool = True,
               read_only: bool = False):
    """`read_only`: restore and evaluate without writing anything into the run directory (`jaxagent eval`)."""
    self.config = config
    self.run_dir = Path(run_dir)
    self.echo = echo and jax.process_index() == 0
    cfg = config
    self.tokenizer = models.load_tokenizer(cfg.model.tokenizer)
    dtype = jnp.dtype(cfg.model.dtype)
    self.process, self.num_processes = jax.process_index(), jax.process_count()
    self.mesh = sharding_lib.mesh_from_config(cfg.mesh)
    learner_rules = sharding_lib.rules_for("learner", cfg.mesh)
    rollout_rules = sharding_lib.rules_for("rollout", cfg.mesh)
    if cfg.algo.name == "ppo" and cfg.algo.advantage != "gae":
      raise config_lib.ConfigError(f"algo.name='ppo' needs algo.advantage='gae' (got {cfg.algo.advantage!r})")
    if cfg.algo.name == "grpo" and cfg.algo.advantage == "gae":
      raise config_lib.ConfigError("algo.advantage='gae' needs a value function: set algo.name='ppo'")
    # The learner scores tokens under softmax(logits / rollout.temperature): the ratio to the recorded
    # behavior log-probs is exact only for that distribution, so truncated sampling is refused here.
    if cfg.rollout.temperature <= 0:
      raise config_lib.ConfigError(f"rollout.temperature={cfg.rollout.temperature}: training samples from the "
                                   "policy; use a temperature > 0 (greedy decoding is for eval/generate)")
    if cfg.rollout.top_k or cfg.rollout.top_p < 1.0:
      raise config_lib.ConfigError(f"rollout.top_k={cfg.rollout.top_k}, rollout.top_p={cfg.rollout.top_p}: "
                                   "truncated sampling would make the importance ratio wrong; use top_k=0, "
                                   "top_p=1.0 for training (they remain available to `jaxagent generate`)")

    # Parameters are created (or loaded) directly in their learner layout: no host copy, no full replica, and
    # the same on every process of a multi-host run.
    init_model = lambda: models.Transformer(cfg.model.init, dtype=dtype, rngs=nnx.Rngs(cfg.run.seed))
    if cfg.model.path:
      loaded = checkpoint.load_model(cfg.model.path, dtype=dtype, mesh=self.mesh, rules=learner_rules)
      self.model = loaded
      policy_params = nnx.split(loaded)[1]
    else:
      self.model = nnx.eval_shape(init_model)  # abstract: the graph and config (the sampler needs no values)
      policy_params = None
    if self.model.config.vocab_size < self.tokenizer.vocab_size:
      raise config_lib.ConfigError(f"model vocab_size {self.model.config.vocab_size} < tokenizer vocab "
                                   f"{self.tokenizer.vocab_size} ({cfg.model.tokenizer})")
    self.graphdefs = {"policy": nnx.split(self.model)[0]}
    make_value = lambda: ValueHead(self.model.config.hidden_size, dtype=dtype)
    if cfg.algo.name == "ppo":
      self.graphdefs["value"] = nnx.split(nnx.eval_shape(make_value))[0]
      self.value_fn = make_value_fn(self.graphdefs)
    rl_updates = cfg.train.iterations * cfg.train.updates_per_iteration
    schedule = optax.join_schedules(
        [optax.constant_schedule(cfg.train.bc_learning_rate), learning_rate_schedule(cfg.optim, rl_updates)],
        [cfg.train.bc_steps])
    self.schedule = schedule
    self.optimizer = make_optimizer(cfg.optim, schedule)

    def init_state(policy):
      params = {"policy": nnx.split(init_model())[1] if policy is None else policy}
      if cfg.algo.name == "ppo":
        params["value"] = nnx.split(make_value())[1]
      # The frozen reference starts as the initial policy; `run()` re-points it after the cold start.
      ref = params["policy"] if cfg.algo.kl_coef > 0 else None
      return TrainState(params=params, opt_state=self.optimizer.init(params), step=jnp.zeros((), jnp.int32),
                        policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(cfg.run.seed),
                        ref_params=ref)

    # Canonical layout: parameters and their optimizer moments by the learner rules, every other leaf (step,
    # counts, RNG) replicated. Every jitted step returns exactly this layout, so nothing recompiles.
    abstract = jax.eval_shape(init_state, policy_params)
    param_sh = models.state_shardings(abstract.params, self.mesh, learner_rules)
    replicated = NamedSharding(self.mesh, P())
    opt_sh = optax.tree_utils.tree_map_params(self.optimizer, lambda _, s: s, abstract.opt_state, param_sh,
                                              transform_non_params=lambda _: replicated)
    self.state_shardings = TrainState(params=param_sh, opt_state=opt_sh,
                                      step=replicated, policy_version=replicated, rng=replicated,
                                      ref_params=param_sh["policy"] if cfg.algo.kl_coef > 0 else None)
    self.state = jax.jit(init_state, out_shardings=self.state_shardings)(policy_params)
    step_args = dict(state_shardings=self.state_shardings)
    self.rl_step = make_train_step(self.graphdefs, self.optimizer, cfg.algo, micro_batches=cfg.train.micro_batches,
                                   mode="rl", temperature=cfg.rollout.temperature, **step_args)
    self.bc_step = make_train_step(self.graphdefs, self.optimizer, cfg.algo, micro_batches=1, mode="bc",
                                   **step_args)

    sharding_lib.check_replication(self.state.params, cfg.mesh.max_replicated_fraction)
    # Colocated placement: the policy lives in the learner layout and is resharded (in small groups, sources freed)
    # into the rollout layout for generation and back for the update: one layout at a time, on device.
    learner_sh = param_sh["policy"]
    rollout_sh = models.state_shardings(abstract.params["policy"], self.mesh, rollout_rules)
    self.to_rollout = lambda p: sharding_lib.reshard(p, rollout_sh)
    self.to_learner = lambda p: sharding_lib.reshard(p, learner_sh)
    self.batch_sharding = lambda shape: NamedSharding(self.mesh, models.logical_to_spec(
        ("batch",) + (None,) * (len(shape) - 1), shape, self.mesh, learner_rules))

    self.env_spec = envs.get(cfg.env.name)
    for name, value in (("train.tasks_per_iteration", cfg.train.tasks_per_iteration),
                        ("train.eval_episodes", cfg.train.eval_episodes or self.num_processes)):
      if value % self.num_processes:
        raise config_lib.ConfigError(f"{name}={value}: must be divisible by the {self.num_processes} processes")
    self.global_rows = cfg.train.tasks_per_iteration * cfg.train.group_size
    self.rows = self.global_rows // self.num_processes  # this process's trajectories per iteration
    pool_cfg = envs.pool.PoolConfig(
        env=cfg.env.name, kind=cfg.env.pool, num_workers=cfg.env.workers,
        action_timeout_s=cfg.env.action_timeout_s, episode_timeout_s=cfg.env.episode_timeout_s,
        max_turns=cfg.env.max_turns, invalid_action=cfg.env.invalid_action)
    self.pool = envs.pool.Pool(pool_cfg, num_slots=self.rows)
    stops = tuple(tuple(self.tokenizer.encode(s)) for s in cfg.rollout.stop)
    stops += ((self.tokenizer.special("<|eot|>"),), (self.tokenizer.eos_id,))
    sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                              top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
                              stop_sequences=stops)
    buckets = tuple(b for b in (16, 32, 64, 128, 256, 512, 1024, 2048) if b < cfg.rollout.max_context) + (
        cfg.rollout.max_context,)
    # Observation chunks are padded to one fixed length (body cap + framing): one compiled extend per run.
    extend = (cfg.rollout.max_observation_tokens + 3,)
    shard = dict(mesh=self.mesh, rules=rollout_rules)
    self.sampler = Sampler(self.model, cache_size=cfg.rollout.max_context, config=sampling,
                           pad_id=self.tokenizer.pad_id, buckets=buckets, extend_buckets=extend, **shard)
    self.eval_sampler = Sampler(
        self.model, cache_size=cfg.rollout.max_context,
        config=dataclasses.replace(sampling, temperature=cfg.train.eval_temperature),
        pad_id=self.tokenizer.pad_id, buckets=buckets, extend_buckets=extend, **shard)
    engine_args = dict(max_turns=cfg.env.max_turns, max_observation_tokens=cfg.rollout.max_observation_tokens,
                       stop_strings=cfg.rollout.stop, gamma=cfg.algo.gamma,
                       invalid_action_rule=cfg.env.invalid_action, chat=ChatFormat())
    self.engine = RolloutEngine(self.sampler, self.pool, self.env_spec, self.tokenizer, **engine_args)
    self.eval_engine = RolloutEngine(self.eval_sampler, self.pool, self.env_spec, self.tokenizer, **engine_args)

    # Tasks: a grain pipeline over the train split, sharded by process; its iterator state is checkpointed.
    options = dict(cfg.env.options or {})
    task_list = self.env_spec.tasks("train", NUM_TRAIN_TASKS, cfg.run.seed, **options)
    # Every process walks the same global sequence of batches and keeps its contiguous slice, so the global
    # batch (and every row's seed and sampling key) is the same for any number of processes.
    local = cfg.train.tasks_per_iteration // self.num_processes
    dataset = (grain.MapDataset.source(task_list).shuffle(seed=cfg.run.seed).repeat()
               .batch(cfg.train.tasks_per_iteration, batch_fn=list)
               .map(lambda batch: batch[self.process * local:(self.process + 1) * local]))
    self.task_iter = iter(dataset)

    self.checkpointer = checkpointing.TrainCheckpointer(self.run_dir / "checkpoints",
                                                        keep=cfg.train.keep_checkpoints)
    self.model_config = models.config_to_hf(self.model.config)
    self.iteration = 0
    self.counters = {"env_interactions": 0, "action_tokens": 0, "device_seconds": 0.0, "wall_seconds": 0.0}
    resume_step = None
    if resume:
      restored = self.checkpointer.restore_latest(self.state, self.model_config)
      if restored is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir / 'checkpoints'}")
      self.iteration, self.state, meta = restored
      self.task_iter.set_state(meta["data_iterator"])
      self.counters = meta["counters"]
      self.state = jax.jit(lambda x: x, out_shardings=self.state_shardings)(self.state)
      resume_step = int(self.state.step)
      self._print(f"resumed from {self.run_dir / 'checkpoints' / str(self.iteration)} "
                  f"(iteration {self.iteration}, step {resume_step}, policy version {int(self.state.policy_version)})")
    self.metrics = metrics_lib.MetricsLogger(self.run_dir, enabled=jax.process_index() == 0 and not read_only,
                                             resume_step=resume_step)
    prefix = "trajectories" if self.num_processes == 1 else f"trajectories-p{self.process}"
    save = cfg.train.save_trajectories and not read_only
    if resume and save:
      shards = meta.get("trajectory_shards", {})
      moved = trajectory_store.discard_from(self.run_dir / "trajectories", int(shards.get(prefix, 0)),
                                            prefix=prefix)
      if moved:
        self._print(f"set aside {len(moved)} trajectory shard(s) written after that checkpoint "
                    f"(trajectories/discarded/): their iterations are replayed")
    self.writer = TrajectoryWriter(self.run_dir / "trajectories", prefix=prefix) if save else None
    self._start_wall = time.perf_counter() - self.counters["wall_seconds"]

  # ------------------------------------------------------------------------------------------------

  def set_reference(self) -> None:
    """Makes the current policy the frozen KL reference (a copy; no-op without `algo.kl_coef`)."""
    if self.config.algo.kl_coef > 0:
      self.state = jax.jit(lambda s: s.replace(ref_params=s.params["policy"]), donate_argnums=0,
                           out_shardings=self.state_shardings)(self.state)

  def _print(self, *args) -> None:
    if self.echo:
      print(*args, flush=True)

  def _sum(self, value) -> np.ndarray:
    """Sum over processes of a host value (identity in a single process)."""
    if self.num_processes == 1:
      return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(np.asarray(value))).sum(axis=0)

  def _gather(self, value) -> np.ndarray:
    """Concatenation over processes (in process order) of a host array's rows."""
    if self.num_processes == 1:
      return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(np.asarray(value), tiled=True))

  def _global(self, tree):
    """This process's rows of host arrays -> global batch arrays in the learner layout."""
    def put(x):
      x = np.asarray(x)
      shape = (x.shape[0] * self.num_processes,) + x.shape[1:]
      return jax.make_array_from_process_local_data(self.batch_sharding(shape), x, shape)
    return jax.tree.map(put, tree)

  def _rollout(self, engine, tasks, seeds, group_size, rng):
    """Reshards the policy into the rollout layout, runs `engine`, reshards back (donating each time)."""
    policy = self.to_rollout(self.state.params["policy"])
    try:
      return engine.run(policy, tasks, seeds, group_size=group_size, rng=rng,
                        policy_version=int(self.state.policy_version))
    finally:
      self.state = self.state.replace(params={**self.state.params, "policy": self.to_learner(policy)})

  def _save(self) -> None:
    shards = self._gather(np.asarray([self.writer.next_index if self.writer is not None else 0]))
    meta = {"iteration": self.iteration, "data_iterator": self.task_iter.get_state(),
            "counters": self.counters, "versions": checkpointing.versions(),
            "env": {"name": self.env_spec.name, "version": self.engine.env_version},
            "policy_version": int(self.state.policy_version),
            "trajectory_shards": {("trajectories" if self.num_processes == 1 else f"trajectories-p{p}"): int(n)
                                  for p, n in enumerate(shards)}}
    self.checkpointer.save(self.iteration, self.state, meta, self.model_config,
                           config_lib.to_dict(self.config))

  # ------------------------------------------------------------------------------------------------
  # Behavior cloning cold start.

  def demonstrations(self, n: int, seed: int) -> list[tr.Trajectory]:
    """Scripted demonstrations replayed through the same engine layout (tokens, roles, masks)."""
    tasks = self.env_spec.tasks("train", n, _seed(seed, "demo"), **dict(self.config.env.options or {}))
    out = []
    env = self.env_spec.make(max_turns=self.config.env.max_turns)
    chat = ChatFormat()
    for i, task in enumerate(tasks):
      obs = env.reset(task, i)
      stream = tr.TokenStream()
      chat.prompt(stream, obs.text, self.tokenizer)
      turns = []
      stop = self.tokenizer.encode(self.config.rollout.stop[0])
      termination = tr.TerminationReason.MAX_TURNS
      for action in self.env_spec.demo(task, **dict(self.config.env.demo_options or {})):
        tokens = self.tokenizer.encode(action) + stop
        # The scripted policy puts probability 1 on its action: behavior log-prob 0, policy_version -1.
        span = stream.sampled(tokens, [0.0] * len(tokens))
        result = env.step(action)
        turns.append(tr.Turn(action=tr.Action(span=span, text=action), reward=result.reward,
                             reward_components=dict(result.reward_components)))
        if result.done:
          termination = tr.TerminationReason(result.termination)
          break
        stream.control(chat.tool, tr.Role.TOOL, self.tokenizer)
        stream.text(result.observation.text, tr.Role.TOOL, self.tokenizer,
                    max_tokens=self.config.rollout.max_observation_tokens)
        stream.control(chat.end_of_turn, tr.Role.TOOL, self.tokenizer)
        stream.control(chat.assistant, tr.Role.TOOL, self.tokenizer)
      out.append(tr.Trajectory(
          task=tr.Task(task.id, task.split, task.version),
          env=tr.EnvInfo(self.env_spec.name, self.engine.env_version, i), policy_version=-1,
          termination=termination, reward=tr.Reward(total=sum(t.reward for t in turns)), turns=tuple(turns),
          metadata={"source": "scripted_demo"}, **stream.arrays()))
    return out

  def behavior_cloning(self) -> None:
    cfg = self.config.train
    start_step = int(self.state.step)
    if start_step >= cfg.bc_steps:
      return
    demos = self.demonstrations(max(cfg.bc_steps * cfg.bc_batch_size // 4, cfg.bc_batch_size), self.config.run.seed)
    length = self.config.rollout.max_context
    rng = np.random.default_rng(_seed(self.config.run.seed, "bc", start_step))
    progress = metrics_lib.Progress(cfg.bc_steps - start_step, "cold start (BC)", self.echo)
    for step in range(start_step, cfg.bc_steps):
      pick = rng.choice(len(demos), cfg.bc_batch_size, replace=False)
      local = cfg.bc_batch_size // self.num_processes
      mine = pick[self.process * local:(self.process + 1) * local]
      batch = assemble([demos[i] for i in mine], length=length, rows=local, pad_id=self.tokenizer.pad_id)
      normalizer = self._sum(algos.loss_normalizer(
          batch.loss_mask, batch.segment_ids, aggregation=self.config.algo.aggregation,
          norm_length=self.config.algo.norm_length, allow_empty=True))
      self.state, m = self.bc_step(self.state, self._global(batch), jnp.float32(normalizer))
      if step % 10 == 0 or step == cfg.bc_steps - 1:
        m = jax.device_get(m)
        self.metrics.log(int(self.state.step), {"bc/nll": m["nll"], "bc/grad_norm": m["grad_norm"]})
        progress.update(10 if step % 10 == 0 and step else 1, nll=f"{float(m['nll']):.3f}")
    progress.close()

  # ------------------------------------------------------------------------------------------------
  # Evaluation.

  def evaluate(self, split: str | None = None, episodes: int | None = None) -> EvalResult:
    cfg = self.config
    split = split or cfg.train.eval_split
    episodes = cfg.train.eval_episodes if episodes is None else episodes
    tasks = self.env_spec.tasks(split, episodes, _seed(cfg.run.seed, "eval", split), **dict(cfg.env.options or {}))
    names = [t.value for t in tr.TerminationReason]
    passed, rewards, terms = 0, 0.0, np.zeros(len(names), np.int64)
    for start in range(0, episodes, self.global_rows):
      chunk = tasks[start:start + self.global_rows]
      chunk += chunk[:1] * (self.global_rows - len(chunk))  # pad the last chunk; padding is not counted
      mine = range(self.process * self.rows, (self.process + 1) * self.rows)
      seeds = [_seed(cfg.run.seed, "eval", split, start + i) for i in mine]
      trajs, _ = self._rollout(self.eval_engine, [chunk[i] for i in mine], seeds, 1,
                               jax.random.key(_seed(cfg.run.seed, "eval-rng", start)))
      for i, t in zip(mine, trajs):
        if start + i < episodes:
          passed += bool(t.verifier.passed)
          rewards += t.reward.total
          terms[names.index(t.termination.value)] += 1
    passed, rewards, terms = self._sum(passed), self._sum(rewards), self._sum(terms)
    return EvalResult(split, episodes, int(passed), metrics_lib.wilson_interval(int(passed), episodes),
                      {n: int(c) for n, c in zip(names, terms) if c}, float(rewards) / max(episodes, 1))

  # ------------------------------------------------------------------------------------------------
  # Reinforcement learning.

  def rl_iteration(self) -> dict[str, float]:
    cfg = self.config
    it = self.iteration
    timer = metrics_lib.StageTimer()
    wall0 = time.perf_counter()
    tasks = next(self.task_iter)  # this process's slice of the global batch of tasks
    seeds = [_seed(cfg.run.seed, "env", it, self.process * self.rows + i) for i in range(self.rows)]
    rng = jax.random.fold_in(self.state.rng, it)
    with timer("rollout"):
      sampled, stats = self._rollout(self.engine, tasks, seeds, cfg.train.group_size, rng)
      trajs, extra, stats, refill = self._dynamic_sampling(sampled, stats, rng) if cfg.train.dynamic_sampling \
          else (sampled, [], stats, {})
    with timer("advantages"):
      batch, value_targets, value_normalizer, _ = self._advantages(trajs)
      normalizer = self._sum(algos.loss_normalizer(batch.loss_mask, batch.segment_ids,
                                                   aggregation=cfg.algo.aggregation,
                                                   norm_length=cfg.algo.norm_length, allow_empty=True))
      value_normalizer = self._sum(value_normalizer)
      batch, value_targets = self._global(batch), self._global(value_targets)
    with timer("update"):
      for _ in range(cfg.train.updates_per_iteration):
        self.state, m = self.rl_step(self.state, batch, jnp.float32(normalizer), value_targets,
                                     jnp.float32(value_normalizer))
      m = jax.device_get(m)
    if self.writer is not None:
      with timer("write"):
        for t in trajs:
          self.writer.write(t)
        for t in extra:  # sampled by dynamic sampling but not trained on: kept, marked
          self.writer.write(dataclasses.replace(t, metadata={**t.metadata, "trained": False}))
        self.writer.flush()

    # Policy metrics describe the first-round sample (dynamic sampling's refills are selected, not sampled).
    totals = self._gather(np.asarray([t.reward.total for t in sampled], np.float64))
    passed = self._gather(np.asarray([bool(t.verifier.passed) for t in sampled]))
    groups = totals.reshape(cfg.train.tasks_per_iteration, cfg.train.group_size)
    stage = timer.pop()
    self.counters["env_interactions"] += int(self._sum(stats.env_steps))
    self.counters["action_tokens"] += int(self._sum(stats.action_tokens))
    self.counters["device_seconds"] += stats.decode_s + stats.extend_s + stage.get("time/update_s", 0.0)
    self.counters["wall_seconds"] = time.perf_counter() - self._start_wall
    out = {
        "reward_mean": float(totals.mean()), "success_rate": float(passed.mean()),
        "reward_std_within_group": float(groups.std(axis=1).mean()),
        "zero_variance_group_fraction": float((np.ptp(groups, axis=1) == 0).mean()),
        "learning_rate": float(self.schedule(int(self.state.step) - 1)),
        "time/reset_s": stats.reset_s, "time/decode_s": stats.decode_s, "time/env_s": stats.env_s,
        "time/extend_s": stats.extend_s, "time/iteration_s": time.perf_counter() - wall0,
        **stage, **{k: float(v) for k, v in m.items()}, **self.counters, **refill,
    }
    # Like reward_mean, over the first-round sample. Reward components: this process's rows (their names
    # come from the env and may differ between processes, so they are not gathered).
    for key in sorted({k for t in sampled for k in t.reward.components}):
      out[f"reward/{key}"] = float(np.mean([t.reward.components.get(key, 0.0) for t in sampled]))
    # Termination counts, and env determinism measured: episodes replayed after a worker restart and how many
    # of them diverged (since this process started). One collective for both, every process summed.
    names = [t.value for t in tr.TerminationReason]
    counts = self._sum(np.asarray([sum(t.termination.value == n for t in sampled) for n in names]
                                  + [self.pool.replays, self.pool.replay_divergences]))
    out.update({f"termination/{n}": int(c) for n, c in zip(names, counts) if c})
    out.update({"env/replays": int(counts[-2]), "env/replay_divergences": int(counts[-1])})
    return out

  def _dynamic_sampling(self, sampled: list[tr.Trajectory], stats, rng):
    """DAPO dynamic sampling (Yu et al. 2025): a group whose rewards are all equal carries no GRPO signal.

    The batch keeps its B task slots. While some slot (on any process) holds such a flat group, and at most
    `train.dynamic_sampling_rounds` times, a new batch of tasks is rolled out and each flat slot takes the
    group rolled out in its own slot if that one varies. Slot by slot, so the choice does not depend on how
    the slots are spread over processes; rounds are decided collectively, so every process draws the same
    task batches and the data order stays exact across resume and topologies. Slots still flat at the end
    are trained as they are (advantage 0) and counted.

    Returns (trained trajectories, sampled-but-unused trajectories, merged stats, metrics).
    """
    cfg = self.config
    g = cfg.train.group_size
    chunks = lambda ts: [ts[i * g:(i + 1) * g] for i in range(len(ts) // g)]
    # Only trajectories with a turn count, as in the advantages: a reset that failed is in no group.
    varied = lambda group: len({t.reward.total for t in group if t.turns}) > 1
    chosen = chunks(sampled)
    flat = [not varied(group) for group in chosen]
    unused, rounds, sampled_groups = [], 0, len(chosen)
    while rounds < cfg.train.dynamic_sampling_rounds and self._sum(np.asarray(sum(flat))) > 0:
      rounds += 1
      tasks = next(self.task_iter)
      seeds = [_seed(cfg.run.seed, "env", self.iteration, "refill", rounds, self.process * self.rows + i)
               for i in range(self.rows)]
      more, more_stats = self._rollout(self.engine, tasks, seeds, g, jax.random.fold_in(rng, 1000 + rounds))
      stats = RolloutStats(*(a + b for a, b in zip(dataclasses.astuple(stats), dataclasses.astuple(more_stats))))
      for slot, group in enumerate(chunks(more)):
        sampled_groups += 1
        if flat[slot] and varied(group):
          unused += chosen[slot]
          chosen[slot], flat[slot] = group, False
        else:
          unused += group
    metrics = {"dynamic_sampling/rounds": rounds,
               "dynamic_sampling/groups_sampled": int(self._sum(sampled_groups)),
               "dynamic_sampling/zero_variance_groups_trained": int(self._sum(sum(flat)))}
    return [t for group in chosen for t in group], unused, stats, metrics

  def _advantages(self, trajs: list[tr.Trajectory]):
    """(batch, value targets or None, value normalizer, AdvantageOutput) for one rollout batch."""
    cfg = self.config
    rewards_ns, mask_ns, group_ids = advantage_inputs(trajs, steps=cfg.env.max_turns, gamma=cfg.algo.gamma)
    layout = dict(length=cfg.rollout.max_context, rows=self.rows, pad_id=self.tokenizer.pad_id)
    values_ns = value_targets = None
    if cfg.algo.name == "ppo":
      # V(s_t) is read at the token before action t (unpacked rows: trajectory i is row i from position 0).
      state_pos = np.zeros(mask_ns.shape, np.int32)
      for i, t in enumerate(trajs):
        for j, turn in enumerate(t.turns):
          state_pos[i, j] = turn.action.span[0] - 1
      plain = assemble(trajs, **layout)
      values_bt = sharding_lib.local_rows(self.value_fn(self.state.params, self._global(plain)))
      rows = np.arange(len(trajs))[:, None]
      values_ns = np.where(mask_ns, values_bt[rows, state_pos], 0.0)
    adv = algos.get_advantage(cfg.algo.advantage)(
        jnp.asarray(rewards_ns), jnp.asarray(mask_ns), jnp.asarray(group_ids),
        values_ns=None if values_ns is None else jnp.asarray(values_ns), **algos.advantage_kwargs(cfg.algo))
    adv_ns = np.asarray(adv.advantages)
    batch = assemble(trajs, [adv_ns[i, :len(t.turns)] for i, t in enumerate(trajs)], level="turn", **layout)
    value_normalizer = 0.0
    if values_ns is not None:
      shape = batch.tokens.shape
      old, ret, vmask = np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, bool)
      returns_ns = np.asarray(adv.returns)
      for i, t in enumerate(trajs):
        for j in range(len(t.turns)):
          p = state_pos[i, j]
          old[i, p], ret[i, p], vmask[i, p] = values_ns[i, j], returns_ns[i, j], True
      value_targets = ValueTargets(old_values=old, returns=ret, mask=vmask)
      value_normalizer = float(vmask.sum())
    return batch, value_targets, value_normalizer, adv

  def run(self) -> tuple[EvalResult | None, EvalResult | None]:
    cfg = self.config
    self._print(f"RUN_DIR {self.run_dir.resolve()}")
    if self.process == 0:
      (self.run_dir / "config.yaml").write_text(config_lib.dump(cfg))
    before = after = None
    if int(self.state.step) < cfg.train.bc_steps:
      self.behavior_cloning()
      self.set_reference()
      self._save()
    if cfg.train.eval_episodes and self.iteration == 0:
      before = self.evaluate()
      self._print(f"after cold start: {before.line()}")
      self.metrics.log(int(self.state.step), {"eval_success_rate": before.success_rate, **self.counters},
                       iteration=self.iteration)
    progress = metrics_lib.Progress(cfg.train.iterations, "GRPO", self.echo)
    progress.update(self.iteration)
    while self.iteration < cfg.train.iterations:
      m = self.rl_iteration()
      self.iteration += 1
      self.metrics.log(int(self.state.step), m, iteration=self.iteration)
      progress.update(1, reward=f"{m['reward_mean']:.2f}", succ=f"{m['success_rate']:.2f}")
      every = cfg.train.eval_every
      if cfg.train.eval_episodes and every and self.iteration % every == 0 and self.iteration < cfg.train.iterations:
        mid = self.evaluate()
        progress.write(f"iteration {self.iteration}: {mid.line()}")
        self.metrics.log(int(self.state.step), {"eval_success_rate": mid.success_rate}, iteration=self.iteration)
      if self.iteration % cfg.train.checkpoint_every == 0 or self.iteration == cfg.train.iterations:
        self._save()
    progress.close()
    self.checkpointer.wait()
    if cfg.train.eval_episodes:
      after = self.evaluate()
      self._print(f"after RL:         {after.line()}")
      self.metrics.log(int(self.state.step), {"eval_success_rate": after.success_rate, **self.counters},
                       iteration=self.iteration)
    if cfg.train.plots and jax.process_index() == 0:
      metrics_lib.write_plots(self.run_dir)
    return before, after

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
    self.checkpointer.close()
    self.metrics.close()
    self.pool.close()


def new_run_dir(config: Config) -> Path:
  """`<root>/<name>-<timestamp>`; in a multi-process run every process gets process 0's timestamp."""
  stamp = np.int64(int(datetime.datetime.now().strftime("%Y%m%d%H%M%S")))
  if jax.process_count() > 1:
    stamp = multihost_utils.broadcast_one_to_all(stamp)
  text = str(int(stamp))
  run_dir = Path(config.run.root) / f"{config.run.name}-{text[:8]}-{text[8:]}"
  run_dir.mkdir(parents=True, exist_ok=jax.process_count() > 1)
  return run_dir


def train(config: Config, *, run_dir: Path | None = None, resume: bool = False) -> Trainer:
  """Trains per `config` in `run_dir` (a new one unless resuming). Returns the closed trainer.

  `jax.distributed` is initialized first (a no-op for a single process), so the same command runs on one
  machine or on every host of a cluster.
  """
  from jaxagent import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(config.distributed)
  if resume and run_dir is None:
    raise ValueError("--resume needs the run directory")
  run_dir = run_dir or new_run_dir(config)
  run_dir.mkdir(parents=True, exist_ok=True)
  trainer = Trainer(config, run_dir, resume=resume)
  try:
    trainer.run()
  finally:
    trainer.close()
  return trainer
