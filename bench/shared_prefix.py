"""Shared-prefix updates against unshared ones on a real rollout batch, in one run: update seconds, the tokens the
model computed, and the compiled step's memory.

    .venv/bin/python bench/shared_prefix.py [--config smollm2_calculator_budget_cpu] [--group-sizes 4 8]
        [--rounds 2] [--set KEY=VALUE ...]

For each group size G: the config's run is built (`train.group_size=G`, no cold start, no evaluation), one sync rl
iteration rolls out its B x G trajectories with the policy as loaded (the batch the update trains on: each
group's prompt is shared by its G members, the rest is each member's own), then the same update (the run's
jitted rl step, its micro-batches, LoRA and chunked log-probs) runs on that batch unshared and shared, alternating,
`--rounds` times each from the same state; the best time of each is printed with their ratio. Tokens: real tokens
(`update/tokens_unshared`, `update/tokens_computed`) and the padded slots each layout runs (rows x length).
Memory: XLA's memory analysis of each compiled step (arguments + temporaries; output aliases the donated state).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxagent import config as config_lib  # noqa: E402
from jaxagent.train import learner, rl  # noqa: E402
from jaxagent.train import metrics as metrics_lib  # noqa: E402
from jaxagent.train.run import build_run  # noqa: E402


def _memory_gib(step, state, prepared) -> float:
  compiled = step.lower(state, prepared.batch, jnp.float32(prepared.normalizer), prepared.value_targets,
                        jnp.float32(prepared.value_normalizer)).compile()
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**30


def _shape(batch) -> str:
  return "x".join(map(str, (batch.tokens if batch.shared is None else batch.shared.tokens).shape))


def _slots(batch) -> int:
  layout = batch.tokens if batch.shared is None else batch.shared.tokens
  return int(layout.shape[0] * layout.shape[1])


def bench(config_name: str, group_size: int, rounds: int, overrides: list[str]) -> dict:
  with tempfile.TemporaryDirectory() as root:
    cfg = config_lib.load(config_name, [f"run.root={root}", f"train.group_size={group_size}", "train.bc_steps=0",
                                        "train.eval_episodes=0", "train.plots=false",
                                        "train.dynamic_sampling=false", "train.shared_prefix=on", *overrides])
    run = build_run(cfg, Path(root) / "run")
    try:
      state = run.new_state()
      initial = jax.tree.map(jnp.array, state.train)
      t0 = time.perf_counter()
      state, record = rl.iteration(run, state)
      rollout_s = time.perf_counter() - t0
      trajectories = [t for t in record.stored if t.metadata.get("trained", True)]
      off = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, shared_prefix="off"))
      runs = {"unshared": dataclasses.replace(run, config=off), "shared": run}
      prepared = {name: learner.prepare_batch(r, initial, trajectories) for name, r in runs.items()}
      times: dict[str, list[float]] = {name: [] for name in runs}
      memory = {name: _memory_gib(run.steps.rl, jax.tree.map(jnp.array, initial), prepared[name]) for name in runs}
      print(f"  G={group_size}: {len(trajectories)} trajectories rolled out in {rollout_s:.0f} s; unshared "
            f"{_shape(prepared['unshared'].batch)}, shared {_shape(prepared['shared'].batch)}; compiled step memory "
            f"{memory['unshared']:.2f} / {memory['shared']:.2f} GiB", flush=True)
      for _ in range(rounds + 1):  # the first round compiles
        for name, r in runs.items():
          fresh = jax.tree.map(jnp.array, initial)
          t = time.perf_counter()
          new, _ = learner.update(r, fresh, prepared[name])
          jax.block_until_ready(new.params)
          times[name].append(time.perf_counter() - t)
          print(f"  G={group_size} {name}: {times[name][-1]:.1f} s", flush=True)
    finally:
      run.close()
  stats = prepared["shared"].stats
  return dict(group_size=group_size, trajectories=len(trajectories), rollout_s=rollout_s,
              tokens_unshared=stats[metrics_lib.TOKENS_UNSHARED], tokens_computed=stats[metrics_lib.TOKENS_COMPUTED],
              slots_unshared=_slots(prepared["unshared"].batch), slots_shared=_slots(prepared["shared"].batch),
              unshared_s=min(times["unshared"][1:]), shared_s=min(times["shared"][1:]),
              memory_unshared=memory["unshared"], memory_shared=memory["shared"])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="smollm2_calculator_budget_cpu")
  parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  args = parser.parse_args(argv)
  rows = [bench(args.config, g, args.rounds, args.set) for g in args.group_sizes]
  print(f"\n{args.config}, {jax.devices()[0].device_kind}, best of {args.rounds} updates each")
  print("| G | trajectories | tokens unshared / computed | slots unshared / shared | update s unshared / shared "
        "| speed-up | memory GiB unshared / shared |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['group_size']} | {r['trajectories']} | {r['tokens_unshared']} / {r['tokens_computed']} "
          f"({r['tokens_unshared'] / r['tokens_computed']:.2f}x) | {r['slots_unshared']} / {r['slots_shared']} "
          f"({r['slots_unshared'] / r['slots_shared']:.2f}x) | {r['unshared_s']:.1f} / {r['shared_s']:.1f} "
          f"| {r['unshared_s'] / r['shared_s']:.2f}x | {r['memory_unshared']:.2f} / {r['memory_shared']:.2f} |")


if __name__ == "__main__":
  main()
