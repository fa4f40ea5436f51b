"""Chat framing: the one place that decides which tokens surround prompts, actions and observations.

The rollout engine never builds framing itself. It asks a `ChatFormat` for
  * `prompt(text)`         the prompt stream (system/user turn and the generation prompt), recorded verbatim;
  * `observation(text, role, after)`  one observation frame: exactly the tokens appended to the KV cache after
                           the action `after`, with the body's span inside it and whether the body was cut;
  * `action_tokens(text)`  a complete scripted action (demonstrations), ending the way a sampled one ends;
  * `action_text(tokens)`  the text the env receives for sampled action tokens (reasoning removed);
  * `reasoning_length(tokens)`  how many leading tokens of a sampled action are private reasoning;
  * `stop_sequences`       token sequences that end an action (the sampler's stop table);
  * `frame_length`         the longest observation frame (the sampler's one extend bucket).
A frame is a detached `TokenStream`: its tokens entered through the stream's own doors (encoded text, named
control tokens, template tokens), the sampler receives `frame.tokens`, and the record appends the same frame
(`TokenStream.extend`): token-in, token-out, nothing encoded twice.

Two formats:
  * `ControlTokenChat`: the byte tokenizer's own control tokens (the default run);
  * `TemplateChat`: the tokenizer's Hugging Face chat template (`model.chat_format: auto` with a tokenizer
    that has one), applied as token deltas, for any template.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from typing import Any, Mapping, Sequence

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
  has_reasoning: bool = False   # sampled actions may open with a private reasoning span

  @abc.abstractmethod
  def prompt(self, text: str, system: str | None = None) -> tr.TokenStream:
    """A new stream holding the prompt for the first observation `text`, ready for the first action; `system`:
    the episode's own system message in place of the configured one (`Observation.system`)."""

  @abc.abstractmethod
  def observation(self, text: str, role: tr.Role = tr.Role.TOOL, after: Sequence[int] = ()) -> Frame:
    """The frame of an env observation (role TOOL, or ERROR for an error reply to a rejected action) that
    follows the action tokens `after`."""

  @abc.abstractmethod
  def action_tokens(self, text: str) -> list[int]:
    """A complete action as the policy would sample it (text, then what ends an action)."""

  @abc.abstractmethod
  def action_text(self, tokens: Sequence[int]) -> str:
    """The env's view of sampled action tokens (control tokens and the ending removed)."""

  def reasoning_length(self, tokens: Sequence[int]) -> int:
    """How many leading tokens of a sampled action are private reasoning (recorded as role REASONING)."""
    del tokens
    return 0


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

  def prompt(self, text: str, system: str | None = None) -> tr.TokenStream:
    """No system role here: an episode's own system message goes before the text, a blank line between."""
    if system:
      text = f"{system}\n\n{text}"
    stream, role = tr.TokenStream(), tr.Role.PROMPT
    stream.control(self.BOS, role, self.tokenizer)
    stream.control(self.USER, role, self.tokenizer)
    stream.text(text, role, self.tokenizer)
    stream.control(self.END_OF_TURN, role, self.tokenizer)
    stream.control(self.ASSISTANT, role, self.tokenizer)
    return stream

  def observation(self, text: str, role: tr.Role = tr.Role.TOOL, after: Sequence[int] = ()) -> Frame:
    del after  # every action ends before <|tool|>: the frame does not depend on how
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


# Placeholders rendered through the template and split on: plain ASCII words no template rewrites.
_USER, _ACTION, _OBSERVATION = "JAXAGENTUSERSLOT", "JAXAGENTACTIONSLOT", "JAXAGENTTOOLSLOT"
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one of these functions. Answer with a JSON object inside <tool_call></tool_call> "
    'tags: <tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>\n<tools>\n{tools}\n'
    "</tools>")


class TemplateError(ValueError):
  """A chat template cannot be applied as token deltas (it does not render a message verbatim)."""


def _split(text: str, slot: str, what: str) -> tuple[str, str]:
  if text.count(slot) != 1:
    raise TemplateError(f"the chat template renders {what} {text.count(slot)} times (expected once, verbatim): "
                        f"{text!r}")
  before, _, after = text.partition(slot)
  return before, after


