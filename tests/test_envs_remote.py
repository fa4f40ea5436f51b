"""Env servers at scale: the handshake every worker passes, admission control with back-pressure, the
Kubernetes manifests, and a remote pool of loopback servers that trains from YAML alone."""

import argparse
import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import envs
from envs import _protocol as P
from envs import pool as pool_lib
from envs import server as server_lib

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def servers(tmp_path):
  """Starts loopback env servers: `servers(env, *flags) -> "tcp:127.0.0.1:PORT"`; all are killed at the end."""
  procs = []

  def start(env="calculator", *flags, port=None):
    port = port or _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from envs import server; sys.exit(server.main())",
                             env, "--tcp", f"127.0.0.1:{port}", *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    procs.append(proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return f"tcp:127.0.0.1:{port}"
      except OSError:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"server on port {port} did not start")

  start.procs = procs
  yield start
  for proc in procs:
    proc.kill()
    proc.wait(timeout=10)


def _remote(addresses, env="calculator", **kw):
  return pool_lib.PoolConfig(kind="remote", num_workers=len(addresses), addresses=tuple(addresses), env=env, **kw)


def test_handshake_refuses_a_server_of_another_env_naming_it(servers):
  good, other = servers("calculator"), servers("faults")
  with pytest.raises(pool_lib.HandshakeError, match=f"{other} serves 'faults'"):
    pool_lib.Pool(_remote([good, other]), num_slots=2)


def test_a_remote_worker_that_reconnects_to_a_server_of_another_env_is_refused(servers, caplog):
  address = servers("faults")
  task = envs.get("faults").tasks("train", 1)[0]
  with pool_lib.Pool(_remote([address], env="faults", max_retries=1), num_slots=1) as pool:
    pool.reset(0, task, 0)
    assert pool.step(0, "ok").observation.text == "ok 1"
    servers.procs[-1].kill()   # a rolling update puts a server of another env at the same address
    servers.procs[-1].wait(timeout=10)
    servers("calculator", port=int(address.rsplit(":", 1)[1]))
    r = pool.step(0, "ok")
  # Refused at the reconnect (not replayed there, which would end as env_error on the calculator).
  assert r.termination == "retries_exhausted", r
  assert "reconnected to a different server" in caplog.text and "serves 'calculator'" in caplog.text


def test_handshake_refuses_mixed_versions_and_protocols():
  hello = lambda version, protocol=P.PROTOCOL_VERSION: {"env": "calculator", "version": version, "protocol": protocol}
  pool_lib.check_handshake("calculator", [("a", hello("v1")), ("b", hello("v1"))])
  with pytest.raises(pool_lib.HandshakeError, match="different versions of the env .*a: calculator v1; b: calculator v2"):
    pool_lib.check_handshake("calculator", [("a", hello("v1")), ("b", hello("v2"))])
  with pytest.raises(pool_lib.HandshakeError, match="b speaks protocol 99.*this client speaks protocol"):
    pool_lib.check_handshake(None, [("a", hello("v1")), ("b", hello("v1", 99))])
  # Observations differ between episode-sandbox modes (paths, exit codes): a replay must never cross them.
  boxed = lambda mode: dict(hello("v1"), episode_sandbox=mode)
  with pytest.raises(pool_lib.HandshakeError, match="confine episodes differently .*a: bwrap; b: none"):
    pool_lib.check_handshake("calculator", [("a", boxed("bwrap")), ("b", boxed("none"))])


def test_a_full_server_makes_resets_wait_until_an_episode_ends(servers):
  address = servers("faults", "--max-episodes", "1")
  task = envs.get("faults").tasks("train", 1)[0]
  with pool_lib.Pool(_remote([address], env="faults", reset_timeout_s=20.0), num_slots=2) as pool:
    pool.reset(0, task, 0)
    second = pool.reset_async(1, task, 1)
    time.sleep(0.5)
    assert not second.done(), "the second episode was admitted past --max-episodes 1"
    assert pool.step(0, "done").done  # the first episode ends: its instance is closed, the second gets in
    assert not isinstance(second.result(timeout=20), Exception)
    assert pool.admission_waits == 1
    assert pool.step(1, "ok").observation.text == "ok 1"


def test_admission_wait_is_bounded_and_ends_the_episode_without_a_restart(servers):
  address = servers("faults", "--max-episodes", "1")
  task = envs.get("faults").tasks("train", 1)[0]
  with pool_lib.Pool(_remote([address], env="faults", reset_timeout_s=1.0), num_slots=2) as pool:
    pool.reset(0, task, 0)
    (err,) = pool.reset_many([1], [task], [1], return_exceptions=True)
    assert isinstance(err, pool_lib.AdmissionTimeout) and "admitted no new episode" in str(err)
    assert pool.slots[1].termination == envs.Termination.ENV_TIMEOUT
    assert pool.workers[0].generation == 0  # a full server is not a broken one
    assert pool.step(0, "ok").observation.text == "ok 1"  # the admitted episode is untouched


