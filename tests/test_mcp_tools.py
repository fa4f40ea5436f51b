"""MCP tools beside an env's own (envs/mcp_tools.py), served by a real `mcp` server (envs/builtin/mcp_arithmetic.py):
listed into the parser and the prompt, called by episodes in sandboxed workers, errors under the invalid-action
rule, a dying server as env_error."""

import json

import pytest

import envs
from envs import mcp_tools
from envs.builtin import calculator

pytest.importorskip("mcp", reason="the MCP tests start real servers with the mcp package ([test] extra)")

SERVER = "mcp:stdio:python -m envs.builtin.mcp_arithmetic"
TASK = calculator.tasks("train", 1, seed=0)[0]
MULTIPLY = json.dumps({"name": "multiply", "arguments": {"a": 6, "b": 7}})


def _calculator(**kwargs):
  return envs.get("calculator").make(max_turns=6, action_syntax="json", **kwargs)


def test_an_episode_calls_the_servers_tools_beside_the_envs_own():
  env = mcp_tools.wrap(_calculator(), [SERVER])
  try:
    assert env.parser.names == ("calc", "answer", "multiply", "divide")
    assert env.parser.version.startswith("json-v1+mcp-") and env.versions()["parser"] == env.parser.version
    multiply = next(t for t in env.parser.tools if t.name == "multiply")
    assert multiply.parameters["required"] == ["a", "b"] and multiply.description == "Multiply two integers."
    assert env.reset(TASK, 0).text == TASK.payload["question"]
    step = env.step(MULTIPLY)
    assert step.observation.text == "42" and not step.done and step.info["tool"] == "multiply"
    # The tool's error result: the invalid-action rule (an error observation), the episode goes on.
    step = env.step(json.dumps({"name": "divide", "arguments": {"a": 1, "b": 0}}))
    assert step.outcome == envs.Outcome.INVALID_ACTION_CONTINUED and "division by zero" in step.observation.text
    # Arguments are checked against the server's schema before anything is sent.
    step = env.step(json.dumps({"name": "multiply", "arguments": {"a": "six", "b": 7}}))
    assert step.outcome == envs.Outcome.INVALID_ACTION_CONTINUED and "bad arguments" in step.observation.text
    # The env's own tools are the env's; its answer ends the episode as before.
    value = calculator.safe_eval(TASK.payload["question"])
    step = env.step(json.dumps({"name": "answer", "arguments": {"answer": str(value)}}))
    assert step.done and step.verdict.passed and env.turn == 4
  finally:
    env.close()


def test_a_server_that_dies_mid_episode_ends_it_as_env_error_and_the_next_episode_starts_a_new_one():
  env = mcp_tools.wrap(_calculator(), [f"{SERVER} --die-after 1"])
  try:
    env.reset(TASK, 0)
    assert env.step(MULTIPLY).observation.text == "42"
    step = env.step(MULTIPLY)
    assert step.done and step.termination == envs.Termination.ENV_ERROR
    assert "Connection closed" in step.info["error"] or "not running" in step.info["error"]
    assert envs.Termination.ENV_ERROR.value in envs.INFRASTRUCTURE_TERMINATIONS
    env.reset(TASK, 1)
    assert env.step(MULTIPLY).observation.text == "42"
  finally:
    env.close()


def test_bad_servers_and_clashing_or_changed_tools_are_named():
  with pytest.raises(ValueError, match=r"expected 'mcp:stdio:<command"):
    mcp_tools.check_servers(["stdio:python -m x"])
  with pytest.raises(envs.EnvError, match="failed to start"):
    mcp_tools.wrap(_calculator(), ["mcp:stdio:/nonexistent/server"])
  with pytest.raises(envs.EnvError, match=r"'multiply' .* the name is taken"):
    mcp_tools.wrap(_calculator(), [SERVER, SERVER])
  with pytest.raises(envs.EnvError, match="other tools than when the run was built"):
    mcp_tools.wrap(_calculator(), [SERVER], expected="00000000")
  with pytest.raises(ValueError, match="tools="):
    envs.pool.PoolConfig(env="calculator", tools=("python -m x",))


@pytest.mark.slow
def test_sandboxed_workers_start_a_server_per_episode_and_route_the_calls(tmp_path):
  cfg = envs.pool.PoolConfig(env="calculator", kind="local", num_workers=1, action_syntax="json", max_turns=4,
                             tools=(SERVER,))
  with envs.pool.Pool(cfg, num_slots=2) as pool:
    for slot in (0, 1):  # two episodes at once on one worker: a server each
      pool.reset(slot, TASK, slot)
    assert [pool.step(slot, MULTIPLY).observation.text for slot in (0, 1)] == ["42", "42"]
    value = calculator.safe_eval(TASK.payload["question"])
    done = pool.step(0, json.dumps({"name": "answer", "arguments": {"answer": str(value)}}))
    assert done.done and done.verdict.passed
  cfg = envs.pool.PoolConfig(env="calculator", kind="local", num_workers=1, action_syntax="json", max_turns=4,
                             tools=(f"{SERVER} --die-after 0",), replay_on_crash=False)
  with envs.pool.Pool(cfg, num_slots=1) as pool:
    pool.reset(0, TASK, 0)
    step = pool.step(0, MULTIPLY)
    assert step.done and step.termination == envs.Termination.ENV_ERROR and "MCP server" in step.info["error"]


@pytest.mark.slow
def test_the_trainer_lists_the_tools_into_the_prompt_and_refuses_line_actions(tmp_path, smollm2_dir):
  from jaxagent import config as config_lib
  from jaxagent.train.run import build_run
  overrides = [f"model.tokenizer={smollm2_dir}", "env.name=calculator", f"env.tools=[\"{SERVER}\"]",
               "env.demo_options={style: direct}", "train.eval_episodes=0"]
  run = build_run(config_lib.load("calculator_agent_tiny_cpu", overrides), tmp_path / "run", echo=False)
  try:
    info = run.interface.env_info
    assert [t["function"]["name"] for t in info.tools] == ["calc", "answer", "multiply", "divide"]
    assert info.tools_version and info.parser.version.endswith(info.tools_version)
    prompt = run.interface.tokenizer.decode(run.interface.chat.prompt("2*3").tokens(0, None))
    assert '"name": "multiply"' in prompt and '"name": "calc"' in prompt
    assert run.rollout.pool.cfg.tools == (SERVER,) and run.rollout.pool.cfg.tools_version == info.tools_version
  finally:
    run.close()
  with pytest.raises(config_lib.ConfigError, match="MCP tools take JSON arguments"):
    build_run(config_lib.load("tiny_cpu", [f"env.tools=[\"{SERVER}\"]"]), tmp_path / "line", echo=False)
