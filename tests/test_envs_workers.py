"""Worker protocol and pools under injected faults. Every test is bounded in time by the pool's timeouts."""

import dataclasses
import os
import signal
import socket
import struct
import time
import typing

import pytest

import envs
from envs import _protocol as P
from envs import pool as pool_lib
from envs.pool import (PoolConfig, RemoteError, WorkerConfig, WorkerCrashed, WorkerTimeout, make_pool,
                       reset_termination)

FAULTS = envs.get("faults")
V = P.PROTOCOL_VERSION


def _kill_worker(p, index):
  """SIGKILL a worker and wait (bounded) until its connection has seen it die."""
  os.killpg(p.worker_pids()[index], signal.SIGKILL)
  deadline = time.monotonic() + 10
  while not p.workers[index].conn.closed:
    assert time.monotonic() < deadline, "killed worker's connection never closed"
    time.sleep(0.01)


def _pool(kind, n=4, **kw):
  kw.setdefault("action_timeout_s", 2.0)
  p = make_pool(n, env="faults", kind=kind, num_workers=2, **kw)
  p.reset_many(range(n), FAULTS.tasks("train", n, 0), range(n))
  return p


@pytest.fixture(params=["inprocess", "local"])
def kind(request):
  return request.param


@pytest.mark.alone  # a worker killed and restarted within 4 s: not beside other xdist workers' tests
def test_hanging_step_times_out_and_others_are_unaffected(kind):
  with _pool(kind) as p:
    assert all(r.outcome == "ok" for r in p.step_many(range(4), ["ok"] * 4))
    t = time.monotonic()
    results = p.step_many([0, 1, 2, 3], ["hang", "ok", "ok", "echo x"])
    assert time.monotonic() - t < 4.0
    assert results[0].termination == "env_timeout" and results[0].info["timeout"] == "action"
    assert [r.observation.text for r in results[1:]] == ["ok 2", "ok 2", "x"]
    # slot 2 shared the killed worker: it was replayed, its env state is intact.
    later = p.step_many([1, 2, 3], ["ok", "ok", "ok"])
    assert [r.observation.text for r in later] == ["ok 3", "ok 3", "ok 3"]


def _with_reset_faults(n, faults):
  tasks = FAULTS.tasks("train", n, 0)
  return [dataclasses.replace(t, payload={"reset": faults[i]}) if i in faults else t for i, t in enumerate(tasks)]


def test_env_raising_in_reset_ends_that_episode_only(kind):
  with make_pool(4, env="faults", kind=kind, num_workers=2) as p:
    tasks = _with_reset_faults(4, {1: "raise"})
    out = p.reset_many(range(4), tasks, range(4), return_exceptions=True)
    assert isinstance(out[1], RemoteError) and "injected reset fault" in str(out[1])
    assert [o.text for i, o in enumerate(out) if i != 1] == [f"faults {tasks[i].id} seed {i}" for i in (0, 2, 3)]
    r = p.step(1, "ok")  # the failed episode is over: stepping it answers, does not raise
    assert r.done and r.termination == "env_error" and r.info["already_done"]
    assert [x.observation.text for x in p.step_many([0, 2, 3], ["ok"] * 3)] == ["ok 1"] * 3
    with pytest.raises(RemoteError, match="injected reset fault"):  # default: raised, after every slot was tried
      p.reset_many(range(4), tasks, range(4))
    assert p.step(3, "ok").observation.text == "ok 1"


@pytest.mark.alone  # retries with worker restarts within 15 s: not beside other xdist workers' tests
def test_worker_dying_or_hanging_in_reset_exhausts_its_retries():
  # One worker per slot: a reset that kills or wedges its worker must not take the neighbours' resets with it.
  with make_pool(4, env="faults", kind="local", num_workers=4, max_retries=1, reset_timeout_s=1.5) as p:
    t = time.monotonic()
    out = p.reset_many(range(4), _with_reset_faults(4, {1: "crash", 2: "hang"}), range(4), return_exceptions=True)
    assert time.monotonic() - t < 15
    assert isinstance(out[1], WorkerCrashed) and isinstance(out[2], WorkerCrashed), out
    assert [p.slots[i].termination for i in (1, 2)] == ["retries_exhausted"] * 2
    assert reset_termination(WorkerTimeout("x")) == "env_timeout" and reset_termination(out[1]) == "retries_exhausted"
    assert [x.observation.text for x in p.step_many([0, 3], ["ok", "ok"])] == ["ok 1", "ok 1"]


