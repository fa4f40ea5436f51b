"""Mixture of experts (the qwen3_moe family): the dropless routed MLP equals a dense reference that runs every
expert on every token, a token's experts depend on that token alone, the layers' scans (remat) equal the
unrolled loop and give the same gradients when dense and sparse layers alternate, and bad configs are refused by
name. Parity with transformers is in models_vs_reference_test.py, the KV cache in test_kv_cache.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from tests.test_kv_cache import decisive_routers

CONFIG = models.ModelConfig(model_type="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            qk_norm=True, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                            moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=(2,))
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
  return decisive_routers(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), seed=1)


def _dense_reference(moe: models.MoE, x_btd):
  """Every expert on every token, combined with the routing weights of the chosen ones (zero elsewhere)."""
  experts_btk, weights_btk = moe.route(x_btd)
  e = moe.w_gate_edf.shape[0]
  combine_bte = jnp.sum(jax.nn.one_hot(experts_btk, e) * weights_btk[..., None], axis=2)
  gate = jnp.einsum("btd,edf->btef", x_btd, moe.w_gate_edf[...])
  up = jnp.einsum("btd,edf->btef", x_btd, moe.w_up_edf[...])
  out_bted = jnp.einsum("btef,efd->bted", jax.nn.silu(gate) * up, moe.w_down_efd[...])
  return jnp.einsum("bted,bte->btd", out_bted, combine_bte)


def test_layers_follow_the_sparse_rule_and_the_routed_mlp_equals_every_expert_on_every_token(model):
  assert [type(model.layer(i).mlp).__name__ for i in range(4)] == ["MoE", "MoE", "MLP", "MoE"]
  assert models.layer_runs(CONFIG) == ((0, 1), (2,), (3,))  # one stack per run of one structure
  every_other = dataclasses.replace(CONFIG, decoder_sparse_step=2, mlp_only_layers=())
  assert [every_other.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
  moe = model.layer(0).mlp
  x = jax.random.normal(jax.random.key(0), (3, 5, CONFIG.hidden_size))
  experts, weights = moe.route(x)
  assert experts.shape == weights.shape == (3, 5, 2) and experts.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)  # norm_topk_prob
  assert len(np.unique(np.asarray(experts))) > 2  # the tokens spread over the experts
  out, used = moe(x)
  np.testing.assert_array_equal(np.asarray(used), np.asarray(experts))
  np.testing.assert_allclose(np.asarray(out), np.asarray(_dense_reference(moe, x)), atol=TOL, rtol=TOL)
  # Dropless: a token's output does not depend on the other tokens of the batch.
  np.testing.assert_allclose(np.asarray(moe(x[1:2, 2:4])[0]), np.asarray(out)[1:2, 2:4], atol=TOL, rtol=TOL)


def test_scanned_runs_of_layers_equal_the_unrolled_loop_with_gradients(model):
  """Layers 0-1 (sparse), 2 (dense), 3 (sparse): remat scans each run of one structure."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
  graphdef, params = nnx.split(model)

  def loss(params, remat):
    features, _ = nnx.merge(graphdef, params).features(tokens, remat=remat)
    return jnp.sum(features ** 2), features

  (l0, f0), g0 = jax.value_and_grad(loss, has_aux=True)(params, "none")
  (l1, f1), g1 = jax.value_and_grad(loss, has_aux=True)(params, "full")
  np.testing.assert_allclose(np.asarray(f1), np.asarray(f0), atol=TOL, rtol=TOL)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)
  router_grad = g0["layer_stacks"][0]["mlp"]["w_router_de"][...]
  assert float(jnp.abs(router_grad).max()) > 0  # the router learns through its routing weights


def test_parameter_counts_of_the_real_architecture():
  config = models.architecture("qwen3-30b-a3b")
  assert round(config.num_params() / 1e9, 1) == 30.5 and round(config.num_active_params() / 1e9, 1) == 3.4
  dense = models.architecture("qwen3-8b")
  assert dense.num_active_params() == dense.num_params()


