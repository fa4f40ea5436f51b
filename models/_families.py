"""Registry: HF `model_type` -> family, and conversion between HF `config.json` and `ModelConfig`."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable

from models._config import ModelConfig, RopeScaling


class UnsupportedModelError(ValueError):
  """A checkpoint asks for an architecture or option this package does not implement."""


@dataclasses.dataclass(frozen=True)
class Family:
  """How one HF architecture maps onto `ModelConfig`.

  Attributes:
    model_type: HF `model_type` string.
    architecture: HF class written to `config.json["architectures"]`.
    flags: derives the family-specific switches (biases, qk-norm) from the HF dict.
  """

  model_type: str
  architecture: str
  flags: Callable[[dict[str, Any]], dict[str, bool]]
  description: str


def _llama_flags(hf: dict[str, Any]) -> dict[str, bool]:
  bias = bool(hf.get("attention_bias", False))
  return dict(attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
              qk_norm=False)


def _qwen2_flags(hf: dict[str, Any]) -> dict[str, bool]:
  return dict(attention_bias=True, attention_out_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3_flags(hf: dict[str, Any]) -> dict[str, bool]:
  bias = bool(hf.get("attention_bias", False))
  return dict(attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=True)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
  if family.model_type in _FAMILIES:
    raise ValueError(f"model_type {family.model_type!r} is already registered")
  _FAMILIES[family.model_type] = family


register_family(Family("llama", "LlamaForCausalLM", _llama_flags,
                       "Llama 2/3.x: GQA, RoPE (default/linear/llama3), RMSNorm, SwiGLU"))
register_family(Family("qwen2", "Qwen2ForCausalLM", _qwen2_flags,
                       "Qwen2/2.5: Llama layout with q/k/v biases"))
register_family(Family("qwen3", "Qwen3ForCausalLM", _qwen3_flags,
                       "Qwen3: Llama layout with per-head q/k RMSNorm"))
register_family(Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_flags,
                       "Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 with top-k routed expert MLPs (dropless)"))
register_family(Family("gemma3_text", "Gemma3ForCausalLM", _qwen3_flags,
                       "Gemma 3 (text): sliding-window and global layers with their own RoPE bases, q/k norms, four "
                       "norms per block, scaled tied embeddings, GeGLU"))


def families() -> dict[str, Family]:
  """All registered families by `model_type`."""
  return dict(_FAMILIES)


def get_family(model_type: str, *, source: str = "config") -> Family:
  try:
    return _FAMILIES[model_type]
  except KeyError:
    close = difflib.get_close_matches(str(model_type), list(_FAMILIES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnsupportedModelError(
        f"{source}: unknown model_type {model_type!r}{hint}; supported: {sorted(_FAMILIES)}") from None


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
  params = hf.get("rope_parameters") or {}
  legacy = hf.get("rope_scaling") or {}
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  spec = dict(params or legacy)
  rope_type = spec.get("rope_type", spec.get("type", "default"))
  if rope_type == "default":
    return theta, None
  valid = ("default", "linear", "llama3")
  if rope_type not in valid:
    raise UnsupportedModelError(f"{source}: rope_type {rope_type!r} is not supported; valid: {valid}")
  fields = {f.name for f in dataclasses.fields(RopeScaling)}
  kwargs = {k: v for k, v in spec.items() if k in fields}
  kwargs["rope_type"] = rope_type
  return theta, RopeScaling(**kwargs)


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
  """Builds a `ModelConfig` from an HF `config.json` dict; unsupported options are errors."""
  if hf.get("model_type") == "gemma3":
    raise UnsupportedModelError(f"{source}: model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration; "
                                "its text model (text_config, model_type 'gemma3_text') is supported")
  family = get_family(hf.get("model_type"), source=source)
  gemma = family.model_type == "gemma3_text"
  act_key = "hidden_activation" if gemma else "hidden_act"
  act = hf.get(act_key, "silu")
  valid = GEMMA_ACTIVATIONS if gemma else {"silu": "silu"}
  if act not in valid:
    raise UnsupportedModelError(f"{source}: {act_key} {act!r} is not supported; valid: {sorted(valid)}")
  if gemma:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      if hf.get(key) is not None:
        raise UnsupportedModelError(f"{source}: {key}={hf[key]!r} is not supported (Gemma 3 has none); set it null")
    if hf.get("use_bidirectional_attention"):
      raise UnsupportedModelError(f"{source}: use_bidirectional_attention=true is not supported (a causal LM)")
  elif hf.get("use_sliding_window"):
    raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported; set it to false")
  missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads") if k not in hf]
  if missing:
    raise UnsupportedModelError(f"{source}: missing required keys {missing}")
  heads = int(hf["num_attention_heads"])
  extra = _gemma3_from_hf(hf, source) if gemma else {}
  theta, scaling = _rope_from_hf(extra.pop("rope_hf") if gemma else hf, source)
  moe = _moe_from_hf(hf, source) if family.model_type in MOE_FAMILIES else {}
  eos = hf.get("eos_token_id")
  return ModelConfig(
      model_type=family.model_type,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_hidden_layers=int(hf["num_hidden_layers"]),
      num_attention_heads=heads,
      num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=theta,
      rope_scaling=scaling,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),  # Gemma ties by default
      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
      pad_token_id=hf.get("pad_token_id"),
      **family.flags(hf),
      **moe,
      **extra,
  )


GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # HF's name -> ours


def _int_if_whole(x: float | None) -> int | float | None:
  """transformers' strict configs type some scalars as int (Gemma 3's query_pre_attn_scalar)."""
  return int(x) if x is not None and float(x).is_integer() else x


def _gemma3_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """Gemma 3's fields. RoPE: transformers 5 nests `rope_parameters` by layer type; the hub's configs give
  `rope_theta` / `rope_scaling` (full layers) and `rope_local_base_freq` (sliding layers). Layer types: listed, or
  every `sliding_window_pattern`-th layer full (HF's default rule)."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params:
    full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    rope_hf = {"rope_parameters": full}
    local_theta = float(local.get("rope_theta", 10000.0))
    if local.get("rope_type", "default") != "default":
      raise UnsupportedModelError(f"{source}: sliding layers' rope_type {local['rope_type']!r} is not supported; "
                                  "valid: 'default'")
  else:
    rope_hf = {k: hf[k] for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in hf}
    local_theta = float(hf.get("rope_local_base_freq", 10000.0))
  layers = int(hf["num_hidden_layers"])
  pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
  types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(layers)]
  return dict(rope_hf=rope_hf, rope_local_theta=local_theta, layer_types=tuple(types),
              sliding_window=hf.get("sliding_window"), hidden_activation=GEMMA_ACTIVATIONS[hf.get(
                  "hidden_activation", "gelu_pytorch_tanh")], norm_offset=1.0, sandwich_norms=True,
              embed_scale=float(int(hf["hidden_size"]) ** 0.5),
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))


