"""Guess the number: `guess 7` -> `higher` / `lower` / `correct`, within a turn budget.

The secret is drawn from (task id, seed), so the same seed replays the same episode. Splits are isolated by
template (range size): train 1..16, tune 1..24, eval 1..32. The budget is ceil(log2(range)) + 1 guesses;
running out ends the episode as `turn_budget_exhausted` (not task completion).
"""

from __future__ import annotations

import math
import random

from envs._api import (COMPLETED, TURN_BUDGET_EXHAUSTED, ActionParser, Call, Env, EnvSpec, InvalidAction,
                       Observation, StepResult, Task, Verdict, Verifier, source_version, Tool)

SPLIT_RANGES = {"train": (16,), "tune": (24,), "eval": (32,)}


def secret(task: Task, seed: int) -> int:
  return random.Random(f"{task.id}:{seed}").randint(1, int(task.payload["high"]))


def budget(high: int) -> int:
  return math.ceil(math.log2(high)) + 1


class GuessVerifier(Verifier):
  version = "guess-exact-v1"

  def score(self, task: Task, final: tuple[int, int]) -> Verdict:
    guess, target = final
    return Verdict(guess == target, 1.0 if guess == target else 0.0, dict(guess=guess), self.version)


class GuessEnv(Env):
  name = "guess"
  description = "guess a number with higher/lower feedback and a turn budget: `guess 7`"
  parser = ActionParser(tools=(
      Tool.with_arg("guess", "Guess the secret number; the reply is higher, lower or correct.", "number",
                    "an integer in the task's range", ["string", "integer"]),), max_chars=16)

  def __init__(self, max_turns: int = 16, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = GuessVerifier()

  def _reset(self, task: Task, seed: int) -> str:
    self.high = int(task.payload["high"])
    self.secret = secret(task, seed)
    self.left = budget(self.high)
    self.lo, self.hi = 1, self.high  # what the replies so far leave possible
    return f"number in 1..{self.high}, {self.left} guesses"

  def _step(self, call: Call) -> StepResult:
    try:
      g = int(call.arg)
    except ValueError:
      raise InvalidAction(f"guess needs an integer, got {call.arg[:16]!r}") from None
    if not 1 <= g <= self.high:
      raise InvalidAction(f"guess {g} outside 1..{self.high}")
    self.left -= 1
    if g == self.secret:
      v = self.verifier.verify(self.task, (g, self.secret))
      return StepResult(Observation("correct"), {"outcome": v.reward}, True, COMPLETED, verdict=v)
    text = "higher" if g < self.secret else "lower"
    if g < self.secret:
      self.lo = max(self.lo, g + 1)
    else:
      self.hi = min(self.hi, g - 1)
    if self.left <= 0:  # the verifier scores the last guess: failed, and the episode ends on the budget.
      v = self.verifier.verify(self.task, (g, self.secret))
      return StepResult(Observation(text), {"outcome": v.reward}, True, TURN_BUDGET_EXHAUSTED, verdict=v)
    return StepResult(Observation(text), {}, False, None, {})

  def state_key(self) -> str:
    """The secret (episodes of one task with other seeds have other secrets: their states differ), the range
    the replies so far leave possible and the guesses left (not the order the replies came in)."""
    return f"guess:{self.secret}:{self.lo}-{self.hi}:{self.left}"

  def snapshot(self):
    return dict(turn=self.turn, done=self.done, left=self.left, lo=self.lo, hi=self.hi)

  def restore(self, state) -> None:
    self.turn, self.done, self.left = int(state["turn"]), bool(state["done"]), int(state["left"])
    self.lo, self.hi = int(state.get("lo", 1)), int(state.get("hi", self.high))


def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
  if split not in SPLIT_RANGES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_RANGES)}")
  version = source_version(tasks)
  highs = SPLIT_RANGES[split]
  return [Task(id=f"guess-{split}-{seed}-{i}", split=split, payload=dict(high=highs[i % len(highs)]),
               version=version) for i in range(n)]


def demo(task: Task, seed: int = 0) -> list[str]:
  """Binary search against the secret of (task, seed)."""
  lo, hi, target, out = 1, int(task.payload["high"]), secret(task, seed), []
  while True:
    g = (lo + hi) // 2
    out.append(f"guess {g}")
    if g == target:
      return out
    lo, hi = (g + 1, hi) if g < target else (lo, g - 1)


SPEC = EnvSpec(name="guess", description=GuessEnv.description, make=GuessEnv, tasks=tasks, demo=demo,
               version_sources=(GuessEnv,))
