"""`jaxagent compare RUN RUN ...`: learning curves of several runs in one PNG, and a table of their final evals.

The PNG has a row per metric (held-out success, train success, mean reward by default) and a column per x-axis
of docs/design.md §2.11 (env interactions, action tokens, device seconds, wall time): runs are compared at
equal cost, not only at equal iterations. The table gives each run's final held-out success with its Wilson
interval (the run's `train.eval_episodes`), its cost at the end on the four axes, and the clean success and
exploit-probe count of every evaluation suite found under `RUN/evals/`. A second table (`gain_table`) gives what
RL added to the cold start: the first held-out eval against the last, whether their intervals are apart, the
zero-variance group fraction of each iteration (sampled, and trained after dynamic sampling) and the wall time
of each stage (behavior cloning, the evals, the RL iterations).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import yaml

from jaxagent.config import ConfigError
from jaxagent.train import metrics as metrics_lib

DEFAULT_METRICS = (metrics_lib.EVAL_SUCCESS_RATE, metrics_lib.SUCCESS_RATE, metrics_lib.REWARD_MEAN)
TRAINED_FLAT = "dynamic_sampling/zero_variance_groups_trained"  # flat groups left after the refills


def labels(run_dirs: Sequence[Path]) -> list[str]:
  """Each run's name, with as many parent directories as it takes to tell every run apart."""
  parts = [r.resolve().parts for r in run_dirs]
  for depth in range(1, max(len(p) for p in parts) + 1):
    names = ["/".join(p[-depth:]) for p in parts]
    if len(set(names)) == len(names):
      return names
  raise ConfigError(f"the same run directory is given twice: {[str(r) for r in run_dirs]}")


def summary(run_dir: Path) -> dict[str, Any]:
  """One run's row of the table."""
  records = metrics_lib.read_metrics(run_dir / metrics_lib.METRICS_FILE)
  config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
  n = int(((config or {}).get("train") or {}).get("eval_episodes") or 0)
  evals = [r for r in records if isinstance(r.get(metrics_lib.EVAL_SUCCESS_RATE), (int, float))]
  last = {}
  for r in records:
    last.update({k: r[k] for k in metrics_lib.X_AXES if isinstance(r.get(k), (int, float))})
  row: dict[str, Any] = {"iterations": max((r["iteration"] for r in records if isinstance(r.get("iteration"), int)),
                                          default=0), **last}
  if evals:
    rate = float(evals[-1][metrics_lib.EVAL_SUCCESS_RATE])
    row["eval_success"] = rate
    if n:
      row["eval_ci"] = list(metrics_lib.wilson_interval(round(rate * n), n))
      row["eval_episodes"] = n
  if len(evals) > 1:  # the first held-out eval (after the cold start) against the last
    rate = float(evals[0][metrics_lib.EVAL_SUCCESS_RATE])
    row["start_success"] = rate
    if n:
      row["start_ci"] = list(metrics_lib.wilson_interval(round(rate * n), n))
      row["separated"] = row["start_ci"][1] < row["eval_ci"][0] or row["eval_ci"][1] < row["start_ci"][0]
  groups = int(((config or {}).get("train") or {}).get("tasks_per_iteration") or 0)
  rl = [r for r in records if isinstance(r.get(metrics_lib.ZERO_VARIANCE_GROUP_FRACTION), (int, float))]
  if rl:
    row["zero_variance"] = [float(r[metrics_lib.ZERO_VARIANCE_GROUP_FRACTION]) for r in rl]
    if groups and all(isinstance(r.get(TRAINED_FLAT), int) for r in rl):
      row["zero_variance_trained"] = [r[TRAINED_FLAT] / groups for r in rl]
  stages = {"bc": sum(float(r[metrics_lib.BC_SECONDS]) for r in records if metrics_lib.BC_SECONDS in r),
            "eval": [float(r[metrics_lib.EVAL_SECONDS]) for r in evals if metrics_lib.EVAL_SECONDS in r],
            "iterations": sum(float(r[metrics_lib.ITERATION_SECONDS]) for r in records
                              if metrics_lib.ITERATION_SECONDS in r)}
  row["stage_s"] = {k: v for k, v in stages.items() if v}
  for path in sorted((run_dir / "evals").glob("*.json")):
    try:
      report = json.loads(path.read_text())
      clean = report["conditions"]["clean"]
    except (ValueError, KeyError, TypeError):
      continue
    row.setdefault("suites", {})[report.get("suite", path.stem)] = {
        "clean_success": clean["success"], "ci": clean["ci"], "probes_passed": report.get("metrics", {}).get(
            "probes.passed")}
  return row


