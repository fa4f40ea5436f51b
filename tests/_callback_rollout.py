"""One process of tests/test_multihost.py's callback-transport check (run under launch/local.py, N processes).

    python launch/local.py -n 2 --devices-per-process 2 --module tests._callback_rollout -- OUT_DIR [--set k=v ...]

Builds the trainer's rollout (the default model, calculator, sandboxed local env workers), rolls out one GRPO
round's tasks with `rollout.env_transport=host_loop`, then the same tasks (same env seeds, sampling key and
weights) with `callback`: one jitted program whose io_callback, inside shard_map, reaches this process's own
env workers with this process's own rows. Writes OUT_DIR/p<process>.json: per transport, each trajectory's
(task, seed, tokens, roles, behavior log-probs, termination, env worker pid), and the program's exchanges.
Each transport runs twice (the second, warm round's wall time is printed). Exits 1 if the two transports'
first trajectories differ.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from jaxagent import distributed

distributed.initialize_from_env()  # before any JAX computation

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxagent import config as config_lib  # noqa: E402
from jaxagent import seeds  # noqa: E402
from jaxagent.rollout import actors, scheduler  # noqa: E402
from jaxagent.rollout.sampler import Finish  # noqa: E402
from jaxagent.train import rollouts  # noqa: E402
from jaxagent.train.run import build_run  # noqa: E402


def main(argv: list[str]) -> int:
  out, overrides = Path(argv[0]), [a for a in argv[1:] if a != "--set"]
  cfg = config_lib.load("tiny_cpu", ["train.bc_steps=0", "train.eval_episodes=0", "train.plots=false",
                                     "run.name=callback-check", *overrides])
  run = build_run(cfg, Path(tempfile.mkdtemp(prefix="callback-check-")), echo=False)
  # An untrained policy's actions run into the turn budget, which ends the episode after one turn. Handed to
  # the env instead (as bench/grpo_vs_tunix.py does), they are invalid actions answered with an error
  # observation: every episode runs `env.max_turns` turns, so frames are fed and envs stepped mid-program.
  finished = actors.finished_actions

  def budget_is_stop(*args):
    return {i: a if a.finish != Finish.BUDGET else dataclasses.replace(a, finish=Finish.STOP)
            for i, a in finished(*args).items()}

  actors.finished_actions = budget_is_stop
  try:
    state = run.policy.init_state()
    # One round's tasks and env seeds (this process's share of the global batch), rolled out twice.
    tasks = run.new_supplies().for_stage(0).draw(0, 0)
    env_seeds = seeds.episodes(cfg.run.seed, 0, run.rows.local, jax.process_index())
    records, walls = {}, {"host_loop": [], "callback": []}
    exchange, calls = scheduler.Scheduler.exchange, []  # the program's host exchanges, per pass

    def counted(self, *args):
      calls[-1] += 1
      return exchange(self, *args)

    scheduler.Scheduler.exchange = counted
    for transport in ("host_loop", "callback") * 2:  # the second pass is warm: its times are the comparison
      run.rollout.engine.transport = transport
      calls.append(0)
      t0 = time.perf_counter()
      state, trajectories, _ = rollouts.collect(run, state, tasks, env_seeds, group_size=cfg.train.group_size,
                                                rng=run.rollout.key(state.rng, 0, 0))
      walls[transport].append(time.perf_counter() - t0)
      if transport in records:
        continue
      records[transport] = [dict(task=t.task.id, seed=t.env.seed, tokens=t.tokens.tolist(), roles=t.roles.tolist(),
                                 logprobs=np.asarray(t.behavior_logprobs).round(5).tolist(),
                                 termination=t.termination.value, turns=len(t.turns), process=t.metadata["process"],
                                 pid=t.metadata["env_worker_pid"]) for t in trajectories]
  finally:
    run.close()
  same = [(a["task"], a["seed"], a["tokens"], a["roles"]) == (b["task"], b["seed"], b["tokens"], b["roles"])
          for a, b in zip(records["host_loop"], records["callback"])]
  out.mkdir(parents=True, exist_ok=True)
  (out / f"p{jax.process_index()}.json").write_text(json.dumps(
      {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.local_device_count(),
       "exchanges": calls[1], "wall_s": walls, "same": same, **records}))
  print(f"process {jax.process_index()}: {sum(same)}/{len(same)} trajectories equal, {calls[1]} exchanges; "
        f"warm round: host_loop {walls['host_loop'][-1]:.3f} s, callback {walls['callback'][-1]:.3f} s")
  return 0 if same and all(same) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
