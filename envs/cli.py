"""`jaxagent envs list | check ENV | swe-corpus | serve ENV`: registered envs, measured replay rate, the swe
corpus's scale report, worker server.

ENV is a registered name (built-ins and installed `jaxagent.envs` entry points, which `list` shows) or
`package.module:ATTR` naming an EnvSpec; a bad one exits 2 with one line saying what is valid.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import envs
from envs import pool as pool_lib


def _cmd_list(args) -> int:
  for name in envs.names():
    spec = envs.get(name)
    print(f"{name}  {spec.version}  {spec.description}")
  return 0


def _bad_env(name: str) -> str | None:
  """The one-line error for an env name that does not resolve, else None."""
  try:
    envs.check_name(name)
  except envs.UnknownEnvError as e:
    return f"envs: error: {e}"
  return None


def check(env: str, *, episodes: int = 16, split: str = "train", kind: str = "inprocess", seed: int = 0,
          workers: int = 1) -> dict:
  """Run each episode twice with the same seed and actions (the scripted demo, with one invalid action
  inserted first); returns replay rate, step latencies (seconds) and outcome counts."""
  spec = envs.get(env)
  if spec.needs_sandbox and kind == "inprocess":
    kind = "local"  # its actions run real programs: only inside a worker sandbox.
  tasks = spec.tasks(split, episodes, seed)
  runs, latencies, outcomes = [], [], collections.Counter()
  with pool_lib.make_pool(episodes, env=env, kind=kind, num_workers=workers) as pool:
    for _ in range(2):
      obs = pool.reset_many(range(episodes), tasks, [seed + i for i in range(episodes)])
      traces = [[o.text] for o in obs]
      scripts = [["?? not an action"] + spec.demo(t, seed + i) for i, t in enumerate(tasks)]
      for turn in range(max(map(len, scripts))):
        rows = [i for i, s in enumerate(scripts) if turn < len(s) and not pool.slots[i].done]
        if not rows:
          break
        t0 = time.perf_counter()
        results = pool.step_many(rows, [scripts[i][turn] for i in rows])
        per_step = (time.perf_counter() - t0) / len(rows)
        for i, r in zip(rows, results):
          latencies.append(float(r.info.get("env_s", per_step)))
          outcomes[r.outcome.value] += 1
          traces[i].append((r.observation.text, r.reward, r.done, r.termination))
      runs.append(traces)
  same = sum(a == b for a, b in zip(*runs))
  lat = sorted(latencies)
  q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
  return dict(env=env, version=spec.version, episodes=episodes, replay_rate=same / episodes,
              latency_s=dict(p50=q(0.5), p90=q(0.9), p99=q(0.99), max=lat[-1], mean=statistics.fmean(lat)),
              outcomes=dict(outcomes), deterministic=spec.deterministic, pool=kind)


def _cmd_check(args) -> int:
  if (error := _bad_env(args.env)) is not None:
    print(error, file=sys.stderr)
    return 2
  r = check(args.env, episodes=args.episodes, split=args.split, kind=args.pool, seed=args.seed,
            workers=args.workers)
  lat = r["latency_s"]
  print(f"{r['env']} {r['version']} ({r['pool']} pool, {r['episodes']} episodes x 2)")
  print(f"  deterministic replay rate: {r['replay_rate']:.1%}")
  print("  step latency ms: " + " ".join(f"{k}={v * 1e3:.2f}" for k, v in lat.items()))
  print("  outcomes: " + " ".join(f"{k}={v}" for k, v in sorted(r["outcomes"].items())))
  return 0 if r["replay_rate"] == 1.0 or not r["deterministic"] else 1


def _cmd_serve(args) -> int:
  from envs import server
  if (error := _bad_env(args.env)) is not None:
    print(error, file=sys.stderr)
    return 2
  return server.serve_args(args)


def register(subparsers) -> None:
  """Adds `envs` with its subcommands to a `jaxagent` argparse subparsers object."""
  p = subparsers.add_parser("envs", help="environments: list, check replay/latency, serve a worker")
  sub = p.add_subparsers(dest="envs_command", required=True)
  q = sub.add_parser("list", help="one line per registered env (entry points included): name, version, "
                     "description")
  q.set_defaults(func=_cmd_list)
  q = sub.add_parser("check", help="run episodes twice with the same seeds/actions: replay rate, latency, outcomes")
  q.add_argument("env", help="registered name or package.module:ATTR naming an EnvSpec")
  q.add_argument("--episodes", type=int, default=16)
  q.add_argument("--split", choices=envs.SPLITS, default="train")
  q.add_argument("--pool", choices=pool_lib.POOL_KINDS[:2], default="inprocess")
  q.add_argument("--workers", type=int, default=1)
  q.add_argument("--seed", type=int, default=0)
  q.set_defaults(func=_cmd_check)
  q = sub.add_parser("swe-corpus", help="the swe env's corpus: fetch the PyPI packages, run their tests, mine "
                     "mutants (cached), print the scale report")
  from envs.builtin import swe_corpus
  swe_corpus.add_args(q)
  q.set_defaults(func=swe_corpus.cmd_report)
  q = sub.add_parser("serve", help="host env instances behind the wire protocol (unix socket or loopback TCP)")
  from envs.server import add_serve_args
  add_serve_args(q)
  q.set_defaults(func=_cmd_serve)


def main(argv: list[str] | None = None) -> int:
  """`python -m envs.cli list|check|serve ...` (the same as `jaxagent envs ...`, without jaxagent)."""
  parser = argparse.ArgumentParser(prog="python -m envs.cli")
  register(parser.add_subparsers(dest="command", required=True))
  args = parser.parse_args(["envs", *(sys.argv[1:] if argv is None else argv)])
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
