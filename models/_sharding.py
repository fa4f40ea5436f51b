"""Logical axis names -> mesh axes, through one rules table.

Modules name logical axes only (`("embed", "mlp")`). A rules table maps each logical name to zero or more
mesh axes; the tables and the mesh axes live in `jaxagent/sharding.py` (a role picks its table there): this
package knows logical names only. A dimension that the mapped mesh axes do not
divide stays replicated, and a mesh axis is used at most once per array.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

def _lookup(rules: Rules, name: str) -> tuple[str, ...]:
  for logical, target in rules:
    if logical == name:
      if target is None:
        return ()
      return (target,) if isinstance(target, str) else tuple(target)
  raise KeyError(f"logical axis {name!r} has no rule; rules cover {[r[0] for r in rules]}")


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules) -> PartitionSpec:
  """The PartitionSpec for an array of `shape` whose dimensions have logical names `axes`."""
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec: list[Any] = []
  for name, dim in zip(axes, shape):
    targets = () if name is None else _lookup(rules, name)
    targets = tuple(a for a in targets if a in mesh.shape and a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in targets)
    if not targets or dim % size:
      spec.append(None)
      continue
    used.update(targets)
    spec.append(targets[0] if len(targets) == 1 else targets)
  return PartitionSpec(*spec)


def variable_sharding(variable: nnx.Variable, mesh: Mesh, rules: Rules) -> NamedSharding:
  """The `NamedSharding` of one (concrete or abstract) variable from its logical axis names."""
  axes = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
  return NamedSharding(mesh, logical_to_spec(axes, variable.shape, mesh, rules))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
  """A tree like `state` (concrete or abstract) holding each variable's `NamedSharding`."""
  return jax.tree.map(lambda v: v.replace(variable_sharding(v, mesh, rules)), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
  """Returns `model` with every parameter placed on `mesh` according to `rules`."""
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  return nnx.merge(graphdef, jax.device_put(state, shardings))
