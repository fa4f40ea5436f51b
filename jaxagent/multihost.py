"""Multi-host row plumbing: the one place where this process's rows meet global arrays and other processes.

Every process holds a contiguous block of a batch's rows (process p owns block p). Host code works on those
rows; jitted code works on global arrays. The helpers here are the only crossings:

  to_global(tree, mesh, rules)   this process's rows (numpy) -> global arrays, rows sharded by `batch`
  local_rows(x)                  a global batch-leading array -> this process's rows (numpy)
  host_sum(x) / host_gather(x)   a host value summed / concatenated over processes
  host_sums(named)               several named host values summed in one collective, read back by name
  any_process(flag)              one decision every process agrees on
  per_shard_callback(fn, ...)    inside jitted code: a host callback per row block, on the host that holds it

Each is the identity (no collective) in a single-process run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import models


def batch_sharding(shape: tuple[int, ...], mesh: Mesh, rules: models.Rules) -> NamedSharding:
  """The layout of a global batch-leading array of `shape`: its first axis is the logical `batch`."""
  return NamedSharding(mesh, models.logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules))


def batch_shards(rows: int, mesh: Mesh, rules: models.Rules) -> tuple[tuple[str, ...], int]:
  """The mesh axes a global batch of `rows` is sharded over by `rules`, and into how many row blocks (1: none)."""
  spec = models.logical_to_spec(("batch",), (rows,), mesh, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return axes, math.prod(mesh.shape[a] for a in axes)


def expert_placement(num_experts: int, mesh: Mesh | None,
                     rules: models.Rules) -> models.ExpertPlacement | None:
  """Where a mixture-of-experts policy's programs on `mesh` dispatch tokens to experts: per shard of the batch's
  rows (the axes `rules` split a batch over), to the experts the rules place on each device (`expert` axis: expert
  parallelism). None for a dense policy, no mesh, or nothing split."""
  if not num_experts or mesh is None:
    return None
  axes, shards = batch_shards(mesh.devices.size, mesh, rules)
  experts_split = models.logical_to_spec(("experts",), (num_experts,), mesh, rules)[0] is not None
  return models.ExpertPlacement(mesh, axes, tuple(rules)) if shards > 1 or experts_split else None


def to_global(tree: Any, mesh: Mesh | None, rules: models.Rules) -> Any:
  """This process's rows of host arrays -> global arrays whose leading axis is laid out as logical `batch`.

  Rows too few to shard over the mapped mesh axes are replicated: every process then holds all rows (they are
  gathered first), so the global array is the same on every process.
  """
  if mesh is None:
    return jax.tree.map(jax.numpy.asarray, tree)

  def sharding(x):
    return batch_sharding((x.shape[0] * jax.process_count(),) + x.shape[1:], mesh, rules)

  tree = jax.tree.map(np.asarray, tree)
  if jax.process_count() == 1:  # every row is here: one batched transfer for the whole tree
    return jax.device_put(tree, jax.tree.map(sharding, tree))

  def put(x):
    s, shape = sharding(x), (x.shape[0] * jax.process_count(),) + x.shape[1:]
    if s.spec[0] is None:  # replicated: every process holds every row
      x = host_gather(x)
    return jax.make_array_from_process_local_data(s, x, shape)

  return jax.tree.map(put, tree)


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a batch-leading global array (process p owns the p-th contiguous block of rows).

  Read from the shards this process already holds when they cover its block (the batch is sharded that way
  whenever rows are spread over processes: `to_global`); otherwise, e.g. rows too few to shard, the array is
  gathered from every process first.
  """
  n = jax.process_count()
  if n == 1:
    return np.asarray(jax.device_get(x))
  rows = x.shape[0] // n
  lo = jax.process_index() * rows
  out = covered = None
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0])
    a, b = max(start, lo), min(stop, lo + rows)
    if a >= b:
      continue
    if out is None:
      out, covered = np.empty((rows,) + x.shape[1:], x.dtype), np.zeros((rows,) + x.shape[1:], bool)
    where = (slice(a - lo, b - lo),) + tuple(shard.index[1:])
    out[where] = np.asarray(shard.data)[a - start:b - start]
    covered[where] = True
  if out is not None and covered.all():
    return out
  full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return full[lo:lo + rows]


