"""Source mutations (envs/builtin/mutations.py): each operator changes exactly the recorded text of one line,
columns are characters even on non-ASCII lines, and a stale mutation is refused."""

import ast

import pytest

from envs.builtin import mutations

SOURCE = '''def f(a, b):
    """Énergie: the docstring is not ASCII."""
    s = "é" if a < b and b else "ü"
    if a == 2:
        return g(a, b + 1)
    while a - 1 > 0:
        a -= 1
    return s
'''


def test_each_operator_changes_one_line_as_recorded():
  cands = mutations.candidates("m.py", SOURCE)
  assert {m["kind"] for m in cands} == set(mutations.KINDS)
  before = SOURCE.splitlines()
  for m in cands:
    after = mutations.apply(SOURCE, m)
    ast.parse(after)  # every mutant is still Python
    changed = [k for k, (x, y) in enumerate(zip(before, after.splitlines())) if x != y]
    assert changed == [m["line"] - 1], m
    line = before[m["line"] - 1]
    assert line[m["col"]:m["col"] + len(m["original"])] == m["original"]  # character columns
    assert after.splitlines()[m["line"] - 1] == line[:m["col"]] + m["replacement"] + line[m["col"] + len(m["original"]):]


def test_operators_on_a_known_line():
  got = {(m["kind"], m["original"], m["replacement"]) for m in mutations.candidates("m.py", SOURCE) if m["line"] == 3}
  assert ("cmp_swap", "<", "<=") in got and ("bool_swap", "and", "or") in got
  got5 = {(m["kind"], m["replacement"]) for m in mutations.candidates("m.py", SOURCE) if m["line"] == 5}
  assert ("swap_args", "b + 1, a") in got5 and ("return_none", "None") in got5 and ("arith_flip", "-") in got5
  got4 = {(m["kind"], m["replacement"]) for m in mutations.candidates("m.py", SOURCE) if m["line"] == 4}
  assert {("drop_branch", "False"), ("negate_cond", "not (a == 2)"), ("const_off_by_one", "3")} <= got4


def test_kinds_select_operators_and_a_stale_mutation_is_refused():
  only = mutations.candidates("m.py", SOURCE, kinds=("cmp_swap",))
  assert only and {m["kind"] for m in only} == {"cmp_swap"}
  with pytest.raises(ValueError, match="not among"):
    mutations.candidates("m.py", SOURCE, kinds=("typo",))
  m = only[0]
  with pytest.raises(mutations.MutationMismatch, match="stale task"):
    mutations.apply(SOURCE.replace("a < b", "a > b"), m)


def test_identifiers_find_what_a_repair_brings_in():
  assert {"os", "getcwd"} <= mutations.identifiers("import os\nx = os.getcwd()\n") - mutations.identifiers("x = 1\n")
