"""Tokenizers: local HF tokenizer directories (through transformers) and a byte-level demo tokenizer.

Both satisfy `Tokenizer`: `encode` turns untrusted text into ordinary tokens only (special-token text such as
an end-of-turn marker stays plain text), `special(name)` is the only way to get a control token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence


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
    from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top

    path = Path(path)
    if not path.is_dir():
      raise FileNotFoundError(f"{path}: tokenizer directory not found")
    self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    self.vocab_size = len(self.hf)
    if self.hf.eos_token_id is None:
      raise ValueError(f"{path}: tokenizer has no eos token")
    self.eos_id = int(self.hf.eos_token_id)
    self.pad_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id)

  def encode(self, text: str) -> list[int]:
    # split_special_tokens: special-token text in untrusted input is tokenized as ordinary text.
    return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

  def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
    return self.hf.decode(list(map(int, ids)), skip_special_tokens=skip_special)

  def special(self, name: str) -> int:
    token_id = self.hf.convert_tokens_to_ids(name)
    if token_id is None or token_id == self.hf.unk_token_id or name not in self.hf.all_special_tokens + list(
        self.hf.added_tokens_encoder):
      raise KeyError(f"unknown special token {name!r}; have {sorted(self.hf.all_special_tokens)}")
    return int(token_id)

  def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> list[int]:
    out = self.hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
  """`"byte"` -> `ByteTokenizer()`; otherwise a local HF tokenizer directory."""
  if str(spec) == "byte":
    return ByteTokenizer()
  return HFTokenizer(spec)
