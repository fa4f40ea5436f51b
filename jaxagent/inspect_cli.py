"""`jaxagent inspect PATH`: stored trajectories as JSON lines, coloured text, or an HTML page.

Bad records are reported on stderr (file and record index) and skipped; every other record is still shown;
the exit status is 1 when any record was bad. Rendering (escaped: stored text is untrusted) lives in
jaxagent/trajectory_render.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

from envs import Outcome, Termination
from jaxagent.trajectory import Role, Trajectory
from jaxagent.trajectory_render import render_html, render_text


def summary(t: Trajectory) -> dict[str, Any]:
  """The `--format jsonl` object: the summary keys below, no more (use `--full` for the whole record)."""
  return {
      "schema": t.schema,
      "task": {"id": t.task.id, "split": t.task.split, "version": t.task.version, "prompt": t.task.prompt},
      "env": {"name": t.env.name, "version": t.env.version, "seed": t.env.seed},
      "policy_version": t.policy_version,
      "termination": t.termination.value,
      "reward": {"total": t.reward.total, "components": dict(t.reward.components), "gamma": t.reward.gamma},
      "turns": [{
          "action": {"text": turn.action.text, "valid": turn.action.valid},
          "observation": None if turn.observation is None else {
              "text": turn.observation.text, "truncated": turn.observation.truncated,
              "original_bytes": turn.observation.original_bytes},
          "reward": turn.reward, "policy_version": turn.policy_version, "t_decode_s": turn.t_decode_s,
          "t_env_s": turn.t_env_s} for turn in t.turns],
      "tokens": t.tokens.tolist(),
      "roles": [Role(int(r)).name.lower() for r in t.roles],
      "loss_mask": t.loss_mask.astype(int).tolist(),
      "behavior_logprobs": [None if x != x else x for x in t.behavior_logprobs.tolist()],   # NaN -> null
      "timing": {"reset_s": t.timing.reset_s, "verify_s": t.timing.verify_s},
      "verifier": {"name": t.verifier.name, "version": t.verifier.version, "passed": t.verifier.passed},
  }


def _verdict(t: Trajectory) -> str:
  return {True: "pass", False: "fail", None: "none"}[t.verifier.passed]


def final_outcome(t: Trajectory) -> str:
  """How the episode ended, at the env's finer grain (its last step's outcome; the termination before any)."""
  return t.turns[-1].outcome if t.turns else t.termination.value


def keep(t: Trajectory, args) -> bool:
  """The filters of `jaxagent inspect` (every one given must hold)."""
  return ((args.min_reward is None or t.reward.total >= args.min_reward)
          and (args.max_reward is None or t.reward.total <= args.max_reward)
          and (not args.verdict or _verdict(t) in args.verdict)
          and (not args.termination or t.termination.value in args.termination)
          and (not args.outcome or final_outcome(t) in args.outcome)
          and (not args.split or t.task.split in args.split)
          and (not args.task or any(t.task.id == x or t.task.id.startswith(x) for x in args.task)))


def _cmd_inspect(args) -> int:
  from jaxagent import trajectory_store

  tokenizer = None
  if args.tokenizer:
    import models
    tokenizer = models.load_tokenizer(args.tokenizer)
  out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
  errors: list[trajectory_store.TrajectoryReadError] = []
  try:
    records = (t for t in trajectory_store.read(args.path, errors) if keep(t, args))
    if args.limit is not None:
      records = itertools.islice(records, args.limit)
    if args.format == "html":
      out.write(render_html(list(records), tokenizer, errors=[str(e) for e in errors]))
    else:
      color = args.color == "always" or (args.color == "auto" and out.isatty())
      for t in records:
        if args.format == "jsonl":
          obj = t.to_dict(arrays_as="lists") if args.full else summary(t)
          out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        else:
          out.write(render_text(t, tokenizer, color) + "\n")
  except FileNotFoundError as e:
    print(f"jaxagent inspect: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:   # `jaxagent inspect … | head`
    sys.stdout = open("/dev/null", "w", encoding="utf-8")
    return 0
  finally:
    if out is not sys.stdout:
      out.close()
  for e in errors:
    print(f"jaxagent inspect: error: {e}", file=sys.stderr)
  return 1 if errors else 0


def register(subparsers) -> None:
  """Adds `inspect` to the `jaxagent` command line."""
  p = subparsers.add_parser("inspect", help="show stored trajectories (jsonl, coloured text, html)")
  p.add_argument("path", help="an ArrayRecord trajectory file or a directory of them")
  p.add_argument("--format", default="jsonl", choices=("jsonl", "text", "html"))
  p.add_argument("--full", action="store_true", help="jsonl: the complete record, not the summary keys")
  p.add_argument("--tokenizer", help="'byte', an HF tokenizer dir or npm:<package> (the run's model.tokenizer): "
                 "show the decoded token stream by role")
  p.add_argument("--color", default="auto", choices=("auto", "always", "never"), help="text format")
  p.add_argument("-o", "--output", help="write here instead of stdout")
  f = p.add_argument_group("filters (each given must hold; repeat a flag for any of several values)")
  f.add_argument("--min-reward", type=float, help="return >= this")
  f.add_argument("--max-reward", type=float, help="return <= this")
  f.add_argument("--verdict", action="append", choices=("pass", "fail", "none"), help="the verifier's verdict")
  f.add_argument("--termination", action="append", choices=[x.value for x in Termination])
  f.add_argument("--outcome", action="append", choices=[x.value for x in Outcome],
                 help="how the episode ended at the env's grain (its last step's outcome)")
  f.add_argument("--split", action="append", choices=("train", "tune", "eval"))
  f.add_argument("--task", action="append", help="a task id, or the start of one")
  f.add_argument("--limit", type=int, help="show at most this many")
  p.set_defaults(func=_cmd_inspect)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(prog="jaxagent")
  register(parser.add_subparsers(dest="command", required=True))
  a = parser.parse_args()
  sys.exit(a.func(a))
