"""OpenEnv both ways (envs/openenv_bridge.py), with openenv-core's own server and client: a server written with
its server classes trained on as `env.name: openenv:<url>`, and a built-in env served with `--openenv` played by
its `GenericEnvClient`."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import envs
from envs.builtin import calculator

pytest.importorskip("openenv.core", reason="the OpenEnv tests run openenv-core's server and client ([test] extra)")

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _serving(argv, port: int, log: Path):
  """A server process on 127.0.0.1:`port`, up (its /health answers) or failing the test. Its output goes to
  `log` (a pipe nobody reads fills up and stalls the server)."""
  import requests
  proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    try:
      if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
        return proc
    except requests.ConnectionError:
      pass
    if proc.poll() is not None:
      break
    time.sleep(0.2)
  proc.kill()
  pytest.fail(f"the server did not come up: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def reverse_server(tmp_path_factory):
  port = _free_port()
  proc = _serving([sys.executable, "tests/_openenv_server.py", str(port)], port,
                  tmp_path_factory.mktemp("openenv") / "server.log")
  yield f"http://127.0.0.1:{port}"
  proc.kill()
  proc.wait()


def test_an_openenv_server_is_played_as_an_env(reverse_server):
  spec = envs.get(f"openenv:{reverse_server}")
  assert spec.network and spec is envs.get(f"openenv:{reverse_server}/")
  train, evals = spec.tasks("train", 3), spec.tasks("eval", 3)
  assert not {t.payload["reset_seed"] for t in train} & {t.payload["reset_seed"] for t in evals}
  env = spec.make(max_turns=4)
  try:
    obs = env.reset(train[0], seed=123)
    assert obs.text.startswith("reverse ")  # the observation's one string field
    word = obs.text.split()[1]
    assert env.reset(train[0], seed=456).text == obs.text  # the task, not the episode seed, names the instance
    step = env.step("nope")  # the action schema's one string field takes the text
    assert not step.done and step.observation.text == "wrong" and step.reward == 0.0
    step = env.step(word[::-1])
    assert step.done and step.termination == envs.Termination.COMPLETED and step.verdict.passed
    assert step.reward == 1.0 and step.verdict.evidence["reward"] == 1.0
  finally:
    env.close()


def test_an_unreachable_server_is_an_env_error_and_a_bad_url_is_named():
  port = _free_port()
  env = envs.get(f"openenv:http://127.0.0.1:{port}").make(max_turns=2)
  with pytest.raises(envs.EnvError, match="cannot connect"):
    env.reset(envs.get(f"openenv:http://127.0.0.1:{port}").tasks("train", 1)[0], 0)
  with pytest.raises(envs.UnknownEnvError, match="expected 'openenv:http://HOST:PORT'"):
    envs.get("openenv:127.0.0.1:8000")
  with pytest.raises(RuntimeError, match="client of a server over the network"):
    envs.pool.Pool(envs.pool.PoolConfig(env=f"openenv:http://127.0.0.1:{port}", sandbox="bwrap"), num_slots=1)


def test_a_builtin_env_served_with_openenv_is_played_by_openenvs_own_client(tmp_path):
  from openenv.core import GenericEnvClient
  port = _free_port()
  proc = _serving([sys.executable, "-m", "envs.server", "calculator", "--openenv", "--tcp", f"127.0.0.1:{port}"],
                  port, tmp_path / "server.log")
  try:
    with GenericEnvClient(base_url=f"http://127.0.0.1:{port}").sync() as client:
      result = client.reset(task_index=2, seed=0)
      question = result.observation["text"]
      assert question == calculator.tasks("train", 3)[2].payload["question"] and not result.done
      result = client.step({"text": f"calc {question}"})
      assert result.observation["text"] == str(calculator.safe_eval(question)) and not result.done
      result = client.step({"text": f"answer {calculator.safe_eval(question)}"})
      assert result.done and result.reward == 1.0 and result.observation["text"] == "correct"
  finally:
    proc.kill()
    proc.wait()
  bad = subprocess.run([sys.executable, "-m", "envs.server", "calculator", "--openenv", "--tcp", "10.0.0.1:80"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "not a loopback address" in bad.stderr


@pytest.mark.slow
def test_two_grpo_iterations_on_an_openenv_server(tmp_path, reverse_server):
  from jaxagent import cli, trajectory_store
  from tests.test_train import TINY
  run = tmp_path / "job"
  sets = [*TINY, f"env.name=openenv:{reverse_server}", "train.bc_steps=0", "train.eval_episodes=4",
          "train.iterations=2", "env.max_turns=3", "env.pool.kind=local", "env.demo_options=null"]
  assert cli.main(["train", "tiny_cpu", "--run-dir", str(run), *[x for o in sets for x in ("--set", o)]]) == 0
  stored = list(trajectory_store.read(run / "trajectories"))
  assert stored and all(t.env.name == f"openenv:{reverse_server}" for t in stored)
  for t in stored:
    t.validate()
    assert t.termination.value in ("completed", "max_turns", "context_exhausted", "turn_budget_exhausted"), t
    assert np.isfinite(t.behavior_logprobs[t.loss_mask]).all()
    assert all(turn.observation is None or turn.observation.text in ("right", "wrong") for turn in t.turns)
  lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert [x["iteration"] for x in lines if "loss" in x] == [1, 2]
