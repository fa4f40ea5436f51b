"""The learner's side of an rl iteration: a batch of trajectories -> the update's inputs -> the update.

  prepare_batch(run, state, trajectories)   -> Prepared   assembly, advantages (PPO: values at collection time
                                                          and GAE with bootstrap; decoupled PPO: π_prox), the
                                                          loss normalizers
  update(run, state, prepared)              -> state, metrics   `train.updates_per_iteration` jitted steps
  group_statistics(run, trajectories)       -> metrics    within-group return spread (the estimator's groups)
  batch_length(cfg, trajectories)           -> T          an update batch's length (`train.batch_length`)

The sync loop (jaxagent/train/loop.py) calls them in turn; the one_step_off / async learner thread
(jaxagent/train/freshness.py) calls the same two on the batches a rollout stream produced.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import envs
from jaxagent import algos, multihost, shared_prefix
from jaxagent import buckets as buckets_lib
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent.assembly import (Batch, BatchShape, RouteShape, advantage_inputs, assemble, step_group_indices,
                               turn_rewards)
from jaxagent.config import Config
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.rollouts import trained_rows
from jaxagent.train.run import Run, replays_routes
from jaxagent.train.state import TrainState
from jaxagent.train.value import ValueTargets

# Episodes cut off before the task ended: their last state is not terminal, so GAE bootstraps from its value.
TRUNCATIONS = (envs.Termination.MAX_TURNS, envs.Termination.TURN_BUDGET_EXHAUSTED,
               envs.Termination.CONTEXT_EXHAUSTED)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """One update's inputs (global arrays) and the statistics of the advantage estimator that built them."""
  batch: Batch
  normalizer: float
  value_targets: ValueTargets | None
  value_normalizer: float
  stats: dict[str, float]
  estimate: algos.AdvantageOutput      # the estimator's output (this process's rows), for diagnostics
  excluded: tuple[str | None, ...] = ()  # per row: why it is not trained on (its termination, or
                                         # "variance_filter"), None when it is


def stored(t: tr.Trajectory, excluded: str | None, **metadata) -> tr.Trajectory:
  """`t` as the trajectory store keeps it: `metadata` added, and marked untrained (with why) when `excluded`."""
  extra = {} if excluded is None else {"trained": False, "excluded": excluded}
  return dataclasses.replace(t, metadata={**t.metadata, **metadata, **extra}) if metadata or extra else t


def _estimate(cfg: Config, rewards_ns, mask_ns, group_ids, values_ns=None, bootstrap_n=None, trajectories=None
              ) -> algos.AdvantageOutput:
  """The configured advantage estimator, always called the same way (one compiled program per shape); gigpo
  also gets the anchor-state step groups of `trajectories`."""
  put = lambda x: None if x is None else jnp.asarray(x)
  step_groups = None
  if cfg.algo.advantage == "gigpo":
    step_groups = step_group_indices(trajectories, steps=mask_ns.shape[1])
  inputs = algos.AdvantageInputs(put(rewards_ns), put(mask_ns), put(group_ids), values=put(values_ns),
                                 bootstrap=put(bootstrap_n), step_groups=put(step_groups))
  return algos.get_advantage(cfg.algo.advantage)(inputs, algos.AdvantageConfig.from_algo(cfg.algo))


def _turn_advantages(cfg: Config, trajectories, mask_ns, group_ids) -> np.ndarray:
  """`algo.turn_reward_weight` × the turn advantages of the turns' own rewards (0 when the weight is 0)."""
  if not cfg.algo.turn_reward_weight:
    return np.zeros(mask_ns.shape, np.float32)
  rewards = turn_rewards(trajectories, steps=mask_ns.shape[1])
  adv = algos.turn_advantages(jnp.asarray(rewards), jnp.asarray(mask_ns), jnp.asarray(group_ids),
                              eps=cfg.algo.adv_eps, scale_std=cfg.algo.scale_std)
  return cfg.algo.turn_reward_weight * np.asarray(adv)


