"""`make_plan(config, topology)`: every program of an RL iteration compiled for a TPU topology, from shapes only.

The run's own builders lay the policy out (`train.run.build_policy` over the topology's devices, abstract: no
weight is allocated), make its steps (`build_steps`) and its sampler (`make_sampler`); each program is lowered on
`ShapeDtypeStruct`s carrying the shardings a run would give its arrays and compiled by libtpu's compiler. What the
compiler reports per device becomes a `Plan`: per program, HBM against the chip's and the roofline time; per
iteration, seconds, tokens/s per chip and MFU, and whether it fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from jaxagent import config as config_lib
from jaxagent import multihost
from jaxagent.assembly import Batch, RouteShape
from jaxagent.config import Config
from jaxagent.plan.compiled import ProgramCost, compile_program
from jaxagent.plan.topologies import GIB, Topology, per_device_bytes
from jaxagent.rollout.sampler import Feed
from jaxagent.train import run as run_lib
from jaxagent.train.value import ValueTargets


@dataclasses.dataclass(frozen=True)
class Iteration:
  """One synchronous RL iteration on the roofline: every program at the chip's peak FLOPs or HBM bandwidth
  (whichever binds), the slowest trajectory decoding every turn's whole action budget."""
  rollout_seconds: float
  update_seconds: float
  reshard_seconds: float
  generated_tokens: int           # over all rows: rows x max_turns x max_new_tokens (capped by the context)
  trained_tokens: int             # train rows x batch length
  chips: int
  peak_flops: float               # all chips, bf16
  model_flops: float              # 6 N per trained token + 2 N per generated token (N: every parameter)
  train_step_flops_ratio: float   # the train step's FLOPs (`train_step_flops`, remat and attention included)
                                  # over 6 N x trained tokens

  @property
  def seconds(self) -> float:
    return self.rollout_seconds + self.update_seconds + self.reshard_seconds

  @property
  def tokens_per_second_per_chip(self) -> float:
    return self.trained_tokens / self.seconds / self.chips if self.seconds else 0.0

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.seconds * self.peak_flops) if self.seconds else 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `jaxagent plan` prints: the layout, every program's cost, the iteration, and whether it fits."""
  topology: Topology
  mesh: dict[str, int]
  params: int                     # the policy's parameters
  rows: int                       # rollout rows (decode slots) over all hosts
  train_rows: int
  batch_length: int
  micro_batches: int
  programs: tuple[ProgramCost, ...]
  iteration: Iteration
  headroom: float                 # the HBM fraction every program must leave free to count as fitting

  @property
  def capacity(self) -> int:
    return self.topology.device_hbm

  def over(self, program: ProgramCost) -> int:
    """Bytes `program` needs beyond the usable HBM (capacity less the headroom); <= 0 when it fits."""
    return program.peak_bytes - int(self.capacity * (1 - self.headroom))

  @property
  def fits(self) -> bool:
    return all(self.over(p) <= 0 for p in self.programs)

  @property
  def worst(self) -> ProgramCost:
    return max(self.programs, key=lambda p: p.peak_bytes)

  def to_json(self) -> dict[str, Any]:
    t = self.topology
    it = self.iteration
    return {
        "topology": t.name, "chip": t.chip.generation, "chips": t.chips, "hosts": t.hosts,
        "devices": len(t.devices), "device_hbm_bytes": t.device_hbm, "device_bf16_flops": t.device_flops,
        "device_hbm_bandwidth": t.device_bandwidth, "mesh": self.mesh, "params": self.params, "rows": self.rows,
        "env_slots_per_host": self.rows // t.hosts, "train_rows": self.train_rows,
        "batch_length": self.batch_length, "micro_batches": self.micro_batches, "headroom": self.headroom,
        "programs": [dict(dataclasses.asdict(p), peak_bytes=p.peak_bytes, seconds=p.seconds(t),
                          bound=p.bound(t), over_bytes=self.over(p), hbm_fraction=p.peak_bytes / self.capacity)
                     for p in self.programs],
        "iteration": dict(dataclasses.asdict(it), seconds=it.seconds,
                          tokens_per_second_per_chip=it.tokens_per_second_per_chip, mfu=it.mfu),
        "fits": self.fits,
    }

  def lines(self) -> list[str]:
    t = self.topology
    gib = lambda b: f"{b / GIB:7.2f}"
    hosts = t.host_devices()
    out = [f"topology {t.name}: {t.chips} chips ({t.chip.device_kind}), {len(t.devices)} devices on {t.hosts} "
           f"hosts ({sorted(set(hosts.values()))[0]} devices each); per device {t.device_hbm / GIB:.1f} GiB HBM, "
           f"{t.device_flops / 1e12:.0f} TFLOP/s bf16, {t.device_bandwidth / 1e12:.2f} TB/s (published chip peaks)",
           f"mesh {self.mesh}; policy {self.params / 1e9:.2f}B parameters; rollout {self.rows} rows "
           f"({self.rows // t.hosts} env slots per host); train batch {self.train_rows} x {self.batch_length} "
           f"tokens in {self.micro_batches} micro-batch(es)",
           "",
           f"{'program':<16}{'args GiB':>9}{'out':>8}{'temp':>8}{'code':>8}{'resident':>9}{'peak':>8}{'of HBM':>8}"
           f"{'GFLOP':>11}{'GB r/w':>9}{'roofline':>11}  collectives (count, MiB)   compile"]
    for p in self.programs:
      coll = " ".join(f"{c.kind} {c.count}/{c.bytes / 2 ** 20:.0f}" for c in p.collectives) or "-"
      out.append(f"{p.name:<16}{gib(p.argument_bytes):>9}{gib(p.output_bytes - p.alias_bytes):>8}"
                 f"{gib(p.temp_bytes):>8}{gib(p.code_bytes):>8}{gib(p.resident_bytes):>9}{gib(p.peak_bytes):>8}"
                 f"{p.peak_bytes / self.capacity:>8.1%}{p.model_flops / 1e9:>11.1f}{p.model_bytes / 1e9:>9.2f}"
                 f"{p.seconds(t) * 1e3:>9.2f}ms  {coll}   {p.compile_seconds:.1f}s")
      if p.refused:
        out.append(f"  {p.name}: refused by the compiler, temporaries alone exceed HBM: {p.refused}")
    for p in self.programs:
      out.append(f"  {p.name}: {p.what}; {p.bound(t)}-bound, x{p.calls:g} per iteration")
    it = self.iteration
    out += ["",
            f"iteration (roofline): {it.seconds:.2f} s = rollout {it.rollout_seconds:.2f} + update "
            f"{it.update_seconds:.2f} + reshard {it.reshard_seconds:.2f}; {it.trained_tokens:,} trained tokens, "
            f"{it.tokens_per_second_per_chip:,.0f} tokens/s per chip, MFU {it.mfu:.1%}; the train step's FLOPs "
            f"(attention, remat) are {it.train_step_flops_ratio:.2f}x 6·N·tokens",
            "GFLOP and GB r/w are per device and call (a decode program: one step): the larger of XLA's count, "
            "which counts a loop's body once (scanned layers), and the model's FLOPs and the bytes a call must "
            "move (weights, KV cache); the JSON has both (flops / bytes_accessed, work_flops / work_bytes)"]
    if self.fits:
      w = self.worst
      out.append(f"fits: every program within {1 - self.headroom:.0%} of {self.capacity / GIB:.1f} GiB per device; "
                 f"the largest is {w.name} at {w.peak_bytes / GIB:.2f} GiB ({w.peak_bytes / self.capacity:.1%})")
    else:
      for p in self.programs:
        if self.over(p) > 0:
          out.append(f"does not fit: {p.name} needs {p.peak_bytes / GIB:.2f} GiB per device, "
                     f"{self.over(p) / GIB:.2f} GiB over {1 - self.headroom:.0%} of {self.capacity / GIB:.1f} GiB")
    return out


