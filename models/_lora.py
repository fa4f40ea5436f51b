"""LoRA adapters (arXiv:2106.09685) over a `Transformer`'s parameters, kept apart from them.

Adapters are a nested dict that mirrors the policy's parameter paths down to each target weight, holding
`{"a": [L, d_in, r], "b": [L, r, d_out]}`, one adapter per layer of the weight's layer stack (L leading, as the
stacked weight); the effective weight is `W + (alpha / r) · reshape(a @ b, W.shape)`, where d_in is the weight's
input dimensions (D for q/k/v/gate/up, N·H for o, F for down). `b` starts at zero, so the
adapted model starts as the base model. `merge` is pure: the trainer merges inside the jitted step (the base
weights are an input, never differentiated) and for rollouts and HF export.

    adapters = models.lora_init(nnx.state(model), rank=8, targets=("q", "v"), key=jax.random.key(0))
    merged = models.lora_merge(nnx.state(model), adapters, scale=16 / 8)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

# target name -> (parameter name, number of leading input dimensions)
LORA_TARGETS = {"q": ("w_q_dnh", 1), "k": ("w_k_dkh", 1), "v": ("w_v_dkh", 1), "o": ("w_o_nhd", 2),
                "gate": ("w_gate_df", 1), "up": ("w_up_df", 1), "down": ("w_down_fd", 1)}


def _names(path) -> tuple[str, ...]:
  """A parameter's path as strings, without the variable's `.value`."""
  out = []
  for k in path:
    name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
    if name != "value":
      out.append(str(name))
  return tuple(out)


def lora_init(policy: Any, *, rank: int, targets: Sequence[str], key: jax.Array,
              dtype: Any = jnp.float32) -> dict[str, Any]:
  """Adapters for every target weight of `policy` (a model's parameter state)."""
  if rank < 1:
    raise ValueError(f"LoRA rank={rank}: must be >= 1")
  unknown = sorted(set(targets) - set(LORA_TARGETS))
  if unknown or not targets:
    raise ValueError(f"LoRA targets {list(targets)}: choose from {sorted(LORA_TARGETS)}")
  wanted = dict(LORA_TARGETS[t] for t in targets)
  adapters: dict[str, Any] = {}
  leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(policy)[0] if _names(p)[-1] in wanted]
  keys = jax.random.split(key, max(len(leaves), 1))
  for k, (path, leaf) in zip(keys, leaves):
    names = _names(path)
    layers, shape = leaf.shape[0], leaf.shape[1:]  # every target weight is in a layer stack
    n_in = wanted[names[-1]]
    d_in, d_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    node = adapters
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = {"a": jax.random.normal(k, (layers, d_in, rank), dtype) * d_in ** -0.5,
                       "b": jnp.zeros((layers, rank, d_out), dtype)}
  if not leaves:
    raise ValueError(f"LoRA targets {list(targets)}: no such weight in the model")
  return adapters


def lora_merge(policy: Any, adapters: dict[str, Any], scale: float) -> Any:
  """`policy` with each adapted weight replaced by `W + scale · a @ b` (in W's dtype)."""

  def merge(path, w):
    node = adapters
    for name in _names(path):
      if not isinstance(node, dict) or name not in node:
        return w
      node = node[name]
    delta = jnp.einsum("lir,lro->lio", node["a"], node["b"], preferred_element_type=jnp.float32) * scale
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(merge, policy)
