"""Tests for jaxagent.train.metrics: jsonl + TensorBoard logger, plots, Wilson interval, progress, timer."""

import io
import json
import math
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxagent.train import metrics as m


def _read_jsonl(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def _tb_scalars(tb_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
  """Parses every TFRecord event file: returns tag -> [(step, value)] and the purge (session start) steps."""
  scalars: dict[str, list[tuple[int, float]]] = {}
  session_starts = []
  for path in sorted(tb_dir.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      pos += 12  # length + its masked crc32c
      event = event_pb2.Event.FromString(data[pos:pos + length])
      pos += length + 4  # payload + its masked crc32c
      if event.HasField("session_log"):
        session_starts.append(event.step)
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars, session_starts


def test_jsonl_round_trip_converts_numpy_jax_and_nonfinite(tmp_path):
  with m.MetricsLogger(tmp_path, tensorboard=False) as logger:
    logger.log(
        3,
        {
            "reward_mean": np.float32(0.25),
            "loss": jnp.asarray(1.5, jnp.float32),
            "tokens": np.int64(1234),
            "jax_int": jnp.asarray(7, jnp.int32),
            "one_elem": np.array([2.5]),
            "flag": np.bool_(True),
            "plain": 0.125,
            "kl": float("nan"),
            "grad_norm": np.float64("inf"),
        },
        iteration=2,
    )
    logger.log(4, {"reward_mean": 0.5})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2
  assert "NaN" not in lines[0] and "Infinity" not in lines[0]  # strict JSON
  first, second = (json.loads(line) for line in lines)
  assert first["step"] == 3 and first["iteration"] == 2 and isinstance(first["time"], float)
  assert first["reward_mean"] == 0.25 and first["loss"] == 1.5 and first["plain"] == 0.125
  assert first["tokens"] == 1234 and isinstance(first["tokens"], int)
  assert first["jax_int"] == 7 and isinstance(first["jax_int"], int)
  assert first["one_elem"] == 2.5 and first["flag"] == 1
  assert first["kl"] is None and first["grad_norm"] is None
  assert sorted(first["nonfinite"]) == ["grad_norm", "kl"]
  assert second == {"step": 4, "iteration": None, "time": second["time"], "reward_mean": 0.5}


def test_each_line_is_flushed_before_close(tmp_path):
  logger = m.MetricsLogger(tmp_path, tensorboard=False)
  logger.log(1, {"a": 1.0})
  assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["a"] == 1.0
  logger.log(2, {"a": 2.0})
  assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
  logger.close()
  logger.close()  # idempotent


def test_bad_metrics_are_rejected(tmp_path):
  with m.MetricsLogger(tmp_path, tensorboard=False) as logger:
    with pytest.raises(ValueError, match="reserved"):
      logger.log(0, {"step": 1.0})
    with pytest.raises(ValueError, match="not a scalar"):
      logger.log(0, {"v": np.zeros(3)})
    with pytest.raises(TypeError, match="not a real number"):
      logger.log(0, {"v": "high"})
  assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_drops_later_steps_and_appends(tmp_path):
  with m.MetricsLogger(tmp_path, tensorboard=False) as logger:
    for step in range(1, 6):
      logger.log(step, {"reward_mean": step / 10})
  # Crash after step 5; the last checkpoint was step 3.
  with m.MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
    for step in range(4, 7):
      logger.log(step, {"reward_mean": step})
  records = _read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert [r["reward_mean"] for r in records] == [0.1, 0.2, 0.3, 4, 5, 6]
  assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_append_without_resume_step_cuts_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "iteration": null, "time": 0.0, "a": 1.0}\n{"step": 2, "itera')
  with pytest.warns(UserWarning, match="torn"):
    logger = m.MetricsLogger(tmp_path, tensorboard=False)
  with logger:
    logger.log(2, {"a": 2.0})
  assert [(r["step"], r["a"]) for r in _read_jsonl(path)] == [(1, 1.0), (2, 2.0)]


def test_tensorboard_event_file_has_scalars_and_purge_on_resume(tmp_path):
  with m.MetricsLogger(tmp_path) as logger:
    logger.log(1, {"reward_mean": np.float32(0.5), "time/decode_s": 2.0, "kl": float("nan")})
    logger.log(2, {"reward_mean": 0.75})
  tb_dir = tmp_path / "tensorboard"
  assert list(tb_dir.glob("events.out.tfevents.*"))
  scalars, starts = _tb_scalars(tb_dir)
  assert scalars["reward_mean"] == [(1, 0.5), (2, 0.75)]
  assert scalars["time/decode_s"] == [(1, 2.0)]
  assert "kl" not in scalars  # non-finite values are left out of TensorBoard
  assert starts == []

  with m.MetricsLogger(tmp_path, resume_step=1) as logger:
    logger.log(2, {"reward_mean": 0.9})
  scalars, starts = _tb_scalars(tb_dir)
  assert starts == [2]  # TensorBoard hides the crashed run's events from step 2 on
  assert scalars["reward_mean"][-1] == (2, pytest.approx(0.9))


def test_disabled_logger_writes_nothing(tmp_path):
  run_dir = tmp_path / "run"
  with m.MetricsLogger(run_dir, enabled=False) as logger:
    logger.log(1, {"reward_mean": 1.0})
  assert not run_dir.exists()


def _write_lines(path: Path, records: list[dict]) -> None:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plots_for_present_metrics_only(tmp_path):
  records = []
  for i in range(1, 6):
    records.append({
        "step": i, "iteration": i, "time": float(i), "reward_mean": i / 5, "grad_norm": 1.0 / i,
        "entropy": None, "env_interactions": 8 * i, "action_tokens": 100 * i, "device_seconds": 2.0 * i,
        "wall_seconds": 3.0 * i,
    })
  # An eval line logged on its own, without x-axes: it takes the last values seen.
  records.append({"step": 5, "iteration": 5, "time": 5.5, "eval_success_rate": 0.4})
  _write_lines(tmp_path / "metrics.jsonl", records)
  written = m.write_plots(tmp_path)
  assert [p.name for p in written] == ["reward_mean.png", "eval_success_rate.png", "grad_norm.png"]
  for path in written:
    assert path.parent == tmp_path / "plots"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
  assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in written)


def test_plots_survive_empty_missing_partial_and_torn_files(tmp_path):
  assert m.write_plots(tmp_path) == []  # no file
  (tmp_path / "metrics.jsonl").write_text("")
  assert m.write_plots(tmp_path) == []  # empty file
  # A metric present but no x-axis at all: the figure is still drawn, with "no data" panels.
  _write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "iteration": None, "time": 1.0, "kl": 0.1}])
  assert [p.name for p in m.write_plots(tmp_path)] == ["kl.png"]
  # A torn last line (crash mid-write) is skipped with a warning.
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 2, "iteration": null, "time": 2.0, "success_rate": 0.')
  with pytest.warns(UserWarning, match="unreadable"):
    records = m.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [1]
  with pytest.warns(UserWarning, match="unreadable"):
    assert [p.name for p in m.write_plots(tmp_path)] == ["kl.png"]


