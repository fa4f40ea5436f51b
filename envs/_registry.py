"""Name -> EnvSpec registry of environments (built-ins register on import of `envs`)."""

from __future__ import annotations

import difflib
import importlib

from envs._api import EnvSpec

_REGISTRY: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> EnvSpec:
  if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
    raise ValueError(f"environment {spec.name!r} is already registered")
  _REGISTRY[spec.name] = spec
  return spec


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> EnvSpec:
  """An env by registry name, or `package.module:ATTR` naming an EnvSpec (imported on demand)."""
  if name in _REGISTRY:
    return _REGISTRY[name]
  if ":" in name:
    module, _, attr = name.partition(":")
    spec = getattr(importlib.import_module(module), attr)
    if not isinstance(spec, EnvSpec):
      raise TypeError(f"{name}: is a {type(spec).__name__}, not an EnvSpec")
    return spec
  close = difflib.get_close_matches(name, names(), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise KeyError(f"unknown environment {name!r}{hint}; registered: {names()}")
