"""Environments: API, built-in envs, worker server and pools. Never imports JAX or jaxagent.

Public API:
  Task, Observation, StepResult, Verdict, Verifier, Env, EnvSpec, ActionParser, Call, Tool, InvalidActionRule
  ACTION_SYNTAXES: how actions are written (line `NAME ARG`, or json function calls)
  Termination, Outcome (str enums: the one vocabulary of episode ends) and TERMINATIONS, OUTCOMES, OUTCOME_CODES
  get(name), names(), register(spec), check_name(name), is_valid_name(name), UnknownEnvError
  (names: built-ins, `jaxagent.envs` entry points of installed packages, or `package.module:ATTR`)
  agent_spec(name, agent=, tasks=, tools=, verifier=): an agent written against the OpenAI chat API, as an env
  (envs/gateway.py)
"""

from envs._api import (ACTION_SYNTAXES, CANCELLED, COMPLETED, CONTEXT_EXHAUSTED, ENV_API_VERSION, ENV_ERROR,
                       ENV_TIMEOUT, INFRASTRUCTURE_TERMINATIONS, INVALID_ACTION, INVALID_ACTION_RULES,
                       JSON_PARSER_VERSION, MAX_TURNS, OUTCOME_CODES, OUTCOMES, PARSER_REJECTED, RETRIES_EXHAUSTED,
                       SPLITS, TERMINATIONS, TURN_BUDGET_EXHAUSTED, ActionParser, Call, Env, EnvAPIError, EnvError,
                       EnvSpec, InvalidAction, InvalidActionRule, Observation, Outcome, ParseError, StepResult, Task,
                       Termination, Tool, Verdict, Verifier, source_version)
from envs._registry import (ENTRY_POINT_GROUP, UnknownEnvError, check_name, get, is_valid_name, names,
                            register)
from envs import mcp_tools, pool  # noqa: E402, F401  (no jax; gives envs.pool.Pool)
from envs.gateway import AgentEnv, agent_spec  # noqa: F401
from envs.builtin import calculator as _calculator
from envs.builtin import calculator_agent as _calculator_agent
from envs.builtin import code_repair as _code_repair
from envs.builtin import database as _database
from envs.builtin import faults as _faults
from envs.builtin import gridworld as _gridworld
from envs.builtin import guess as _guess
from envs.builtin import sokoban as _sokoban
from envs.builtin import swe as _swe
from envs.builtin import terminal as _terminal

for _m in (_calculator, _calculator_agent, _guess, _gridworld, _sokoban, _terminal, _faults, _code_repair, _swe, _database):
  register(_m.SPEC)
del _m
