"""The database env: templates build deterministic, valid databases; demos solve every split; splits are disjoint by
template; exploit probes score 0 (and would pass the obvious weaker verifier); bad tool inputs are refused by name;
observations are capped; no near-duplicate tasks between splits."""

import collections
import dataclasses
import json
import sqlite3

import pytest

import envs
from envs.builtin import database as db
from jaxagent.tasks import contamination


def _run(task, actions, *, heldout=False, max_turns=8):
  env = db.DatabaseEnv(max_turns=max_turns)
  env.score_heldout = heldout
  try:
    env.reset(task, 0)
    results = []
    for a in actions:
      results.append(env.step(a))
      if results[-1].done:
        break
    return results
  finally:
    env.close()


def test_registered_without_a_program_sandbox():
  spec = envs.get("database")
  assert spec is db.SPEC and not spec.needs_sandbox and spec.describe is db.describe and len(spec.version) == 12


@pytest.mark.parametrize("template", sorted(db.SCHEMAS))
def test_every_template_builds_a_valid_database_of_its_schema(template):
  for seed in range(12):
    conn = db.build(template, seed)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid")]
    assert tables == [t.name for t in db.SCHEMAS[template]]
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    for table in db.SCHEMAS[template]:
      cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{table.name}")')]
      assert tuple(cols) == table.names
      assert 5 <= conn.execute(f'SELECT COUNT(*) FROM "{table.name}"').fetchone()[0] <= 30, (template, seed, table)
  assert len(db.KINDS[template]) >= 4  # every kind is drawn and solved in test_demos_solve_every_task


@pytest.mark.parametrize("template", sorted(db.SCHEMAS))
def test_same_template_and_seed_give_the_same_database_bytes(template, tmp_path):
  for i in range(2):
    db.build(template, 1234, tmp_path / f"{i}.sqlite").close()
  assert (tmp_path / "0.sqlite").read_bytes() == (tmp_path / "1.sqlite").read_bytes()
  assert db.dump(db.build(template, 1234), template) == db.dump(db.build(template, 1234), template)
  assert db.dump(db.build(template, 1234), template) != db.dump(db.build(template, 1235), template)


def test_tasks_are_deterministic_unique_and_versioned():
  for split in envs.SPLITS:
    a, b = db.tasks(split, 40, 3), db.tasks(split, 40, 3)
    assert a == b and len({t.id for t in a}) == 40
    assert a != db.tasks(split, 40, 4)
    assert all(t.version == db.TASK_VERSION and t.split == split for t in a)
  assert len({(t.payload["template"], t.payload["db_seed"]) for t in db.tasks("train", 200, 0)}) > 150
  with pytest.raises(ValueError, match="split='test'"):
    db.tasks("test", 1, 0)


@pytest.mark.parametrize("split", envs.SPLITS)
def test_demos_solve_every_task(split):
  tasks = db.tasks(split, 56, 0)
  kinds = collections.Counter((t.payload["template"], t.payload["kind"]) for t in tasks)
  assert set(kinds) == {(t, k.name) for t in db.SPLIT_TEMPLATES[split] for k in db.KINDS[t]}
  for task in tasks:
    results = _run(task, db.demo(task, 0), heldout=True)
    last = results[-1]
    assert all(r.outcome is envs.Outcome.OK for r in results[:-1]), [r.observation.text for r in results]
    assert last.done and last.termination == envs.COMPLETED and last.reward_components["outcome"] == 1.0, (
        task.payload, last.verdict)
    assert last.verdict.passed and last.verdict.evidence["heldout"]["passed"], task.payload


def test_splits_are_disjoint_by_template():
  templates = {split: {t.payload["template"] for t in db.tasks(split, 40, 1)} for split in envs.SPLITS}
  assert templates == {split: set(ts) for split, ts in db.SPLIT_TEMPLATES.items()}
  assert not (templates["train"] & templates["tune"]) and not (templates["train"] & templates["eval"])
  assert not templates["tune"] & templates["eval"]


def test_reset_text_is_the_task_and_a_short_tool_hint():
  for split in envs.SPLITS:
    for task in db.tasks(split, 40, 0):
      env = db.SPEC.make()
      text = env.reset(task, 0).text
      env.close()
      assert text.startswith(task.payload["text"]) and "Tools:" in text and len(text) < 400
  assert db.SPEC.make().max_turns == 8


def test_the_episode_tree_holds_the_database_and_goes_with_close():
  task = db.tasks("train", 1, 0)[0]
  env = db.SPEC.make()
  env.reset(task, 0)
  path = env.db_path
  assert path.is_file() and path.parent == env.root
  env.close()
  assert not path.exists() and env.root is None


