"""A small text gridworld: walk `A` to `G` around walls `#` with `move up|down|left|right`.

The observation is the grid, one row per line. Splits are isolated by template (wall layout): layouts 0-3
train, 4 tune, 5-6 eval. Start and goal cells come from the task.
"""

from __future__ import annotations

import collections
import random

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
  description = "5x5 text gridworld, reach G: `move up|down|left|right`"
  parser = ActionParser(tools=(
      Tool.with_arg("move", "Move the agent A one cell; the reply is the new grid.", "direction",
                    "up, down, left or right"),), max_chars=16)

  def __init__(self, max_turns: int = 24, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = GridVerifier()

  def _render(self) -> str:
    rows = [list(r) for r in LAYOUTS[self.task.payload["layout"]]]
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
    layout = LAYOUTS[self.task.payload["layout"]]
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
  rows = [list(r) for r in LAYOUTS[task.payload["layout"]]]
  (gr, gc), (sr, sc) = task.payload["goal"], task.payload["start"]
  rows[gr][gc], rows[sr][sc] = "G", "A"
  return "\n".join("".join(r) for r in rows)


def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
  if split not in SPLIT_LAYOUTS:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_LAYOUTS)}")
  rng = random.Random(f"grid:{split}:{seed}")
  version = source_version(tasks, extra=repr(LAYOUTS))
  out = []
  for i in range(n):
    layout = SPLIT_LAYOUTS[split][i % len(SPLIT_LAYOUTS[split])]
    start, goal = rng.sample(_free(LAYOUTS[layout]), 2)
    out.append(Task(id=f"grid-{layout}-{start[0]}{start[1]}-{goal[0]}{goal[1]}", split=split,
                    payload=dict(layout=layout, start=list(start), goal=list(goal)), version=version))
  return out


def demo(task: Task, seed: int = 0) -> list[str]:
  p = task.payload
  return [f"move {m}" for m in shortest_path(LAYOUTS[p["layout"]], p["start"], p["goal"])]


SPEC = EnvSpec(name="gridworld", description=GridEnv.description, make=GridEnv, tasks=tasks, demo=demo,
               version_sources=(GridEnv,), describe=describe)
