"""A test env any policy solves about half the time: one turn, any text; the verifier passes an action whose
UTF-8 bytes sum to an even number. Lets rejection sampling and offline learning keep samples from a random
tiny model (tests only; used as env.name=tests._coin_env:SPEC)."""

import envs


class CoinEnv(envs.Env):
  name = "coin"
  description = "say anything; even byte sums pass"
  parser = envs.ActionParser(tools=("say",), max_chars=64)

  def _reset(self, task, seed):
    return f"coin {task.payload['n']}"

  def _step(self, call):  # never reached: `step` takes any text
    raise envs.InvalidAction("unused")

  def step(self, action_text):
    self.turn += 1
    passed = sum(action_text.encode()) % 2 == 0
    verdict = envs.Verdict(passed, 1.0 if passed else 0.0, {"sum_even": passed}, "coin-v1")
    self.done = True
    return envs.StepResult(envs.Observation("yes" if passed else "no"), {"outcome": verdict.reward}, True,
                           envs.Termination.COMPLETED, verdict=verdict)


SPLITS = {"train": 0, "tune": 1_000_000, "eval": 2_000_000}  # disjoint payloads per split


def tasks(split, n, seed=0):
  return [envs.Task(f"coin-{split}-{seed}-{i}", split, {"n": SPLITS[split] + seed * 10_000 + i}, "1")
          for i in range(n)]


def demo(task, seed=0, **options):
  del task, seed, options
  return ["say hi"]


SPEC = envs.EnvSpec(name="coin", description=CoinEnv.description, make=CoinEnv, tasks=tasks, demo=demo,
                    version_sources=(CoinEnv,))