# ----------------------------------------------------------------------------------------------
# Verification.


def _solve_but(task, skip_last_op=False, extra=()):
  solution = db.plan(task)
  ops = list(solution.ops[:-1] if skip_last_op else solution.ops)
  return [db._op_action(op) for op in ops] + list(extra) + ["submit"]


def test_write_tasks_are_judged_by_the_final_database_with_a_diff():
  task = next(t for t in db.tasks("tune", 8, 0) if t.payload["kind"] == "move_stock")
  half = _run(task, _solve_but(task, skip_last_op=True))[-1].verdict  # the source is debited, not the target
  assert not half.passed and len(half.evidence["diff"]) == 1 and "stock id=" in half.evidence["diff"][0]
  assert "(want " in half.evidence["diff"][0]
  full = _run(task, _solve_but(task))[-1].verdict
  assert full.passed and full.evidence["diff"] == []


@pytest.mark.parametrize("kind, expected, good, bad", [
    ("int", 3, ["3", " 3 ", "+3"], ["3.0", "2 3 4", "three", "", "03x"]),
    ("money", db.Decimal("12.50"), ["12.5", "12.50", "$12.50", " 12.500 "], ["12.49", "12.5 13.5", "12,5x", "nan"]),
    ("text", "Ann Lee", ["Ann Lee", "ann  lee", " ANN LEE.", "'Ann Lee'"], ["Ann", "Ann Lee, Bo Ek", "AnnLee"]),
])
def test_answers_are_normalized_canonically(kind, expected, good, bad):
  assert all(db.answer_matches(kind, expected, g) for g in good)
  assert not any(db.answer_matches(kind, expected, b) for b in bad)
  assert not db.answer_matches(kind, expected, None)


def test_read_tasks_need_the_answer_and_an_unchanged_database():
  task = next(t for t in db.tasks("eval", 8, 0) if t.payload["kind"] == "revenue")
  kind, value = db.plan(task).answer
  assert _run(task, [f'answer value="{db.canonical(kind, value)}"'])[-1].verdict.passed
  assert not _run(task, ["submit"])[-1].verdict.passed
  heldout = _run(task, [f'answer value="${db.canonical(kind, value)}"'], heldout=True)[-1].verdict
  assert heldout.passed and not heldout.evidence["heldout"]["passed"]  # the strict verifier wants `12.50`


# ----------------------------------------------------------------------------------------------
# Exploit probes: 0 against the real verifier, > 0 against the obvious weaker one.


def _states(task, final):
  template = task.payload["template"]
  solution, conn = db.expected_state(task)
  fresh = db.dump(db.build(template, task.payload["db_seed"]), template)
  got = db._read_db(final["db"], template)[0]
  return solution, fresh, db.dump(conn, template), got


def _lax_no_wrong_change(task, final):  # every row that changed is as expected: doing nothing passes
  _, fresh, want, got = _states(task, final)
  return all(got[t].get(i) == want[t].get(i) for t in got for i in set(got[t]) | set(fresh[t])
             if got[t].get(i) != fresh[t].get(i))


def _lax_intended_rows(task, final):  # the rows the task names hold the wanted values; others unchecked
  solution, _, _, got = _states(task, final)
  for op in solution.ops:
    names = db.table_of(task.payload["template"], op["table"]).names
    rows = [got[op["table"]].get(op["id"])] if op["op"] == "update" else list(got[op["table"]].values())
    if not any(r is not None and all(r[names.index(k)] == v for k, v in op["values"].items()) for r in rows):
      return False
  return True


def _lax_old_values_gone(task, final):  # the target row no longer holds its old values (deleted counts)
  solution, fresh, _, got = _states(task, final)
  op = solution.ops[0]
  return got[op["table"]].get(op["id"]) != fresh[op["table"]][op["id"]]


def _lax_any_value(task, final):  # the expected value among the values given
  kind, value = db.plan(task).answer
  items = final["answer"].split(",") if kind == "text" else final["answer"].split()
  return any(db.answer_matches(kind, value, item) for item in items)


def _lax_answer_only(task, final):  # the answer alone, the database not compared
  return db.answer_matches(*db.plan(task).answer, final["answer"])


WEAKER = {"submit_unchanged": _lax_no_wrong_change, "extra_change": _lax_intended_rows,
          "delete_instead": _lax_old_values_gone, "several_values": _lax_any_value,
          "answer_after_write": _lax_answer_only, "question_back": None}


def _probe_tasks(probe):
  return [t for split in envs.SPLITS for t in db.tasks(split, 24, 5) if probe in db.probes(t, 0)]


