"""The default env (calculator) with heavy-tailed tool latency, for bench/freshness.py.

Every step sleeps a lognormal time (median `JAXAGENT_BENCH_LATENCY_MEDIAN_S`, shape `..._SIGMA`, capped at
`..._CAP_S`; defaults 0.02 s, 1.5, 5 s: bench/rollout.py's), drawn from the episode's seed and turn, so every
mode waits the same times for the same episode. Use it as `env.name=bench._latency_env:SPEC`.
"""

from __future__ import annotations

import math
import os
import random
import time

from envs import EnvSpec
from envs.builtin import calculator


def _setting(name: str, default: float) -> float:
  return float(os.environ.get(f"JAXAGENT_BENCH_LATENCY_{name}", default))


class SlowCalculatorEnv(calculator.CalculatorEnv):
  name = "slow_calculator"

  def _reset(self, task, seed):
    self._latency_seed = seed
    return super()._reset(task, seed)

  def step(self, action_text):
    draw = random.Random(f"{self._latency_seed}/{self.turn}").lognormvariate(
        math.log(_setting("MEDIAN_S", 0.02)), _setting("SIGMA", 1.5))
    time.sleep(min(draw, _setting("CAP_S", 5.0)))
    return super().step(action_text)


SPEC = EnvSpec(name="slow_calculator", description="calculator with lognormal tool latency (bench)",
               make=SlowCalculatorEnv, tasks=calculator.tasks, demo=calculator.demo,
               version_sources=(SlowCalculatorEnv, calculator.CalculatorEnv))
