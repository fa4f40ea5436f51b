"""Run metrics: a jsonl + TensorBoard logger, learning-curve plots, Wilson intervals, progress bar, stage timer.

Layout under a run directory:
    metrics.jsonl          one JSON object per `MetricsLogger.log` call (the source of truth)
    tensorboard/           TensorBoard event files (scalars only), written with tensorboardX
    plots/<metric>.png     learning curves from `write_plots`

Each jsonl line is `{"step": int, "iteration": int | null, "time": unix seconds, <flat metrics>}`, plus
`"nonfinite": [keys]` when a value was NaN/Inf (stored as null, since JSON has no NaN). Every line is flushed
as soon as it is written, so a crashed run keeps all lines but at most a torn last one, which readers skip.

Learning curves are drawn against the four x-axes of docs/design.md §2.11, which the loop logs as cumulative metrics
on every line: `env_interactions`, `action_tokens`, `device_seconds`, `wall_seconds`.

Only one process of a multi-host job should write: build the logger with `enabled=jax.process_index() == 0`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"
# Keys the logger owns in every line; a metric may not use them.
RESERVED_KEYS = frozenset({"step", "iteration", "time", "nonfinite"})
# Metric names, defined once: the loop writes them, the plots and tests read them.
REWARD_MEAN = "reward_mean"                                     # first-round sample of an iteration
SUCCESS_RATE = "success_rate"
EVAL_SUCCESS_RATE = "eval_success_rate"                         # held-out split
EVAL_SECONDS = "time/eval_s"                                    # wall time of that evaluation
BC_SECONDS = "time/bc_s"                                        # of a behavior-cloning stage (its last line)
ITERATION_SECONDS = "time/iteration_s"                          # of an RL (or sft/rft/offline) iteration
REWARD_STD_WITHIN_GROUP = "reward_std_within_group"             # the advantage estimator's groups
ZERO_VARIANCE_GROUP_FRACTION = "zero_variance_group_fraction"
EXCLUDED_TRAJECTORIES = "excluded_trajectories"                 # infrastructure failures, never trained
TOKENS_COMPUTED = "update/tokens_computed"                      # what the update's model ran on (shared once)
TOKENS_UNSHARED = "update/tokens_unshared"                      # the batch's tokens, each trajectory's own
HISTORY_REWRITTEN = "episodes/history_rewritten"                # an agent's history broke the record (gateway)
ENV_INTERACTIONS, ACTION_TOKENS, DEVICE_SECONDS, WALL_SECONDS = (
    "env_interactions", "action_tokens", "device_seconds", "wall_seconds")
# Cumulative x-axes of docs/design.md §2.11, in subplot order.
X_AXES = (ENV_INTERACTIONS, ACTION_TOKENS, DEVICE_SECONDS, WALL_SECONDS)


def advance(counters: Mapping[str, float], *, env_interactions: int = 0, action_tokens: int = 0,
            device_s: float = 0.0, wall_s: float | None = None) -> dict[str, float]:
  """The x-axes after one iteration, the one rule every paradigm counts by: env interactions and action tokens
  summed over processes (the caller's collective); device seconds of this process's rollout decode + extend and
  optimizer updates (the seconds the policy's devices were busy); wall seconds since the run began (a resumed
  run continues its count), or unchanged when None."""
  out = dict(counters)
  out[ENV_INTERACTIONS] += int(env_interactions)
  out[ACTION_TOKENS] += int(action_tokens)
  out[DEVICE_SECONDS] += device_s
  if wall_s is not None:
    out[WALL_SECONDS] = wall_s
  return out
# Metrics that get a learning-curve figure when present.
Y_METRICS = (REWARD_MEAN, SUCCESS_RATE, EVAL_SUCCESS_RATE, "grad_norm", "entropy", "kl", "approx_kl",
             ZERO_VARIANCE_GROUP_FRACTION, REWARD_STD_WITHIN_GROUP)


def device_memory(devices=None) -> dict[str, float]:
  """`memory/peak_gib` and `memory/in_use_gib`: the most any of this process's devices has held since it
  started, and holds now (GiB), where the backend reports it (GPU, TPU); {} where it does not (CPU)."""
  stats = [d.memory_stats() for d in (devices if devices is not None else _local_devices())]
  stats = [s for s in stats if s]
  if not stats:
    return {}
  return {"memory/peak_gib": max(s.get("peak_bytes_in_use", 0) for s in stats) / 2**30,
          "memory/in_use_gib": max(s.get("bytes_in_use", 0) for s in stats) / 2**30}


def _local_devices():
  import jax  # this module stays importable without initializing jax
  return jax.local_devices()


def to_python_scalar(name: str, value: Any) -> int | float:
  """Converts a Python, numpy or jax scalar (or a one-element array) to a Python int or float.

  Args:
    name: the metric name, for error messages.
    value: the value to convert; bools become ints.

  Returns:
    A Python `int` for integer and boolean values, otherwise a Python `float`.

  Raises:
    ValueError: the value has more than one element.
    TypeError: the value is not a real number (a string, complex, None, ...).
  """
  if isinstance(value, bool):
    return int(value)
  if isinstance(value, int | float):
    return value
  array = np.asarray(value)  # Also fetches a jax.Array from its device.
  if array.size != 1:
    raise ValueError(f"metric {name!r} is not a scalar: shape {array.shape}")
  item = array.reshape(()).item()
  if isinstance(item, bool):
    return int(item)
  if isinstance(item, int | float):
    return item
  raise TypeError(f"metric {name!r} is not a real number: {type(value).__name__}")


def read_metrics(path: Path) -> list[dict[str, Any]]:
  """Reads a metrics.jsonl file, skipping (with a warning) lines that are torn or not JSON objects.

  Args:
    path: the jsonl file; a missing file reads as empty.

  Returns:
    The records in file order.
  """
  path = Path(path)
  if not path.exists():
    return []
  records = []
  with path.open("rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError):
        record = None
      if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        warnings.warn(f"{path}:{number}: skipping unreadable metrics line (torn by a crash?)", stacklevel=2)
        continue
      records.append(record)
  return records


class MetricsLogger:
  """Appends one JSON line per `log` call to `run_dir/metrics.jsonl` and mirrors scalars to TensorBoard.

  On resume pass the checkpoint's step as `resume_step`: lines with a larger step (logged after that
  checkpoint by the crashed run) are dropped from the jsonl, and TensorBoard is told to purge them, so the
  resumed run has no duplicate steps. Without `resume_step` an existing file is appended to as is (a torn
  last line is cut off first, so it cannot swallow the next line).

  Usage:
    with MetricsLogger(run_dir, enabled=jax.process_index() == 0, resume_step=step) as logger:
      logger.log(step, {"reward_mean": r, "env_interactions": n}, iteration=it)
  """

  def __init__(
      self,
      run_dir: Path,
      *,
      enabled: bool = True,
      tensorboard: bool = True,
      resume_step: int | None = None,
  ):
    """Opens the jsonl file (and TensorBoard writer) for appending.

    Args:
      run_dir: the run directory; created if missing.
      enabled: False on non-zero processes of a multi-host job: nothing is created or written.
      tensorboard: also write TensorBoard event files under `run_dir/tensorboard/`.
      resume_step: the step the run resumes from; existing lines with a larger step are dropped.
    """
    self.run_dir = Path(run_dir)
    self.path = self.run_dir / METRICS_FILE
    self.enabled = enabled
    self._file: TextIO | None = None
    self._tb = None
    if not enabled:
      return
    self.run_dir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      _prepare_for_append(self.path, resume_step)
    self._file = self.path.open("a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter

      # purge_step makes TensorBoard hide events at or after it that an earlier (crashed) run wrote.
      purge_step = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_step, flush_secs=30)

  def log(self, step: int, metrics: Mapping[str, Any], *, iteration: int | None = None) -> None:
    """Writes one line (and the finite scalars to TensorBoard), then flushes.

    Args:
      step: the optimizer step this line belongs to.
      metrics: flat name -> scalar (Python, numpy or jax; one element).
      iteration: the loop iteration, when it differs from the step.

    Raises:
      ValueError: a metric uses a reserved key or is not a scalar.
      TypeError: a value is not a real number.
    """
    if not self.enabled:
      return
    if self._file is None:
      raise RuntimeError("MetricsLogger.log after close()")
    record: dict[str, Any] = {
        "step": int(step),
        "iteration": None if iteration is None else int(iteration),
        "time": time.time(),
    }
    nonfinite = []
    for name, value in metrics.items():
      if name in RESERVED_KEYS:
        raise ValueError(f"metric name {name!r} is reserved by the logger")
      value = to_python_scalar(name, value)
      if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(name)
        value = None
      record[name] = value
    if nonfinite:
      record["nonfinite"] = nonfinite
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in record.items():
        if name not in RESERVED_KEYS and value is not None:
          self._tb.add_scalar(name, value, global_step=record["step"], walltime=record["time"])
      self._tb.flush()

  def close(self) -> None:
    """Closes the files; idempotent."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _prepare_for_append(path: Path, resume_step: int | None) -> None:
  """Makes an existing jsonl safe to append to: drops lines past `resume_step` and any torn last line."""
  data = path.read_bytes()
  if resume_step is None:
    if data and not data.endswith(b"\n"):
      warnings.warn(f"{path}: dropping a torn last line before appending", stacklevel=3)
      cut = data.rfind(b"\n") + 1
      with path.open("r+b") as f:
        f.truncate(cut)
    return
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Torn lines are dropped here on purpose.
    kept = [r for r in read_metrics(path) if r["step"] <= resume_step]
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w", encoding="utf-8") as f:
    for record in kept:
      f.write(json.dumps(record, allow_nan=False) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)  # Atomic: a crash here leaves either the old or the new file.