def train_step_flops(model: Any, rows: int, length: int, remat: str) -> float:
  """FLOPs of one update of `rows` x `length` tokens, all devices: 6 N per token for the weights (N: every
  parameter a token uses, the unembedding included: a mixture of experts counts its k routed experts), 12 L T N_q H per token for attention scores and values over the whole
  [T, T] square (what every kernel here computes: masked, not skipped), and one more forward (a third of both)
  when layers are rematerialized."""
  tokens = rows * length
  weights = 6.0 * model.num_active_params() * tokens
  attention = 12.0 * model.num_hidden_layers * length * model.num_attention_heads * model.head_dim * tokens
  return (weights + attention) * (4.0 / 3.0 if remat != "none" else 1.0)


def rollout_work(model: Any, rows: int, tokens: int, slots: int) -> float:
  """FLOPs of `rows` rows each running `tokens` new tokens against `slots` cache slots, all devices: 2 N per token
  (N: the parameters a token uses) and 4 L N_q H per token and slot for attention over the whole cache (computed
  over every slot, masked; a sliding layer's ring is counted as a full cache)."""
  per_token = 2.0 * model.num_active_params() + 4.0 * model.num_hidden_layers * slots * (
      model.num_attention_heads * model.head_dim)
  return per_token * rows * tokens


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _batch(cfg: Config, rows: int, length: int, mesh, rules, model_config: models.ModelConfig
           ) -> tuple[Batch, ValueTargets | None]:
  """The abstract update batch a run hands its rl step (`learner.prepare_batch`'s fields and dtypes)."""
  sh = multihost.batch_sharding((rows, length), mesh, rules)
  a = lambda dtype: _abstract((rows, length), dtype, sh)
  truncated = config_lib.truncates(cfg.rollout)
  routes = RouteShape.of(model_config) if run_lib.replays_routes(cfg, model_config) else None
  if routes is not None:
    shape = (rows, length, routes.sparse_layers, routes.experts_per_token)
    routes = _abstract(shape, np.int16, multihost.batch_sharding(shape, mesh, rules))
  batch = Batch(tokens=a(jnp.int32), positions=a(jnp.int32), segment_ids=a(jnp.int32), loss_mask=a(jnp.bool_),
                roles=a(jnp.int8), behavior_logprobs=a(jnp.float32), advantages=a(jnp.float32),
                policy_versions=a(jnp.int32), trajectory_index=a(jnp.int32),
                sampling_thresholds=a(jnp.float32) if truncated else None,
                proximal_logprobs=a(jnp.float32) if cfg.algo.loss == "decoupled_ppo" else None,
                expert_routes=routes)
  values = (ValueTargets(old_values=a(jnp.float32), returns=a(jnp.float32), mask=a(jnp.bool_))
            if cfg.algo.name == "ppo" else None)
  return batch, values


