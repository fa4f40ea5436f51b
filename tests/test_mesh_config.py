"""Mesh from config (ICI/DCN, -1 inferred), per-role rules tables and the replication guard, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from jaxagent import config as config_lib
from jaxagent import sharding

CONFIG = models.ModelConfig(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                            tie_word_embeddings=False)


def _mesh_config(*overrides):
  return config_lib.load(None, list(overrides)).mesh


@pytest.mark.parametrize("overrides, devices, granules, ici, dcn", [  # (data, fsdp, expert, tensor)
    ((), 8, 1, (1, 8, 1, 1), (1, 1, 1, 1)),                             # default: FSDP inside, data across
    ((), 8, 2, (1, 4, 1, 1), (2, 1, 1, 1)),
    (("mesh.ici.tensor=2",), 16, 4, (1, 2, 1, 2), (4, 1, 1, 1)),
    (("mesh.dcn.data=1", "mesh.dcn.fsdp=-1"), 32, 4, (1, 8, 1, 1), (1, 4, 1, 1)),
    (("mesh.dcn.data=1",), 8, 2, (1, 8, 1, 1), (1, 1, 1, 1)),           # DCN all 1: ICI covers every device
    (("mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.tensor=-1"), 8, 1, (2, 1, 1, 4), (1, 1, 1, 1)),
    (("mesh.ici.expert=4", "mesh.ici.tensor=2"), 16, 1, (1, 2, 4, 2), (1, 1, 1, 1)),  # expert parallelism
])
def test_resolve_mesh_shape(overrides, devices, granules, ici, dcn):
  got_ici, got_dcn = sharding.resolve_mesh_shape(_mesh_config(*overrides), devices, granules)
  assert tuple(got_ici.values()) == ici and tuple(got_dcn.values()) == dcn


@pytest.mark.parametrize("overrides, devices, granules, pattern", [
    (("mesh.ici.tensor=3",), 8, 1, r"mesh.ici \(over all 8 devices\): 8 cannot be split as .*'tensor': 3"),
    (("mesh.dcn.data=4",), 8, 2, r"mesh.dcn \(over 2 granules: slices or processes\)=\{'data': 4.*multiplies "
                                 r"to 4, but there are 2"),
    (("mesh.ici.fsdp=2",), 8, 1, r"mesh.ici \(over all 8 devices\)=\{'data': 1, 'fsdp': 2, 'expert': 1, "
                                 r"'tensor': 1\} multiplies to 2"),
    ((), 8, 3, r"8 devices are not split evenly over 3 granules"),
])
def test_mesh_shape_errors_name_the_keys(overrides, devices, granules, pattern):
  with pytest.raises(ValueError, match=pattern):
    sharding.resolve_mesh_shape(_mesh_config(*overrides), devices, granules)


def test_mesh_from_config_on_8_devices():
  mesh = sharding.mesh_from_config(_mesh_config("mesh.ici.data=2", "mesh.ici.tensor=2"))
  assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
  default = sharding.mesh_from_config(_mesh_config())
  assert dict(default.shape) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
  sub = sharding.mesh_from_config(_mesh_config("mesh.ici.tensor=2"), devices=jax.devices()[:4])
  assert dict(sub.shape) == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 2}
  # One process is one granule: a DCN size > 1 cannot be met (the 2-process test builds a hybrid mesh).
  with pytest.raises(ValueError, match=r"mesh.dcn \(over 1 granules.*'data': 2.*there are 1"):
    sharding.mesh_from_config(_mesh_config("mesh.dcn.data=2"))


def test_role_tables_and_tiny_cpu_mesh():
  cfg = _mesh_config()
  assert sharding.rules_for("learner", cfg) is sharding.FSDP_TP_RULES
  assert sharding.rules_for("rollout", cfg) is sharding.TENSOR_PARALLEL_RULES
  assert sharding.rules_for("reference", _mesh_config("mesh.rules.reference=replicated")) is sharding.REPLICATED_RULES
  with pytest.raises(ValueError, match=r"role 'critic': not one of \['rollout', 'learner', 'reference'\]"):
    sharding.rules_for("critic", cfg)
  tiny = config_lib.load("tiny_cpu").mesh
  assert dict(sharding.mesh_from_config(tiny).shape) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}


def _forward(model, tokens):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)


def test_rollout_and_learner_layouts_compute_the_same_logits():
  mesh = sharding.mesh_from_config(_mesh_config("mesh.ici.data=2", "mesh.ici.tensor=2"))  # (2, 2, 2)
  cfg = _mesh_config()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (4, 12)), jnp.int32)
  expected = np.asarray(models.Transformer(CONFIG, rngs=nnx.Rngs(0))(tokens))
  for role, spec_q, spec_embed in (("rollout", P(None, "tensor", None), P("tensor", None)),
                                   ("learner", P("fsdp", "tensor", None), P("tensor", "fsdp"))):
    rules = sharding.rules_for(role, cfg)
    model = models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh, rules)
    assert model.layer_stacks[0].attn.w_q_dnh[...].sharding.spec == P(None, *spec_q), role  # [L, D, N, H]
    assert model.embed_vd[...].sharding.spec == spec_embed, role
    np.testing.assert_allclose(np.asarray(_forward(model, tokens)), expected, rtol=0, atol=1e-5)


def test_replication_guard():
  mesh = sharding.mesh_from_config(_mesh_config("mesh.ici.tensor=2"))  # fsdp 4 x tensor 2
  learner = nnx.split(models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh, sharding.FSDP_TP_RULES))[1]
  report = sharding.check_replication(learner, 0.05)
  # Only the RMSNorm scales stay replicated: (2 layers x 2 + final) x 64 floats.
  assert report.replicated_bytes == 5 * 64 * 4 and report.total_bytes == CONFIG.num_params() * 4
  assert report.replicated_fraction < 0.01

  replicated = nnx.split(models.shard_model(models.Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh,
                                            sharding.REPLICATED_RULES))[1]
  with pytest.raises(sharding.ReplicationError,
                     match=r"100\.0% of parameter bytes .* more than mesh.max_replicated_fraction=0.5\. "
                           r"Largest replicated: embed_vd \[264, 64\] \(0\.06 MiB\), w_unembed_dv \[64, 264\].*"
                           r"layer_stacks\.0\.mlp\.w_down_fd \[2, 128, 64\]"):
    sharding.check_replication(replicated, 0.5)
  assert sharding.check_replication(replicated, 1.0).replicated_fraction == 1.0

  # Abstract state (eval_shape + shardings) is checked the same way, before anything is allocated.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), replicated)
  with pytest.raises(sharding.ReplicationError):
    sharding.check_replication(abstract, 0.5)

  # On one device nothing counts as replicated.
  single = jax.device_put(replicated, jax.devices()[0])
  assert sharding.check_replication(single, 0.0).replicated_bytes == 0
  with pytest.raises(ValueError, match=r"max_replicated_fraction=1.5: must be in \[0, 1\]"):
    sharding.check_replication(learner, 1.5)


@pytest.mark.parametrize("sizes, fraction, expected", [
    ([1, 1, 1, 1], 0.5, [range(0, 2), range(2, 4)]),
    ([5, 1, 1, 1], 0.25, [range(0, 1), range(1, 3), range(3, 4)]),   # an array over budget is its own group
    ([1] * 8, 1.0, [range(0, 8)]),
    ([], 0.5, []),
])
def test_chunk_plan(sizes, fraction, expected):
  assert sharding.chunk_plan(sizes, fraction) == expected


def test_reshard_round_trip_between_role_layouts_frees_sources_and_keeps_values():
  mesh = sharding.mesh_from_config(_mesh_config("mesh.ici.data=2", "mesh.ici.tensor=2"))  # (2, 2, 2)
  cfg = _mesh_config()
  abstract = nnx.split(nnx.eval_shape(lambda: models.Transformer(CONFIG, rngs=nnx.Rngs(0))))[1]
  layouts = {role: models.state_shardings(abstract, mesh, sharding.rules_for(role, cfg))
             for role in ("learner", "rollout")}
  params = jax.jit(lambda: nnx.split(models.Transformer(CONFIG, rngs=nnx.Rngs(0)))[1],
                   out_shardings=layouts["learner"])()
  expected = jax.tree.map(np.asarray, params)
  source = jax.tree.leaves(params)
  same = [x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(source, jax.tree.leaves(layouts["rollout"]))]
  assert not all(same), "the two layouts do not differ: the test would be vacuous"
  rollout = sharding.reshard(params, layouts["rollout"], chunk_fraction=0.3)
  for x, y, kept in zip(source, jax.tree.leaves(rollout), same):
    assert (y is x) if kept else x.is_deleted(), "moved sources are freed; arrays already in place stay"
  for x, s in zip(jax.tree.leaves(rollout), jax.tree.leaves(layouts["rollout"])):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  back = sharding.reshard(rollout, layouts["learner"], chunk_fraction=0.3)
  for x, s, e in zip(jax.tree.leaves(back), jax.tree.leaves(layouts["learner"]), jax.tree.leaves(expected)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
    np.testing.assert_array_equal(np.asarray(x), e)