def write_plots(run_dir: Path) -> list[Path]:
  """Draws learning curves from `run_dir/metrics.jsonl` into `run_dir/plots/<metric>.png`.

  One figure per metric of `Y_METRICS` that has a finite value somewhere, with one subplot per x-axis of
  `X_AXES`. Lines that lack an x-axis value (e.g. eval lines logged on their own) take the last value seen
  before them, since the x-axes are cumulative. Missing metrics are skipped; an empty, missing or partial
  file never raises.

  Args:
    run_dir: the run directory.

  Returns:
    The PNG files written, in `Y_METRICS` order.
  """
  run_dir = Path(run_dir)
  records = read_metrics(run_dir / METRICS_FILE)
  written = []
  for metric in Y_METRICS:
    rows = curve(records, metric)
    if not rows:
      continue
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{metric}.png"
    plot_metric(metric, {"": rows}, path)
    written.append(path)
  return written


def _is_number(value: Any) -> bool:
  return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _forward_fill(records: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, float]]:
  last: dict[str, float] = {}
  filled = []
  for record in records:
    for key in keys:
      if _is_number(record.get(key)):
        last[key] = record[key]
    filled.append(dict(last))
  return filled


def curve(records: list[dict[str, Any]], metric: str) -> list[tuple[dict[str, float], float]]:
  """(x-axes, value) of every line of `records` with a finite `metric`, the x-axes forward-filled (a line
  without them, e.g. an eval logged on its own, takes the last seen: they are cumulative)."""
  return [(x, r[metric]) for x, r in zip(_forward_fill(records, X_AXES), records) if _is_number(r.get(metric))]


