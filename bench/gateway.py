"""The gateway's cost per model call, against the plain env path, in one run.

    .venv/bin/python bench/gateway.py [--episodes 200] [--kinds inprocess local]

The same calculator episodes (reset, one calc call, the answer) played two ways:
  env      the calculator env: the action text is parsed and stepped in the worker;
  gateway  the calculator task as an OpenAI-client ReAct agent (envs/builtin/calculator_agent.py): each action
           answers the agent's pending chat-completions request over the worker's loopback HTTP, the agent's
           `openai` client parses it, runs the tool and sends its next request, which the env checks (the
           extension rule) and returns as the observation.
  mcp      the calculator env with `env.tools` = the example MCP server (envs/builtin/mcp_arithmetic.py): the
           first call is `multiply` (a `tools/call` to the episode's server), then the answer; each reset
           starts the episode's server.
through a pool of each `--kind` (inprocess: threads in this process, the env's own cost; local: a worker
process, what training sees). Printed: median and p90 microseconds per step (an action in, the observation out)
and per reset, and the gateway / env and mcp / env ratios of the step medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs.builtin import calculator  # noqa: E402


MCP_SERVER = "mcp:stdio:python -m envs.builtin.mcp_arithmetic"


def _episodes(kind: str, path: str, n: int) -> dict[str, list[float]]:
  tasks = calculator.tasks("train", n, seed=0)
  times: dict[str, list[float]] = {"reset": [], "step": []}
  env, syntax, tools = {"env": ("calculator", "line", ()), "gateway": ("calculator_agent", "json", ()),
                        "mcp": ("calculator", "json", (MCP_SERVER,))}[path]
  cfg = envs.pool.PoolConfig(env=env, kind=kind, num_workers=1, action_syntax=syntax, tools=tools)
  with envs.pool.Pool(cfg, num_slots=1) as pool:
    for i, task in enumerate(tasks):
      q, value = task.payload["question"], calculator.safe_eval(task.payload["question"])
      calc, answer = {"env": (f"calc {q}", f"answer {value}"),
                      "gateway": (json.dumps({"name": "calc", "arguments": {"expression": q}}), str(value)),
                      "mcp": (json.dumps({"name": "multiply", "arguments": {"a": value, "b": 1}}),
                              json.dumps({"name": "answer", "arguments": {"answer": str(value)}}))}[path]
      start = time.perf_counter()
      pool.reset(0, task, i)
      times["reset"].append(time.perf_counter() - start)
      for action in (calc, answer):
        start = time.perf_counter()
        result = pool.step(0, action)
        times["step"].append(time.perf_counter() - start)
      if not (result.done and result.verdict is not None and result.verdict.passed):
        raise RuntimeError(f"{path} via {kind}: the scripted episode did not pass: {result}")
  return times


def _us(xs: list[float], q: float) -> float:
  xs = sorted(xs[len(xs) // 10:]) or sorted(xs)  # the first tenth warms up (imports, the gateway's first start)
  return 1e6 * xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--episodes", type=int, default=200)
  ap.add_argument("--kinds", nargs="+", default=["inprocess", "local"], choices=["inprocess", "local"])
  ap.add_argument("--paths", nargs="+", default=["env", "gateway", "mcp"], choices=["env", "gateway", "mcp"])
  args = ap.parse_args(argv)
  print(f"{'pool':10s} {'path':8s} {'step p50 us':>12s} {'step p90 us':>12s} {'reset p50 us':>13s}")
  for kind in args.kinds:
    result = {path: _episodes(kind, path, args.episodes) for path in dict.fromkeys(["env", *args.paths])}
    for path, t in result.items():
      print(f"{kind:10s} {path:8s} {_us(t['step'], 0.5):12.0f} {_us(t['step'], 0.9):12.0f} "
            f"{_us(t['reset'], 0.5):13.0f}")
    for path in result:
      if path != "env":
        ratio = _us(result[path]["step"], 0.5) / _us(result["env"]["step"], 0.5)
        extra = _us(result[path]["step"], 0.5) - _us(result["env"]["step"], 0.5)
        print(f"{kind:10s} {path} / env per step: {ratio:.1f}x (+{extra:.0f} us per call)")


if __name__ == "__main__":
  main()
