"""Layers are stored as stacks (one per run of layers of one structure) and run as scans: the scanned model equals
the same layers applied one by one (logits and gradient, float32), the programs' size does not grow with depth,
and a checkpoint written with one tree per layer is refused by name with what to do."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import models
from jaxagent import weights
from jaxagent.train import checkpointing
from models._rope import rope_tables
from tests.test_kv_cache import CONFIG, GEMMA_CONFIG, MOE_CONFIG, decisive_routers

TOL = dict(rtol=1e-5, atol=1e-5)
GEMMA_4 = dataclasses.replace(GEMMA_CONFIG, num_hidden_layers=4, layer_types=(
    "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"))  # stacks of 2, 1, 1
CONFIGS = {"dense": dataclasses.replace(CONFIG, num_hidden_layers=3), "moe": MOE_CONFIG, "gemma3": GEMMA_4}


def test_layer_runs_group_consecutive_layers_of_one_structure():
  assert models.layer_runs(dataclasses.replace(CONFIG, num_hidden_layers=5)) == ((0, 1, 2, 3, 4),)
  assert models.layer_runs(MOE_CONFIG) == ((0,), (1,))  # sparse, then the dense layer of mlp_only_layers
  sliding_5_to_1 = dataclasses.replace(GEMMA_CONFIG, num_hidden_layers=8, layer_types=(
      ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 2))
  assert models.layer_runs(sliding_5_to_1) == ((0, 1, 2, 3, 4), (5,), (6, 7))
  assert models.layer_runs(GEMMA_4) == ((0, 1), (2,), (3,))


def _unrolled_logits(model, tokens):
  """The layers applied one at a time (`Transformer.layer`), as a model stored per layer would run them."""
  b, t = tokens.shape
  x = jnp.take(model.embed_vd[...], tokens, axis=0) * jnp.asarray(model.config.embed_scale, jnp.float32)
  positions, segments = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)
  for i in range(model.config.num_hidden_layers):
    x = model.layer(i)(x, positions, segments, rope_tables(model.config), None)[0]
  return model.unembed(model.final_norm(x))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scanned_layers_equal_the_layers_one_by_one_in_logits_and_gradient(name):
  model = decisive_routers(models.Transformer(CONFIGS[name], rngs=nnx.Rngs(1)))
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9)), jnp.int32)
  np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(_unrolled_logits(model, tokens)), **TOL)

  def loss(state, forward):
    logits = forward(nnx.merge(graphdef, state), tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[:, :-1, :].max(-1)) + jnp.mean(logits[:, :, 3])

  scanned = jax.grad(loss)(state, lambda m, t: m(t))
  unrolled = jax.grad(loss)(state, _unrolled_logits)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(scanned), jax.tree.leaves(unrolled), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL, err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(scanned["layer_stacks"]))


def _program_text(layers: int, kind: str) -> str:
  config = dataclasses.replace(CONFIG, num_hidden_layers=layers)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0))))
  if kind == "decode":
    cache = jax.eval_shape(lambda: models.KVCache.init(config, 4, 64))
    step = lambda s, c, t: nnx.merge(graphdef, s)(t, cache=c)
    return jax.jit(step).lower(state, cache, jax.ShapeDtypeStruct((4, 1), jnp.int32)).as_text()
  loss = lambda s, t: jnp.mean(nnx.merge(graphdef, s).features(t, remat="full")[0])
  return jax.jit(jax.grad(loss)).lower(state, jax.ShapeDtypeStruct((2, 16), jnp.int32)).as_text()


@pytest.mark.parametrize("kind", ["decode", "train"])
def test_a_program_does_not_grow_with_depth(kind):
  """One compiled layer body whatever the depth: 2 and 24 layers lower to programs of (almost) the same size."""
  shallow, deep = len(_program_text(2, kind)), len(_program_text(24, kind))
  print(f"{kind}: {shallow} -> {deep} characters of StableHLO for 2 -> 24 layers")
  assert deep < 1.05 * shallow


def _orbax_model_checkpoint(path, model_config: dict):
  """An Orbax model checkpoint holding only a model config (what the layout check reads first)."""
  with ocp.CheckpointManager(path.resolve()) as mngr:
    mngr.save(0, args=ocp.args.Composite(**{weights.PARAMS: ocp.args.StandardSave({"x": np.zeros(2)}),
                                            weights.MODEL_CONFIG: ocp.args.JsonSave(model_config)}), force=True)
    mngr.wait_until_finished()
  return path


def test_a_checkpoint_with_one_tree_per_layer_is_refused_with_what_to_do(tmp_path):
  per_layer = models.config_to_hf(CONFIG)  # as written before layer stacks: no layout key
  with pytest.raises(models.CheckpointError, match=r"one parameter tree per layer .*\(`jaxagent convert"):
    weights.load_model(_orbax_model_checkpoint(tmp_path / "old", per_layer))
  with pytest.raises(checkpointing.IncompatibleCheckpointError, match=r"cannot resume: it holds one parameter tree "
                                                                        r"per layer"):
    checkpointing._check_compatible(per_layer, weights.checkpoint_model_config(CONFIG), tmp_path)
  checkpointing._check_compatible(weights.checkpoint_model_config(CONFIG), weights.checkpoint_model_config(CONFIG),
                                  tmp_path)
  # Today's checkpoints round-trip.
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(0))
  restored = weights.load_model(weights.save_model(model, tmp_path / "new"))
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(restored))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
