"""Host-callback bridge: step environments from inside a jitted rollout program.

`EnvBridge.step(action_tokens_ba, action_lengths_b)` is traceable (usable under `jit`, `lax.while_loop`,
`lax.scan`). It runs `io_callback` inside `shard_map` over the batch axis (`multihost.per_shard_callback`, which
the rollout engine's callback transport uses too), so each shard — on every host — calls only its own pool with
only its own rows; outside `shard_map` the callback would gather the whole batch to one device (docs/design.md §4).

Outcome codes (int32) are `envs.OUTCOME_CODES`:
  0 ok, 1 completed, 2 max_turns, 3 context_exhausted, 4 turn_budget_exhausted, 5 invalid_action,
  6 parser_rejected, 7 env_error, 8 env_timeout, 9 retries_exhausted, 10 cancelled, 11 worker_crash,
  12 invalid_action_continued, 13 parser_rejected_continued, 14 replay_diverged, 15 history_rewritten.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import envs
from jaxagent import multihost

OUTCOME_CODES = dict(envs.OUTCOME_CODES)


class StepPool(Protocol):
  """What the bridge needs of a pool (envs.pool.Pool satisfies it): row i of a shard is slot i."""

  def step_many(self, slots: Sequence[int], actions: Sequence[str]) -> list[envs.StepResult]: ...


class TextTokenizer(Protocol):
  pad_id: int

  def encode(self, text: str) -> list[int]: ...
  def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """Per-row results of one bridge step (all leading dim B).

  Attributes:
    obs_tokens: int32[B, O], padded with the tokenizer's pad id.
    obs_lengths: int32[B], 0 for rows that were already done.
    reward: float32[B], the step reward (sum of its components).
    done: bool[B].
    outcome: int32[B], see the module docstring.
  """
  obs_tokens: jax.Array
  obs_lengths: jax.Array
  reward: jax.Array
  done: jax.Array
  outcome: jax.Array


jax.tree_util.register_dataclass(EnvStep, data_fields=["obs_tokens", "obs_lengths", "reward", "done", "outcome"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class HostStep:
  """What the host kept of one shard's step: texts and full StepResults, for the trajectory record."""
  shard: int
  actions: list[str]
  results: list[envs.StepResult]
  obs_truncated_tokens: list[bool]


class EnvBridge:
  """Steps per-shard env pools from jitted code.

  Args:
    pools: shard index -> pool; a host only needs the pools of its own (addressable) shards. Shard index is
      the position along `batch_axes` of the mesh (row-major when several axes).
    tokenizer: decodes action tokens, encodes observation text (never to special tokens).
    mesh: the device mesh.
    obs_len: O, observation tokens per row; longer observations are cut (flagged in `history`).
    batch_axes: mesh axis name(s) the batch dimension is sharded over.
  """

  def __init__(self, pools: Mapping[int, StepPool] | Sequence[StepPool], tokenizer: TextTokenizer, mesh: Mesh,
               obs_len: int, batch_axes: str | tuple[str, ...] = "data", keep_history: bool = True):
    if obs_len < 1:
      raise ValueError(f"obs_len={obs_len}: must be >= 1")
    self.batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    missing = [a for a in self.batch_axes if a not in mesh.axis_names]
    if missing:
      raise ValueError(f"batch_axes {missing} not in mesh axes {mesh.axis_names}")
    self.pools = dict(enumerate(pools)) if isinstance(pools, Sequence) else dict(pools)
    self.tokenizer, self.mesh, self.obs_len = tokenizer, mesh, obs_len
    self.num_shards = int(np.prod([mesh.shape[a] for a in self.batch_axes]))
    self.keep_history = keep_history
    self.history: list[HostStep] = []
    self._lock = threading.Lock()

  # -- host side
  def _host_step(self, shard, tokens_ba, lengths_b):
    shard = int(np.asarray(shard).reshape(-1)[0])
    try:
      pool = self.pools[shard]
    except KeyError:
      raise KeyError(f"EnvBridge: no pool for shard {shard}; have shards {sorted(self.pools)}") from None
    tokens_ba, lengths_b = np.asarray(tokens_ba), np.asarray(lengths_b)
    rows = tokens_ba.shape[0]
    actions = [self.tokenizer.decode(tokens_ba[i, :max(0, int(lengths_b[i]))].tolist()) for i in range(rows)]
    results = pool.step_many(list(range(rows)), actions)
    obs = np.full((rows, self.obs_len), self.tokenizer.pad_id, np.int32)
    lens = np.zeros((rows,), np.int32)
    reward = np.zeros((rows,), np.float32)
    done = np.zeros((rows,), np.bool_)
    outcome = np.zeros((rows,), np.int32)
    cut = []
    for i, r in enumerate(results):
      ids = self.tokenizer.encode(r.observation.text) if not r.info.get("already_done") else []
      cut.append(len(ids) > self.obs_len)
      ids = ids[:self.obs_len]
      obs[i, :len(ids)] = ids
      lens[i], reward[i], done[i] = len(ids), r.reward, r.done
      outcome[i] = OUTCOME_CODES[r.outcome]
    if self.keep_history:
      with self._lock:
        self.history.append(HostStep(shard, actions, results, cut))
    return obs, lens, reward, done, outcome

  # -- traced side
  def step(self, action_tokens_ba: jax.Array, action_lengths_b: jax.Array) -> EnvStep:
    """int32[B, A], int32[B] -> EnvStep; traceable. B must divide by the number of batch shards."""
    b = action_tokens_ba.shape[0]
    if b % self.num_shards:
      raise ValueError(f"batch {b} is not divisible by the {self.num_shards} shards of {self.batch_axes}")
    rows = b // self.num_shards
    shapes = (jax.ShapeDtypeStruct((rows, self.obs_len), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
              jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.bool_),
              jax.ShapeDtypeStruct((rows,), jnp.int32))
    args = (action_tokens_ba.astype(jnp.int32), action_lengths_b.astype(jnp.int32))
    out = multihost.per_shard_callback(self._host_step, shapes, args, self.mesh, self.batch_axes)
    return EnvStep(*out)

  def __call__(self, action_tokens_ba, action_lengths_b) -> EnvStep:
    return self.step(action_tokens_ba, action_lengths_b)

  def take_history(self) -> list[HostStep]:
    with self._lock:
      out, self.history = self.history, []
    return out