class TemplateChat(ChatFormat):
  """Framing from the tokenizer's own chat template, applied as token deltas (token-in, token-out).

  The template is rendered once, at construction, on placeholder messages; the text around each placeholder is
  the framing. A placeholder is never tokenized: the framing is encoded with the template's special tokens
  recognized (`encode_template`) and the real content goes through `encode`, so a tool output that contains
  "<|im_end|>" stays plain text (unlike re-rendering the history through `apply_chat_template`, which lets text
  become control tokens):

    prompt:       {template up to the user message} {first observation} {rest, generation prompt}  role: prompt
    action:       {sampled tokens, ending with the template's end-of-turn token or an eos}  role: policy
    observation:  {template after an assistant message up to the tool message} {observation}
                  {rest, generation prompt}                                                 role: tool / error

  The observation frame starts with what the template writes after an assistant's content (Qwen: `<|im_end|>\n`);
  its first token is the end-of-turn token the policy sampled to stop, so it is left out when the action ended
  with it. Sampled tokens are kept as sampled, including reasoning: a template that is not prefix-stable
  (Qwen3 drops earlier turns' `<think>` blocks when re-rendering a conversation) is not re-applied to the
  history, so the policy saw, and the learner trains on, its own earlier reasoning in context.

  Tools: the env's tool schemas go to the template (`tools=`). A template that does not render tools gets them
  in the system prompt instead (`TOOLS_SYSTEM_PROMPT`; `tools_in_system_prompt` is True). A template that refuses
  a tool message (Gemma 3's roles must alternate user / model) frames observations as user turns
  (`observation_role` "user"); one without a system role folds the system prompt where it puts it (Gemma: into
  the first user turn).

  Args:
    tokenizer: an `models.HFTokenizer` with a chat template.
    tools: OpenAI-style function schemas (`envs.Tool.schema()`).
    system_prompt: the system message (None: none, unless tools need one).
    template_kwargs: extra template variables (e.g. `enable_thinking: false` for Qwen3).
    stop: extra strings that end an action (the tokenizer's end-of-turn and eos ids always do).
    max_observation_tokens: observation bodies are cut to this many tokens (and flagged truncated).
    reasoning: treat `<think>...</think>` at the start of an action as reasoning (when the vocabulary has both
      as single tokens).
  """

  def __init__(self, tokenizer, *, tools: Sequence[Mapping[str, Any]] = (), system_prompt: str | None = None,
               template_kwargs: Mapping[str, Any] | None = None, stop: Sequence[str] = (),
               max_observation_tokens: int = 64, reasoning: bool = True):
    if getattr(tokenizer, "chat_template", None) is None:
      raise TemplateError(f"tokenizer {getattr(tokenizer, 'path', tokenizer)!r} has no chat template")
    self.tokenizer = tokenizer
    self.kwargs = dict(template_kwargs or {})
    self.max_observation_tokens = max_observation_tokens
    self.stop = tuple(stop)
    tools = [dict(t) for t in tools]
    user = [{"role": "user", "content": _USER}]
    try:
      ignores_tools = bool(tools) and self._render(user, tools, True) == self._render(user, None, True)
      if ignores_tools:  # the template has no place for tools: they go to the system prompt
        listing = "\n".join(json.dumps(t) for t in tools)
        block = TOOLS_SYSTEM_PROMPT.format(tools=listing)
        system_prompt = f"{system_prompt}\n\n{block}" if system_prompt else block
      self.tools = None if ignores_tools or not tools else tools
      self.tools_in_system_prompt = ignores_tools
      self._tools_block = block if ignores_tools else None
      self.system_prompt = system_prompt
      self._base = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + user
      before, after = _split(self._render(self._base, self.tools, True), _USER, "the user message")
      # A template without a tool role (Gemma's: roles alternate user / model) gets observations as user turns.
      self.observation_role = "tool"
      conversation = self._base + [{"role": "assistant", "content": _ACTION},
                                   {"role": "tool", "content": _OBSERVATION}]
      try:
        rendered = self._render(conversation, self.tools, True)
      except Exception:  # jinja's raise_exception, or any template error
        self.observation_role = "user"
        conversation[-1] = {"role": "user", "content": _OBSERVATION}
        rendered = self._render(conversation, self.tools, True)
      _, after_action = _split(rendered, _ACTION, "the assistant message")
      self._frame_head_text, frame_tail = _split(after_action, _OBSERVATION, "the tool message")
    except TemplateError:
      raise
    except Exception as e:  # jinja raises its own errors (a template that insists on other roles, ...)
      raise TemplateError(f"the chat template failed on a user / assistant / tool conversation: "
                          f"{type(e).__name__}: {e}") from None
    encode = tokenizer.encode_template
    self._prompt_head, self._prompt_tail = encode(before), encode(after)
    self._prompt_frames: dict[str, tuple[list[int], list[int]]] = {}  # an episode's own system message -> both
    self._frame_head, self._frame_tail = encode(self._frame_head_text), encode(frame_tail)
    # The template's end-of-turn: the first token it writes after an assistant's content, when that is one
    # special token (Qwen <|im_end|>, Llama 3 <|eot_id|>). The policy stops on it or on an eos id.
    first = self._frame_head[:1]
    special = set(getattr(tokenizer.hf, "all_special_ids", ())) | set(getattr(tokenizer.hf, "added_tokens_decoder",
                                                                              {}))
    self.end_of_turn = first[0] if first and first[0] in special else None
    stop_ids = sorted({*tokenizer.eos_ids, *([self.end_of_turn] if self.end_of_turn is not None else [])})
    self.stop_ids = frozenset(stop_ids)
    self.stop_sequences = tuple((i,) for i in stop_ids) + tuple(tuple(tokenizer.encode(s)) for s in self.stop)
    self.frame_length = len(self._frame_head) + max_observation_tokens + len(self._frame_tail)
    think = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    self._think = think if reasoning and None not in think else None
    self.has_reasoning = self._think is not None
    # A generation prompt may open the think block itself (thinking templates): the action starts inside it.
    last = lambda token: max((i for i, t in enumerate(self._prompt_tail) if t == token), default=-1)
    self._prompt_opens_think = self.has_reasoning and last(think[0]) > last(think[1])
    # Scripted tool calls (`action_tokens`) are cut out of a rendering between these two constant pieces.
    self._user_turn = self._render(self._base, self.tools, False)
    self._generation = encode(self._render(self._base, self.tools, True)[len(self._user_turn):])

  def _render(self, messages, tools, add_generation_prompt: bool) -> str:
    return self.tokenizer.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      **self.kwargs)

  def _prompt_frame(self, system: str | None) -> tuple[list[int], list[int]]:
    """The prompt's template tokens before and after the first observation, for the configured system prompt
    (None) or an episode's own (the tools block added where the template has no place for tools)."""
    if system is None:
      return self._prompt_head, self._prompt_tail
    if system not in self._prompt_frames:
      if len(self._prompt_frames) >= 64:  # agents bring one or a few: a bound, not an eviction policy
        self._prompt_frames.clear()
      content = f"{system}\n\n{self._tools_block}" if self._tools_block else system
      try:
        rendered = self._render([{"role": "system", "content": content}, {"role": "user", "content": _USER}],
                                self.tools, True)
      except Exception as e:  # jinja's raise_exception: a template without a system role
        raise TemplateError(f"the chat template refuses a system message ({type(e).__name__}: {e})") from None
      before, after = _split(rendered, _USER, "the user message")
      self._prompt_frames[system] = (self.tokenizer.encode_template(before), self.tokenizer.encode_template(after))
    return self._prompt_frames[system]

  def prompt(self, text: str, system: str | None = None) -> tr.TokenStream:
    head, tail = self._prompt_frame(system)
    stream, role = tr.TokenStream(), tr.Role.PROMPT
    stream.template(head, role)
    stream.text(text, role, self.tokenizer)
    stream.template(tail, role)
    return stream

  def observation(self, text: str, role: tr.Role = tr.Role.TOOL, after: Sequence[int] = ()) -> Frame:
    stream = tr.TokenStream()
    head = self._frame_head
    if after and self.end_of_turn is not None and int(after[-1]) == self.end_of_turn:
      head = head[1:]  # the policy sampled the end-of-turn token: it is in the action's span already
    stream.template(head, role)
    body, cut = stream.capped_text(text, role, self.tokenizer, max_tokens=self.max_observation_tokens)
    stream.template(self._frame_tail, role)
    return Frame(stream=stream, body=body, truncated=cut > 0)

  def reasoning_length(self, tokens: Sequence[int]) -> int:
    """The think block the action opens with (or that the generation prompt opened), up to and including its
    `</think>`; an unclosed one runs to the action's end (its stop token excepted). A `</think>` later in an
    action that did not open with one is ordinary text."""
    if self._think is None:
      return 0
    tokens = list(map(int, tokens))
    start, end = self._think
    if not (self._prompt_opens_think or tokens[:1] == [start]):
      return 0
    if end in tokens:
      return tokens.index(end) + 1
    return len(tokens) - (1 if tokens and tokens[-1] in self.stop_ids else 0)

  def action_text(self, tokens: Sequence[int]) -> str:
    tokens = list(map(int, tokens))[self.reasoning_length(tokens):]
    if tokens and tokens[-1] in self.stop_ids:
      tokens = tokens[:-1]
    # Not skipping special tokens: the env sees every token the policy produced (a stray control token is part
    # of the action and the parser judges it).
    text = self.tokenizer.decode(tokens)
    for stop in self.stop:
      if text.endswith(stop):
        return text[: -len(stop)]
    return text

  def action_tokens(self, text: str) -> list[int]:
    """A scripted action as the policy would write it: a JSON call `{"name", "arguments"}` is rendered through
    the template's own tool-call convention (Qwen: `<tool_call>...</tool_call>`); other text is the content."""
    end = [self.end_of_turn] if self.end_of_turn is not None else [self.tokenizer.eos_id]
    try:
      call = json.loads(text)
    except json.JSONDecodeError:
      call = None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
      return self.tokenizer.encode(text) + end
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": call["name"],
                                                                 "arguments": call.get("arguments", {})}}]}
    full = self._render(self._base + [message, {"role": self.observation_role, "content": _OBSERVATION}],
                        self.tools, False)
    if not full.startswith(self._user_turn):
      raise TemplateError("the chat template re-renders the user message differently once an assistant follows")
    rest = full[len(self._user_turn):]
    if self._frame_head_text not in rest:
      raise TemplateError("cannot find where the template ends an assistant tool call")
    rest = self.tokenizer.encode_template(rest[:rest.index(self._frame_head_text)])
    # The assistant header is the part of the generation prompt this rendering shares (Qwen3 with
    # enable_thinking=false also prompts an empty <think></think> that a rendered tool call does not repeat).
    generation = self._generation
    common = 0
    while common < min(len(generation), len(rest)) and generation[common] == rest[common]:
      common += 1
    if not rest[common:]:  # the template does not render tool calls: the convention TOOLS_SYSTEM_PROMPT teaches
      return self.tokenizer.encode(f"<tool_call>{json.dumps(call)}</tool_call>") + end
    return rest[common:] + end


CHAT_FORMATS = ("auto", "control_tokens", "template")


def make_chat(tokenizer, kind: str = "auto", *, tools: Sequence[Mapping[str, Any]] = (),
              system_prompt: str | None = None, template_kwargs: Mapping[str, Any] | None = None,
              stop: Sequence[str] | None = None, max_observation_tokens: int = 64,
              reasoning: bool = True) -> ChatFormat:
  """The chat format `kind` for `tokenizer` (`auto`: the template when the tokenizer has one, else control
  tokens). `stop: None` is the format's default (control tokens: a newline; template: none beyond its ids)."""
  if kind not in CHAT_FORMATS:
    raise ValueError(f"chat format {kind!r}: not one of {CHAT_FORMATS}")
  if kind == "template" or (kind == "auto" and getattr(tokenizer, "chat_template", None) is not None):
    return TemplateChat(tokenizer, tools=tools, system_prompt=system_prompt, template_kwargs=template_kwargs,
                        stop=stop or (), max_observation_tokens=max_observation_tokens, reasoning=reasoning)
  return ControlTokenChat(tokenizer, stop=("\n",) if stop is None else stop,
                          max_observation_tokens=max_observation_tokens)