def plot_metric(metric: str, series: Mapping[str, list[tuple[dict[str, float], float]]], path: Path) -> None:
  """Writes one figure (a subplot per x-axis, a line per series; a legend when they are named) atomically to
  `path`."""
  # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display needed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(16, 3.6), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(X_AXES), sharey=True)
  for ax, x_key in zip(axes, X_AXES):
    drawn = 0
    for label, rows in series.items():
      points = sorted((x[x_key], y) for x, y in rows if x_key in x)
      if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="." if len(points) < 50 else None, linewidth=1.2, label=label or None)
        drawn += 1
    if not drawn:
      ax.text(0.5, 0.5, f"no {x_key} logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(x_key)
    ax.grid(True, alpha=0.3)
  if any(series):
    axes[0].legend(fontsize="small")
  axes[0].set_ylabel(metric)
  fig.suptitle(metric)
  tmp = path.with_name(path.stem + ".tmp.png")
  fig.savefig(tmp, dpi=90)
  os.replace(tmp, path)  # A reader polling the plots never sees a half-written PNG.


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval for a binomial proportion (95% for the default z).

  Args:
    successes: number of successes, 0 <= successes <= n.
    n: number of trials.
    z: the standard-normal quantile of the confidence level.

  Returns:
    (low, high) within [0, 1]; (0.0, 1.0) when n == 0.

  Raises:
    ValueError: successes is outside [0, n].
  """
  if n < 0 or not 0 <= successes <= n:
    raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
  if n == 0:
    return 0.0, 1.0
  p = successes / n
  denominator = 1.0 + z * z / n
  center = (p + z * z / (2 * n)) / denominator
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
  return max(0.0, center - half), min(1.0, center + half)


class Progress:
  """A console progress bar (tqdm) with a short postfix such as `reward=0.42 succ=0.31`.

  When the output is not a terminal (a log file under SLURM, say) it redraws at most every 5 s.
  """

  def __init__(self, total: int, desc: str, enabled: bool = True, *, file: TextIO | None = None):
    """Creates the bar.

    Args:
      total: the number of units (iterations) expected.
      desc: the label in front of the bar.
      enabled: False prints nothing (non-zero processes, quiet runs).
      file: the stream to draw on; stderr by default.
    """
    from tqdm import tqdm

    stream = sys.stderr if file is None else file
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    self._bar = tqdm(
        total=total,
        desc=desc,
        disable=not enabled,
        file=stream,
        dynamic_ncols=True,
        mininterval=0.5 if is_tty else 5.0,
        leave=True,
    )

  def update(self, n: int = 1, **postfix: Any) -> None:
    """Advances by `n` and replaces the postfix; floats are shown with 3 significant digits.

    Args:
      n: units completed.
      **postfix: name -> value shown after the bar.
    """
    if postfix:
      shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in postfix.items()}
      self._bar.set_postfix(shown, refresh=False)
    self._bar.update(n)

  def write(self, line: str) -> None:
    """Prints a line to stdout above the bar without breaking it (nothing where the bar is disabled)."""
    if not self._bar.disable:
      self._bar.write(line, file=sys.stdout)

  def close(self) -> None:
    """Draws the final state and releases the bar."""
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


class StageTimer:
  """Accumulates wall seconds per named stage: `with timer("decode"): ...`; `pop()` reads and resets.

  A stage that raises is still timed. Stages may nest under different names (an outer stage includes the
  inner one's time).
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    """Creates an empty timer.

    Args:
      clock: seconds since an arbitrary origin; injectable for tests.
    """
    self._clock = clock
    self._seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, stage: str) -> Iterator[None]:
    start = self._clock()
    try:
      yield
    finally:
      self._seconds[stage] = self._seconds.get(stage, 0.0) + (self._clock() - start)

  def pop(self) -> dict[str, float]:
    """Returns `{"time/<stage>_s": seconds}` accumulated since the last pop, and resets.

    Returns:
      Seconds per stage, keyed for `MetricsLogger.log`.
    """
    out = {f"time/{stage}_s": seconds for stage, seconds in self._seconds.items()}
    self._seconds = {}
    return out
