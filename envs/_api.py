"""Environment API: tasks, environments, verifiers, action parsing and the invalid-action rule.

Plain Python only (no JAX, no jaxagent imports): everything here also runs inside sandboxed worker processes
and containers. `Termination` and `Outcome` are the one vocabulary of episode ends: jaxagent imports them from
here (envs never imports jaxagent).

Split by concern behind these names: `envs/_vocabulary.py` (terminations, outcomes and the other enumerations),
`envs/_wire.py` (records that cross the wire), `envs/_tools.py` (tools, the action parser, the invalid-action
rule); this module holds `Env`, `Verifier`, `EnvSpec` and versions, and re-exports the rest.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import hashlib
import inspect
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

# The rest of the API, re-exported: built-in envs and user code import it from here or from `envs`.
from envs._tools import (  # noqa: F401
    ACTION_SYNTAXES, JSON_ENVELOPE_CHARS, JSON_PARSER_VERSION, ActionParser, InvalidAction, InvalidActionRule,
    ParseError, Tool)
from envs._vocabulary import (  # noqa: F401
    CANCELLED, COMPLETED, CONTEXT_EXHAUSTED, ENV_ERROR, ENV_TIMEOUT, INFRASTRUCTURE_TERMINATIONS, INVALID_ACTION,
    INVALID_ACTION_RULES, MAX_TURNS, OUTCOME_CODES, OUTCOMES, PARSER_REJECTED, RETRIES_EXHAUSTED,
    REWARD_COMPONENTS, SPLITS, TERMINATIONS, TURN_BUDGET_EXHAUSTED, EnvError, Outcome, Termination)
from envs._wire import Call, Observation, StepResult, Task, Verdict  # noqa: F401


# ----------------------------------------------------------------------------------------------
# Env and verifier.


class Verifier(abc.ABC):
  """Scores an outcome; versioned separately from the env that produced it."""

  version: str = "0"

  @abc.abstractmethod
  def score(self, task: Task, final: Any) -> Verdict:
    """Args: task; final: what the episode produced (an answer string, a directory...)."""

  def verify(self, task: Task, final: Any) -> Verdict:
    """`score`, timed: the verdict carries the verifier's wall time in `seconds` (recorded as T_verify)."""
    start = time.perf_counter()
    verdict = self.score(task, final)
    return dataclasses.replace(verdict, seconds=time.perf_counter() - start)


