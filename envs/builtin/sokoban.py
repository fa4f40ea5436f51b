"""Sokoban: push every box `$` onto a goal `.` with `move up|down|left|right` (the RAGEN / GiGPO benchmark family).

The observation is the room inside its border wall in XSB letters, one row per line: `#` wall, `_` floor, `.` goal, `$` box, `*` box on
a goal, `@` the player, `+` the player on a goal. Walking into a box pushes it when the cell behind it is free;
a push into a corner that is not a goal makes the task unsolvable (the episode runs on to its turn limit).

Tasks: a room is a layout (border and interior walls, distinct rooms numbered in a fixed order); a task places the player,
the boxes and the goals on its floor and is kept only when `solve` (breadth-first search over (player, boxes)
states) finds a solution of `min_moves`..`max_moves` moves: the reference solution and the solvability filter
in one. Splits are isolated by layout: layout k belongs to train when k % 10 < 8, tune when 8, eval when 9.

Rewards: `outcome` 1 when every box is on a goal (the verifier's pass); `progress` ±0.1 when a push puts a box
on a goal / takes one off. Anchor states (`state_key`): the player's cell and the boxes' cells.
"""

from __future__ import annotations

import collections
import functools
import random
from typing import Iterable

from envs._api import (COMPLETED, ActionParser, Call, Env, EnvSpec, InvalidAction, Observation, StepResult,
                       Task, Verdict, Verifier, source_version, Tool)

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
SPLIT_OF_LAYOUT = {**{r: "train" for r in range(8)}, 8: "tune", 9: "eval"}  # by layout number % 10
PROGRESS = 0.1
MAX_SEARCH_STATES = 200_000  # the solver's bound: a room this generator draws has far fewer states

Cell = tuple[int, int]


SEPARATION = 6  # cells in which a room differs from every room of another split (three walls moved, at least)


@functools.lru_cache(maxsize=32)
def rooms(size: int, walls: int, count: int) -> tuple[tuple[str, ...], ...]:
  """`count` rooms (layouts 0..count-1): a `size`×`size` grid, its border walls and `walls` interior walls with
  a connected floor (rows of `#` and `_`), drawn in a fixed order. Layout k's split is `SPLIT_OF_LAYOUT[k % 10]`,
  and a drawn room is kept only if it differs in >= `SEPARATION` cells from every room kept for another split:
  no held-out room is a train room with one wall moved (`jaxagent tasks check` finds no near-duplicate)."""
  if size < 4:
    raise ValueError(f"size={size}: must be >= 4 (a border and a 2x2 floor)")
  inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
  if not 0 <= walls <= len(inner) - 3:
    raise ValueError(f"walls={walls}: must be in 0..{len(inner) - 3} for size {size}")
  rng = random.Random(f"sokoban-rooms:{size}:{walls}")
  kept: list[frozenset] = []
  for _ in range(200 * count + 1000):
    if len(kept) == count:
      break
    blocked = frozenset(rng.sample(inner, walls))
    floor = [p for p in inner if p not in blocked]
    if len(_reachable(set(floor), floor[0], ())) != len(floor) or blocked in kept:
      continue
    split = SPLIT_OF_LAYOUT[len(kept) % 10]
    if all(len(blocked ^ other) >= SEPARATION for k, other in enumerate(kept) if SPLIT_OF_LAYOUT[k % 10] != split):
      kept.append(blocked)
  if len(kept) < count:
    raise ValueError(f"layouts={count}: only {len(kept)} rooms of size {size} with {walls} interior walls are "
                     f"{SEPARATION} cells apart between splits: ask for fewer layouts or a larger room")
  return tuple(tuple("".join("#" if (r, c) in blocked or not (0 < r < size - 1 and 0 < c < size - 1) else "_"
                             for c in range(size)) for r in range(size)) for blocked in kept)


def _floor(rows: Iterable[str]) -> frozenset[Cell]:
  return _floor_of(tuple(rows))


@functools.lru_cache(maxsize=1024)
def _floor_of(rows: tuple[str, ...]) -> frozenset[Cell]:
  return frozenset((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch != "#")


def lower_bound(player: Cell, boxes: Iterable[Cell], goals: Iterable[Cell]) -> int:
  """Moves no solution can take fewer of: every push moves one box one cell, so a box needs at least its
  Manhattan distance to the nearest goal in pushes; and before the first push the player walks at least to a
  cell next to a box that must move. The task generator skips draws whose bound exceeds `max_moves` before
  searching: the same tasks come out, without a breadth-first search for each hopeless draw."""
  goals = list(goals)
  far = [(b, min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in goals)) for b in boxes]
  pushes = sum(d for _, d in far)
  if not pushes:
    return 0
  return pushes + min(abs(player[0] - b[0]) + abs(player[1] - b[1]) for b, d in far if d) - 1