@pytest.mark.parametrize("changes, match", [
    (dict(num_experts_per_tok=0), r"num_experts_per_tok must be in 1..num_experts \(6\), got 0"),
    (dict(num_experts_per_tok=7), r"num_experts_per_tok must be in 1..num_experts \(6\), got 7"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size must be a positive int with num_experts=6"),
    (dict(mlp_only_layers=(4,)), r"mlp_only_layers \[4\]: not layers of 0..3"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step must be a positive int"),
])
def test_bad_moe_configs_are_refused_by_name(changes, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CONFIG, **changes)


def test_hf_configs_of_the_moe_family():
  hf = models.config_to_hf(CONFIG)
  assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["mlp_only_layers"] == [2]
  assert models.config_from_hf(hf) == CONFIG
  # The hub's configs say num_experts; transformers 5 writes num_local_experts: both read.
  local = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 6}
  assert models.config_from_hf(local).num_experts == 6
  with pytest.raises(models.UnsupportedModelError, match=r"qwen3_moe config needs \['moe_intermediate_size'\]"):
    models.config_from_hf({k: v for k, v in hf.items() if k != "moe_intermediate_size"}, source="c.json")
  with pytest.raises(models.UnsupportedModelError, match="num_experts=6 has no HF form"):
    models.config_to_hf(dataclasses.replace(CONFIG, model_type="qwen3"))
  with pytest.raises(models.UnsupportedModelError, match=r"did you mean 'qwen3_moe'"):
    models.config_from_hf(dict(hf, model_type="qwen3moe"))


def test_routes_of_a_cached_decode_equal_the_full_forward_and_replaying_them_changes_nothing(model):
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 10)), jnp.int32)
  logits, _, routes = model.features(tokens, return_routes=True)
  assert routes.shape == (2, 10, 3, 2)  # 3 sparse layers of 4, top-2
  cache = models.KVCache.init(CONFIG, 2, 10)
  _, cache, first = model.features(tokens[:, :6], cache=cache, return_routes=True)
  pieces = [first]
  for i in range(6, 10):
    _, cache, step = model.features(tokens[:, i:i + 1], cache=cache, return_routes=True)
    pieces.append(step)
  np.testing.assert_array_equal(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(routes))
  replayed = model.features(tokens, routes=routes)[0]
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(logits), atol=1e-6, rtol=1e-6)
  partly = routes.at[:, :5].set(-1)  # -1: those tokens route themselves
  np.testing.assert_allclose(np.asarray(model.features(tokens, routes=partly)[0]), np.asarray(logits), atol=1e-6)
  with pytest.raises(ValueError, match=r"routes of shape \(2, 10, 2, 2\): this model takes \[B=2, T=10, 3 sparse"):
    model.features(tokens, routes=routes[:, :, :2])


def _fragile(seed=0):
  """A mixture whose routers nearly tie: experts come in groups of k + 1 whose router columns differ by 1e-5, so a
  token's k experts are k of its best group's k + 1, and which k hangs on those 1e-5: a 1e-4 change of the router
  (a sampler's weights one bf16 rounding or one step away) changes many tokens' set of experts (not just their
  order, as tied pairs under top-2 would); the experts' weights are large enough that which ones run changes the
  next token's probability."""
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  group = CONFIG.num_experts_per_tok + 1
  for stack in model.layer_stacks:
    if isinstance(stack.mlp, models.MoE):
      *layers, d, e = stack.mlp.w_router_de.shape
      base = rng.normal(0, 0.5, (*layers, d, e // group))
      tied = np.stack([base + 1e-5 * rng.normal(size=base.shape) for _ in range(group)], axis=-1)
      stack.mlp.w_router_de[...] = jnp.asarray(tied.reshape(*layers, d, e), jnp.float32)
      for w in (stack.mlp.w_gate_edf, stack.mlp.w_up_edf, stack.mlp.w_down_efd):  # experts that matter
        w[...] = jnp.asarray(rng.normal(0, 0.3, w.shape), jnp.float32)
  return model


def test_router_replay_makes_the_first_ratio_one_where_fragile_routing_breaks_it():
  """The sampler's router is the learner's plus 1e-4 noise. Without replay the learner picks other experts for
  some tokens and the importance ratio of the very first update is far from 1; replaying the sampler's expert
  ids leaves only the routing weights' 1e-4 difference."""
  learner = _fragile()
  graphdef, params = nnx.split(learner)
  noise = iter(jax.random.split(jax.random.key(9), 8))
  sampler = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(
      lambda path, x: x + 1e-4 * jax.random.normal(next(noise), x.shape) if "w_router_de" in str(path) else x,
      params))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, CONFIG.vocab_size, (4, 24)), jnp.int32)

  def logprobs(model, routes=None):
    logits = model(tokens, routes=routes)[:, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]

  sampled = sampler.features(tokens, return_routes=True)[2]
  behavior = logprobs(sampler)
  own = learner.features(tokens, return_routes=True)[2]
  flipped = float(jnp.mean(jnp.any(own != sampled, axis=-1)))
  without = jnp.exp(logprobs(learner) - behavior)
  replayed = jnp.exp(logprobs(learner, sampled) - behavior)
  print(f"routing decisions that differ: {flipped:.1%}; ratio without replay [{float(without.min()):.4f}, "
        f"{float(without.max()):.4f}], with replay [{float(replayed.min()):.6f}, {float(replayed.max()):.6f}]")
  assert flipped > 0.05  # the routing is fragile here ...
  assert float(jnp.abs(without - 1).max()) > 0.05  # ... and that breaks the ratio without replay
  assert float(jnp.abs(replayed - 1).max()) < 1e-3  # with replay: 1 within the routing weights' own difference

  # The router still learns under replay: its gradient flows through the replayed experts' probabilities.
  def loss(params):
    return -jnp.sum(nnx.merge(graphdef, params)(tokens, routes=sampled)[:, :, 0])
  grads = jax.grad(loss)(params)
  assert float(jnp.abs(grads["layer_stacks"][0]["mlp"]["w_router_de"][...]).max()) > 0


