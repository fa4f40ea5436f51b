"""Logical axis names -> mesh axes, through one rules table.

Modules name logical axes only (`("embed", "mlp")`). A rules table maps each logical name to zero or more
mesh axes; a role (rollout, learner, reference) picks its table. A dimension that the mapped mesh axes do not
divide stays replicated, and a mesh axis is used at most once per array.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

MESH_AXES = ("data", "fsdp", "tensor")

# FSDP over `fsdp`, tensor parallelism over `tensor`; `batch` is for activations and data.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
)


def _lookup(rules: Rules, name: str) -> tuple[str, ...]:
  for logical, target in rules:
    if logical == name:
      if target is None:
        return ()
      return (target,) if isinstance(target, str) else tuple(target)
  raise KeyError(f"logical axis {name!r} has no rule; rules cover {[r[0] for r in rules]}")


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> PartitionSpec:
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


def variable_sharding(variable: nnx.Variable, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """The `NamedSharding` of one (concrete or abstract) variable from its logical axis names."""
  axes = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
  return NamedSharding(mesh, logical_to_spec(axes, variable.shape, mesh, rules))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
  """A tree like `state` (concrete or abstract) holding each variable's `NamedSharding`."""
  return jax.tree.map(lambda v: v.replace(variable_sharding(v, mesh, rules)), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Returns `model` with every parameter placed on `mesh` according to `rules`."""
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  return nnx.merge(graphdef, jax.device_put(state, shardings))


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with axes `data, fsdp, tensor`; one size may be -1 (inferred)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = dict({"data": -1, "fsdp": 1, "tensor": 1}, **(shape or {}))
  unknown = set(sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid: {MESH_AXES}")
  inferred = [a for a, s in sizes.items() if s == -1]
  known = math.prod(s for s in sizes.values() if s != -1)
  if len(inferred) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {inferred}")
  if inferred:
    if len(devices) % known:
      raise ValueError(f"mesh {sizes}: {len(devices)} devices are not divisible by {known}")
    sizes[inferred[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, have {len(devices)}")
  grid = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
  return Mesh(grid, MESH_AXES)
