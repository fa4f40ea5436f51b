"""Runs an evaluation suite (`jaxagent eval --suite`) against a run's latest checkpoint.

Every condition is the run's own config (production parser, tool permissions, env pool) plus the condition's
overrides (`env.perturb`, `env.max_turns`, `rollout.max_new_tokens`), built with `build_run(purpose="eval")`:
perturbations go through the env pool (envs/perturb.py, in the workers), never into the env under test. Every
condition runs the same held-out tasks with the same env seeds and sampling keys as `jaxagent eval` (the clean
condition *is* `jaxagent eval`), so each task is compared with itself: `lost` counts tasks solved clean and not
here, `gained` the reverse.

Per condition: success (Wilson 95 %), the drop from clean, mean reward, terminations, and cost (action tokens,
tool calls, env seconds, wall seconds; per episode and per solved task). The clean build also runs pass@k /
pass^k (k samples per task, the unbiased estimators of Chen et al. 2021 and tau-bench over the k samples,
j = 1..k) and the env's exploit probes (`EnvSpec.probes`, scripted through the same engine; each must score 0).

Everything lands in `<out>/<suite>.json` (flat `metrics` for gates, and per-condition tables) and the episodes
in `<out>/<suite>/<condition>/` (trajectory shards `jaxagent inspect` reads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

import envs

from jaxagent import config as config_lib
from jaxagent import multihost, seeds
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.evals import report as report_lib
from jaxagent.evals.suite import Condition, Suite
from jaxagent.rollout.actors import ScriptedActions
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import resume
from jaxagent.train.loop import scripted_action
from jaxagent.train.rollouts import over_tasks
from jaxagent.train.run import Run, build_run, held_out_tasks

# Cost sums per condition, in this order (host-summed as one vector).
COST_KEYS = ("action_tokens", "tool_calls", "env_seconds")


@dataclasses.dataclass(frozen=True)
class ConditionResult:
  name: str
  kind: str
  overrides: tuple[str, ...]
  solved: np.ndarray          # [tasks] bool: the task's episode passed its verifier
  reward: float               # mean return
  terminations: dict[str, int]
  cost: dict[str, float]      # sums over the condition's episodes (COST_KEYS)
  wall_s: float               # the condition's rollout wall time
  heldout: tuple[int, int]    # (episodes the held-out verifier scored, of which it passed)
  trajectories: tuple[tr.Trajectory, ...] = dataclasses.field(default=(), repr=False)  # this process's

  @property
  def episodes(self) -> int:
    return len(self.solved)

  @property
  def successes(self) -> int:
    return int(self.solved.sum())

  def summary(self, clean: "ConditionResult | None") -> dict[str, Any]:
    n, k = self.episodes, self.successes
    lo, hi = metrics_lib.wilson_interval(k, n)
    per = max(k, 1)
    out = {"kind": self.kind, "overrides": list(self.overrides), "episodes": n, "successes": k,
           "success": k / n, "ci": [lo, hi], "mean_reward": self.reward, "terminations": self.terminations,
           **{f"{c}_per_episode": v / n for c, v in self.cost.items()},
           **{f"{c}_per_solved": (v / per if k else None) for c, v in self.cost.items()},
           "wall_seconds": self.wall_s, "wall_seconds_per_solved": self.wall_s / per if k else None}
    scored, held = self.heldout
    if scored:  # the proxy-vs-target gap: training verifier passes minus held-out verifier passes, per episode
      # (an episode no verifier scored, e.g. out of turns, fails both)
      out.update(heldout_scored=scored, heldout_success=held / n, proxy_gap=(k - held) / n)
    if clean is not None:
      out.update(drop=(clean.successes - k) / n, lost=int((clean.solved & ~self.solved).sum()),
                 gained=int((~clean.solved & self.solved).sum()))
    return out


def _pass_estimates(counts: np.ndarray, k: int) -> dict[str, float]:
  """pass@j and pass^j for j = 1..k from k samples per task with `counts` successes each (unbiased: 1 - C(k-c,
  j)/C(k,j) and C(c,j)/C(k,j), averaged over tasks)."""
  out = {}
  for j in range(1, k + 1):
    at = np.mean([1.0 - math.comb(k - c, j) / math.comb(k, j) for c in counts])
    hat = np.mean([math.comb(c, j) / math.comb(k, j) for c in counts])
    out[f"pass@{j}"], out[f"pass^{j}"] = float(at), float(hat)
  return out


def _cost(trajectories: Sequence[tr.Trajectory]) -> np.ndarray:
  return np.asarray([[int((t.roles == tr.Role.POLICY).sum()), len(t.turns),
                      sum(turn.t_env_s for turn in t.turns)] for t in trajectories], np.float64).reshape(-1, 3)


def _store(directory: Path | None, trajectories: Sequence[tr.Trajectory]) -> None:
  if directory is None:
    return
  prefix = trajectory_store.shard_prefix(jax.process_index(), jax.process_count())
  if directory.is_dir():  # a suite run again replaces its episodes (they are made again from the checkpoint)
    pattern = trajectory_store.shard_pattern(prefix)
    for old in directory.iterdir():
      if pattern.match(old.name):
        old.unlink()
  with trajectory_store.TrajectoryWriter(directory, prefix=prefix) as writer:
    for t in trajectories:
      writer.write(t)


def run_condition(run: Run, state, condition: Condition, suite: Suite, tasks: Sequence, overrides: Sequence[str],
                  store: Path | None) -> tuple[Any, ConditionResult]:
  """The held-out episodes of one condition (the same tasks, env seeds and sampling keys as `jaxagent eval`)."""
  cfg = run.config
  start = time.perf_counter()
  state, done = over_tasks(run, state, tasks, samples=1, evaluation=True,
                           env_seeds=lambda s, rows: seeds.eval_episodes(cfg.run.seed, suite.split, s, rows),
                           rng_seed=lambda s: seeds.eval_rng(cfg.run.seed, s))
  wall = time.perf_counter() - start
  trajectories = [t for _, (t,) in done]
  solved = np.zeros(len(tasks), np.int64)
  names = [t.value for t in envs.Termination]
  terms = np.zeros(len(names), np.int64)
  for index, (t,) in done:
    solved[index] = bool(t.verifier.passed)
    terms[names.index(t.termination.value)] += 1
  cost = _cost(trajectories).sum(0)
  reward = sum(t.reward.total for t in trajectories)
  verdicts = [report_lib.heldout_verdict(t) for t in trajectories]
  heldout = np.asarray([sum(v is not None for v in verdicts), sum(bool(v) for v in verdicts)], np.int64)
  total = multihost.host_sums(dict(solved=solved, terms=terms, cost=cost, reward=np.float64(reward),
                                   heldout=heldout))
  _store(store, trajectories)
  return state, ConditionResult(
      condition.name, condition.kind, tuple(overrides), total["solved"] > 0, float(total["reward"]) / len(tasks),
      {n: int(c) for n, c in zip(names, total["terms"]) if c}, dict(zip(COST_KEYS, map(float, total["cost"]))),
      wall, tuple(int(x) for x in total["heldout"]), tuple(trajectories))


def run_pass_k(run: Run, state, suite: Suite, tasks: Sequence) -> tuple[Any, dict[str, Any]]:
  """k samples of each of the first `suite.pass_k_tasks` tasks (evaluation temperature)."""
  cfg, k = run.config, suite.pass_k
  if run.rows.local % k:
    raise config_lib.ConfigError(f"pass_k.k={k}: must divide the run's {run.rows.local} rollout rows per process "
                                 "(train.tasks_per_iteration x train.group_size)")
  tasks = list(tasks[:suite.pass_k_tasks])
  state, done = over_tasks(run, state, tasks, samples=k, evaluation=True,
                           env_seeds=lambda s, rows: seeds.pass_k(cfg.run.seed, suite.split, s, rows),
                           rng_seed=lambda s: seeds.pass_k_rng(cfg.run.seed, s))
  counts = np.zeros(len(tasks), np.int64)
  for index, trajs in done:
    counts[index] = sum(bool(t.verifier.passed) for t in trajs)
  counts = np.asarray(multihost.host_sum(counts), np.int64)
  return state, {"k": k, "tasks": len(tasks), "successes_per_task": np.bincount(counts, minlength=k + 1).tolist(),
                 **_pass_estimates(counts, k)}


def run_probes(run: Run, suite: Suite, tasks: Sequence) -> dict[str, Any]:
  """The env's exploit probes (`EnvSpec.probes`) on the first `suite.probe_tasks` tasks, scripted through the
  run's engine and pool (the production parser, tool permissions and verifier). Each probe must score 0."""
  spec, cfg = run.interface.env_spec, run.config
  if spec.probes is None or not suite.probe_tasks:
    return {"defined": [] if spec.probes is None else sorted(spec.probes(tasks[0], 0)), "runs": 0, "passed": 0,
            "by_probe": {}}

  tasks = list(tasks[:suite.probe_tasks])
  env_seeds = seeds.eval_episodes(cfg.run.seed, suite.split, 0, range(len(tasks)))
  episodes = [(name, task, seed, actions) for task, seed in zip(tasks, env_seeds)
              for name, actions in sorted(spec.probes(task, seed).items())]
  by_probe: dict[str, dict[str, Any]] = {}
  for start in range(0, len(episodes), run.rows.local):
    chunk = episodes[start:start + run.rows.local]
    scripts = [[run.interface.chat.action_tokens(scripted_action(run, a)) for a in actions] for *_, actions in chunk]
    trajs, _ = run.rollout.engine.run(ScriptedActions(scripts, cfg.rollout.max_context),
                                      [task for _, task, *_ in chunk], [seed for _, _, seed, _ in chunk],
                                      group_size=1, policy_version=-1)
    for (name, task, _, actions), t in zip(chunk, trajs):
      row = by_probe.setdefault(name, {"runs": 0, "passed": 0, "max_reward": 0.0, "examples": []})
      row["runs"] += 1
      won = bool(t.verifier.passed) or t.reward.total > 0
      row["passed"] += won
      row["max_reward"] = max(row["max_reward"], float(t.reward.total))
      if won and len(row["examples"]) < 3:
        row["examples"].append({"task": task.id, "actions": list(actions), "evidence": t.verifier.evidence})
  return {"defined": sorted(by_probe), "runs": sum(r["runs"] for r in by_probe.values()),
          "passed": sum(r["passed"] for r in by_probe.values()), "by_probe": by_probe}


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
  """The numbers a gate can name: `<condition>.<success|drop|lost|gained|mean_reward|..._per_solved>`,
  `pass@j`, `pass^j`, `probes.passed`, `probes.<name>`."""
  out: dict[str, float] = {}
  for name, row in report["conditions"].items():
    for key, value in row.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        out[f"{name}.{key}"] = float(value)
  for key, value in (report.get("pass_k") or {}).items():
    if key.startswith("pass"):
      out[key] = float(value)
  probes = report.get("probes") or {}
  out["probes.passed"] = float(probes.get("passed", 0))
  for name, row in (probes.get("by_probe") or {}).items():
    out[f"probes.{name}"] = float(row["passed"])
  return out


