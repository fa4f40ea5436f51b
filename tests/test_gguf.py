"""GGUF -> HF directory (models.convert_gguf): every supported quantisation type, llama.cpp's q/k row order and the
qwen2 biases, checked against transformers' own GGUF loader (its torch dequantisers and permutation) on tiny
files written here the way llama.cpp's converter writes them; and the errors for what is not supported."""

import json

import numpy as np
import pytest

import models
from tests import hf_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads GGUF tensors only with accelerate (test extra)")

Q = gguf.GGMLQuantizationType
# Bytes per block, where the float16 super-block scales sit (ggml-common.h) and their values: random bytes
# elsewhere, scales chosen so that weights stay below ~0.1 like a trained model's (Q6_K's 8-bit sub-scales and
# 6-bit values reach 127 * 32 times its d).
_K_BLOCKS = {"Q4_K": (144, (0, 2), (2e-4, 1e-4)), "Q5_K": (176, (0, 2), (2e-4, 1e-4)), "Q6_K": (210, (208,), (2e-5,))}


def _permute(w, heads):
  """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(array, qtype, rng):
  """`array` (float32, HF layout) in GGUF type `qtype`: quantised with gguf's numpy quantiser, or for K-quants
  (which gguf-py cannot quantise) random blocks with small valid scales, whose values the test then defines."""
  if qtype == "F32" or array.ndim == 1:
    return array.astype(np.float32), None
  if qtype == "F16":
    return array.astype(np.float16), None
  if qtype in _K_BLOCKS:
    size, offsets, values = _K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (array.shape[0], array.shape[1] // 256, size), dtype=np.uint8)
    for at, value in zip(offsets, values):
      blocks[..., at:at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(array.shape[0], -1), Q[qtype]
  return gguf.quants.quantize(array.astype(np.float32), Q[qtype]), Q[qtype]


def write_gguf(path, hf_model, arch: str, qtype: str, seed: int = 0):
  """A GGUF file of `hf_model` as llama.cpp writes it (names, q/k permutation for llama, metadata, a tokenizer)."""
  cfg = hf_model.config
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  tokens = [f"<s{i}>" for i in range(3)] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(cfg.vocab_size - 3)]
  w.add_token_list(tokens)
  w.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
  w.add_token_merges([])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
           "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
           **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv" for k in ("weight", "bias")}}
  for name, param in hf_model.state_dict().items():
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    array = param.detach().numpy().astype(np.float32)
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      target = f"blk.{i}.{layer[rest]}"
      if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
        heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
        array = _permute(array, heads)
    else:
      target = names[name]
    data, raw = _encode(array, qtype, rng)
    w.add_tensor(target, data, raw_dtype=raw)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _logits_ours(hf_dir, tokens):
  import jax.numpy as jnp
  return np.asarray(models.from_pretrained(hf_dir)(jnp.asarray(tokens)))


def _logits_transformers_gguf(path, tokens):
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
  with torch.no_grad():
    return ref(torch.as_tensor(tokens)).logits.numpy()


CASES = [("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
         ("llama", "Q4_1"), ("llama", "Q5_0"), ("qwen2", "Q8_0"), ("llama", "Q4_K"), ("llama", "Q5_K"),
         ("qwen2", "Q6_K")]


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_converted_gguf_equals_transformers_reading_the_same_file(tmp_path, arch, qtype):
  wide = qtype in _K_BLOCKS  # K-quant rows are 256-value blocks
  hf = hf_reference.make_hf_model(arch, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  **(dict(hidden_size=256, intermediate_size=256, head_dim=64) if wide else {}))
  path = write_gguf(tmp_path / f"tiny-{arch}-{qtype}.gguf", hf, arch, qtype)
  out = models.convert_gguf(path, tmp_path / "hf")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == arch and config["tie_word_embeddings"] is False
  tokens = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 12))
  ours, ref = _logits_ours(out, tokens), _logits_transformers_gguf(path, tokens)
  assert np.abs(ref).max() > 0.1  # not a degenerate model
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
  # The converted directory is an ordinary HF checkpoint for transformers too.
  direct = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  with torch.no_grad():
    np.testing.assert_allclose(direct(torch.as_tensor(tokens)).logits.numpy(), ref, rtol=0, atol=1e-5)


def test_float_weights_round_trip_exactly_through_llama_cpps_permutation(tmp_path):
  hf = hf_reference.make_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
  out = models.convert_gguf(write_gguf(tmp_path / "tiny.gguf", hf, "llama", "F32"), tmp_path / "hf")
  from safetensors.numpy import load_file
  got = load_file(str(out / "model.safetensors"))
  for name, param in hf.state_dict().items():
    if name == "lm_head.weight":
      assert name not in got  # tied: the GGUF has no output.weight
      continue
    np.testing.assert_array_equal(got[name], param.detach().numpy(), err_msg=name)


def test_tokenizer_and_generation_config_come_from_the_file(tmp_path):
  hf = hf_reference.make_hf_model("llama")
  out = models.convert_gguf(write_gguf(tmp_path / "tiny.gguf", hf, "llama", "F32"), tmp_path / "hf")
  tok = models.load_tokenizer(out)
  assert tok.eos_id == 1 and tok.special("<s2>") == 2
  assert tok.encode("<s1>ab") != [1, *tok.encode("ab")]  # untrusted text never becomes a control token
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1


def _tiny_gguf(path, arch="llama"):
  return write_gguf(path, hf_reference.make_hf_model("llama"), arch, "F32")


def test_unsupported_architecture_quantisation_and_bad_files_are_named(tmp_path):
  with pytest.raises(models.UnsupportedModelError, match=r"architecture 'gemma2' is not supported; supported: "
                     r"\['llama', 'qwen2', 'qwen3'\]"):
    models.convert_gguf(_tiny_gguf(tmp_path / "a.gguf", arch="gemma2"), tmp_path / "a")
  w = gguf.GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
  for key, value in (("llama.block_count", 1), ("llama.embedding_length", 256), ("llama.feed_forward_length", 256),
                     ("llama.attention.head_count", 4)):
    w.add_uint32(key, value)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(["a", "b"])
  w.add_tensor("token_embd.weight", np.zeros((2, 84), np.uint8), raw_dtype=Q.Q2_K)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(models.UnsupportedModelError, match=r"'token_embd.weight' has quantisation Q2_K; supported"):
    models.convert_gguf(tmp_path / "q2k.gguf", tmp_path / "b")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(models.CheckpointError, match="junk.gguf: not a readable GGUF file"):
    models.convert_gguf(tmp_path / "junk.gguf", tmp_path / "c")
  with pytest.raises(models.CheckpointError, match="no such GGUF file"):
    models.convert_gguf(tmp_path / "missing.gguf", tmp_path / "d")
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="not empty"):
    models.convert_gguf(_tiny_gguf(tmp_path / "e.gguf"), tmp_path / "full")
  assert (tmp_path / "full" / "keep.txt").read_text() == "x"
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left behind


def test_cli_convert_writes_an_hf_directory_from_a_gguf_file(tmp_path, capsys):
  from jaxagent import cli
  path = _tiny_gguf(tmp_path / "tiny.gguf")
  assert cli.main(["convert", str(path), str(tmp_path / "hf")]) == 0
  assert "hf, llama" in capsys.readouterr().out
  assert models.read_config(tmp_path / "hf").num_hidden_layers == 2


def test_a_gguf_path_resolves_to_one_cached_conversion(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXAGENT_CACHE", str(tmp_path / "cache"))
  path = _tiny_gguf(tmp_path / "tiny.gguf")
  first = models.resolve(path)
  assert models.read_config(first).num_hidden_layers == 2 and path.is_file()  # the user's file is left alone
  stamp = (first / "model.safetensors").stat().st_mtime_ns
  assert models.resolve(str(path)) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
  assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [first.name]  # no staging left behind