def variance_kept(fraction: float, trajectories: Sequence[tr.Trajectory], train: np.ndarray) -> np.ndarray:
  """StarPO-S's variance filter (`tasks.variance_filter`): bool[N], the trajectories of the ceil(fraction · groups)
  groups whose trained members' returns have the largest population std (a stable sort: ties keep the earlier
  group). Every row is kept at fraction 1."""
  kept = np.ones(len(trajectories), bool)
  if fraction >= 1.0:
    return kept
  groups: dict[str, list[int]] = {}
  for i, t in enumerate(trajectories):
    groups.setdefault(t.group_id, []).append(i)
  names = list(groups)
  std = [float(np.std([trajectories[i].reward.total for i in groups[g] if train[i]] or [0.0])) for g in names]
  order = sorted(range(len(names)), key=lambda k: -std[k])
  keep = {names[k] for k in order[:int(np.ceil(fraction * len(names)))]}
  return np.asarray([t.group_id in keep for t in trajectories], bool)


def batch_length(cfg: Config, trajectories: Sequence[tr.Trajectory]) -> int:
  """T of an update batch of `trajectories` (this process's; every process must call it, with the same answer):
  `train.batch_length` "bucket" the smallest of `buckets.batch_lengths(rollout.max_context)` that holds the
  longest trajectory of any process, "max_context" always the context length.

  Padding is never trained on (loss mask and attention segments) and adds only zeros to the gradient, so the
  length changes no value beyond float rounding: the sums over tokens are blocked differently (measured on the
  grpo_vs_tunix bench batch: parameters after one step within 1e-6 of the max_context step's).
  """
  limit = cfg.rollout.max_context
  if cfg.train.batch_length == "max_context":
    return limit
  longest = int(multihost.host_max(np.asarray(max((len(t) for t in trajectories), default=1), np.int64)))
  # Longer than the context: the context length, so that assembly names the trajectory (never truncated).
  return buckets_lib.fit(min(longest, limit), buckets_lib.batch_lengths(limit))


