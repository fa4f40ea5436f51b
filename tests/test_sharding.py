"""Sharding runs for real on 8 fake CPU devices (tests/conftest.py): 2x4 mesh == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from jaxagent import weights
from jaxagent import sharding
from tests import hf_reference as ref

CONFIG = models.ModelConfig(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "tests/conftest.py must give 8 CPU devices"
  return sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})


def _forward(model, tokens):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)


def test_rules_table_shards_parameters(mesh):
  model = models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh, sharding.FSDP_TP_RULES)
  stack = model.layer_stacks[0]  # every layer's weights stacked on a leading axis that is never split
  assert stack.mlp.w_gate_df[...].sharding.spec == P(None, "fsdp", "tensor")
  assert stack.mlp.w_down_fd[...].sharding.spec == P(None, "tensor", "fsdp")
  assert stack.attn.w_q_dnh[...].sharding.spec == P(None, "fsdp", "tensor", None)
  # kv_heads=2 is not divisible by tensor=4: that dimension stays replicated, embed is still FSDP.
  assert stack.attn.w_k_dkh[...].sharding.spec == P(None, "fsdp", None, None)
  assert model.embed_vd[...].sharding.spec == P("tensor", "fsdp")
  shard = model.embed_vd[...].addressable_shards[0].data
  assert shard.shape == (264 // 4, 64 // 2)


def test_sharded_forward_equals_unsharded(mesh):
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (4, 16)), jnp.int32)
  expected = np.asarray(model(tokens))
  sharded = models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh, sharding.FSDP_TP_RULES)
  batch_sharding = jax.sharding.NamedSharding(mesh, models.logical_to_spec(("batch", None), (4, 16), mesh, sharding.FSDP_TP_RULES))
  got = _forward(sharded, jax.device_put(tokens, batch_sharding))
  assert len(got.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-5)


def test_from_pretrained_places_tensors_on_the_mesh(mesh, tmp_path):
  torch_model = ref.make_hf_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
  path = ref.save_hf_model(torch_model, tmp_path / "hf")
  model = models.from_pretrained(path, mesh=mesh, rules=sharding.FSDP_TP_RULES)
  w = model.layer_stacks[0].mlp.w_up_df[...]
  assert w.sharding.spec == P(None, "fsdp", "tensor") and len(w.sharding.device_set) == 8
  tokens, mask, positions = ref.padded_batch()
  got = jax.jit(lambda t, p, s: model(t, positions_bt=p, segment_ids_bt=s))(
      jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(mask, jnp.int32))
  expected = ref.reference_logits(torch_model, tokens, mask, positions)
  assert np.abs(np.asarray(got) - expected)[mask.astype(bool)].max() <= 1e-4

  # Orbax restore straight into the same shardings.
  ckpt = weights.save_model(model, tmp_path / "ckpt")
  restored = weights.load_model(ckpt, mesh=mesh, rules=sharding.FSDP_TP_RULES)
  assert restored.layer_stacks[0].mlp.w_up_df[...].sharding.spec == P(None, "fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(restored.layer_stacks[0].mlp.w_up_df[...]), np.asarray(w))


def test_bf16_runs_sharded(mesh, tmp_path):
  model32 = models.Transformer(CONFIG, rngs=nnx.Rngs(1))
  path = models.save_pretrained(model32, tmp_path / "hf")
  model16 = models.from_pretrained(path, dtype=jnp.bfloat16, mesh=mesh, rules=sharding.FSDP_TP_RULES)
  assert model16.embed_vd[...].dtype == jnp.bfloat16
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 264, (2, 12)), jnp.int32)
  got = np.asarray(_forward(model16, tokens))
  expected = np.asarray(model32(tokens))
  assert got.dtype == np.float32 and np.isfinite(got).all()
  # bf16 keeps ~3 significant digits: error bounded relative to the logit scale.
  assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_mesh_shape_errors():
  with pytest.raises(ValueError, match="at most one mesh axis"):
    sharding.make_mesh({"data": -1, "fsdp": -1})
  with pytest.raises(ValueError, match="needs 6 devices"):
    sharding.make_mesh({"data": 3, "fsdp": 2, "tensor": 1})
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sharding.make_mesh({"model": 2})