class Env(abc.ABC):
  """One episode at a time. Subclasses implement `_reset` and `_step`; the base class enforces turn limits,
  the invalid-action rule and observation caps, and turns `EnvError` into `env_error`.
  """

  name: str = "env"
  description: str = ""
  parser: ActionParser
  verifier: Verifier | None = None  # set by envs that score their episodes
  # An independent check of the same final state, apart from the training verifier: it never feeds a reward.
  # It scores only when the worker is asked to (`score_heldout`, an evaluation's pool) and its verdict rides
  # in the training verdict's evidence under "heldout" (`judge`): the proxy-vs-target gap of docs/design.md §2.5.
  heldout_verifier: Verifier | None = None
  score_heldout: bool = False
  # How the programs an action runs are confined (`envs._sandbox` modes: bwrap, none, auto); the worker that
  # hosts the env sets it (`envs.server --episode-sandbox`). Envs that run programs give it to EpisodeSandbox.
  episode_sandbox: str = "auto"

  def versions(self) -> dict[str, str]:
    """What a policy trained here depends on besides the env's code: its action parser and verifier versions."""
    return {"parser": str(self.parser.version), "verifier": "" if self.verifier is None else str(self.verifier.version)}

  def __init__(self, *, max_turns: int = 8, invalid_action: InvalidActionRule = InvalidActionRule(),
               max_obs_bytes: int = 4096, action_syntax: str | None = None):
    if max_turns < 1:
      raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if max_obs_bytes < 16:
      raise ValueError(f"max_obs_bytes={max_obs_bytes}: must be >= 16")
    self.max_turns = max_turns
    self.invalid_action = invalid_action
    self.max_obs_bytes = max_obs_bytes
    if action_syntax is not None:  # None: the class's parser as declared
      if action_syntax not in ACTION_SYNTAXES:
        raise ValueError(f"action_syntax={action_syntax!r}: not one of {ACTION_SYNTAXES}")
      self.parser = self.parser.with_syntax(action_syntax)  # the class's parser, in this episode's syntax
    self.task: Task | None = None
    self.turn = 0
    self.done = False

  # -- subclass hooks
  @abc.abstractmethod
  def _reset(self, task: Task, seed: int) -> str: ...

  @abc.abstractmethod
  def _step(self, call: Call) -> StepResult:
    """Run a parsed call; raise InvalidAction for refused calls, EnvError for tool faults."""

  def _parse(self, action_text: str) -> Call:
    """The action text as a call: the parser's (`ParseError` / `InvalidAction` go to the invalid-action rule).
    An env that takes free text (an agent over the gateway) reads it otherwise."""
    return self.parser.parse(action_text)

  def state_key(self) -> str | None:
    """The anchor state the episode is in, as text: what an action's consequences depend on (e.g. gridworld's
    position), not how the episode got there. Two steps of one task group from equal keys are compared by GiGPO
    (`algo.advantage: gigpo`). The base class hashes it into `Observation.state_key` after `reset` and every
    step. None (the default): this env names no states."""
    return None

  def _anchor(self) -> str | None:
    key = self.state_key()
    if key is None:
      return None
    if not isinstance(key, str):
      raise TypeError(f"{self.name}.state_key() returned {type(key).__name__}: must be a str or None")
    return hashlib.sha256(key.encode("utf-8", errors="replace")).hexdigest()[:16]

  def judge(self, final: Any) -> Verdict:
    """The training verifier's verdict on `final`; with `score_heldout` and a held-out verifier, its verdict
    too, in `evidence["heldout"]` (never in the reward). Envs call this where they would call
    `self.verifier.verify(self.task, final)`."""
    verdict = self.verifier.verify(self.task, final)
    if self.score_heldout and self.heldout_verifier is not None:
      held = self.heldout_verifier.verify(self.task, final)
      verdict = dataclasses.replace(verdict, evidence={**verdict.evidence, "heldout": held.to_wire()})
    return verdict

  def snapshot(self) -> Any:
    raise NotImplementedError(f"{self.name} does not support snapshot()")

  def restore(self, state: Any) -> None:
    raise NotImplementedError(f"{self.name} does not support restore()")

  def close(self) -> None:
    pass

  # -- public
  def reset(self, task: Task, seed: int) -> Observation:
    self.task, self.turn, self.done = task, 0, False
    text = self._reset(task, int(seed))
    return Observation.capped(text, self.max_obs_bytes, self._anchor())

  def step(self, action_text: str) -> StepResult:
    if self.task is None:
      raise RuntimeError(f"{self.name}: step() before reset()")
    if self.done:
      raise RuntimeError(f"{self.name}: step() after the episode ended")
    self.turn += 1
    info: dict[str, Any] = dict(turn=self.turn, action=action_text[:256])
    call: Call | None = None
    try:
      call = self._parse(action_text)
      result = self._step(call)
    except (ParseError, InvalidAction) as e:
      result = self.invalid_action.apply(e)
    except EnvError as e:
      result = StepResult(Observation.capped(f"env error: {e}", self.max_obs_bytes), {}, True, ENV_ERROR,
                          dict(error=str(e)))
    if not result.done and self.turn >= self.max_turns:
      result = dataclasses.replace(result, done=True, termination=MAX_TURNS, outcome=Outcome.MAX_TURNS)
    obs = result.observation
    if len(obs.text.encode("utf-8", errors="replace")) > self.max_obs_bytes:
      capped = Observation.capped(obs.text, self.max_obs_bytes, obs.state_key)
      obs = dataclasses.replace(capped, original_size=max(capped.original_size, obs.original_size))
    if obs.state_key is None and result.termination != ENV_ERROR:  # an env fault leaves no state to name
      obs = dataclasses.replace(obs, state_key=self._anchor())
    self.done = result.done
    return dataclasses.replace(result, observation=obs, info={**info, **result.info}, call=call)


# ----------------------------------------------------------------------------------------------
# Versions.

# The version of the contract every env runs under (`Env.step`'s invalid-action rule, turn and observation caps,
# what a termination means). An env's version is its own source plus this number, not the source of this file:
# editing a docstring here changes no env's version. Bump it when a change here changes what any env does for the
# same actions; every env's version changes with it, and resuming a run refuses (docs/design.md §2.8) unless
# `train.allow_env_change` (recorded in the checkpoint).
ENV_API_VERSION = 1


def source_version(*objs: Any, data: Iterable[Path] = (), extra: str = "") -> str:
  """A short hash of the source files defining `objs`, the files in `data` and `extra`.

  Independent of where the files are (a worker sees envs/ and user packages at other paths than the trainer):
  each file counts by its name and contents, in that order.
  """
  h = hashlib.sha256()
  paths = {inspect.getsourcefile(o) for o in objs} | {str(Path(p)) for p in data}
  files = sorted((Path(f).name, Path(f).read_bytes()) for f in paths)
  for name, body in files:
    h.update(name.encode())
    h.update(body)
  h.update(extra.encode())
  return h.hexdigest()[:12]


class EnvAPIError(TypeError):
  """An `EnvSpec` whose functions cannot be called the way the trainer calls them (e.g. written for an older API)."""


# How the trainer calls an EnvSpec's functions: (attribute, positional args, keyword args, the expected signature).
_CALLS = (
    ("make", (), {"max_turns": 1}, "make(**kwargs) -> Env (the trainer passes max_turns and env.options)"),
    ("tasks", ("train", 1, 0), {}, "tasks(split, n, seed, **options) -> list[Task]"),
    ("demo", (None, 0), {}, "demo(task, seed, **options) -> list[str]"),
    ("describe", (None,), {}, "describe(task) -> str"),
    ("probes", (None, 0), {}, "probes(task, seed) -> {name: [actions]}"),
    ("timeouts", (), {}, "timeouts() -> {action_timeout_s | reset_timeout_s: seconds}"),
)
POOL_TIMEOUTS = ("action_timeout_s", "reset_timeout_s")  # what an EnvSpec's `timeouts` may raise
# What changed in the API, by function, for the error a stale user env gets.
_CHANGES = {"demo": "demo gained the episode's `seed` after `task` (a seeded env, like guess, needs it to solve "
                    "the task it was reset with): add it, e.g. `def demo(task, seed, **options)`"}