def prepare_batch(run: Run, state: TrainState, trajectories: Sequence[tr.Trajectory]) -> Prepared:
  """Assembly, advantages (PPO: values at collection time and GAE with bootstrap) and the loss normalizers."""
  cfg = run.config
  infrastructure_ok = trained_rows(run, trajectories)
  kept = variance_kept(cfg.tasks.variance_filter, trajectories, infrastructure_ok)
  train = infrastructure_ok & kept
  rewards_ns, mask_ns, group_ids = advantage_inputs(trajectories, steps=cfg.env.max_turns, gamma=cfg.algo.gamma)
  mask_ns &= train[:, None]  # excluded rows: no valid step, so in no group statistic and without advantage
  routes = RouteShape.of(run.policy.model.config) if replays_routes(cfg, run.policy.model.config) else None
  batch_shape = BatchShape(length=batch_length(cfg, trajectories), rows=run.rows.train,
                           pad_id=run.interface.tokenizer.pad_id, thresholds=config_lib.truncates(cfg.rollout),
                           routes=routes)
  values_ns = bootstrap_n = value_targets = None
  if cfg.algo.name == "ppo":
    # V(s_t) is read at the token before action t; V(s_T) of a cut-off episode at its last token (unpacked
    # rows: trajectory i is row i from position 0).
    state_pos = np.zeros(mask_ns.shape, np.int32)
    for i, t in enumerate(trajectories):
      for j, turn in enumerate(t.turns):
        state_pos[i, j] = turn.action.span[0] - 1
    plain = assemble(trajectories, shape=batch_shape)
    values_bt = multihost.local_rows(run.steps.value_fn(state.params, run.policy.layout.to_global(plain)))
    rows = np.arange(len(trajectories))
    values_ns = np.where(mask_ns, values_bt[rows[:, None], state_pos], 0.0)
    cut = np.asarray([t.termination in TRUNCATIONS and bool(t.turns) for t in trajectories]) & train
    last = np.asarray([max(len(t) - 1, 0) for t in trajectories])
    bootstrap_n = np.where(cut, values_bt[rows, last], 0.0).astype(np.float32)
  adv = _estimate(cfg, rewards_ns, mask_ns, group_ids, values_ns, bootstrap_n, trajectories)
  adv_ns = np.asarray(adv.advantages)
  if cfg.algo.turn_reward_weight:
    adv_ns = adv_ns + _turn_advantages(cfg, trajectories, mask_ns, group_ids)
  batch = assemble(trajectories, [adv_ns[i, :len(t.turns)] for i, t in enumerate(trajectories)], level="turn",
                   shape=batch_shape, train=train)
  value_normalizer = 0.0
  if values_ns is not None:
    shape = batch.tokens.shape
    old, ret, vmask = np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, bool)
    returns_ns = np.asarray(adv.returns)
    for i, j in zip(*np.nonzero(mask_ns)):
      p = state_pos[i, j]
      old[i, p], ret[i, p], vmask[i, p] = values_ns[i, j], returns_ns[i, j], True
    value_targets = ValueTargets(old_values=old, returns=ret, mask=vmask)
    value_normalizer = float(vmask.sum())
  normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids, aggregation=cfg.algo.aggregation,
                                     norm_length=cfg.algo.norm_length, allow_empty=True)
  batch, tokens = share_prefixes(run, batch)
  sums = multihost.host_sums({"normalizer": float(normalizer), "value_normalizer": value_normalizer,
                              "excluded": int((~infrastructure_ok).sum()),
                              "variance_filtered": int((infrastructure_ok & ~kept).sum()), **tokens})
  batch = run.policy.layout.to_global(batch)
  if run.steps.logprob_fn is not None:  # decoupled PPO: π_prox, the parameters this update starts from
    batch = batch.replace(proximal_logprobs=run.steps.logprob_fn(state.params, batch))
  return Prepared(batch=batch, normalizer=float(sums["normalizer"]),
                  value_targets=None if value_targets is None else run.policy.layout.to_global(value_targets),
                  value_normalizer=float(sums["value_normalizer"]),
                  stats={metrics_lib.EXCLUDED_TRAJECTORIES: int(sums["excluded"]), **_step_stats(adv),
                         **{k: int(sums[k]) for k in tokens},
                         **({"variance_filter/dropped_trajectories": int(sums["variance_filtered"])}
                            if cfg.tasks.variance_filter < 1.0 else {})},
                  estimate=adv,
                  excluded=tuple(None if used else ("variance_filter" if ok else t.termination.value)
                                 for t, used, ok in zip(trajectories, train, infrastructure_ok)))


