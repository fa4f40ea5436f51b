"""The jitted train step: masked policy-gradient (GRPO/PPO) or behavior-cloning loss, micro-batch gradient
accumulation inside the step, one optimizer update, donated state.

    step_fn = make_train_step({"policy": graphdef}, optimizer, StepOptions(algo, micro_batches=4, mode="rl"))
    state, metrics = step_fn(state, batch, normalizer)

The loss normalizer is computed over the whole batch on the host (`algos.loss_normalizer`) and passed in,
so the gradient is the same whether the batch is processed whole or in micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
from jaxagent import algos
from jaxagent.assembly import Batch
from jaxagent.config import AlgoConfig
from jaxagent.train.state import TrainState
from jaxagent.train.value import ValueTargets

Mode = Literal["rl", "bc", "offline"]

# How each per-micro-batch metric ([M] values) combines into the metric of the whole batch, so that the metrics
# of M micro-batches equal those of the batch processed at once:
#   sums:        counts, and quantities already divided by the WHOLE batch's normalizer (pg_loss, value_loss:
#                `aggregate` over a micro-batch is its share of the batch's aggregate).
#   token means: plain means over the micro-batch's loss tokens, weighted by `loss_tokens`.
#   value means: plain means over the micro-batch's value positions, weighted by `value_positions`.
#   ratio_min / ratio_max: over micro-batches with loss tokens (0 when the batch has none, as `policy_loss`).
#   skipped:     any (the step overwrites it from the batch's normalizers).
_SUMS = ("loss_tokens", "value_positions", "pg_loss", "value_loss")
_TOKEN_MEANS = ("clip_fraction", "ratio_mean", "approx_kl", "entropy", "kl", "nll", "policy_lag", "kept_mass",
                "behavior_weight_mean", "truncated_fraction")
_VALUE_MEANS = ("value_clip_fraction", "value_error")
#   router means: the mixture of experts' router losses, computed per micro-batch (the load-balancing loss is not a
#                sum over tokens, so it is the one term micro-batching changes) and averaged over them.
_ROUTER_MEANS = ("moe/load_balance", "moe/router_z")


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Everything static about a jitted step (the one options type `make_train_step` and `_loss` share).

  Attributes:
    algo: the losses' settings (clipping, aggregation, KL, entropy and value coefficients).
    mode: "rl" (the policy loss against the rollout's behavior log-probs), "bc" (masked NLL: bc, sft, rft,
      offline filtered_bc), "offline" (iw_pg: truncated importance weights against another policy's log-probs).
    micro_batches: gradient accumulation over this many slices of the batch (equal to one full batch).
    temperature: the rollout's sampling temperature (RL and offline score tokens under it).
    logits_chunk, remat, attention: compute/memory trades that change no value (`algos.next_token_stats`,
      `Transformer.features`, `models.ATTENTION_IMPLEMENTATIONS`).
    compute_dtype: mixed precision: parameters cast to it in the loss, gradients reach the master weights.
    frozen: keys of `state.params` that are inputs only (LoRA: "policy").
    lora_scale: alpha / rank of the adapters merged into the policy (0: no LoRA).
    max_ratio, min_negative_ratio: offline iw_pg's truncation and floor (`algos.importance_weighted_loss`).
  """
  algo: AlgoConfig
  mode: Mode = "rl"
  micro_batches: int = 1
  temperature: float = 1.0
  logits_chunk: int | None = None
  remat: str = "none"
  compute_dtype: Any = None
  attention: str = "einsum"
  frozen: tuple[str, ...] = ()
  lora_scale: float = 0.0
  max_ratio: float = 1.0
  min_negative_ratio: float = 0.0


