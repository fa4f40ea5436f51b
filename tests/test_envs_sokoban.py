"""Sokoban: pushes, the breadth-first solver (shortest, and None when unsolvable), splits by room, anchor keys."""

import itertools

import pytest

import envs
from envs.builtin import sokoban

ROOM = ("######", "#____#", "#____#", "#____#", "######")


def test_pushes_move_boxes_and_walls_stop_them():
  floor = sokoban._floor(ROOM)
  boxes = frozenset({(2, 2)})
  assert sokoban.push(floor, (2, 1), boxes, "right") == ((2, 2), frozenset({(2, 3)}))
  assert sokoban.push(floor, (2, 3), frozenset({(2, 4)}), "right") == ((2, 3), frozenset({(2, 4)}))  # wall
  two = frozenset({(2, 2), (2, 3)})
  assert sokoban.push(floor, (2, 1), two, "right") == ((2, 1), two)  # two boxes in a row do not move
  assert sokoban.push(floor, (1, 1), boxes, "up") == ((1, 1), boxes)


def test_solver_is_shortest_against_brute_force_and_finds_no_solution_for_a_cornered_box():
  player, box, goal = (3, 1), (2, 2), (1, 4)
  path = sokoban.solve(ROOM, player, [box], [goal])
  floor = sokoban._floor(ROOM)

  def solves(moves):
    p, b = player, frozenset({box})
    for m in moves:
      p, b = sokoban.push(floor, p, b, m)
    return b == {goal}

  assert solves(path)
  shortest = next(n for n in range(1, len(path) + 1)
                  if any(solves(ms) for ms in itertools.product(sokoban.MOVES, repeat=n)))
  assert len(path) == shortest
  assert sokoban.solve(ROOM, (2, 2), [(1, 1)], [(3, 4)]) is None  # a box in a corner never moves again
  assert sokoban.solve(ROOM, player, [box], [goal], max_moves=len(path) - 1) is None


def test_episode_rewards_progress_and_outcome_and_names_states_by_position():
  task = sokoban.tasks("train", 1, 3)[0]
  env = sokoban.SokobanEnv()
  first = env.reset(task, 0)
  assert first.text == sokoban.describe(task) and first.text.count("$") + first.text.count("*") == 1
  results = [env.step(a) for a in sokoban.demo(task)]
  last = results[-1]
  assert last.done and last.verdict.passed and last.reward_components == {"progress": 0.1, "outcome": 1.0}
  assert all(r.reward == 0.0 for r in results[:-1])
  # Back and forth returns to the same anchor state; a bumped wall leaves it unchanged.
  env.reset(task, 0)
  keys = [env.step(f"move {m}").observation.state_key for m in ("up", "down", "up", "down")]
  assert keys[0] == keys[2] and keys[1] == keys[3]
  with pytest.raises(ValueError, match="only 0 of 1 .*widen the move range"):
    sokoban.tasks("train", 1, 0, min_moves=60, max_moves=64)


def test_splits_use_rooms_far_apart():
  rooms = sokoban.rooms(7, 4, 100)
  walls = [frozenset((r, c) for r, row in enumerate(x) for c, ch in enumerate(row) if ch == "#") for x in rooms]
  split = [sokoban.SPLIT_OF_LAYOUT[k % 10] for k in range(100)]
  for i, j in itertools.combinations(range(100), 2):
    if split[i] != split[j]:
      assert len(walls[i] ^ walls[j]) >= sokoban.SEPARATION
  layouts = {s: {t.payload["layout"] for t in sokoban.tasks(s, 100, 0)} for s in envs.SPLITS}
  assert all(sokoban.SPLIT_OF_LAYOUT[k % 10] == s for s, ks in layouts.items() for k in ks)


def test_the_generators_lower_bound_never_exceeds_a_shortest_solution():
  """`lower_bound` lets the task generator skip hopeless draws without a search: it must never be above the true
  shortest solution (then it would drop solvable tasks), and it should prune (else it is worth nothing)."""
  import random
  rng = random.Random(0)
  rooms = sokoban.rooms(7, 4, 20)
  pruned = checked = 0
  for _ in range(400):
    rows = rooms[rng.randrange(len(rooms))]
    boxes = rng.choice((1, 2))
    cells = rng.sample(sorted(sokoban._floor(rows)), 2 * boxes + 1)
    player, box_cells, goals = cells[0], cells[1:1 + boxes], cells[1 + boxes:]
    bound = sokoban.lower_bound(player, box_cells, goals)
    path = sokoban.solve(rows, player, box_cells, goals, max_moves=12)
    if path is not None:
      checked += 1
      assert bound <= len(path), (rows, player, box_cells, goals, bound, path)
    pruned += bound > 6
  assert checked > 30 and pruned > 100
