"""Bring your agent: an agent written with the real `openai` client, played as an env through the gateway
(envs/gateway.py): exact replies, the extension rule and its recorded break, bad requests, and training end to end."""

import json
import threading

import numpy as np
import pytest

import envs
from envs import gateway
from envs.builtin import calculator, calculator_agent

openai = pytest.importorskip("openai", reason="the gateway tests drive the real openai client ([test] extra)")

TASK = calculator.tasks("train", 1, seed=0)[0]
QUESTION = TASK.payload["question"]
VALUE = calculator.safe_eval(QUESTION)
CALL = json.dumps({"name": "calc", "arguments": {"expression": QUESTION}})


def _env(agent, **kwargs) -> gateway.AgentEnv:
  spec = envs.agent_spec("test_agent", agent=agent, tasks=calculator.tasks, tools=calculator_agent.TOOLS,
                         verifier=calculator.CalculatorVerifier(), agent_timeout_s=kwargs.pop("timeout", 10.0))
  return spec.make(max_turns=kwargs.pop("max_turns", 4), **kwargs)


def test_a_react_agent_gets_the_policys_replies_and_its_tool_results_are_the_observations():
  seen = []

  def agent(task, client):
    answer = calculator_agent.run_agent(task, client)
    seen.append(answer)
    return answer

  env = _env(agent)
  try:
    obs = env.reset(TASK, seed=0)
    assert obs.text == QUESTION and obs.system == calculator_agent.SYSTEM
    step = env.step(f"<tool_call>{CALL}</tool_call>")  # the template's convention
    assert not step.done and step.observation.text == str(VALUE)
    assert step.call == envs.Call("calc", f"<tool_call>{CALL}</tool_call>", {"expression": QUESTION})
    step = env.step(str(VALUE))  # a reply without a tool call is the agent's answer
    assert step.done and step.termination == envs.Termination.COMPLETED and step.verdict.passed
    assert step.reward == 1.0 and seen == [str(VALUE)]
    # The next episode in the same env instance (the worker reuses it): a fresh key, the same gateway.
    obs = env.reset(TASK, seed=1)
    step = env.step("7")
    assert step.done and not step.verdict.passed and step.reward == 0.0
  finally:
    env.close()


def test_a_reward_returned_by_the_agent_is_the_reward():
  def agent(task, client):
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                           tools=[t.schema() for t in calculator_agent.TOOLS])
    return 0.25 if reply.choices[0].message.content == "half" else 0.0

  env = _env(agent)
  try:
    env.reset(TASK, 0)
    step = env.step("half")
    assert step.done and step.reward == 0.25 and step.verdict.passed and step.verdict.evidence == {"returned": 0.25}
  finally:
    env.close()


def test_a_harness_that_rewrites_history_gets_a_recorded_break_not_a_silent_mismatch():
  errors, answered = [], threading.Event()

  def agent(task, client):
    tools = [t.schema() for t in calculator_agent.TOOLS]
    messages = [{"role": "user", "content": task.payload["question"]}]
    message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
    # A harness that re-renders the reply in its own words (and keeps the call): the policy never wrote this.
    messages += [{"role": "assistant", "content": "Let me compute.", "tool_calls": [
        c.model_dump() for c in message.tool_calls]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "13"}]
    try:
      client.chat.completions.create(model="m", messages=messages, tools=tools)
    except openai.APIStatusError as e:
      errors.append((e.status_code, str(e)))
      answered.set()
      raise

  env = _env(agent)
  try:
    env.reset(TASK, 0)
    step = env.step(CALL)
    assert step.done and step.termination == envs.Termination.ENV_ERROR
    assert step.outcome == envs.Outcome.HISTORY_REWRITTEN
    assert "message 1 differs" in step.info["break"]
    assert answered.wait(10) and errors[0][0] == 409 and "history" in errors[0][1]
  finally:
    env.close()


