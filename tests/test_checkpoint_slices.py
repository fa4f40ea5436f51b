"""Loading onto a mesh reads slices: each device's slice of a parameter comes from a region of its HF tensor
(`models._hf._Relayout`: every HF tensor becomes ours by a reshape and a transpose), so a host reads what its
devices hold. On 8 fake CPU devices, with experts split over `expert`, heads over `tensor` and `embed` over
`fsdp`: the loaded model equals the whole-tensor load, every region read is exactly its slice (no byte of
another device's slice), and each expert weight reads only the experts its slice holds."""

import collections

import jax
import numpy as np
import pytest
from flax import nnx

import models
from jaxagent import sharding
from models import _hf

CONFIG = models.ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            qk_norm=True, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))


@pytest.mark.parametrize("splits, perm, hf_shape, index", [
    (((4, 8), None), (2, 0, 1), (32, 32), (slice(8, 24), slice(2, 4), slice(None))),    # q: [n*h, d] -> [d, n, h]
    ((None, (4, 8)), (1, 2, 0), (32, 32), (slice(0, 2), slice(None), slice(16, 32))),   # o: [d, n*h] -> [n, h, d]
    (((4, 8), None), (2, 0, 1), (32, 32), (slice(None), slice(1, 3), slice(0, 4))),     # half a head: read whole
    (((2, 8),), None, (16,), (slice(1, 2), slice(None))),                                # a bias's heads
    (None, (1, 0), (48, 32), (slice(16, 32), slice(24, 48))),                           # transposed
])
def test_a_slice_of_ours_reads_the_hf_region_that_holds_it(splits, perm, hf_shape, index):
  relayout = _hf._Relayout(splits=splits, perm=perm)
  hf = np.random.default_rng(0).normal(size=hf_shape).astype(np.float32)
  regions = []

  class Recorded:
    def __getitem__(self, region):
      regions.append(region)
      return hf[region]

  got = relayout.read(Recorded(), hf_shape, index)
  np.testing.assert_array_equal(got, relayout.to_ours(hf)[index])
  np.testing.assert_array_equal(relayout.to_hf(relayout.to_ours(hf)), hf)
  aligned = index[-1] == slice(None) or perm is None or splits is None or splits[0] is None
  read = hf[regions[0]].size
  assert read == got.size if aligned else read > got.size  # a head cut in half is read whole, then sliced


def test_a_mesh_load_reads_each_device_slice_from_its_region_and_only_its_experts(tmp_path, monkeypatch):
  assert jax.device_count() == 8, "tests/conftest.py must give 8 CPU devices"
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(0))
  models.save_pretrained(model, tmp_path / "hf", max_shard_bytes=40_000)  # several shards
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  whole = nnx.state(models.from_pretrained(tmp_path / "hf"))
  reads = collections.defaultdict(list)  # tensor name -> elements of each region read
  read = _hf._TensorIndex.read

  def recording(self, name, relayout, index):
    out = read(self, name, relayout, index)
    reads[name].append(out.size)
    return out

  monkeypatch.setattr(_hf._TensorIndex, "read", recording)
  loaded = models.from_pretrained(tmp_path / "hf", mesh=mesh, rules=sharding.FSDP_TP_RULES)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.state(loaded)), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  state = nnx.state(loaded)
  for key, variable in nnx.to_flat_state(state):
    names, _ = _hf._hf_names(key, CONFIG)
    array = variable[...]
    slices = {tuple((s.start, s.stop) for s in shard.index): shard.data.size for shard in array.addressable_shards}
    got = sum(sum(reads[n]) for n in names.flat)
    # Every distinct slice is read once, as its own region: no more than the devices hold, no whole tensors.
    assert got == sum(slices.values()), (key, got, slices)
  gate = state["layer_stacks"][0]["mlp"]["w_gate_edf"][...]  # [L, E, D, F]
  assert {s.data.shape[1] for s in gate.addressable_shards} == {2}
  # An expert's tensor is read only for the slices of the devices that hold that expert: 2 of the 8 devices'
  # slices (expert 2 x the rest), distinct over fsdp and tensor: 4 regions of a quarter each.
  expert0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
  per_expert = CONFIG.hidden_size * CONFIG.moe_intermediate_size
  assert sorted(reads[expert0]) == [per_expert // 4] * 4