def test_experts_dispatched_per_batch_shard_on_8_devices_equal_one_device(model):
  """The model sharded over a 4 (fsdp) x 2 (tensor) mesh of fake CPU devices, its experts' dispatch split over
  the batch's shards (`dispatch_experts_over`): the same logits and gradients as one device, and the compiled
  update holds no whole-batch copy of the assignments (its temporaries shrink)."""
  from jaxagent import sharding
  assert jax.device_count() == 8, "tests/conftest.py must give 8 CPU devices"
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  graphdef, params = nnx.split(model)
  sharded = nnx.split(models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh,
                                         sharding.FSDP_TP_RULES))[1]
  sharded = jax.tree.map(lambda s, p: jax.device_put(p, s.sharding), sharded, params)  # the same values, laid out
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, CONFIG.vocab_size, (8, 12)), jnp.int32)
  rows = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))

  def loss(params, tokens):
    return jnp.mean(nnx.merge(graphdef, params)(tokens) ** 2)

  grad = jax.jit(jax.value_and_grad(loss))
  expected_loss, expected_grads = grad(params, tokens)

  def dispatched(params, tokens):
    with models.dispatch_experts_over(models.ExpertPlacement(mesh, ("fsdp",), sharding.FSDP_TP_RULES)):
      return jax.value_and_grad(loss)(params, tokens)

  program = jax.jit(dispatched).lower(sharded, rows).compile()
  got_loss, got_grads = program(sharded, rows)
  np.testing.assert_allclose(float(got_loss), float(expected_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(expected_grads), jax.tree.leaves(got_grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)
  whole = jax.jit(jax.value_and_grad(loss)).lower(sharded, rows).compile()
  print(f"temporaries per device: dispatched per shard {program.memory_analysis().temp_size_in_bytes:,} B, as one "
        f"{whole.memory_analysis().temp_size_in_bytes:,} B")
  assert program.memory_analysis().temp_size_in_bytes < whole.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("shape,rows,tokens_to_experts", [
    ({"fsdp": 2, "expert": 2, "tensor": 2}, 8, True),  # tokens over the expert axis, gathered and scattered back
    ({"fsdp": 2, "expert": 2, "tensor": 2}, 2, True),  # rows too few to split: the same tokens, outputs summed
    ({"fsdp": 2, "expert": 2, "tensor": 2}, 8, False)])  # many tokens per expert: the experts come to the tokens
def test_expert_parallel_on_8_devices_equals_one_device(model, shape, rows, tokens_to_experts, monkeypatch):
  """Experts split over the `expert` mesh axis (3 of the 6 on each device), the dispatch split over the batch's
  shards: the same logits and gradients as one device, each device holding only its experts' weights. With few
  tokens per expert the compiled program moves tokens, not experts: no all-gather in it is as large as a layer's
  experts; with many (the limit set to 0 here) it gathers each layer's experts instead."""
  if not tokens_to_experts:
    monkeypatch.setattr(models._transformer, "TOKENS_TO_EXPERTS_MAX_PER_EXPERT", 0)
  from jaxagent import multihost, sharding
  mesh = sharding.make_mesh(shape)
  rules = sharding.FSDP_TP_RULES
  graphdef, params = nnx.split(model)
  shardings = models.state_shardings(params, mesh, rules)
  sharded = jax.device_put(params, shardings)
  gate = sharded["layer_stacks"][0]["mlp"]["w_gate_edf"][...]
  assert {s.data.shape[1] for s in gate.addressable_shards} == {CONFIG.num_experts // 2}  # [L, E, D, F]
  assert not set(sharded["layer_stacks"][0]["mlp"]["w_router_de"][...].sharding.spec) - {None, "fsdp"}  # router whole
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, CONFIG.vocab_size, (rows, 12)), jnp.int32)
  placement = multihost.expert_placement(CONFIG.num_experts, mesh, rules)
  assert placement is not None and "expert" in placement.batch_axes
  tokens_sharding = multihost.batch_sharding(tokens.shape, mesh, rules)
  assert (tokens_sharding.spec[0] is None) == (rows == 2)

  def loss(params, tokens):
    return jnp.mean(nnx.merge(graphdef, params)(tokens) ** 2)

  expected_loss, expected_grads = jax.jit(jax.value_and_grad(loss))(params, tokens)

  def dispatched(params, tokens):
    with models.dispatch_experts_over(placement):
      return jax.value_and_grad(loss)(params, tokens)

  program = jax.jit(dispatched).lower(sharded, jax.device_put(tokens, tokens_sharding)).compile()
  got_loss, got_grads = program(sharded, jax.device_put(tokens, tokens_sharding))
  np.testing.assert_allclose(float(got_loss), float(expected_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(expected_grads), jax.tree.leaves(got_grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)
  e, d, f = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
  whole = {(e, d, f), (e, f, d), (e, d, f // 2), (e, f // 2, d)}  # every expert, with or without the tensor split
  gathered = {tuple(int(n) for n in dims.split(",")) for dims in re.findall(r"\[([\d,]+)\]\S*\s+all-gather",
                                                                          program.as_text())}
  assert bool(gathered & whole) != tokens_to_experts, f"all-gathers: {gathered}"


def test_router_statistics_are_one_and_log_e_squared_for_a_uniform_router_and_ignore_padding(model):
  """`features(router_stats=True)`: the load-balancing loss E·Σ f_e·P_e is 1 whenever the router's probabilities
  are uniform (whatever the top-k picks), the z-loss is logsumexp(0)² = (log E)²; a skewed router raises the
  balance loss; padding tokens (segment 0) count in neither."""
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
  uniform = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "w_router_de" in str(path) else x, params))
  stats = uniform.features(tokens, router_stats=True)[-1]
  np.testing.assert_allclose(float(stats["load_balance"]), 1.0, rtol=1e-5)
  np.testing.assert_allclose(float(stats["router_z"]), np.log(CONFIG.num_experts) ** 2, rtol=1e-5)
  skewed = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[..., 0].add(3.0) if "w_router_de" in str(path) else x, params))  # expert 0
  assert float(skewed.features(tokens, router_stats=True)[-1]["load_balance"]) > 1.1
  # Padding changes nothing: the same tokens with padded ones appended.
  padded = jnp.concatenate([tokens, tokens[:, :4]], axis=1)
  segments = jnp.concatenate([jnp.ones((2, 9), jnp.int32), jnp.zeros((2, 4), jnp.int32)], axis=1)
  got = model.features(padded, segment_ids_bt=segments, router_stats=True)[-1]
  want = model.features(tokens, router_stats=True)[-1]
  for key in ("load_balance", "router_z"):
    np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5)
  # Under remat (the layers scanned) the statistics are the same.
  scanned = model.features(tokens, remat="full", router_stats=True)[-1]
  np.testing.assert_allclose(float(scanned["load_balance"]), float(want["load_balance"]), rtol=1e-5)


