"""Shared-prefix packing: a batch's common token prefixes computed once give the unshared batch's features, loss,
metrics and gradient (float32, the micro-batch tolerance), for GRPO and PPO, with branches, LoRA, remat, chunked
log-probs, truncated sampling, a KL reference, micro-batches and every attention kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from jaxagent import algos, shared_prefix
from jaxagent.assembly import Batch
from jaxagent.config import AlgoConfig, ConfigError, load
from jaxagent.train import step as step_lib
from jaxagent.train.state import TrainState
from jaxagent.train.value import ValueHead, ValueTargets

CONFIG = models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
SLIDING = dataclasses.replace(CONFIG, layer_types=("sliding_attention", "full_attention"), sliding_window=4)
B, T, BLOCK = 8, 24, 4
TEMPERATURE = 0.8
TOL = dict(rtol=1e-5, atol=1e-5)  # micro-batch == full batch's


def _sequences(rng):
  """Rows of sequences (token lists) and each sequence's prompt length: a group of five (two prompts' worth of
  members, one a duplicate, one a branch that shares two completion tokens with another), a group of two, a
  sequence that shares nothing (packed in a row with a group member) and an empty row."""
  tok = lambda n: list(rng.integers(1, CONFIG.vocab_size, size=n))
  pa, pb = tok(7), tok(5)
  a1, a2, a3 = pa + tok(5), pa + tok(8), pa + tok(3)
  a4 = a2[:9] + [t % 31 + 1 for t in a2[9:12]]  # diverges from a2 after 2 completion tokens
  b1, b2, c = pb + tok(9), pb + tok(6), tok(10)
  rows = [[a1], [a2], [a3], [a4], [list(a1)], [b1], [b2, c], []]
  prompts = {id(s): 7 for s in (a1, a2, a3, a4, rows[4][0])} | {id(b1): 5, id(b2): 5, id(c): 1}
  return rows, prompts


def _batch(seed=0, *, thresholds=True):
  rng = np.random.default_rng(seed)
  rows, prompts = _sequences(rng)
  z = lambda dtype: np.zeros((B, T), dtype)
  tokens, pos, seg, mask = z(np.int32), z(np.int32), z(np.int32), z(bool)
  for r, seqs in enumerate(rows):
    col = 0
    for s, seq in enumerate(seqs, start=1):
      n = len(seq)
      tokens[r, col:col + n], pos[r, col:col + n], seg[r, col:col + n] = seq, np.arange(n), s
      mask[r, col + prompts[id(seq)]:col + n] = True
      col += n
  # Recorded thresholds are a property of each sampled token in its context: equal where the prefixes are.
  thr = np.where(mask, 0.05 * ((tokens * 7 + pos) % 5) - 0.1, np.nan).astype(np.float32)
  mask &= rng.random((B, T)) < 0.85  # some sampled tokens not trained on
  versions = np.where(mask, (np.arange(B) % 3 + 2)[:, None], -1).astype(np.int32)
  return Batch(tokens=tokens, positions=pos, segment_ids=seg, loss_mask=mask,
               roles=np.where(seg > 0, 0, -1).astype(np.int8),
               behavior_logprobs=np.where(mask, -3.4 + rng.normal(scale=0.3, size=(B, T)), 0.0).astype(np.float32),
               advantages=np.where(mask, rng.normal(size=(B, T)), 0.0).astype(np.float32),
               policy_versions=versions, trajectory_index=np.where(seg > 0, np.arange(B)[:, None], -1).astype(np.int32),
               sampling_thresholds=thr if thresholds else None)


def _shared(batch: Batch, block: int = BLOCK) -> Batch:
  trees = shared_prefix.prefix_trees(batch, block)
  length = 64
  return batch.replace(shared=shared_prefix.pack(batch, trees, length=length, packed_rows=trees.rows_needed(length)))


def test_the_prefix_trees_compute_each_common_prefix_once():
  batch = _batch()
  trees = shared_prefix.prefix_trees(batch, BLOCK)
  real = int((batch.segment_ids > 0).sum())
  # Block 1 (rows 0-3): a1 12, a2 15, a3 10, a4 12 tokens share the prompt's first 6 slots; a4 shares a2's
  # first 8 (the branch point's token is computed once per branch). Block 2: the duplicate of a1 is alone in
  # its block (blocks never share); b1 and b2 share 4 slots; c shares nothing.
  assert [[len(tree.nodes) for tree in block.trees] for block in trees.blocks] == [
      [6 + (12 - 6) + (10 - 6) + 2 + (15 - 8) + (12 - 8)], [12, 4 + (14 - 4) + (11 - 4), 10]]
  assert real - trees.tokens == (2 * 6 + 8) + 4
  shared = _shared(batch).shared
  assert int((shared.segment_ids > 0).sum()) == trees.tokens
  # Every token is held by a slot with its token and position, and predicted by its predecessor's slot.
  flat = lambda x, r: x.reshape(B // BLOCK, -1)[r // BLOCK]
  for r, c in zip(*np.nonzero(batch.segment_ids)):
    k = shared.slot[r, c]
    assert flat(shared.tokens, r)[k] == batch.tokens[r, c] and flat(shared.positions, r)[k] == batch.positions[r, c]
    if batch.positions[r, c]:
      assert flat(shared.targets, r)[shared.predictor[r, c]] == batch.tokens[r, c]
      assert flat(shared.target_mask, r)[shared.predictor[r, c]] >= batch.loss_mask[r, c]
    else:
      assert shared.predictor[r, c] == -1


def test_sequences_that_share_nothing_pack_to_their_own_segments():
  batch = _batch()
  lone = batch.replace(segment_ids=np.where(np.arange(B)[:, None] == 6, batch.segment_ids, 0))  # b2 and c
  trees = shared_prefix.prefix_trees(lone, BLOCK)
  assert trees.tokens == int((lone.segment_ids > 0).sum())
  shared = _shared(lone).shared
  ends = shared.segment_ends[shared.segment_ids > 0]
  np.testing.assert_array_equal(ends, shared.segment_ids[shared.segment_ids > 0] + 1)  # no segment has a child


def test_blocks_must_divide_the_rows():
  with pytest.raises(ValueError, match="block_rows=3: must divide the batch's 8 rows"):
    shared_prefix.prefix_trees(_batch(), 3)


@pytest.mark.parametrize("config", [CONFIG, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("attention", models.ATTENTION_IMPLEMENTATIONS)
def test_tree_attention_gives_each_sequence_its_own_features(config, attention, monkeypatch):
  monkeypatch.setattr(models._transformer, "ATTENTION_CHUNK", 8)  # several query blocks
  model = models.Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  batch = _shared(_batch())
  s = batch.shared
  x_btd, _ = model.features(jnp.asarray(batch.tokens), positions_bt=jnp.asarray(batch.positions),
                            segment_ids_bt=jnp.asarray(batch.segment_ids), attention=attention)
  x_pld, _ = model.features(jnp.asarray(s.tokens), positions_bt=jnp.asarray(s.positions),
                            segment_ids_bt=jnp.asarray(s.segment_ids), segment_ends_bt=jnp.asarray(s.segment_ends),
                            attention=attention)
  real = batch.segment_ids > 0
  for d in range(config.hidden_size):
    got = np.asarray(s.unshare(x_pld[..., d], jnp.asarray(s.slot)))
    np.testing.assert_allclose(got[real], np.asarray(x_btd[..., d])[real], **TOL)


def _setup(value: bool, lora: bool):
  model = models.Transformer(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, policy = nnx.split(model)
  graphdefs, params = {"policy": graphdef}, {"policy": policy}
  if value:
    graphdefs["value"], head = nnx.split(ValueHead(CONFIG.hidden_size))
    keys = iter(jax.random.split(jax.random.key(7), 8))
    params["value"] = jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape, x.dtype), head)
  if lora:
    adapters = models.lora_init(policy, rank=2, targets=("q", "v", "up"), key=jax.random.key(3))
    # Non-zero B matrices, so the adapters change the policy and get a gradient through both factors.
    params["lora"] = jax.tree.map(lambda x: x + 0.1, adapters)
  return graphdefs, params


def _value_targets(batch: Batch):
  rng = np.random.default_rng(5)
  vmask = batch.loss_mask & (rng.random((B, T)) < 0.3)
  return ValueTargets(old_values=np.where(vmask, rng.normal(size=(B, T)), 0).astype(np.float32),
                      returns=np.where(vmask, rng.normal(size=(B, T)), 0).astype(np.float32), mask=vmask)


CASES = {
    "grpo": (AlgoConfig(name="grpo", advantage="grpo"), {}),
    "grpo-kl-seq-mean": (AlgoConfig(name="grpo", advantage="grpo", kl_coef=0.1, aggregation="seq-mean-token-mean",
                                    entropy_coef=0.01), {}),
    "ppo-value": (AlgoConfig(name="ppo", advantage="gae"), {}),
    "ppo-value-kl": (AlgoConfig(name="ppo", advantage="gae", kl_coef=0.1), {}),
    "grpo-lora-remat-chunked": (AlgoConfig(name="grpo", advantage="grpo"),
                                dict(lora=True, remat="full", logits_chunk=8)),
    "tis": (AlgoConfig(name="grpo", advantage="grpo", loss="tis"), dict(thresholds=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_shared_batch_has_the_unshared_loss_metrics_and_gradient(case):
  algo, extra = CASES[case]
  value = algo.name == "ppo"
  lora = extra.get("lora", False)
  graphdefs, params = _setup(value, lora)
  options = step_lib.StepOptions(algo, temperature=TEMPERATURE, remat=extra.get("remat", "none"),
                                 logits_chunk=extra.get("logits_chunk"), lora_scale=2.0 if lora else 0.0,
                                 frozen=("policy",) if lora else ())
  batch = _batch(thresholds=extra.get("thresholds", True))
  targets = _value_targets(batch) if value else None
  normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids, aggregation=algo.aggregation)
  ref = params["policy"] if algo.kl_coef else None

  def loss(trained, b):
    return step_lib._loss({**params, **trained}, graphdefs, b, jnp.float32(normalizer),
                          None if targets is None else jax.tree.map(jnp.asarray, targets),
                          jnp.float32(targets.mask.sum() if value else 0), options, ref_params=ref,
                          policy_version=jnp.int32(5))

  trained = {k: v for k, v in params.items() if k not in options.frozen}
  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (l0, m0), g0 = grad(trained, jax.tree.map(jnp.asarray, batch))
  (l1, m1), g1 = grad(trained, jax.tree.map(jnp.asarray, _shared(batch)))
  np.testing.assert_allclose(l1, l0, **TOL)
  assert m1.keys() == m0.keys()
  for key in m0:
    np.testing.assert_allclose(m1[key], m0[key], **TOL, err_msg=key)
  flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
  assert any(float(jnp.abs(g).max()) > 1e-3 for g in flat0)  # a real gradient to compare
  for a, b in zip(flat0, flat1):
    np.testing.assert_allclose(b, a, **TOL)


def test_a_shared_batch_steps_like_the_unshared_one_over_micro_batches():
  algo = AlgoConfig(name="grpo", advantage="grpo")
  graphdefs, params = _setup(value=False, lora=False)
  optimizer = optax.sgd(0.5)

  def state():
    fresh = jax.tree.map(jnp.array, params)  # the step donates its state: a new copy per call
    return TrainState(params=fresh, opt_state=optimizer.init(fresh), step=jnp.zeros((), jnp.int32),
                      policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0))

  batch = _batch()
  normalizer = jnp.float32(algos.loss_normalizer(batch.loss_mask, batch.segment_ids))
  step = step_lib.make_train_step(graphdefs, optimizer, step_lib.StepOptions(algo, micro_batches=2,
                                                                             temperature=TEMPERATURE))
  s0, m0 = step(state(), jax.tree.map(jnp.asarray, batch), normalizer)
  s1, m1 = step(state(), jax.tree.map(jnp.asarray, _shared(batch)), normalizer)
  for key in m0:
    np.testing.assert_allclose(m1[key], m0[key], **TOL, err_msg=key)
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(b, a, **TOL)


def test_shared_prefix_on_with_a_router_loss_is_refused():
  with pytest.raises(ConfigError, match="train.shared_prefix='on' with a router loss"):
    load("tiny_cpu", ["train.shared_prefix=on", "algo.moe_load_balance_coef=0.01"])


def test_unquoted_on_and_off_in_yaml_name_the_modes():
  assert load("tiny_cpu", ["train.shared_prefix=off"]).train.shared_prefix == "off"
  assert load("tiny_cpu", ["train.shared_prefix=on"]).train.shared_prefix == "on"
  with pytest.raises(ConfigError, match=r"train.shared_prefix='sometimes': not one of \['auto', 'off', 'on'\]"):
    load("tiny_cpu", ["train.shared_prefix=sometimes"])


def test_sequences_must_count_positions_from_zero():
  batch = _batch()
  shifted = batch.replace(positions=np.where(batch.segment_ids > 0, batch.positions + 3, 0).astype(np.int32))
  with pytest.raises(ValueError, match="row 0: the sequence at columns 0:12 does not count its positions from 0"):
    shared_prefix.prefix_trees(shifted, BLOCK)


def test_a_slice_across_blocks_is_refused():
  shared = _shared(_batch()).shared
  with pytest.raises(ValueError, match="6 unshared rows and .* packed rows are not whole blocks of 4"):
    shared.unshare(jnp.asarray(shared.tokens[:1]), jnp.asarray(shared.slot[:6]))


def test_auto_shares_only_when_slots_shrink_and_attention_scores_do_not_grow():
  sharing = lambda slots, scores: shared_prefix.Sharing(tokens_unshared=0, tokens_computed=0,
                                                        slots_unshared=16 * 384, slots_computed=slots,
                                                        scores_unshared=16 * 384**2, scores_computed=scores)
  assert sharing(2 * 768, 2 * 768**2).worth_it(0.2)            # the budget recipe's batches
  assert not sharing(int(0.85 * 16 * 384), 100).worth_it(0.2)   # saves only 15 % of the slots
  assert not sharing(1 * 4096, 1 * 4096**2).worth_it(0.2)       # one long row: fewer slots, 7x the scores
  assert [shared_prefix.packed_rows_for(n) for n in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
