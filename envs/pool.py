"""Env pools: one client API over in-process, local (sandboxed subprocess), Docker and remote workers.

A pool owns `num_slots` episode slots spread over its workers. `reset(slot, task, seed)` starts an episode,
`step_many(slots, actions)` steps several slots concurrently. Every failure ends in a distinct outcome:

  parser_rejected / invalid_action   the env refused the action (the configured rule decides if it ends)
  env_error                          a tool fault inside the env (outcome env_error)
  env_error + outcome worker_crash   the worker died and the episode could not be replayed
  env_error + outcome replay_diverged   replaying the episode on a restarted worker gave other observations
  env_timeout                        a step exceeded `action_timeout_s`, or the episode `episode_timeout_s`
  retries_exhausted                  the worker kept dying on this step
  cancelled                          `cancel(slot)` was called

`PoolConfig` = `WorkerConfig` (how workers run: the YAML section `env.pool`) + the episode fields (env,
max_turns, invalid_action, penalty); `PoolConfig.from_workers(workers, env=...)` joins them.

A crashed or hung worker is restarted; the episodes it hosted are replayed (reset with the same seed, the same
actions) before their next step, so other trajectories are not affected when envs are deterministic. Replay is
checked, not assumed: every observation of the replay must match the one the episode saw (text, truncation,
done, termination), or the episode ends as `replay_diverged`. `Pool.replays` / `Pool.replay_divergences` count
both (the trainer logs them as `env/replays`, `env/replay_divergences`).

Layout: `envs/_pool_config.py` (WorkerConfig, PoolConfig), `envs/_connections.py` (handshake, connections,
errors), `envs/_workers.py` (worker kinds, bubblewrap and Docker helpers); this module is the pool, its slots
and replay, and re-exports the public names of all three.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import shutil
import threading
import time
import uuid
import warnings
from typing import Any, Sequence

from envs import _registry
from envs._api import (CANCELLED, ENV_ERROR, ENV_TIMEOUT, POOL_TIMEOUTS, RETRIES_EXHAUSTED, Observation, Outcome, StepResult, Task,
                       Termination)


from envs._pool_config import (ENVS_DIR, POOL_KINDS, SANDBOXES, PoolConfig, PoolKind, Sandbox,  # noqa: F401
                                WorkerConfig)
from envs._connections import (AdmissionTimeout, HandshakeError, InProcessConnection, RemoteError,  # noqa: F401
                               SocketConnection, WorkerCrashed, WorkerTimeout, check_handshake)
from envs._workers import (SECCOMP_EPISODES, DockerWorker, InProcessWorker, LocalWorker, RemoteWorker,  # noqa: F401
                           Worker, bwrap_available, bwrap_command, docker_host, import_roots)

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# The pool.


@dataclasses.dataclass
class _Slot:
  worker: int
  instance: str
  task: Task | None = None
  seed: int = 0
  actions: list[str] = dataclasses.field(default_factory=list)
  generation: int = -1
  done: bool = False
  termination: Termination | None = None
  started: float = 0.0
  cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
  first_generation: int = -1  # the worker's generation when the episode began
  seen: list[tuple] = dataclasses.field(default_factory=list)  # what reset and each step answered (replay check)


class ReplayDiverged(RuntimeError):
  """A replayed episode answered differently from the original: the env is not deterministic."""


def _seen(reply: dict[str, Any]) -> tuple:
  """The part of a worker's reply a replay must reproduce (timings and other info may differ)."""
  obs = reply.get("observation", reply)
  return (obs.get("text"), obs.get("truncated"), reply.get("done"), reply.get("termination"))