@pytest.mark.parametrize(
    "successes, n, low, high",
    [
        # Roots of (p̂ - p)² = z² p(1 - p) / n, solved by hand; for 0/n the upper one is z²/(n + z²).
        (0, 10, 0.0, 0.277540),
        (5, 10, 0.236590, 0.763410),
        (10, 10, 0.722460, 1.0),
        (1, 10, 0.017876, 0.404156),
        (50, 100, 0.403830, 0.596170),
    ],
)
def test_wilson_interval_known_values(successes, n, low, high):
  got = m.wilson_interval(successes, n)
  assert got == pytest.approx((low, high), abs=1e-5)


def test_wilson_interval_edges_and_consistency():
  assert m.wilson_interval(0, 0) == (0.0, 1.0)
  with pytest.raises(ValueError):
    m.wilson_interval(11, 10)
  with pytest.raises(ValueError):
    m.wilson_interval(-1, 10)
  # Symmetric under success/failure swap; narrows with n; higher z widens.
  low, high = m.wilson_interval(3, 20)
  assert m.wilson_interval(17, 20) == pytest.approx((1 - high, 1 - low))
  assert np.diff(m.wilson_interval(30, 200)) < np.diff(m.wilson_interval(3, 20))
  assert np.diff(m.wilson_interval(3, 20, z=2.576)) > high - low
  assert math.isclose(sum(m.wilson_interval(5, 10)), 1.0)


