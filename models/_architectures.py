"""Named real architectures: the published shapes of models we benchmark and test with random weights.

Accelerator machines that cannot reach a model hub (and checkpoints too large to carry) still get the real
shapes, so speed and memory are measured on the model a user would train. The values are the models' own
Hugging Face `config.json`s (transcribed; no weights).
"""

from __future__ import annotations

from models._config import ModelConfig, RopeScaling

ARCHITECTURES: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: Llama layout, tied embeddings, ChatML tokens 1 (<|im_start|>) /
    # 2 (<|im_end|>).
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    # Qwen/Qwen3-0.6B: qk-norm, tied embeddings, eos <|im_end|> (151645), pad <|endoftext|> (151643).
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qk_norm=True, max_position_embeddings=40960, bos_token_id=None,
        eos_token_id=151645, pad_token_id=151643),
    # Qwen/Qwen3-8B: qk-norm, untied embeddings.
    "qwen3-8b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, qk_norm=True, max_position_embeddings=40960, bos_token_id=None,
        eos_token_id=151645, pad_token_id=151643),
    # meta-llama/Llama-3.1-70B-Instruct: Llama 3.1 RoPE scaling, untied embeddings, eos <|end_of_text|>,
    # <|eom_id|>, <|eot_id|>.
    "llama3.1-70b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009), pad_token_id=None),
    # Qwen/Qwen3-30B-A3B: 128 experts, top-8 with renormalized weights, every layer sparse; 30.5B parameters,
    # 3.3B active per token.
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, qk_norm=True, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_id=151645, pad_token_id=None, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True),
    # google/gemma-3-4b-it's text model: 5 sliding layers (window 1024, RoPE base 10K) to every global one (RoPE
    # base 1M, linear scaling x8), query_pre_attn_scalar 256, tied embeddings; eos <eos> and <end_of_turn>.
    "gemma3-4b": ModelConfig(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=RopeScaling(rope_type="linear", factor=8.0), tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=131072, bos_token_id=2, eos_token_id=(1, 106), pad_token_id=0,
        hidden_activation="gelu_tanh", norm_offset=1.0, sandwich_norms=True, embed_scale=2560 ** 0.5,
        query_pre_attn_scalar=256.0, sliding_window=1024, rope_local_theta=10000.0,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34))),
}


def architecture(name: str) -> ModelConfig:
  """The `ModelConfig` of a named architecture; an unknown name is an error listing the known ones."""
  try:
    return ARCHITECTURES[name]
  except KeyError:
    raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}") from None
