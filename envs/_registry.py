"""Name -> EnvSpec registry of environments.

Three ways to name an environment:
  - a registered name: the built-ins (registered on import of `envs`) and anything `register(spec)` added;
  - an installed package's entry point in the group `jaxagent.envs` (loaded lazily, once, the first time a name
    is looked up or listed); the entry point loads to an `EnvSpec` and is registered under `spec.name`:
        [project.entry-points."jaxagent.envs"]
        my_env = "my_pkg.my_env:SPEC"
  - `package.module:ATTR` naming an `EnvSpec` in any importable module (imported on demand, not registered).

A bad name raises `UnknownEnvError` (a KeyError and a ValueError) whose message names the value and what is
valid. Worker processes resolve names the same way; `worker_name` gives the form a worker can always resolve.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import threading
import warnings

from envs._api import EnvAPIError, EnvSpec
from envs import openenv_bridge

ENTRY_POINT_GROUP = "jaxagent.envs"

_REGISTRY: dict[str, EnvSpec] = {}
_SOURCES: dict[str, str] = {}  # name -> "module:attr" of envs registered from entry points
_entry_points_loaded = False
_entry_points_lock = threading.RLock()  # an entry point whose module looks a name up re-enters


class UnknownEnvError(KeyError, ValueError):
  """An environment name that resolves to no EnvSpec; the message says what is valid."""

  def __str__(self) -> str:  # KeyError would repr() the message
    return str(self.args[0]) if self.args else ""


def register(spec: EnvSpec) -> EnvSpec:
  if not isinstance(spec, EnvSpec):
    raise TypeError(f"register({spec!r}): not an EnvSpec")
  if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
    raise ValueError(f"environment {spec.name!r} is already registered")
  _REGISTRY[spec.name] = spec
  return spec


def _load_entry_points() -> None:
  """Registers every `jaxagent.envs` entry point once; a broken one is skipped with a warning naming it."""
  global _entry_points_loaded
  with _entry_points_lock:
    if _entry_points_loaded:
      return
    _entry_points_loaded = True
    try:
      eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as e:  # broken metadata must not stop the built-ins
      warnings.warn(f"envs: cannot read the {ENTRY_POINT_GROUP!r} entry points: {type(e).__name__}: {e}",
                    RuntimeWarning, stacklevel=3)
      return
    for ep in eps:
      where = f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r})"
      try:
        spec = ep.load()
        if not isinstance(spec, EnvSpec):
          raise TypeError(f"loads to a {type(spec).__name__}, not an EnvSpec")
        if _REGISTRY.get(spec.name) is spec:
          continue  # already registered (a built-in, or the same spec under two entry points)
        register(spec)
      except Exception as e:  # user code: report it, keep the other envs
        warnings.warn(f"envs: {where} skipped: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        continue
      _SOURCES[spec.name] = f"{ep.module}:{ep.attr}"


def names() -> list[str]:
  """Registered names: the built-ins, `register`ed specs and installed `jaxagent.envs` entry points."""
  _load_entry_points()
  return sorted(_REGISTRY)


def _valid() -> str:
  return (f"registered names are {names()}, or 'package.module:ATTR' naming an EnvSpec, or "
          f"'{openenv_bridge.PREFIX}http://HOST:PORT' (an OpenEnv server)")


def _import_spec(name: str) -> EnvSpec:
  module, _, attr = name.partition(":")
  if not module or not attr or ":" in attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
    raise UnknownEnvError(f"environment {name!r}: not of the form 'package.module:ATTR'; {_valid()}")
  try:
    mod = importlib.import_module(module)
  except EnvAPIError as e:  # an EnvSpec in it written for another API: say which function and what changed
    raise UnknownEnvError(f"environment {name!r}: {e}") from e
  except Exception as e:  # ImportError or whatever the user module raised
    raise UnknownEnvError(f"environment {name!r}: cannot import module {module!r} ({type(e).__name__}: {e}); "
                          f"{_valid()}") from e
  try:
    spec = functools.reduce(getattr, attr.split("."), mod)
  except AttributeError:
    public = sorted(k for k, v in vars(mod).items() if isinstance(v, EnvSpec))
    raise UnknownEnvError(f"environment {name!r}: module {module!r} has no attribute {attr!r} (its EnvSpecs: "
                          f"{public or 'none'}); {_valid()}") from None
  if not isinstance(spec, EnvSpec):
    raise UnknownEnvError(f"environment {name!r}: {module}:{attr} is a {type(spec).__name__}, not an EnvSpec; "
                          f"{_valid()}")
  return spec


def get(name: str) -> EnvSpec:
  """The EnvSpec of `name` (a registered or entry-point name, or `package.module:ATTR`).

  Raises:
    UnknownEnvError: naming the bad value and what is valid.
  """
  if not isinstance(name, str):
    raise UnknownEnvError(f"environment {name!r}: must be a str; {_valid()}")
  if name in _REGISTRY:
    return _REGISTRY[name]
  if name.startswith(openenv_bridge.PREFIX):
    try:
      return openenv_bridge.client_spec(name)
    except ValueError as e:
      raise UnknownEnvError(str(e)) from None
  if ":" in name:
    return _import_spec(name)
  _load_entry_points()
  if name in _REGISTRY:
    return _REGISTRY[name]
  close = difflib.get_close_matches(name, names(), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise UnknownEnvError(f"unknown environment {name!r}{hint}; {_valid()}")


def check_name(name: str) -> None:
  """Raises `UnknownEnvError` (the clear message) unless `name` resolves to an EnvSpec."""
  get(name)


def is_valid_name(name: str) -> bool:
  """Whether `name` resolves to an EnvSpec (imports a `package.module:ATTR` module to find out)."""
  try:
    get(name)
  except UnknownEnvError:
    return False
  return True


def worker_name(name: str) -> str:
  """The name to hand a worker process for `name`: the same string, except that an env registered from an
  entry point becomes its `module:attr` (a sandboxed worker sees the module, not the package metadata)."""
  get(name)
  return _SOURCES.get(name, name)


def module_of(name: str) -> str | None:
  """The module a worker must import to build `name` (None for the built-ins, which live in `envs`)."""
  ref = worker_name(name)
  return ref.partition(":")[0] if ":" in ref and not ref.startswith(openenv_bridge.PREFIX) else None