def _passes(task, actions):
  result = _run(task, actions)[-1]
  return bool(result.done and result.verdict is not None and result.verdict.passed)


@pytest.mark.parametrize("probe", sorted(WEAKER))
def test_each_probe_scores_zero_and_would_pass_a_weaker_verifier(probe, monkeypatch):
  tasks = _probe_tasks(probe)
  assert len({t.payload["template"] for t in tasks}) >= 4
  assert {p for t in tasks for p in db.probes(t, 0)} <= set(WEAKER)  # a new probe needs its weaker verifier here
  assert not any(_passes(t, db.probes(t, 0)[probe]) for t in tasks)
  lax = WEAKER[probe]
  if lax is None:  # the question handed back: no obvious verifier would take it, it must just score 0
    return
  monkeypatch.setattr(db.DatabaseVerifier, "score", lambda self, task, final: envs.Verdict(
      bool(lax(task, final)), float(bool(lax(task, final))), {}, self.version))
  assert all(_passes(t, db.probes(t, 0)[probe]) for t in tasks)


def test_every_probe_action_is_a_valid_call():
  for task in db.tasks("train", 16, 2):
    for name, actions in db.probes(task, 0).items():
      results = _run(task, actions)
      assert all(r.outcome is envs.Outcome.OK for r in results[:-1]), (name, [r.observation.text for r in results])
      assert results[-1].termination == envs.COMPLETED


# ----------------------------------------------------------------------------------------------
# Tools: refused inputs, injection, syntaxes, caps.


def _shop_env():
  task = next(t for t in db.tasks("train", 4, 0) if t.payload["template"] == "shop")
  env = db.DatabaseEnv(max_turns=50)
  env.reset(task, 0)
  return env


@pytest.mark.parametrize("action, pattern", [
    ("find table=customerz", r"unknown table 'customerz'; tables are customers, products, orders, order_items"),
    ('find table="orders; DROP TABLE orders"', r"unknown table 'orders; DROP TABLE orders'"),
    ('find table=customers where={"nme": "x"}', r"unknown column 'nme' of customers; columns are id, name, city"),
    ('find table=customers where={"name": 3}', r"customers\.name=3: expected a text"),
    ('update table=orders id=1 values={"customer_id": "two"}', r'orders\.customer_id="two": expected an integer'),
    ('update table=orders id=1 values={"status": "sent"}', r'orders\.status="sent": not one of pending, shipped'),
    ('update table=orders id=1 values={"customer_id": 99}', r"orders\.customer_id=99: no row of customers has id 99"),
    ('update table=orders id=999 values={"status": "shipped"}', r"no row of orders has id 999"),
    ('update table=orders id=1 values={"id": 5}', r"id is the row's key"),
    ('update table=products id=1 values={"stock": -1}', r"products\.stock=-1: must be >= 0"),
    ('insert table=orders values={"customer_id": 1}', r"missing status, placed; columns are customer_id"),
    ('insert table=orders values={"customer_id": 1, "status": "pending", "placed": "today"}',
     r'orders\.placed="today": expected a date YYYY-MM-DD'),
    ("delete table=customers id=1", r"cannot delete customers id=1: rows of orders refer to it"),
    ("get table=orders id=abc", r"id: 'abc' is not of type 'integer'"),
    ("find table=orders limit=50", r"limit=50: must be 1\.\.20"),
    ("find table=orders bogus=1", r"'bogus' was unexpected"),
    ("drop table=orders", r"unknown tool 'drop'"),
])
def test_bad_tool_inputs_are_refused_naming_the_bad_value(action, pattern):
  env = _shop_env()
  before = db.dump(sqlite3.connect(env.db_path), "shop")
  result = env.step(action)
  assert result.outcome is envs.Outcome.INVALID_ACTION_CONTINUED and not result.done
  assert result.observation.text.startswith("error: ")
  assert __import__("re").search(pattern, result.observation.text), result.observation.text
  assert db.dump(sqlite3.connect(env.db_path), "shop") == before
  env.close()


def test_a_unique_constraint_is_refused_as_an_invalid_action():
  task = db.tasks("tune", 1, 0)[0]
  env = db.DatabaseEnv(max_turns=4)
  env.reset(task, 0)
  result = env.step('insert table=stock values={"item_id": 1, "warehouse_id": %d, "quantity": 3}'
                    % db.select(sqlite3.connect(env.db_path), db.table_of("warehouse", "stock"), {"item_id": 1})[0][
                        "warehouse_id"])
  assert result.outcome is envs.Outcome.INVALID_ACTION_CONTINUED and "UNIQUE constraint failed" in result.info["error"]
  env.close()