def share_block_rows(run: Run, rows: int) -> int:
  """The unshared rows a prefix-tree block covers (`shared_prefix`): the most that lie inside one process's
  `rows`, one micro-batch and one device's share of the global batch, so no gather crosses them."""
  total = rows * jax.process_count()
  layout = run.policy.layout
  shards = 1 if layout.mesh is None else multihost.batch_shards(total, layout.mesh, layout.learner_rules)[1]
  return math.gcd(rows, total // run.config.train.micro_batches, total // shards)


def share_prefixes(run: Run, batch: Batch) -> tuple[Batch, dict[str, int]]:
  """`batch` with its prefix trees attached when `train.shared_prefix` says to share (on, or auto and
  `Sharing.worth_it` over all processes: the padded slots shrink by more than `train.shared_prefix_min_saving`
  and the attention scores do not grow), and this process's tokens computed vs unshared (equal when not shared).
  Every process takes the same decision and shape."""
  cfg = run.config
  real = int((batch.segment_ids != 0).sum())
  router = bool(cfg.algo.moe_load_balance_coef or cfg.algo.moe_router_z_coef)  # counts tokens: never shared
  unshared = {metrics_lib.TOKENS_COMPUTED: real, metrics_lib.TOKENS_UNSHARED: real}
  if cfg.train.shared_prefix == "off" or router:
    return batch, unshared
  trees = shared_prefix.prefix_trees(batch, share_block_rows(run, batch.tokens.shape[0]))
  # One collective for the shape: the largest tree on any process, and the fullest block's rows at each length.
  lengths = shared_prefix.packed_lengths(batch.tokens.shape[1] * trees.block_rows)
  most = multihost.host_max(np.asarray([trees.largest] + [trees.rows_needed(n) for n in lengths], np.int64))
  length = buckets_lib.fit(max(int(most[0]), 1), lengths)
  packed_rows = shared_prefix.packed_rows_for(int(most[1 + lengths.index(length)]))
  sharing = shared_prefix.measure(trees, batch.tokens.shape, length=length, packed_rows=packed_rows,
                                  real_tokens=real)
  total = shared_prefix.Sharing(**{k: int(v) for k, v in multihost.host_sums(dataclasses.asdict(sharing)).items()})
  if cfg.train.shared_prefix == "auto" and not total.worth_it(cfg.train.shared_prefix_min_saving):
    return batch, unshared
  batch = batch.replace(shared=shared_prefix.pack(batch, trees, length=length, packed_rows=packed_rows))
  return batch, {metrics_lib.TOKENS_COMPUTED: sharing.tokens_computed, metrics_lib.TOKENS_UNSHARED: real}


def _step_stats(adv: algos.AdvantageOutput) -> dict[str, float]:
  """gigpo's anchor-state group sizes (this process's rows; a group never spans two processes)."""
  if adv.step_stats is None:
    return {}
  return {f"gigpo/{k}": float(v) for k, v in jax.device_get(adv.step_stats).items()}


def group_statistics(run: Run, trajectories: Sequence[tr.Trajectory],
                     estimate: algos.AdvantageOutput | None = None) -> dict[str, float]:
  """Within-group return spread of `trajectories` with the advantage estimator's own grouping: a trajectory
  without a turn or ended by an infrastructure failure is in no group. Summed over processes (a group never
  spans two: each holds whole task slots).

  `estimate`: the estimator's output for exactly these trajectories, when `prepare_batch` already has it.
  """
  cfg = run.config
  if estimate is None:
    rewards_ns, mask_ns, group_ids = advantage_inputs(trajectories, steps=cfg.env.max_turns, gamma=cfg.algo.gamma)
    mask_ns &= trained_rows(run, trajectories)[:, None]
    values = np.zeros(mask_ns.shape, np.float32) if cfg.algo.advantage == "gae" else None  # unused by the groups
    bootstrap = np.zeros(mask_ns.shape[:1], np.float32) if cfg.algo.advantage == "gae" else None
    estimate = _estimate(cfg, rewards_ns, mask_ns, group_ids, values, bootstrap, trajectories)
  groups, flat, std = (float(x) for x in jax.device_get((estimate.groups, estimate.zero_variance_groups,
                                                         estimate.group_return_std)))
  groups, flat, spread = multihost.host_sum(np.asarray([groups, flat, std * groups]))
  return {metrics_lib.REWARD_STD_WITHIN_GROUP: float(spread / max(groups, 1.0)),
          metrics_lib.ZERO_VARIANCE_GROUP_FRACTION: float(flat / max(groups, 1.0))}


def update(run: Run, state: TrainState, prepared: Prepared) -> tuple[TrainState, dict[str, Any]]:
  """`train.updates_per_iteration` jitted steps on one prepared batch; metrics of the last one (on the host)."""
  for _ in range(run.config.train.updates_per_iteration):
    state, m = run.steps.rl(state, prepared.batch, jnp.float32(prepared.normalizer), prepared.value_targets,
                            jnp.float32(prepared.value_normalizer))
  return state, jax.device_get(m)
