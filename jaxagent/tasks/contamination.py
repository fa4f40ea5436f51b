"""Near-duplicate tasks between splits (docs/design.md §2.7: check contamination beyond exact match).

A task's text is what its env's `EnvSpec.describe` gives, else its payload as `path=value` lines in key order. Two tasks are near-duplicates when the Jaccard similarity of their character 5-gram sets
reaches a threshold, estimated with MinHash and found with an LSH index (`datasketch`), so checking M held-out
tasks against N train tasks costs O(N + M), not O(N·M). Exact duplicates (same text) are reported apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, Mapping, Sequence

import envs

SHINGLE = 5
NUM_PERM = 128


def task_text(task: envs.Task) -> str:
  """The payload as `path=value` lines in key order (nested keys dotted, list items by index): values alone
  would make different tasks look alike (gridworld's `4 1 4 1 4` vs `1 4 1 4 1`), keys alone all alike."""
  out: list[str] = []

  def walk(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
      for k in sorted(value):
        walk(value[k], f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
      for i, v in enumerate(value):
        walk(v, f"{path}.{i}")
    else:
      out.append(f"{path}={value if isinstance(value, str) else json.dumps(value)}")

  walk(task.payload, "")
  return "\n".join(out)


def shingles(text: str, n: int = SHINGLE) -> list[bytes]:
  """Character n-grams (the whole text when shorter than n)."""
  return sorted({text[i:i + n].encode() for i in range(max(1, len(text) - n + 1))})


@dataclasses.dataclass(frozen=True)
class Match:
  held_out: str        # task id
  train: str
  similarity: float    # estimated Jaccard (1.0 for an exact duplicate)
  exact: bool


@dataclasses.dataclass(frozen=True)
class Report:
  train: int
  held_out: int
  threshold: float
  matches: tuple[Match, ...]      # the closest train task of every contaminated held-out task

  @property
  def contaminated(self) -> int:
    return len(self.matches)

  @property
  def exact(self) -> int:
    return sum(m.exact for m in self.matches)

  @property
  def fraction(self) -> float:
    return self.contaminated / max(self.held_out, 1)

  def line(self) -> str:
    return (f"{self.contaminated}/{self.held_out} held-out tasks ({self.fraction:.1%}) have a near-duplicate among "
            f"{self.train} train tasks ({self.exact} exact; estimated Jaccard of character {SHINGLE}-grams >= "
            f"{self.threshold:g})")


def check(train: Sequence[envs.Task], held_out: Sequence[envs.Task], *, threshold: float = 0.8,
          num_perm: int = NUM_PERM, describe: Callable[[envs.Task], str] | None = None) -> Report:
  """Every held-out task with a train task at estimated Jaccard >= `threshold` (its closest one).

  `describe`: the env's text of a task (`EnvSpec.describe`); None: `task_text`.
  """
  text_of = describe or task_text
  from datasketch import MinHash, MinHashLSH  # only when checking
  if not 0 < threshold <= 1:
    raise ValueError(f"threshold={threshold}: must be in (0, 1]")
  digest = lambda text: hashlib.blake2b(text.encode(), digest_size=16).digest()
  train_texts = [text_of(t) for t in train]
  exact: dict[bytes, int] = {}
  for i, text in enumerate(train_texts):
    exact.setdefault(digest(text), i)
  held_texts = [text_of(t) for t in held_out]
  matches: list[Match] = []
  near: list[int] = []
  for j, text in enumerate(held_texts):
    i = exact.get(digest(text))
    if i is not None:
      matches.append(Match(held_out[j].id, train[i].id, 1.0, True))
    else:
      near.append(j)
  if near and train:
    train_h = MinHash.bulk([shingles(t) for t in train_texts], num_perm=num_perm)
    # Recall first: datasketch's default bands find a pair AT the threshold only ~40% of the time; these find
    # it ~99% of the time and let more dissimilar pairs through, which the estimate below then drops.
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.01, 0.99))
    with lsh.insertion_session() as session:
      for i, h in enumerate(train_h):
        session.insert(i, h, check_duplication=False)
    held_h = MinHash.bulk([shingles(held_texts[j]) for j in near], num_perm=num_perm)
    for j, h in zip(near, held_h):
      best = max(((h.jaccard(train_h[i]), i) for i in lsh.query(h)), default=None)
      if best is not None and best[0] >= threshold:
        matches.append(Match(held_out[j].id, train[best[1]].id, float(best[0]), False))
  return Report(train=len(train), held_out=len(held_out), threshold=threshold, matches=tuple(matches))