def test_two_new_messages_or_a_user_turn_are_breaks_too():
  def agent(task, client):
    tools = [t.schema() for t in calculator_agent.TOOLS]
    messages = [{"role": "user", "content": "q"}]
    message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
    messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "are you sure?"}]
    client.chat.completions.create(model="m", messages=messages, tools=tools)

  env = _env(agent)
  try:
    env.reset(TASK, 0)
    step = env.step("5")
    assert step.outcome == envs.Outcome.HISTORY_REWRITTEN and "exactly one tool message" in step.info["break"]
  finally:
    env.close()


def test_a_malformed_request_gets_a_400_with_a_message_and_the_episode_goes_on():
  statuses = []

  def agent(task, client):
    tools = [t.schema() for t in calculator_agent.TOOLS]
    for bad in ([{"role": "robot", "content": "hi"}], [{"role": "user", "content": {"x": 1}}]):
      try:
        client.chat.completions.create(model="m", messages=bad, tools=tools)
      except openai.BadRequestError as e:
        statuses.append((e.status_code, e.body["message"]))
    try:  # tools that are not the env's: the prompt the policy sees could not be what the agent asked for
      client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=[])
    except openai.BadRequestError as e:
      statuses.append((e.status_code, e.body["message"]))
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=tools)
    return float(reply.choices[0].message.content == "ok")

  env = _env(agent)
  try:
    obs = env.reset(TASK, 0)
    assert obs.text == "q"
    assert [s for s, _ in statuses] == [400, 400, 400]
    assert "role='robot'" in statuses[0][1] and "content" in statuses[1][1] and "tools differ" in statuses[2][1]
    step = env.step("ok")
    assert step.done and step.reward == 1.0
  finally:
    env.close()


def test_raw_http_errors_name_the_problem():
  """Without the client: a body that is not JSON, streaming, a wrong path and a stale key."""
  import urllib.error
  import urllib.request
  release = threading.Event()

  def agent(task, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                   tools=[t.schema() for t in calculator_agent.TOOLS])
    release.wait(10)
    return 0.0

  env = _env(agent)
  try:
    env.reset(TASK, 0)
    key = env.episode.key

    def post(path, body, key=key):
      req = urllib.request.Request(env.gateway.base_url.removesuffix("/v1") + path, data=body,
                                   headers={"Authorization": f"Bearer {key}"}, method="POST")
      try:
        with urllib.request.urlopen(req, timeout=10) as r:
          return r.status, json.loads(r.read())
      except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

    status, body = post("/v1/chat/completions", b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "q"}],
                                                            "stream": True}).encode())
    assert status == 400 and "stream" in body["error"]["message"]
    status, body = post("/v1/completions", b"{}")
    assert status == 404 and "/v1/chat/completions" in body["error"]["message"]
    status, body = post("/v1/chat/completions", b"{}", key="not-the-episode")
    assert status == 401
    # A second request while the first waits for the policy.
    status, body = post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "q"}],
                                                            "tools": [t.schema() for t in calculator_agent.TOOLS]})
                        .encode())
    assert status == 409 and "one request at a time" in body["error"]["message"]
    release.set()
    assert env.step("1").done
  finally:
    env.close()


def test_an_agent_that_raises_or_never_calls_ends_as_env_error():
  def raises(task, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                   tools=[t.schema() for t in calculator_agent.TOOLS])
    raise KeyError("tool registry")

  env = _env(raises)
  try:
    env.reset(TASK, 0)
    step = env.step("x")
    assert step.termination == envs.Termination.ENV_ERROR and "KeyError" in step.info["error"]
  finally:
    env.close()
  env = _env(lambda task, client: 1.0)
  try:
    with pytest.raises(envs.EnvError, match="returned 1.0 before calling the model"):
      env.reset(TASK, 0)
  finally:
    env.close()
  env = _env(lambda task, client: threading.Event().wait(5), timeout=0.5)
  try:
    with pytest.raises(envs.EnvError, match=r"neither called the model nor returned within 0.5 s"):
      env.reset(TASK, 0)
  finally:
    env.close()


