"""Tiny random Hugging Face checkpoints made locally with transformers (the PyTorch parity reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# One spec per (family, variant): GQA ratios, tied/untied, rope scaling, biases, head_dim != D/N.
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-llama3-bias": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "llama-mha-tied-linear": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama-mqa-headdim": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False)),
    "qwen2-tied-gqa4": ("qwen2", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-untied-gqa3": ("qwen2", dict(
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        rope_theta=500000.0)),
    "qwen3-untied": ("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)),
    "qwen3-tied-bias": ("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
        attention_bias=True)),
    # Mixture of experts: 8 experts, top-2 with renormalized weights, the second of 3 layers dense.
    "qwen3moe-dense-layer": ("qwen3_moe", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1])),
    # Top-3 of 6 with the softmax mass kept, sparse every second layer (decoder_sparse_step), tied.
    "qwen3moe-sparse-step": ("qwen3_moe", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2)),
    # Gemma 3: sliding layers (window 5, shorter than the 12-token batch) around a global one whose RoPE is
    # linearly scaled, a query scale of its own, GeGLU, four zero-centred norms per block, scaled tied embeddings.
    "gemma3-window-in-prompt": ("gemma3_text", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}

VOCAB = 101


def make_hf_model(family: str, seed: int = 0, **overrides: Any):
  """A float32 transformers model with random weights large enough that errors would show."""
  import torch
  import transformers

  classes = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
      "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
      "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
  }
  config_cls, model_cls = classes[family]
  kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.08)
  kwargs.update(overrides)
  if "rope_theta" in kwargs:  # transformers 5 keeps theta inside rope_parameters
    theta = kwargs.pop("rope_theta")
    kwargs["rope_parameters"] = dict(kwargs.pop("rope_scaling", None) or {"rope_type": "default"},
                                     rope_theta=theta)
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kwargs)).eval().float()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("bias"):
        param.normal_(0.0, 0.1)
      elif "norm" in name:  # Gemma's scale is 1 + weight: either way the norms are far from plain
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
      elif name.endswith("mlp.gate.weight"):  # a router: decisive, so float rounding flips no top-k choice
        param.normal_(0.0, 0.5)
  return model


def save_hf_model(model, path: Path) -> Path:
  model.save_pretrained(str(path))
  return path


def reference_logits(model, tokens: np.ndarray, mask: np.ndarray | None = None,
                     positions: np.ndarray | None = None) -> np.ndarray:
  import torch

  kwargs = {"input_ids": torch.tensor(tokens, dtype=torch.long)}
  if mask is not None:
    kwargs["attention_mask"] = torch.tensor(mask, dtype=torch.long)
  if positions is not None:
    kwargs["position_ids"] = torch.tensor(positions, dtype=torch.long)
  with torch.no_grad():
    return model(**kwargs).logits.float().numpy()


def padded_batch(seed: int = 0, batch: int = 3, length: int = 12):
  """Tokens with row 1 left-padded and row 2 right-padded; mask (1 = token) and positions."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (batch, length))
  mask = np.ones((batch, length), np.int64)
  mask[1, :4] = 0
  mask[2, -5:] = 0
  positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
  return tokens, mask, positions