def _reachable(floor: set[Cell], start: Cell, boxes: Iterable[Cell]) -> set[Cell]:
  blocked, seen, q = set(boxes), {start}, collections.deque([start])
  while q:
    r, c = q.popleft()
    for dr, dc in MOVES.values():
      nxt = (r + dr, c + dc)
      if nxt in floor and nxt not in blocked and nxt not in seen:
        seen.add(nxt)
        q.append(nxt)
  return seen


def push(floor: set[Cell], player: Cell, boxes: frozenset[Cell], move: str) -> tuple[Cell, frozenset[Cell]]:
  """One move: the new (player, boxes); unchanged when a wall or an unmovable box is in the way."""
  dr, dc = MOVES[move]
  nxt = (player[0] + dr, player[1] + dc)
  if nxt not in floor:
    return player, boxes
  if nxt in boxes:
    beyond = (nxt[0] + dr, nxt[1] + dc)
    if beyond not in floor or beyond in boxes:
      return player, boxes
    return nxt, (boxes - {nxt}) | {beyond}
  return nxt, boxes


def solve(rows: Iterable[str], player: Cell, boxes: Iterable[Cell], goals: Iterable[Cell], *,
          max_moves: int = 64) -> list[str] | None:
  """A shortest solution (moves) by breadth-first search over (player, boxes), or None when there is none
  within `max_moves` moves (or `MAX_SEARCH_STATES` states)."""
  floor, goals = _floor(rows), frozenset(map(tuple, goals))
  start = (tuple(player), frozenset(map(tuple, boxes)))
  prev: dict = {start: None}
  frontier = [start]
  for _ in range(max_moves + 1):
    nxt_frontier = []
    for state in frontier:
      if state[1] == goals:
        path = []
        while prev[state] is not None:
          state, move = prev[state]
          path.append(move)
        return path[::-1]
      for move in MOVES:
        nxt = push(floor, *state, move)
        if nxt not in prev:
          prev[nxt] = (state, move)
          nxt_frontier.append(nxt)
      if len(prev) > MAX_SEARCH_STATES:
        return None
    frontier = nxt_frontier
  return None


def render(rows: Iterable[str], player: Cell, boxes: Iterable[Cell], goals: Iterable[Cell]) -> str:
  """The room inside its border (the border walls tell nothing and cost tokens every turn)."""
  grid = [list(r) for r in rows]
  goals, boxes = set(map(tuple, goals)), set(map(tuple, boxes))
  for r, c in goals:
    grid[r][c] = "."
  for r, c in boxes:
    grid[r][c] = "*" if (r, c) in goals else "$"
  grid[player[0]][player[1]] = "+" if tuple(player) in goals else "@"
  return "\n".join("".join(r[1:-1]) for r in grid[1:-1])


class SokobanVerifier(Verifier):
  version = "sokoban-boxes-on-goals-v1"

  def score(self, task: Task, final) -> Verdict:
    boxes = sorted(map(list, final))
    passed = boxes == sorted(map(list, task.payload["goals"]))
    return Verdict(passed, 1.0 if passed else 0.0, dict(boxes=boxes), self.version)


