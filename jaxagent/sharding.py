"""Meshes from config, per-role rules tables, and a guard against silently replicated parameters.

The mesh has axes `data, fsdp, expert, tensor`. Each axis has an ICI size (inside a granule: a TPU slice, or one
process elsewhere) and a DCN size (across granules); the mesh axis is their product. One size per group may
be -1 (inferred). With DCN sizes all 1 the mesh is `mesh_utils.create_device_mesh` over every device;
otherwise `mesh_utils.create_hybrid_device_mesh`, so that only the DCN axes cross slow links.

A role (rollout, learner, reference) maps logical axes to mesh axes through a named rules table
(`RULE_TABLES`, data in jaxagent/mesh_rules.py), chosen in `mesh.rules.<role>`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

import models
from jaxagent.config import MeshAxes, MeshConfig
from jaxagent.mesh_rules import (FSDP_TP_RULES, MESH_AXES, REPLICATED_RULES, ROLES, RULE_TABLES,  # noqa: F401
                                 TENSOR_PARALLEL_RULES)



def rules_for(role: str, config: MeshConfig) -> models.Rules:
  """The rules table configured for `role` ("rollout", "learner" or "reference")."""
  if role not in ROLES:
    raise ValueError(f"role {role!r}: not one of {list(ROLES)}")
  name = getattr(config.rules, role)
  if name not in RULE_TABLES:
    raise ValueError(f"mesh.rules.{role}={name!r}: not one of {sorted(RULE_TABLES)}")
  return RULE_TABLES[name]


# ----------------------------------------------------------------------------------------------
# Mesh.


def _infer(sizes: MeshAxes | dict[str, int], total: int, where: str) -> dict[str, int]:
  """Sizes per mesh axis with the one -1 filled in so that they multiply to `total` (the only inference)."""
  if isinstance(sizes, dict):
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"{where}: unknown mesh axes {sorted(unknown)}; valid: {list(MESH_AXES)}")
    out = {a: sizes.get(a, 1) for a in MESH_AXES}
  else:
    out = {a: getattr(sizes, a) for a in MESH_AXES}
  if sum(v == -1 for v in out.values()) > 1:
    raise ValueError(f"{where}: at most one mesh axis may be -1, got {out}")
  known = math.prod(v for v in out.values() if v != -1)
  inferred = [a for a, v in out.items() if v == -1]
  if inferred:
    if total % known:
      raise ValueError(f"{where}: {total} cannot be split as {out} (the fixed sizes multiply to {known})")
    out[inferred[0]] = total // known
  if math.prod(out.values()) != total:
    raise ValueError(f"{where}={out} multiplies to {math.prod(out.values())}, but there are {total}")
  return out


def resolve_mesh_shape(config: MeshConfig, num_devices: int, num_granules: int) -> tuple[dict[str, int],
                                                                                       dict[str, int]]:
  """ICI and DCN sizes per axis with every -1 filled in.

  Args:
    config: the `mesh` config section.
    num_devices: devices in the mesh.
    num_granules: TPU slices, or processes on other platforms.

  Returns:
    `(ici, dcn)` dicts over `data, fsdp, expert, tensor`. With DCN sizes all 1, the ICI sizes cover every device.

  Raises:
    ValueError: the sizes do not fit the devices; the message names the config keys and counts.
  """
  if num_devices % num_granules:
    raise ValueError(f"{num_devices} devices are not split evenly over {num_granules} granules")
  dcn_sizes = [getattr(config.dcn, a) for a in MESH_AXES]
  if all(s == 1 for s in dcn_sizes):  # explicitly flat: one mesh over every device, whatever the granules
    dcn = dict.fromkeys(MESH_AXES, 1)
  else:
    dcn = _infer(config.dcn, num_granules, f"mesh.dcn (over {num_granules} granules: slices or processes)")
  if math.prod(dcn.values()) == 1:
    ici = _infer(config.ici, num_devices, f"mesh.ici (over all {num_devices} devices)")
  else:
    ici = _infer(config.ici, num_devices // num_granules,
                 f"mesh.ici (over the {num_devices // num_granules} devices of one granule)")
  return ici, dcn


def _granules(devices: Sequence[jax.Device]) -> tuple[int, bool]:
  """(count, process_is_granule): TPU slices, else processes. A TPU device that reports no slice index is in
  the one slice of its topology (a single-slice topology description, `jaxagent plan`): its hosts share ICI."""
  if devices[0].platform == "tpu":
    return len({getattr(d, "slice_index", None) or 0 for d in devices}), False
  return len({d.process_index for d in devices}), True


def mesh_from_config(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The `data, fsdp, expert, tensor` mesh the config describes, over `devices` (default: all devices of all processes).

  Args:
    config: the `mesh` config section.
    devices: the devices to use (default `jax.devices()`).

  Returns:
    A `jax.sharding.Mesh` whose axis sizes are ICI x DCN per axis.
  """
  devices = list(jax.devices() if devices is None else devices)
  num_granules, process_is_granule = _granules(devices)
  ici, dcn = resolve_mesh_shape(config, len(devices), num_granules)
  if math.prod(dcn.values()) == 1:
    grid = mesh_utils.create_device_mesh([ici[a] for a in MESH_AXES], devices,
                                         allow_split_physical_axes=config.allow_split_physical_axes)
  else:
    grid = mesh_utils.create_hybrid_device_mesh(
        [ici[a] for a in MESH_AXES], [dcn[a] for a in MESH_AXES], devices,
        process_is_granule=process_is_granule, allow_split_physical_axes=config.allow_split_physical_axes)
  return Mesh(np.asarray(grid), MESH_AXES)


