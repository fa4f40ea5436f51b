"""The data paradigms besides online RL, one iteration at a time, for curriculum stages (and the `jaxagent sft`,
`rft`, `offline` verbs, which are one-stage curricula):

  sft      supervised fine-tuning on `stage.data`: a JSONL chat file (jaxagent/data/chats.py) or stored
           trajectories (jaxagent/data/trajectories.py, `stage.filter`). One optimizer step per iteration.
  offline  learning from another policy's stored trajectories. `method: filtered_bc` is sft on the filtered
           episodes; `method: iw_pg` is a policy gradient on group-relative advantages of the stored returns,
           weighted by π_θ/μ against the recorded behavior log-probs and truncated at `stage.max_ratio`
           (`algos.importance_weighted_loss`). One optimizer step per iteration.
  rft      rejection-sampling fine-tuning (STaR, Zelikman et al. 2022; RFT, Yuan et al. 2023): a round (one
           iteration) rolls out `stage.rollouts` batches of B tasks x G samples with the current policy, keeps
           the verified samples not already kept (same task and same actions), and takes `stage.updates` steps
           on batches drawn from everything kept so far in the stage.

Every paradigm trains on the recorded masks: only policy (assistant) tokens carry loss. Batches are a pure
function of (run seed, stage, iteration) through grain (`data.trajectories.Examples`), so a run killed and
resumed continues exactly: sft and offline need no iterator state, and rft rebuilds its kept set from the run's
own trajectory store, which holds exactly the checkpoint's timeline (`trajectory_store.discard_from`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import algos, multihost, seeds
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.assembly import BatchShape, assemble
from jaxagent.data import chats
from jaxagent.data import trajectories as stored
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import learner, rollouts
from jaxagent.train.records import IterationRecord
from jaxagent.train.run import Run
from jaxagent.train.state import RunState

RFT_KEY = "rft"  # trajectory metadata: {"stage": name, "kept": bool} on every rft sample in the store


@dataclasses.dataclass
class StageData:
  """What a non-rl stage trains on, built when the stage starts (or resumes)."""
  index: int
  examples: stored.Examples | None = None     # sft, offline: the dataset; rft: rebuilt every round
  advantages: np.ndarray | None = None        # offline iw_pg: float32[N, S] per example and turn
  behavior_versions: np.ndarray | None = None # offline: the recorded policy versions (staleness)
  kept: list[tr.Trajectory] = dataclasses.field(default_factory=list)   # rft: this process's verified samples
  seen: set = dataclasses.field(default_factory=set)                      # rft: their (task, actions) keys


def _fits(run: Run, t: tr.Trajectory) -> bool:
  return len(t) <= run.config.rollout.max_context


def _read_back_kept(run: Run, stage: config_lib.StageConfig, data: StageData) -> None:
  """A resumed rft stage's kept set: this process's samples marked kept in the run's store, in write order (the
  store holds exactly the restored checkpoint's timeline). Refuses a resume on another process count: each
  process keeps its own samples, so the sets cannot be redistributed."""
  directory = run.run_dir / "trajectories"
  if not directory.is_dir():
    return
  prefix = trajectory_store.shard_prefix(jax.process_index(), jax.process_count())
  writers = set()
  for path in trajectory_store.list_files(directory):
    for t in trajectory_store.read_file(path):
      mark = t.metadata.get(RFT_KEY) or {}
      if mark.get("stage") != stage.name:
        continue
      writer = path.name[:-len(trajectory_store.SUFFIX)].rsplit("-", 1)[0]
      writers.add(writer)
      if writer == prefix and mark.get("kept"):
        data.kept.append(t)
        data.seen.add(_sample_key(t))
  now = {trajectory_store.shard_prefix(i, jax.process_count()) for i in range(jax.process_count())}
  if writers - now:
    raise config_lib.ConfigError(
        f"stage {stage.name!r} (rft) ran on other processes ({sorted(writers)}) than this resume ({sorted(now)}): "
        "each process fine-tunes on the samples it kept, which cannot be redistributed; resume it with the same "
        "number of processes")


def _check_unchanged(run: Run, run_state: RunState, stage: config_lib.StageConfig, fingerprint: dict) -> None:
  """Records what a stage's data was when the stage began (`<run>/data/<stage>.json`); a resumed stage refuses
  data that changed since, whose batches would differ from the run's."""
  record = run.run_dir / "data" / f"{stage.name}.json"
  if run_state.iteration > run_state.stage_start and record.is_file():
    before = json.loads(record.read_text())
    if before != fingerprint:
      raise config_lib.ConfigError(
          f"stage {stage.name!r}: its data changed since the stage began ({record}: {before} vs now {fingerprint}); "
          "resuming would train on other batches than the run did. Restore the data, or start a new run")
    return
  if jax.process_index() == 0:
    record.parent.mkdir(exist_ok=True)
    record.write_text(json.dumps(fingerprint, indent=1))


