"""Checkpoints of a run and resuming from them: what a checkpoint's metadata holds besides the train state
(iteration, curriculum stage, counters, task-iterator state, env and library versions, trajectory shards,
LoRA settings, the monitors' windows), and the checks a resume makes (env unchanged, same LoRA settings, stage in
range).

  save(run, run_state, writer)   -> None                    (asynchronous; `run.checkpointer` waits on close)
  restore(run)                  -> RunState, metadata     (the newest intact checkpoint)

The Orbax layer under it (integrity digests, retries, topology changes) is jaxagent/train/checkpointing.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

import models
from jaxagent import config as config_lib
from jaxagent import multihost
from jaxagent import sharding as sharding_lib
from jaxagent import trajectory_store
from jaxagent.config import Config
from jaxagent.train import checkpointing
from jaxagent.train.run import Run
from jaxagent.train.state import RunState


class EnvChangedError(config_lib.ConfigError):
  """A resume would train on a different env, parser or verifier than the checkpoint's."""


def save(run: Run, run_state: RunState, writer: trajectory_store.TrajectoryWriter | None,
         env_change: Mapping[str, Any] | None = None) -> None:
  """Checkpoints the run's state (`RunState.to_checkpoint`, beside its train state) with the versions it depends
  on and the trajectory shards written so far (asynchronously)."""
  shards = multihost.host_gather(np.asarray([writer.next_index if writer is not None else 0]))
  meta = {**run_state.to_checkpoint(), "versions": checkpointing.versions(), "env": dict(run.env_versions),
          "policy_version": int(run_state.train.policy_version),
          "trajectory_shards": {trajectory_store.shard_prefix(p, len(shards)): int(n) for p, n in enumerate(shards)},
          "lora": lora_settings(run.config)}
  if env_change:
    meta["env_change_allowed"] = dict(env_change)
  run.checkpointer.save(run_state.iteration, run_state.train, meta, run.policy.model_config,
                        config_lib.to_dict(run.config))


def run_directory(path: Path | str, flag: str = "--checkpoint") -> Path:
  """The run directory a command-line path names (the directory itself or its `checkpoints/`); a directory
  without the run's `config.yaml` is an error naming `flag`."""
  run_dir = Path(path)
  if run_dir.name == "checkpoints":
    run_dir = run_dir.parent
  if not (run_dir / "config.yaml").is_file():
    raise config_lib.ConfigError(f"{flag} {path}: expected a run directory with config.yaml")
  return run_dir


def check_env_versions(run: Run, stored: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """Refuses to resume on a changed env, parser or verifier unless `train.allow_env_change` (then recorded);
  an evaluation (`build_run(purpose="eval")`) warns and goes on.

  Returns the change to record in the checkpoint metadata (None when nothing changed).
  """
  if not stored:
    return None
  now = run.env_versions
  diff = {k: (stored.get(k), now.get(k)) for k in ("name", "version", "parser", "verifier")
          if k in stored and stored.get(k) != now.get(k)}
  if not diff:
    return None
  detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
  if run.purpose == "eval":  # evaluating an old policy on today's env is a question worth asking; say so
    warnings.warn(f"evaluating on a changed environment ({detail}): the numbers describe this env, not the one "
                  "the policy was trained on", RuntimeWarning, stacklevel=2)
    return None
  if not run.config.train.allow_env_change:
    raise EnvChangedError(f"the environment changed since the checkpoint ({detail}); resuming would train the "
                          "policy on other tasks or rewards than it was trained on so far. To resume anyway, pass "
                          "--set train.allow_env_change=true (recorded in the checkpoint metadata)")
  warnings.warn(f"resuming on a changed environment ({detail}): allowed by train.allow_env_change, recorded",
                RuntimeWarning, stacklevel=2)
  return {"from": dict(stored), "to": dict(now)}


def lora_settings(config: Config) -> dict[str, Any] | None:
  """The LoRA settings a checkpoint's state depends on (None: full fine-tuning), stored in its meta."""
  m = config.model
  return None if not m.lora_rank else {"rank": m.lora_rank, "alpha": m.lora_alpha, "targets": list(m.lora_targets)}


def restore(run: Run) -> tuple[RunState, dict[str, Any]]:
  """The newest intact checkpoint of the run as `RunState`, and its metadata (the task iterator continues from
  it when the run has one). Raises `models.CheckpointError` if there is none."""
  # Restored straight into the learner layout: no train state is initialized first (one copy in memory).
  restored = run.checkpointer.restore_latest(run.policy.abstract_state, run.policy.model_config,
                                             require={"lora": lora_settings(run.config)})
  if restored is None:
    raise models.CheckpointError(f"{run.run_dir}: no complete checkpoint under {run.run_dir / 'checkpoints'}")
  iteration, state, meta = restored
  missing = [k for k in run.policy.abstract_state.params if k not in state.params]
  if missing:  # frozen parameters (LoRA's base policy) are not in checkpoints: from model.path or the seed
    base = run.policy.init_state().params
    state = state.replace(params={**state.params, **{k: base[k] for k in missing}})
  state = jax.jit(lambda x: x, out_shardings=run.policy.layout.state_shardings, donate_argnums=0)(state)  # pinned
  sharding_lib.check_replication(state.params, run.config.mesh.max_replicated_fraction)
  change = check_env_versions(run, meta.get("env"))
  if change:
    meta = {**meta, "env_change_allowed": change}
  stages = config_lib.stages(run.config)
  where = meta.get("curriculum")
  if where is None:  # a checkpoint from before curriculum stages: the implicit cold start + rl schedule
    bc = int(state.step) < run.config.train.bc_steps
    where = {"stage": 0 if bc else next((i for i, st in enumerate(stages) if st.paradigm == "rl"), len(stages)),
             "stage_start": 0}
  if not 0 <= int(where["stage"]) <= len(stages):
    raise config_lib.ConfigError(f"the checkpoint is in curriculum stage {where['stage']}, this config has "
                                 f"{len(stages)} stage(s): resume with the run's own config")
  skipped = meta.get("_skipped_steps") or []
  note = f"; skipped damaged/unreadable step(s) {skipped}" if skipped else ""
  run.print(f"resumed from {run.run_dir / 'checkpoints' / str(iteration)} (iteration {iteration}, step "
            f"{int(state.step)}, policy version {int(state.policy_version)}{note})")
  return RunState.from_checkpoint(state, {**meta, "iteration": iteration, "curriculum": where},
                                  supplies=run.new_supplies(), monitors_config=run.config.train.monitors), meta
