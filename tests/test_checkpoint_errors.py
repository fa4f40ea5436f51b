"""Bad checkpoints fail with errors that name the file and the tensor."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from jaxagent import weights
from tests import hf_reference as ref


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  path = tmp_path_factory.mktemp("good")
  return ref.save_hf_model(ref.make_hf_model("llama", num_attention_heads=4, num_key_value_heads=2), path)


def _copy(src, dst):
  dst.mkdir()
  for f in src.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  return dst


def test_missing_tensor(good, tmp_path):
  bad = _copy(good, tmp_path / "bad")
  tensors = load_file(str(bad / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing.*model\.safetensors"):
    models.from_pretrained(bad)


def test_shape_mismatch(good, tmp_path):
  bad = _copy(good, tmp_path / "bad")
  config = json.loads((bad / "config.json").read_text())
  config["intermediate_size"] = 80
  (bad / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.CheckpointError,
                     match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape "
                           r"\((64, 96|96, 64)\); .*config\.json implies \((64, 80|80, 64)\)"):
    models.from_pretrained(bad)


def test_unknown_model_type(good, tmp_path):
  bad = _copy(good, tmp_path / "bad")
  config = json.loads((bad / "config.json").read_text())
  config["model_type"] = "lama"
  (bad / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.UnsupportedModelError, match=r"config\.json.*'lama'.*did you mean 'llama'"):
    models.from_pretrained(bad)


def test_truncated_safetensors(good, tmp_path):
  bad = _copy(good, tmp_path / "bad")
  data = (bad / "model.safetensors").read_bytes()
  (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(models.CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
    models.from_pretrained(bad)


def test_missing_shard_of_an_index(good, tmp_path):
  model = models.from_pretrained(good)
  out = models.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
  shards = sorted(out.glob("model-*.safetensors"))
  assert len(shards) > 1
  shards[-1].unlink()
  with pytest.raises(models.CheckpointError, match=shards[-1].name):
    models.from_pretrained(out)


def test_unexpected_tensor(good, tmp_path):
  bad = _copy(good, tmp_path / "bad")
  tensors = load_file(str(bad / "model.safetensors"))
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
  save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError, match=r"not described by config\.json.*mlp\.extra\.weight"):
    models.from_pretrained(bad)


def test_unsupported_options_are_named(good, tmp_path):
  for key, value, pattern in (("hidden_act", "gelu", "hidden_act 'gelu'"),
                              ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_type 'yarn'")):
    bad = _copy(good, tmp_path / f"bad-{key}")
    config = json.loads((bad / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.UnsupportedModelError, match=pattern):
      models.from_pretrained(bad)


def test_not_a_checkpoint(tmp_path):
  with pytest.raises(models.CheckpointError, match="config.json"):
    models.from_pretrained(tmp_path)
  with pytest.raises(models.CheckpointError, match="neither an HF checkpoint"):
    weights.load_model(tmp_path)