MOE_FAMILIES = ("qwen3_moe",)


def _moe_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """The mixture-of-experts fields (`num_experts` as the hub's configs spell it, or transformers 5's
  `num_local_experts`)."""
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                            ("moe_intermediate_size", hf.get("moe_intermediate_size"))) if v is None]
  if missing:
    raise UnsupportedModelError(f"{source}: a {hf.get('model_type')} config needs {missing}")
  return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_intermediate_size=int(hf["moe_intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
              mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))


def config_to_hf(config: ModelConfig, *, dtype: str = "float32") -> dict[str, Any]:
  """The HF `config.json` dict (transformers 5 layout) for `config`."""
  family = get_family(config.model_type)
  expected = family.flags({"attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias})
  actual = {k: getattr(config, k) for k in expected}
  if expected != actual:
    raise UnsupportedModelError(
        f"{config.model_type}: flags {actual} cannot be expressed in an HF config (expected {expected})")
  rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
  if config.rope_scaling is not None:
    rope.update(dataclasses.asdict(config.rope_scaling))
  hf = {
      "architectures": [family.architecture],
      "model_type": config.model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_hidden_layers,
      "num_attention_heads": config.num_attention_heads,
      "num_key_value_heads": config.num_key_value_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "rope_parameters": rope,
      "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple)
                      else config.eos_token_id,
      "pad_token_id": config.pad_token_id,
      "dtype": dtype,
  }
  if config.model_type in ("llama", "qwen3", "qwen3_moe"):
    hf["attention_bias"] = config.attention_bias
  if config.model_type == "llama":
    hf["mlp_bias"] = config.mlp_bias
  if config.model_type in ("qwen2", "qwen3", "qwen3_moe"):
    hf["use_sliding_window"] = False
  if config.model_type == "gemma3_text":
    hf.pop("hidden_act")
    hf.update(hidden_activation={v: k for k, v in GEMMA_ACTIVATIONS.items()}[config.hidden_activation],
              rope_parameters={"full_attention": rope,
                               "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta}},
              layer_types=list(config.layer_types), sliding_window=config.sliding_window,
              query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar), final_logit_softcapping=None,
              attn_logit_softcapping=None, attention_bias=config.attention_bias)
  elif config.hidden_activation != "silu" or config.sandwich_norms or config.layer_types or config.norm_offset:
    raise UnsupportedModelError(f"{config.model_type}: Gemma's options (activation, norms, sliding layers) have no "
                                "HF form in this family; use model_type gemma3_text")
  if config.model_type in MOE_FAMILIES:
    hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
              decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers))
  elif config.num_experts:
    raise UnsupportedModelError(f"{config.model_type}: num_experts={config.num_experts} has no HF form; "
                                f"mixture-of-experts families: {list(MOE_FAMILIES)}")
  return hf
