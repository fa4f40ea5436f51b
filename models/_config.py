"""Model configuration: one frozen dataclass for every supported family.

Field names follow Hugging Face `config.json` so a YAML model section and an HF config read the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3"]
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SwiGLU, GeGLU (tanh-approximated GELU)
LAYER_TYPES = ("full_attention", "sliding_attention")


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
  """Architecture of a decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE).

  Attributes:
    model_type: HF `model_type`; picks the family (see `models.families()`).
    attention_bias: bias on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    attention_out_bias: bias on the output projection (Llama's `attention_bias` covers it too).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    num_experts: mixture-of-experts MLPs with this many experts (0: every MLP is dense). Which layers are sparse
      follows HF's rule (`is_moe_layer`): not in `mlp_only_layers`, and every `decoder_sparse_step`-th layer.
    num_experts_per_tok: experts each token is routed to (top-k of the router's softmax, in float32).
    moe_intermediate_size: each expert's MLP width (dense layers keep `intermediate_size`).
    norm_topk_prob: the k routing weights are renormalized to sum to 1 (else they keep their softmax mass).
    hidden_activation: the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    norm_offset: RMSNorm multiplies by (norm_offset + weight), in float32 before the cast back (Gemma: 1, its
      weights stored zero-centred); 0: by the weight, after the cast (Llama).
    sandwich_norms: each block also normalizes its attention and MLP outputs before adding them (Gemma's four
      norms per block).
    embed_scale: the embeddings are multiplied by this, rounded to the parameter dtype (Gemma: sqrt(hidden)).
    query_pre_attn_scalar: attention logits are scaled by its inverse square root (None: head_dim's).
    layer_types: per layer "full_attention" or "sliding_attention" (empty: every layer full).
    sliding_window: a sliding layer's query sees the keys less than this many positions back (itself included).
    rope_local_theta: RoPE base of the sliding layers (unscaled); full layers use rope_theta and rope_scaling.
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
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  hidden_activation: str = "silu"
  norm_offset: float = 0.0
  sandwich_norms: bool = False
  embed_scale: float = 1.0
  query_pre_attn_scalar: float | None = None
  layer_types: tuple[str, ...] = ()
  sliding_window: int | None = None
  rope_local_theta: float = 10000.0

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
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
    if self.hidden_activation not in ACTIVATIONS:
      raise ValueError(f"ModelConfig.hidden_activation={self.hidden_activation!r}: not one of {ACTIVATIONS}")
    if self.layer_types:
      if len(self.layer_types) != self.num_hidden_layers:
        raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                         f"{self.num_hidden_layers} layers")
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f"ModelConfig.layer_types {bad}: not one of {LAYER_TYPES}")
      if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                          and self.sliding_window >= 1):
        raise ValueError(f"ModelConfig.sliding_window must be a positive int with sliding layers, got "
                         f"{self.sliding_window!r}")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"ModelConfig.num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
                         f"{self.num_experts_per_tok!r}")
      if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size < 1:
        raise ValueError(f"ModelConfig.moe_intermediate_size must be a positive int with num_experts="
                         f"{self.num_experts}, got {self.moe_intermediate_size!r}")
      if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
        raise ValueError(f"ModelConfig.decoder_sparse_step must be a positive int, got {self.decoder_sparse_step!r}")
      bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
      if bad:
        raise ValueError(f"ModelConfig.mlp_only_layers {bad}: not layers of 0..{self.num_hidden_layers - 1}")
    elif self.num_experts < 0:
      raise ValueError(f"ModelConfig.num_experts must be >= 0 (0: dense), got {self.num_experts!r}")

  def is_sliding_layer(self, layer: int) -> bool:
    """Whether layer `layer` attends within a sliding window (`layer_types`)."""
    return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

  def is_moe_layer(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is a mixture of experts (HF Qwen3-MoE's rule)."""
    return bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

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
    dense = 3 * d * f + (2 * f + d) * self.mlp_bias
    sparse = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
    norms = (4 if self.sandwich_norms else 2) * d
    layers = sum(attn + norms + (sparse if self.is_moe_layer(i) else dense) for i in range(self.num_hidden_layers))
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return embed + layers + d

  def num_active_params(self) -> int:
    """Parameters a token's forward pass uses: `num_params` with only `num_experts_per_tok` experts per sparse
    layer (the router counted whole)."""
    unused = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
    return self.num_params() - unused * sum(map(self.is_moe_layer, range(self.num_hidden_layers)))


def replace(config: ModelConfig, **changes: Any) -> ModelConfig:
  return dataclasses.replace(config, **changes)
