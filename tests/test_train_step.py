"""The jitted train step: accumulating over micro-batches gives the same update AND the same metrics as one pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from jaxagent import algos
from jaxagent.assembly import Batch
from jaxagent.config import AlgoConfig, OptimConfig
from jaxagent.train.state import TrainState, make_optimizer
from jaxagent.train.step import StepOptions, make_train_step, make_value_fn
from jaxagent.train.value import ValueHead, ValueTargets

CONFIG = models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
B, T, M = 8, 16, 4
TEMPERATURE = 0.8
TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(model, seed=0):
  """8 rows of 16 tokens, some packed with two sequences; micro-batches of 2 rows differ in their loss tokens.

  Rows 2 and 3 (all of micro-batch 1) have no loss token, row 5 one; behavior log-probs are the current
  policy's plus noise (ratios near 1, some clipped); policy versions differ per row (non-trivial lag).
  """
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CONFIG.vocab_size, size=(B, T)).astype(np.int32)
  lengths = [16, 16, 16, 12, 9, 16, 5, 14]
  split = {0: 7, 4: 5, 7: 9}   # rows packed with a second sequence starting at this position
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for r, n in enumerate(lengths):
    seg[r, :n] = 1
    pos[r, :n] = np.arange(n)
    if r in split:
      s = split[r]
      seg[r, s:n] = 2
      pos[r, s:n] = np.arange(n - s)
  mask = (rng.random((B, T)) < 0.6) & (seg > 0) & (pos > 0)   # position 0 of a sequence is never predicted
  mask[2:4] = False
  mask[5] = False
  mask[5, 3] = True
  tokens = np.where(seg > 0, tokens, 0).astype(np.int32)
  logits = model(jnp.asarray(tokens), positions_bt=jnp.asarray(pos), segment_ids_bt=jnp.asarray(seg)) / TEMPERATURE
  logp = np.asarray(algos.next_token_logprobs(logits, jnp.asarray(tokens), jnp.asarray(mask)))
  behavior = np.where(mask, logp + rng.normal(scale=0.3, size=(B, T)), 0.0).astype(np.float32)
  adv = np.where(mask, rng.normal(size=(B, T)), 0.0).astype(np.float32)
  versions = np.where(mask, (np.arange(B) % 3 + 2)[:, None], -1).astype(np.int32)
  return Batch(tokens=tokens, positions=pos, segment_ids=seg, loss_mask=mask,
               roles=np.where(seg > 0, 0, -1).astype(np.int8), behavior_logprobs=behavior, advantages=adv,
               policy_versions=versions, trajectory_index=np.where(seg > 0, np.arange(B)[:, None], -1).astype(np.int32))


def _value_targets(seed=1):
  """A few value positions per row, a different number per micro-batch (none in micro-batch 2)."""
  rng = np.random.default_rng(seed)
  vmask = np.zeros((B, T), bool)
  for r, positions in {0: [2, 8], 1: [5], 2: [1, 4, 9, 12], 3: [3], 6: [2, 4], 7: [1, 6, 10]}.items():
    vmask[r, positions] = True
  old = np.where(vmask, rng.normal(scale=0.5, size=(B, T)), 0.0).astype(np.float32)
  ret = np.where(vmask, rng.normal(size=(B, T)), 0.0).astype(np.float32)
  return ValueTargets(old_values=old, returns=ret, mask=vmask), np.float32(vmask.sum())


def _setup(algo: AlgoConfig, *, value: bool, reference: bool):
  model = models.Transformer(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, policy = nnx.split(model)
  graphdefs = {"policy": graphdef}
  params = {"policy": policy}
  if value:
    head = ValueHead(CONFIG.hidden_size)
    graphdefs["value"], head_params = nnx.split(head)
    # A non-zero head (the default is zeros) so values, clipping and value errors are non-trivial.
    keys = iter(jax.random.split(jax.random.key(7), 8))
    params["value"] = jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape, x.dtype), head_params)
  ref = None
  if reference:
    keys = iter(jax.random.split(jax.random.key(3), 64))
    ref = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), policy)
  # Adam's eps large enough that near-zero gradient entries do not become ±lr (sign of rounding noise).
  optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, eps=1e-3, max_grad_norm=1.0),
                             optax.constant_schedule(1e-2))

  def state():
    fresh = jax.tree.map(jnp.array, params)   # the step donates its state: a new copy per call
    return TrainState(params=fresh, opt_state=optimizer.init(fresh), step=jnp.zeros((), jnp.int32),
                      policy_version=jnp.asarray(5, jnp.int32), rng=jax.random.key(0),
                      ref_params=None if ref is None else jax.tree.map(jnp.array, ref))

  return model, graphdefs, optimizer, state


def _compare(graphdefs, optimizer, state, algo, mode, batch, normalizer, value_targets=None, value_normalizer=0.0):
  results = {}
  for micro in (1, M):
    step = make_train_step(graphdefs, optimizer, StepOptions(algo, micro_batches=micro, mode=mode,
                                                             temperature=TEMPERATURE))
    new, metrics = step(state(), batch, jnp.float32(normalizer), value_targets, jnp.float32(value_normalizer))
    results[micro] = jax.device_get((new.params, metrics))
  (p1, m1), (pm, mm) = results[1], results[M]
  assert sorted(m1) == sorted(mm)
  mismatched = {k: (float(m1[k]), float(mm[k])) for k in m1
                if not np.allclose(np.asarray(mm[k]), np.asarray(m1[k]), **TOL)}
  assert not mismatched, f"metrics differ (whole batch, {M} micro-batches): {mismatched}"
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(pm)):
    np.testing.assert_allclose(b, a, **TOL)
  return m1, p1


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_grpo_micro_batches_match_the_whole_batch(aggregation):
  algo = AlgoConfig(name="grpo", advantage="grpo", aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
  model, graphdefs, optimizer, state = _setup(algo, value=False, reference=True)
  batch = _batch(model)
  normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids, aggregation=aggregation)
  m, params = _compare(graphdefs, optimizer, state, algo, "rl", batch, normalizer)
  # The comparison is not vacuous: the update moved the weights, KL, clipping and lag are all non-zero.
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), params, state().params)
  assert max(jax.tree.leaves(moved)) > 1e-3
  assert m["kl"] > 0 and 0 < m["clip_fraction"] < 1 and m["policy_lag"] > 0 and m["pg_loss"] != 0
  assert m["loss_tokens"] == batch.loss_mask.sum() and m["ratio_min"] < 1 < m["ratio_max"]


def test_ppo_value_head_micro_batches_match_the_whole_batch():
  algo = AlgoConfig(name="ppo", advantage="gae", value_coef=0.5, value_clip_eps=0.2, entropy_coef=0.01)
  model, graphdefs, optimizer, state = _setup(algo, value=True, reference=False)
  batch = _batch(model, seed=4)
  value_targets, value_normalizer = _value_targets()
  normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids)
  m, _ = _compare(graphdefs, optimizer, state, algo, "rl", batch, normalizer, value_targets, value_normalizer)
  assert m["value_loss"] > 0 and m["value_error"] > 0 and 0 < m["value_clip_fraction"] < 1


def test_behavior_cloning_micro_batches_match_the_whole_batch():
  algo = AlgoConfig()
  model, graphdefs, optimizer, state = _setup(algo, value=False, reference=False)
  batch = _batch(model, seed=2)
  normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids)
  m, _ = _compare(graphdefs, optimizer, state, algo, "bc", batch, normalizer)
  assert m["nll"] > 0 and m["entropy"] > 0


@pytest.mark.parametrize("chunk", [5, 16, 40])  # a ragged last chunk, one chunk per row, one longer than a row
@pytest.mark.parametrize("truncated", [False, True], ids=["full", "thresholds"])
def test_chunked_logprobs_and_entropy_equal_the_direct_path_with_gradients(chunk, truncated):
  rng = np.random.default_rng(0)
  b, t, d, v = 3, 16, 8, 300
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) < 0.7)
  # Thresholds near the middle of each position's logits (NaN on a few: nothing cut there).
  tau = jnp.where(jnp.asarray(rng.random((b, t)) < 0.2), jnp.nan, jnp.asarray(rng.normal(size=(b, t)), jnp.float32))
  tau = tau if truncated else None

  def stats(x, w, chunk):
    logp, ent, _ = algos.next_token_stats(x, w, tokens, mask, temperature=0.7, chunk=chunk, thresholds_bt=tau)
    return jnp.sum(jnp.where(mask, logp * jnp.arange(t) + 0.3 * ent, 0.0)), (logp, ent)

  if truncated:  # log of the mass kept: <= 0, the same on both paths, and some cut
    kept0, kept1 = (algos.next_token_stats(x, w, tokens, mask, temperature=0.7, chunk=c, thresholds_bt=tau)[2]
                    for c in (None, chunk))
    np.testing.assert_allclose(kept1, kept0, **TOL)
    assert float(jnp.max(kept0)) <= 1e-6 and float(jnp.min(jnp.where(mask, kept0, 0.0))) < -1e-3
  (direct, (lp0, e0)), g0 = jax.value_and_grad(stats, argnums=(0, 1), has_aux=True)(x, w, None)
  (chunked, (lp1, e1)), g1 = jax.value_and_grad(stats, argnums=(0, 1), has_aux=True)(x, w, chunk)
  np.testing.assert_allclose(lp1, lp0, **TOL)
  np.testing.assert_allclose(e1, e0, **TOL)
  np.testing.assert_allclose(chunked, direct, rtol=1e-5)
  for a, c in zip(g0, g1):
    np.testing.assert_allclose(c, a, **TOL)
  assert float(jnp.abs(g0[1]).max()) > 1e-3  # the gradient is not trivially zero
  # The unshifted reference: position t's log-prob comes from x[t-1] (cut at position t's threshold).
  logits = jnp.concatenate([jnp.zeros((b, 1, v)), (jnp.einsum("btd,dv->btv", x, w) / 0.7)[:, :-1]], axis=1)
  if truncated:
    logits = algos.truncated_logits(logits, tokens, tau)
  ref = algos.token_logprobs(logits, tokens)
  scored = np.asarray(mask).copy()
  scored[:, 0] = False  # position 0 predicts nothing
  np.testing.assert_allclose(np.where(scored, lp1, 0.0), np.where(scored, ref, 0.0), **TOL)


def test_chunked_logits_and_remat_leave_the_train_step_unchanged(monkeypatch):
  """The memory options (and the attention kernel) change what is stored, not the update: same params and
  metrics (RL with KL, and BC). The chunked kernel runs blocks of 4 queries here (several per row, one padded)."""
  monkeypatch.setattr(models._transformer, "ATTENTION_CHUNK", 4)
  algo = AlgoConfig(name="grpo", advantage="grpo", kl_coef=0.1, entropy_coef=0.01)
  model, graphdefs, optimizer, state = _setup(algo, value=False, reference=True)
  batch = _batch(model, seed=3)
  normalizer = jnp.float32(algos.loss_normalizer(batch.loss_mask, batch.segment_ids))
  for mode in ("rl", "bc"):
    results = []
    for memory in ({}, {"logits_chunk": 6}, {"logits_chunk": 6, "remat": "full"}, {"remat": "dots"},
                   {"attention": "dot_product"}, {"attention": "dot_product", "remat": "full", "logits_chunk": 5},
                   {"attention": "chunked"}, {"attention": "chunked", "remat": "full"}):
      step = make_train_step(graphdefs, optimizer, StepOptions(algo, micro_batches=2, mode=mode,
                                                               temperature=TEMPERATURE, **memory))
      new, metrics = step(state(), batch, normalizer)
      results.append(jax.device_get((new.params, metrics)))
    for params, metrics in results[1:]:
      for key, value in results[0][1].items():
        np.testing.assert_allclose(metrics[key], value, **TOL, err_msg=f"{mode} {key}")
      for a, c in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(params)):
        np.testing.assert_allclose(c, a, **TOL)
  with pytest.raises(ValueError, match="remat='some': not one of"):
    model.features(jnp.zeros((1, 4), jnp.int32), remat="some")


def test_the_value_function_runs_the_configured_attention_kernel_with_the_same_values(monkeypatch):
  """PPO's values at collection time take the loss's attention kernel: chunked gives einsum's values, and its
  program is the chunked one (a loop over query blocks), not [T, T] logits per layer."""
  monkeypatch.setattr(models._transformer, "ATTENTION_CHUNK", 4)
  model, graphdefs, _, state = _setup(AlgoConfig(name="ppo", advantage="gae"), value=True, reference=False)
  batch, params = _batch(model, seed=3), state().params
  programs = {a: make_value_fn(graphdefs, attention=a) for a in ("einsum", "chunked")}
  np.testing.assert_allclose(np.asarray(programs["chunked"](params, batch)),
                             np.asarray(programs["einsum"](params, batch)), **TOL)
  text = {a: p.lower(params, batch).as_text() for a, p in programs.items()}
  loops = {a: t.count("stablehlo.while") for a, t in text.items()}
  assert loops["chunked"] > loops["einsum"] >= 1, loops  # the layers' scan, and chunked's loop over query blocks


def test_mixed_precision_keeps_float32_master_weights_and_moments_and_tracks_float32_training():
  """bf16 forward/backward against float32 master weights: over 3 updates the parameters move like float32
  training's (stated tolerance: the difference of the two updates is within 10 % of the update's size), the
  losses agree to 2 %, and the weights and Adam moments stay float32."""
  algo = AlgoConfig(name="grpo", advantage="grpo", entropy_coef=0.01)
  model, graphdefs, optimizer, state = _setup(algo, value=False, reference=False)
  batch = _batch(model, seed=5)
  normalizer = jnp.float32(algos.loss_normalizer(batch.loss_mask, batch.segment_ids))
  runs = {}
  for dtype in (None, jnp.bfloat16):
    step = make_train_step(graphdefs, optimizer, StepOptions(algo, mode="rl", temperature=TEMPERATURE,
                                                             compute_dtype=dtype))
    s, losses = state(), []
    for _ in range(3):
      s, metrics = step(s, batch, normalizer)
      losses.append(float(metrics["loss"]))
    runs[dtype] = (jax.device_get(s), losses)
  (full, full_losses), (mixed, mixed_losses) = runs[None], runs[jnp.bfloat16]
  assert {x.dtype for x in jax.tree.leaves((mixed.params, mixed.opt_state)) if x.dtype.kind == "f"} == {np.dtype(np.float32)}
  np.testing.assert_allclose(mixed_losses, full_losses, rtol=2e-2, atol=1e-3)
  start = jax.device_get(state().params)
  for s0, a, b in zip(jax.tree.leaves(start), jax.tree.leaves(full.params), jax.tree.leaves(mixed.params)):
    update = np.abs(np.asarray(a) - s0).max()
    assert update > 0 and np.abs(np.asarray(b) - np.asarray(a)).max() <= 0.1 * update + 1e-6
  assert mixed_losses != full_losses  # bf16 really ran