def _loss(params, graphdefs, batch: Batch, normalizer, value_targets: ValueTargets | None, value_normalizer,
          options: StepOptions, ref_params=None, policy_version=None):
  """`params` is `{"policy": …}` plus `"value"` for PPO; `graphdefs` the matching graph definitions;
  `ref_params` the frozen reference policy (KL term), not differentiated.

  In RL mode π_θ is the distribution the rollout samples from, softmax(logits / temperature), so that the
  ratio π_θ/μ against the recorded behavior log-probs is 1 on-policy. Offline mode: the same π_θ, the
  truncated importance-weighted gradient (`algos.importance_weighted_loss`, weights capped at `max_ratio`,
  negative-advantage tokens below `min_negative_ratio` cut) against another policy's recorded log-probs.

  `compute_dtype` (mixed precision): the parameters are cast to it here, so the forward and backward run in it
  while the gradient reaches the master weights in their own dtype.
  """
  o, algo = options, options.algo
  mode, compute_dtype = o.mode, o.compute_dtype
  params = policy_params(params, o.lora_scale)
  if compute_dtype is not None:
    params = cast_floating(params, compute_dtype)
    ref_params = None if ref_params is None else cast_floating(ref_params, compute_dtype)
  scores = _scores(params, graphdefs, batch, options)
  logp_bt, entropy_bt, log_kept_bt, router = scores.logp, scores.entropy, scores.log_kept, scores.router
  mask_bt = batch.loss_mask
  token_mean = lambda x: jnp.sum(jnp.where(mask_bt, x, 0.0)) / jnp.maximum(jnp.sum(mask_bt), 1)
  kept = {} if log_kept_bt is None else {"kept_mass": token_mean(jnp.exp(log_kept_bt))}
  if mode == "bc":
    nll_bt = -logp_bt
    loss = algos.aggregate(nll_bt, mask_bt, normalizer, segment_ids_bt=batch.segment_ids,
                           aggregation=algo.aggregation)
    count = jnp.sum(mask_bt)
    mean = lambda x: jnp.sum(jnp.where(mask_bt, x, 0.0)) / jnp.maximum(count, 1)
    return loss, {"loss_tokens": count.astype(jnp.float32), "nll": mean(nll_bt), "entropy": mean(entropy_bt)}
  # Policy lag: updates between the behavior policy of each trained token and the policy being updated.
  lag_bt = (policy_version - batch.policy_versions).astype(jnp.float32)
  tokens = algos.TokenLossInputs(logp=logp_bt, old_logp=batch.behavior_logprobs, advantages=batch.advantages,
                                 loss_mask=mask_bt, normalizer=normalizer, segment_ids=batch.segment_ids,
                                 entropy=entropy_bt)
  if mode == "offline":
    loss, metrics = algos.importance_weighted_loss(tokens, algos.ImportanceWeightConfig(
        aggregation=algo.aggregation, max_ratio=o.max_ratio, min_negative_ratio=o.min_negative_ratio,
        entropy_coef=algo.entropy_coef))
    return loss, dict(metrics, policy_lag=token_mean(lag_bt), **kept)
  if algo.loss == "tis":
    loss, metrics = algos.importance_weighted_loss(tokens, algos.ImportanceWeightConfig(
        aggregation=algo.aggregation, max_ratio=algo.behavior_weight_cap, entropy_coef=algo.entropy_coef))
    loss, metrics = _with_router(loss, dict(metrics, policy_lag=token_mean(lag_bt), **kept), router, o)
    return _with_value(params, graphdefs, scores, batch, metrics, loss, value_targets, value_normalizer, algo)
  ref_logp_bt = None
  if ref_params is not None:  # the reference routes itself
    ref = nnx.merge(graphdefs["policy"], jax.lax.stop_gradient(ref_params))
    ref_scores = _token_scores(ref, batch, dataclasses.replace(options, remat="none"), routes=False,
                               with_entropy=False)
    ref_logp_bt = jax.lax.stop_gradient(ref_scores.logp)
  decoupled = algo.loss == "decoupled_ppo"
  if decoupled and batch.proximal_logprobs is None:
    raise ValueError("algo.loss='decoupled_ppo' needs the batch's proximal_logprobs (make_logprob_fn)")
  tokens = tokens.replace(old_logp=batch.proximal_logprobs if decoupled else batch.behavior_logprobs,
                          ref_logp=ref_logp_bt, behavior_logp=batch.behavior_logprobs if decoupled else None)
  loss, metrics = algos.policy_loss(tokens, algos.PolicyLossConfig.from_algo(algo))
  metrics = dict(metrics, policy_lag=token_mean(lag_bt), **kept)
  loss, metrics = _with_router(loss, metrics, router, o)
  return _with_value(params, graphdefs, scores, batch, metrics, loss, value_targets, value_normalizer, algo)