def test_progress_shows_postfix_and_disabled_prints_nothing():
  out = io.StringIO()
  bar = m.Progress(total=4, desc="train", enabled=True, file=out)
  bar.update(succ=0.31)
  bar.update(2, reward=0.4213, tokens=812)
  bar.close()
  text = out.getvalue()
  final = text.rsplit("\r", 1)[-1]
  assert "train" in final and "3/4" in final
  assert "reward=0.421," in final and "tokens=812" in final  # floats shortened to 3 digits
  assert "succ" not in final  # each update replaces the postfix
  quiet = io.StringIO()
  with m.Progress(total=4, desc="train", enabled=False, file=quiet) as bar:
    bar.update(reward=1.0)
  assert quiet.getvalue() == ""


def test_progress_does_not_spam_a_non_tty():
  out = io.StringIO()  # not a TTY: redraws at most every 5 s
  with m.Progress(total=1000, desc="x", file=out) as bar:
    for _ in range(1000):
      bar.update(reward=0.1)
  assert out.getvalue().count("\r") <= 4  # first draw (+ maybe one) and the final one


def test_stage_timer_accumulates_and_resets():
  ticks = iter([0.0, 1.0, 10.0, 12.5, 20.0, 20.25, 30.0, 34.0])
  timer = m.StageTimer(clock=lambda: next(ticks))
  with timer("decode"):
    pass
  with timer("env"):
    pass
  with pytest.raises(RuntimeError):
    with timer("decode"):  # a failing stage is still timed
      raise RuntimeError("boom")
  assert timer.pop() == {"time/decode_s": 1.25, "time/env_s": 2.5}
  assert timer.pop() == {}
  with timer("update"):
    pass
  assert timer.pop() == {"time/update_s": 4.0}


def test_stage_timer_real_clock():
  timer = m.StageTimer()
  for _ in range(3):
    with timer("sleep"):
      sum(range(10_000))
  seconds = timer.pop()["time/sleep_s"]
  assert 0.0 < seconds < 5.0


def test_every_paradigm_advances_the_x_axes_by_one_rule():
  start = dict.fromkeys(m.X_AXES, 0)
  one = m.advance(start, env_interactions=np.float64(3), action_tokens=5, device_s=0.5, wall_s=10.0)
  assert start == dict.fromkeys(m.X_AXES, 0)  # a new dict: the loop state's counters are not mutated
  assert one == {m.ENV_INTERACTIONS: 3, m.ACTION_TOKENS: 5, m.DEVICE_SECONDS: 0.5,
                 m.WALL_SECONDS: 10.0}
  assert isinstance(one[m.ENV_INTERACTIONS], int)
  two = m.advance(one, device_s=0.25)
  assert two[m.DEVICE_SECONDS] == 0.75 and two[m.WALL_SECONDS] == 10.0


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_device_memory_reports_the_largest_device_in_gib_and_nothing_where_the_backend_is_silent():
  gib = 2**30
  two = [_Device({"peak_bytes_in_use": 3 * gib, "bytes_in_use": gib}),
         _Device({"peak_bytes_in_use": 5 * gib, "bytes_in_use": gib // 2})]
  assert m.device_memory(two) == {"memory/peak_gib": 5.0, "memory/in_use_gib": 1.0}
  assert m.device_memory([_Device(None)]) == {}   # XLA:CPU reports no memory stats
  assert m.device_memory() == {}                    # this process's (CPU) devices
