"""Train state and optimizer: one immutable pytree that a jitted step maps to the next one; the run's state
(`RunState`) around it: everything else that decides the next step, and what a checkpoint saves."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

import flax.struct
import jax
import optax

from jaxagent.config import OptimConfig
from jaxagent.tasks import supply as task_supply
from jaxagent.train import monitors as monitors_lib
from jaxagent.train.metrics import X_AXES



@flax.struct.dataclass
class TrainState:
  """Everything that decides the next update (besides data and env state, checkpointed beside it).

  Attributes:
    params: the policy's parameters (`nnx.State`).
    opt_state: Optax state.
    step: int32[] optimizer updates applied.
    policy_version: int32[] version of `params`; +1 per update; stamped on every sampled trajectory.
    rng: the run's base key; per-step keys are `fold_in(rng, step)`, never a mutated key.
    ref_params: the frozen reference policy for the KL term (`algo.kl_coef > 0`), else None. Set to the
      policy at the start of RL (after the cold start); never updated; checkpointed with the rest.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  policy_version: jax.Array
  rng: jax.Array
  ref_params: Any = None


def learning_rate_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup, then constant or cosine decay to `end_lr_ratio * learning_rate`."""
  lr = config.learning_rate
  if config.schedule == "constant":
    main = optax.constant_schedule(lr)
  else:
    decay = config.decay_steps or max(total_steps - config.warmup_steps, 1)
    main = optax.cosine_decay_schedule(lr, decay, alpha=config.end_lr_ratio)
  if not config.warmup_steps:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, config.warmup_steps), main],
                              [config.warmup_steps])


def make_optimizer(config: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW on `schedule` with global-norm clipping (the trainer joins its cold-start and RL schedules)."""
  return optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay))


class LiveStream(Protocol):
  """What the run's state needs of an rl stage's rollout stream (`jaxagent.train.freshness.Freshness`:
  train.freshness one_step_off / async): its checkpoint, a pause for evaluations, and closing."""

  def checkpoint(self, iteration: int) -> dict[str, Any]: ...

  def pause(self) -> None: ...

  def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunState:
  """Everything that decides a run's next step, carried from iteration to iteration; what a checkpoint saves
  (`to_checkpoint`) and a resume rebuilds (`from_checkpoint`).

  Values: the train state, where the run is (iteration, curriculum stage and the iteration it began), the
  cumulative counters (the x-axes) and the monitors' windows. Holders that cannot be values, because they hold
  running episodes or an iterator: the task supplies (their draw state is saved), an async rl stage's stream
  (its slots and queue are saved) and a non-rl stage's data (rft's kept set, read back from the run's store on a
  resume). Env seeds and sampling keys are derived from (seed, iteration), so the checkpoint of this state is
  all a resumed run needs to continue exactly as the uninterrupted one.
  """
  train: TrainState
  monitors: monitors_lib.Monitors
  supplies: task_supply.StageSupplies | None = None
  iteration: int = 0
  stage: int = 0           # the curriculum stage (index into config.stages) the next step belongs to
  stage_start: int = 0     # the iteration at which that stage began (a stage ends `steps` later, or promoted)
  counters: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(X_AXES, 0))
  stream: LiveStream | None = None                  # while an rl stage with train.freshness != sync runs
  saved_stream: Mapping[str, Any] | None = None     # the stream's checkpoint, until a resumed stream restarts
  stage_data: Any = None                            # the current non-rl stage's `paradigms.StageData`

  @property
  def supply(self) -> task_supply.TaskSupply | None:
    """The task supply the current stage draws from."""
    return None if self.supplies is None else self.supplies.for_stage(self.stage)

  def to_checkpoint(self) -> dict[str, Any]:
    """The checkpoint metadata of this state (JSON; the train state is saved beside it)."""
    supply = self.supply
    out = {"iteration": self.iteration, "data_iterator": None if supply is None else supply.get_state(),
           "curriculum": {"stage": self.stage, "stage_start": self.stage_start}, "counters": dict(self.counters),
           "monitors": self.monitors.to_checkpoint()}
    if self.stream is not None:
      out["stream"] = self.stream.checkpoint(self.iteration)
    elif self.saved_stream is not None:  # resumed, the stream not restarted yet: its saved state stands
      out["stream"] = dict(self.saved_stream)
    return out

  @classmethod
  def from_checkpoint(cls, train: TrainState, meta: Mapping[str, Any], *, supplies: task_supply.StageSupplies | None,
                      monitors_config) -> "RunState":
    """The state `to_checkpoint` saved, around the restored `train` state: the current stage's supply continues
    from its saved draw state, the monitors (`monitors_config`: train.monitors) from their windows."""
    where = meta["curriculum"]
    state = cls(train=train, monitors=monitors_lib.Monitors.from_checkpoint(monitors_config, meta.get("monitors")),
                supplies=supplies, iteration=int(meta["iteration"]), stage=int(where["stage"]),
                stage_start=int(where["stage_start"]), counters=dict(meta["counters"]), saved_stream=meta.get("stream"))
    if state.supply is not None and meta.get("data_iterator") is not None:
      state.supply.set_state(meta["data_iterator"])
    return state