def _host_feed(rows: int, width: int, pad_id: int, mesh, rules) -> Feed:
  return jax.tree.map(lambda x: _abstract(x.shape, x.dtype, multihost.batch_sharding(x.shape, mesh, rules)),
                      Feed.empty(rows, width, pad_id))


GROUPS = {"update": ("train_step", "proximal_logp", "values"), "reshard": ("rollout_copy", "to_rollout", "to_learner"),
          "rollout": ("rollout_feed", "rollout_decode")}


def make_plan(cfg: Config, topology: Topology, *, headroom: float = 0.1,
              progress: Callable[[str], None] | None = None, groups: tuple[str, ...] = tuple(GROUPS),
              compiled: tuple[ProgramCost, ...] = ()) -> Plan:
  """Compiles the programs of one synchronous RL iteration of `cfg` for `topology` (see the module docstring);
  only those of `groups` (`GROUPS`: update, reshard, rollout) when fewer are asked for (`fit`'s probes), and
  none already in `compiled` (programs of this config compiled before: `fit` reuses its probes').

  Raises:
    ConfigError: the config cannot be laid on the topology (the mesh does not divide it: the message names the
      axis and the sizes), or its combination of settings is refused as `jaxagent train` would refuse it.
  """
  with models.compiling_for(topology.devices[0].platform):  # the TPU's kernels, traced on this CPU host
    return _make_plan(cfg, topology, headroom=headroom, progress=progress, groups=groups, compiled=compiled)


@dataclasses.dataclass(frozen=True)
class _Parts:
  """What the run's builders make of a config on a topology, and the sizes every program shares."""
  cfg: Config
  topology: Topology
  io: Any                  # train.run's interface: tokenizer, chat framing
  policy: Any              # train.run's policy: model, layouts, abstract train state
  steps: Any               # train.run's jitted steps
  sampler: Any             # the rollout sampler
  rows: int                # rollout rows over all hosts
  train_rows: int
  length: int              # the context: KV cache slots and the longest update batch
  generated: int           # tokens the slowest trajectory decodes in an iteration


