"""Shared-prefix packing: the tokens that several sequences of a batch hold in common, computed once.

Every trajectory of a GRPO group repeats its task's prompt, and a branch (`rollout.branch`) repeats its parent's
history up to the branch point. `prefix_trees` finds the prefix trees of an assembled `Batch` and `pack` lays
them out (`jaxagent.train.learner.share_prefixes` decides whether an update uses them): a token
that several sequences hold at the same position after the same history is one slot, then each continues on its
own. What counts as shared is decided by tokens alone (never by text): slot t of a sequence is keyed by its
input token, the token it predicts (t + 1's; none at the end), and what the model's computation there reads
from the record (the expert routes of the input token, the sampling threshold of the predicted one). Two
sequences share slot t iff they share every slot before it and its key. So each slot predicts one token, and
where sequences diverge the last common token is computed once per branch (the duplicate that keeps every slot
with a single successor).

Each tree is one run of consecutive slots in a packed row, in depth-first preorder; its segments (maximal chains
without a fork) are numbered in that order and each slot carries its segment's id and the end of its segment's
subtree, the models' tree attention rule (models/_transformer.py): a slot attends to its own segment and its
ancestors', by position. The per-slot results (log-probs, entropy, kept mass, values) are gathered back onto
the unshared batch, where the losses run unchanged: loss masks, advantages, behavior log-probs and every loss
term map one to one.

Sharing works on blocks of `block_rows` consecutive unshared rows, each packed into `packed_rows` rows of its
own: a block lies inside one micro-batch, one process and one device's rows, so the gather never crosses them.
Shape letters: B/T the unshared batch, P/L the packed one (`P = blocks x packed_rows`), M sparse layers, k.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import assembly, buckets as buckets_lib

@flax.struct.dataclass
class SharedPrefix:
  """A batch's sequences as prefix trees (a pytree; the packed leaves lead with [P, L], the maps with [B, T]).

  Attributes:
    tokens: int32[P, L] each slot's input token; 0 at padding.
    positions: int32[P, L] its position in its sequences.
    segment_ids: int32[P, L] its segment, numbered in preorder from 1 within a row; 0 at padding.
    segment_ends: int32[P, L] the end (exclusive) of its segment's subtree's ids.
    targets: int32[P, L] the token the slot predicts (0: none).
    target_mask: bool[P, L] whether a loss token of some sequence is that prediction.
    thresholds: float32[P, L] the recorded sampling threshold of the predicted token, or None.
    routes: int16[P, L, M, k] the recorded experts of the input token, or None.
    slot: int32[B, T] where unshared token (b, t) is: a flat index into its block's packed rows; -1 at padding.
    predictor: int32[B, T] the slot whose hidden state predicts token (b, t); -1 for a sequence's first token.
    block_rows / packed_rows: unshared and packed rows of a block (static).
  """
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  segment_ends: np.ndarray
  targets: np.ndarray
  target_mask: np.ndarray
  slot: np.ndarray
  predictor: np.ndarray
  thresholds: np.ndarray | None = None
  routes: np.ndarray | None = None
  block_rows: int = flax.struct.field(pytree_node=False, default=1)
  packed_rows: int = flax.struct.field(pytree_node=False, default=1)

  def unshare(self, packed_pl: jax.Array, index_bt: jax.Array) -> jax.Array:
    """Per-slot values [P, L] -> per unshared token [B, T] (`index_bt`: `slot` or `predictor`; 0 where -1).
    Works on any micro-batch slice: blocks never straddle one."""
    b, t = index_bt.shape
    blocks = b // self.block_rows
    if b % self.block_rows or packed_pl.shape[0] != blocks * self.packed_rows:
      raise ValueError(f"{b} unshared rows and {packed_pl.shape[0]} packed rows are not whole blocks of "
                       f"{self.block_rows} and {self.packed_rows}: slice a shared batch only between blocks")
    flat = packed_pl.reshape(blocks, -1)
    index = index_bt.reshape(blocks, -1)
    out = jnp.take_along_axis(flat, jnp.maximum(index, 0), axis=1)
    return jnp.where(index >= 0, out, jnp.zeros((), out.dtype)).reshape(b, t)


@dataclasses.dataclass(frozen=True)
class Sharing:
  """What sharing a batch saves, before it is chosen: real tokens, padded slots (rows x length) and attention
  scores (rows x length²: the packed rows are longer), shared and unshared."""
  tokens_unshared: int
  tokens_computed: int
  slots_unshared: int
  slots_computed: int
  scores_unshared: int
  scores_computed: int

  @property
  def saving(self) -> float:
    """The fraction of the padded batch's slots that sharing does not compute."""
    return 1.0 - self.slots_computed / max(self.slots_unshared, 1)

  def worth_it(self, min_saving: float) -> bool:
    """Sharing saves more than `min_saving` of the slots and its attention scores are no more than the unshared
    batch's (a tree's row can be many times longer than a trajectory: its [L, L] scores grow quadratically)."""
    return self.saving > min_saving and self.scores_computed <= self.scores_unshared


