"""A small text gridworld: walk `A` to `G` around walls `#` with `move up|down|left|right`.

The observation is the grid, one row per line. Splits are isolated by template (wall layout): layouts 0-3
train, 4 tune, 5-6 eval. Start and goal cells come from the task.

Larger grids: `tasks(..., size=7)` draws `layouts` rooms of `size`x`size` cells with `walls` walls from Sokoban's
room generator (`envs.builtin.sokoban.rooms`: connected floor, splits by layout number k % 10, held-out rooms
`SEPARATION` cells from every train room) and keeps start/goal pairs `min_moves`..`max_moves` moves apart; the room
travels in the task's payload (`rows`).
"""

from __future__ import annotations

import collections
import random

from envs.builtin import sokoban
from envs._api import (COMPLETED, ActionParser, Call, Env, EnvSpec, InvalidAction, Observation, StepResult,
                       Task, Verdict, Verifier, source_version, Tool)

LAYOUTS = (
    (".....", ".#...", ".#.#.", "...#.", "....."),
    (".....", "..#..", "..#..", "..#..", "....."),
    (".....", ".###.", ".....", ".###.", "....."),
    ("..#..", "..#..", ".....", ".##..", "....."),
    (".....", "#.##.", ".....", ".##.#", "....."),
    ("...#.", ".#.#.", ".#...", ".###.", "....."),
    (".#...", ".#.#.", "...#.", "##.#.", "....."),
)
SPLIT_LAYOUTS = {"train": (0, 1, 2, 3), "tune": (4,), "eval": (5, 6)}
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _free(layout):
  return [(r, c) for r, row in enumerate(layout) for c, ch in enumerate(row) if ch == "."]


def shortest_path(layout, start, goal) -> list[str]:
  prev = {tuple(start): None}
  q = collections.deque([tuple(start)])
  while q:
    cur = q.popleft()
    if cur == tuple(goal):
      break
    for name, (dr, dc) in MOVES.items():
      nxt = (cur[0] + dr, cur[1] + dc)
      if 0 <= nxt[0] < len(layout) and 0 <= nxt[1] < len(layout[0]) and layout[nxt[0]][nxt[1]] == "." \
          and nxt not in prev:
        prev[nxt] = (cur, name)
        q.append(nxt)
  path, cur = [], tuple(goal)
  while prev[cur] is not None:
    cur, name = prev[cur]
    path.append(name)
  return path[::-1]


class GridVerifier(Verifier):
  version = "grid-goal-v1"

  def score(self, task: Task, final) -> Verdict:
    passed = list(final) == list(task.payload["goal"])
    return Verdict(passed, 1.0 if passed else 0.0, dict(position=list(final)), self.version)