def with_env_timeouts(cfg: PoolConfig) -> PoolConfig:
  """`cfg` with its action and reset timeouts raised to what the env says its steps need on this machine
  (`EnvSpec.timeouts`, measured), never lowered; a raise is logged. An env not known here (a remote pool's)
  keeps `cfg`."""
  try:
    spec = _registry.get(cfg.env)
  except Exception:  # a remote pool's env may exist only on its servers
    return cfg
  if spec.timeouts is None:
    return cfg
  need = dict(spec.timeouts())
  unknown = sorted(set(need) - set(POOL_TIMEOUTS))
  if unknown:
    raise ValueError(f"env {spec.name!r}: timeouts() gave {unknown}; it may give {list(POOL_TIMEOUTS)}")
  raised = {k: float(v) for k, v in need.items() if float(v) > getattr(cfg, k)}
  if raised:
    log.info("env %s needs %s on this machine (measured): raising the pool's %s", spec.name,
             ", ".join(f"{k}={v:.0f}" for k, v in raised.items()),
             ", ".join(f"{k} from {getattr(cfg, k):g}" for k in raised))
  return dataclasses.replace(cfg, **raised) if raised else cfg


class Pool:
  """`num_slots` episode slots over `cfg.num_workers` workers, one client API for every kind."""

  def __init__(self, cfg: PoolConfig, num_slots: int):
    if num_slots < 1:
      raise ValueError(f"num_slots={num_slots}: must be >= 1")
    self.cfg = cfg = with_env_timeouts(cfg)
    self.sandboxed = False
    self.spare_swaps = 0  # restarts served by a warm spare (cfg.warm_spares)
    self._spares: list[Worker] = []  # started, handshaken, ready to take a failed worker's place
    self._spare_lock = threading.Lock()
    self._spare_names = itertools.count(cfg.num_workers)
    self._spare_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool-spare")
    self._closed = False
    self.workers = [self._make_worker(i) for i in range(cfg.num_workers)]
    self._worker_locks = [threading.Lock() for _ in self.workers]  # a worker's restart vs. its (generation, conn)
    self._count_lock = threading.Lock()
    self.replays = 0               # episodes replayed on a restarted worker, since the pool started
    self.replay_divergences = 0    # of which answered differently (ended as replay_diverged)
    self.slots = [_Slot(worker=i % cfg.num_workers, instance=f"s{i}") for i in range(num_slots)]
    self._executor = concurrent.futures.ThreadPoolExecutor(max(4, min(num_slots, 64)), thread_name_prefix="pool")
    # Resets run apart: one waiting for a full server to admit it must not hold a thread the steps of admitted
    # episodes need (those steps are what ends episodes and frees the server).
    self._reset_executor = concurrent.futures.ThreadPoolExecutor(max(4, min(num_slots, 64)),
                                                                 thread_name_prefix="pool-reset")
    self.version: str | None = None
    # Instance names are unique per episode and per pool (a late close never hits a new episode, and pools of
    # several trainer processes share servers without colliding).
    self._episodes = itertools.count()
    self._tag = uuid.uuid4().hex[:8]
    self.admission_waits = 0  # resets that waited for a full server to admit them (back-pressure)
    try:
      for w in self.workers:
        w.start()
      futures = [w.conn.call("hello", {}, cfg.start_timeout_s) for w in self.workers]
      hellos = [(getattr(w.conn, "address", f"worker {i}"), self._wait(f, cfg.start_timeout_s))
                for i, (w, f) in enumerate(zip(self.workers, futures))]
      for w, (_, hello) in zip(self.workers, hellos):
        w.hello = hello
      try:
        expected = _registry.get(cfg.env).name
      except Exception:  # a remote pool's env may exist only on its servers
        expected = None
      check_handshake(expected, hellos)
      unconfined = [where for where, h in hellos if h.get("episode_sandbox") == "none"]
      if unconfined and cfg.sandbox != "none":
        raise HandshakeError(f"env workers {', '.join(unconfined)} run each episode's programs unconfined "
                             f"(--episode-sandbox none) but this pool's sandbox is {cfg.sandbox!r}: start them "
                             "with --episode-sandbox bwrap, or set sandbox='none' (env.pool.sandbox) to accept it")
    except BaseException:
      self.close()
      raise
    self.version = hellos[0][1]["version"]
    self._first_hello = hellos[0][1]  # what restarted workers and spares must match
    for _ in range(cfg.warm_spares):
      self._submit_spare()

  def _unsandboxed(self, why: str) -> None:
    """An env whose actions run real programs never runs outside a sandbox unless sandbox='none' says so."""
    from envs._registry import get
    if get(self.cfg.env).needs_sandbox and self.cfg.sandbox != "none":
      raise RuntimeError(f"env {self.cfg.env!r} runs real programs and needs a sandbox, but {why}; use the local "
                         "pool with bubblewrap or the docker pool (sandbox='none', env.pool.sandbox in a jaxagent "
                         "config, runs it unsandboxed anyway)")

  def _make_worker(self, i: int) -> Worker:
    cfg = self.cfg
    if cfg.kind == "inprocess":
      if i == 0:
        self._unsandboxed("kind='inprocess' (env.pool.kind) runs it in this process")
      return InProcessWorker(cfg, i)
    if cfg.kind == "remote":
      if len(cfg.addresses) < cfg.num_workers:
        raise ValueError(f"addresses (env.pool.addresses) has {len(cfg.addresses)} entries for "
                         f"num_workers={cfg.num_workers}")
      return RemoteWorker(cfg, i)
    from envs._registry import get
    if get(cfg.env).network and (cfg.kind == "docker" or cfg.sandbox == "bwrap"):
      raise RuntimeError(f"env {cfg.env!r} is a client of a server over the network, which a "
                         f"{'docker container' if cfg.kind == 'docker' else 'bubblewrap sandbox'} cuts; use "
                         "env.pool.kind=inprocess or local with env.pool.sandbox=auto or none")
    if cfg.kind == "docker":
      if i == 0:
        import docker
        self._docker = docker.DockerClient(base_url=cfg.docker_host or docker_host())
        self.sandboxed = True
      return DockerWorker(cfg, i, self._docker)
    if i == 0:
      # A network client (an OpenEnv server's) runs unconfined: its own code is ours, the server runs elsewhere.
      want = cfg.sandbox != "none" and not get(cfg.env).network
      self.sandboxed = want and bwrap_available()
      if cfg.sandbox == "bwrap" and not self.sandboxed:
        raise RuntimeError("sandbox='bwrap' (env.pool.sandbox) but bubblewrap is not installed or cannot create "
                           "namespaces "
                           "here (apt-get install -y bubblewrap)")
      if want and not self.sandboxed:
        self._unsandboxed("bubblewrap is unavailable here")
        warnings.warn("envs local pool: bubblewrap unavailable, env workers run UNSANDBOXED (network, host "
                      "filesystem reachable); install bubblewrap or use the docker pool", RuntimeWarning,
                      stacklevel=3)
    return LocalWorker(cfg, i, self.sandboxed)

  @staticmethod
  def _wait(fut: concurrent.futures.Future, timeout: float, cancel: threading.Event | None = None):
    deadline = time.monotonic() + timeout
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise WorkerTimeout(f"no reply within {timeout:.1f}s")
      try:
        return fut.result(timeout=min(left, 0.05) if cancel is not None else left)
      except concurrent.futures.TimeoutError:
        if cancel is not None and cancel.is_set():
          raise _Cancelled() from None

  def _restart(self, index: int, seen_generation: int) -> None:
    """Kill and restart worker `index` unless someone already did since `seen_generation`."""
    with self._worker_locks[index]:
      w = self.workers[index]
      if w.generation != seen_generation:
        return
      if self._closed:
        raise WorkerCrashed(f"worker {index}: the pool is closed")
      w.kill()
      spare = self._take_spare()
      if spare is not None:  # a warm spare takes the place (and the generation count) of the failed worker
        log.warning("env worker %d (%s) replaced by a warm spare", index, self.cfg.kind)
        spare.generation, spare.access = w.generation + 1, w.access
        self.workers[index] = spare
        self._discard(w)
        with self._count_lock:
          self.spare_swaps += 1
        self._submit_spare()
        return
      log.warning("restarting env worker %d (%s)", index, self.cfg.kind)
      w.generation += 1
      w.start()
      if self.cfg.kind == "remote":  # a reconnect may reach another server (a new pod of a rolling update)
        try:
          self._greet(w, w.conn.address)
        except HandshakeError as e:
          w.conn.close()
          raise WorkerCrashed(f"worker {index} reconnected to a different server: {e}") from None

  def _greet(self, w: Worker, where: str) -> None:
    """Asks a (re)started worker hello and checks it against the pool's first worker as the pool started
    (`check_handshake`: env, version, protocol, episode-sandbox mode)."""
    hello = self._wait(w.conn.call("hello", {}, self.cfg.start_timeout_s), self.cfg.start_timeout_s)
    first = self._first_hello
    check_handshake(first.get("env"), [("the pool's workers", first), (where, hello)])
    w.hello = hello

  def _add_spare(self) -> None:
    """Starts one more warm spare (on the spare thread); one that fails to start or to match is dropped."""
    if self._closed:
      return
    w = self._make_worker(next(self._spare_names))
    try:
      w.start()
      self._greet(w, "warm spare")
    except Exception as e:  # a restart without a spare still works
      log.error("warm spare worker did not start: %s", e)
      self._discard(w)
      return
    with self._spare_lock:
      if not self._closed:
        self._spares.append(w)
        return
    self._discard(w)

  @staticmethod
  def _discard(w: Worker) -> None:
    try:
      w.kill()
    except Exception as e:
      log.debug("kill worker: %s", e)
    d = getattr(w, "dir", None)
    if d:
      shutil.rmtree(d, ignore_errors=True)

  def _take_spare(self) -> Worker | None:
    while True:
      with self._spare_lock:
        if not self._spares:
          return None
        w = self._spares.pop(0)
      if w.alive():  # outside the lock: for docker, a call to the daemon
        return w
      self._discard(w)  # a spare that died while it waited

  def _submit_spare(self) -> None:
    try:
      self._spare_executor.submit(self._add_spare)
    except RuntimeError:  # the pool closed meanwhile
      pass

  def _restarts(self, s: _Slot) -> int:
    """Restarts of its worker that the episode lived through (info["worker_restarts"])."""
    return self.workers[s.worker].generation - s.first_generation if s.first_generation >= 0 else 0

  def _link(self, index: int) -> tuple[int, Any]:
    """Worker `index`'s (generation, connection), read together: never the new generation with the old
    connection (a call would fail there and restart the fresh worker again) nor the reverse (an episode would
    run on the new worker without its replay). Waits while the worker restarts."""
    with self._worker_locks[index]:
      w = self.workers[index]
      return w.generation, w.conn

  # -- episode API

  def reset(self, slot: int, task: Task, seed: int) -> Observation:
    return self.reset_many([slot], [task], [seed])[0]

  def reset_many(self, slots: Sequence[int], tasks: Sequence[Task], seeds: Sequence[int], *,
                 return_exceptions: bool = False) -> list[Observation | Exception]:
    """Resets several slots concurrently.

    A slot whose reset fails (the env raised: `RemoteError`; the worker died or hung through every retry:
    `WorkerCrashed` / `WorkerTimeout`) ends its episode at once (`reset_termination`); with
    `return_exceptions` its entry is that exception instead of an `Observation` (as in `asyncio.gather`),
    otherwise the first failure is raised after every slot has been tried.
    """
    for i in slots:
      if not 0 <= i < len(self.slots):
        raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")
    out = list(self._reset_executor.map(self._reset_one, slots, tasks, seeds))
    if not return_exceptions:
      for x in out:
        if isinstance(x, Exception):
          raise x
    return out

  def _reset_one(self, i: int, task: Task, seed: int) -> Observation | Exception:
    s = self.slots[i]
    if s.task is not None and not s.done:  # the slot's previous episode was abandoned open: free its instance
      self._close_instance(s)
    s.instance = f"{self._tag}-s{i}e{next(self._episodes)}"
    s.task, s.seed, s.actions, s.done, s.termination = task, int(seed), [], False, None
    s.seen = []
    s.cancel = threading.Event()
    s.started = time.monotonic()
    try:
      return self._try_reset(i, s)
    except (RemoteError, WorkerCrashed, WorkerTimeout) as e:
      log.warning("reset of slot %d (task %s) failed: %s", i, task.id, e)
      s.done, s.termination = True, reset_termination(e)
      return e

  def _admitted_reset(self, conn, s: _Slot) -> dict[str, Any]:
    """The reset call, waiting (with backoff) while the worker is full: its `--max-episodes` admission bound is
    the back-pressure a pool sees. Past `reset_timeout_s` the episode fails as an env timeout."""
    deadline = time.monotonic() + self.cfg.reset_timeout_s  # for admission; each call has its full timeout
    pause, waited = 0.02, False
    while True:
      try:
        return self._wait(conn.call("reset", self._reset_args(s), self.cfg.reset_timeout_s), self.cfg.reset_timeout_s)
      except RemoteError as e:
        if e.kind != "too_many_instances":
          raise
        if not waited:
          waited = True
          with self._count_lock:
            self.admission_waits += 1
        left = deadline - time.monotonic()
        if left <= 0:
          raise AdmissionTimeout(f"worker {s.worker} admitted no new episode within {self.cfg.reset_timeout_s:.0f}s "
                                 f"(it is full: {e})") from None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)

  def _try_reset(self, i: int, s: _Slot) -> Observation:
    for attempt in range(self.cfg.max_retries + 1):
      gen, conn = self._link(s.worker)
      try:
        obs = self._admitted_reset(conn, s)
        s.generation = s.first_generation = gen
        s.seen = [_seen(obs)]
        return Observation.from_wire(obs)
      except AdmissionTimeout:
        raise  # the worker is full, not broken: no restart
      except (WorkerCrashed, WorkerTimeout) as e:
        if self.cfg.kind == "remote" and attempt == self.cfg.max_retries:
          raise
        log.warning("reset of slot %d failed (%s); restarting worker %d", i, e, s.worker)
        self._safe_restart(s.worker, gen)
    raise WorkerCrashed(f"slot {i}: reset failed {self.cfg.max_retries + 1} times")

  def _reset_args(self, s: _Slot) -> dict[str, Any]:
    return dict(instance=s.instance, task=s.task.to_wire(), seed=s.seed, options=self.cfg.reset_options())

  def step(self, slot: int, action: str) -> StepResult:
    return self.step_many([slot], [action])[0]

  def step_many(self, slots: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
    """Step several slots concurrently; every slot gets its answer within its timeouts."""
    if len(slots) != len(actions):
      raise ValueError(f"{len(slots)} slots but {len(actions)} actions")
    for i in slots:
      if not 0 <= i < len(self.slots):
        raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")
      if self.slots[i].task is None:
        raise RuntimeError(f"slot {i}: step before reset")
    return list(self._executor.map(self._step_one, slots, actions))

  def reset_async(self, slot: int, task: Task, seed: int) -> concurrent.futures.Future:
    """`reset_many([slot], ...)` without waiting: a future of the Observation, or of the exception that ended
    the episode at reset (see `reset_many`; the future itself never raises for those)."""
    self._check_slot(slot)
    return self._reset_executor.submit(self._reset_one, slot, task, seed)

  def step_async(self, slot: int, action: str) -> concurrent.futures.Future:
    """`step(slot, action)` without waiting: a future of its StepResult (every fault is a result, as in
    `step_many`). Steps of one slot must not overlap; steps of different slots run concurrently."""
    self._check_slot(slot)
    if self.slots[slot].task is None:
      raise RuntimeError(f"slot {slot}: step before reset")
    return self._executor.submit(self._step_one, slot, action)

  def _check_slot(self, i: int) -> None:
    if not 0 <= i < len(self.slots):
      raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")

  def cancel(self, slot: int) -> None:
    """End slot's episode as `cancelled`; an in-flight step returns at once."""
    self.slots[slot].cancel.set()

  def _close_instance(self, s: _Slot) -> None:
    """Frees the episode's instance on its worker (best effort, not awaited: the name is never reused)."""
    conn = self.workers[s.worker].conn
    if conn is not None and not conn.closed:
      conn.call("close", dict(instance=s.instance), 1.0)

  def _end(self, s: _Slot, termination: Termination, outcome: Outcome, text: str, **info) -> StepResult:
    s.done, s.termination = True, termination
    self._close_instance(s)
    return StepResult(Observation.capped(text, self.cfg.max_obs_bytes), {}, True, termination,
                      dict(info, worker_restarts=self._restarts(s)), outcome=outcome)

  def _step_one(self, i: int, action: str) -> StepResult:
    s = self.slots[i]
    if s.done:  # the episode's own termination again; nothing ran (no observation to append)
      return StepResult(Observation(""), {}, True, s.termination, dict(already_done=True),
                        outcome=Outcome(s.termination))
    if s.cancel.is_set():
      return self._end(s, CANCELLED, Outcome.CANCELLED, "cancelled")
    crashes = 0
    t0 = time.monotonic()
    while True:
      left = self.cfg.episode_timeout_s - (time.monotonic() - s.started)
      if left <= 0:
        return self._end(s, ENV_TIMEOUT, Outcome.ENV_TIMEOUT, f"episode exceeded {self.cfg.episode_timeout_s:.0f}s",
                         timeout="episode")
      w = self.workers[s.worker]
      exclusive = crashes > 0
      w.access.acquire(exclusive)
      gen, conn = self._link(s.worker)
      try:
        if s.generation != gen:  # the worker restarted since this episode began: replay it there.
          if not self.cfg.replay_on_crash:
            return self._end(s, ENV_ERROR, Outcome.WORKER_CRASH, "env worker crashed")
          self._replay(s, gen, conn)
        timeout = min(self.cfg.action_timeout_s, left)
        reply = self._wait(conn.call("step", dict(instance=s.instance, action=action), timeout), timeout,
                           s.cancel)
        result = StepResult.from_wire(reply)
        s.actions.append(action)
        s.seen.append(_seen(reply))
        if result.done:
          s.done, s.termination = True, result.termination
          self._close_instance(s)  # a finished episode holds no instance (a server admits a bounded number)
        return dataclasses.replace(result, info=dict(result.info, worker_restarts=self._restarts(s),
                                                     env_s=time.monotonic() - t0))
      except _Cancelled:
        return self._end(s, CANCELLED, Outcome.CANCELLED, "cancelled")
      except WorkerTimeout:
        # The worker is stuck in this step; only killing it frees it. Its other episodes are replayed.
        self._safe_restart(s.worker, gen)
        which = "episode" if left < self.cfg.action_timeout_s else "action"
        return self._end(s, ENV_TIMEOUT, Outcome.ENV_TIMEOUT, f"env step exceeded {timeout:.1f}s", timeout=which)
      except WorkerCrashed as e:
        crashes += 1
        if not self.cfg.replay_on_crash:
          self._safe_restart(s.worker, gen)
          return self._end(s, ENV_ERROR, Outcome.WORKER_CRASH, f"env worker crashed: {e}")
        if crashes > self.cfg.max_retries:
          self._safe_restart(s.worker, gen)
          return self._end(s, RETRIES_EXHAUSTED, Outcome.RETRIES_EXHAUSTED, f"env worker crashed {crashes} times")
        self._safe_restart(s.worker, gen)
      except RemoteError as e:
        return self._end(s, ENV_ERROR, Outcome.ENV_ERROR, f"env error: {e}", error=str(e))
      except ReplayDiverged as e:
        return self._end(s, ENV_ERROR, Outcome.REPLAY_DIVERGED, f"env replay diverged: {e}", error=str(e))
      finally:
        w.access.release(exclusive)

  def _safe_restart(self, index: int, gen: int) -> None:
    try:
      self._restart(index, gen)
    except WorkerCrashed as e:  # the next call on this worker fails again and is counted there.
      log.error("restart of worker %d failed: %s", index, e)

  def _replay(self, s: _Slot, gen: int, conn) -> None:
    """Re-runs the episode on the restarted worker; raises ReplayDiverged if any answer differs."""
    with self._count_lock:
      self.replays += 1
    calls = [("reset", self._reset_args(s), self.cfg.reset_timeout_s)] + [
        ("step", dict(instance=s.instance, action=a), self.cfg.action_timeout_s) for a in s.actions]
    for k, (op, args, timeout) in enumerate(calls):
      got = _seen(self._wait(conn.call(op, args, timeout), timeout))
      if got != s.seen[k]:
        with self._count_lock:
          self.replay_divergences += 1
        what = "reset" if k == 0 else f"step {k} ({s.actions[k - 1][:64]!r})"
        raise ReplayDiverged(f"{what} answered {got[0]!r:.120}, the episode saw {s.seen[k][0]!r:.120}")
    s.generation = gen

  @property
  def num_slots(self) -> int:
    return len(self.slots)

  def slot_worker(self, slot: int) -> int:
    """The index of the worker that runs `slot`'s env instance."""
    self._check_slot(slot)
    return self.slots[slot].worker

  def slot_termination(self, slot: int) -> Termination | None:
    """How `slot`'s episode ended, as the pool decided it (a reset or step the pool answered for a failed worker,
    the env's own end); None while it runs."""
    self._check_slot(slot)
    return self.slots[slot].termination

  def worker_pids(self) -> list[int | None]:
    return [w.pid() for w in self.workers]

  def close(self) -> None:
    with self._spare_lock:
      self._closed = True
      spares, self._spares = self._spares, []
    for w in spares:
      self._discard(w)
    for i in range(len(getattr(self, "workers", []))):
      lock = self._worker_locks[i] if hasattr(self, "_worker_locks") else threading.Lock()
      with lock:  # after a restart that was under way (it installs its worker, or sees the pool closed)
        self._discard(self.workers[i])
    self._spare_executor.shutdown(wait=False, cancel_futures=True)
    self._executor.shutdown(wait=False, cancel_futures=True)
    self._reset_executor.shutdown(wait=False, cancel_futures=True)

  def __enter__(self) -> "Pool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Cancelled(Exception):
  pass


def reset_termination(error: Exception) -> Termination:
  """The termination of an episode whose reset failed with `error` (see `Pool.reset_many`)."""
  if isinstance(error, WorkerTimeout):
    return ENV_TIMEOUT
  if isinstance(error, WorkerCrashed):
    return RETRIES_EXHAUSTED
  return ENV_ERROR


def make_pool(num_slots: int, cfg: WorkerConfig | None = None, **overrides) -> Pool:
  """`make_pool(8, env="calculator", kind="local")`.

  Args:
    num_slots: episode slots.
    cfg: a PoolConfig, or a WorkerConfig (the episode fields then come from `overrides` or their defaults);
      None: PoolConfig().
    **overrides: any PoolConfig field, worker-level or episode-level.
  """
  if cfg is None:
    cfg = PoolConfig()
  elif not isinstance(cfg, PoolConfig):
    episode = {f.name for f in dataclasses.fields(PoolConfig)} - {f.name for f in dataclasses.fields(WorkerConfig)}
    cfg = PoolConfig.from_workers(cfg, **{k: overrides.pop(k) for k in list(overrides) if k in episode})
  return Pool(dataclasses.replace(cfg, **overrides), num_slots)