def _with_router(loss, metrics, router, options: StepOptions):
  """Adds a mixture of experts' router losses (`algo.moe_load_balance_coef`, `moe_router_z_coef`; `router` None:
  off): each micro-batch adds 1/M of its own, so the step's loss has their mean over micro-batches."""
  if router is None:
    return loss, metrics
  algo = options.algo
  loss = loss + (algo.moe_load_balance_coef * router["load_balance"]
                 + algo.moe_router_z_coef * router["router_z"]) / options.micro_batches
  return loss, {**metrics, "moe/load_balance": router["load_balance"], "moe/router_z": router["router_z"]}


@flax.struct.dataclass
class _Scores:
  """A forward pass's results per unshared token: log π, entropy and log kept mass [B, T] (`_token_scores`),
  the hidden states it ran on (the shared layout's when the batch is shared), the router statistics or None."""
  features: jax.Array
  logp: jax.Array
  entropy: jax.Array | None
  log_kept: jax.Array | None
  router: dict | None


def _scores(params, graphdefs, batch: Batch, options: StepOptions) -> _Scores:
  """The policy's scores of `batch` (`_token_scores`), with a mixture of experts' router statistics when rl mode
  weights them (`_with_router`). `params` already merged and cast.

  Router replay: a mixture of experts sends each token to the experts the sampler recorded for it
  (`batch.expert_routes`), so π_θ is scored through the same experts μ was; the router keeps its gradient
  through the weights it gives those experts (`models.MoE.route`)."""
  o = options
  model = nnx.merge(graphdefs["policy"], params["policy"])
  router = o.mode == "rl" and bool(o.algo.moe_load_balance_coef or o.algo.moe_router_z_coef)
  return _token_scores(model, batch, options, routes=True, router=router)


def _token_scores(model, batch: Batch, options: StepOptions, *, routes: bool, router: bool = False,
                  with_entropy: bool = True) -> _Scores:
  """Per token, log π (under the rollout temperature, cut at the recorded sampling thresholds, in rl and offline
  modes), entropy and the log of the kept mass. A shared batch (`batch.shared`) runs the model on its prefix
  trees, where each slot scores the one token it predicts, and gathers the results back onto the batch's tokens
  (0 off the loss mask, where no loss reads them)."""
  o = options
  scale = 1.0 if o.mode == "bc" else o.temperature
  # Truncated sampling (top-k / top-p): each token is scored under the distribution it was drawn from, cut at
  # its recorded threshold (None: rollouts sampled from the whole distribution; behavior cloning never cuts).
  truncating = o.mode != "bc" and batch.sampling_thresholds is not None
  shared = batch.shared
  if shared is None:
    x_btd, _, *stats = model.features(batch.tokens, positions_bt=batch.positions, segment_ids_bt=batch.segment_ids,
                                      remat=o.remat, attention=o.attention,
                                      routes=batch.expert_routes if routes else None, router_stats=router)
    logp, entropy, kept = algos.next_token_stats(
        x_btd, model.unembed_weight(), batch.tokens, batch.loss_mask, temperature=scale, chunk=o.logits_chunk,
        with_entropy=with_entropy, thresholds_bt=batch.sampling_thresholds if truncating else None)
    return _Scores(x_btd, logp, entropy, kept, stats[0] if stats else None)
  if router:
    raise ValueError("a shared-prefix batch cannot weigh router losses: they count each computed token once "
                     "(train.shared_prefix: off with algo.moe_load_balance_coef or moe_router_z_coef)")
  x_pld, _ = model.features(shared.tokens, positions_bt=shared.positions, segment_ids_bt=shared.segment_ids,
                            segment_ends_bt=shared.segment_ends, remat=o.remat, attention=o.attention,
                            routes=shared.routes if routes else None)
  per_slot = algos.next_token_stats(
      x_pld, model.unembed_weight(), shared.targets, shared.target_mask, temperature=scale, chunk=o.logits_chunk,
      with_entropy=with_entropy, thresholds_bt=shared.thresholds if truncating else None, targets_bt=shared.targets)
  logp, entropy, kept = (None if x is None else jnp.where(batch.loss_mask, shared.unshare(x, shared.predictor), 0.0)
                         for x in per_slot)
  return _Scores(x_pld, logp, entropy, kept, None)


