"""Which of a package's kept tests a change to its source can affect: the swe env runs those, not the suite.

A change inside the body of a function changes only what the code that calls the function sees. The corpus's
baseline traces one run of the kept tests and records, per function (the first line of its code object), the
tests during whose setup, call or teardown it ran, and whether it ran at import (`swe_runner.py`'s callers).
So a change confined to the bodies of functions that never run at import can affect only the tests that called
them; any other change (module-level code, a class body, a def's header: decorators, signature and defaults run
at import; a function body that runs at import; a file that does not parse) can affect every test, and then
every kept test runs. Pure stdlib (it runs inside env workers).

Assumed, as the baseline's rule that a kept test passed twice assumes it: tests are deterministic and
independent (a session-scoped fixture's calls are attributed to the first test that used it). The swe env's
held-out verifier runs every kept test, so `jaxagent eval`'s proxy gap measures what this selection misses.
"""

from __future__ import annotations

import ast
from typing import Any, Iterable, Mapping, Sequence

from envs.builtin import mutations as mutations_lib

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
AT_IMPORT = ""  # the caller recorded for code that ran outside any test


def _outline(node: Any) -> str:
  """`ast.dump` without line numbers, with every function's body left out (its header kept)."""
  if isinstance(node, list):
    return "[" + ", ".join(map(_outline, node)) + "]"
  if not isinstance(node, ast.AST):
    return repr(node)
  fields = [f for f in node._fields if not (isinstance(node, _FUNCTIONS) and f == "body")]
  return f"{type(node).__name__}(" + ", ".join(f"{f}={_outline(getattr(node, f, None))}" for f in fields) + ")"


def _functions(nodes: list[ast.AST]) -> list[ast.AST]:
  """The functions defined in `nodes` outside any function's body (in a class body, an if, a try ...), in order."""
  out: list[ast.AST] = []

  def visit(node: ast.AST) -> None:
    if isinstance(node, _FUNCTIONS):
      out.append(node)
      return
    for child in ast.iter_child_nodes(node):
      visit(child)

  for n in nodes:
    visit(n)
  return out


def first_line(fn: ast.AST) -> int:
  """Its code object's `co_firstlineno`: the first decorator's line for a decorated function."""
  return min([fn.lineno, *(d.lineno for d in fn.decorator_list)])


def _changed(old: list[ast.AST], new: list[ast.AST], out: list[int]) -> bool:
  """Appends to `out` the first lines of `old`'s functions whose bodies differ in `new`; False when the
  statements differ outside function bodies."""
  if _outline(old) != _outline(new):
    return False
  for a, b in zip(_functions(old), _functions(new)):
    if ast.dump(a) == ast.dump(b):
      continue
    inner: list[int] = []
    if _changed(a.body, b.body, inner):  # its own statements are equal: only nested functions changed
      out += inner
    else:
      out.append(first_line(a))
  return True


def changed_functions(old: str, new: str) -> list[int] | None:
  """The first lines (in `old`) of the functions whose bodies alone differ between two versions of a source
  file; None when anything else differs (or `new` does not parse). Line shifts alone are no change."""
  try:
    old_tree, new_tree = mutations_lib.parse(old), mutations_lib.parse(new)
  except (SyntaxError, ValueError):
    return None
  out: list[int] = []
  return sorted(set(out)) if _changed(old_tree.body, new_tree.body, out) else None


def affected_tests(callers: Mapping[str, Mapping[str, Sequence[str]]], kept: Sequence[str],
                   changes: Iterable[tuple[str, str, str]]) -> list[str]:
  """The kept tests that changes can affect. `callers` is the baseline's {file: {first line: [test ids]}};
  `changes` are (file, pristine text, new text). Every kept test when a change is not confined to the bodies of
  functions that do not run at import."""
  kept_set, out = set(kept), set()
  for rel, old, new in changes:
    if old == new:
      continue
    lines = changed_functions(old, new)
    if lines is None:
      return list(kept)
    by_line = callers.get(rel, {})
    for line in lines:
      tests = by_line.get(str(line), ())
      if AT_IMPORT in tests:
        return list(kept)
      out.update(t for t in tests if t in kept_set)
  return [t for t in kept if t in out]