def run_suite(run_dir: Path | str, suite: Suite, overrides: Sequence[str] = (), *, out: Path | str | None = None,
              echo: bool = True) -> dict[str, Any]:
  """Runs `suite` against the latest checkpoint of the run in `run_dir`; writes and returns the report."""
  run_dir = resume.run_directory(run_dir)
  saved = run_dir / "config.yaml"
  out = Path(out) if out is not None else run_dir / "evals"
  base = config_lib.load(saved, list(overrides))
  probe_env = envs.get(base.env.name).make(max_turns=base.env.max_turns)
  tools = tuple(t.name for t in probe_env.parser.tools)
  probe_env.close()
  say = print if echo and jax.process_index() == 0 else (lambda *a, **k: None)
  results: dict[str, ConditionResult] = {}
  report: dict[str, Any] = {"suite": suite.name, "run": str(run_dir), "split": suite.split,
                            "episodes": suite.episodes}
  # clean first: the other conditions are compared with it, and its build runs pass^k and the probes
  ordered = sorted(suite.conditions, key=lambda c: c.name != "clean")
  for condition in ordered:
    extra = condition.overrides(base, tools)
    run = build_run(config_lib.load(saved, list(overrides) + extra + ["env.score_heldout=true"]), run_dir,
                    purpose="eval", echo=False)
    try:
      run_state, meta = resume.restore(run)
      report.setdefault("checkpoint_step", int(run_state.train.step))
      report.setdefault("policy_version", int(run_state.train.policy_version))
      tasks = held_out_tasks(run.config, run.interface.env_spec, suite.split, suite.episodes)
      say(f"[{suite.name}] {condition.name} ({condition.kind}{': ' + ' '.join(extra) if extra else ''}): "
          f"{len(tasks)} episodes", flush=True)
      state, result = run_condition(run, run_state.train, condition, suite, tasks, extra,
                                    out / suite.name / condition.name)
      results[condition.name] = result
      if condition.name == "clean":
        if suite.pass_k:
          say(f"[{suite.name}] pass^k: k={suite.pass_k} on {min(suite.pass_k_tasks, len(tasks))} tasks",
              flush=True)
          state, report["pass_k"] = run_pass_k(run, state, suite, tasks)
        say(f"[{suite.name}] exploit probes", flush=True)
        report["probes"] = run_probes(run, suite, tasks)
    finally:
      run.close()
    row = result.summary(results.get("clean") if condition.name != "clean" else None)
    report.setdefault("conditions", {})[condition.name] = row
    say(f"  success {row['success']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]"
        + (f", drop {row['drop']:+.3f} (lost {row['lost']}, gained {row['gained']})" if "drop" in row else "")
        + f", terminations {row['terminations']}", flush=True)
  report["metrics"] = flat_metrics(report)
  if jax.process_index() == 0:
    out.mkdir(parents=True, exist_ok=True)
    failures = report_lib.find(results)
    page = report_lib.write(out / f"{suite.name}-failures.html", report, failures)
    report["failures"] = {"html": str(page), **{k: sum(f.kind == k for f in failures) for k in report_lib.KINDS}}
    (out / f"{suite.name}.json").write_text(json.dumps(report, indent=1, default=_jsonable))
  return report


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON-able")


