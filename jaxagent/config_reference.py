"""The config reference, docs/config.md, generated from the config tree: every key with its type, default, valid
values and help text. `make docs` writes it (`jaxagent/reference_pages.py`); tests/test_reference_pages.py fails
when the file differs from what this module generates.

A field's help comes from its `config.field(help=...)`; a field of a dataclass that has none (the model
architecture, `models.ModelConfig`) from its class docstring's `Attributes:` section.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any, Iterator

import yaml

from jaxagent import config as config_lib

PAGE = "config.md"  # under docs/
HEADER = """# Configuration reference

Every key of a run's config, generated from `jaxagent/config.py` by `make docs` (a test fails when this file is
stale: edit the code's help text, not this page). A YAML recipe (`jaxagent/configs/*.yaml`) lists only what it
changes; `--set key=value` overrides one key (values parse as YAML); `jaxagent config NAME --set ...` prints the
resolved config and validates it. Keys of list items are shown as `key[].field`.
"""


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key: its dotted path and what the reference says of it."""
  path: str
  type: str
  default: str
  valid: str
  help: str


def _type_text(tp: Any) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Literal:
    return " | ".join(_value_text(a) for a in args)
  if origin in (typing.Union, types.UnionType):
    return " | ".join("null" if a is type(None) else _type_text(a) for a in args)
  if origin is tuple:
    return f"list of {_type_text(args[0])}" if args else "list"
  if origin is dict or tp is dict:
    return "mapping"
  if isinstance(tp, type):
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
            "NoneType": "null"}.get(tp.__name__, tp.__name__)
  return str(tp).replace("typing.", "")


def _value_text(value: Any) -> str:
  """A value as YAML writes it (what a recipe or `--set` takes, and what `jaxagent config` prints)."""
  return yaml.safe_dump(config_lib.to_dict(value), default_flow_style=True, width=1 << 16).removesuffix("...\n").strip()


def _valid_text(metadata: typing.Mapping[str, Any]) -> str:
  parts = [f"{word} {metadata[key]}" for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
           if metadata.get(key) is not None]
  choices = metadata.get("choices")
  if choices is not None:
    parts.append("one of " + ", ".join(_value_text(c) for c in (choices() if callable(choices) else choices)))
  return "; ".join(parts)


def _attribute_docs(cls: type) -> dict[str, str]:
  """`name: text` entries of a class docstring's `Attributes:` section (continuation lines joined)."""
  doc = inspect.getdoc(cls) or ""
  _, _, section = doc.partition("Attributes:\n")
  out: dict[str, str] = {}
  name = None
  for line in section.splitlines():
    m = re.match(r"^  (\w+): (.*)$", line)
    if m:
      name, out[m.group(1)] = m.group(1), m.group(2)
    elif name and line.startswith("    "):
      out[name] += " " + line.strip()
    elif line.strip() and not line.startswith(" "):
      break
  return out


def _dataclass_of(tp: Any) -> type | None:
  """The dataclass a field holds (directly, or as the items of a tuple), else None."""
  if dataclasses.is_dataclass(tp):
    return tp
  if typing.get_origin(tp) is tuple and typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
    return typing.get_args(tp)[0]
  return None


def keys(cls: type = config_lib.Config, prefix: str = "") -> Iterator[Key]:
  """Every leaf key under `cls`, in declaration order (sections and nested records expanded in place)."""
  hints = typing.get_type_hints(cls)
  attribute_docs = _attribute_docs(cls)
  instance = cls()
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    path = f"{prefix}.{f.name}" if prefix else f.name
    tp = hints[f.name]
    nested = _dataclass_of(tp)
    if nested is not None:
      yield from keys(nested, path + ("[]" if nested is not tp else ""))
      continue
    help_text = f.metadata.get("help") or attribute_docs.get(f.name, "")
    yield Key(path, _type_text(tp), _value_text(getattr(instance, f.name)), _valid_text(f.metadata),
              " ".join(help_text.split()))


def table_cell(text: str) -> str:
  """Text for a markdown table cell (of either generated page): one line, a `|` would end the cell and `<name>`
  would read as an HTML tag."""
  return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown() -> str:
  """docs/config.md as it should read: one table per top-level section, headed by the section's docstring."""
  out = [HEADER]
  for section in dataclasses.fields(config_lib.Config):
    cls = typing.get_type_hints(config_lib.Config)[section.name]
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0]
    out.append(f"\n## `{section.name}`\n")
    if doc and not doc.startswith(cls.__name__ + "("):  # not the dataclass's generated signature
      out.append(" ".join(doc.split()) + "\n")
    out.append("\n| key | type | default | valid | what |\n|---|---|---|---|---|\n")
    for key in keys(cls, section.name):
      cells = (f"`{key.path}`", table_cell(key.type), f"`{key.default}`", table_cell(key.valid), table_cell(key.help))
      out.append("| " + " | ".join(cells) + " |\n")
  return "".join(out)
