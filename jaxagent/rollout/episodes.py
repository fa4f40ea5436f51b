"""What the rollout engine tracks per episode (`Episode`, its `EpisodeState`), a branch to replay (`Branch`),
and what a rollout reports (`RolloutStats`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from typing import Any

import numpy as np

import envs
from jaxagent import trajectory as tr
from jaxagent.chat import Frame


@dataclasses.dataclass(frozen=True)
class Branch:
  """An episode that continues `parent` from just before its action `turn` (a counterfactual for that step).

  The env is reset with the parent's task and seed and the parent's first `turn` actions are replayed on it
  (a deterministic env is then in the parent's state: `Env.state_key` says whether it is); the token stream
  starts as the parent's first tokens up to that action, fed as one prompt, carrying no loss. The branch is
  recorded with `metadata.branch = {parent, turn, group}` (its parent's id, the turn, the parent's group)."""
  task: envs.Task
  parent: tr.Trajectory
  turn: int

  def __post_init__(self):
    if not 0 <= self.turn < len(self.parent.turns):
      raise ValueError(f"branch at turn {self.turn}: the parent has turns 0..{len(self.parent.turns) - 1}")


class EpisodeState(enum.Enum):
  QUEUED = "queued"        # not admitted yet
  RESETTING = "resetting"  # its env's reset is running
  FEEDING = "feeding"      # tokens (prompt pieces, an observation frame) or a prompt copy wait for a feed
  DECODING = "decoding"    # the device is decoding its action
  STEPPING = "stepping"    # its env is running its action
  DONE = "done"


@dataclasses.dataclass
class Episode:
  """Host-side state of one episode during a rollout."""

  index: int                    # in this process's quota
  task: envs.Task
  seed: int
  group_id: str
  state: EpisodeState = EpisodeState.QUEUED
  slot: int | None = None
  stream: tr.TokenStream | None = None
  prompt: tuple[int, ...] = ()
  first_text: str = ""          # the env's first observation (TaskRecord.prompt)
  pending: list[int] = dataclasses.field(default_factory=list)  # tokens still to feed
  fed_prompt: bool = False      # the prompt is in the cache
  frame: Frame | None = None    # the observation frame being fed
  future: concurrent.futures.Future | None = None
  action: tuple | None = None   # (span, text, tokens) of the action its env is running
  action_version: int = 0       # the policy version of that action's first token
  version: int = 0              # the policy version when it was admitted (the trajectory's)
  turns: list[tr.Turn] = dataclasses.field(default_factory=list)
  state_key: str | None = None  # the anchor state its next action is taken in (the last observation's)
  branch: Branch | None = None  # continues another trajectory (see `Branch`)
  routes: np.ndarray | None = None  # router replay: the experts its tokens used (`Actor.episode_routes`)
  termination: envs.Termination | None = None
  verifier: tr.VerifierRecord = tr.VerifierRecord()
  verify_s: float = 0.0
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)  # process / slot / env worker that ran it
  # Timing: seconds since the rollout began (admitted, ended), per-stage sums, and when the current stage began.
  admitted_s: float = 0.0
  ended_s: float = 0.0
  reset_s: float = 0.0
  decode_s: float = 0.0
  env_s: float = 0.0
  extend_s: float = 0.0
  since: float = 0.0
  answered: float = 0.0        # when its env's last reply arrived
  last_decode_s: float = 0.0    # the current action's decode time


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """Batch-level stage times of a rollout (seconds).

  Attributes:
    reset_s, env_s: env time summed over episodes (resets; steps): what the envs spent, not wall time.
    decode_s, extend_s: wall time in decode and feed calls (the device's work; a fused feed + decode call,
      and with the callback transport the program's time between host exchanges, count as decode).
    transfer_s: the weights' move to the rollout devices before the rollout (disaggregated placement).
    idle_s: wall time the engine spent waiting on envs with no device call running: every live episode
      waited on its env, or the continuous schedule held a few ready rows back for the many about to arrive
      (`HOLD_READY_FRACTION`), or (several processes) it polled for the others.
    wall_s: the rollout's wall time.
    env_steps, action_tokens: counts.
  """
  reset_s: float
  decode_s: float
  env_s: float
  extend_s: float
  env_steps: int
  action_tokens: int
  idle_s: float = 0.0
  wall_s: float = 0.0
  transfer_s: float = 0.0  # moving the weights to the rollout devices (mesh.placement=disaggregated)

  def __add__(self, other: "RolloutStats") -> "RolloutStats":
    return RolloutStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  @property
  def device_idle_fraction(self) -> float:
    return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0
