"""GGUF files (llama.cpp's format) -> a Hugging Face checkpoint directory our loader and transformers both read.

    hf_dir = models.convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/")   # config, weights, tokenizer
    model = models.from_pretrained(hf_dir)

The file is read with the `gguf` package (ggml's own reader and numpy dequantisers; no torch). What is undone
on the way to HF's layout:
- quantisation: every tensor is dequantised to float32 (the numbers the quantised model computes with);
- llama.cpp's q/k row order: its converter permutes the rows of `q_proj`/`k_proj` of `llama` models for its
  rope kernel (pairs (i, i + H/2) stored adjacent); `_unpermute` restores HF's order;
- names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...;
- the tokenizer: vocabulary, merges, the pre-tokenizer its `tokenizer.ggml.pre` names, control tokens as
  special tokens, the chat template and bos/eos/pad, written as `tokenizer.json` + `tokenizer_config.json`.

Unsupported architectures, quantisation types, pre-tokenizers and rope variants are `UnsupportedModelError`s that
name the value and what is supported; an unreadable file is a `CheckpointError`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from models._families import UnsupportedModelError, config_from_hf, config_to_hf
from models._hf import CheckpointError

# Quantisation types this converter accepts (all dequantised by gguf.quants, tested in tests/test_gguf.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# general.architecture -> HF model_type; q/k rows are permuted by llama.cpp only for `llama`.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp, per pre-tokenizer type).
# None: GPT-2's own regex inside ByteLevel. "smollm": digits one by one, then GPT-2's regex.
PRE_TOKENIZERS: dict[str, tuple[str, str | None]] = {
    "default": ("gpt2", None), "gpt2": ("gpt2", None), "gpt-2": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "llama-bpe": ("split", _LLAMA3_SPLIT), "llama3": ("split", _LLAMA3_SPLIT), "llama-v3": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT), "deepseek-r1-qwen": ("split", _QWEN2_SPLIT),
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _reader(path: Path):
  import gguf
  if not path.is_file():
    raise CheckpointError(f"{path}: no such GGUF file")
  try:
    return gguf.GGUFReader(str(path))
  except (ValueError, OSError, IndexError) as e:  # gguf raises ValueError for a bad magic / truncation
    raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _metadata(reader) -> dict[str, Any]:
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    out[key] = field.contents()
  return out


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py, LlamaModel): rows (head, pair, half) -> (head,
  half, pair)."""
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
  """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
  return float(np.format_float_positional(np.float32(x), unique=True))


def gguf_config(meta: dict[str, Any], tensor_names: set[str], *, source: str) -> dict[str, Any]:
  """The HF `config.json` dict a GGUF file's metadata describes."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise UnsupportedModelError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                                f"{sorted(ARCHITECTURES)}")
  a = lambda key, default=None: meta.get(f"{arch}.{key}", default)
  heads = int(a("attention.head_count"))
  hidden = int(a("embedding_length"))
  head_dim = int(a("attention.key_length") or hidden // heads)
  rope_dim = a("rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != head_dim:
    raise UnsupportedModelError(f"{source}: partial rope ({arch}.rope.dimension_count={rope_dim} != head_dim "
                                f"{head_dim}) is not supported")
  scaling = a("rope.scaling.type")
  if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
    raise UnsupportedModelError(f"{source}: rope scaling ({scaling or 'rope_freqs.weight'}) in a GGUF file is not "
                                "supported; convert the original HF checkpoint instead")
  tokens = meta.get("tokenizer.ggml.tokens") or ()
  hf: dict[str, Any] = {
      "model_type": ARCHITECTURES[arch],
      "vocab_size": int(a("vocab_size") or len(tokens)),
      "hidden_size": hidden,
      "intermediate_size": int(a("feed_forward_length")),
      "num_hidden_layers": int(a("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(a("attention.head_count_kv") or heads),
      "head_dim": head_dim,
      "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon", 1e-6)),
      "rope_theta": _f32(a("rope.freq_base", 10000.0)),
      "max_position_embeddings": int(a("context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
      "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
  }
  if arch in ("llama", "qwen3"):
    hf["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
  if arch == "llama":
    hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
  return hf


def gguf_tensors(reader, hf_config: dict[str, Any], *, source: str) -> dict[str, np.ndarray]:
  """Every tensor of the file, dequantised to float32, under its HF name and in HF's layout."""
  from gguf import quants
  arch = hf_config["model_type"]
  out = {}
  for t in reader.tensors:
    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
      raise UnsupportedModelError(f"{source}: tensor {t.name!r} has quantisation {qtype}; supported: "
                                  f"{list(SUPPORTED_TYPES)}")
    if t.name in _TOP_NAMES:
      name = _TOP_NAMES[t.name]
    else:
      parts = t.name.split(".", 2)
      if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise UnsupportedModelError(f"{source}: tensor {t.name!r} has no HF counterpart for architecture {arch!r}")
      name = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    array = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    expected = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest-varying dimension first
    array = array.reshape(expected)
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
      heads = hf_config["num_attention_heads"] if ".attn_q." in t.name else hf_config["num_key_value_heads"]
      array = _unpermute(array, heads)
    out[name] = np.ascontiguousarray(array)
  return out


def gguf_tokenizer(meta: dict[str, Any], *, source: str):
  """A `transformers.PreTrainedTokenizerFast` built from the file's tokenizer metadata (byte-level BPE)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise UnsupportedModelError(f"{source}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' "
                                "(byte-level BPE)")
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                                f"{sorted(PRE_TOKENIZERS)}")
  tokens = list(meta["tokenizer.ggml.tokens"])
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
  backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
  mode, regex = PRE_TOKENIZERS[pre]
  if mode == "gpt2":
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  elif mode == "digits+gpt2":
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  # Token types (llama.cpp): 3 control (special), 4 user-defined (matched whole, not special).
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
  backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
  name = lambda key: tokens[int(meta[key])] if meta.get(key) is not None else None
  return PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token=name("tokenizer.ggml.bos_token_id"),
      eos_token=name("tokenizer.ggml.eos_token_id"), unk_token=name("tokenizer.ggml.unknown_token_id"),
      pad_token=name("tokenizer.ggml.padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
      add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)), clean_up_tokenization_spaces=False)


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
  """Writes the HF directory (config.json, model.safetensors in float32, tokenizer files, generation_config.json)
  of GGUF file `path` to `out_dir`, whole or not at all (built next to it, then renamed). Returns `out_dir`."""
  from safetensors.numpy import save_file
  path, out_dir = Path(path), Path(out_dir)
  source = str(path)
  reader = _reader(path)
  meta = _metadata(reader)
  hf = gguf_config(meta, {t.name for t in reader.tensors}, source=source)
  config = config_from_hf(hf, source=source)  # validates; written back in our canonical HF layout
  tokenizer = gguf_tokenizer(meta, source=source)
  tensors = gguf_tensors(reader, hf, source=source)
  if out_dir.exists() and any(out_dir.iterdir()):
    raise FileExistsError(f"{out_dir}: exists and is not empty; pick a new directory")
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
  try:
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    hf_out = config_to_hf(config, dtype="float32")
    (staging / "config.json").write_text(json.dumps(hf_out, indent=2))
    tokenizer.save_pretrained(str(staging))
    generation = {k: hf_out[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_out[k] is not None}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (staging / "gguf_source.json").write_text(json.dumps(
        {"file": path.name, "size": path.stat().st_size, "general.name": meta.get("general.name"),
         "types": sorted({t.tensor_type.name for t in reader.tensors})}, indent=2))
    if out_dir.exists():
      out_dir.rmdir()
    os.rename(staging, out_dir)
  finally:
    if staging.exists():
      shutil.rmtree(staging, ignore_errors=True)
  return out_dir