def compare(run_dirs: Sequence[Path | str], out: Path | str, metrics: Sequence[str] = DEFAULT_METRICS
            ) -> dict[str, Any]:
  """Writes the PNG to `out` and returns {label: summary row}."""
  runs = [Path(r) for r in run_dirs]
  for r in runs:
    if not (r / metrics_lib.METRICS_FILE).is_file():
      raise ConfigError(f"{r}: not a run directory (no {metrics_lib.METRICS_FILE})")
  names = labels(runs)
  records = {label: metrics_lib.read_metrics(r / metrics_lib.METRICS_FILE) for label, r in zip(names, runs)}
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(16, 3.2 * len(metrics)), layout="constrained")
  FigureCanvasAgg(fig)
  grid = fig.subplots(len(metrics), len(metrics_lib.X_AXES), squeeze=False)
  for row, metric in zip(grid, metrics):
    for ax, x_key in zip(row, metrics_lib.X_AXES):
      for label in names:
        points = sorted((x[x_key], y) for x, y in metrics_lib.curve(records[label], metric) if x_key in x)
        if points:
          xs, ys = zip(*points)
          ax.plot(xs, ys, marker="." if len(points) < 50 else None, linewidth=1.2, label=label)
      ax.set_xlabel(x_key)
      ax.grid(True, alpha=0.3)
    row[0].set_ylabel(metric)
  grid[0][0].legend(fontsize="small")
  out = Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(out.stem + ".tmp.png")
  fig.savefig(tmp, dpi=80)
  os.replace(tmp, out)
  return {label: summary(r) for label, r in zip(names, runs)}


def table(rows: dict[str, dict[str, Any]]) -> str:
  width = max(12, *(len(k) for k in rows)) + 2
  lines = [f"{'run':<{width}}{'iters':>6}{'held-out success':>18}{'95% CI':>17}{'env inter.':>12}"
           f"{'action tok.':>12}{'device s':>10}{'wall s':>9}  suites (clean success, probes passed)"]
  for label, r in rows.items():
    ci = f"[{r['eval_ci'][0]:.3f}, {r['eval_ci'][1]:.3f}]" if "eval_ci" in r else "-"
    success = f"{r['eval_success']:.3f}" if "eval_success" in r else "-"
    num = lambda k, spec: format(r[k], spec) if k in r else "-"  # noqa: E731
    suites = ", ".join(f"{n}: {s['clean_success']:.3f} / {s['probes_passed']:g}"
                       for n, s in (r.get("suites") or {}).items()) or "-"
    lines.append(f"{label:<{width}}{r['iterations']:>6}{success:>18}{ci:>17}"
                 f"{num(metrics_lib.ENV_INTERACTIONS, ',.0f'):>12}{num(metrics_lib.ACTION_TOKENS, ',.0f'):>12}"
                 f"{num(metrics_lib.DEVICE_SECONDS, '.0f'):>10}{num(metrics_lib.WALL_SECONDS, '.0f'):>9}  {suites}")
  return "\n".join(lines)


def gain_table(rows: dict[str, dict[str, Any]]) -> str:
  """What RL added to the cold start, a line per run with at least two held-out evals (else nothing)."""
  pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
  ci = lambda c: f"[{100 * c[0]:.1f}, {100 * c[1]:.1f}]" if c else ""  # noqa: E731
  lines = []
  for label, r in rows.items():
    if "start_success" not in r:
      continue
    zv = ", ".join(f"{x:.2f}" for x in r.get("zero_variance", ())) or "-"
    trained = ", ".join(f"{x:.2f}" for x in r.get("zero_variance_trained", ()))
    stage = r.get("stage_s", {})
    times = []
    if "bc" in stage:
      times.append(f"bc {stage['bc']:.0f} s")
    if "eval" in stage:
      times.append(f"evals {' + '.join(f'{x:.0f}' for x in stage['eval'])} s")
    if "iterations" in stage:
      times.append(f"rl {stage['iterations']:.0f} s")
    apart = {True: "apart", False: "overlap"}.get(r.get("separated"), "-")
    lines.append(f"{label}: held-out {pct(r['start_success'])} {ci(r.get('start_ci'))} -> "
                 f"{pct(r['eval_success'])} {ci(r.get('eval_ci'))} ({apart}); zero-variance groups per "
                 f"iteration sampled {zv}" + (f", trained {trained}" if trained else "")
                 + f"; {', '.join(times) or 'no stage times'}")
  return "\n".join(lines)
