"""Mixture of experts (the qwen3_moe family): the dropless routed MLP equals a dense reference that runs every
expert on every token, a token's experts depend on that token alone, the layers' scans (remat) equal the
unrolled loop and give the same gradients when dense and sparse layers alternate, and bad configs are refused by
name. Parity with transformers is in models_vs_reference_test.py, the KV cache in test_kv_cache.py."""

import dataclasses

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
  assert [type(layer.mlp).__name__ for layer in model.layers] == ["MoE", "MoE", "MLP", "MoE"]
  every_other = dataclasses.replace(CONFIG, decoder_sparse_step=2, mlp_only_layers=())
  assert [every_other.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
  moe = model.layers[0].mlp
  x = jax.random.normal(jax.random.key(0), (3, 5, CONFIG.hidden_size))
  experts, weights = moe.route(x)
  assert experts.shape == weights.shape == (3, 5, 2) and experts.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)  # norm_topk_prob
  assert len(np.unique(np.asarray(experts))) > 2  # the tokens spread over the experts
  np.testing.assert_allclose(np.asarray(moe(x)), np.asarray(_dense_reference(moe, x)), atol=TOL, rtol=TOL)
  # Dropless: a token's output does not depend on the other tokens of the batch.
  np.testing.assert_allclose(np.asarray(moe(x[1:2, 2:4])), np.asarray(moe(x))[1:2, 2:4], atol=TOL, rtol=TOL)


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
  router_grad = g0["layers"][0]["mlp"]["w_router_de"][...]
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