class SokobanEnv(Env):
  name = "sokoban"
  description = "push every box onto a goal: `move up|down|left|right`"
  parser = ActionParser(tools=(
      Tool.with_arg("move", "Move the player @ one cell, pushing a box $ in the way; the reply is the new room.",
                    "direction", "up, down, left or right"),), max_chars=16)

  def __init__(self, max_turns: int = 12, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = SokobanVerifier()

  def _render(self) -> str:
    p = self.task.payload
    return render(p["room"], self.player, self.boxes, p["goals"])

  def _reset(self, task: Task, seed: int) -> str:
    p = task.payload
    self.floor = _floor(p["room"])
    self.goals = frozenset(map(tuple, p["goals"]))
    self.player, self.boxes = tuple(p["player"]), frozenset(map(tuple, p["boxes"]))
    return self._render()

  def _step(self, call: Call) -> StepResult:
    if call.arg not in MOVES:
      raise InvalidAction(f"move {call.arg[:16]!r}: use one of {' '.join(MOVES)}")
    before = len(self.boxes & self.goals)
    self.player, self.boxes = push(self.floor, self.player, self.boxes, call.arg)
    delta = len(self.boxes & self.goals) - before
    components = {"progress": PROGRESS * delta} if delta else {}
    if self.boxes == self.goals:
      v = self.verifier.verify(self.task, sorted(self.boxes))
      return StepResult(Observation(self._render()), {**components, "outcome": v.reward}, True, COMPLETED,
                        verdict=v)
    return StepResult(Observation(self._render()), components, False, None, {})

  def state_key(self) -> str:
    """The player's cell and the boxes' cells (the room and goals are the task's)."""
    return f"sokoban:{self.player}:{sorted(self.boxes)}"

  def snapshot(self):
    return dict(turn=self.turn, done=self.done, player=list(self.player), boxes=sorted(map(list, self.boxes)))

  def restore(self, state) -> None:
    self.turn, self.done = int(state["turn"]), bool(state["done"])
    self.player, self.boxes = tuple(state["player"]), frozenset(map(tuple, state["boxes"]))


def describe(task: Task) -> str:
  """The first room the agent sees."""
  p = task.payload
  return render(p["room"], p["player"], p["boxes"], p["goals"])


def tasks(split: str, n: int, seed: int = 0, *, size: int = 7, boxes: int = 1, walls: int = 4, layouts: int = 100,
          min_moves: int = 2, max_moves: int = 6) -> list[Task]:
  """`n` solvable tasks of `split` (deterministic in (split, seed, options)).

  Args:
    size: the room's side, border included.
    boxes: boxes (and goals) per task.
    walls: interior walls per room.
    layouts: distinct rooms, layout numbers 0..layouts-1 (8/10 of them train, 1/10 tune, 1/10 eval).
    min_moves, max_moves: a task is kept when its shortest solution has this many moves.
  """
  if split not in ("train", "tune", "eval"):
    raise ValueError(f"split={split!r}: not one of ['eval', 'train', 'tune']")
  if layouts < 10:
    raise ValueError(f"layouts={layouts}: must be >= 10 (every split needs a layout)")
  if not 1 <= min_moves <= max_moves:
    raise ValueError(f"min_moves={min_moves}, max_moves={max_moves}: need 1 <= min_moves <= max_moves")
  if boxes < 1:
    raise ValueError(f"boxes={boxes}: must be >= 1")
  mine = [k for k in range(layouts) if SPLIT_OF_LAYOUT[k % 10] == split]
  rng = random.Random(f"sokoban:{split}:{seed}:{size}:{boxes}:{walls}:{layouts}:{min_moves}:{max_moves}")
  all_rooms = rooms(size, walls, layouts)
  version = source_version(tasks, solve, push,
                           extra=f"{size}:{boxes}:{walls}:{layouts}:{min_moves}:{max_moves}")
  out, attempts = [], 0
  while len(out) < n:
    attempts += 1
    if attempts > 200 * n + 1000:
      raise ValueError(f"sokoban: only {len(out)} of {n} {split} tasks solvable in {min_moves}..{max_moves} "
                       f"moves after {attempts - 1} draws (size={size}, boxes={boxes}, walls={walls}): widen "
                       "the move range or the room")
    k = rng.choice(mine)
    rows = all_rooms[k]
    floor = sorted(_floor(rows))
    if len(floor) < 2 * boxes + 1:
      continue
    cells = rng.sample(floor, 2 * boxes + 1)
    player, box_cells, goals = cells[0], cells[1:1 + boxes], cells[1 + boxes:]
    if lower_bound(player, box_cells, goals) > max_moves:
      continue
    path = solve(rows, player, box_cells, goals, max_moves=max_moves)
    if path is None or len(path) < min_moves:
      continue
    tid = f"sokoban-{size}-{k}-{player[0]}{player[1]}-" + "".join(f"{r}{c}" for r, c in box_cells + goals)
    out.append(Task(id=tid, split=split, version=version,
                    payload=dict(layout=k, room=list(rows), player=list(player),
                                 boxes=[list(b) for b in box_cells], goals=[list(g) for g in goals],
                                 moves=len(path))))
  return out


def demo(task: Task, seed: int = 0) -> list[str]:
  """The shortest solution (`solve`)."""
  p = task.payload
  return [f"move {m}" for m in solve(p["room"], p["player"], p["boxes"], p["goals"], max_moves=64)]


SPEC = EnvSpec(name="sokoban", description=SokobanEnv.description, make=SokobanEnv, tasks=tasks, demo=demo,
               version_sources=(SokobanEnv,), describe=describe)
