"""LoRA: adapters merge exactly, only adapters train (optimizer and checkpoint hold only them), a run resumes,
and the merged export loads in transformers with the same logits."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from jaxagent import algos
from jaxagent.config import AlgoConfig, OptimConfig
from jaxagent.train.state import TrainState, make_optimizer
from jaxagent.train.step import StepOptions, make_train_step
from tests import test_train_step as ts

CONFIG = ts.CONFIG


def test_adapters_start_as_the_base_model_and_merge_into_their_targets_only():
  config = dataclasses.replace(CONFIG, num_hidden_layers=2)
  model = models.Transformer(config, rngs=nnx.Rngs(0))
  base = nnx.state(model)
  adapters = models.lora_init(base, rank=2, targets=("q", "o", "down"), key=jax.random.key(1))
  stack = adapters["layer_stacks"]["0"]  # one adapter per layer of the stack, stacked as its weights
  d, n, h, layers = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_hidden_layers
  assert stack["attn"]["w_q_dnh"]["a"].shape == (layers, d, 2)
  assert stack["attn"]["w_q_dnh"]["b"].shape == (layers, 2, n * h)
  assert stack["attn"]["w_o_nhd"]["a"].shape == (layers, n * h, 2) and set(stack) == {"attn", "mlp"}
  same = models.lora_merge(base, adapters, 8.0)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(same)))
  moved = jax.tree.map(lambda x: x + 0.1, adapters)
  merged = models.lora_merge(base, moved, 0.5)
  ad = moved["layer_stacks"]["0"]["attn"]["w_q_dnh"]
  expect = base["layer_stacks"][0]["attn"]["w_q_dnh"][...][1] + 0.5 * (ad["a"][1] @ ad["b"][1]).reshape(d, n, h)
  np.testing.assert_allclose(merged["layer_stacks"][0]["attn"]["w_q_dnh"][...][1], expect, rtol=1e-6)
  changed = {jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(base)[0],
                                                          jax.tree.leaves(merged)) if not np.array_equal(a, b)}
  assert changed and all(any(w in c for w in ("w_q_dnh", "w_o_nhd", "w_down_fd")) for c in changed)
  with pytest.raises(ValueError, match="choose from"):
    models.lora_init(base, rank=2, targets=("qkv",), key=jax.random.key(0))


def test_a_lora_step_changes_the_adapters_only_and_the_optimizer_holds_only_them():
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(0))
  graphdef, policy = nnx.split(model)
  adapters = models.lora_init(policy, rank=2, targets=("q", "v", "up"), key=jax.random.key(1))
  optimizer = make_optimizer(OptimConfig(learning_rate=1e-2), optax.constant_schedule(1e-2))
  state = TrainState(params={"policy": policy, "lora": adapters}, opt_state=optimizer.init({"lora": adapters}),
                     step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0),
                     ref_params=None)
  before = jax.device_get(state.params)
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert moments <= 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 8  # mu and nu of the adapters (+ counts)
  batch = ts._batch(model, seed=1)
  step = make_train_step({"policy": graphdef}, optimizer, StepOptions(AlgoConfig(), mode="rl", temperature=ts.TEMPERATURE,
                                                                   frozen=("policy",), lora_scale=4.0))
  state, metrics = step(state, batch, jnp.float32(algos.loss_normalizer(batch.loss_mask, batch.segment_ids)))
  after = jax.device_get(state.params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["policy"]), jax.tree.leaves(after["policy"])))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["lora"]), jax.tree.leaves(after["lora"])))
  assert float(metrics["grad_norm"]) > 0


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_only_resumes_and_exports_a_merged_hf_model(tmp_path, capsys):
  import torch
  import transformers

  from jaxagent import cli, weights
  from jaxagent.train import loop
  from tests.test_train import _config

  lora = ["model.lora_rank=4", "model.lora_targets=[q,v,gate]", "train.eval_episodes=0"]
  config = _config(tmp_path, "train.iterations=2", *lora)
  progress = loop.train(config, run_dir=tmp_path / "run")
  ckpt = tmp_path / "run" / "checkpoints"
  step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  stored = json.loads((ckpt / str(step) / "state" / "_METADATA").read_text())["tree_metadata"]
  assert stored and not any("'policy'" in k for k in stored), "the base policy was checkpointed"
  assert any("'lora'" in k for k in stored)
  # Resume: the base comes back from the seed, the adapters from the checkpoint, training continues.
  resumed = loop.train(_config(tmp_path, "train.iterations=3", *lora), run_dir=tmp_path / "run", resume=True)
  assert resumed.iteration == 3 and int(resumed.train.policy_version) == int(progress.train.policy_version) + 1
  assert "resumed from" in capsys.readouterr().out

  # Resuming with other LoRA settings is refused by name (not reported as a damaged checkpoint).
  from jaxagent.train.checkpointing import IncompatibleCheckpointError
  with pytest.raises(IncompatibleCheckpointError, match="lora is .* in the checkpoint"):
    loop.train(_config(tmp_path, "train.iterations=4", "model.lora_rank=8", "model.lora_targets=[q,v,gate]",
                       "train.eval_episodes=0"), run_dir=tmp_path / "run", resume=True)

  # The restored merged policy is the trainer's (in the run's dtype, whatever dtype it is loaded in).
  expect = models.lora_merge(resumed.train.params["policy"], resumed.train.params["lora"], 16.0 / 4)
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
    loaded = nnx.state(weights.load_model(ckpt, dtype=dtype))
    for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(loaded)):
      np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=tol, atol=tol)

  # Merged export: the trained adapters folded into the weights, loadable by transformers, same logits.
  merged = weights.load_model(ckpt)
  assert cli.main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"]) == 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
  tokens = np.random.default_rng(0).integers(0, merged.config.vocab_size, (1, 12))
  ours = np.asarray(merged(jnp.asarray(tokens, jnp.int32)))
  theirs = hf(torch.tensor(tokens)).logits.detach().numpy()
  np.testing.assert_allclose(theirs, ours, rtol=2e-4, atol=2e-4)
  base = models.Transformer(merged.config, rngs=nnx.Rngs(config.run.seed))
  assert not np.allclose(np.asarray(base(jnp.asarray(tokens, jnp.int32))), ours, atol=1e-4)  # adapters count
