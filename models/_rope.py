"""Rotary position embeddings (HF "rotate half" convention) with default / linear / llama3 scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from models._config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """float32[head_dim // 2] inverse frequencies after the configured scaling rule."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
  inv_freq = inv_freq.astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None or scaling.rope_type == "default":
    return inv_freq
  if scaling.rope_type == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig) -> dict[str, np.ndarray]:
  """Each layer type's inverse frequencies: full-attention layers rope_theta with rope_scaling, sliding ones
  rope_local_theta unscaled (Gemma 3; a model without sliding layers never reads that table)."""
  local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
  return {"full_attention": inverse_frequencies(config), "sliding_attention": inverse_frequencies(local)}


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates `x` by its positions; angles are computed in float32, the product in x's dtype."""
  angles_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles_bth = jnp.concatenate([angles_btf, angles_btf], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_bth).astype(x_btnh.dtype), jnp.sin(angles_bth).astype(x_btnh.dtype)
  half = x_btnh.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
  return x_btnh * cos + rotated * sin
