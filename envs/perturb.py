"""Perturbations of an env's tools, injected by the worker that hosts it: the env under test is never edited.

`Perturbation` says what goes wrong; `PerturbedEnv(inner, perturbation)` wraps any `Env` and is what a worker
builds when a reset carries the option `perturb` (`envs.pool.PoolConfig.perturb`, the trainer's `env.perturb`,
an evaluation suite's condition: `jaxagent eval --suite`). Every draw comes from (episode seed, turn), so an
episode meets the same faults on every run and replay stays exact.

  latency_factor, latency_median_s, latency_sigma, latency_cap_s
      every step takes `latency_factor` x its own time, plus a lognormal tail (median, shape sigma, capped):
      real tools have heavy-tailed latency, and a tail past the pool's `action_timeout_s` ends the episode as
      env_timeout, as it would in production.
  transient_p
      a call fails with probability p with an error reply; the env does not run it (its state does not move),
      the turn is spent, and the next call may succeed (recovery is the policy's job).
  down_tool
      every call of this tool fails the same way (a permanent outage of one tool).
  implicit_p
      with probability p a successful reply is plausible but wrong (`corrupt`: one digit changed, e.g. a
      calculator off by one digit; a reply without digits is left as it is). Nothing flags it: ToolMaze's
      implicit failures.
  truncate_fraction
      tool replies (not the task's first observation) are cut to this fraction of their bytes and flagged
      truncated.

Plain Python (no JAX): it runs inside sandboxed workers.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from typing import Any, Mapping

from envs._api import Call, Env, Observation, StepResult, Task

# The error replies the policy sees (and reports count).
TRANSIENT_REPLY = "error: {tool} failed (temporarily unavailable); try again"
DOWN_REPLY = "error: {tool} is unavailable"
_DIGIT = re.compile(r"\d")


@dataclasses.dataclass(frozen=True)
class Perturbation:
  """What goes wrong with an env's tools (module docstring). The default perturbs nothing."""
  latency_factor: float = 1.0
  latency_median_s: float = 0.0
  latency_sigma: float = 0.0
  latency_cap_s: float = 5.0
  transient_p: float = 0.0
  down_tool: str | None = None
  implicit_p: float = 0.0
  truncate_fraction: float = 1.0

  def __post_init__(self):
    checks = (("latency_factor", lambda v: v >= 1.0, ">= 1"), ("latency_median_s", lambda v: v >= 0.0, ">= 0"),
              ("latency_sigma", lambda v: v >= 0.0, ">= 0"), ("latency_cap_s", lambda v: v > 0.0, "> 0"),
              ("transient_p", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
              ("implicit_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
              ("truncate_fraction", lambda v: 0.0 < v <= 1.0, "in (0, 1]"))
    for name, ok, valid in checks:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"perturb.{name}={value!r}: must be a number {valid}")
    if self.down_tool is not None and (not isinstance(self.down_tool, str) or not self.down_tool):
      raise ValueError(f"perturb.down_tool={self.down_tool!r}: must be a tool name")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None) -> "Perturbation":
    """From a YAML / wire mapping; an unknown key is an error that lists the valid ones."""
    d = dict(d or {})
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
      raise ValueError(f"perturb: unknown key(s) {unknown}; valid keys are {valid}")
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    """The fields that differ from the default (what travels in a reset's options)."""
    default = Perturbation()
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)}

  @property
  def active(self) -> bool:
    return bool(self.to_dict())


def corrupt(text: str, rng: random.Random) -> str | None:
  """A plausible but wrong version of `text`: one of its digits replaced by another (a leading digit never
  by 0, so a number keeps its length). None when `text` has no digit."""
  spots = [m.start() for m in _DIGIT.finditer(text)]
  if not spots:
    return None
  i = rng.choice(spots)
  leading = i == 0 or not text[i - 1].isdigit()
  choices = [d for d in "0123456789" if d != text[i] and not (leading and d == "0" and i + 1 < len(text)
                                                                 and text[i + 1].isdigit())]
  return text[:i] + rng.choice(choices) + text[i + 1:]