class _Compiler:
  """Compiles the programs a plan asks for (`GROUPS`), reusing any compiled before, and keeps them in order."""

  def __init__(self, groups: tuple[str, ...], compiled: tuple[ProgramCost, ...], progress):
    self.wanted = {name for group in groups for name in GROUPS[group]}
    self.done = {p.name: p for p in compiled}
    self.progress = progress
    self.programs: list[ProgramCost] = []

  def __call__(self, name: str, *args, **kwargs) -> None:
    if name in self.done:
      self.programs.append(self.done[name])
    elif name in self.wanted:
      self.programs.append(compile_program(name, *args, progress=self.progress, **kwargs))


def _make_plan(cfg: Config, topology: Topology, *, headroom: float, progress: Callable[[str], None] | None,
               groups: tuple[str, ...], compiled: tuple[ProgramCost, ...]) -> Plan:
  config_lib.check_combinations(cfg, topology.hosts)
  jax.config.update("jax_default_matmul_precision", cfg.model.matmul_precision)
  io = run_lib.build_interface(cfg)
  policy = run_lib.build_policy(cfg, io, devices=topology.devices, abstract=True)
  global_rows = cfg.train.tasks_per_iteration * cfg.train.group_size
  length = cfg.rollout.max_context
  parts = _Parts(cfg=cfg, topology=topology, io=io, policy=policy, steps=run_lib.build_steps(cfg, policy, "train"),
                 sampler=run_lib.make_sampler(cfg, io, policy, record_routes=True),
                 rows=cfg.rollout.slots or global_rows,
                 train_rows=run_lib.train_rows(cfg, global_rows, policy.layout.mesh.devices.size), length=length,
                 generated=min(cfg.env.max_turns * cfg.rollout.max_new_tokens, length))
  compile_ = _Compiler(groups, compiled, progress)
  work = _update_programs(parts, compile_)
  rollout_params, resident = _reshard_programs(parts, compile_)
  if "rollout" in groups:
    _rollout_programs(parts, compile_, rollout_params, resident)
  mesh = policy.layout.mesh
  return Plan(topology=topology, mesh=dict(mesh.shape), params=policy.model.config.num_params(), rows=parts.rows,
              train_rows=parts.train_rows, batch_length=length, micro_batches=cfg.train.micro_batches,
              programs=tuple(compile_.programs), iteration=_iteration(parts, compile_.programs, work),
              headroom=headroom)


def _update_programs(parts: _Parts, compile_: _Compiler) -> float:
  """The update (the train state donated, the batch at the longest length a run can assemble) and the forwards
  beside it. Returns the train step's FLOPs per device: XLA's cost analysis counts a loop's body once (the
  micro-batch scan, scanned layers, attention blocks), so its time is from the model's FLOPs."""
  cfg, policy, steps = parts.cfg, parts.policy, parts.steps
  layout, state = policy.layout, policy.abstract_state
  mesh, rows, length = layout.mesh, parts.train_rows, parts.length
  work = train_step_flops(policy.model.config, rows, length, cfg.train.remat) / mesh.devices.size
  batch, values = _batch(cfg, rows, length, mesh, layout.learner_rules, policy.model.config)
  scalar = _abstract((), jnp.float32, NamedSharding(mesh, P()))
  compile_("train_step", f"{cfg.algo.name} update of {rows} x {length} tokens, "
           f"{cfg.train.micro_batches} micro-batch(es), remat {cfg.train.remat}", steps.rl,
           (state, batch, scalar, values, scalar), calls=cfg.train.updates_per_iteration, work_flops=work)
  if steps.logprob_fn is not None:
    compile_("proximal_logp", "decoupled PPO's log π_prox before the update", steps.logprob_fn,
             (state.params, batch))
  if steps.value_fn is not None:
    compile_("values", "PPO's values at collection time", steps.value_fn, (state.params, batch))
  return work