@dataclasses.dataclass
class _Tree:
  """One prefix tree of a block: its nodes in preorder, each node's segment (0-based within the tree, preorder)
  and each segment's subtree end (exclusive)."""
  nodes: list[int]
  segment: list[int]
  segment_end: list[int]


class _Trie:
  """The slots of one block: one node per distinct (history, key); children in first-seen order."""

  def __init__(self):
    self.children: list[dict[bytes, int]] = [{}]  # node 0: the root (no slot)
    self.parent: list[int] = [-1]
    self.position: list[int] = [-1]
    self.cell: list[tuple[int, int]] = [(-1, -1)]  # the first unshared (row, column) seen holding the node

  def insert(self, keys: Sequence[bytes], row: int, start: int) -> list[int]:
    """Adds one sequence (its slot keys, at `row`, columns from `start`); returns its node per token."""
    node, path = 0, []
    for t, key in enumerate(keys):
      child = self.children[node].get(key)
      if child is None:
        child = len(self.children)
        self.children[node][key] = child
        self.children.append({})
        self.parent.append(node)
        self.position.append(t)
        self.cell.append((row, start + t))
      path.append(child)
      node = child
    return path

  def trees(self) -> list[_Tree]:
    """The root's subtrees, each in preorder. A node starts a segment iff its parent is the root or forks."""
    size = [1] * len(self.children)
    for node in range(len(self.children) - 1, 0, -1):  # children are made after their parents
      size[self.parent[node]] += size[node]
    out = []
    for root in self.children[0].values():
      nodes, segment, starts = [], [], []
      stack = [root]
      while stack:
        node = stack.pop()
        parent = self.parent[node]
        if parent == 0 or len(self.children[parent]) > 1:
          starts.append(len(nodes))
          segment.append(len(starts) - 1)
        else:
          segment.append(segment[-1])  # a chain: its parent is the previous node in preorder
        nodes.append(node)
        stack.extend(reversed(list(self.children[node].values())))
      # A segment's subtree is its first node's, a contiguous preorder range; the last node in it holds the
      # subtree's highest segment.
      ends = [segment[i + size[nodes[i]] - 1] + 1 for i in starts]
      out.append(_Tree(nodes, segment, ends))
    return out


def _keys(batch: assembly.Batch, row: int, start: int, stop: int) -> list[bytes]:
  """Each slot's key of the sequence at `row`, columns [start, stop): input token, predicted token (-1 at the
  end), the predicted token's recorded sampling threshold, the input token's recorded expert routes."""
  tokens = batch.tokens[row, start:stop]
  nxt = np.append(tokens[1:], -1).astype(np.int64)
  parts = [np.stack([tokens.astype(np.int64), nxt], axis=1).view(np.uint8).reshape(stop - start, -1)]
  if batch.sampling_thresholds is not None:
    thr = np.append(batch.sampling_thresholds[row, start + 1:stop], np.float32(np.nan)).astype(np.float32)
    parts.append(thr.view(np.uint8).reshape(stop - start, -1))
  if batch.expert_routes is not None:
    parts.append(batch.expert_routes[row, start:stop].reshape(stop - start, -1).view(np.uint8))
  return [row_bytes.tobytes() for row_bytes in np.concatenate(parts, axis=1)]


@dataclasses.dataclass
class _Block:
  trie: _Trie
  trees: list[_Tree]
  sequences: list[tuple[int, int, list[int]]]  # (row, first column, node per token)


@dataclasses.dataclass
class PrefixTrees:
  """A batch's sequences as prefix trees, block by block (host side: `prefix_trees` finds them, `pack` lays
  them out). Every process finds its own rows' trees; the packed shape is agreed from `largest` and
  `rows_needed`."""
  blocks: list[_Block]
  block_rows: int

  @property
  def largest(self) -> int:
    """The slots of the largest tree (0: an empty batch)."""
    return max((len(tree.nodes) for block in self.blocks for tree in block.trees), default=0)

  @property
  def tokens(self) -> int:
    """The slots every tree holds: the tokens a packed batch computes."""
    return sum(len(block.trie.children) - 1 for block in self.blocks)

  def rows_needed(self, length: int) -> int:
    """Packed rows of `length` the fullest block needs (first fit, largest tree first)."""
    return max((len(assembly.first_fit_rows([len(t.nodes) for t in block.trees], length))
                for block in self.blocks), default=0)


def _sequences(segment_ids: np.ndarray) -> list[tuple[int, int]]:
  """(first column, stop) of each segment of one unshared row (consecutive columns of one non-zero id)."""
  out = []
  change = np.flatnonzero(np.diff(segment_ids, prepend=0, append=0))
  for start, stop in zip(change[:-1], change[1:]):
    if segment_ids[start]:
      out.append((int(start), int(stop)))
  return out


