"""Trajectory records: the contract between the sampler, the environments and the learner (docs/design.md §2.1).

A trajectory `τ = (x, o_0, a_0, …, a_{T-1}, o_T)` is stored as ONE flat token stream `z` (what the sampler
actually fed the model and produced) with a role, a loss-mask bit and a behavior log-prob per token, plus
per-turn records whose `span`s index into that stream. Tokens live in exactly one place, so the learner trains
on the sampled tokens and the appended observation tokens as recorded; chat history is never re-tokenized.

`TokenStream` is the host-side builder the rollout engine uses: `sampled(...)` appends policy tokens with their
log-probs, `text(text, role, tokenizer)` appends untrusted text through `tokenizer.encode` (which never yields
special tokens), `control(name, role, tokenizer)` is the only way a control token enters the stream, and
`extend(frame)` appends a frame that `jaxagent.chat` built through those same doors.

Vocabulary shared with `envs` (imported, never redefined): `Termination`, `Outcome`, the invalid-action rule
names. Record types have names of their own (`TaskRecord`, `ObservationRecord`, `VerifierRecord`) so they are
never confused with the env-side `envs.Task`, `envs.Observation`, `envs.Verdict`.

Every record carries `schema` (`SCHEMA_VERSION`); `from_dict` rejects unknown versions and malformed records
with `TrajectoryFormatError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from envs import INVALID_ACTION_RULES, Outcome, Termination  # one vocabulary from env to record

SCHEMA_VERSION = 7
# 2 added the per-trajectory stage times of `Timing` (1 reads with zeros); 3 added `sampling_thresholds` (1 and 2
# read with NaN: sampled from the whole distribution, as every sampler before it did in training); 4 added
# `behavior_versions` (1 to 3 read with each action's turn version: no weight update reached a running episode);
# 5 added `Turn.state_key` (1 to 4 read with None: no anchor state); 6 added `TaskRecord.prompt` (1 to 5 read
# with ""); 7 added `expert_routes` (1 to 6 read with None: no routes recorded, the learner routes every token).
READABLE_SCHEMAS = (1, 2, 3, 4, 5, 6, 7)
KIND = "jaxagent.trajectory"


class TrajectoryFormatError(ValueError):
  """A record is malformed, inconsistent, or has a schema version this build cannot read."""


class Role(enum.IntEnum):
  """Who produced a token. Stored as int8 per token; `PAD_ROLE` (-1) marks padding in batches."""
  SYSTEM = 0
  PROMPT = 1
  POLICY = 2
  TOOL = 3
  ERROR = 4
  REASONING = 5


PAD_ROLE = -1
# Roles whose tokens the policy sampled (they have a behavior log-prob and may carry loss).
SAMPLED_ROLES = (Role.POLICY, Role.REASONING)
# Roles whose tokens came from outside the policy; never trained on.
OBSERVATION_ROLES = (Role.TOOL, Role.ERROR)


def _has_role(roles: np.ndarray, allowed) -> np.ndarray:
  """bool per token: its role is one of `allowed` (a table lookup: `np.isin` costs ~20 us per call, and
  validation calls it a few times per turn of every trajectory a rollout builds)."""
  table = np.zeros(256, bool)
  table[[int(r) & 0xFF for r in allowed]] = True
  return table[np.asarray(roles, np.int8).view(np.uint8)]


# ----------------------------------------------------------------------------------------------
# Small frozen records.


@dataclasses.dataclass(frozen=True)
class TaskRecord:
  """The task an episode ran (its payload stays with the env: answers never enter the record)."""
  id: str
  split: Literal["train", "tune", "eval"] = "train"
  version: str = ""                    # task / dataset version
  prompt: str = ""                     # the env's first observation: what the agent was asked (schema 6)


@dataclasses.dataclass(frozen=True)
class EnvInfo:
  name: str
  version: str                         # code hash or image digest
  seed: int
  clock: str = "host"                  # clock policy ("host": the real clock; no pool freezes it yet)
  network: str = "host"                # network policy ("none" inside a sandbox pool)
  invalid_action_rule: str = "error_observation"  # docs/design.md §2.3: one of envs.INVALID_ACTION_RULES

  def __post_init__(self):
    if self.invalid_action_rule not in INVALID_ACTION_RULES:
      raise TrajectoryFormatError(f"env.invalid_action_rule={self.invalid_action_rule!r}: not one of "
                                  f"{INVALID_ACTION_RULES}")


@dataclasses.dataclass(frozen=True)
class Action:
  span: tuple[int, int]                # [start, stop) into the token stream
  text: str
  valid: bool = True
  parsed: Any = None                   # the parsed call (JSON-able), None when unparseable


@dataclasses.dataclass(frozen=True)
class ObservationRecord:
  span: tuple[int, int]                # [start, stop) of the observation's own tokens in the stream
  text: str
  truncated: bool = False
  original_bytes: int = 0              # size before truncation


@dataclasses.dataclass(frozen=True)
class Turn:
  action: Action
  observation: ObservationRecord | None = None
  reward: float = 0.0
  reward_components: Mapping[str, float] = dataclasses.field(default_factory=dict)
  policy_version: int = 0              # behavior policy that sampled this action
  t_decode_s: float = 0.0
  t_env_s: float = 0.0
  outcome: str = "ok"                  # the env step's `envs.Outcome` (finer than the termination)
  state_key: str | None = None         # the anchor state the action was taken in (`envs.Env.state_key`)

  def __post_init__(self):
    try:
      object.__setattr__(self, "outcome", Outcome(self.outcome).value)
    except ValueError:
      raise TrajectoryFormatError(f"turn outcome {self.outcome!r}: not one of {[o.value for o in Outcome]}") from None


@dataclasses.dataclass(frozen=True)
class Reward:
  total: float                         # the return R(τ) = Σ γ^t r_t + γ^T r_T^term
  gamma: float = 1.0
  terminal: float = 0.0                # r_T^term (e.g. verifier outcome)
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)   # validity/progress/outcome/cost


@dataclasses.dataclass(frozen=True)
class VerifierRecord:
  """The verifier's verdict on the episode, kept with its evidence (None: no verifier ran)."""
  name: str = ""
  version: str = ""
  passed: bool | None = None
  evidence: Any = None                 # JSON-able


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds spent on one trajectory: per stage (summed over its turns) and when it was admitted and ended
  (since its rollout began; the engine's slots run episodes concurrently)."""
  reset_s: float = 0.0
  verify_s: float = 0.0
  decode_s: float = 0.0   # from each action's start to its end (shared decode steps included)
  env_s: float = 0.0      # its env steps
  extend_s: float = 0.0   # from each observation's arrival to its frame being in the cache (queueing included)
  admitted_s: float = 0.0
  ended_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Reasoning:
  kept: bool = False                   # private reasoning tokens kept in the stream
  trained: bool = False                # and carry loss


def _frozen_array(x: Any, dtype: Any, name: str) -> np.ndarray:
  try:
    arr = np.array(x, dtype=dtype)
  except (TypeError, ValueError) as e:
    raise TrajectoryFormatError(f"{name}: cannot convert to {np.dtype(dtype).name}: {e}") from None
  if arr.ndim != 1:
    raise TrajectoryFormatError(f"{name}: expected a 1-D array, got shape {arr.shape}")
  arr.flags.writeable = False
  return arr


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
  """One episode. Arrays are read-only numpy, all of length `len(tokens)`.

  Attributes:
    tokens: int32[L] the stream `z` exactly as the sampler saw/produced it.
    roles: int8[L] `Role` per token.
    loss_mask: bool[L] 1 only for sampled tokens selected for update.
    behavior_logprobs: float32[L] log μ(z_j | z_<j) for sampled tokens; NaN elsewhere.
    sampling_thresholds: float32[L] where top-k / top-p cut the tempered logits each sampled token was drawn
      from (`rollout.sampler.truncation_threshold`; μ is the renormalised distribution over the logits >= it);
      NaN: nothing cut, or not a sampled token. Default: all NaN.
    behavior_versions: int32[L] the policy version that sampled each token (-1: not a sampled token). A weight
      update that reaches a running episode (`train.freshness: async`) splits one action between two versions.
      Default: every sampled token of a turn has the turn's `policy_version`.
    expert_routes: int16[L, M, k] or None. Mixture-of-experts policies with router replay: the k experts each
      token used in each of the M sparse layers when the sampler computed it (-1: not computed there, e.g. a
      token never fed); the learner's forward replays them. None: nothing recorded (a dense policy, replay off).
    policy_version: behavior policy version at the start of the episode (turns carry their own: the version
      of each action's first token).
    group_id: trajectories sharing it form one advantage group (default: the task id).
  """
  task: TaskRecord
  env: EnvInfo
  policy_version: int
  termination: Termination
  reward: Reward
  turns: tuple[Turn, ...]
  tokens: np.ndarray
  roles: np.ndarray
  loss_mask: np.ndarray
  behavior_logprobs: np.ndarray
  sampling_thresholds: np.ndarray | None = None
  behavior_versions: np.ndarray | None = None
  expert_routes: np.ndarray | None = None
  id: str = ""
  group_id: str = ""
  timing: Timing = Timing()
  verifier: VerifierRecord = VerifierRecord()
  reasoning: Reasoning = Reasoning()
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  schema: int = SCHEMA_VERSION

  def __post_init__(self):
    put = lambda k, v: object.__setattr__(self, k, v)
    put("tokens", _frozen_array(self.tokens, np.int32, "tokens"))
    put("roles", _frozen_array(self.roles, np.int8, "roles"))
    put("loss_mask", _frozen_array(self.loss_mask, np.bool_, "loss_mask"))
    put("behavior_logprobs", _frozen_array(self.behavior_logprobs, np.float32, "behavior_logprobs"))
    thresholds = (np.full(self.tokens.shape, np.nan, np.float32) if self.sampling_thresholds is None
                  else self.sampling_thresholds)
    put("sampling_thresholds", _frozen_array(thresholds, np.float32, "sampling_thresholds"))
    put("turns", tuple(self.turns))
    versions = self._turn_versions() if self.behavior_versions is None else self.behavior_versions
    put("behavior_versions", _frozen_array(versions, np.int32, "behavior_versions"))
    put("termination", Termination(self.termination))
    if self.expert_routes is not None:
      routes = np.array(self.expert_routes, np.int16)
      if routes.ndim != 3 or routes.shape[0] != self.tokens.shape[0]:
        raise TrajectoryFormatError(f"expert_routes: shape {routes.shape}, expected [{self.tokens.shape[0]} tokens, "
                                    "sparse layers, experts per token]")
      if (routes < -1).any():
        raise TrajectoryFormatError(f"expert_routes: expert id {int(routes.min())} (ids are >= 0; -1: none)")
      routes.flags.writeable = False
      put("expert_routes", routes)
    if not self.group_id:
      put("group_id", self.task.id)
    self.validate()

  def __len__(self) -> int:
    return int(self.tokens.shape[0])

  def _turn_versions(self) -> np.ndarray:
    """The default `behavior_versions`: the episode's version on sampled tokens, each action's turn version on
    its span, -1 elsewhere."""
    out = np.where(np.isfinite(np.asarray(self.behavior_logprobs, np.float32)), self.policy_version, -1)
    out = out.astype(np.int32)
    for turn in self.turns:
      start, stop = turn.action.span
      out[start:stop] = np.where(out[start:stop] >= 0, turn.policy_version, -1)
    return out

  def validate(self) -> None:
    """Checks the invariants of docs/design.md §2.1; raises `TrajectoryFormatError`."""
    if self.schema not in READABLE_SCHEMAS:
      raise TrajectoryFormatError(f"schema version {self.schema!r}: this build reads {READABLE_SCHEMAS}")
    n = len(self)
    for name in ("roles", "loss_mask", "behavior_logprobs", "sampling_thresholds", "behavior_versions"):
      if getattr(self, name).shape[0] != n:
        raise TrajectoryFormatError(f"{name}: length {getattr(self, name).shape[0]} != tokens length {n}")
    if n and ((self.tokens < 0).any()):
      raise TrajectoryFormatError("tokens: negative token id")
    valid_roles = _has_role(self.roles, Role)
    if not valid_roles.all():
      j = int(np.argmin(valid_roles))
      raise TrajectoryFormatError(f"roles[{j}]={int(self.roles[j])}: not a Role")
    if not self.reasoning.kept and (self.roles == Role.REASONING).any():
      raise TrajectoryFormatError("REASONING tokens present but reasoning.kept is false")
    trainable = [Role.POLICY] + ([Role.REASONING] if self.reasoning.trained else [])
    bad = self.loss_mask & ~_has_role(self.roles, trainable)
    if bad.any():
      j = int(np.argmax(bad))
      raise TrajectoryFormatError(
          f"loss_mask[{j}]=1 on a {Role(int(self.roles[j])).name} token (trainable roles: "
          f"{[r.name for r in trainable]})")
    missing = self.loss_mask & ~np.isfinite(self.behavior_logprobs)
    if missing.any():
      raise TrajectoryFormatError(f"behavior_logprobs[{int(np.argmax(missing))}]: not finite on a loss token")
    for i, turn in enumerate(self.turns):
      self._check_span(turn.action.span, f"turns[{i}].action", SAMPLED_ROLES)
      if turn.observation is not None:
        self._check_span(turn.observation.span, f"turns[{i}].observation", OBSERVATION_ROLES)
    if not math.isfinite(self.reward.total):
      raise TrajectoryFormatError(f"reward.total={self.reward.total}: not finite")
    # The return is the per-turn rewards' discounted sum plus the discounted terminal reward (docs/design.md §2.1).
    g = self.reward.gamma
    expected = sum(t.reward * g ** k for k, t in enumerate(self.turns)) + g ** len(self.turns) * self.reward.terminal
    if not math.isclose(self.reward.total, expected, rel_tol=1e-6, abs_tol=1e-6):
      raise TrajectoryFormatError(
          f"reward.total={self.reward.total!r} != Σ γ^t r_t + γ^T terminal = {expected!r} (γ={g}, "
          f"{len(self.turns)} turns, terminal {self.reward.terminal!r})")

  def _check_span(self, span: tuple[int, int], where: str, roles: Sequence[Role]) -> None:
    start, stop = span
    if not 0 <= start <= stop <= len(self):
      raise TrajectoryFormatError(f"{where}.span={tuple(span)}: outside the stream [0, {len(self)}]")
    inside = self.roles[start:stop]
    # Spans may include template control tokens (role SYSTEM) around the content.
    ok = _has_role(inside, tuple(roles) + (Role.SYSTEM,))
    if not ok.all():
      j = start + int(np.argmin(ok))
      raise TrajectoryFormatError(f"{where}.span: token {j} has role {Role(int(self.roles[j])).name}")

  def action_tokens(self, turn: int) -> np.ndarray:
    start, stop = self.turns[turn].action.span
    return self.tokens[start:stop]

  def observation_tokens(self, turn: int) -> np.ndarray:
    obs = self.turns[turn].observation
    return self.tokens[0:0] if obs is None else self.tokens[obs.span[0]:obs.span[1]]

  # --------------------------------------------------------------------------------------------
  # Plain-data form (the serialized record and `jaxagent inspect --format jsonl`).

  def to_dict(self, *, arrays_as: Literal["bytes", "lists"] = "bytes") -> dict[str, Any]:
    """A plain dict. `arrays_as="bytes"`: little-endian raw arrays (the storage form, exact float32)."""
    if arrays_as == "bytes":
      arrays = {"tokens": self.tokens.astype("<i4").tobytes(), "roles": self.roles.astype("i1").tobytes(),
                "loss_mask": self.loss_mask.astype("u1").tobytes(),
                "behavior_logprobs": self.behavior_logprobs.astype("<f4").tobytes(),
                "sampling_thresholds": self.sampling_thresholds.astype("<f4").tobytes(),
                "behavior_versions": self.behavior_versions.astype("<i4").tobytes()}
      if self.expert_routes is not None:
        arrays["expert_routes"] = {"shape": list(self.expert_routes.shape[1:]),
                                   "ids": self.expert_routes.astype("<i2").tobytes()}
    else:
      arrays = {"tokens": self.tokens.tolist(), "roles": [Role(int(r)).name.lower() for r in self.roles],
                "loss_mask": self.loss_mask.astype(int).tolist(),
                "behavior_logprobs": [None if not math.isfinite(x) else x
                                      for x in self.behavior_logprobs.tolist()],
                "sampling_thresholds": [None if math.isnan(x) else x for x in self.sampling_thresholds.tolist()],
                "behavior_versions": self.behavior_versions.tolist()}
      if self.expert_routes is not None:
        arrays["expert_routes"] = {"shape": list(self.expert_routes.shape[1:]), "ids": self.expert_routes.tolist()}
    return {
        "kind": KIND,
        "schema": self.schema,
        "id": self.id,
        "group_id": self.group_id,
        "task": dataclasses.asdict(self.task),
        "env": dataclasses.asdict(self.env),
        "policy_version": self.policy_version,
        "termination": self.termination.value,
        "reward": {"total": self.reward.total, "components": dict(self.reward.components),
                   "gamma": self.reward.gamma, "terminal": self.reward.terminal},
        "turns": [_turn_to_dict(t) for t in self.turns],
        **arrays,
        "timing": dataclasses.asdict(self.timing),
        "verifier": dataclasses.asdict(self.verifier),
        "reasoning": dataclasses.asdict(self.reasoning),
        "metadata": dict(self.metadata),
    }

  @classmethod
  def from_dict(cls, d: Any) -> "Trajectory":
    """Inverse of `to_dict` (either array form). Raises `TrajectoryFormatError` on anything unexpected."""
    if not isinstance(d, Mapping):
      raise TrajectoryFormatError(f"record is a {type(d).__name__}, expected a mapping")
    if d.get("kind") != KIND:
      raise TrajectoryFormatError(f"record kind {d.get('kind')!r}, expected {KIND!r}")
    schema = d.get("schema")
    if schema not in READABLE_SCHEMAS:
      raise TrajectoryFormatError(
          f"unknown schema version {schema!r} (this build reads versions {READABLE_SCHEMAS})")
    try:
      known = {f.name for f in dataclasses.fields(cls)} | {"kind"}
      extra = sorted(set(d) - known)
      if extra:
        raise TrajectoryFormatError(f"unknown fields {extra}")
      arrays = {k: _array_from(d[k], k) for k in ("tokens", "roles", "loss_mask", "behavior_logprobs")}
      if d.get("sampling_thresholds") is not None:  # absent before schema 3
        arrays["sampling_thresholds"] = _array_from(d["sampling_thresholds"], "sampling_thresholds")
      if d.get("behavior_versions") is not None:  # absent before schema 4
        arrays["behavior_versions"] = _array_from(d["behavior_versions"], "behavior_versions")
      if d.get("expert_routes") is not None:  # absent before schema 7
        arrays["expert_routes"] = _routes_from(d["expert_routes"])
      return cls(
          task=_record(TaskRecord, d["task"], "task"),
          env=_record(EnvInfo, d["env"], "env"),
          policy_version=_int(d["policy_version"], "policy_version"),
          termination=_enum(Termination, d["termination"], "termination"),
          reward=_record(Reward, d["reward"], "reward"),
          turns=tuple(_turn_from_dict(t, f"turns[{i}]") for i, t in enumerate(_list(d["turns"], "turns"))),
          id=str(d.get("id", "")),
          group_id=str(d.get("group_id", "")),
          timing=_record(Timing, d.get("timing", {}), "timing"),
          verifier=_record(VerifierRecord, d.get("verifier", {}), "verifier"),
          reasoning=_record(Reasoning, d.get("reasoning", {}), "reasoning"),
          metadata=dict(d.get("metadata") or {}),
          schema=schema,
          **arrays)
    except KeyError as e:
      raise TrajectoryFormatError(f"missing field {e.args[0]!r}") from None


def _turn_to_dict(t: Turn) -> dict[str, Any]:
  return {"action": {**dataclasses.asdict(t.action), "span": list(t.action.span)},
          "observation": None if t.observation is None else
          {**dataclasses.asdict(t.observation), "span": list(t.observation.span)},
          "reward": t.reward, "reward_components": dict(t.reward_components),
          "policy_version": t.policy_version, "t_decode_s": t.t_decode_s, "t_env_s": t.t_env_s,
          "outcome": t.outcome, "state_key": t.state_key}


def _turn_from_dict(d: Any, where: str) -> Turn:
  if not isinstance(d, Mapping):
    raise TrajectoryFormatError(f"{where}: expected a mapping")
  d = dict(d)
  try:
    d["action"] = _record(Action, d["action"], f"{where}.action")
  except KeyError:
    raise TrajectoryFormatError(f"{where}: missing field 'action'") from None
  if d.get("observation") is not None:
    d["observation"] = _record(ObservationRecord, d["observation"], f"{where}.observation")
  return _record(Turn, d, where)


def _record(cls: type, d: Any, where: str) -> Any:
  if isinstance(d, cls):
    return d
  if not isinstance(d, Mapping):
    raise TrajectoryFormatError(f"{where}: expected a mapping, got {type(d).__name__}")
  d = dict(d)
  if "span" in d:
    span = d["span"]
    if not (isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(x, int) for x in span)):
      raise TrajectoryFormatError(f"{where}.span={span!r}: expected [start, stop]")
    d["span"] = (int(span[0]), int(span[1]))
  try:
    return cls(**d)
  except TypeError as e:
    raise TrajectoryFormatError(f"{where}: {e}") from None


