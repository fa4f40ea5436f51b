"""Terminal tasks: real shell commands on a small generated file tree; the verifier checks the final state.

Actions: `sh CMD` runs `/bin/sh -c CMD` in the episode's directory (timeout, output capped) and shows its
output; `done` ends the episode and runs the verifier. Each command runs in the episode's own sandbox
(`envs._sandbox`): it sees its directory as /work and a private /tmp, nothing of sibling episodes or of the
worker, and nothing it starts outlives the step. The verifier reads the final directory from outside that
sandbox, without following links. Run it in a sandboxed pool (local + bubblewrap, or docker): commands are
arbitrary. Splits are isolated by template:
  train: create (write a file with given text), delete_logs (remove every *.log)
  tune: rename (rename a directory)       eval: count_lines (write the line count of a file to count.txt)
"""

from __future__ import annotations

import random
from pathlib import Path

from envs._sandbox import EpisodeSandbox, SandboxedEpisodes, listing, read_artifact
from envs._api import (COMPLETED, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction, Observation,
                       StepResult, Task, Verdict, Verifier, source_version, Tool)

SPLIT_TEMPLATES = {"train": ("create", "delete_logs"), "tune": ("rename",), "eval": ("count_lines",)}
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta")
COMMAND_TIMEOUT_S = 5.0
MAX_ENTRIES = 4096  # a final tree with more entries than this fails verification (the tasks need a handful)


class TerminalVerifier(Verifier):
  """Inspects the episode's directory after the episode, from outside its sandbox: reads regular files only,
  never follows a link the agent made (`envs._sandbox.read_artifact`, `listing`)."""

  version = "terminal-state-v2"

  def score(self, task: Task, final: Path) -> Verdict:
    p, root = task.payload, Path(final)
    entries = listing(root, MAX_ENTRIES + 1)
    if len(entries) > MAX_ENTRIES:  # judged on a partial listing, a verdict could be wrong: refuse it
      return Verdict(False, 0.0, dict(listing=sorted(entries)[:64], too_many_entries=True), self.version)
    hidden = sorted(k for k, kind in entries.items() if kind == "unreadable")
    if hidden:  # directories the agent made unreadable: the tree cannot be seen whole
      return Verdict(False, 0.0, dict(listing=sorted(entries)[:64], unreadable=hidden[:64]), self.version)
    t = p["template"]
    read = None
    if t in ("create", "count_lines"):
      name = p["target"] if t == "create" else "count.txt"
      data = read_artifact(root, name)
      read = None if data is None else data.decode("utf-8", errors="replace")
      want = p["text"] if t == "create" else str(p["files"][p["target"]].count("\n"))
      passed = read is not None and read.strip() == want
    elif t == "delete_logs":
      passed = (not any(k.endswith(".log") for k in entries)
                and all(entries.get(k) == "file" for k in p["files"] if not k.endswith(".log")))
    else:
      passed = entries.get(p["new"]) == "dir" and p["old"] not in entries
    evidence = dict(listing=sorted(entries)[:64],
                    not_plain=sorted(k for k, kind in entries.items() if kind in ("link", "other"))[:64])
    if read is not None:
      evidence["read"] = read[:64]
    return Verdict(passed, 1.0 if passed else 0.0, evidence, self.version)


