"""The rollout scheduler: admits episodes into free slots, plans each device call (feeds, forks, decodes), hands
finished actions to the env pool and frames back to the sampler, and counts what it did.

Two transports drive it: `host_loop` (Python calls the jitted feed and decode in turn and polls the env futures
between calls) and `exchange` (the host side of the callback program's `io_callback`). It talks to the env pool
through the pool's public interface (`reset_async`, `step_async`, `slot_worker`, `slot_termination`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

import envs
from jaxagent import multihost
from jaxagent import trajectory as tr
from jaxagent.rollout.sampler import Feed, Finish
from jaxagent.rollout import actors as actors_lib
from jaxagent.rollout.actors import Actor, RowAction
from jaxagent.rollout.episodes import Branch, Episode, EpisodeState, RolloutStats

# The continuous schedule holds the device back while fewer than this fraction of the live episodes are ready
# (the others about to answer: see `Scheduler._hold`). Measured with bench/rollout.py: holding until a
# majority (0.5) was ready gave 0.93x lockstep with zero env latency, three quarters 1.06x (3.5x lockstep with
# lognormal latency either way).
HOLD_READY_FRACTION = 0.75


class Scheduler:
  """One rollout's episodes, slots and env futures; both transports drive it (see the module docstring)."""

  def __init__(self, engine: Any, actor: Actor, episodes: list[Episode], policy_version: int):
    """`engine`: the `engine.RolloutEngine` that runs this rollout (its pool, chat, rules and records)."""
    self.engine, self.actor, self.episodes = engine, actor, episodes
    self.pool, self.chat = engine.pool, engine.chat
    self.lockstep = engine.schedule == "lockstep"
    self.policy_version = policy_version
    self.queue = list(episodes)
    self.queue.reverse()  # pop() takes the next episode in order
    self.slot_episode: list[Episode | None] = [None] * engine.slots
    self.resident: dict[tuple[int, ...], int] = {}      # prompt -> a slot whose cache holds it (fork source)
    self.prefilling: dict[tuple[int, ...], Episode] = {}  # prompt -> the episode feeding it now
    self.live = 0  # admitted, not done
    self.remaining = len(episodes)
    self.env_steps = self.action_tokens = 0
    self.idle_s = 0.0
    self.start = time.perf_counter()
    self.pids = self.pool.worker_pids()
    self.last_feed: list[tuple[Episode, str, int]] | None = None
    self.device_mark: float | None = None  # callback transport: when the program last left the host
    self.on_done: Callable[[Episode], None] | None = None  # a stream's: called as each episode ends

  def add(self, episodes: Sequence[Episode]) -> None:
    """More episodes for the queue, after those already in it (a `RolloutStream`'s submissions)."""
    self.episodes += episodes
    self.queue[:0] = reversed(episodes)
    self.remaining += len(episodes)

  # -- bookkeeping

  def now(self) -> float:
    return time.perf_counter() - self.start

  def _end(self, ep: Episode, termination: envs.Termination | None = None) -> None:
    if termination is not None:
      ep.termination = termination
    ep.state, ep.ended_s = EpisodeState.DONE, self.now()
    if ep.slot is not None and ep.stream is not None:
      ep.routes = self.actor.episode_routes(ep.slot, ep.stream.tokens(0, len(ep.stream)))
    if ep.slot is not None:
      self.slot_episode[ep.slot] = None
      if self.resident.get(ep.prompt) == ep.slot:  # another live row holding the prompt serves forks now
        del self.resident[ep.prompt]
        for other in self.slot_episode:
          if other is not None and other.fed_prompt and other.prompt == ep.prompt:
            self.resident[ep.prompt] = other.slot
            break
    if self.prefilling.get(ep.prompt) is ep:
      del self.prefilling[ep.prompt]
    ep.frame = ep.future = ep.action = None
    self.live -= 1
    self.remaining -= 1
    if self.on_done is not None:
      self.on_done(ep)

  def _admit(self) -> None:
    """Free slots take the next episodes (lockstep: only when the whole previous wave is done)."""
    if self.lockstep and self.live:
      return
    for slot, held in enumerate(self.slot_episode):
      if held is not None or not self.queue:
        continue
      ep = self.queue.pop()
      worker = self.pool.slot_worker(slot)
      ep.slot, ep.state, ep.admitted_s, ep.since = slot, EpisodeState.RESETTING, self.now(), time.perf_counter()
      ep.version = self.policy_version
      ep.provenance = {"process": jax.process_index(), "slot": slot, "env_worker": worker,
                       "env_worker_pid": self.pids[worker]}
      self.slot_episode[slot] = ep
      self.live += 1
      if ep.branch is None:
        ep.future = self._answered(ep, self.pool.reset_async(slot, ep.task, ep.seed))
      else:
        ep.future = self._answered(ep, self._replay_executor().submit(self._replay, slot, ep.task, ep.seed,
                                                                       ep.branch))

  @staticmethod
  def _answered(ep: Episode, future: concurrent.futures.Future) -> concurrent.futures.Future:
    """Stamps when the env answered (not when the loop got to it): env times exclude waiting to be collected."""
    future.add_done_callback(lambda _: setattr(ep, "answered", time.perf_counter()))
    return future

  def _collect(self) -> None:
    """Takes every finished env future (resets and steps)."""
    barrier = self.lockstep and any(e.future is not None and not e.future.done()
                                    for e in self.slot_episode if e is not None)
    if barrier:  # lockstep: nothing moves on until the whole wave's envs have answered
      return
    for ep in list(self.slot_episode):
      if ep is None or ep.future is None or not ep.future.done():
        continue
      result, ep.future = ep.future.result(), None
      if ep.answered < ep.since:  # done, but its done-callback has not run yet
        ep.answered = time.perf_counter()
      if ep.state == EpisodeState.RESETTING:
        self._on_reset(ep, result)
      else:
        self._on_step(ep, result)

  def _replay_executor(self) -> concurrent.futures.ThreadPoolExecutor:
    if getattr(self, "_replayer", None) is None:
      self._replayer = concurrent.futures.ThreadPoolExecutor(max(1, len(self.slot_episode)),
                                                             thread_name_prefix="branch-replay")
    return self._replayer

  def _replay(self, slot: int, task: envs.Task, seed: int, branch: Branch):
    """A branch's reset: the env reset, then the parent's first `branch.turn` actions replayed. Returns the last
    observation (its state key that of the replayed state), or the exception that ended the episode, or a
    `StepResult` when a replayed step ended it (the env did not do what it did for the parent)."""
    try:
      obs = self.pool.reset(slot, task, seed)
    except Exception as e:  # as reset_async: the fault ends the episode
      return e
    for turn in branch.parent.turns[:branch.turn]:
      result = self.pool.step(slot, turn.action.text)
      if result.done:
        return result
      obs = result.observation
    return obs

  def _on_reset(self, ep: Episode, obs) -> None:
    ep.reset_s = ep.answered - ep.since
    self.engine.env_replied(ep.reset_s)
    if isinstance(obs, Exception):
      # The env never produced a first observation: the episode ends before any turn, recorded with the fault
      # (no action token, so no loss, no advantage-group member).
      ep.stream = self.chat.prompt("")
      ep.provenance["reset_error"] = str(obs)
      self._end(ep, envs.Termination(self.pool.slot_termination(ep.slot)))
      return
    if ep.branch is not None:
      b = ep.branch
      ep.provenance["branch"] = {"parent": b.parent.id, "turn": b.turn, "group": b.parent.group_id}
      if isinstance(obs, envs.StepResult):  # the replay ended early: the env is not the parent's
        ep.stream = self.chat.prompt("")
        ep.provenance["branch"]["diverged"] = True
        self._end(ep, envs.Termination.ENV_ERROR)
        return
      expected = b.parent.turns[b.turn].state_key
      ep.provenance["branch"]["diverged"] = expected is not None and obs.state_key != expected
      # The parent's tokens up to the branch's first action (the chat's assistant header included), no loss.
      ep.stream = tr.TokenStream.prefix_of(b.parent, b.parent.turns[b.turn].action.span[0])
      ep.first_text = b.parent.task.prompt
      ep.turns = list(b.parent.turns[:b.turn])
      for k, turn in enumerate(ep.turns):
        for key, value in turn.reward_components.items():
          ep.components[key] = ep.components.get(key, 0.0) + float(value) * self.engine.gamma ** k
    else:
      try:
        ep.stream, ep.first_text = self.chat.prompt(obs.text, obs.system), obs.text
      except ValueError as e:  # an episode's own system message the template cannot frame (TemplateError)
        ep.stream = self.chat.prompt("")
        ep.provenance["reset_error"] = str(e)
        self._end(ep, envs.Termination.ENV_ERROR)
        return
    ep.state_key = obs.state_key
    ep.prompt = tuple(ep.stream.tokens(0, len(ep.stream)))
    ep.state, ep.since = EpisodeState.FEEDING, ep.answered
    if ep.prompt not in self.resident and ep.prompt not in self.prefilling:
      self.prefilling[ep.prompt] = ep
      ep.pending = list(ep.prompt)

  def _on_step(self, ep: Episode, result: envs.StepResult) -> None:
    span, text, tokens = ep.action
    t_env = ep.answered - ep.since
    self.engine.env_replied(t_env)
    ep.env_s += t_env
    self.env_steps += 1
    self.engine.record_step(ep, result, span, text, tokens, ep.action_version, ep.last_decode_s, t_env)
    ep.action = None
    if ep.termination is not None:
      self._end(ep)
      return
    if len(ep.turns) >= self.engine.max_turns:  # only reachable if the env allows more turns than our bound
      ep.turns[-1] = dataclasses.replace(ep.turns[-1], observation=None)
      self._end(ep, envs.Termination.MAX_TURNS)
      return
    ep.state, ep.since = EpisodeState.FEEDING, ep.answered
    ep.pending = list(ep.frame.tokens)

  # -- planning a feed

  def _plan(self) -> tuple[Feed | None, list[tuple[Episode, str, int]]]:
    """The next feed: prompt pieces, frames, prompt copies and action starts. Lockstep holds back until every
    episode of the wave is ready to be fed (the turn barrier)."""
    feeding = [e for e in self.slot_episode if e is not None and e.state == EpisodeState.FEEDING]
    if not feeding or (self.lockstep and any(e.state in (EpisodeState.RESETTING, EpisodeState.STEPPING)
                                             for e in self.slot_episode if e is not None)):
      return None, []
    for ep in feeding:  # waiting to copy a prompt that no row holds or feeds any more: feed it itself, now
      # (its prefiller ended, e.g. a one-turn episode finished in the same collect that admitted this one;
      # deciding this after the feed is built would leave a call with nothing to feed: a stall).
      if not (ep.pending or ep.fed_prompt) and ep.prompt not in self.resident and ep.prompt not in self.prefilling:
        self.prefilling[ep.prompt] = ep
        ep.pending = list(ep.prompt)
    width = self.actor.width_for(max((min(len(e.pending), self.actor.width) for e in feeding), default=1))
    f = Feed.empty(self.engine.slots, width, self.chat.tokenizer.pad_id)
    plan = []
    completes = {}  # prompt -> slot of the episode that completes it in this call
    for ep in feeding:
      if ep.pending:
        piece = ep.pending[:width]
        f.tokens[ep.slot, :len(piece)] = piece
        f.lengths[ep.slot] = len(piece)
        last = len(piece) == len(ep.pending)
        if not ep.fed_prompt:
          first = len(ep.pending) == len(ep.prompt)
          f.reset[ep.slot] = first
          f.episode[ep.slot] = ep.index
          f.prompt_done[ep.slot] = last
          if last:
            completes[ep.prompt] = ep.slot
        f.start[ep.slot] = last
        plan.append((ep, "prompt" if not ep.fed_prompt else "frame", len(piece)))
    for ep in feeding:
      if ep.pending or ep.fed_prompt:
        continue
      src = self.resident.get(ep.prompt, completes.get(ep.prompt))
      if src is None:  # another row is still feeding the prompt: copy it once that row has it
        continue
      f.reset[ep.slot] = True
      f.episode[ep.slot] = ep.index
      f.fork[ep.slot] = src
      f.start[ep.slot] = True
      plan.append((ep, "fork", 0))
    return (f if plan else None), plan

  def _after_feed(self, plan, ok: np.ndarray, fed: float) -> None:
    """`fed`: when the feed call began (a row it starts decodes from then on, in the same device call when
    fused)."""
    now = fed
    for ep, kind, n in plan:
      if ep.state != EpisodeState.FEEDING:
        continue
      if not ok[ep.slot]:
        if kind == "frame":  # the observation never reached the policy: it is not part of the trajectory
          ep.turns[-1] = dataclasses.replace(ep.turns[-1], observation=None)
        else:  # the prompt does not fit: nothing of it is the policy's context
          ep.provenance["prompt_tokens"] = len(ep.prompt)
          ep.stream = self.chat.prompt("")
        self._end(ep, envs.Termination.CONTEXT_EXHAUSTED)
        continue
      del ep.pending[:n]
      if ep.pending:
        continue
      if kind == "frame":
        ep.stream.extend(ep.frame.stream)
        ep.frame = None
      else:
        ep.fed_prompt = True
        self.resident[ep.prompt] = ep.slot
        if self.prefilling.get(ep.prompt) is ep:
          del self.prefilling[ep.prompt]
      ep.extend_s += now - ep.since
      ep.state, ep.since = EpisodeState.DECODING, now

  # -- decoding

  def _after_decode(self, actions: dict[int, RowAction | None]) -> None:
    now = time.perf_counter()
    for slot, action in actions.items():
      ep = self.slot_episode[slot]
      t_decode = now - ep.since
      ep.decode_s += t_decode
      ep.last_decode_s = t_decode
      if action is None:  # a script ran out before its episode ended
        self._end(ep, envs.Termination.CANCELLED)
        continue
      span = self.engine.append_action(ep.stream, action)
      self.action_tokens += len(action.tokens)
      text = self.chat.action_text(action.tokens)
      ep.action_version = action.versions[0] if action.versions else self.policy_version
      if action.finish == Finish.STOP:
        ep.action = (span, text, action.tokens)
        ep.state, ep.since = EpisodeState.STEPPING, now
        ep.future = self._answered(ep, self.pool.step_async(slot, text))
        continue
      termination = (envs.Termination.TURN_BUDGET_EXHAUSTED if action.finish == Finish.BUDGET
                     else envs.Termination.CONTEXT_EXHAUSTED)
      # The cut action never reached the env: its outcome is the termination (not "ok").
      ep.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=False), policy_version=ep.action_version,
                              t_decode_s=t_decode, outcome=termination.value, state_key=ep.state_key))
      self._end(ep, termination)

  def _running(self) -> np.ndarray:
    return np.asarray([e is not None and e.state == EpisodeState.DECODING for e in self.slot_episode], bool)

  def _wait(self, timeout: float) -> None:
    """Blocks until some env future of this process completes (or `timeout`)."""
    inflight = [e.future for e in self.slot_episode if e is not None and e.future is not None]
    futures = [f for f in inflight if not f.done()]
    t0 = time.perf_counter()
    # An env answered since the last look (waiting on the others would strand it; lockstep holds answers back
    # on purpose until its wave is complete), or a slot was just freed for the next episode: go on.
    answered = len(futures) < len(inflight) and (not self.lockstep or not futures)
    admittable = bool(self.queue) and None in self.slot_episode and not (self.lockstep and self.live)
    if answered or admittable:
      return
    if futures:
      concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    elif timeout is None:  # nothing in flight, nothing to feed or decode: no event can ever come
      states = [(e.index, e.state.value, len(e.pending)) for e in self.slot_episode if e is not None]
      raise RuntimeError(f"rollout stalled with {self.remaining} episodes left: (episode, state, pending) {states}")
    else:
      time.sleep(timeout)
    self.idle_s += time.perf_counter() - t0

  # -- transports

  def _decodable(self) -> bool:
    """Some row can decode (lockstep: and no row of the wave still waits for a feed)."""
    live = [e for e in self.slot_episode if e is not None]
    if self.lockstep and any(e.state == EpisodeState.FEEDING for e in live):
      return False
    return any(e.state == EpisodeState.DECODING for e in live)

  def _hold(self) -> float | None:
    """Continuous schedule: how long to hold the device back for env replies that are about to arrive (None:
    go on). While fewer than `HOLD_READY_FRACTION` of the live rows are ready to feed or decode and the rest
    wait on envs that usually answer within the typical step time tau (the median env time seen so far), a
    feed or decode chunk now would run mostly empty and the rows arriving during it would wait for its end:
    wait up to tau for them instead. Rows waiting longer than tau (heavy-tailed stragglers) hold no one."""
    tau = self.engine.typical_env_s()
    if self.lockstep or not tau:
      return None
    now = time.perf_counter()
    live = [e for e in self.slot_episode if e is not None]
    ready = sum(e.state in (EpisodeState.FEEDING, EpisodeState.DECODING) for e in live)
    waiting = (EpisodeState.RESETTING, EpisodeState.STEPPING)
    soon = [now - e.since for e in live if e.state in waiting and now - e.since < tau]
    if not ready or ready >= HOLD_READY_FRACTION * (ready + len(soon)):
      return None
    return tau - max(soon)

  def _poll(self):
    """Admits episodes into free slots and takes the envs' answers (waiting while `_hold` says so); returns
    the next feed and its plan (`_plan`)."""
    while True:
      self._admit()
      self._collect()
      hold = self._hold()
      if hold is None:
        return self._plan()
      self._wait(hold)

  def host_loop(self, until: Callable[[], bool] | None = None, poll_s: float = 0.002) -> None:
    """Drives the rollout until every episode is done, or (a stream) until `until()` holds: then an idle
    engine waits in steps of `poll_s` for an env or for `until`, never for ever."""
    agree = (lambda flags: flags) if jax.process_count() == 1 else multihost.host_max
    while True:
      if until is not None and until():
        break
      f, plan = self._poll()
      # Feed and decode are collective: every process calls them together, with or without rows of its own.
      has_feed, live = agree(np.asarray([f is not None, self.remaining > 0], np.int32))
      if not live:
        break
      if has_feed:
        if f is None:
          f = Feed.empty(self.engine.slots, self.actor.width_for(1), self.chat.tokenizer.pad_id)
        # Rows this feed starts decode in the same device call, except in lockstep while some row of the wave
        # still has prompt pieces to come (the whole wave starts together).
        fed = {id(e): n for e, _, n in plan}
        rest = self.lockstep and any(e is not None and e.state == EpisodeState.FEEDING
                                     and (id(e) not in fed or len(e.pending) > fed[id(e)])
                                     for e in self.slot_episode)
        fed = time.perf_counter()
        if not agree(np.asarray([rest], np.int32))[0]:
          ok, actions = self.actor.feed_decode(f, self.lockstep)
          self._after_feed(plan, ok, fed)
          self._after_decode(actions(self._running()))
          continue
        ok = self.actor.feed(f)
        self._after_feed(plan, ok, time.perf_counter())
      if agree(np.asarray([self._decodable()], np.int32))[0]:
        self._after_decode(self.actor.decode(self._running() if self._decodable() else
                                             np.zeros(self.engine.slots, bool), self.lockstep))
      elif not has_feed:
        # Nothing for the device anywhere: wait for an env. Alone, until one answers; with other processes,
        # briefly, then agree again (another process's env may have answered); a stream, briefly, then asks
        # `until` again (the learner may have finished).
        self._wait(poll_s if until is not None else None if jax.process_count() == 1 else 0.005)

  def exchange(self, finish, n, tokens, logprobs, thresholds, ok):
    """The callback transport's host side: takes the program's finished actions and last feed's result,
    returns the next feed (numpy arrays, all rows) and whether the rollout is complete."""
    entered = time.perf_counter()
    if self.device_mark is not None:
      self.actor.decode_s += entered - self.device_mark
    ok = np.asarray(ok)
    if self.last_feed:  # fed (and decoding from) when the program resumed after the last exchange
      self._after_feed(self.last_feed, ok, self.device_mark)
    self._after_decode(actors_lib.finished_actions(self._running(), finish, n, tokens, logprobs, thresholds))
    while True:
      f, plan = self._poll()
      if f is not None or self._running().any() or self.remaining == 0:
        break
      if jax.process_count() > 1:
        # Other processes' rows may have work: waiting here for an env would hold the whole program (and
        # them) at this exchange. Wait briefly, then let the program run a round with nothing of ours in it.
        self._wait(0.005)
        f, plan = self._poll()
        break
      self._wait(None)
    self.last_feed = plan
    if f is None:
      f = Feed.empty(self.engine.slots, self.actor.width, self.chat.tokenizer.pad_id)
    elif f.tokens.shape[1] != self.actor.width:  # the program's feed has one width
      tokens = np.full((self.engine.slots, self.actor.width), self.chat.tokenizer.pad_id, np.int32)
      tokens[:, :f.tokens.shape[1]] = f.tokens
      f = f.replace(tokens=tokens)
    f = self.actor.global_ids(f)
    self.device_mark = time.perf_counter()
    return (f.tokens, f.lengths, f.reset, f.episode, f.prompt_done, f.fork, f.start,
            np.asarray(self.remaining == 0))

  def stats(self) -> RolloutStats:
    eps = self.episodes
    return RolloutStats(reset_s=sum(e.reset_s for e in eps), decode_s=self.actor.decode_s,
                        env_s=sum(e.env_s for e in eps), extend_s=self.actor.extend_s, env_steps=self.env_steps,
                        action_tokens=self.action_tokens, idle_s=self.idle_s,
                        wall_s=time.perf_counter() - self.start)