def _with_value(params, graphdefs, scores: _Scores, batch: Batch, metrics, loss, value_targets, value_normalizer,
                algo):
  """PPO: adds the value loss on the same features (a shared batch's: each token's value read at its slot)."""
  if value_targets is not None:
    values = nnx.merge(graphdefs["value"], params["value"])(scores.features).astype(jnp.float32)
    values_bt = values if batch.shared is None else batch.shared.unshare(values, batch.shared.slot)
    vloss, vmetrics = algos.value_loss(values_bt, value_targets.old_values, value_targets.returns,
                                       value_targets.mask, value_normalizer, clip_eps=algo.value_clip_eps)
    loss = loss + algo.value_coef * vloss
    metrics = dict(metrics, value_loss=vloss, **vmetrics)
  return loss, metrics


def policy_params(params: dict[str, Any], lora_scale: float) -> dict[str, Any]:
  """`params` with LoRA adapters (`params["lora"]`) merged into the policy's weights, and without them."""
  if "lora" not in params:
    return params
  rest = {k: v for k, v in params.items() if k != "lora"}
  return {**rest, "policy": models.lora_merge(params["policy"], params["lora"], lora_scale)}


def cast_floating(tree, dtype):
  """Floating-point leaves of `tree` as `dtype` (integer leaves, e.g. RNG state, unchanged)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _combine(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Reduces per-micro-batch metrics ([M] each) to batch metrics (rules above; an unknown key is an error)."""
  tokens = metrics["loss_tokens"]
  total = jnp.sum(tokens)
  weighted_mean = lambda x, w: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)
  out = {}
  for key, value in metrics.items():
    if key in _SUMS:
      out[key] = jnp.sum(value)
    elif key in _TOKEN_MEANS:
      out[key] = weighted_mean(value, tokens)
    elif key in _VALUE_MEANS:
      out[key] = weighted_mean(value, metrics["value_positions"])
    elif key in _ROUTER_MEANS:
      out[key] = jnp.mean(value)
    elif key == "ratio_min":
      out[key] = jnp.where(total > 0, jnp.min(jnp.where(tokens > 0, value, jnp.inf)), 0.0)
    elif key in ("ratio_max", "behavior_weight_max"):
      out[key] = jnp.where(total > 0, jnp.max(jnp.where(tokens > 0, value, -jnp.inf)), 0.0)
    elif key == "skipped":
      out[key] = jnp.max(value)
    else:
      raise ValueError(f"metric {key!r} has no micro-batch combination rule in train/step.py")
  return out