def test_expert_parallel_decoding_equals_one_device(model):
  """The sampler on an expert-parallel rollout layout (experts over `expert`, their width over `tensor`, no FSDP:
  the rollout rules): prefill and sampled decode give the same tokens and log-probs as one device, and every
  program's dispatch runs under the sampler's expert placement."""
  from jaxagent import multihost, sharding
  from jaxagent.rollout.sampler import Sampler, SamplingConfig
  mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  rules = sharding.TENSOR_PARALLEL_RULES
  cfg = SamplingConfig(temperature=1.0, max_new_tokens=6)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 1, 4, 1, 5]]
  params = nnx.split(model)[1]
  single = Sampler(model, cache_size=32, config=cfg, pad_id=0)
  _, expected = single.generate(params, single.prefill(params, prompts, jax.random.key(9)))
  sharded = jax.device_put(params, models.state_shardings(params, mesh, rules))
  s = Sampler(model, cache_size=32, config=cfg, pad_id=0, mesh=mesh, rules=rules)
  assert s.expert_placement == multihost.expert_placement(CONFIG.num_experts, mesh, rules)
  assert s.expert_placement.batch_axes == ("data", "expert")
  _, got = s.generate(sharded, s.prefill(sharded, prompts, jax.random.key(9)))
  assert np.array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-5)