def test_tool_fault_is_env_error_and_huge_observation_is_capped(kind):
  with _pool(kind, max_obs_bytes=1000) as p:
    r = p.step_many([0, 1], ["raise", "big 10000000"])
    assert r[0].termination == "env_error" and r[0].outcome == "env_error"
    assert r[1].observation.truncated and r[1].observation.original_size == 10_000_000
    assert len(r[1].observation.text) == 1000 and not r[1].done
    again = p.step(0, "ok")   # stepping a finished episode answers, does not raise
    assert again.done and again.termination == "env_error" and again.info["already_done"]
    assert again.outcome is envs.Outcome.ENV_ERROR and again.termination is envs.Termination.ENV_ERROR


@pytest.mark.parametrize("rule", envs.INVALID_ACTION_RULES)
def test_invalid_action_rules_cross_the_wire(rule):
  with _pool("local", invalid_action=rule, penalty=0.25) as p:
    r = p.step_many([0, 1], ["Hang now\n!", "nosuchtool x"])
    if rule == "terminate":
      assert (r[0].termination, r[1].termination) == ("parser_rejected", "invalid_action")
    else:
      assert not r[0].done and r[0].outcome == "parser_rejected_continued"
      assert r[1].outcome == "invalid_action_continued"
      assert r[1].reward == (-0.25 if rule == "penalty" else 0.0)
    assert r[0].info["rule"] == rule


def test_worker_killed_mid_episode_is_replayed():
  with _pool("local") as p:
    p.step_many(range(4), ["ok"] * 4)
    _kill_worker(p, 0)
    r = p.step_many(range(4), ["ok"] * 4)
    assert [x.observation.text for x in r] == ["ok 2"] * 4
    assert [x.info["worker_restarts"] for x in r] == [1, 0, 1, 0]


def _wait_for_spares(p, n: int, timeout_s: float = 30.0) -> list[int]:
  deadline = time.monotonic() + timeout_s
  while len(p._spares) < n:
    assert time.monotonic() < deadline, f"no {n} warm spares within {timeout_s}s"
    time.sleep(0.05)
  return [w.pid() for w in p._spares]


def test_a_warm_spare_takes_a_hung_workers_place_and_is_replaced_in_the_background():
  with _pool("local", warm_spares=1, action_timeout_s=1.0) as p:
    [spare] = _wait_for_spares(p, 1)
    old = p.worker_pids()[0]
    p.step_many(range(4), ["ok"] * 4)
    r = p.step_many(range(4), ["hang", "ok", "ok", "ok"])   # worker 0 (slots 0, 2) hangs: it is killed
    assert r[0].termination == "env_timeout"
    assert p.worker_pids()[0] == spare != old and p.spare_swaps == 1
    r = p.step_many([1, 2, 3], ["ok"] * 3)   # slot 2 is replayed on the spare, as on a restarted worker
    assert [x.observation.text for x in r] == ["ok 3"] * 3 and r[1].info["worker_restarts"] == 1
    assert (p.replays, p.replay_divergences) == (1, 0)
    [fresh] = _wait_for_spares(p, 1)   # a new spare was started to take the next failure
    assert fresh not in (old, spare)
    _kill_worker(p, 0)
    assert p.step(2, "ok").observation.text == "ok 4" and p.worker_pids()[0] == fresh and p.spare_swaps == 2
  assert all(not os.path.exists(f"/proc/{pid}") or "\tZ" in open(f"/proc/{pid}/status").read()
             for pid in (old, spare, fresh))


def test_replay_is_checked_and_a_diverging_episode_ends_alone():
  with _pool("local") as p:
    p.step_many(range(4), ["ok", "ok", "random", "ok"])  # slot 2's env state cannot be reproduced
    _kill_worker(p, 0)  # hosts slots 0 and 2
    r = p.step_many(range(4), ["ok"] * 4)
    assert [x.observation.text for x in (r[0], r[1], r[3])] == ["ok 2"] * 3
    assert r[2].done and r[2].termination == "env_error" and r[2].outcome is envs.Outcome.REPLAY_DIVERGED
    assert "step 1 ('random')" in r[2].info["error"]
    assert (p.replays, p.replay_divergences) == (2, 1)
    assert p.step(0, "ok").observation.text == "ok 3"  # the replayed episode goes on


def test_worker_crash_without_replay_is_distinct_outcome():
  with _pool("local", replay_on_crash=False) as p:
    p.step_many(range(4), ["ok"] * 4)
    _kill_worker(p, 1)
    r = p.step_many(range(4), ["ok"] * 4)
    assert [x.outcome for x in r] == ["ok", "worker_crash", "ok", "worker_crash"]
    assert r[1].outcome is envs.Outcome.WORKER_CRASH and r[0].call == envs.Call("ok", "")
    assert r[1].termination == "env_error"
    p.reset(1, FAULTS.tasks("train", 1, 9)[0], 0)   # the pool recovered
    assert p.step(1, "ok").observation.text == "ok 1"


