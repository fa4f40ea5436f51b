"""Trajectories for a person: coloured text (decoded by role, or the recorded turn texts), one self-contained
HTML page, and the pieces of it other pages embed (`jaxagent inspect`, the evaluation report).

Stored text is untrusted (tool output): control characters are escaped in text and everything is HTML-escaped
in pages, so a record can never drive the terminal or the browser.
"""

from __future__ import annotations

import html
import re
from typing import Iterable

from jaxagent.trajectory import Role, Trajectory

ANSI = {Role.SYSTEM: "90", Role.PROMPT: "34", Role.POLICY: "32", Role.TOOL: "33", Role.ERROR: "31",
        Role.REASONING: "35"}
CSS = {Role.SYSTEM: "#888", Role.PROMPT: "#1f5fbf", Role.POLICY: "#1a7f37", Role.TOOL: "#9a6700",
       Role.ERROR: "#cf222e", Role.REASONING: "#8250df"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _safe(text: str) -> str:
  return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _role_runs(t: Trajectory) -> Iterable[tuple[Role, int, int]]:
  start = 0
  for j in range(1, len(t) + 1):
    if j == len(t) or t.roles[j] != t.roles[start]:
      yield Role(int(t.roles[start])), start, j
      start = j


def _header(t: Trajectory) -> list[str]:
  verdict = {True: "pass", False: "fail", None: "n/a"}[t.verifier.passed]
  prompt = _safe(t.task.prompt) if t.task.prompt else "(not recorded: schema < 6)"
  return [
      f"trajectory {t.id or '?'}  task {t.task.id} ({t.task.split}, {t.task.version})  "
      f"env {t.env.name}@{t.env.version} seed {t.env.seed}",
      f"prompt: {prompt}",
      f"termination {t.termination.value}  return {t.reward.total:g} (γ={t.reward.gamma:g}) "
      f"{dict(t.reward.components)}  verifier {t.verifier.name or '?'} {t.verifier.version} {verdict}",
      f"policy v{t.policy_version}  {len(t)} tokens, {int(t.loss_mask.sum())} trained  "
      f"reset {t.timing.reset_s:.3f}s verify {t.timing.verify_s:.3f}s",
  ]


def render_text(t: Trajectory, tokenizer=None, color: bool = True) -> str:
  """A trajectory for a person: the decoded stream by role (with a tokenizer) or the recorded turn texts."""
  paint = (lambda role, s: f"\x1b[{ANSI[role]}m{s}\x1b[0m") if color else (lambda role, s: s)
  lines = _header(t)
  if tokenizer is not None:
    parts = []
    for role, a, b in _role_runs(t):
      parts.append(paint(role, _safe(tokenizer.decode(t.tokens[a:b].tolist()))))
    lines.append("".join(parts))
  else:
    for i, turn in enumerate(t.turns):
      flag = "" if turn.action.valid else "  [invalid]"
      lines.append(f"--- turn {i}  reward {turn.reward:g}  policy v{turn.policy_version}  "
                   f"decode {turn.t_decode_s:.3f}s env {turn.t_env_s:.3f}s{flag}")
      lines.append(paint(Role.POLICY, _safe(turn.action.text)))
      if turn.observation is not None:
        obs = turn.observation
        role = _observation_role(t, obs)
        trunc = f"  [truncated from {obs.original_bytes} bytes]" if obs.truncated else ""
        lines.append(paint(role, _safe(obs.text)) + trunc)
  legend = " ".join(paint(r, r.name.lower()) for r in Role)
  return "\n".join(lines + [f"roles: {legend}", ""])


def _observation_role(t: Trajectory, obs) -> Role:
  """The role the stream gave an observation's tokens (TOOL, or ERROR for an error reply)."""
  return Role(int(t.roles[obs.span[0]])) if obs.span[1] > obs.span[0] else Role.TOOL


def trajectory_html(t: Trajectory, tokenizer=None, note: str = "") -> str:
  """One trajectory as an HTML `<section>` (its header with the prompt, then the stream by role), `note` (plain
  text, escaped) above it."""
  body = ["<section>"]
  if note:
    body.append(f"<p class=note>{html.escape(note)}</p>")
  body.append("<pre class=head>" + html.escape("\n".join(_header(t))) + "</pre><pre>")
  if tokenizer is not None:
    for role, a, b in _role_runs(t):
      text = tokenizer.decode(t.tokens[a:b].tolist())
      body.append(f"<span class=r{role.name.lower()} title={role.name.lower()}>{html.escape(text)}</span>")
  else:
    for i, turn in enumerate(t.turns):
      flag = "" if turn.action.valid else " [invalid]"
      body.append(f"<span class=rsystem>--- turn {i} reward {turn.reward:g} ({html.escape(turn.outcome)}){flag}"
                  "</span>\n")
      body.append(f"<span class=rpolicy title=policy>{html.escape(turn.action.text)}</span>\n")
      if turn.observation is not None:
        role = _observation_role(t, turn.observation).name.lower()
        trunc = f" [truncated from {turn.observation.original_bytes} bytes]" if turn.observation.truncated else ""
        body.append(f"<span class=r{role} title={role}>{html.escape(turn.observation.text)}</span>"
                    f"<span class=rsystem>{trunc}</span>\n")
  body.append("</pre></section>")
  return "".join(body)


def page(title: str, body: str) -> str:
  """A self-contained HTML page with the role colours and their legend; `body` is HTML already escaped."""
  style = "".join(f".r{r.name.lower()}{{color:{c}}}" for r, c in CSS.items())
  legend = " ".join(f"<span class=r{r.name.lower()}>{r.name.lower()}</span>" for r in Role)
  return (f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title><style>"
          "body{font-family:sans-serif;margin:1em}pre{white-space:pre-wrap;font-family:monospace}"
          "section{border-top:1px solid #ccc}.head{color:#444}.note{background:#fff3cd;padding:.4em}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}"
          + style + f"</style></head><body><p>roles: {legend}</p>{body}</body></html>\n")


def render_html(trajectories: Iterable[Trajectory], tokenizer=None, errors: Iterable[str] = ()) -> str:
  """One self-contained HTML page; every stored string is escaped."""
  errs = "".join(f"<p class=rerror>{html.escape(e)}</p>" for e in errors)
  return page("jaxagent trajectories", errs + "".join(trajectory_html(t, tokenizer) for t in trajectories))