def placement_meshes(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
  """(learner mesh, rollout mesh) of `mesh.placement`: one mesh twice (colocated), or two meshes of one shape
  (disaggregated: the first half of every process's devices learns, the second half rolls out), the learner
  device at each grid position paired with the rollout device at the same position (`cross_mesh_copy`)."""
  devices = list(jax.devices() if devices is None else devices)
  if config.placement == "colocated":
    mesh = mesh_from_config(config, devices)
    return mesh, mesh
  by_process: dict[int, list[jax.Device]] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  counts = {p: len(ds) for p, ds in by_process.items()}
  if any(n % 2 for n in counts.values()):
    raise ValueError(f"mesh.placement=disaggregated splits each process's devices in half; devices per process "
                     f"{counts} (use an even number, e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  learner = [d for ds in by_process.values() for d in ds[:len(ds) // 2]]
  rollout = [d for ds in by_process.values() for d in ds[len(ds) // 2:]]
  return mesh_from_config(config, learner), mesh_from_config(config, rollout)


def cross_mesh_copy(tree: Any, source: Mesh, target: Mesh, shardings: Any) -> Any:
  """Copies `tree` (arrays on `source`) onto `target`, a mesh of the same shape on other devices, then into
  `shardings` (on `target`); the source arrays stay. One jitted program over the union of both meshes moves
  every leaf: `ppermute` along a `role` axis sends each source device's shard to the target device at its grid
  position. This is what works under multi-controller JAX, where `device_put` between disjoint device sets of
  several processes raises (jax: "cross-host reshard ... should have the same set of devices"; marin#3947)."""
  if source.devices.shape != target.devices.shape:
    raise ValueError(f"meshes of shapes {source.devices.shape} and {target.devices.shape}: need one shape")
  union = Mesh(np.stack([source.devices, target.devices]), ("role",) + tuple(source.axis_names))
  pair = {d: t for d, t in zip(source.devices.flat, target.devices.flat)}
  leaves, treedef = jax.tree.flatten(tree)

  def stacked(x):
    spec = x.sharding.spec
    sh = jax.sharding.NamedSharding(union, jax.sharding.PartitionSpec("role", *spec))
    shards = []
    for s in x.addressable_shards:
      shards.append(s.data.reshape((1,) + s.data.shape))
      shards.append(jnp.zeros((1,) + s.data.shape, x.dtype, device=pair[s.device]))  # what ppermute fills
    return jax.make_array_from_single_device_arrays((2,) + x.shape, sh, shards), spec

  arrays, specs = zip(*map(stacked, leaves)) if leaves else ((), ())
  key = (union, tuple(specs), tuple((a.shape, a.dtype) for a in arrays))
  move = _CROSS_MESH_PROGRAMS.get(key)
  if move is None:
    in_specs = tuple(jax.sharding.PartitionSpec("role", *s) for s in specs)
    body = lambda *xs: tuple(jax.lax.ppermute(x, "role", perm=[(0, 1)]) for x in xs)
    move = jax.jit(jax.shard_map(body, mesh=union, in_specs=in_specs, out_specs=in_specs))
    _CROSS_MESH_PROGRAMS[key] = move
  moved = move(*arrays)
  out = []
  for x, y, spec in zip(leaves, moved, specs):
    sh = jax.sharding.NamedSharding(target, spec)
    parts = [s.data.reshape(s.data.shape[1:]) for s in y.addressable_shards if s.device in pair.values()]
    out.append(jax.make_array_from_single_device_arrays(x.shape, sh, parts))
  del moved
  return jax.device_put(jax.tree.unflatten(treedef, out), shardings)


_CROSS_MESH_PROGRAMS: dict[Any, Any] = {}  # (union mesh, specs, shapes) -> the jitted move


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `data, fsdp, expert, tensor` mesh over `devices` (default: all) from explicit sizes; one may be -1 (inferred).

  Unset axes default to `data: -1, fsdp: 1, expert: 1, tensor: 1`. For the configured mesh use `mesh_from_config`.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": -1, "fsdp": 1, "expert": 1, "tensor": 1, **(shape or {})}
  if -1 not in sizes.values() and math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, have {len(devices)}")
  sizes = _infer(sizes, len(devices), "mesh")
  return Mesh(np.asarray(devices).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)


# ----------------------------------------------------------------------------------------------
# Replication guard.


class ReplicationError(ValueError):
  """Too many parameter bytes are fully replicated on a multi-device mesh."""


@dataclasses.dataclass(frozen=True)
class ReplicationReport:
  """Parameter bytes and how many of them every device holds in full."""

  total_bytes: int
  replicated_bytes: int
  largest_replicated: tuple[tuple[str, tuple[int, ...], int], ...]  # (path, shape, bytes), largest first

  @property
  def replicated_fraction(self) -> float:
    return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0


def check_replication(state: Any, max_replicated_fraction: float, *, top: int = 5) -> ReplicationReport:
  """Fails when more than `max_replicated_fraction` of parameter bytes are fully replicated.

  A leaf counts as replicated when its sharding spans more than one device and every device holds all of
  it. Leaves on a single device are never counted, so the guard is silent on one device.

  Args:
    state: a pytree (e.g. `nnx.State`) of `jax.Array`s or `jax.ShapeDtypeStruct`s with shardings.
    max_replicated_fraction: in [0, 1]; 1 allows everything.
    top: how many of the largest replicated leaves to name.

  Returns:
    The `ReplicationReport`.

  Raises:
    ReplicationError: naming the fraction, the limit and the largest replicated parameters.
    ValueError: `max_replicated_fraction` outside [0, 1], or a leaf without a sharding.
  """
  if not 0.0 <= max_replicated_fraction <= 1.0:
    raise ValueError(f"max_replicated_fraction={max_replicated_fraction}: must be in [0, 1]")
  total, replicated, named = 0, 0, []
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(state):
    path = jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      continue
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    total += nbytes
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
      raise ValueError(f"{path} has no sharding; place the state on a mesh first")
    if len(sharding.device_set) > 1 and sharding.is_fully_replicated:
      replicated += nbytes
      named.append((path, tuple(leaf.shape), nbytes))
  named.sort(key=lambda item: -item[2])
  report = ReplicationReport(total, replicated, tuple(named[:top]))
  if report.replicated_fraction > max_replicated_fraction:
    listing = ", ".join(f"{p} {list(s)} ({b / 2**20:.2f} MiB)" for p, s, b in report.largest_replicated)
    raise ReplicationError(
        f"{report.replicated_fraction:.1%} of parameter bytes ({replicated:,} of {total:,}) are fully "
        f"replicated on every device, more than mesh.max_replicated_fraction={max_replicated_fraction}. "
        f"Largest replicated: {listing}. Use a rules table that shards them (mesh.rules.*), a mesh with "
        f"fsdp/tensor > 1 whose sizes divide these dimensions, or raise the limit.")
  return report


# ----------------------------------------------------------------------------------------------
# Resharding between layouts on the same devices.


def chunk_plan(nbytes: Sequence[int], fraction: float) -> list[range]:
  """Consecutive groups of arrays of at most `fraction` of the total bytes each (an array larger than that
  is a group of its own)."""
  budget = fraction * sum(nbytes)
  groups, start, size = [], 0, 0
  for i, n in enumerate(nbytes):
    if i > start and size + n > budget:
      groups.append(range(start, i))
      start, size = i, 0
    size += n
  if nbytes:
    groups.append(range(start, len(nbytes)))
  return groups


def reshard_plan(leaves: Sequence[Any], targets: Sequence[Any], chunk_fraction: float) -> list[list[int]]:
  """The groups of leaf indices `reshard` moves, in order: only arrays not already in their target layout."""
  moving = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not x.sharding.is_equivalent_to(s, x.ndim)]
  return [[moving[g] for g in group] for group in chunk_plan([leaves[i].nbytes for i in moving], chunk_fraction)]


@functools.lru_cache(maxsize=None)
def _mover(out_shardings: tuple[Any, ...]):
  """One jitted identity that lays its arguments out as `out_shardings` (XLA slices locally where the
  destination is more sharded and all-gathers where it is less; nothing goes through the host)."""
  return jax.jit(lambda *xs: xs, out_shardings=out_shardings)


def reshard(tree: Any, shardings: Any, *, chunk_fraction: float = 0.125) -> Any:
  """Moves every array of `tree` to the matching sharding of `shardings`; the source arrays are deleted.

  Arrays move in a few groups of at most `chunk_fraction` of the bytes each, one jitted program per group,
  and each group's sources are freed as soon as it lands: the peak stays about the larger of the two layouts
  plus one group (one program for the whole tree would hold every input and every output at once; jit
  donation cannot free an input whose shape differs from every output), while the per-program dispatch
  cost is paid a few times instead of once per array. Arrays already in their target layout stay as they
  are. Works across processes: each group is a collective on the mesh.
  """
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  out = list(leaves)
  for idx in reshard_plan(leaves, targets, chunk_fraction):
    moved = jax.block_until_ready(_mover(tuple(targets[i] for i in idx))(*[leaves[i] for i in idx]))
    for i, y in zip(idx, moved):
      leaves[i].delete()
      out[i] = y
  return treedef.unflatten(out)
