"""Multi-host row plumbing: the one place where this process's rows meet global arrays and other processes.

Every process holds a contiguous block of a batch's rows (process p owns block p). Host code works on those
rows; jitted code works on global arrays. The helpers here are the only crossings:

  to_global(tree, mesh, rules)   this process's rows (numpy) -> global arrays, rows sharded by `batch`
  local_rows(x)                  a global batch-leading array -> this process's rows (numpy)
  host_sum(x) / host_gather(x)   a host value summed / concatenated over processes
  host_sums(named)               several named host values summed in one collective, read back by name
  any_process(flag)              one decision every process agrees on

Each is the identity (no collective) in a single-process run.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

import models


def to_global(tree: Any, mesh: Mesh | None, rules: models.Rules) -> Any:
  """This process's rows of host arrays -> global arrays whose leading axis is laid out as logical `batch`.

  Rows too few to shard over the mapped mesh axes are replicated: every process then holds all rows (they are
  gathered first), so the global array is the same on every process.
  """
  if mesh is None:
    return jax.tree.map(jax.numpy.asarray, tree)

  def sharding(x):
    shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
    return NamedSharding(mesh, models.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), shape, mesh, rules))

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