def host_sum(value: Any) -> np.ndarray:
  """Sum over processes of a host value (elementwise for arrays)."""
  if jax.process_count() == 1:
    return np.asarray(value)
  return np.asarray(multihost_utils.process_allgather(np.asarray(value))).sum(axis=0)


def host_sums(named: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Sums over processes of named host values (scalars or arrays, any mix), in one collective, read back by name
  (never by position). The dtype is the values' common one (ints stay ints)."""
  parts = {k: np.asarray(v) for k, v in named.items()}
  dtype = np.result_type(*parts.values()) if parts else np.float64
  total = host_sum(np.concatenate([p.astype(dtype).ravel() for p in parts.values()]) if parts else np.zeros(0))
  out, start = {}, 0
  for k, p in parts.items():
    out[k] = total[start:start + p.size].reshape(p.shape)
    start += p.size
  return out


def host_gather(value: Any) -> np.ndarray:
  """Concatenation over processes (in process order) of a host array's rows."""
  if jax.process_count() == 1:
    return np.asarray(value)
  return np.asarray(multihost_utils.process_allgather(np.asarray(value), tiled=True))


def host_max(value: Any) -> np.ndarray:
  """Elementwise maximum over processes of a host value."""
  if jax.process_count() == 1:
    return np.asarray(value)
  return np.asarray(multihost_utils.process_allgather(np.asarray(value))).max(axis=0)


def any_process(flag: bool) -> bool:
  """True if `flag` is true on any process (the same answer on all of them)."""
  return bool(host_sum(np.asarray(bool(flag), np.int32)) > 0)

def per_shard_callback(fn: Callable, shapes: Sequence[jax.ShapeDtypeStruct], args: Sequence[jax.Array], mesh: Mesh,
                       batch_axes: str | Sequence[str]) -> tuple[jax.Array, ...]:
  """`io_callback(fn, shapes, shard, *rows)` once per shard of the batch; traceable.

  Runs inside `shard_map` over `batch_axes`, so each shard (on every host) calls `fn` on its own host with only
  its own rows: `fn(shard, *args_rows)` gets the shard's index along `batch_axes` (row-major when several) and
  its rows of each of `args` (batch-leading), and returns arrays of `shapes` (per shard; batch-leading outputs
  are concatenated over shards like the inputs). Outside `shard_map` the callback would gather the whole batch
  to one device (docs/design.md §4). Mesh axes the batch is not sharded over hold replicas of each row block:
  only the replica at index 0 calls the host (an env must be stepped once), the others receive its result
  through a psum.
  """
  axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  axis = axes if len(axes) > 1 else axes[0]
  replica_axes = tuple(a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1)

  def call(shard, *rows):
    return io_callback(fn, tuple(shapes), shard, *rows, ordered=False)

  def per_shard(*rows):
    shard = jax.lax.axis_index(axis)
    if not replica_axes:
      return call(shard, *rows)
    leader = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in replica_axes]))
    zeros = tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
    out = jax.lax.cond(leader, call, lambda *_: zeros, shard, *rows)
    out = [jax.lax.psum(o.astype(jnp.int32) if o.dtype == jnp.bool_ else o, replica_axes) for o in out]
    return tuple(o.astype(s.dtype) for o, s in zip(out, shapes))

  spec = PartitionSpec(axis)
  # Whatever layout the caller had, the batch goes to its shards (a no-op when it is already there).
  sharding = jax.sharding.NamedSharding(mesh, spec)
  explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  place = jax.reshard if explicit else jax.lax.with_sharding_constraint
  args = tuple(place(a, sharding) for a in args)
  return tuple(jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * len(args), out_specs=(spec,) * len(shapes),
                             check_vma=False)(*args))