def table(report: dict[str, Any]) -> str:
  """The report as the console shows it: a row per condition, then pass^k, probes and cost."""
  lines = [f"suite {report['suite']} on {report['run']} (step {report.get('checkpoint_step')}, "
           f"{report['split']} split, {report['episodes']} episodes per condition)",
           f"{'condition':<22}{'kind':<14}{'success':>9}{'95% CI':>17}{'drop':>8}{'lost':>6}{'gained':>7}"
           f"{'tokens/solved':>15}{'calls/solved':>13}{'s/solved':>10}  terminations"]
  for name, r in report["conditions"].items():
    ci = f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines.append(f"{name:<22}{r['kind']:<14}{r['success']:>9.3f}{ci:>17}{fmt(r.get('drop'), '+.3f'):>8}"
                 f"{fmt(r.get('lost'), 'd'):>6}{fmt(r.get('gained'), 'd'):>7}"
                 f"{fmt(r['action_tokens_per_solved'], '.1f'):>15}{fmt(r['tool_calls_per_solved'], '.2f'):>13}"
                 f"{fmt(r['wall_seconds_per_solved'], '.3f'):>10}  "
                 + ", ".join(f"{k} {v}" for k, v in sorted(r["terminations"].items(), key=lambda kv: -kv[1])))
  pk = report.get("pass_k")
  if pk:
    k = pk["k"]
    lines.append(f"pass@k / pass^k over {pk['tasks']} tasks x {k} samples: "
                 + "  ".join(f"pass@{j} {pk[f'pass@{j}']:.3f} pass^{j} {pk[f'pass^{j}']:.3f}" for j in range(1, k + 1)))
  held = [(n, r) for n, r in report["conditions"].items() if r.get("heldout_scored")]
  if held:
    lines.append("held-out verifier: " + ", ".join(
        f"{n} {r['heldout_success']:.3f} (proxy gap {r['proxy_gap']:+.3f})"
        for n, r in held))
  probes = report.get("probes") or {}
  if probes.get("runs"):
    lines.append(f"exploit probes: {probes['passed']} of {probes['runs']} scored > 0 ("
                 + ", ".join(f"{n} {r['passed']}/{r['runs']}" for n, r in probes["by_probe"].items()) + ")")
  else:
    lines.append("exploit probes: none defined by this env" if not probes.get("defined") else "exploit probes: off")
  failures = report.get("failures")
  if failures:
    lines.append("high-reward failures to read: " + ", ".join(f"{k} {failures[k]}" for k in report_lib.KINDS)
                 + f" ({failures['html']})")
  return "\n".join(lines)