def _digest(paths) -> str:
  h = hashlib.sha256()
  for path in paths:
    h.update(path.name.encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


def prepare(run: Run, run_state: RunState, index: int) -> StageData:
  """The data of stage `index` (printing what was selected); rft: its kept set so far, from the run's store."""
  cfg = run.config
  stage = config_lib.stages(cfg)[index]
  seed = seeds.data_order(cfg.run.seed, index)
  if stage.paradigm == "rft":
    data = StageData(index)
    if run_state.iteration > run_state.stage_start:  # resumed inside the stage: the rounds so far are in the store
      _read_back_kept(run, stage, data)
      run.print(f"stage {stage.name!r} (rft): {len(data.kept)} kept sample(s) of earlier rounds read back")
    return data
  where = f"stage {stage.name!r} data={stage.data!r}"
  if stage.paradigm == "sft" and chats.is_chat_file(stage.data):
    try:
      loaded = chats.read_chats(stage.data, run.interface.chat, run.interface.action_parser)
    except chats.ChatDataError as e:
      raise config_lib.ConfigError(f"stage {stage.name!r}: {e}") from None
    long = [t.id for t in loaded.trajectories if not _fits(run, t)]
    if long:
      raise config_lib.ConfigError(
          f"{where}: {len(long)} chat(s) longer than rollout.max_context={cfg.rollout.max_context} tokens in the "
          f"run's framing (first: {long[0]}); raise rollout.max_context (the policy could not act on them either) "
          "or shorten them")
    _check_unchanged(run, run_state, stage, {"data": stage.data, "digest": _digest([Path(stage.data)])})
    run.print(f"stage {stage.name!r} (sft): {len(loaded.trajectories)} chats from {stage.data}"
              + (f"; {loaded.system_messages_dropped} system message(s) not used (the run's framing has its own)"
                 if loaded.system_messages_dropped else "")
              + (f"; {loaded.observations_truncated} tool repl(ies) cut to rollout.max_observation_tokens"
                 if loaded.observations_truncated else ""))
    return StageData(index, examples=stored.Examples(loaded.trajectories.__getitem__, len(loaded.trajectories),
                                                     seed))
  try:
    files = trajectory_store.list_files(stage.data)
    if not files:
      raise FileNotFoundError("no finished trajectory shard (*.array_record) there")
    selection = stored.select(stage.data, stage.filter, exclude=cfg.train.exclude_terminations,
                              max_turns=cfg.env.max_turns, gamma=cfg.algo.gamma,
                              max_length=cfg.rollout.max_context)
  except (OSError, ValueError, RuntimeError) as e:  # missing, empty, or not ArrayRecord files
    raise config_lib.ConfigError(f"{where}: not readable as stored trajectories: {e}") from None
  _check_unchanged(run, run_state, stage, {"data": stage.data, "files": {p.name: p.stat().st_size for p in files},
                                          "selected": selection.counts})
  run.print(f"stage {stage.name!r} ({stage.paradigm}): {selection.line()} from {stage.data}")
  if not len(selection):
    raise config_lib.ConfigError(f"stage {stage.name!r}: no stored trajectory in {stage.data} passes its filter "
                                 f"({selection.line()})")
  data = StageData(index, examples=stored.Examples(selection.fetch, len(selection), seed),
                   behavior_versions=selection.policy_versions)
  if stage.importance_weighted:
    estimate = algos.get_advantage(cfg.algo.advantage)(
        algos.AdvantageInputs(jnp.asarray(selection.rewards), jnp.asarray(selection.mask),
                              jnp.asarray(selection.groups)), algos.AdvantageConfig.from_algo(cfg.algo))
    data.advantages = np.asarray(estimate.advantages, np.float32)
    flat = int(estimate.zero_variance_groups)
    run.print(f"stage {stage.name!r}: {int(estimate.groups)} groups of the stored returns, {flat} with equal "
              "returns (advantage 0: no signal)")
  return data


def _sample_key(t: tr.Trajectory) -> tuple:
  return (t.task.id, tuple(turn.action.text for turn in t.turns))


def supervised_batch(run: Run, trajectories, advantages=None):
  """This process's rows of a supervised batch (train.bc_batch_size over all processes), at the length
  `learner.batch_length` picks (every process calls it)."""
  cfg = run.config
  # Offline iw_pg scores logged tokens as the rollout samples (thresholds included); behavior cloning does not.
  return assemble(trajectories, advantages, level="turn", shape=BatchShape(
      length=learner.batch_length(cfg, trajectories), rows=run.rows.bc, pad_id=run.interface.tokenizer.pad_id,
      thresholds=advantages is not None and config_lib.truncates(cfg.rollout)))


def loss_normalizer(run: Run, batch) -> float:
  """The batch's loss normalizer over every process (so the gradient does not depend on the process count)."""
  cfg = run.config
  return float(multihost.host_sum(algos.loss_normalizer(batch.loss_mask, batch.segment_ids,
                                                        aggregation=cfg.algo.aggregation,
                                                        norm_length=cfg.algo.norm_length, allow_empty=True)))


def supervised_iteration(run: Run, run_state: RunState, data: StageData) -> tuple[RunState, dict[str, Any]]:
  """One optimizer step of an sft or offline stage on its batch for this iteration."""
  cfg = run.config
  stage = config_lib.stages(cfg)[run_state.stage]
  step = run_state.iteration - run_state.stage_start
  positions, trajs = data.examples.batch(step, cfg.train.bc_batch_size,
                                         part=(jax.process_index(), jax.process_count()))
  iw = stage.importance_weighted
  advantages = [data.advantages[p, :len(t.turns)] for p, t in zip(positions, trajs)] if iw else None
  batch = supervised_batch(run, trajs, advantages)
  normalizer = loss_normalizer(run, batch)
  step_fn = run.steps.offline[(stage.max_ratio, stage.min_negative_ratio)] if iw else run.steps.bc
  update0 = time.perf_counter()
  state, m = step_fn(run_state.train, run.policy.layout.to_global(batch), jnp.float32(normalizer))
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  counters = metrics_lib.advance(run_state.counters, device_s=time.perf_counter() - update0)
  prefix = stage.paradigm
  out = {f"{prefix}/loss": m["loss"], f"{prefix}/grad_norm": m["grad_norm"], f"{prefix}/loss_tokens": m["loss_tokens"]}
  if iw:
    out.update({f"offline/{k}": m[k] for k in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl")})
    out["offline/truncated_fraction"] = m["clip_fraction"]  # truncated at max_ratio, or cut below the floor
    versions = multihost.host_gather(np.asarray([data.behavior_versions[p] for p in positions], np.float64))
    out["offline/behavior_version_mean"] = float(versions.mean())
    sums = multihost.host_sums({"abs_sum": float(np.abs(np.concatenate(advantages)).sum()) if advantages else 0.0,
                                "turns": float(sum(len(a) for a in advantages))})
    out["offline/advantage_abs_mean"] = float(sums["abs_sum"] / max(sums["turns"], 1.0))  # per turn, all processes
  else:
    out[f"{prefix}/nll"] = m["nll"]
  return dataclasses.replace(run_state, train=state, iteration=run_state.iteration + 1, counters=counters), out


def rft_round(run: Run, run_state: RunState, data: StageData
              ) -> tuple[RunState, dict[str, Any], list[tr.Trajectory]]:
  """One rft round: sample, keep the new verified samples, fine-tune on everything kept so far. Returns the new
  state, the round's metrics and every sample, marked kept or not (for the run's store)."""
  cfg = run.config
  stage = config_lib.stages(cfg)[run_state.stage]
  it, state = run_state.iteration, run_state.train
  supply = run_state.supply
  samples: list[tr.Trajectory] = []
  env_steps = tokens = 0
  rollout_s = 0.0
  for r in range(stage.rollouts):
    state, sampled = rollouts.sample_round(run, state, supply, it, r, kind="rft")
    samples += sampled.trajectories
    stats = sampled.stats
    env_steps, tokens = env_steps + stats.env_steps, tokens + stats.action_tokens
    rollout_s += stats.decode_s + stats.extend_s
  usable = rollouts.trained_rows(run, samples)
  marked = []
  new = 0
  for t, ok in zip(samples, usable):
    kept = bool(ok and t.verifier.passed and _sample_key(t) not in data.seen)
    if kept:
      data.kept.append(t)
      data.seen.add(_sample_key(t))
      new += 1
    marked.append(dataclasses.replace(t, metadata={**t.metadata, RFT_KEY: {"stage": stage.name, "kept": kept}}))
  nll = []
  update0 = time.perf_counter()
  examples = (stored.Examples(data.kept.__getitem__, len(data.kept), seeds.rft_order(cfg.run.seed, it))
              if data.kept else None)
  for u in range(stage.updates):
    # Nothing kept yet (on this process): an empty batch, whose step is skipped when no process has one.
    batch = supervised_batch(run, examples.batch(u, run.rows.bc)[1] if examples is not None else [])
    state, m = run.steps.bc(state, run.policy.layout.to_global(batch), jnp.float32(loss_normalizer(run, batch)))
    nll.append(float(jax.device_get(m["nll"])))
  update_s = time.perf_counter() - update0
  counts = {k: int(v) for k, v in multihost.host_sums({
      "samples": len(samples), "verified": sum(bool(t.verifier.passed) for t in samples), "kept_new": new,
      "kept_total": len(data.kept), "env_steps": env_steps, "action_tokens": tokens}).items()}
  counters = metrics_lib.advance(run_state.counters, env_interactions=counts["env_steps"],
                                 action_tokens=counts["action_tokens"], device_s=rollout_s + update_s)
  out = {**{f"rft/{k}": counts[k] for k in ("samples", "verified", "kept_new", "kept_total")},
         metrics_lib.SUCCESS_RATE: counts["verified"] / max(counts["samples"], 1),
         "rft/nll": float(np.mean(nll)) if nll else 0.0}
  return dataclasses.replace(run_state, train=state, iteration=it + 1, counters=counters), out, marked


def iteration(run: Run, run_state: RunState) -> tuple[RunState, IterationRecord]:
  """One iteration of the current non-rl stage, on its data (built when the stage starts or resumes)."""
  stage = config_lib.stages(run.config)[run_state.stage]
  wall0 = time.perf_counter()
  if run_state.stage_data is None or run_state.stage_data.index != run_state.stage:
    run_state = dataclasses.replace(run_state, stage_data=prepare(run, run_state, run_state.stage))
  stored_samples: list[tr.Trajectory] = []
  if stage.paradigm == "rft":
    run_state, m, stored_samples = rft_round(run, run_state, run_state.stage_data)
  else:
    run_state, m = supervised_iteration(run, run_state, run_state.stage_data)
  return run_state, IterationRecord(stage.paradigm, m, time.perf_counter() - wall0, stored_samples)