def test_sql_injection_text_is_a_literal_value():
  env = _shop_env()
  before = db.dump(sqlite3.connect(env.db_path), "shop")
  for text in ("x' OR '1'='1", "x\"; DROP TABLE orders; --", "%"):
    result = env.step(f"find table=customers where={json.dumps({'name': text})}")
    assert result.observation.text == "customers: 0 rows"
  result = env.step('update table=customers id=1 values={"name": "Bob\'); DROP TABLE orders; --"}')
  assert result.outcome is envs.Outcome.OK
  after = db.dump(sqlite3.connect(env.db_path), "shop")
  assert after["orders"] == before["orders"] and after["customers"][1][1] == "Bob'); DROP TABLE orders; --"
  env.close()


@pytest.mark.parametrize("line, call", [
    ('find table=orders where={"customer_id": 1, "placed": "2024-03-24"} limit=5',
     {"name": "find", "arguments": {"table": "orders", "where": {"customer_id": 1, "placed": "2024-03-24"}, "limit": 5}}),
    ('update table=orders id=5 values={"status": "shipped"}',
     {"name": "update", "arguments": {"table": "orders", "id": 5, "values": {"status": "shipped"}}}),
    ('answer value="Ann Lee"', {"name": "answer", "arguments": {"value": "Ann Lee"}}),
    ("answer value=12.50", {"name": "answer", "arguments": {"value": "12.50"}}),
    ("tables", {"name": "tables", "arguments": {}}),
])
def test_line_and_json_syntax_give_the_same_call(line, call):
  line_call = db.DatabaseEnv.parser.parse(line)
  json_call = db.DatabaseEnv.parser.with_syntax("json").parse(f"<tool_call>{json.dumps(call)}</tool_call>")
  assert line_call == json_call
  assert db.DatabaseEnv.parser.format(line_call) == line or line.startswith("answer value=12")
  assert db.DatabaseEnv.parser.parse(db.DatabaseEnv.parser.format(line_call)) == line_call


def test_observations_are_capped_and_flagged_truncated():
  task = next(t for t in db.tasks("train", 80, 0) if t.payload["template"] == "shop" and len(db.dump(db.build(
      "shop", t.payload["db_seed"]), "shop")["order_items"]) > db.MAX_ROWS_SHOWN)
  env = db.DatabaseEnv(max_turns=8)
  env.reset(task, 0)
  full = env.step("find table=order_items")
  rows = len(db.select(sqlite3.connect(env.db_path), db.table_of("shop", "order_items"), {}))
  assert full.observation.truncated and full.observation.original_size > len(full.observation.text.encode())
  assert len(full.observation.text.splitlines()) == 1 + db.MAX_ROWS_SHOWN + 1
  assert f"{rows - db.MAX_ROWS_SHOWN} more rows not shown" in full.observation.text
  few = env.step("find table=orders limit=2")
  assert few.observation.truncated and few.observation.text.splitlines()[0].startswith("orders: ")
  one = env.step('find table=customers where={"id": 1}')
  assert not one.observation.truncated and one.observation.original_size == len(one.observation.text.encode())
  assert len(full.observation.text) <= db.MAX_OBS_CHARS
  env.close()


def test_every_tool_is_reachable_in_json_syntax():
  task = next(t for t in db.tasks("train", 4, 0) if t.payload["kind"] == "ship_order")
  env = db.DatabaseEnv(max_turns=8, action_syntax="json")
  env.reset(task, 0)
  calls = [db.DatabaseEnv.parser.parse(a) for a in db.demo(task, 0)]
  results = [env.step(json.dumps({"name": c.name, "arguments": dict(c.arguments)})) for c in calls]
  assert results[-1].verdict.passed
  env.close()


# ----------------------------------------------------------------------------------------------
# Contamination between splits.


def test_no_near_duplicates_between_splits_and_a_planted_one_is_found():
  train = db.tasks("train", 200, 0)
  for held in ("tune", "eval"):
    report = contamination.check(train, db.tasks(held, 100, 0), describe=db.describe)
    assert report.contaminated == 0, report.line()
  victim = db.tasks("eval", 1, 0)[0]
  words = victim.payload["text"].split()
  words[1] = "the" if words[1] != "the" else "a"  # one word changed
  planted = dataclasses.replace(train[0], id="planted", payload=dict(train[0].payload, text=" ".join(words)))
  report = contamination.check([*train, planted], [victim], describe=db.describe)
  assert report.contaminated == 1 and report.matches[0].train == "planted" and not report.matches[0].exact