def prefix_trees(batch: assembly.Batch, block_rows: int) -> PrefixTrees:
  """The prefix trees of each block of `block_rows` consecutive rows of `batch` (numpy)."""
  rows = batch.tokens.shape[0]
  if block_rows < 1 or rows % block_rows:
    raise ValueError(f"block_rows={block_rows}: must divide the batch's {rows} rows")
  blocks = []
  for first in range(0, rows, block_rows):
    trie, sequences = _Trie(), []
    for row in range(first, first + block_rows):
      for start, stop in _sequences(batch.segment_ids[row]):
        if not np.array_equal(batch.positions[row, start:stop], np.arange(stop - start)):
          raise ValueError(f"row {row}: the sequence at columns {start}:{stop} does not count its positions from 0 "
                           "(assembled batches do); a tree slot's position is its depth")
        sequences.append((row, start, trie.insert(_keys(batch, row, start, stop), row, start)))
    blocks.append(_Block(trie, trie.trees(), sequences))
  return PrefixTrees(blocks, block_rows)


def pack(batch: assembly.Batch, trees: PrefixTrees, *, length: int, packed_rows: int) -> SharedPrefix:
  """Lays `trees` out as `packed_rows` rows of `length` per block, with the maps back onto `batch`."""
  if trees.largest > length:
    raise ValueError(f"a prefix tree of {trees.largest} tokens does not fit packed rows of length={length}")
  p = len(trees.blocks) * packed_rows
  zeros = lambda dtype: np.zeros((p, length), dtype)
  out = dict(tokens=zeros(np.int32), positions=zeros(np.int32), segment_ids=zeros(np.int32),
             segment_ends=zeros(np.int32), targets=zeros(np.int32), target_mask=zeros(bool))
  if batch.sampling_thresholds is not None:
    out["thresholds"] = np.full((p, length), np.nan, np.float32)
  if batch.expert_routes is not None:
    out["routes"] = np.full((p, length) + batch.expert_routes.shape[2:], -1, batch.expert_routes.dtype)
  slot = np.full(batch.tokens.shape, -1, np.int32)
  predictor = np.full(batch.tokens.shape, -1, np.int32)
  t_unshared = batch.tokens.shape[1]
  for j, block in enumerate(trees.blocks):
    layout = assembly.first_fit_rows([len(tree.nodes) for tree in block.trees], length)
    if len(layout) > packed_rows:
      raise ValueError(f"block {j} needs {len(layout)} packed rows > packed_rows={packed_rows}")
    node_slot = {}
    for k, members in enumerate(layout):
      row, col, base = j * packed_rows + k, 0, 0
      for tree in (block.trees[i] for i in members):
        for node, seg in zip(tree.nodes, tree.segment):
          r, c = block.trie.cell[node]
          out["tokens"][row, col] = batch.tokens[r, c]
          out["positions"][row, col] = block.trie.position[node]
          out["segment_ids"][row, col] = base + seg + 1
          out["segment_ends"][row, col] = base + tree.segment_end[seg] + 1
          if c + 1 < t_unshared and batch.segment_ids[r, c + 1] == batch.segment_ids[r, c]:
            out["targets"][row, col] = batch.tokens[r, c + 1]
            if "thresholds" in out:
              out["thresholds"][row, col] = batch.sampling_thresholds[r, c + 1]
          if "routes" in out:
            out["routes"][row, col] = batch.expert_routes[r, c]
          node_slot[node] = k * length + col
          col += 1
        base += len(tree.segment_end)
    for r, start, path in block.sequences:
      slots = np.asarray([node_slot[n] for n in path], np.int32)
      slot[r, start:start + len(path)] = slots
      predictor[r, start + 1:start + len(path)] = slots[:-1]
      mask = batch.loss_mask[r, start + 1:start + len(path)]
      local = slots[:-1][mask]
      out["target_mask"][j * packed_rows + local // length, local % length] = True
  return SharedPrefix(**out, slot=slot, predictor=predictor, block_rows=trees.block_rows, packed_rows=packed_rows)


def measure(trees: PrefixTrees, batch_shape: tuple[int, int], *, length: int, packed_rows: int,
            real_tokens: int) -> Sharing:
  """What packing `trees` at (`packed_rows` per block, `length`) computes against the unshared `batch_shape`."""
  rows, t = batch_shape
  packed = len(trees.blocks) * packed_rows
  return Sharing(tokens_unshared=real_tokens, tokens_computed=trees.tokens, slots_unshared=rows * t,
                 slots_computed=packed * length, scores_unshared=rows * t * t, scores_computed=packed * length**2)


def packed_lengths(limit: int) -> tuple[int, ...]:
  """The packed rows' lengths a run compiles for (as the update batch's: `buckets.batch_lengths`), up to
  `limit`: the batch's length times a block's rows, the most tokens a block holds."""
  return buckets_lib.batch_lengths(limit)


def packed_rows_for(needed: int) -> int:
  """The packed rows per block a run compiles for: `needed` rounded up to a power of two (few shapes)."""
  return 1 << max(needed - 1, 0).bit_length()
