"""Source mutations of Python code (SWE-smith's method): AST-located, one line each, so a task's reference
solution is the inverse patch of its mutations. Used by `code_repair` (our toy package) and `swe` (real PyPI
packages). Plain stdlib: this runs inside env workers.

A mutation is a dict {module, line, col, kind, original, replacement}: on line `line` (1-based) of `module`, the
text `original` at character column `col` becomes `replacement`. Operators (`KINDS`):
  cmp_swap          < <=, > >=, == !=
  arith_flip        + -, += -=
  bool_swap         and or
  const_off_by_one  an integer literal +1 or -1
  negate_cond       an if / while test -> not (test)
  drop_branch       an if / elif test -> False (the branch never runs)
  swap_args         the first two positional arguments of a call swapped
  return_none       return EXPR -> return None
"""

from __future__ import annotations

import ast
import io
import threading
import tokenize
from typing import Any, Iterable, Mapping, Sequence

KINDS = ("cmp_swap", "arith_flip", "bool_swap", "const_off_by_one", "negate_cond", "drop_branch", "swap_args",
         "return_none")
CMP_SWAP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "=="}
ARITH_FLIP = {"+": "-", "-": "+"}
AUG_FLIP = {"+=": "-=", "-=": "+="}
BOOL_SWAP = {"and": "or", "or": "and"}
FIELDS = ("module", "line", "col", "kind", "original", "replacement")


_PARSING = threading.Lock()


def parse(source: str) -> ast.Module:
  """`ast.parse`, one thread at a time: CPython 3.11's conversion of a parse tree to Python objects is not
  thread-safe (CPython gh-106905: two mining threads got "SystemError: AST constructor recursion depth
  mismatch")."""
  with _PARSING:
    return ast.parse(source)


class MutationMismatch(ValueError):
  """A mutation does not match the text it is applied to (a stale task for another version of the source)."""


def _tokens(source: str) -> list[tokenize.TokenInfo]:
  return [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
          if t.type in (tokenize.OP, tokenize.NAME)]


def candidates(module: str, source: str, kinds: Iterable[str] = KINDS) -> list[dict[str, Any]]:
  """Every single-line mutation of `source` by the operators `kinds`, in source order.

  Columns are characters (AST offsets are UTF-8 bytes: converted, so non-ASCII source is fine).
  """
  kinds = frozenset(kinds)
  if kinds - set(KINDS):
    raise ValueError(f"kinds {sorted(kinds - set(KINDS))}: not among {KINDS}")
  tree, toks, lines = parse(source), _tokens(source), source.splitlines()
  out: list[dict[str, Any]] = []

  def col(line: int, byte_col: int) -> int:
    return len(lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))

  def segment(node: ast.AST) -> tuple[int, int, str] | None:
    """(line, char column, text) of a node that sits on one line."""
    if node.lineno != node.end_lineno:
      return None
    start, end = col(node.lineno, node.col_offset), col(node.lineno, node.end_col_offset)
    return node.lineno, start, lines[node.lineno - 1][start:end]

  def add(kind, line, column, original, replacement):
    if kind not in kinds or original == replacement:
      return
    if lines[line - 1][column:column + len(original)] != original:
      raise AssertionError(f"{module}:{line}:{column}: expected {original!r}")  # a bug in this generator
    out.append(dict(module=module, line=line, col=column, kind=kind, original=original, replacement=replacement))

  def between(a: ast.AST, b: ast.AST, table: Mapping[str, str], kind: str):
    start = (a.end_lineno, col(a.end_lineno, a.end_col_offset))
    end = (b.lineno, col(b.lineno, b.col_offset))
    hits = [t for t in toks if t.start >= start and t.end <= end and t.string in table]
    if len(hits) == 1 and hits[0].start[0] == hits[0].end[0]:
      add(kind, hits[0].start[0], hits[0].start[1], hits[0].string, table[hits[0].string])

  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      operands = [node.left] + node.comparators
      for a, b in zip(operands, operands[1:]):
        between(a, b, CMP_SWAP, "cmp_swap")
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
      between(node.left, node.right, ARITH_FLIP, "arith_flip")
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
      between(node.target, node.value, AUG_FLIP, "arith_flip")
    elif isinstance(node, ast.BoolOp):
      for a, b in zip(node.values, node.values[1:]):
        between(a, b, BOOL_SWAP, "bool_swap")
    elif isinstance(node, ast.Constant) and type(node.value) is int:
      seg = segment(node)
      if seg is not None:
        for delta in (1, -1):
          add("const_off_by_one", *seg, str(node.value + delta))
    elif isinstance(node, ast.Call) and len(node.args) >= 2 and not any(
        isinstance(a, ast.Starred) for a in node.args[:2]):
      a, b = segment(node.args[0]), segment(node.args[1])
      if a is not None and b is not None and a[0] == b[0] and a[2] != b[2]:
        text = lines[a[0] - 1][a[1]:b[1] + len(b[2])]
        add("swap_args", a[0], a[1], text, b[2] + text[len(a[2]):len(text) - len(b[2])] + a[2])
    elif isinstance(node, ast.Return) and node.value is not None:
      seg = segment(node.value)
      if seg is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
        add("return_none", *seg, "None")
    if isinstance(node, (ast.If, ast.While)):
      seg = segment(node.test)
      if seg is not None:
        add("negate_cond", *seg, f"not ({seg[2]})")
        if isinstance(node, ast.If):
          add("drop_branch", *seg, "False")
  out.sort(key=lambda m: (m["line"], m["col"], m["kind"], m["replacement"]))
  return out


def apply(source: str, mutations: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
  """`source` with `mutations` (of this module, on distinct lines) applied; MutationMismatch when one does not
  match the text it was made from."""
  ms = [mutations] if isinstance(mutations, Mapping) else list(mutations)
  lines = source.splitlines(keepends=True)
  for m in ms:
    line, column, orig = int(m["line"]), int(m["col"]), str(m["original"])
    if not 1 <= line <= len(lines) or lines[line - 1][column:column + len(orig)] != orig:
      raise MutationMismatch(f"mutation {dict(m)!r} does not match {m.get('module')} (a stale task for another "
                             "version of the source?)")
    text = lines[line - 1]
    lines[line - 1] = text[:column] + str(m["replacement"]) + text[column + len(orig):]
  return "".join(lines)


def mutation_id(m: Mapping[str, Any]) -> str:
  return f"{m['module']}:{m['line']}:{m['col']}:{m['kind']}:{m['replacement']}"


def identifiers(source: str) -> set[str]:
  """The names `source` uses or defines (names, attributes, functions, classes, arguments, imports): a repair
  that brings in one its pristine version does not use (`open`, `sys`, `__import__`) is refused by the
  verifiers of code_repair and swe."""
  names: set[str] = set()
  for node in ast.walk(parse(source)):
    if isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.arg):
      names.add(node.arg)
    elif isinstance(node, ast.alias):
      names.add(node.asname or node.name)
  return names