def _check_callable(name: str, attr: str, fn: Any, args: tuple, kwargs: dict, expected: str) -> None:
  if not callable(fn):
    raise EnvAPIError(f"EnvSpec {name!r}: {attr} is {type(fn).__name__!r}, not a function; expected {expected}")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin or C callable: nothing to check
    return
  try:
    signature.bind(*args, **kwargs)
  except TypeError as e:
    hint = f"; {_CHANGES[attr]}" if attr in _CHANGES else ""
    where = getattr(fn, "__qualname__", attr)
    raise EnvAPIError(f"EnvSpec {name!r}: {attr} = {where}{signature} cannot be called as {expected} ({e})"
                      f"{hint}") from None


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A registered environment.

  Attributes:
    name: registry name.
    description: one line.
    make: `make(**kwargs) -> Env`.
    tasks: `tasks(split, n, seed) -> list[Task]` (deterministic).
    demo: `demo(task, seed, **options) -> list[str]`, scripted actions that solve `task` reset with `seed`
      (behavior cloning; `options` are the config's `env.demo_options`).
    version_sources: objects whose source files define the version.
    deterministic: replay with the same seed and actions gives the same observations.
    needs_sandbox: actions run real programs (terminal, code repair).
    describe: `describe(task) -> str`, the task as a person would compare two of them (near-duplicate checks
      between splits); None: the payload as `key=value` lines, which suits payloads of text and numbers.
    probes: `probes(task, seed) -> {name: [actions]}`, exploit probes: scripted episodes that try to game the
      verifier without doing the task (an answer in a format a lax parser would take, a file written in place
      of the work); each must score 0 (`jaxagent eval --suite`). None: the env defines none.
    data_dirs: `data_dirs() -> {VARIABLE: directory}`, data the env reads at run time from outside its package (a
      fetched corpus, in the cache): a sandboxed local worker gets each directory bound read-only at the same
      path and VARIABLE set to it, so the env finds it there as here. None: the package holds all its data.
    timeouts: `timeouts() -> {"action_timeout_s": s, "reset_timeout_s": s}`, the wall-clock limits this env's steps
      and resets need on this machine (measured, e.g. from a test suite's timed run); a pool whose own limit is
      lower raises it to this and logs it. None: the pool's limits as configured.
    site_packages: its workers import installed packages beyond the standard library and msgpack (an agent's
      `openai` client): a bubblewrap worker gets the trainer's site-packages bound read-only (still no network,
      no writes); a docker image must have them installed.
    network: the env is a client of a server elsewhere (an OpenEnv server's): its workers need the network, so a
      local pool runs them unsandboxed under sandbox='auto' and refuses 'bwrap' and docker.
  """
  name: str
  description: str
  make: Callable[..., Env]
  tasks: Callable[[str, int, int], list[Task]]
  demo: Callable[..., list[str]]
  version_sources: tuple[Any, ...] = ()
  data_files: tuple[Path, ...] = ()
  deterministic: bool = True
  needs_sandbox: bool = False
  describe: Callable[[Task], str] | None = None
  probes: Callable[..., dict[str, list[str]]] | None = None
  data_dirs: Callable[[], Mapping[str, Path]] | None = None
  timeouts: Callable[[], Mapping[str, float]] | None = None
  site_packages: bool = False
  network: bool = False

  def __post_init__(self):
    for attr, args, kwargs, expected in _CALLS:
      fn = getattr(self, attr)
      if fn is None and attr in ("describe", "probes", "timeouts"):
        continue
      _check_callable(self.name, attr, fn, args, kwargs, expected)

  def check_options(self, attr: str, options: Mapping[str, Any] | None) -> None:
    """Raises ValueError unless `attr` ("tasks" or "demo") takes every key of `options` as a keyword: the
    message names the option, this env's function and the options it does take."""
    if not options:
      return
    fn = getattr(self, attr)
    args = next(a for name, a, _, _ in _CALLS if name == attr)
    try:
      params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
      return
    if any(p.kind is p.VAR_KEYWORD for p in params):
      return
    filled = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in filled]
    unknown = [k for k in options if k not in takes]
    if unknown:
      where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', attr)}"
      close = difflib.get_close_matches(unknown[0], takes, n=1)
      raise ValueError(f"{unknown[0]!r} is not an option of the {self.name} env's {attr} ({where})"
                       + (f" (did you mean {close[0]!r}?)" if close else "")
                       + f"; it takes {', '.join(map(repr, takes)) if takes else 'none'}")

  @property
  def version(self) -> str:
    """The env's own source files (`version_sources`, else `make`'s), its data files and `ENV_API_VERSION`."""
    return source_version(*(self.version_sources or (self.make,)), data=self.data_files,
                          extra=f"env-api-{ENV_API_VERSION}")
