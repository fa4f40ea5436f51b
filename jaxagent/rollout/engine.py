"""Multi-turn rollout: B tasks x G samples over <= T turns with the sampler and an env pool.

One host loop per turn: decode every active row in one jitted call (`Sampler.generate`), step all their envs
concurrently (`envs.Pool.step_many`), append the observations to the KV cache (`Sampler.extend`) and continue.
The trajectory's token stream is built from exactly what the sampler produced and what was appended
(`TokenStream`), never from re-tokenized text, so the learner trains on the tokens that were sampled.

Chat layout (control tokens by name from the tokenizer):
  prompt:       <bos> <|user|> {first observation} <|eot|> <|assistant|>        roles: prompt
  action:       {sampled tokens, ending with a stop sequence}                     role: policy (loss)
  observation:  <|tool|> {observation} <|eot|> <|assistant|>                      role: tool (no loss)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

import envs
from jaxagent import trajectory as tr
from jaxagent.rollout.sampler import Finish, Sampler



@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """Control-token names framing prompts and observations."""

  bos: str | None = "<bos>"
  user: str = "<|user|>"
  assistant: str = "<|assistant|>"
  tool: str = "<|tool|>"
  end_of_turn: str = "<|eot|>"

  def prompt(self, stream: tr.TokenStream, text: str, tokenizer) -> None:
    if self.bos:
      stream.control(self.bos, tr.Role.PROMPT, tokenizer)
    stream.control(self.user, tr.Role.PROMPT, tokenizer)
    stream.text(text, tr.Role.PROMPT, tokenizer)
    stream.control(self.end_of_turn, tr.Role.PROMPT, tokenizer)
    stream.control(self.assistant, tr.Role.PROMPT, tokenizer)

  def observation_tokens(self, tokens: Sequence[int], tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prefix, body, suffix) token lists of an observation whose text encoded to `tokens`."""
    return ([tokenizer.special(self.tool)], list(tokens),
            [tokenizer.special(self.end_of_turn), tokenizer.special(self.assistant)])


