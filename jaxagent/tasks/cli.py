"""`jaxagent tasks generate | filter | check`: the task pipeline and the contamination report.

  jaxagent tasks generate terminal -n 10000 --out train.jsonl          the env's generator, timed
  jaxagent tasks filter train.jsonl --out kept.jsonl [--policy RUN]    reference solutions (+ policy samples)
  jaxagent tasks check terminal [--train kept.jsonl] [--eval eval.jsonl]  near-duplicates between splits

A trainer reads a filtered file with `--set tasks.train_file=kept.jsonl`.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import envs
from envs import pool as pool_lib
from jaxagent import seeds
from jaxagent.tasks import contamination, pipeline


def _options(pairs) -> dict:
  out = {}
  for pair in pairs or ():
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise SystemExit(f"tasks: error: --option {pair!r}: expected KEY=VALUE")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def _env(name: str) -> str:
  try:
    envs.check_name(name)
  except envs.UnknownEnvError as e:
    raise SystemExit(f"tasks: error: {e}") from None
  return name


def _cmd_generate(args) -> int:
  env = _env(args.env)
  t0 = time.perf_counter()
  tasks = pipeline.generate(env, args.split, args.n, args.seed, **_options(args.option))
  seconds = time.perf_counter() - t0
  pipeline.write_jsonl(args.out, env, tasks)
  distinct = len({contamination.task_text(t) for t in tasks})
  print(pipeline.throughput_line(f"generated {env}/{args.split}", len(tasks), seconds)
        + f" ({distinct} distinct) -> {args.out}")
  return 0


def _read(path: str):
  try:
    return pipeline.read_jsonl(path)
  except (OSError, ValueError) as e:
    raise SystemExit(f"tasks: error: {e}") from None


def _cmd_filter(args) -> int:
  env_in_file, tasks = _read(args.file)
  env = _env(args.env or env_in_file or "")
  if env_in_file and args.env and env_in_file != args.env:
    raise SystemExit(f"tasks: error: --env {args.env!r} but {args.file} holds {env_in_file!r} tasks")
  t0 = time.perf_counter()
  runs = pipeline.execute(env, tasks, kind=args.pool, workers=args.workers, slots=args.slots, seed=args.seed,
                          progress=not args.quiet)
  seconds = time.perf_counter() - t0
  reasons = collections.Counter(r.reason for r in runs)
  print(pipeline.throughput_line(f"executed the reference solutions ({args.pool} pool, {args.workers} workers)",
                                 len(runs), seconds))
  print(f"  solvable {reasons[pipeline.SOLVED]}/{len(runs)}; broken: "
        + (", ".join(f"{k}={v}" for k, v in sorted(reasons.items())
                     if k != pipeline.SOLVED and k not in pipeline.INFRASTRUCTURE) or "none"))
  kept = [r.task for r in runs if r.solved]
  unknown = [r for r in runs if r.infrastructure]
  if unknown:
    print(f"  {len(unknown)} task(s) failed twice for infrastructure reasons (neither kept nor broken: rerun the "
          "filter on them): " + ", ".join(r.task.id for r in unknown[:5]))
  report = {"env": env, "tasks": len(runs), "seconds": seconds, "reasons": dict(reasons),
            "broken": [{"id": r.task.id, "reason": r.reason, "detail": r.detail} for r in runs
                       if not r.solved and not r.infrastructure],
            "infrastructure": [{"id": r.task.id, "reason": r.reason, "detail": r.detail} for r in unknown]}
  if args.policy:
    t0 = time.perf_counter()
    from jaxagent.train import rollouts  # JAX and the trainer: only here
    wins = rollouts.policy_outcomes(args.policy, kept, args.samples, seed=args.seed)
    seconds = time.perf_counter() - t0
    always, never = int((wins == args.samples).sum()), int((wins == 0).sum())
    print(pipeline.throughput_line(f"sampled the policy {args.samples}x", len(kept), seconds))
    print(f"  always solved {always}, never solved {never}, frontier {len(kept) - always - never}")
    report.update(policy=str(args.policy), samples=args.samples, always_solved=always, never_solved=never,
                  successes={t.id: int(w) for t, w in zip(kept, wins)})
    kept = [t for t, w in zip(kept, wins) if 0 < w < args.samples]
  pipeline.write_jsonl(args.out, env, kept)
  print(f"kept {len(kept)}/{len(runs)} -> {args.out}")
  if args.report:
    Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
  return 0


def _cmd_check(args) -> int:
  env = _env(args.env)
  spec = envs.get(env)
  train = (_read(args.train)[1] if args.train
           else spec.tasks("train", args.n, args.seed, **_options(args.option)))
  # The held-out tasks `jaxagent train` with run.seed=--seed evaluates on (the same seed derivation).
  held = (_read(args.eval)[1] if args.eval
          else spec.tasks(args.split, args.n_eval, seeds.held_out(args.seed, args.split), **_options(args.option)))
  t0 = time.perf_counter()
  report = contamination.check(train, held, threshold=args.threshold, describe=spec.describe)
  print(f"{env}: {report.line()} [{time.perf_counter() - t0:.1f} s]")
  for m in report.matches[:args.show]:
    print(f"  {m.held_out} ~ {m.train}  similarity {m.similarity:.2f}{' (exact)' if m.exact else ''}")
  leaked = report.fraction > args.max_contamination
  print("CONTAMINATED" if leaked else "clean", f"(tolerated: {args.max_contamination:.1%})")
  return 1 if leaked else 0


def register(subparsers) -> None:
  """Adds `tasks` with its subcommands to a `jaxagent` argparse subparsers object."""
  p = subparsers.add_parser("tasks", help="task pipeline: generate, filter by solvability, check contamination")
  sub = p.add_subparsers(dest="tasks_command", required=True)

  q = sub.add_parser("generate", help="the env's task generator -> a JSONL task file (timed)")
  q.add_argument("env", help="registered name or package.module:ATTR naming an EnvSpec")
  q.add_argument("-n", type=int, default=1000, help="tasks to generate")
  q.add_argument("--split", choices=envs.SPLITS, default="train")
  q.add_argument("--seed", type=int, default=0)
  q.add_argument("--option", action="append", metavar="KEY=VALUE", help="generator keyword (JSON value), "
                 "e.g. mutations=3 for code_repair")
  q.add_argument("--out", required=True)
  q.set_defaults(func=_cmd_generate)

  q = sub.add_parser("filter", help="run every task's reference solution in an env pool (drop broken tasks); "
                     "with --policy also drop tasks a trained policy always or never solves")
  q.add_argument("file", help="JSONL task file (jaxagent tasks generate)")
  q.add_argument("--env", help="the env (default: the one named in the file)")
  q.add_argument("--out", required=True, help="the kept tasks (JSONL)")
  q.add_argument("--report", help="JSON: reasons per broken task, policy successes per task")
  q.add_argument("--pool", choices=pool_lib.POOL_KINDS[:3], default="local")
  q.add_argument("--workers", type=int, default=2)
  q.add_argument("--slots", type=int, default=None, help="episodes in flight (default: 2 per worker)")
  q.add_argument("--seed", type=int, default=0)
  q.add_argument("--policy", metavar="RUN_DIR", help="a training run: its latest checkpoint samples each task")
  q.add_argument("--samples", type=int, default=8, help="with --policy: samples per task")
  q.add_argument("--quiet", action="store_true", help="no progress bar")
  q.set_defaults(func=_cmd_filter)

  q = sub.add_parser("check", help="near-duplicates of held-out tasks among train tasks; exit 1 when above "
                     "--max-contamination")
  q.add_argument("env", help="registered name or package.module:ATTR naming an EnvSpec")
  q.add_argument("--train", help="JSONL train tasks (default: -n from the env's generator)")
  q.add_argument("--eval", help="JSONL held-out tasks (default: --n-eval of --split from the generator)")
  q.add_argument("-n", type=int, default=10000)
  q.add_argument("--n-eval", type=int, default=1000)
  q.add_argument("--split", choices=("tune", "eval"), default="eval")
  q.add_argument("--seed", type=int, default=0)
  q.add_argument("--option", action="append", metavar="KEY=VALUE")
  q.add_argument("--threshold", type=float, default=0.8, help="estimated Jaccard of a near-duplicate")
  q.add_argument("--max-contamination", type=float, default=0.0)
  q.add_argument("--show", type=int, default=10, help="matches to list")
  q.set_defaults(func=_cmd_check)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="jaxagent")
  register(parser.add_subparsers(dest="command", required=True))
  args = parser.parse_args(["tasks", *(sys.argv[1:] if argv is None else argv)])
  return args.func(args)
