"""The generated reference pages and the command that writes them (`make docs`: `python -m jaxagent.reference_pages
docs`): docs/config.md from the config tree (`jaxagent.config_reference`) and docs/cli.md from the argument parser
(`jaxagent.cli.build_parser`: every verb with its usage, what it does, and each argument with its default).
tests/test_reference_pages.py fails when a page differs from what is generated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

from jaxagent import cli, config_reference

DOCS = Path(__file__).resolve().parents[1] / "docs"
CLI_PAGE = "cli.md"
PROG_WIDTH = 100  # usage lines are wrapped at this width, whatever the terminal that generates the page
HEADER = """# Command-line reference

Every `jaxagent` verb, generated from its argument parser by `make docs` (a test fails when this file is stale:
edit the parser's help text, not this page). `jaxagent VERB --help` prints the same. Verbs that take a config
accept a recipe name (`jaxagent/configs/`) or a YAML path and any number of `--set key=value` overrides; every key:
[config.md](config.md).
"""


class _FixedWidth(argparse.HelpFormatter):
  def __init__(self, prog: str):
    super().__init__(prog, width=PROG_WIDTH, max_help_position=40)


def verbs(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> Iterator[tuple[str, str,
                                                                                              argparse.ArgumentParser]]:
  """(verb path, help, parser) of every verb and sub-verb, in the parser's order."""
  parser = parser or cli.build_parser()
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      helps = {c.dest: c.help or "" for c in action._choices_actions}
      for name, sub in action.choices.items():
        path = f"{prefix}{name}"
        yield path, helps.get(name, ""), sub
        yield from verbs(sub, path + " ")


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
  rows = []
  for action in parser._actions:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
      continue
    name = ", ".join(action.option_strings) or action.metavar or action.dest
    if action.option_strings and action.nargs != 0:
      choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
      name += f" {action.metavar or choices or action.dest.upper()}"
    empty = action.default in (None, argparse.SUPPRESS, False, [], ()) or action.nargs == 0
    default = "" if empty else f"`{action.default}`"
    help_text = action.help or ""  # (no help here uses argparse's %(default)s expansion)
    required = "required" if action.required or not action.option_strings and action.nargs not in ("?", "*") else ""
    cells = (f"`{config_reference.table_cell(name)}`", required, default, config_reference.table_cell(help_text))
    rows.append("| " + " | ".join(cells) + " |\n")
  return rows


def markdown() -> str:
  """docs/cli.md as it should read: one section per verb, its usage and a table of its arguments."""
  out = [HEADER]
  for path, help_text, parser in verbs():
    parser.formatter_class = _FixedWidth
    out.append(f"\n## `jaxagent {path}`\n\n{' '.join(help_text.split())}\n")
    out.append(f"\n```text\n{parser.format_usage().strip()}\n```\n")
    rows = _arguments(parser)
    if rows:
      out.append("\n| argument | | default | what |\n|---|---|---|---|\n")
      out.extend(rows)
  return "".join(out)


def pages() -> dict[str, str]:
  """File name under docs/ -> its text as it should read."""
  return {config_reference.PAGE: config_reference.markdown(), CLI_PAGE: markdown()}


def main(argv: list[str]) -> int:
  docs = Path(argv[0]) if argv else DOCS
  for name, text in pages().items():
    (docs / name).write_text(text)
    print(f"wrote {docs / name}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
