"""Token assembly: trajectories -> one fixed-shape, padded, masked `Batch` (host side, numpy).

Token-in, token-out (docs/design.md §2.1): the batch is made of the recorded stream `Trajectory.tokens` — the
tokens the sampler produced and the observation tokens it appended — copied, never re-tokenized. Lengths are
padded up to one of a few bucket sizes (and rows up to a fixed count) so jitted consumers see a handful of
shapes and do not recompile every step. A trajectory longer than the largest bucket is an error, never
silently truncated.

Shape letters: B rows, T bucket length, N trajectories, S steps (turns).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import flax.struct
import numpy as np

from jaxagent import buckets as buckets_lib
from jaxagent.trajectory import PAD_ROLE, Trajectory

DEFAULT_BUCKETS: tuple[int, ...] = buckets_lib.BATCH


@flax.struct.dataclass
class Batch:
  """A training batch; a pytree (every leaf leads with `[B, T]`, but `shared`'s packed ones: `[P, L]`).

  Attributes:
    tokens: int32[B, T] the recorded token stream; `pad_id` at padding.
    positions: int32[B, T] position within its sequence (restarts at 0 in each packed segment; 0 at padding).
    segment_ids: int32[B, T] 1, 2, … per sequence in a row; 0 = padding (the models' attention rule).
    loss_mask: bool[B, T] the recorded loss mask; False at padding.
    roles: int8[B, T] `Role` per token; `PAD_ROLE` (-1) at padding.
    behavior_logprobs: float32[B, T] behavior log-prob of sampled tokens; 0 elsewhere.
    advantages: float32[B, T] per-token advantage on loss tokens; 0 elsewhere.
    policy_versions: int32[B, T] behavior policy version of sampled tokens; -1 elsewhere.
    trajectory_index: int32[B, T] index of the source trajectory in the input list; -1 at padding.
    sampling_thresholds: float32[B, T] where truncated sampling cut each sampled token's tempered logits (NaN:
      nothing cut, and everywhere else), or None when the batch was assembled without them (untruncated
      sampling: the learner then compiles without the truncation at all).
    proximal_logprobs: float32[B, T] decoupled PPO's log π_prox, filled on the device (`make_logprob_fn`).
    expert_routes: int16[B, T, M, k] the experts each token used in the sampler (router replay; -1: the
      learner routes that token itself), or None when the batch was assembled without them.
    shared: the same sequences as prefix trees (`jaxagent.shared_prefix.SharedPrefix`): the model runs on those,
      the losses on this batch; None: the model runs on this batch.
  """
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  roles: np.ndarray
  behavior_logprobs: np.ndarray
  advantages: np.ndarray
  policy_versions: np.ndarray
  trajectory_index: np.ndarray
  sampling_thresholds: np.ndarray | None = None
  proximal_logprobs: np.ndarray | None = None
  expert_routes: np.ndarray | None = None
  shared: Any = None  # a `jaxagent.shared_prefix.SharedPrefix` (which imports this module)

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens.shape)


@dataclasses.dataclass(frozen=True)
class RouteShape:
  """What a policy's recorded routes must look like (`models.ModelConfig`: its sparse layers, top-k, experts)."""
  sparse_layers: int
  experts_per_token: int
  experts: int
  model: str = ""  # named in refusals (the model_type)

  @classmethod
  def of(cls, config: Any) -> "RouteShape | None":
    """The shape of a `models.ModelConfig`'s routes; None for a dense model."""
    sparse = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if not sparse:
      return None
    return cls(sparse, config.num_experts_per_tok, config.num_experts, config.model_type)


def check_routes(t: Trajectory, shape: RouteShape) -> None:
  """Refuses (ValueError, naming the trajectory and both shapes) routes recorded on another model: replaying
  them would route tokens to the wrong experts, or to experts that do not exist."""
  m, k = t.expert_routes.shape[1:]
  top = int(t.expert_routes.max(initial=-1))
  if (m, k) != (shape.sparse_layers, shape.experts_per_token) or top >= shape.experts:
    raise ValueError(
        f"trajectory {t.id or t.task.id}: expert_routes were recorded on a model with {m} sparse layers x top-{k}"
        f" (largest expert id {top}); this policy ({shape.model or 'mixture of experts'}) has "
        f"{shape.sparse_layers} sparse layers x top-{shape.experts_per_token} of {shape.experts} experts. "
        "Replay routes only on the model that recorded them (or set model.moe.router_replay: false)")


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= length; ValueError when none is (`buckets.fit`)."""
  return buckets_lib.fit(length, buckets)


def group_indices(trajectories: Sequence[Trajectory]) -> np.ndarray:
  """Dense int32 group index per trajectory (first-seen order of `group_id`), for the advantage estimators."""
  index: dict[str, int] = {}
  return np.array([index.setdefault(t.group_id, len(index)) for t in trajectories], np.int32)


def advantage_inputs(trajectories: Sequence[Trajectory], *, steps: int | None = None, gamma: float = 1.0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-step rewards for the registered estimators: `(rewards_ns float32, mask_ns bool, group_ids_n int32)`.

  Step t is turn t with reward `turns[t].reward`; the terminal reward `r_T^term` is added to the last step
  as `γ · r_T^term`, so the discounted return at step 0 is `Σ γ^t r_t + γ^T r_T^term` (docs/design.md §2.1).
  A trajectory without turns has no valid step. `steps` pads S to a fixed size (default: the max turn count).
  """
  n_turns = [len(t.turns) for t in trajectories]
  s = max(n_turns, default=0) if steps is None else steps
  if max(n_turns, default=0) > s:
    raise ValueError(f"a trajectory has {max(n_turns)} turns > steps={s}")
  rewards = np.zeros((len(trajectories), max(s, 1)), np.float32)
  mask = np.zeros_like(rewards, bool)
  for i, t in enumerate(trajectories):
    for j, turn in enumerate(t.turns):
      rewards[i, j] = turn.reward
    if t.turns:
      rewards[i, len(t.turns) - 1] += gamma * t.reward.terminal
      mask[i, :len(t.turns)] = True
  return rewards, mask, group_indices(trajectories)


def step_group_indices(trajectories: Sequence[Trajectory], *, steps: int | None = None) -> np.ndarray:
  """GiGPO's anchor-state groups: int32[N, S], equal for the steps of one advantage group (`group_id`) taken in
  the same anchor state (`Turn.state_key`), dense in first-seen order; -1 for a step without a key or past the
  trajectory's turns. Steps of different task groups never share an index, even with equal keys. A branch
  (`metadata.branch`) counts in its parent's group: its continuations are the counterfactuals of the parent's
  steps from the same states."""
  n_turns = [len(t.turns) for t in trajectories]
  s = max(n_turns, default=0) if steps is None else steps
  out = np.full((len(trajectories), max(s, 1)), -1, np.int32)
  index: dict[tuple[str, str], int] = {}
  for i, t in enumerate(trajectories):
    for j, turn in enumerate(t.turns[:out.shape[1]]):
      if turn.state_key is not None:
        owner = (t.metadata.get("branch") or {}).get("group", t.group_id)
        out[i, j] = index.setdefault((owner, turn.state_key), len(index))
  return out


def turn_rewards(trajectories: Sequence[Trajectory], *, steps: int | None = None,
                 exclude: Sequence[str] = ("outcome",)) -> np.ndarray:
  """Per-turn rewards for `algo.turn_reward_weight`: float32[N, S], each turn's reward components but those in
  `exclude` (by default the outcome: what is left is what the turn itself earned: validity, progress, cost)."""
  n_turns = [len(t.turns) for t in trajectories]
  s = max(n_turns, default=0) if steps is None else steps
  out = np.zeros((len(trajectories), max(s, 1)), np.float32)
  for i, t in enumerate(trajectories):
    for j, turn in enumerate(t.turns[:out.shape[1]]):
      out[i, j] = sum(v for k, v in turn.reward_components.items() if k not in exclude)
  return out


def _token_advantages(t: Trajectory, adv, level: str, i: int) -> np.ndarray:
  out = np.zeros(len(t), np.float32)
  if adv is None:
    return out
  if level == "trajectory":
    out[:] = float(adv)
  elif level == "turn":
    adv = np.asarray(adv, np.float32)
    if adv.ndim != 1 or adv.shape[0] < len(t.turns):
      raise ValueError(f"trajectory {i}: per-turn advantages of shape {adv.shape} for {len(t.turns)} turns")
    for j, turn in enumerate(t.turns):
      start, stop = turn.action.span
      out[start:stop] = adv[j]
  elif level == "token":
    adv = np.asarray(adv, np.float32)
    if adv.shape != (len(t),):
      raise ValueError(f"trajectory {i}: per-token advantages of shape {adv.shape}, expected ({len(t)},)")
    out[:] = adv
  else:
    raise ValueError(f"level={level!r}: not 'trajectory', 'turn' or 'token'")
  return np.where(t.loss_mask, out, 0.0).astype(np.float32)


def _token_versions(t: Trajectory) -> np.ndarray:
  return np.where(np.isfinite(t.behavior_logprobs), t.behavior_versions, -1).astype(np.int32)


def first_fit_rows(lengths: Sequence[int], length: int) -> list[list[int]]:
  """First-fit decreasing: rows of trajectory indices whose lengths sum to <= length."""
  rows: list[list[int]] = []
  free: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
    for r, room in enumerate(free):
      if lengths[i] <= room:
        rows[r].append(i)
        free[r] -= lengths[i]
        break
    else:
      rows.append([i])
      free.append(length - lengths[i])
  return rows


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """The shape and the carried fields of a batch `assemble` builds (static: every process builds batches of
  one structure).

  Attributes:
    buckets: allowed lengths T; the batch uses the smallest that fits (ignored when `length` is given).
    length: fixed T instead of a bucket.
    rows: fixed B (empty rows are all padding); default: as many as needed.
    pad_id: token id at padding.
    pack: place several trajectories per row (segment ids 1, 2, …), first-fit decreasing.
    thresholds: carry the recorded `sampling_thresholds` (rollouts sampled with top-k / top-p).
    routes: carry the recorded `expert_routes` of a policy of this `RouteShape` (router replay). A trajectory
      without routes gets -1 (routed by the learner); one recorded on a model of another shape is refused
      (`check_routes`).
  """
  buckets: Sequence[int] = DEFAULT_BUCKETS
  length: int | None = None
  rows: int | None = None
  pad_id: int = 0
  pack: bool = False
  thresholds: bool = False
  routes: RouteShape | None = None


def assemble(trajectories: Sequence[Trajectory], advantages: Sequence | np.ndarray | None = None, *,
             level: Literal["trajectory", "turn", "token"] = "trajectory", shape: BatchShape = BatchShape(),
             train: Sequence[bool] | None = None) -> Batch:
  """Copies recorded token streams into a padded `Batch` of `shape`.

  Args:
    trajectories: the records; their `tokens`/`roles`/`loss_mask`/`behavior_logprobs` are used verbatim.
    advantages: per trajectory, by `level`: "trajectory" a scalar (e.g. GRPO), "turn" one value per turn
      (e.g. `AdvantageOutput.advantages[i]`, spread over that turn's action span), "token" one per token.
      Only loss tokens keep a non-zero advantage. None: zeros.
    shape: the batch's length, rows, padding, packing and carried fields (`BatchShape`).
    train: per trajectory, whether its loss tokens count (False: its tokens are in the batch, its loss mask
      and advantages are all zero; e.g. an episode ended by an infrastructure failure). Default: all True.
  Returns:
    `Batch` of numpy arrays, shapes `[B, T]`.
  """
  length, rows, pad_id, thresholds, routes = shape.length, shape.rows, shape.pad_id, shape.thresholds, shape.routes
  if advantages is not None and len(advantages) != len(trajectories):
    raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
  if train is not None and len(train) != len(trajectories):
    raise ValueError(f"{len(train)} train flags for {len(trajectories)} trajectories")
  lengths = [len(t) for t in trajectories]
  longest = max(lengths, default=1)
  if length is None:
    length = bucket_length(longest, shape.buckets)
  elif longest > length:
    raise ValueError(f"trajectory of {longest} tokens does not fit length={length} (never truncated)")
  layout = first_fit_rows(lengths, length) if shape.pack else [[i] for i in range(len(trajectories))]
  b = len(layout) if rows is None else rows
  if len(layout) > b:
    raise ValueError(f"{len(trajectories)} trajectories need {len(layout)} rows > rows={rows}")

  batch = dict(
      tokens=np.full((b, length), pad_id, np.int32),
      positions=np.zeros((b, length), np.int32),
      segment_ids=np.zeros((b, length), np.int32),
      loss_mask=np.zeros((b, length), bool),
      roles=np.full((b, length), PAD_ROLE, np.int8),
      behavior_logprobs=np.zeros((b, length), np.float32),
      advantages=np.zeros((b, length), np.float32),
      policy_versions=np.full((b, length), -1, np.int32),
      trajectory_index=np.full((b, length), -1, np.int32),
  )
  if thresholds:
    batch["sampling_thresholds"] = np.full((b, length), np.nan, np.float32)
  if routes is not None:
    batch["expert_routes"] = np.full((b, length, routes.sparse_layers, routes.experts_per_token), -1, np.int16)
  for r, members in enumerate(layout):
    offset = 0
    for seg, i in enumerate(members, start=1):
      t = trajectories[i]
      sl = np.s_[r, offset:offset + len(t)]
      batch["tokens"][sl] = t.tokens
      batch["positions"][sl] = np.arange(len(t), dtype=np.int32)
      batch["segment_ids"][sl] = seg
      used = train is None or bool(train[i])
      batch["loss_mask"][sl] = t.loss_mask & used
      batch["roles"][sl] = t.roles
      batch["behavior_logprobs"][sl] = np.where(np.isfinite(t.behavior_logprobs), t.behavior_logprobs, 0.0)
      if used:
        batch["advantages"][sl] = _token_advantages(t, None if advantages is None else advantages[i], level, i)
      batch["policy_versions"][sl] = _token_versions(t)
      batch["trajectory_index"][sl] = i
      if thresholds:
        batch["sampling_thresholds"][sl] = t.sampling_thresholds
      if routes is not None and t.expert_routes is not None:
        check_routes(t, routes)
        batch["expert_routes"][sl] = t.expert_routes
      offset += len(t)
  return Batch(**batch)