def test_reply_messages_follow_the_templates_tool_call_convention():
  names = ["calc"]
  tagged = gateway.reply_message(f"Sure. <tool_call>{CALL}</tool_call>", names)
  assert tagged.text == "Sure." and tagged.calls == (("calc", json.dumps({"expression": QUESTION})),)
  assert gateway.reply_message(CALL, names).calls == tagged.calls  # bare JSON (Llama 3 style)
  assert gateway.reply_message('{"name": "other", "arguments": {}}', names).calls == ()  # not one of its tools
  assert gateway.reply_message("42", names) == gateway.Message("assistant", "42")
  body = gateway.completion(tagged, "r1", "policy")
  assert body["choices"][0]["finish_reason"] == "tool_calls"
  assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
      "expression": QUESTION}


@pytest.mark.slow
def test_an_openai_client_agent_trains_two_grpo_iterations_through_the_gateway(tmp_path, smollm2_dir):
  """SmolLM2's tokenizer and template, a tiny random model, sandboxed local workers: the demonstrations go
  through the gateway with their tokens exactly as scripted, and 2 GRPO iterations store records that keep the
  trajectory contract."""
  from jaxagent import cli, config as config_lib, trajectory as tr, trajectory_store
  from jaxagent.train import loop
  from jaxagent.train.run import build_run
  overrides = [f"model.tokenizer={smollm2_dir}", "train.bc_steps=4", "train.eval_episodes=0"]
  run = build_run(config_lib.load("calculator_agent_tiny_cpu", overrides), tmp_path / "demos", echo=False)
  try:
    demos = loop.demonstrations(run, 4, seed=0)
    chat = run.interface.chat
  finally:
    run.close()
  for t in demos:
    t.validate()
    assert t.termination == envs.Termination.COMPLETED and t.verifier.passed, t.turns
    script = calculator_agent.demo(envs.Task(t.task.id, "train", {"question": t.task.prompt}, "v"))
    for turn, line in zip(t.turns, script):
      start, stop = turn.action.span
      assert list(t.tokens[start:stop]) == chat.action_tokens(line)  # exact token capture
      assert (t.roles[start:stop] == tr.Role.POLICY).all() and t.loss_mask[start:stop].all()
    obs = t.turns[0].observation
    assert obs.text == str(calculator.safe_eval(t.task.prompt))
    assert (t.roles[obs.span[0]:obs.span[1]] == tr.Role.TOOL).all() and not t.loss_mask[obs.span[0]:obs.span[1]].any()
  run_dir = tmp_path / "job"
  assert cli.main(["train", "calculator_agent_tiny_cpu", "--run-dir", str(run_dir),
                   *[x for o in overrides for x in ("--set", o)]]) == 0
  stored = list(trajectory_store.read(run_dir / "trajectories"))
  assert len(stored) == 2 * 2 * 4
  for t in stored:
    t.validate()  # the contract checker: no violation
    assert np.isfinite(t.behavior_logprobs[t.loss_mask]).all()
  lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [x["iteration"] for x in lines if "loss" in x] == [1, 2]


def test_an_episodes_own_system_message_frames_its_prompt(smollm2_dir):
  """SmolLM2's template has no place for tools: the tools block follows the episode's own system message too."""
  import models
  from jaxagent.chat import make_chat
  chat = make_chat(models.HFTokenizer(smollm2_dir), "template", tools=[t.schema() for t in calculator_agent.TOOLS],
                   system_prompt="configured")
  decode = lambda stream: chat.tokenizer.decode(stream.tokens(0, len(stream)))
  own, configured = decode(chat.prompt("2*3", system="Be brief.")), decode(chat.prompt("2*3"))
  assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calc"' in own
  assert configured.startswith("<|im_start|>system\nconfigured\n\n# Tools")
  assert own.endswith("<|im_start|>user\n2*3<|im_end|>\n<|im_start|>assistant\n") and own.endswith(
      configured[configured.index("<|im_start|>user"):])