def _routes_from(x: Any) -> np.ndarray:
  """`expert_routes` from its stored form: {"shape": [M, k], "ids": bytes (int16) or nested lists}."""
  if not isinstance(x, Mapping) or set(x) != {"shape", "ids"}:
    raise TrajectoryFormatError("expert_routes: expected {'shape': [sparse layers, k], 'ids': ...}")
  shape = x["shape"]
  if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
    raise TrajectoryFormatError(f"expert_routes.shape={shape!r}: expected [sparse layers, k], both > 0")
  ids = x["ids"]
  if isinstance(ids, (bytes, bytearray)):
    per_token = 2 * shape[0] * shape[1]
    if len(ids) % per_token:
      raise TrajectoryFormatError(f"expert_routes.ids: {len(ids)} bytes is not a multiple of {per_token}")
    return np.frombuffer(bytes(ids), "<i2").reshape((-1, *shape))
  try:
    out = np.array(ids, np.int16)
  except (TypeError, ValueError) as e:
    raise TrajectoryFormatError(f"expert_routes.ids: {e}") from None
  return out.reshape((0, *shape)) if out.size == 0 else out


def _array_from(x: Any, name: str) -> np.ndarray:
  dtypes = {"tokens": "<i4", "roles": "i1", "loss_mask": "u1", "behavior_logprobs": "<f4",
            "sampling_thresholds": "<f4", "behavior_versions": "<i4"}
  if isinstance(x, (bytes, bytearray)):
    dt = np.dtype(dtypes[name])
    if len(x) % dt.itemsize:
      raise TrajectoryFormatError(f"{name}: {len(x)} bytes is not a multiple of {dt.itemsize}")
    return np.frombuffer(bytes(x), dtype=dt)
  if not isinstance(x, list):
    raise TrajectoryFormatError(f"{name}: expected bytes or a list, got {type(x).__name__}")
  if name == "roles":
    return np.array([_enum(Role, r, f"roles[{i}]") if isinstance(r, str) else r
                     for i, r in enumerate(x)], np.int8)
  if name in ("behavior_logprobs", "sampling_thresholds"):
    return np.array([np.nan if v is None else v for v in x], np.float32)
  return np.array(x, dtypes[name])