class PerturbedEnv(Env):
  """`inner` with its tools perturbed. The inner env's parser, verifier, turn limit, invalid-action rule,
  observation cap, anchor states and snapshots are kept; a call the perturbation fails is never run by it."""

  def __init__(self, inner: Env, perturbation: Perturbation):
    super().__init__(max_turns=inner.max_turns, invalid_action=inner.invalid_action,
                     max_obs_bytes=inner.max_obs_bytes)
    self.inner, self.perturbation = inner, perturbation
    self.name, self.description = inner.name, inner.description
    self.parser, self.verifier, self.heldout_verifier = inner.parser, inner.verifier, inner.heldout_verifier
    tools = [t.name for t in inner.parser.tools]
    if perturbation.down_tool is not None and perturbation.down_tool not in tools:
      raise ValueError(f"perturb.down_tool={perturbation.down_tool!r}: {inner.name} has the tools {tools}")
    self.seed = 0

  def versions(self) -> dict[str, str]:
    return self.inner.versions()

  def _reset(self, task: Task, seed: int) -> str:
    self.seed = int(seed)
    return self.inner.reset(task, seed).text

  def state_key(self) -> str | None:
    return self.inner.state_key()

  def snapshot(self) -> Any:
    return self.inner.snapshot()

  def restore(self, state: Any) -> None:
    self.inner.restore(state)

  def close(self) -> None:
    self.inner.close()

  def _rng(self, what: str) -> random.Random:
    return random.Random(f"perturb/{what}/{self.seed}/{self.turn}")

  def _step(self, call: Call) -> StepResult:
    p = self.perturbation
    start = time.perf_counter()
    if call.name == p.down_tool:
      result = StepResult(Observation.capped(DOWN_REPLY.format(tool=call.name), self.max_obs_bytes), {}, False,
                          None, dict(perturbation="down_tool"))
    elif p.transient_p and self._rng("transient").random() < p.transient_p:
      result = StepResult(Observation.capped(TRANSIENT_REPLY.format(tool=call.name), self.max_obs_bytes), {},
                          False, None, dict(perturbation="transient"))
    else:
      self.inner.turn = self.turn
      result = self.inner._step(call)  # the hook Env.step would call
      result = self._distort(result)
    self._wait(time.perf_counter() - start)
    return result

  def _distort(self, result: StepResult) -> StepResult:
    """Implicit failures and truncation of a reply the inner env gave (a finished step's is left alone: the
    episode's verdict is the env's)."""
    p, obs = self.perturbation, result.observation
    if result.done:
      return result
    text, tags = obs.text, [result.info["perturbation"]] if "perturbation" in result.info else []
    if p.implicit_p and self._rng("implicit").random() < p.implicit_p:
      wrong = corrupt(text, self._rng("implicit-digit"))
      if wrong is not None:
        text, tags = wrong, tags + ["implicit"]
    raw = text.encode("utf-8", errors="replace")
    keep = int(len(raw) * p.truncate_fraction)
    if keep < len(raw):
      text, tags = raw[:keep].decode("utf-8", errors="ignore"), tags + ["truncated"]
      obs = dataclasses.replace(obs, truncated=True, original_size=max(obs.original_size, len(raw)))
    if not tags:
      return result
    return dataclasses.replace(result, observation=dataclasses.replace(obs, text=text),
                               info={**result.info, "perturbation": "+".join(tags)})

  def _wait(self, own_s: float) -> None:
    p = self.perturbation
    extra = (p.latency_factor - 1.0) * own_s
    if p.latency_median_s > 0:
      draw = self._rng("latency").lognormvariate(math.log(p.latency_median_s), p.latency_sigma)
      extra += min(draw, p.latency_cap_s)
    if extra > 0:
      time.sleep(extra)


def wrap(env: Env, options: Mapping[str, Any] | None) -> Env:
  """`env` perturbed as `options` (a `Perturbation` mapping) say; `env` itself when they perturb nothing."""
  perturbation = Perturbation.from_dict(options)
  return PerturbedEnv(env, perturbation) if perturbation.active else env
