"""How env workers run and what an episode is: `WorkerConfig` (the YAML section `env.pool`) and
`PoolConfig` (plus the episode fields). Part of `envs.pool`, which re-exports every public name.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
import typing
from typing import Any, Literal, Mapping

from envs._api import ACTION_SYNTAXES, INVALID_ACTION_RULES
from envs.perturb import Perturbation
from envs.mcp_tools import check_servers


log = logging.getLogger(__name__)
PoolKind = Literal["inprocess", "local", "docker", "remote"]
Sandbox = Literal["auto", "bwrap", "none"]
POOL_KINDS: tuple[str, ...] = typing.get_args(PoolKind)
SANDBOXES: tuple[str, ...] = typing.get_args(Sandbox)
ENVS_DIR = Path(__file__).resolve().parent


def _invalid(obj, name: str, valid: str) -> ValueError:
  return ValueError(f"{name}={getattr(obj, name)!r}: {valid}")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """How env workers run (the YAML section `env.pool`). Validated on construction; an error names the field,
  the value and what is valid (`num_workers=0: must be >= 1`).

  Field types are the ones a typed YAML loader can build: str, int, float, bool, `X | None`, `tuple[str, ...]`
  and `Literal[...]`.
  """
  kind: PoolKind = "local"  # inprocess (threads here), local (subprocess, bwrap), docker, remote (addresses)
  num_workers: int = 1  # worker processes / containers / connections; the slots are spread over them
  # auto (bwrap if available), bwrap (required), none (unconfined, asked for explicitly). Local pool: each worker
  # in bubblewrap; and for envs that run programs (terminal, code_repair), in every pool kind, each episode's
  # programs in a sandbox of their own (envs._sandbox; docker: nested in the container).
  sandbox: Sandbox = "auto"
  action_timeout_s: float = 10.0  # one step's limit; past it the episode ends as env_timeout
  episode_timeout_s: float = 600.0  # a whole episode's limit (reset to last step); env_timeout past it
  reset_timeout_s: float = 30.0  # one reset's limit; the worker is restarted past it
  start_timeout_s: float = 30.0  # a worker's limit to start and answer hello
  max_retries: int = 2  # restarts a crashed step is retried on before retries_exhausted
  # local/docker pools: workers started ahead and held ready; a crashed or hung worker is replaced by one at once
  # (no start on the episode's path), and a new spare starts in the background
  warm_spares: int = 0
  replay_on_crash: bool = True  # replay episodes on a restarted worker (else they end as worker_crash)
  max_obs_bytes: int = 4096  # observation cap in bytes; longer ones are truncated and flagged
  max_inflight: int = 64  # requests in flight per worker connection (backpressure)
  addresses: tuple[str, ...] = ()  # remote pool: one `unix:/path` or `tcp:host:port` per worker
  docker_image: str = "jaxagent-envs:latest"  # docker pool: the worker image (user envs: see DockerWorker)
  docker_host: str | None = None  # docker pool: daemon URL (None: $JAXAGENT_DOCKER_HOST or the private one)
  docker_memory: str = "512m"  # docker pool: memory limit per container
  docker_cpus: float = 1.0  # docker pool: CPUs per container
  docker_pids: int = 128  # docker pool: process limit per container

  def __post_init__(self):
    if self.kind not in POOL_KINDS:
      raise _invalid(self, "kind", f"not one of {POOL_KINDS}")
    if self.sandbox not in SANDBOXES:
      raise _invalid(self, "sandbox", f"not one of {SANDBOXES}")
    for name in ("num_workers", "max_inflight", "max_obs_bytes", "docker_pids"):
      if getattr(self, name) < 1:
        raise _invalid(self, name, "must be >= 1")
    for name in ("action_timeout_s", "episode_timeout_s", "reset_timeout_s", "start_timeout_s", "docker_cpus"):
      if not getattr(self, name) > 0:
        raise _invalid(self, name, "must be > 0")
    if self.max_retries < 0:
      raise _invalid(self, "max_retries", "must be >= 0")
    if self.warm_spares < 0:
      raise _invalid(self, "warm_spares", "must be >= 0")
    if self.warm_spares and self.kind not in ("local", "docker"):
      raise _invalid(self, "warm_spares", f"only local and docker pools start workers (kind={self.kind!r}); "
                     "use 0")
    if not isinstance(self.addresses, tuple) or not all(isinstance(a, str) for a in self.addresses):
      raise _invalid(self, "addresses", "must be a tuple of str (unix:/path or tcp:host:port)")
    if self.kind == "remote" and not self.addresses:
      raise _invalid(self, "addresses", "a remote pool needs worker addresses (unix:/path or tcp:host:port)")


@dataclasses.dataclass(frozen=True)
class PoolConfig(WorkerConfig):
  """A pool: how its workers run (`WorkerConfig`) plus what each episode is (env and its reset options)."""
  env: str = "calculator"  # registered name, `jaxagent.envs` entry point, or package.module:ATTR
  max_turns: int | None = None  # per-episode turn limit (None: the env's default)
  invalid_action: str = "error_observation"  # docs/design.md §2.3: one of INVALID_ACTION_RULES
  penalty: float = 0.1  # validity penalty under the "penalty" rule
  action_syntax: str = "line"  # how actions are written: one of ACTION_SYNTAXES (line `NAME ARG`, json calls)
  # tool faults injected by the worker around the env (envs.perturb.Perturbation's fields; None: none)
  perturb: Mapping[str, Any] | None = None
  score_heldout: bool = False  # also score episodes with the env's held-out verifier (evaluation only)
  # MCP servers whose tools each episode offers beside the env's (`mcp:stdio:<command>`, envs/mcp_tools.py) and
  # their tools' version as the trainer listed them (the worker refuses other tools)
  tools: tuple[str, ...] = ()
  tools_version: str | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.invalid_action not in INVALID_ACTION_RULES:
      raise _invalid(self, "invalid_action", f"not one of {INVALID_ACTION_RULES}")
    if self.max_turns is not None and self.max_turns < 1:
      raise _invalid(self, "max_turns", "must be >= 1 or None")
    if self.penalty < 0:
      raise _invalid(self, "penalty", "must be >= 0")
    if self.action_syntax not in ACTION_SYNTAXES:
      raise _invalid(self, "action_syntax", f"not one of {ACTION_SYNTAXES}")
    if self.perturb is not None:
      object.__setattr__(self, "perturb", Perturbation.from_dict(self.perturb).to_dict() or None)
    object.__setattr__(self, "tools", tuple(self.tools))
    try:
      check_servers(self.tools)
    except ValueError as e:
      raise _invalid(self, "tools", str(e)) from None

  @classmethod
  def from_workers(cls, workers: WorkerConfig, **episode_fields: Any) -> "PoolConfig":
    """`workers`' fields plus the episode-level ones (env, max_turns, invalid_action, penalty, action_syntax)."""
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    clash = sorted(set(episode_fields) & worker_fields)
    if clash:
      raise TypeError(f"PoolConfig.from_workers: {clash} are worker fields; set them on the WorkerConfig")
    return cls(**{name: getattr(workers, name) for name in worker_fields}, **episode_fields)

  def reset_options(self) -> dict[str, Any]:
    opts = dict(invalid_action=self.invalid_action, penalty=float(self.penalty), max_obs_bytes=self.max_obs_bytes)
    if self.max_turns is not None:
      opts["max_turns"] = self.max_turns
    if self.action_syntax != "line":  # the default is not sent: a line-syntax pool talks to any server
      opts["action_syntax"] = self.action_syntax
    if self.perturb:  # nor is an empty perturbation
      opts["perturb"] = dict(self.perturb)
    if self.score_heldout:
      opts["score_heldout"] = True
    if self.tools:
      opts["tools"] = list(self.tools)
      if self.tools_version is not None:
        opts["tools_version"] = self.tools_version
    return opts