def _enum(cls: type[enum.Enum], v: Any, where: str) -> Any:
  if cls is Role and isinstance(v, str):
    try:
      return Role[v.upper()]
    except KeyError:
      raise TrajectoryFormatError(f"{where}={v!r}: not one of {[r.name.lower() for r in Role]}") from None
  try:
    return cls(v)
  except ValueError:
    raise TrajectoryFormatError(f"{where}={v!r}: not one of {[m.value for m in cls]}") from None


def _int(v: Any, where: str) -> int:
  if isinstance(v, bool) or not isinstance(v, int):
    raise TrajectoryFormatError(f"{where}={v!r}: expected an integer")
  return v


def _list(v: Any, where: str) -> list:
  if not isinstance(v, (list, tuple)):
    raise TrajectoryFormatError(f"{where}: expected a list, got {type(v).__name__}")
  return list(v)


# ----------------------------------------------------------------------------------------------
# Building the stream on the host.


class TokenStream:
  """Append-only builder of a trajectory's token stream (host side, used by the rollout engine).

  Every token enters through one of four doors, each recording its role:
    * `sampled(tokens, logprobs)` — tokens the policy produced, with their behavior log-probs;
    * `text(text, role, tokenizer)` — untrusted or template text through `tokenizer.encode`, which never
      produces special tokens (a tool output containing "<|eot|>" stays plain text);
    * `control(name, role, tokenizer)` — one control token via `tokenizer.special(name)`;
    * `template(tokens, role)` — tokens a chat template rendered around prompts and observations.
  Each returns the `(start, stop)` span it appended.
  """

  def __init__(self):
    self._tokens: list[int] = []
    self._roles: list[int] = []
    self._mask: list[bool] = []
    self._logp: list[float] = []
    self._tau: list[float] = []
    self._ver: list[int] = []

  def __len__(self) -> int:
    return len(self._tokens)

  @classmethod
  def prefix_of(cls, t: "Trajectory", stop: int) -> "TokenStream":
    """The first `stop` tokens of `t` as recorded (roles, log-probs, thresholds, versions), none of them carrying
    loss: the part of a branch it shares with its parent (trained, if at all, in the parent)."""
    z = cls()
    z._tokens = [int(x) for x in t.tokens[:stop]]
    z._roles = [int(x) for x in t.roles[:stop]]
    z._mask = [False] * len(z._tokens)
    z._logp = [float(x) for x in t.behavior_logprobs[:stop]]
    z._tau = [float(x) for x in t.sampling_thresholds[:stop]]
    z._ver = [int(x) for x in t.behavior_versions[:stop]]
    return z

  def _append(self, tokens: Sequence[int], role: Role, mask: bool, logp: Sequence[float] | None,
              thresholds: Sequence[float] | None = None, versions: Sequence[int] | None = None):
    start = len(self._tokens)
    tokens = [int(t) for t in tokens]
    self._tokens += tokens
    self._roles += [int(role)] * len(tokens)
    self._mask += [mask] * len(tokens)
    self._logp += list(map(float, logp)) if logp is not None else [math.nan] * len(tokens)
    self._tau += list(map(float, thresholds)) if thresholds is not None else [math.nan] * len(tokens)
    self._ver += list(map(int, versions)) if versions is not None else [-1] * len(tokens)
    return start, len(self._tokens)

  def sampled(self, tokens: Sequence[int], logprobs: Sequence[float], *, role: Role = Role.POLICY,
              train: bool = True, thresholds: Sequence[float] | None = None,
              versions: Sequence[int] | None = None) -> tuple[int, int]:
    """`thresholds`: where truncated sampling cut each token's distribution (None: nothing was cut);
    `versions`: the policy version that sampled each token (None: unknown, -1; `arrays` then leaves the
    trajectory to default them to its turns' versions)."""
    if len(tokens) != len(logprobs):
      raise ValueError(f"{len(tokens)} sampled tokens but {len(logprobs)} log-probs")
    if thresholds is not None and len(thresholds) != len(tokens):
      raise ValueError(f"{len(tokens)} sampled tokens but {len(thresholds)} sampling thresholds")
    if versions is not None and len(versions) != len(tokens):
      raise ValueError(f"{len(tokens)} sampled tokens but {len(versions)} policy versions")
    if role not in SAMPLED_ROLES:
      raise ValueError(f"sampled tokens must have role POLICY or REASONING, got {role.name}")
    return self._append(tokens, role, train, logprobs, thresholds, versions)

  def text(self, text: str, role: Role, tokenizer: Any, *, max_tokens: int | None = None) -> tuple[int, int]:
    """Appends `tokenizer.encode(text)`, cut to its first `max_tokens` tokens when given."""
    return self.capped_text(text, role, tokenizer, max_tokens=max_tokens)[0]

  def capped_text(self, text: str, role: Role, tokenizer: Any, *, max_tokens: int | None = None
                  ) -> tuple[tuple[int, int], int]:
    """`text`, also returning how many tokens of the encoded text were cut (0: none)."""
    if role in SAMPLED_ROLES:
      raise ValueError("policy tokens enter through `sampled`, never by encoding text")
    tokens = tokenizer.encode(text)
    kept = tokens if max_tokens is None else tokens[:max_tokens]
    return self._append(kept, role, False, None), len(tokens) - len(kept)

  def extend(self, other: "TokenStream") -> tuple[int, int]:
    """Appends another stream's tokens as they are (roles, mask, log-probs): a frame built ahead of time."""
    start = len(self._tokens)
    self._tokens += other._tokens
    self._roles += other._roles
    self._mask += other._mask
    self._logp += other._logp
    self._tau += other._tau
    self._ver += other._ver
    return start, len(self._tokens)

  def template(self, tokens: Sequence[int], role: Role) -> tuple[int, int]:
    """Appends tokens a chat template rendered (its own trusted text, special tokens included)."""
    if role in SAMPLED_ROLES:
      raise ValueError("policy tokens enter through `sampled`, never as template tokens")
    return self._append(tokens, role, False, None)

  def control(self, name: str, role: Role, tokenizer: Any) -> tuple[int, int]:
    if role in SAMPLED_ROLES:
      raise ValueError("sampled control tokens (e.g. the policy's own end-of-turn) go through `sampled`")
    return self._append([tokenizer.special(name)], role, False, None)

  def tokens(self, start: int, stop: int) -> list[int]:
    """The token ids of the span [start, stop) (no copy of the whole stream)."""
    return self._tokens[start:stop]

  def arrays(self) -> dict[str, np.ndarray]:
    """`tokens`, `roles`, `loss_mask`, `behavior_logprobs`, `sampling_thresholds` (and `behavior_versions` when
    every sampled token has one) for `Trajectory(**stream.arrays(), ...)`."""
    ver = np.array(self._ver, np.int32)
    sampled = np.isfinite(np.array(self._logp, np.float32))
    versioned = sampled.any() and (ver[sampled] >= 0).all()
    return {**({"behavior_versions": ver} if versioned else {}),"tokens": np.array(self._tokens, np.int32), "roles": np.array(self._roles, np.int8),
            "loss_mask": np.array(self._mask, np.bool_),
            "behavior_logprobs": np.array(self._logp, np.float32),
            "sampling_thresholds": np.array(self._tau, np.float32)}
