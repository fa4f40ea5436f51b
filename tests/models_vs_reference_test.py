"""Parity: our NNX models vs transformers (PyTorch) on tiny random checkpoints, max |Δlogit| <= 1e-4."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import models
from tests import hf_reference as ref

TOL = 1e-4  # fixed; never loosened to pass


@pytest.fixture(scope="module", params=sorted(ref.SPECS))
def checkpoint(request, tmp_path_factory):
  family, overrides = ref.SPECS[request.param]
  torch_model = ref.make_hf_model(family, **overrides)
  path = ref.save_hf_model(torch_model, tmp_path_factory.mktemp(request.param))
  return request.param, torch_model, path


def test_logits_match_transformers_on_a_padded_batch(checkpoint):
  name, torch_model, path = checkpoint
  model = models.from_pretrained(path)
  tokens, mask, positions = ref.padded_batch()
  expected = ref.reference_logits(torch_model, tokens, mask, positions)
  got = np.asarray(model(jnp.asarray(tokens, jnp.int32), positions_bt=jnp.asarray(positions, jnp.int32),
                         segment_ids_bt=jnp.asarray(mask, jnp.int32)))
  valid = mask.astype(bool)
  assert got.dtype == np.float32 and got.shape == expected.shape
  assert np.abs(expected).max() > 0.5, "reference logits too small for a meaningful comparison"
  err = np.abs(got - expected)[valid].max()
  assert err <= TOL, f"{name}: max |Δlogit| {err:.3g} > {TOL}"


def test_default_positions_match_transformers(checkpoint):
  _, torch_model, path = checkpoint
  model = models.from_pretrained(path)
  tokens = np.random.default_rng(1).integers(0, ref.VOCAB, (2, 40))  # past llama3's 16-token original ctx
  err = np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - ref.reference_logits(torch_model, tokens))
  assert err.max() <= TOL


def test_round_trip_through_save_pretrained(checkpoint, tmp_path):
  name, torch_model, path = checkpoint
  model = models.from_pretrained(path)
  out = models.save_pretrained(model, tmp_path / "out", max_shard_bytes=60_000)  # forces an index
  assert (out / models._hf.INDEX_FILE).is_file()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert type(reloaded) is type(torch_model)
  tokens, mask, positions = ref.padded_batch(seed=2)
  a = ref.reference_logits(torch_model, tokens, mask, positions)
  b = ref.reference_logits(reloaded, tokens, mask, positions)
  assert np.abs(a - b)[mask.astype(bool)].max() <= TOL, name
  # And back into ours from the sharded (indexed) checkpoint.
  again = models.from_pretrained(out)
  got = np.asarray(again(jnp.asarray(tokens, jnp.int32), positions_bt=jnp.asarray(positions, jnp.int32),
                         segment_ids_bt=jnp.asarray(mask, jnp.int32)))
  assert np.abs(got - a)[mask.astype(bool)].max() <= TOL


@pytest.mark.parametrize("spec", ["gemma3-window-in-prompt", "qwen3moe-dense-layer"])
def test_greedy_generation_equals_transformers_generate(spec):
  """The new families through the sampler (prefill, then one-token decode steps on the KV cache): a 12-token
  prompt and 10 new tokens (Gemma 3: under a window of 5), the same greedy tokens as transformers' generate."""
  from jaxagent.rollout.sampler import Sampler, SamplingConfig
  import jax
  import torch
  from flax import nnx

  family, overrides = ref.SPECS[spec]
  torch_model = ref.make_hf_model(family, seed=3, **overrides)
  prompts = np.random.default_rng(4).integers(0, ref.VOCAB, (2, 12))
  with torch.no_grad():
    want = torch_model.generate(torch.tensor(prompts), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                attention_mask=torch.ones(prompts.shape, dtype=torch.long)).numpy()[:, 12:]
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    model = models.from_pretrained(ref.save_hf_model(torch_model, __import__("pathlib").Path(tmp)))
  sampler = Sampler(model, cache_size=32, config=SamplingConfig(temperature=0.0, max_new_tokens=10), pad_id=0,
                    buckets=(16,))
  params = nnx.state(model)
  state = sampler.prefill(params, prompts.tolist(), jax.random.key(0))
  _, out = sampler.generate(params, state)
  np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_registry_covers_the_families():
  assert {"llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"} <= set(models.families())
  for family in models.families().values():
    assert family.architecture.endswith("ForCausalLM")
