"""Chat framing: the one place that decides which tokens surround prompts, actions and observations.

The rollout engine never builds framing itself. It asks a `ChatFormat` for
  * `prompt(text)`         the prompt stream (system/user turn and the generation prompt), recorded verbatim;
  * `observation(text, role)`  one observation frame: exactly the tokens appended to the KV cache, with the
                           body's span inside it and whether the body was cut;
  * `action_tokens(text)`  a complete scripted action (demonstrations), ending the way a sampled one ends;
  * `action_text(tokens)`  the text the env receives for sampled action tokens;
  * `stop_sequences`       token sequences that end an action (the sampler's stop table);
  * `frame_length`         the longest observation frame (the sampler's one extend bucket).
A frame is a detached `TokenStream`: its tokens entered through the stream's own doors (encoded text, named
control tokens), the sampler receives `frame.tokens(0, len(frame))`, and the record appends the same frame
(`TokenStream.extend`): token-in, token-out, nothing encoded twice.

`ControlTokenChat` is the byte tokenizer's framing (below). A Hugging Face chat template plugs in as another
`ChatFormat` that computes the same four things as token deltas of the template.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

from jaxagent import trajectory as tr


@dataclasses.dataclass(frozen=True)
class Frame:
  """An observation as it enters the stream.

  Attributes:
    stream: the frame's tokens (roles included), appended to the cache and to the record as they are.
    body: [start, stop) of the observation's own tokens inside `stream` (the rest is framing).
    truncated: the body was cut to the frame's token budget.
  """
  stream: tr.TokenStream
  body: tuple[int, int]
  truncated: bool

  @property
  def tokens(self) -> list[int]:
    return self.stream.tokens(0, len(self.stream))


class ChatFormat(abc.ABC):
  """How prompts, actions and observations become tokens for one tokenizer (see the module docstring)."""

  tokenizer: object
  stop_sequences: tuple[tuple[int, ...], ...]
  frame_length: int

  @abc.abstractmethod
  def prompt(self, text: str) -> tr.TokenStream:
    """A new stream holding the prompt for the first observation `text`, ready for the first action."""

  @abc.abstractmethod
  def observation(self, text: str, role: tr.Role = tr.Role.TOOL) -> Frame:
    """The frame of an env observation (role TOOL, or ERROR for an error reply to a rejected action)."""

  @abc.abstractmethod
  def action_tokens(self, text: str) -> list[int]:
    """A complete action as the policy would sample it (text, then what ends an action)."""

  @abc.abstractmethod
  def action_text(self, tokens: Sequence[int]) -> str:
    """The env's view of sampled action tokens (control tokens and the ending removed)."""


class ControlTokenChat(ChatFormat):
  """The byte tokenizer's framing, with control tokens by name:

    prompt:       <bos> <|user|> {first observation} <|eot|> <|assistant|>        role: prompt
    action:       {sampled tokens, ending with a stop string, <|eot|> or <eos>}  role: policy (loss)
    observation:  <|tool|> {observation} <|eot|> <|assistant|>                  role: tool / error

  Args:
    tokenizer: has `encode`, `decode(ids, skip_special=)`, `special(name)` and `eos_id`.
    stop: strings that end an action (`rollout.stop`); the first ends scripted actions.
    max_observation_tokens: observation bodies are cut to this many tokens (and flagged truncated).
  """

  BOS, USER, ASSISTANT, TOOL, END_OF_TURN = "<bos>", "<|user|>", "<|assistant|>", "<|tool|>", "<|eot|>"
  CONTROL_TOKENS = (BOS, USER, ASSISTANT, TOOL, END_OF_TURN)

  def __init__(self, tokenizer, *, stop: Sequence[str] = ("\n",), max_observation_tokens: int = 64):
    if not stop:
      raise ValueError("stop: at least one string must end an action")
    self.tokenizer = tokenizer
    self.stop = tuple(stop)
    self.max_observation_tokens = max_observation_tokens
    self.stop_sequences = tuple(tuple(tokenizer.encode(s)) for s in self.stop) + (
        (tokenizer.special(self.END_OF_TURN),), (tokenizer.eos_id,))
    # <|tool|> body <|eot|> <|assistant|>
    self.frame_length = max_observation_tokens + 3

  def prompt(self, text: str) -> tr.TokenStream:
    stream, role = tr.TokenStream(), tr.Role.PROMPT
    stream.control(self.BOS, role, self.tokenizer)
    stream.control(self.USER, role, self.tokenizer)
    stream.text(text, role, self.tokenizer)
    stream.control(self.END_OF_TURN, role, self.tokenizer)
    stream.control(self.ASSISTANT, role, self.tokenizer)
    return stream

  def observation(self, text: str, role: tr.Role = tr.Role.TOOL) -> Frame:
    stream = tr.TokenStream()
    stream.control(self.TOOL, role, self.tokenizer)
    body, cut = stream.capped_text(text, role, self.tokenizer, max_tokens=self.max_observation_tokens)
    stream.control(self.END_OF_TURN, role, self.tokenizer)
    stream.control(self.ASSISTANT, role, self.tokenizer)
    return Frame(stream=stream, body=body, truncated=cut > 0)

  def action_tokens(self, text: str) -> list[int]:
    return self.tokenizer.encode(text) + self.tokenizer.encode(self.stop[0])

  def action_text(self, tokens: Sequence[int]) -> str:
    text = self.tokenizer.decode(tokens, skip_special=True)
    for stop in self.stop:
      if text.endswith(stop):
        return text[: -len(stop)]
    return text
