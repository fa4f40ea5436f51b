"""Value head for PPO: a linear read-out of the policy's final hidden states (shared trunk)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx


class ValueHead(nnx.Module):
  """`V(s) = h · w + b` on the final-normed hidden state of the token that precedes an action."""

  def __init__(self, dim: int, *, dtype: Any = jnp.float32):
    self.w_d = nnx.Param(jnp.zeros((dim,), dtype), out_sharding=("embed",), eager_sharding=False)
    self.b = nnx.Param(jnp.zeros((), dtype), out_sharding=(), eager_sharding=False)

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    return jnp.einsum("btd,d->bt", x_btd, self.w_d[...], preferred_element_type=jnp.float32) + self.b[...]


@flax.struct.dataclass
class ValueTargets:
  """PPO value-loss inputs aligned with a `Batch` ([B, T]); only `mask` positions count.

  Attributes:
    old_values: float32 values at collection time (for value clipping).
    returns: float32 GAE returns (value targets).
    mask: bool; the state token before each action.
  """

  old_values: jax.Array
  returns: jax.Array
  mask: jax.Array