@pytest.mark.alone  # three worker restarts within 10 s: not beside other xdist workers' tests
def test_crashing_step_exhausts_retries_without_charging_neighbours():
  with _pool("local", max_retries=2) as p:
    t = time.monotonic()
    r = p.step_many([1, 3], ["crash", "ok"])
    assert r[0].termination == "retries_exhausted" and r[0].info["worker_restarts"] == 3
    assert r[1].observation.text == "ok 1" and not r[1].done
    assert time.monotonic() - t < 10


@pytest.mark.alone  # a cancel answered within 5 s: not beside other xdist workers' tests
def test_cancel_returns_in_flight_step_at_once(kind):
  with _pool(kind, action_timeout_s=30.0) as p:
    import threading
    threading.Timer(0.3, p.cancel, args=(0,)).start()
    t = time.monotonic()
    r = p.step_many([0, 1], ["sleep 20", "ok"])
    assert time.monotonic() - t < 5
    assert r[0].termination == "cancelled" and r[1].observation.text == "ok 1"


def test_episode_timeout():
  with _pool("local", action_timeout_s=5.0, episode_timeout_s=1.0) as p:
    r = p.step(0, "sleep 3")
    assert r.termination == "env_timeout" and r.info["timeout"] == "episode"


def test_pool_config_errors_name_the_value():
  with pytest.raises(ValueError, match=r"^kind='k8s': not one of \('inprocess', 'local', 'docker', 'remote'\)$"):
    PoolConfig(kind="k8s")
  with pytest.raises(ValueError, match=r"^addresses=\(\): a remote pool needs worker addresses"):
    PoolConfig(kind="remote")
  for kwargs, message in [(dict(sandbox="docker"), r"^sandbox='docker': not one of \('auto', 'bwrap', 'none'\)$"),
                          (dict(num_workers=0), r"^num_workers=0: must be >= 1$"),
                          (dict(action_timeout_s=0.0), r"^action_timeout_s=0.0: must be > 0$"),
                          (dict(max_retries=-1), r"^max_retries=-1: must be >= 0$"),
                          (dict(kind="inprocess", warm_spares=1),
                           r"^warm_spares=1: only local and docker pools start workers \(kind='inprocess'\)")]:
    with pytest.raises(ValueError, match=message):
      WorkerConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
      PoolConfig(**kwargs)
  with pytest.raises(ValueError, match=r"^invalid_action='ignore': not one of \('error_observation'"):
    PoolConfig(invalid_action="ignore")
  with pytest.raises(ValueError, match=r"^max_turns=0: must be >= 1 or None$"):
    PoolConfig(max_turns=0)


def test_worker_config_is_a_yaml_loadable_section_and_pool_config_extends_it():
  allowed = {str, int, float, bool, str | None, int | None, float | None, bool | None, tuple[str, ...]}
  hints = typing.get_type_hints(WorkerConfig)
  assert list(hints) == [f.name for f in dataclasses.fields(WorkerConfig)]
  for name, hint in hints.items():
    assert hint in allowed or typing.get_origin(hint) is typing.Literal, (name, hint)
  assert typing.get_args(hints["kind"]) == pool_lib.POOL_KINDS == ("inprocess", "local", "docker", "remote")
  assert typing.get_args(hints["sandbox"]) == pool_lib.SANDBOXES == ("auto", "bwrap", "none")
  episode = [f.name for f in dataclasses.fields(PoolConfig)][len(hints):]
  assert episode == ["env", "max_turns", "invalid_action", "penalty", "action_syntax", "perturb",
                     "score_heldout", "tools", "tools_version"] and issubclass(PoolConfig, WorkerConfig)

  workers = WorkerConfig(kind="inprocess", num_workers=2, action_timeout_s=3.0, addresses=("unix:/x",))
  cfg = PoolConfig.from_workers(workers, env="faults", max_turns=5)
  assert cfg == PoolConfig(kind="inprocess", num_workers=2, action_timeout_s=3.0, addresses=("unix:/x",),
                           env="faults", max_turns=5)
  assert all(getattr(cfg, name) == getattr(workers, name) for name in hints)
  with pytest.raises(TypeError, match=r"\['num_workers'\] are worker fields"):
    PoolConfig.from_workers(workers, num_workers=3)
  # make_pool takes either config and overrides of either level.
  with make_pool(2, workers, env="faults", max_turns=2, num_workers=1) as p:
    assert p.cfg == dataclasses.replace(cfg, max_turns=2, num_workers=1)
    p.reset_many([0, 1], FAULTS.tasks("train", 2, 0), [0, 1])
    assert [r.termination for r in p.step_many([0, 1], ["ok", "ok"])] == [None, None]
    assert [r.termination for r in p.step_many([0, 1], ["ok", "ok"])] == ["max_turns"] * 2