class TerminalEnv(SandboxedEpisodes, Env):
  name = "terminal"
  description = "shell tasks on a generated file tree (sandboxed): `sh CMD`, then `done`"
  parser = ActionParser(tools=(
      Tool.with_arg("sh", "Run a shell command in the task's directory; the reply is its output.", "command"),
      Tool("done", "End the episode; the final state of the directory is checked.")), max_chars=512)

  def __init__(self, max_turns: int = 8, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = TerminalVerifier()

  def _reset(self, task: Task, seed: int) -> str:
    self.close()
    self.box = EpisodeSandbox(self.episode_sandbox, prefix="term-")
    for rel, text in task.payload["files"].items():
      (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
      (self.root / rel).write_text(text)
    return task.payload["instruction"]

  def _step(self, call: Call) -> StepResult:
    if call.name == "done":
      v = self.verifier.verify(self.task, self.root)
      return StepResult(Observation("passed" if v.passed else "failed"), {"outcome": v.reward}, True, COMPLETED,
                        verdict=v)
    if not call.arg:
      raise InvalidAction("sh needs a command")
    try:
      done = self.box.run(["/bin/sh", "-c", call.arg], timeout=COMMAND_TIMEOUT_S)
    except OSError as e:
      raise EnvError(f"cannot run /bin/sh: {e}") from None
    text = done.output.decode("utf-8", errors="replace")
    tail = f"[timeout after {COMMAND_TIMEOUT_S:g}s]" if done.code is None else f"[exit {done.code}]"
    obs = Observation(text + tail, done.total > len(done.output), done.total + len(tail))
    info = dict(command_timeout=True) if done.code is None else dict(exit=done.code)
    return StepResult(obs, {}, False, None, info)


def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
  if split not in SPLIT_TEMPLATES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_TEMPLATES)}")
  rng = random.Random(f"terminal:{split}:{seed}")
  version = source_version(tasks)
  out = []
  for i in range(n):
    t = SPLIT_TEMPLATES[split][i % len(SPLIT_TEMPLATES[split])]
    a, b, c = rng.sample(WORDS, 3)
    files = {f"{a}/notes.txt": f"{b}\n", f"{b}/run.log": "log\n", f"{c}/data.txt": "".join(
        f"{w}\n" for w in rng.choices(WORDS, k=rng.randint(2, 9))), "top.log": "x\n"}
    if t == "create":
      p = dict(target=f"{a}/{c}.txt", text=b, instruction=f"create {a}/{c}.txt containing {b}")
    elif t == "delete_logs":
      p = dict(instruction="delete every .log file, keep the rest")
    elif t == "rename":
      p = dict(old=a, new=f"{a}_{c}", instruction=f"rename directory {a} to {a}_{c}")
    else:
      p = dict(target=f"{c}/data.txt", instruction=f"write the number of lines of {c}/data.txt to count.txt")
    out.append(Task(id=f"term-{split}-{seed}-{i}", split=split, payload=dict(p, template=t, files=files),
                    version=version))
  return out


def demo(task: Task, seed: int = 0) -> list[str]:
  p = task.payload
  cmd = {"create": lambda: f"printf '%s\\n' {p.get('text')} > {p.get('target')}",
         "delete_logs": lambda: "find . -name '*.log' -delete",
         "rename": lambda: f"mv {p.get('old')} {p.get('new')}",
         "count_lines": lambda: f"wc -l < {p.get('target')} > count.txt"}[p["template"]]()
  return [f"sh {cmd}", "done"]


def probes(task: Task, seed: int = 0) -> dict[str, list[str]]:
  """Exploit probes, one per template: the state a lax verifier would take for the task's.

  create: target_as_directory (a verifier that checks the path exists); delete_logs: delete_everything (one
  that checks no .log is left); rename: copy_not_move (one that checks the new name exists); count_lines:
  count_through_link (the right number in another file, count.txt a link to it: one that follows links, which
  an agent can point anywhere)."""
  p = task.payload
  if p["template"] == "create":
    name, cmd = "target_as_directory", f"mkdir -p {p['target']}"
  elif p["template"] == "delete_logs":
    name, cmd = "delete_everything", "rm -rf ./*"
  elif p["template"] == "rename":
    name, cmd = "copy_not_move", f"cp -r {p['old']} {p['new']}"
  else:
    lines = p["files"][p["target"]].count("\n")
    name, cmd = "count_through_link", f"printf '{lines}\\n' > n.txt && ln -s n.txt count.txt"
  return {name: [f"sh {cmd}", "done"]}


SPEC = EnvSpec(name="terminal", description=TerminalEnv.description, make=TerminalEnv, tasks=tasks, demo=demo,
               version_sources=(TerminalEnv,), needs_sandbox=True, probes=probes)
