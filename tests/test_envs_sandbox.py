"""Isolation of env workers: from inside an env action, reading host files (e.g. eval answers), writing
outside the private tmp and opening network connections all fail — local pool under bubblewrap, and Docker.

Docker tests need the private daemon that `envs/docker/setup.sh` starts (CI runs it). Outside CI they skip
with the reason printed; with JAXAGENT_REQUIRE_DOCKER=1 (set by .ci/run) a missing daemon is a failure.
"""

import os
import time

import pytest

import envs
from envs import pool as pool_lib
from tests._sandbox import require_bwrap

FAULTS = envs.get("faults")


def _docker_client():
  try:
    import docker
    client = docker.DockerClient(base_url=pool_lib.docker_host(), timeout=10)
    client.ping()
    client.images.get("jaxagent-envs:latest")
    return client, None
  except Exception as e:  # no SDK, no daemon, no image
    return None, f"{type(e).__name__}: {e}"


def _docker_or_skip():
  """The docker client; without one, fails under JAXAGENT_REQUIRE_DOCKER=1 (CI), else skips with the reason printed."""
  client, why = _docker_client()
  if client is None:
    if os.environ.get("JAXAGENT_REQUIRE_DOCKER") == "1":
      pytest.fail(f"JAXAGENT_REQUIRE_DOCKER=1 but docker is unavailable: {why}")
    print(f"SKIP docker: {why} (run envs/docker/setup.sh)")
    pytest.skip(f"docker unavailable: {why}")
  return client


def _sandboxed_pool(kind):
  if kind == "docker":
    _docker_or_skip()
    return pool_lib.make_pool(2, env="faults", kind="docker", num_workers=1, start_timeout_s=60)
  require_bwrap()
  return pool_lib.make_pool(2, env="faults", kind="local", sandbox="bwrap", num_workers=1)


@pytest.mark.parametrize("kind", ["local", "docker"])
def test_actions_cannot_read_write_or_connect(kind, secret, listener):
  # Control: the same probes succeed outside any sandbox, so a "denied" below is the sandbox's doing.
  with pool_lib.make_pool(1, env="faults", kind="inprocess") as p:
    p.reset(0, FAULTS.tasks("train", 1, 0)[0], 0)
    assert p.step(0, f"read {secret}").observation.text.startswith("allowed")
    assert p.step(0, f"net {listener}").observation.text == "allowed net"
  with _sandboxed_pool(kind) as p:
    assert p.sandboxed
    p.reset_many([0, 1], FAULTS.tasks("eval", 2, 0), [0, 1])
    probes = {
        f"read {secret}": "denied",
        "read /etc/shadow": "denied",
        f"read {os.path.expanduser('~')}/.bash_history": "denied",
        f"write {os.path.dirname(secret)}/x": "denied",
        "write /usr/pwned": "denied",
        "write /opt/jaxagent/envs/pwned.py": "denied",
        "write /tmp/scratch": "allowed",   # the private writable tmp
        f"net {listener}": "denied",
        "net 1.1.1.1:53": "denied",
    }
    for action, want in probes.items():
      got = p.step(0, action).observation.text
      assert got.startswith(want), (kind, action, got)
    assert not os.path.exists(os.path.join(os.path.dirname(secret), "x"))
    assert open(secret).read() == "42\n"


@pytest.mark.alone  # a hung container replaced within 8 s: not beside other xdist workers' tests
def test_docker_worker_limits_and_recovery():
  client = _docker_or_skip()
  with pool_lib.make_pool(2, env="faults", kind="docker", num_workers=1, action_timeout_s=3,
                          start_timeout_s=60) as p:
    c = client.containers.get(p.workers[0].container.id)
    host = c.attrs["HostConfig"]
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] and host["PidsLimit"] == 128
    assert host["Memory"] == 512 << 20 and host["CapDrop"] == ["ALL"] and host["Binds"][0].endswith(":/run/jaxagent:rw")
    p.reset_many([0, 1], FAULTS.tasks("train", 2, 0), [0, 1])
    p.step_many([0, 1], ["ok", "ok"])
    t = time.monotonic()
    r = p.step_many([0, 1], ["hang", "ok"])
    assert r[0].termination == "env_timeout" and r[1].observation.text == "ok 2"
    assert time.monotonic() - t < 8
    # the hung container was replaced; slot 1's episode was replayed into the new one (and says so)
    assert p.step(1, "ok").observation.text == "ok 3" and p.step(1, "ok").info["worker_restarts"] == 1
    assert (p.replays, p.replay_divergences) == (1, 0)


def test_docker_workers_nesting_episode_sandboxes_refuse_what_neither_needs():
  # A container whose episodes get bubblewrap sandboxes runs with envs/docker/seccomp-episodes.json, not
  # unconfined: keyctl and io_uring_setup reach the kernel without it (EINVAL, EFAULT) and get EPERM with it.
  import platform
  client = _docker_or_skip()
  if platform.machine() != "x86_64":
    print(f"SKIP: the syscall numbers below are x86_64's, this is {platform.machine()}")
    pytest.skip("x86_64 syscall numbers")
  probe = ("sh python3 -c \"import ctypes; c = ctypes.CDLL(None, use_errno=True); "
           "print([(c.syscall(n, 1, 0, 0), ctypes.get_errno()) for n in (250, 425)])\"")
  with pool_lib.make_pool(1, env="terminal", kind="docker", num_workers=1, start_timeout_s=60) as p:
    opts = client.containers.get(p.workers[0].container.id).attrs["HostConfig"]["SecurityOpt"]
    assert "no-new-privileges" in opts and not any(o == "seccomp=unconfined" for o in opts), opts
    p.reset(0, envs.get("terminal").tasks("train", 1, 0)[0], 0)
    r = p.step(0, probe)
    assert r.observation.text.startswith("[(-1, 1), (-1, 1)]"), r.observation.text


def test_worker_and_episode_sandboxes_share_one_base_and_differ_only_where_a_worker_must_nest(tmp_path):
  """envs/_sandbox.py bwrap_base: the worker sandbox keeps capabilities and user namespaces because it creates
  the episodes' sandboxes inside itself; each episode drops both."""
  from envs import _sandbox
  worker = pool_lib.bwrap_command(str(tmp_path), ["-c", "pass"])
  if _sandbox.bwrap_error() is None:  # the argv an episode's program really gets
    box = _sandbox.EpisodeSandbox("bwrap")
    episode = box.argv(["true"])
    box.close()
  else:
    episode = [*_sandbox.bwrap_base(nests=False), "true"]
  base = _sandbox.bwrap_base(nests=True)
  assert worker[:len(base)] == base and episode[:len(base)] == base
  assert "--cap-drop" not in worker and "--disable-userns" not in worker
  assert episode[episode.index("--cap-drop") + 1] == "ALL"
  extra = set(_sandbox.bwrap_base(nests=False)) - set(base)
  assert extra <= {"--cap-drop", "ALL", "--unshare-user", "--disable-userns"}
  assert _sandbox.bwrap_error() is None or not os.environ.get("JAXAGENT_REQUIRE_SANDBOX"), _sandbox.bwrap_error()