def test_kubernetes_manifests_deploy_the_server_the_remote_pool_reaches():
  text = (ROOT / "launch" / "k8s" / "env-servers.yaml").read_text()
  docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
  assert set(docs) == {"Deployment", "Service", "NetworkPolicy"}
  deployment, service, policy = docs["Deployment"], docs["Service"], docs["NetworkPolicy"]
  pod = deployment["spec"]["template"]
  assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
  assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
  (container,) = pod["spec"]["containers"]
  assert container["command"] == ["python3", "-m", "envs.server"]
  parser = argparse.ArgumentParser()
  server_lib.add_serve_args(parser)
  args = parser.parse_args(container["args"])  # the server accepts its arguments
  envs.get(args.env)
  port = int(args.tcp.rpartition(":")[2])
  assert args.allow_any_address and args.max_episodes >= 1
  ports = {p["name"]: p["containerPort"] for p in container["ports"]}
  (svc_port,) = service["spec"]["ports"]
  assert ports[svc_port["targetPort"]] == port
  security = container["securityContext"]
  assert security["readOnlyRootFilesystem"] and security["capabilities"]["drop"] == ["ALL"]
  assert not security["allowPrivilegeEscalation"] and pod["spec"]["securityContext"]["runAsNonRoot"]
  assert policy["spec"]["egress"] == [] and "Egress" in policy["spec"]["policyTypes"]
  # The trainer snippet in the header is a valid remote pool reaching that Service.
  snippet = yaml.safe_load("\n".join(line[2:] for line in text.splitlines()
                                     if line.startswith("#   ") or line.startswith("# env:")))
  pool = pool_lib.WorkerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in snippet["env"]["pool"].items()})
  assert pool.kind == "remote" and len(pool.addresses) == pool.num_workers
  assert {a for a in pool.addresses} == {f"tcp:{service['metadata']['name']}:{svc_port['port']}"}


@pytest.mark.slow
def test_a_remote_pool_of_two_loopback_servers_trains_from_yaml_alone(servers, tmp_path):
  addresses = [servers("calculator"), servers("calculator")]
  config = yaml.safe_load((ROOT / "jaxagent" / "configs" / "tiny_cpu.yaml").read_text())
  config["env"]["pool"] = {"kind": "remote", "num_workers": 2, "addresses": addresses}
  config["run"].update(root=str(tmp_path / "runs"))
  config["train"].update(iterations=3, bc_steps=20, eval_episodes=16, eval_every=0, plots=False)
  path = tmp_path / "remote.yaml"
  path.write_text(yaml.safe_dump(config))
  done = subprocess.run([sys.executable, "-m", "jaxagent", "train", str(path)], cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "after RL:" in done.stdout
  (run,) = (tmp_path / "runs").iterdir()
  from jaxagent import trajectory_store
  stored = list(trajectory_store.read(run / "trajectories"))
  assert {t.metadata["env_worker"] for t in stored} == {0, 1}  # both servers hosted episodes
  assert len({t.metadata["env_worker_pid"] for t in stored}) == 2  # two server processes, by their hello
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in rows if r.get("iteration") == 3 and "reward_mean" in r][-1]
  ends = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("termination/")}
  assert sum(ends.values()) == 8 * 8, ends  # every episode of the iteration ended, none by an infrastructure fault
  assert not set(ends) & {"env_error", "env_timeout", "retries_exhausted", "cancelled"}, ends


@pytest.mark.slow
def test_soak_loses_and_mis_terminates_no_episode_under_injected_faults():
  """A short run of bench/soak.py (the full one: 1,000 concurrent episodes for minutes; figures in the README)."""
  sys.path.insert(0, str(ROOT / "bench"))
  import soak
  report = soak.soak(slots=120, workers=3, seconds=12, drain_seconds=60, seed=1, echo=lambda *_: None,
                     rates={"crash": 0.01, "hang": 0.01, "raise": 0.02, "big": 0.05})
  assert report["lost"] == 0 and report["mis_terminated"] == 0, report["problems"]
  ends = report["terminations"]
  assert ends.get("retries_exhausted") and ends.get("env_timeout") and ends.get("env_error"), ends  # faults hit
  assert report["restarts"] > 0 and report["replays"] > 0 and report["replay_divergences"] == 0
  assert ends["completed"] > 5 * report["slots"], ends  # siblings of crashed and hung episodes completed


@pytest.mark.alone  # a step within 2 s beside 74 waiting resets: not beside other xdist workers' tests
def test_waiting_resets_do_not_hold_up_the_steps_that_would_free_the_server(servers):
  """More slots than the pool has threads, and a server that admits a few: the waiting resets must not starve
  the admitted episodes' steps (whose ends free places), or back-pressure turns into failed episodes."""
  address = servers("faults", "--max-episodes", "6")
  task = envs.get("faults").tasks("train", 1)[0]
  with pool_lib.Pool(_remote([address], env="faults", reset_timeout_s=30.0), num_slots=80) as pool:
    first = pool.reset_many(list(range(6)), [task] * 6, list(range(6)))
    assert all(not isinstance(o, Exception) for o in first)
    waiting = [pool.reset_async(i, task, i) for i in range(6, 80)]  # 74 resets wait for places
    time.sleep(0.3)
    t0 = time.monotonic()
    assert pool.step(0, "done").done
    assert time.monotonic() - t0 < 2.0, "a step of an admitted episode queued behind waiting resets"
    for k in range(1, 6):
      assert pool.step(k, "done").done
    slot_of = {fut: 6 + j for j, fut in enumerate(waiting)}
    for fut in concurrent.futures.as_completed(slot_of, timeout=60):  # each end admits a waiting episode
      assert not isinstance(fut.result(), Exception), fut.result()
      assert pool.step(slot_of[fut], "done").done
    assert pool.admission_waits >= 50  # most waited (a few reached the server only after places freed)


def test_a_connection_that_ends_frees_its_episodes_on_the_server(servers):
  address = servers("faults", "--max-episodes", "2")
  task = envs.get("faults").tasks("train", 1)[0]
  with pool_lib.Pool(_remote([address], env="faults"), num_slots=2) as pool:
    pool.reset_many([0, 1], [task, task], [0, 1])  # the server is full, and this client goes away
  with pool_lib.Pool(_remote([address], env="faults", reset_timeout_s=5.0), num_slots=2) as pool:
    out = pool.reset_many([0, 1], [task, task], [0, 1], return_exceptions=True)
    assert not any(isinstance(o, Exception) for o in out) and pool.admission_waits == 0
