"""The calculator task played by an agent written against the OpenAI chat API: the gateway's example
(`envs/gateway.py`), and a template for bringing your own agent.

The agent is ordinary client code, nothing of jaxagent in it: a ReAct loop that offers the model one tool,
`calc`, runs the calls the model makes, appends the replies as served and the tool results, and returns the
model's final text, which the calculator's verifier scores. The tasks and the verifier are the calculator env's.

    jaxagent train calculator_agent_tiny_cpu            # 2 GRPO iterations through the gateway
"""

from __future__ import annotations

import json

from envs._tools import InvalidAction, Tool
from envs.builtin.calculator import CalculatorVerifier, safe_eval, tasks
from envs.gateway import agent_spec

TOOLS = (Tool.with_arg("calc", "Evaluate an integer expression with + - * and parentheses; returns its value.",
                       "expression", "e.g. 12*7"),)
SYSTEM = "Solve the arithmetic question. Call calc to compute, then reply with the final integer alone."


def run_agent(task, client, max_calls: int = 4):
  """A ReAct loop over `client` (an `openai.OpenAI`); returns the final answer text."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.payload["question"]}]
  tools = [t.schema() for t in TOOLS]
  for _ in range(max_calls):
    message = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
    messages.append(message.model_dump(exclude_none=True))  # the reply as served: the history extends
    if not message.tool_calls:
      return message.content or ""
    for call in message.tool_calls:
      try:
        result = str(safe_eval(str(json.loads(call.function.arguments)["expression"])))
      except (InvalidAction, KeyError, TypeError, json.JSONDecodeError) as e:
        result = f"error: {e}"
      messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
  return ""  # out of calls: scored as wrong


def demo(task, seed: int = 0) -> list[str]:
  """The model's replies that solve `task`: one calc call of the whole question, then the value."""
  question = task.payload["question"]
  return [json.dumps({"name": "calc", "arguments": {"expression": question}}), str(safe_eval(question))]


SPEC = agent_spec("calculator_agent", agent=run_agent, tasks=tasks, tools=TOOLS, verifier=CalculatorVerifier(),
                  demo=demo, description="calculator, played by an OpenAI-client ReAct agent over the gateway")
