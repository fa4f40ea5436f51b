"""Train state and optimizer: one immutable pytree that a jitted step maps to the next one; the loop's
host-side state (`LoopState`) around it."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.struct
import jax
import optax

from jaxagent.config import OptimConfig
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


@dataclasses.dataclass(frozen=True)
class LoopState:
  """The loop's host-side state besides the train state: iteration and the cumulative counters (x-axes)."""
  state: TrainState
  iteration: int = 0
  counters: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(X_AXES, 0))
  stage: int = 0           # the curriculum stage (index into config.stages) the next step belongs to
  stage_start: int = 0     # the iteration at which that stage began (an rl stage ends steps later, or promoted)
