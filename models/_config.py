"""Model configuration: one frozen dataclass for every supported family.

Field names follow Hugging Face `config.json` so a YAML model section and an HF config read the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (HF `rope_parameters` / `rope_scaling`).

  `llama3` is the rule of Llama 3.1 (arXiv:2407.21783 §3.1 / HF `_compute_llama3_parameters`).
  """

  rope_type: RopeType = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3).

  Attributes:
    model_type: HF `model_type`; picks the family (see `models.families()`).
    attention_bias: bias on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    attention_out_bias: bias on the output projection (Llama's `attention_bias` covers it too).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
  """

  model_type: str = "llama"
  vocab_size: int = 264
  hidden_size: int = 64
  intermediate_size: int = 176
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  head_dim: int = 16
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  attention_out_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 2048
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
          f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def num_params(self) -> int:
    d, f, n, k, h = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                     self.num_key_value_heads, self.head_dim)
    attn = d * n * h * 2 + d * k * h * 2
    attn += (n + 2 * k) * h * self.attention_bias + d * self.attention_out_bias
    attn += 2 * h * self.qk_norm
    mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
    layer = attn + mlp + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return embed + self.num_hidden_layers * layer + d


def replace(config: ModelConfig, **changes: Any) -> ModelConfig:
  return dataclasses.replace(config, **changes)