def make_train_step(graphdefs: dict[str, nnx.GraphDef], optimizer: optax.GradientTransformation,
                    options: StepOptions, *, state_shardings: Any = None,
                    expert_dispatch: models.ExpertPlacement | None = None):
  """Returns `step(state, batch, normalizer, value_targets=None, value_normalizer=0) -> (state, metrics)`.

  `options`: everything static about the step (`StepOptions`: the losses, mode, micro-batches, temperature,
  memory trades, mixed precision, frozen parameters). `expert_dispatch`: a mixture-of-experts policy's placement
  on the learner mesh: each batch shard's tokens are dispatched on its own devices, to experts split over the
  expert axis (`models.dispatch_experts_over`); None: a micro-batch dispatches as one.

  `options.frozen`: keys of `state.params` that are inputs only (LoRA: "policy"): no gradient is computed for them
  and the optimizer state covers the rest. A batch with nothing to learn from (normalizer and value normalizer 0)
  is an explicit skip: metrics say `skipped=1` and the state is returned unchanged (no optimizer step, no weight
  decay, same step and policy version).

  Jitted with the state donated (and its layout pinned to `state_shardings` when given). The gradient is
  accumulated over `options.micro_batches` slices of the batch in a `lax.scan`; every slice's loss is divided by
  the whole batch's normalizer, so the sum is the full loss.
  """
  micro_batches, mode, frozen = options.micro_batches, options.mode, tuple(options.frozen)

  def split(x):
    b = x.shape[0]
    if b % micro_batches:
      raise ValueError(f"batch of {b} rows is not divisible into {micro_batches} micro-batches")
    return x.reshape((micro_batches, b // micro_batches) + x.shape[1:])

  if mode != "bc" and not options.temperature > 0:
    raise ValueError(f"temperature={options.temperature}: RL needs a sampling temperature > 0 (greedy rollouts "
                     "have no behavior distribution to correct for)")
  loss = functools.partial(_loss, graphdefs=graphdefs, options=options)
  # Differentiated with respect to the trained parameters only; the frozen ones are a plain input.
  grad_fn = jax.value_and_grad(lambda trained, fixed, **kw: loss({**fixed, **trained}, **kw), has_aux=True)

  def step(state: TrainState, batch: Batch, normalizer: jax.Array, value_targets: ValueTargets | None = None,
           value_normalizer: jax.Array | float = 0.0) -> tuple[TrainState, dict[str, Any]]:
    with models.dispatch_experts_over(expert_dispatch):
      return _step(state, batch, normalizer, value_targets, value_normalizer)

  def _step(state, batch, normalizer, value_targets, value_normalizer):
    micro = jax.tree.map(split, (batch, value_targets))
    trained = {k: v for k, v in state.params.items() if k not in frozen}
    fixed = {k: v for k, v in state.params.items() if k in frozen}

    def accumulate(grads, mb):
      (loss, metrics), g = grad_fn(trained, fixed, batch=mb[0], normalizer=normalizer, value_targets=mb[1],
                                   value_normalizer=value_normalizer,
                                   ref_params=state.ref_params if mode == "rl" else None,
                                   policy_version=state.policy_version)
      return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, trained)
    grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, micro)
    metrics = _combine(metrics)
    metrics["loss"] = jnp.sum(losses)  # each micro-batch loss is already divided by the global normalizer
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, trained)
    new_trained = optax.apply_updates(trained, updates)
    skip = (normalizer <= 0) & (jnp.asarray(value_normalizer) <= 0)
    metrics["skipped"] = skip.astype(jnp.float32)
    keep = lambda old, new: jax.tree.map(lambda a, b: jnp.where(skip, a, b), old, new)
    new_state = state.replace(params={**state.params, **keep(trained, new_trained)},
                              opt_state=keep(state.opt_state, opt_state),
                              step=jnp.where(skip, state.step, state.step + 1),
                              policy_version=jnp.where(skip, state.policy_version, state.policy_version + 1))
    return new_state, metrics

  # Pinning the new state's layout to the old one keeps every call's input shardings identical.
  out_shardings = None if state_shardings is None else (state_shardings, None)
  return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def make_value_fn(graphdefs: dict[str, nnx.GraphDef], compute_dtype=None, lora_scale: float = 0.0,
                  attention: str = "einsum", expert_dispatch: models.ExpertPlacement | None = None):
  """Jitted `values(params, batch) -> float32[B, T]` (value estimates at collection time, for GAE), in the
  same `compute_dtype` and `attention` kernel as the loss; `expert_dispatch` as the train step's."""

  def values(params, batch: Batch):
    with models.dispatch_experts_over(expert_dispatch):
      return _values(params, batch)

  def _values(params, batch: Batch):
    params = policy_params(params, lora_scale)
    if compute_dtype is not None:
      params = cast_floating(params, compute_dtype)
    model = nnx.merge(graphdefs["policy"], params["policy"])
    x_btd, _ = model.features(batch.tokens, positions_bt=batch.positions, segment_ids_bt=batch.segment_ids,
                              attention=attention, routes=batch.expert_routes)  # what the loss's value head reads
    return nnx.merge(graphdefs["value"], params["value"])(x_btd).astype(jnp.float32)

  return jax.jit(values)


def make_logprob_fn(graphdefs: dict[str, nnx.GraphDef], options: StepOptions,
                    expert_dispatch: models.ExpertPlacement | None = None):
  """Jitted `logprobs(params, batch) -> float32[B, T]`: log π of each token exactly as the rl loss scores it
  (rollout temperature, recorded truncation, mixed precision, LoRA merged); 0 off the loss mask. Decoupled PPO's
  proximal log-probs, read with the parameters at the start of an update; `expert_dispatch` as the train
  step's."""

  def logprobs(params, batch: Batch):
    with models.dispatch_experts_over(expert_dispatch):
      return _logprobs(params, batch)

  def _logprobs(params, batch: Batch):
    params = policy_params(params, options.lora_scale)
    if options.compute_dtype is not None:
      params = cast_floating(params, options.compute_dtype)
    logp_bt = _scores(params, graphdefs, batch, options).logp
    return jnp.where(batch.loss_mask, logp_bt, 0.0)

  return jax.jit(logprobs)