def _reshard_programs(parts: _Parts, compile_: _Compiler) -> tuple[Any, int]:
  """The reshard into the rollout layout and back (colocated), or the rollout copy (mixed precision, LoRA); a
  disaggregated run's cross-mesh copy is not planned. Returns the rollout policy (abstract) and the bytes per
  device the train state keeps resident while the rollout runs."""
  cfg, policy = parts.cfg, parts.policy
  layout, state = policy.layout, policy.abstract_state
  rollout_dtype = policy.mixed or jnp.dtype(cfg.model.dtype)
  rollout_params = jax.tree.map(lambda x, sh: _abstract(x.shape, rollout_dtype if jnp.issubdtype(
      x.dtype, jnp.floating) else x.dtype, sh), state.params["policy"], layout.rollout_policy_shardings)
  whole_state = per_device_bytes(state)
  if layout.rollout_copy is not None:
    compile_("rollout_copy", "the policy cast/merged into the rollout layout (the learner's arrays stay)",
             layout.rollout_copy, (state.params,), resident_bytes=whole_state - per_device_bytes(state.params))
    return rollout_params, 0 if layout.disaggregated else whole_state
  if layout.disaggregated:
    return rollout_params, 0
  learner_policy = state.params["policy"]
  to_rollout = jax.jit(lambda p: p, out_shardings=layout.rollout_policy_shardings, donate_argnums=0)
  to_learner = jax.jit(lambda p: p, out_shardings=layout.state_shardings.params["policy"], donate_argnums=0)
  rest = whole_state - per_device_bytes(learner_policy)
  compile_("to_rollout", "the policy resharded into the rollout rules (whole tree at once: an upper bound)",
           to_rollout, (learner_policy,), resident_bytes=rest)
  compile_("to_learner", "and back into the learner rules", to_learner, (rollout_params,), resident_bytes=rest)
  return rollout_params, rest


def _rollout_programs(parts: _Parts, compile_: _Compiler, rollout_params: Any, resident: int) -> None:
  """The rollout: every row's KV cache at max_context; a feed (prompt pieces, observations) and a decode step."""
  layout, sampler, rows, length = parts.policy.layout, parts.sampler, parts.rows, parts.length
  rollout_mesh = layout.rollout_mesh or layout.mesh
  rng = _abstract((), jax.eval_shape(lambda: jax.random.key(0)).dtype, NamedSharding(rollout_mesh, P()))
  init = sampler._init.lower(rows, rng).compile()
  shapes = jax.eval_shape(lambda r: sampler._init(rows, r), rng)
  sampler_state = jax.tree.map(lambda x, sh: _abstract(x.shape, x.dtype, sh), shapes, init.output_shardings)
  width = max(sampler.extend_buckets)
  feed = _host_feed(rows, width, parts.io.tokenizer.pad_id, rollout_mesh, layout.rollout_rules)
  steps_arg = _abstract((), jnp.int32, NamedSharding(rollout_mesh, P()))
  until_arg = _abstract((), jnp.float32, NamedSharding(rollout_mesh, P()))
  # What a call must move: the weights once and the whole KV cache (every slot is read, masked).
  moved = per_device_bytes(rollout_params) + per_device_bytes((sampler_state.cache.k, sampler_state.cache.v))
  model, devices = parts.policy.model.config, rollout_mesh.devices.size
  compile_("rollout_feed", f"{rows} rows append up to {width} tokens each to KV caches of {length} slots",
           sampler._feed, (rollout_params, sampler_state, feed), resident_bytes=resident,
           calls=math.ceil(max(length - parts.generated, width) / width),
           work_flops=rollout_work(model, rows, width, length) / devices, work_bytes=moved)
  compile_("rollout_decode", f"one decode step of {rows} rows (a loop of rollout.decode_chunk steps)",
           sampler._decode, (rollout_params, sampler_state, steps_arg, until_arg), resident_bytes=resident,
           calls=parts.generated, work_flops=rollout_work(model, rows, 1, length) / devices, work_bytes=moved)


def _iteration(parts: _Parts, programs: list[ProgramCost], work: float) -> Iteration:
  by_name = {p.name: p for p in programs}
  topology = parts.topology
  seconds = lambda name: by_name[name].seconds(topology) * by_name[name].calls if name in by_name else 0.0
  n_params = parts.policy.model.config.num_active_params()  # the FLOPs a token costs (MoE: its k experts)
  trained = parts.train_rows * parts.length
  devices = parts.policy.layout.mesh.devices.size
  return Iteration(
      rollout_seconds=seconds("rollout_feed") + seconds("rollout_decode"),
      update_seconds=sum(seconds(n) for n in GROUPS["update"]),
      reshard_seconds=sum(seconds(n) for n in GROUPS["reshard"]),
      generated_tokens=parts.rows * parts.generated, trained_tokens=trained, chips=topology.chips,
      peak_flops=topology.chips * topology.chip.bf16_flops,
      model_flops=(6.0 * n_params * trained * parts.cfg.train.updates_per_iteration
                   + 2.0 * n_params * parts.rows * parts.generated),
      train_step_flops_ratio=work * devices / (6.0 * n_params * trained))