# -- the wire: a bad frame gets an error reply, never a crash.


@pytest.fixture
def served(tmp_path):
  import subprocess
  import sys
  sock = str(tmp_path / "w.sock")
  proc = subprocess.Popen([sys.executable, "-m", "envs.server", "faults", "--socket", sock],
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 20
  while not os.path.exists(sock):
    assert time.monotonic() < deadline and proc.poll() is None
    time.sleep(0.02)
  yield sock, proc
  proc.kill()
  proc.wait(timeout=10)


def _rpc(conn, raw: bytes):
  conn.sendall(raw)
  conn.settimeout(5)
  return P.read_frame(conn)


@pytest.mark.parametrize("raw,kind", [
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_msgpack"),
    (P.pack([1, 2]), "bad_request"),
    (P.pack({"v": V, "id": "x", "op": "ping"}), "bad_request"),
    (P.pack({"v": 99, "id": 4, "op": "ping"}), "bad_version"),
    (P.pack({"v": V, "id": 5, "op": "rm -rf"}), "bad_op"),
    (P.pack({"v": V, "id": 6, "op": "step", "args": {"instance": "nope", "action": "ok"}}), "unknown_instance"),
    (P.pack({"v": V, "id": 7, "op": "reset", "args": {"instance": "a", "task": {"id": 1}}}), "bad_args"),
    (P.pack({"v": V, "id": 8, "op": "reset", "args": {"instance": "a", "seed": 0, "options": {"x": 1},
                                                        "task": {"id": "t", "split": "train", "payload": {},
                                                                 "version": "0"}}}), "bad_args"),
    (struct.pack(">I", P.MAX_FRAME_BYTES + 1) + b"\0" * (P.MAX_FRAME_BYTES + 1), "frame_too_large"),
])
def test_bad_frames_get_error_replies(served, raw, kind):
  sock, proc = served
  with socket.socket(socket.AF_UNIX) as conn:
    conn.connect(sock)
    reply = _rpc(conn, raw)
    assert reply["ok"] is False and reply["error"]["kind"] == kind, reply
    # the same connection still works afterwards
    assert _rpc(conn, P.pack(P.request(1, "ping", {})))["ok"] is True
  assert proc.poll() is None


def test_truncated_frame_and_garbage_do_not_kill_the_server(served):
  sock, proc = served
  for junk in (b"\x00\x00", b"\xff" * 64):
    with socket.socket(socket.AF_UNIX) as conn:
      conn.connect(sock)
      conn.sendall(junk)
  with socket.socket(socket.AF_UNIX) as conn:
    conn.connect(sock)
    hello = _rpc(conn, P.pack(P.request(3, "hello", {})))
    assert hello["result"]["env"] == "faults" and hello["result"]["protocol"] == P.PROTOCOL_VERSION
  assert proc.poll() is None


def test_remote_pool_talks_to_a_served_worker(served):
  sock, _ = served
  with make_pool(2, env="faults", kind="remote", addresses=(f"unix:{sock}",)) as p:
    p.reset_many([0, 1], FAULTS.tasks("eval", 2, 0), [0, 1])
    assert [r.observation.text for r in p.step_many([0, 1], ["ok", "echo remote"])] == ["ok 1", "remote"]


def test_in_process_connection_keeps_at_most_max_inflight_threads_and_close_stops_them():
  # Ops run on kept daemon threads (one started per op cost ~4 ms of every env call), never more than
  # max_inflight at once; close fails what is still queued and stops the idle threads.
  import threading

  from envs._connections import InProcessConnection

  def env_threads():
    return [t for t in threading.enumerate() if t.name == "inproc-env"]

  before = len(env_threads())
  conn = InProcessConnection("guess", max_inflight=3, episode_sandbox="none")
  for _ in range(20):  # one at a time: the first thread serves them all
    assert conn.call("ping", {}, 5.0).result(timeout=5)["time"] > 0
  assert len(env_threads()) - before == 1
  futures = [conn.call("ping", {}, 5.0) for _ in range(30)]
  assert all(f.result(timeout=5)["time"] > 0 for f in futures)
  assert 1 <= len(env_threads()) - before <= 3
  with pytest.raises(RemoteError, match="unknown_instance"):
    conn.call("step", dict(instance="nope", action="x"), 5.0).result(timeout=5)
  conn.close()
  with pytest.raises(WorkerCrashed, match="closed"):
    conn.call("ping", {}, 5.0).result(timeout=5)
  deadline = time.monotonic() + 5
  while len(env_threads()) > before and time.monotonic() < deadline:
    time.sleep(0.01)
  assert len(env_threads()) == before, "close left idle in-process env threads running"
