"""`jaxagent plan CONFIG --topology v5p-64`: does a config fit a TPU slice? Compiled here, no TPU needed."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_plan(args) -> int:
  import jax

  # Nothing runs on a device: the programs are compiled for the topology's devices. Staying on the CPU keeps a
  # TPU or GPU host's accelerators free and start-up fast.
  jax.config.update("jax_platforms", "cpu")
  from jaxagent import config as config_lib
  from jaxagent import plan

  if not 0.0 <= args.headroom < 1.0:
    raise config_lib.ConfigError(f"--headroom {args.headroom}: a fraction of HBM in [0, 1)")
  try:
    topology = plan.topology(args.topology)
  except plan.TopologyError as e:
    raise config_lib.ConfigError(str(e)) from None
  cfg = config_lib.load(args.config, args.overrides)
  progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
  if args.fit:
    found = plan.fit(cfg, topology, headroom=args.headroom, progress=progress)
    report = found.plan
  else:
    found, report = None, plan.make_plan(cfg, topology, headroom=args.headroom, progress=progress)
  if args.json:
    print(json.dumps(dict(report.to_json(), **({"fit": found.to_json()} if found else {})), indent=1))
  else:
    print("\n".join(report.lines() + (found.lines() if found else [])))
  return 0 if report.fits else 1


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("plan", help="compile every program of a run's RL iteration for a TPU topology on this host "
                     "(libtpu, no TPU): per-device HBM, FLOPs, collectives, roofline time; exit 1 if it does not "
                     "fit")
  p.add_argument("config", help="YAML file, or the name of a config in jaxagent/configs/")
  p.add_argument("--topology", required=True, help="a TPU slice: v5p-64 (accelerator type) or v5p:2x4x4 (chip grid)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config value (repeatable)")
  p.add_argument("--headroom", type=float, default=0.1, help="HBM fraction every program must leave free")
  p.add_argument("--fit", action="store_true", help="search the largest train.tasks_per_iteration (rollout rows) "
                 "and then the smallest train.micro_batches that fit; prints the overrides (each probe compiles)")
  p.add_argument("--json", action="store_true", help="print the plan as JSON (for launch scripts)")
  p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
  p.set_defaults(func=_cmd_plan)