def _any_process(flag: bool) -> bool:
  """True if `flag` is true on any process (the same answer on all of them)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.asarray(multihost_utils.process_allgather(np.asarray(bool(flag)))).any())


@dataclasses.dataclass
class _Row:
  """Host-side state of one trajectory during a rollout."""

  task: envs.Task
  seed: int
  stream: tr.TokenStream
  turns: list[tr.Turn] = dataclasses.field(default_factory=list)
  done: bool = False
  termination: tr.TerminationReason | None = None
  verifier: tr.Verifier = tr.Verifier()
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  pending: list[int] = dataclasses.field(default_factory=list)  # observation tokens to append
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)  # process / env worker that ran it


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  reset_s: float
  decode_s: float
  env_s: float
  extend_s: float
  env_steps: int
  action_tokens: int


class RolloutEngine:
  """Runs groups of multi-turn episodes.

  Args:
    sampler: compiled sampler (its `max_new_tokens` is the per-turn budget).
    pool: env pool with at least `rows` slots.
    env_spec: the environment's registry entry (name, version, verifier).
    tokenizer: encodes observations (never into control tokens) and names control tokens.
    max_turns: hard bound on turns per episode.
    max_observation_tokens: observation tokens beyond this are cut and flagged truncated.
    stop_strings: decoded from an action's end before it goes to the env.
    gamma: discount for the recorded return.
    invalid_action_rule: as configured on the pool (recorded on every trajectory).
  """

  def __init__(self, sampler: Sampler, pool: envs.pool.Pool, env_spec: envs.EnvSpec, tokenizer, *,
               max_turns: int, max_observation_tokens: int, stop_strings: Sequence[str] = ("\n",),
               gamma: float = 1.0, invalid_action_rule: str = "error_observation",
               chat: ChatFormat = ChatFormat()):
    self.sampler = sampler
    self.pool = pool
    self.env_spec = env_spec
    self.tokenizer = tokenizer
    self.max_turns = max_turns
    self.max_observation_tokens = max_observation_tokens
    self.stop_strings = tuple(stop_strings)
    self.gamma = gamma
    if invalid_action_rule not in envs.INVALID_ACTION_RULES:
      raise ValueError(f"invalid_action_rule={invalid_action_rule!r}: not one of {envs.INVALID_ACTION_RULES}")
    self.rule = invalid_action_rule
    self.chat = chat
    self.env_version = pool.version or env_spec.version

  def _action_text(self, tokens: Sequence[int]) -> str:
    text = self.tokenizer.decode(tokens, skip_special=True)
    for stop in self.stop_strings:
      if text.endswith(stop):
        return text[: -len(stop)]
    return text

  def run(self, params, tasks: Sequence[envs.Task], seeds: Sequence[int], *, group_size: int, rng: jax.Array,
          policy_version: int) -> tuple[list[tr.Trajectory], RolloutStats]:
    """Rolls out `group_size` episodes of each task; row `i` is task `i // group_size` with seed `seeds[i]`."""
    n = len(tasks) * group_size
    if len(seeds) != n:
      raise ValueError(f"{len(seeds)} seeds for {n} episodes")
    row_tasks = [t for t in tasks for _ in range(group_size)]
    slots = list(range(n))
    start = time.perf_counter()
    first = self.pool.reset_many(slots, row_tasks, list(seeds), return_exceptions=True)
    reset_s = time.perf_counter() - start
    rows = []
    pids = self.pool.worker_pids()
    for slot, (task, seed, obs) in enumerate(zip(row_tasks, seeds, first)):
      stream = tr.TokenStream()
      worker = self.pool.slots[slot].worker
      provenance = {"process": jax.process_index(), "env_worker": worker, "env_worker_pid": pids[worker]}
      row = _Row(task=task, seed=int(seed), stream=stream, provenance=provenance)
      if isinstance(obs, Exception):
        # The env never produced a first observation: the episode ends before any turn, recorded with the
        # fault (no action token, so no loss, no advantage-group member). Its row still takes its slot in the
        # batch (static shapes), holding an empty prompt that is never decoded.
        self.chat.prompt(stream, "", self.tokenizer)
        row.done, row.termination = True, tr.TerminationReason(self.pool.slots[slot].termination)
        row.provenance["reset_error"] = str(obs)
      else:
        self.chat.prompt(stream, obs.text, self.tokenizer)
      rows.append(row)

    prompts = [r.stream.arrays()["tokens"].tolist() for r in rows]
    # Prefix reuse only if every process can (prefill's row count is part of the global shape).
    shared = not _any_process(not all(prompts[i] == prompts[i - i % group_size] for i in range(n)))
    if shared and group_size > 1:  # prefix reuse: prefill each distinct prompt once
      state = self.sampler.repeat(self.sampler.prefill(params, prompts[::group_size], rng), group_size)
    else:
      state = self.sampler.prefill(params, prompts, rng)

    decode_s = env_s = extend_s = 0.0
    env_steps = action_tokens = 0
    # Every turn starts with some row running on some process: turn 0 has all rows, and a later turn is
    # reached only when the collective check after the env step found one.
    for _ in range(self.max_turns):
      active = np.asarray([not r.done for r in rows])
      t0 = time.perf_counter()
      state, out = self.sampler.generate(params, state, active)
      out = self.sampler.to_host(out.replace(raw_logprobs=None))  # the record needs no untempered log-probs
      t_decode = time.perf_counter() - t0
      decode_s += t_decode

      stepping, actions, turns_pending = [], [], {}
      for i in np.flatnonzero(active):
        row = rows[i]
        length = int(out.lengths[i])
        tokens = out.tokens[i, :length].tolist()
        span = row.stream.sampled(tokens, out.logprobs[i, :length].tolist())
        action_tokens += length
        finish = Finish(int(out.finish[i]))
        text = self._action_text(tokens)
        if finish == Finish.STOP:
          stepping.append(i)
          actions.append(text)
          turns_pending[i] = (span, text)
          continue
        row.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=False),
                                 policy_version=policy_version, t_decode_s=t_decode))
        row.done = True
        row.termination = (tr.TerminationReason.TURN_BUDGET_EXHAUSTED if finish == Finish.BUDGET
                           else tr.TerminationReason.CONTEXT_EXHAUSTED)

      if stepping:
        t0 = time.perf_counter()
        results = self.pool.step_many(stepping, actions)
        t_env = time.perf_counter() - t0
        env_s += t_env
        env_steps += len(stepping)
        for i, result in zip(stepping, results):
          self._record_step(rows[i], result, *turns_pending[i], policy_version, t_decode, t_env)

      needs = [i for i, r in enumerate(rows) if not r.done]
      if not _any_process(bool(needs)):
        break
      t0 = time.perf_counter()
      state, ok = self.sampler.extend(params, state, [rows[i].pending if not rows[i].done else []
                                                      for i in range(n)])
      ok = bool(np.asarray(ok.addressable_data(0)))  # replicated scalar: every process has it
      extend_s += time.perf_counter() - t0
      for i in needs:
        row = rows[i]
        if ok:
          self._append_observation(row)
        else:  # the observation never reached the policy: it is not part of the trajectory
          row.turns[-1] = dataclasses.replace(row.turns[-1], observation=None)
          row.pending = []
          row.done = True
          row.termination = tr.TerminationReason.CONTEXT_EXHAUSTED
      if not ok:
        break

    for row in rows:
      if not row.done:  # only reachable if the env allows more turns than the engine's bound
        row.done = True
        row.termination = tr.TerminationReason.MAX_TURNS
    # One advantage group per task slot (its G samples), named by the task and the slot's first env seed:
    # two slots that drew the same question stay two groups, in every batch, round and topology.
    trajectories = [self._trajectory(r, policy_version, reset_s / max(n, 1),
                                     group_id=f"{r.task.id}/{seeds[i - i % group_size]}")
                    for i, r in enumerate(rows)]
    return trajectories, RolloutStats(reset_s=reset_s, decode_s=decode_s, env_s=env_s, extend_s=extend_s,
                                      env_steps=env_steps, action_tokens=action_tokens)

  def _record_step(self, row: _Row, result: envs.StepResult, span, text: str, policy_version: int,
                   t_decode: float, t_env: float) -> None:
    for key, value in result.reward_components.items():
      row.components[key] = row.components.get(key, 0.0) + float(value) * self.gamma ** len(row.turns)
    info = result.info or {}
    valid = not str(result.outcome).startswith(("parser_rejected", "invalid_action"))
    call = info.get("call")
    obs = None
    if not result.done:
      encoded = self.tokenizer.encode(result.observation.text)
      truncated = result.observation.truncated or len(encoded) > self.max_observation_tokens
      body = encoded[: self.max_observation_tokens]
      prefix, body, suffix = self.chat.observation_tokens(body, self.tokenizer)
      row.pending = prefix + body + suffix
      start = len(row.stream)
      obs = tr.Observation(span=(start + len(prefix), start + len(prefix) + len(body)),
                           text=result.observation.text, truncated=truncated,
                           original_bytes=result.observation.original_size)
    row.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=valid, parsed=call), observation=obs,
                             reward=result.reward, reward_components=dict(result.reward_components),
                             policy_version=policy_version, t_decode_s=t_decode, t_env_s=t_env))
    if "passed" in info:
      row.verifier = tr.Verifier(name=self.env_spec.name, version=str(info.get("verifier", "")),
                                 passed=bool(info["passed"]), evidence=info.get("evidence"))
    if result.done:
      row.done = True
      row.termination = tr.TerminationReason(result.termination)

  def _append_observation(self, row: _Row) -> None:
    """Records the observation tokens that `extend` just appended, through the stream's own doors."""
    obs = row.turns[-1].observation
    start, _ = row.stream.control(self.chat.tool, tr.Role.TOOL, self.tokenizer)
    row.stream.text(obs.text, tr.Role.TOOL, self.tokenizer, max_tokens=self.max_observation_tokens)
    row.stream.control(self.chat.end_of_turn, tr.Role.TOOL, self.tokenizer)
    _, stop = row.stream.control(self.chat.assistant, tr.Role.TOOL, self.tokenizer)
    if row.stream.tokens(start, stop) != row.pending:  # encode is deterministic; anything else is a bug worth stopping for
      raise RuntimeError("observation tokens in the record differ from the tokens appended to the cache")
    row.pending = []

  def _trajectory(self, row: _Row, policy_version: int, reset_s: float, group_id: str) -> tr.Trajectory:
    total = sum(t.reward * self.gamma ** k for k, t in enumerate(row.turns))
    return tr.Trajectory(
        task=tr.Task(id=row.task.id, split=row.task.split, version=row.task.version),
        env=tr.EnvInfo(name=self.env_spec.name, version=self.env_version, seed=row.seed,
                       network="none" if self.pool.sandboxed else "host",  # cut only inside a sandbox
                       invalid_action_rule=self.rule),
        policy_version=policy_version, termination=row.termination,
        reward=tr.Reward(total=float(total), gamma=self.gamma, components=dict(row.components)),
        turns=tuple(row.turns), id=uuid.uuid4().hex, group_id=group_id,
        timing=tr.Timing(reset_s=reset_s), verifier=row.verifier, metadata=row.provenance, **row.stream.arrays())
