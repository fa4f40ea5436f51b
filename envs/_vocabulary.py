"""The one vocabulary of episode ends, shared with jaxagent: `Termination`, `Outcome`, their constants and
name tuples, splits, invalid-action rules, reward components. Part of the env API (`envs/_api.py` re-exports
every name). Plain Python only.
"""

from __future__ import annotations

import enum
from typing import Mapping



# ----------------------------------------------------------------------------------------------
# Termination reasons and per-step outcomes: the one vocabulary shared with jaxagent (which imports these).


class Termination(str, enum.Enum):
  """Why an episode ended (docs/design.md §2.1), recorded with the trajectory, never inferred later.

  A `str` enum: members compare and hash equal to their value (`Termination.COMPLETED == "completed"`), and
  `str()` / f-strings give the value. Use `.value` when writing to the wire or logs.
  """
  COMPLETED = "completed"                      # the task ran to its end and a verifier scored it
  MAX_TURNS = "max_turns"                      # the turn limit was reached first
  CONTEXT_EXHAUSTED = "context_exhausted"      # the policy's context / token budget ran out
  TURN_BUDGET_EXHAUSTED = "turn_budget_exhausted"  # the task's own budget (e.g. guesses) ran out
  INVALID_ACTION = "invalid_action"            # a refused call ended the episode (rule "terminate")
  PARSER_REJECTED = "parser_rejected"          # text that is not an action ended the episode (rule "terminate")
  ENV_ERROR = "env_error"                      # a tool / env / worker fault
  ENV_TIMEOUT = "env_timeout"                  # an action or the episode exceeded its time limit
  RETRIES_EXHAUSTED = "retries_exhausted"      # the worker kept dying on this step
  CANCELLED = "cancelled"                      # the trainer cancelled the episode

  def __str__(self) -> str:
    return self.value

  __format__ = str.__format__


class Outcome(str, enum.Enum):
  """What one step came to: "ok", a termination, or a finer reason (a worker crash ends as env_error, a
  rejected action under the error_observation / penalty rules does not end the episode).

  Members after the terminations only ever get appended: their position is their `OUTCOME_CODES` code.
  """
  OK = "ok"
  COMPLETED = "completed"
  MAX_TURNS = "max_turns"
  CONTEXT_EXHAUSTED = "context_exhausted"
  TURN_BUDGET_EXHAUSTED = "turn_budget_exhausted"
  INVALID_ACTION = "invalid_action"
  PARSER_REJECTED = "parser_rejected"
  ENV_ERROR = "env_error"
  ENV_TIMEOUT = "env_timeout"
  RETRIES_EXHAUSTED = "retries_exhausted"
  CANCELLED = "cancelled"
  WORKER_CRASH = "worker_crash"                              # done, env_error: worker died, no replay
  INVALID_ACTION_CONTINUED = "invalid_action_continued"      # not done: refused call answered with an error
  PARSER_REJECTED_CONTINUED = "parser_rejected_continued"    # not done: non-action answered with an error
  REPLAY_DIVERGED = "replay_diverged"                        # done, env_error: a replay answered differently
  HISTORY_REWRITTEN = "history_rewritten"  # done, env_error: an agent's request did not extend the record

  def __str__(self) -> str:
    return self.value

  __format__ = str.__format__

  @property
  def ends_episode(self) -> bool:
    """True for every outcome of a finished step (all but ok and the *_continued ones)."""
    return self not in _CONTINUING


_CONTINUING = frozenset({Outcome.OK, Outcome.INVALID_ACTION_CONTINUED, Outcome.PARSER_REJECTED_CONTINUED})
if [o.value for o in Outcome][1:len(Termination) + 1] != [t.value for t in Termination]:
  raise AssertionError("Outcome must list every Termination, in order, right after ok")

COMPLETED = Termination.COMPLETED
MAX_TURNS = Termination.MAX_TURNS
CONTEXT_EXHAUSTED = Termination.CONTEXT_EXHAUSTED
TURN_BUDGET_EXHAUSTED = Termination.TURN_BUDGET_EXHAUSTED
INVALID_ACTION = Termination.INVALID_ACTION
PARSER_REJECTED = Termination.PARSER_REJECTED
ENV_ERROR = Termination.ENV_ERROR
ENV_TIMEOUT = Termination.ENV_TIMEOUT
RETRIES_EXHAUSTED = Termination.RETRIES_EXHAUSTED
CANCELLED = Termination.CANCELLED

TERMINATIONS: tuple[str, ...] = tuple(t.value for t in Termination)
# Ends that are faults of the infrastructure, not of the policy or the task: the trainer's default
# train.exclude_terminations (stored, counted, never trained on), and what `jaxagent tasks execute` retries.
INFRASTRUCTURE_TERMINATIONS: tuple[str, ...] = (ENV_ERROR.value, ENV_TIMEOUT.value, RETRIES_EXHAUSTED.value,
                                                CANCELLED.value)
OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)
# Codes are what the host-callback bridge returns (int32); keyed by the value, so a member looks up too.
OUTCOME_CODES: Mapping[str, int] = {name: i for i, name in enumerate(OUTCOMES)}

SPLITS = ("train", "tune", "eval")
INVALID_ACTION_RULES = ("error_observation", "terminate", "penalty")
REWARD_COMPONENTS = ("validity", "progress", "outcome", "cost")


class EnvError(RuntimeError):
  """An environment or tool fault (not a task failure): ends the episode as `env_error`."""


