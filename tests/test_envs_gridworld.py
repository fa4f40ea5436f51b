"""Gridworld's generated rooms (`tasks(..., size=N)`): splits by room, path lengths, demos, default unchanged."""

import random

import pytest

import envs
from envs.builtin import gridworld, sokoban
from jaxagent.tasks import contamination


def test_default_tasks_are_the_built_in_layouts_drawn_as_before():
  for split in envs.SPLITS:
    rng, layouts = random.Random(f"grid:{split}:3"), gridworld.SPLIT_LAYOUTS[split]
    expected = []
    for i in range(12):
      layout = layouts[i % len(layouts)]
      expected.append((layout, *rng.sample(gridworld._free(gridworld.LAYOUTS[layout]), 2)))
    got = [(t.payload["layout"], tuple(t.payload["start"]), tuple(t.payload["goal"]))
           for t in gridworld.tasks(split, 12, 3)]
    assert got == expected and all("rows" not in t.payload for t in gridworld.tasks(split, 12, 3))


def test_generated_rooms_split_by_layout_and_keep_the_move_range():
  by_split = {s: gridworld.tasks(s, 60, 1, size=6, walls=6, min_moves=4, max_moves=8) for s in envs.SPLITS}
  layouts = {s: {t.payload["layout"] for t in ts} for s, ts in by_split.items()}
  assert all(sokoban.SPLIT_OF_LAYOUT[k % 10] == s for s, ks in layouts.items() for k in ks)
  assert len(layouts["train"]) > 20
  for task in by_split["eval"]:
    rows = task.payload["rows"]
    assert len(rows) == 6 and all(len(r) == 6 for r in rows) and sum(r.count("#") for r in rows) == 6
    assert 4 <= len(gridworld.demo(task)) <= 8
  env = gridworld.GridEnv()
  for task in by_split["train"][:10]:
    first = env.reset(task, 0)
    assert first.text == gridworld.describe(task) and len(first.text.splitlines()) == 6
    results = [env.step(a) for a in gridworld.demo(task)]
    assert results[-1].done and results[-1].verdict.passed and not any(r.done for r in results[:-1])
  report = contamination.check(gridworld.tasks("train", 1000, 0, size=6, walls=6),
                               gridworld.tasks("eval", 100, 1, size=6, walls=6), describe=gridworld.describe)
  assert report.contaminated == 0, report.matches[:3]


def test_generated_room_options_are_checked():
  with pytest.raises(ValueError, match="min_moves=9, max_moves=3"):
    gridworld.tasks("train", 1, 0, size=6, min_moves=9, max_moves=3)
  with pytest.raises(ValueError, match="layouts=5"):
    gridworld.tasks("train", 1, 0, size=6, layouts=5)
  with pytest.raises(ValueError, match="only 0 of 2"):
    gridworld.tasks("train", 2, 0, size=6, walls=6, min_moves=30, max_moves=40)