class GridEnv(Env):
  name = "gridworld"
  description = "text gridworld, reach G: `move up|down|left|right`"
  parser = ActionParser(tools=(
      Tool.with_arg("move", "Move the agent A one cell; the reply is the new grid.", "direction",
                    "up, down, left or right"),), max_chars=16)

  def __init__(self, max_turns: int = 24, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = GridVerifier()

  def _render(self) -> str:
    rows = [list(r) for r in _rows(self.task)]
    g = self.task.payload["goal"]
    rows[g[0]][g[1]] = "G"
    rows[self.pos[0]][self.pos[1]] = "A"
    return "\n".join("".join(r) for r in rows)

  def _reset(self, task: Task, seed: int) -> str:
    self.pos = list(task.payload["start"])
    return self._render()

  def _step(self, call: Call) -> StepResult:
    if call.arg not in MOVES:
      raise InvalidAction(f"move {call.arg[:16]!r}: use one of {' '.join(MOVES)}")
    layout = _rows(self.task)
    dr, dc = MOVES[call.arg]
    r, c = self.pos[0] + dr, self.pos[1] + dc
    if 0 <= r < len(layout) and 0 <= c < len(layout[0]) and layout[r][c] == ".":
      self.pos = [r, c]
    if self.pos == list(self.task.payload["goal"]):
      v = self.verifier.verify(self.task, self.pos)
      return StepResult(Observation(self._render()), {"outcome": v.reward}, True, COMPLETED, verdict=v)
    return StepResult(Observation(self._render()), {}, False, None, {})

  def state_key(self) -> str:
    """Where A stands (layout and goal are the task's): equal keys, equal futures."""
    p = self.task.payload
    return f"grid:{p['layout']}:{tuple(p['goal'])}:{tuple(self.pos)}"

  def snapshot(self):
    return dict(turn=self.turn, done=self.done, pos=list(self.pos))

  def restore(self, state) -> None:
    self.turn, self.done, self.pos = int(state["turn"]), bool(state["done"]), list(state["pos"])


def describe(task: Task) -> str:
  """The grid with the start `A` and goal `G`: what the agent first sees (a payload of three small numbers
  says little about how alike two tasks are)."""
  rows = [list(r) for r in _rows(task)]
  (gr, gc), (sr, sc) = task.payload["goal"], task.payload["start"]
  rows[gr][gc], rows[sr][sc] = "G", "A"
  return "\n".join("".join(r) for r in rows)


def _rows(task: Task) -> tuple[str, ...]:
  """The task's room: its own rows (a generated layout) or a built-in one."""
  return tuple(task.payload["rows"]) if "rows" in task.payload else LAYOUTS[task.payload["layout"]]


def tasks(split: str, n: int, seed: int = 0, *, size: int | None = None, walls: int = 8, layouts: int = 100,
          min_moves: int = 1, max_moves: int | None = None) -> list[Task]:
  """`n` tasks of `split` (deterministic in (split, seed, options)).

  Args:
    size: None: the seven built-in 5x5 layouts; else generated `size`x`size` rooms (`rooms` of sokoban).
    walls, layouts: a generated room's walls, and how many distinct rooms (8/10 train, 1/10 tune, 1/10 eval).
    min_moves, max_moves: a task is kept when its shortest path has this many moves (None: no upper bound).
  """
  if split not in SPLIT_LAYOUTS:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_LAYOUTS)}")
  if not 1 <= min_moves <= (max_moves or min_moves):
    raise ValueError(f"min_moves={min_moves}, max_moves={max_moves}: need 1 <= min_moves <= max_moves")
  if size is None:
    rooms, mine = LAYOUTS, SPLIT_LAYOUTS[split]
    rng = random.Random(f"grid:{split}:{seed}")  # the move range only rejects draws: default tasks as before
  else:
    if layouts < 10:
      raise ValueError(f"layouts={layouts}: must be >= 10 (every split needs a layout)")
    # sokoban's rooms have a border wall: a size+2 room inside its border is a size x size grid
    rooms = tuple(tuple(row[1:-1].replace("_", ".") for row in room[1:-1])
                  for room in sokoban.rooms(size + 2, walls, layouts))
    mine = [k for k in range(layouts) if sokoban.SPLIT_OF_LAYOUT[k % 10] == split]
    rng = random.Random(f"grid:{split}:{seed}:{size}:{walls}:{layouts}:{min_moves}:{max_moves}")
  version = (source_version(tasks, extra=repr(LAYOUTS)) if size is None
             else source_version(tasks, sokoban.rooms.__wrapped__, extra=f"{size}:{walls}:{layouts}"))
  out, attempts = [], 0
  while len(out) < n:
    attempts += 1
    if attempts > 200 * n + 1000:
      raise ValueError(f"gridworld: only {len(out)} of {n} {split} tasks {min_moves}..{max_moves} moves apart "
                       f"after {attempts - 1} draws (size={size}): widen the move range")
    layout = mine[len(out) % len(mine)] if size is None else rng.choice(mine)
    start, goal = rng.sample(_free(rooms[layout]), 2)
    moves = len(shortest_path(rooms[layout], start, goal))
    if not min_moves <= moves <= (max_moves or moves):
      continue
    payload = dict(layout=layout, start=list(start), goal=list(goal))
    if size is not None:
      payload["rows"] = list(rooms[layout])
    out.append(Task(id=f"grid-{'' if size is None else f'{size}-'}{layout}-{start[0]}{start[1]}-"
                       f"{goal[0]}{goal[1]}", split=split, payload=payload, version=version))
  return out


def demo(task: Task, seed: int = 0) -> list[str]:
  p = task.payload
  return [f"move {m}" for m in shortest_path(_rows(task), p["start"], p["goal"])]


SPEC = EnvSpec(name="gridworld", description=GridEnv.description, make=GridEnv, tasks=tasks, demo=demo,
               version_sources=(GridEnv,), describe=describe)
