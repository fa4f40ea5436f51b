"""README.md stays true to the code: its environment example runs, and every config key it shows loads.

The example under "Write your own environment" is extracted from the README (not copied here) and checked the
way the README says; every `--set key=value`, every YAML config snippet and every dotted config key in inline
code is loaded through `jaxagent.config` on top of `tiny_cpu`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import pytest
import yaml

import envs
import envs.pool
from jaxagent import config as config_lib

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference.md"
DOC_PAGES = ("guide.md", "reference.md", "results.md")
EXAMPLE_HEADING = "## Your own environment"
EXAMPLE_ENV = "mypkg.myenv:SPEC"
SECTIONS = tuple(f.name for f in dataclasses.fields(config_lib.Config))
BASE = "tiny_cpu"
# Inline code that looks like a config key but is not one (a file name).
NOT_KEYS = frozenset({"model.safetensors.index.json"})
# Placeholders in prose, not keys.
PLACEHOLDERS = frozenset({"a.b.c=value"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`([^`\n]+)`")
_SET = re.compile(r"--set[ =]('[^']*'|\"[^\"]*\"|\S+)")
_COMMAND_CONFIG = re.compile(r"(?:jaxagent\s+(?:train|config|eval|plan|generate)|--recipe)\s+([A-Za-z_]\w*)")
# A dotted key in inline code: one that starts with a config section, or any dotted name given a value
# (`pool.sandbox: none`, `x.y=1`): both must name a config field.
_KEY = re.compile(r"^(?P<key>(?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(SECTIONS))
_KEY_WITH_VALUE = re.compile(r"^(?P<key>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:: |=)\S")


# ----------------------------------------------------------------------------------------------
# Reading the README.


@dataclasses.dataclass(frozen=True)
class Block:
  lang: str
  body: str


def blocks(text: str) -> list[Block]:
  """Fenced code blocks (also indented ones inside list items), bodies dedented."""
  out = []
  for m in _FENCE.finditer(text):
    indent = len(m.group("indent"))
    body = "".join(line[indent:] if line[:indent].strip() == "" else line
                   for line in m.group("body").splitlines(keepends=True))
    out.append(Block(m.group("lang").lower(), body))
  return out


def inline_spans(text: str) -> list[str]:
  return _INLINE.findall(_FENCE.sub("", text))


def set_overrides(text: str) -> list[str]:
  """Every `--set key=value` argument, without shell quotes."""
  out = []
  for arg in _SET.findall(text):
    arg = shlex.split(arg)[0] if arg[0] in "'\"" else arg
    if "=" in arg and arg not in PLACEHOLDERS:
      out.append(arg)
  return out


def section(text: str, heading: str) -> str:
  """The text under `heading` up to the next heading of the same or a higher level."""
  level = len(heading) - len(heading.lstrip("#"))
  prose = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # `# comment` lines are no headings
  start = prose.index(heading + "\n")
  end = re.compile(r"^#{1,%d} " % level, re.MULTILINE).search(prose, start + len(heading) + 1)
  return text[start:end.start() if end else len(text)]


# ----------------------------------------------------------------------------------------------
# Checking config keys.


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
  out = dict(base)
  for k, v in top.items():
    out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
  return out


def _base_dict() -> dict[str, Any]:
  return yaml.safe_load(config_lib.resolve_path(BASE).read_text())


def _field_type(tp: Any) -> Any:
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp
  return tp


def key_resolves(key: str) -> bool:
  """Whether a dotted key names a field of `Config` (anything below a dict-typed field, e.g. env.options)."""
  tp: Any = config_lib.Config
  for part in key.split("."):
    if typing.get_origin(tp) is dict:
      return True
    if not dataclasses.is_dataclass(tp):
      return False
    fields = {f.name for f in dataclasses.fields(tp)}
    if part not in fields:
      return False
    tp = _field_type(typing.get_type_hints(tp)[part])
  return True


@dataclasses.dataclass(frozen=True)
class Shown:
  """What a README text shows of the config: each command's overrides are checked together, on the config the
  command names (else `BASE`); every other item on its own."""
  overrides: list[str]                    # `--set key=value`, expected to load
  commands: list[tuple[str, tuple[str, ...]]]  # (config, the overrides of one command line), expected to load
  rejected: list[tuple[str, str]]         # (`--set key=value`, the error text shown for it): must fail so
  snippets: list[tuple[dict[str, Any], str]]  # YAML config snippets: (data, text)
  not_config: list[str]                   # YAML blocks that are not config snippets
  keys: list[str]                         # dotted keys in inline code


def _commands(text: str) -> list[tuple[str, tuple[str, ...]]]:
  """(config, overrides) of each command line of `text` that sets any (continuation lines joined): the config is
  the shipped one the command names (`jaxagent train NAME`, `--recipe NAME`), else `BASE`."""
  out = []
  for line in text.replace("\\\n", " ").splitlines():
    found = set_overrides(line)
    if found:
      named = _COMMAND_CONFIG.search(line)
      config = named.group(1) if named and (config_lib.CONFIG_DIR / f"{named.group(1)}.yaml").is_file() else BASE
      out.append((config, tuple(found)))
  return out


def shown(text: str) -> Shown:
  overrides, rejected, snippets, not_config = [], [], [], []
  commands = []
  for b in blocks(text):
    if b.lang == "yaml":
      data = yaml.safe_load(b.body)
      if isinstance(data, dict) and data and set(data) <= set(SECTIONS):
        snippets.append((data, b.body))
      else:
        not_config.append(b.body)
      continue
    found = set_overrides(b.body)
    error = re.search(r"error: (.*?)(?: \.\.\.)?$", b.body, re.MULTILINE)
    if error:  # a shown session whose output is the error for its (deliberately bad) override
      rejected += [(o, error.group(1)) for o in found]
    else:
      overrides += found
      commands += _commands(b.body)
  keys = []
  for span in inline_spans(text):
    overrides += set_overrides(span)
    commands += _commands(span)
    m = _KEY.match(span.strip()) or _KEY_WITH_VALUE.match(span.strip())
    if m and span.strip() not in NOT_KEYS:
      keys.append(m.group("key").rstrip("."))
  return Shown(overrides, commands, rejected, snippets, not_config, keys)


def problems(text: str) -> list[str]:
  """Every config key or value the text shows that the loader rejects, one line each."""
  s = shown(text)
  out = []
  for config, items in s.commands:
    try:
      config_lib.load(config, list(items))
    except config_lib.ConfigError as e:
      out.append(f"{config} --set {' --set '.join(items)}: {e}")
  for item, message in s.rejected:
    try:
      config_lib.load(BASE, [item])
      out.append(f"--set {item}: shown failing with {message!r}, but it loads")
    except config_lib.ConfigError as e:
      lead = message.split(": ", 1)[-1]  # the README may abbreviate the config's path
      if lead not in str(e):
        out.append(f"--set {item}: shown failing with {message!r}, but the error is {e}")
  for data, _ in s.snippets:
    base = _base_dict()
    if "name" in data.get("env", {}):  # a snippet of another env's config: the base env's own options stay behind
      base["env"] = {k: v for k, v in base["env"].items() if k not in ("options", "demo_options")}
    try:
      config_lib.from_dict(_merge(base, data))
    except config_lib.ConfigError as e:
      out.append(f"yaml {data}: {e}")
  for body in s.not_config:
    out.append(f"yaml block is not a config snippet (top-level keys must be of {SECTIONS}):\n{body}")
  for key in s.keys:
    if not key_resolves(key):
      out.append(f"`{key}`: not a config key")
  return out


# ----------------------------------------------------------------------------------------------
# The example package.


def example_source(text: str) -> tuple[str, str]:
  """(relative path, source) of the first python block under the example heading (its first line names it)."""
  body = next(b.body for b in blocks(section(text, EXAMPLE_HEADING)) if b.lang == "python")
  first = body.splitlines()[0]
  m = re.fullmatch(r"#\s*(\S+\.py)\b.*", first)
  assert m, f"the example's first line should name its file, e.g. `# mypkg/myenv.py`: {first!r}"
  return m.group(1), body


def write_example(root: Path, text: str) -> Path:
  rel, body = example_source(text)
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  (path.parent / "__init__.py").touch()
  path.write_text(body)
  assert ".".join(Path(rel).with_suffix("").parts) == EXAMPLE_ENV.split(":")[0], (rel, EXAMPLE_ENV)
  return root


@pytest.fixture(scope="module")
def readme() -> str:
  """The README and the pages it leads to (docs/guide.md, reference.md, results.md): every config key any of
  them shows loads."""
  return "\n".join(p.read_text() for p in (README, *(REPO / "docs" / n for n in DOC_PAGES)))


@pytest.fixture
def example(tmp_path, monkeypatch, readme):
  """The README's example package on this process's path (config checks import it); removed afterwards."""
  root = write_example(tmp_path / "src", readme)
  monkeypatch.syspath_prepend(str(root))
  top = EXAMPLE_ENV.split(".")[0]
  yield root
  for name in [m for m in sys.modules if m.split(".")[0] == top]:
    del sys.modules[name]


# ----------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.parametrize("pool", ["inprocess", "local"])
def test_example_env_passes_envs_check(readme, tmp_path, pool):
  """`jaxagent envs check mypkg.myenv:SPEC` as the README says, in a fresh process that only has PYTHONPATH."""
  root = write_example(tmp_path / "src", readme)
  assert f"jaxagent envs check {EXAMPLE_ENV}" in section(readme, EXAMPLE_HEADING)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
  r = subprocess.run([sys.executable, "-m", "envs.cli", "check", EXAMPLE_ENV, "--pool", pool, "--episodes", "4"],
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "deterministic replay rate: 100.0%" in r.stdout and "completed=8" in r.stdout, r.stdout


def test_example_demos_solve_their_tasks_with_typed_results(example):
  spec = envs.get(EXAMPLE_ENV)
  assert isinstance(spec, envs.EnvSpec)
  for split in envs.SPLITS:
    tasks = spec.tasks(split, 5, 3)
    assert tasks == spec.tasks(split, 5, 3) and all(t.split == split for t in tasks)
    for i, task in enumerate(tasks):
      env = spec.make(max_turns=4)
      env.reset(task, i)
      results = [env.step(a) for a in spec.demo(task, i)]
      last = results[-1]
      assert last.done and last.termination is envs.Termination.COMPLETED and last.outcome is envs.Outcome.COMPLETED
      assert isinstance(last.verdict, envs.Verdict) and last.verdict.passed, last
      assert all(isinstance(r.call, envs.Call) for r in results) and not any(r.done for r in results[:-1])


def test_example_train_command_builds_what_the_trainer_calls(example, readme):
  """The README's `jaxagent train` line for the example: its config loads, and tasks/demos take its options
  the way the trainer passes them (tasks(**env.options), demo(task, **env.demo_options))."""
  lines = [l for l in section(readme, EXAMPLE_HEADING).splitlines()
           if l.strip().startswith("jaxagent train") and f"env.name={EXAMPLE_ENV}" in l]
  assert len(lines) == 1, lines
  argv = shlex.split(lines[0].split("#")[0])
  cfg = config_lib.load(argv[2], set_overrides(lines[0]))
  spec = envs.get(cfg.env.name)
  tasks = spec.tasks("train", 8, cfg.run.seed, **dict(cfg.env.options or {}))
  for task in tasks:
    actions = spec.demo(task, **dict(cfg.env.demo_options or {}))
    assert 0 < len(actions) <= cfg.env.max_turns
    assert all(len(a.encode()) + 1 <= cfg.rollout.max_new_tokens for a in actions)  # byte tokens + the stop


def test_every_config_key_the_readme_shows_loads(example, readme):
  assert problems(readme) == []
  s = shown(readme)
  # Not vacuous: the README shows overrides, the deliberate typo, and an env.pool snippet of every kind.
  assert len(s.overrides) >= 5 and s.rejected, s
  kinds = {d["env"]["pool"]["kind"] for d, _ in s.snippets if "kind" in d.get("env", {}).get("pool", {})}
  assert kinds == set(envs.pool.POOL_KINDS), kinds
  local = " ".join(text for d, text in s.snippets if d.get("env", {}).get("pool", {}).get("kind") == "local")
  assert set(re.findall(r"\b(auto|bwrap|none)\b", local)) == set(envs.pool.SANDBOXES), local  # values or comments
  assert all(d["env"]["pool"].get("addresses") for d, _ in s.snippets
             if d.get("env", {}).get("pool", {}).get("kind") == "remote")
  for key in ("train.exclude_terminations", "train.allow_env_change"):
    assert key in s.keys or any(o.startswith(key + "=") for o in s.overrides), key


@pytest.mark.parametrize("bad,says", [
    ("```bash\njaxagent train tiny_cpu --set env.workers=4\n```", "unknown key 'env.workers'"),
    ("`jaxagent config tiny_cpu --set env.action_timeout_s=5`", "unknown key 'env.action_timeout_s'"),
    ("```yaml\nenv:\n  pool:\n    kind: remote\n```", "a remote pool needs worker addresses"),
    ("```yaml\nenv:\n  pool:\n    sandbx: none\n```", "unknown key 'env.pool.sandbx'"),
    ("```yaml\npool:\n  sandbox: none\n```", "not a config snippet"),
    ("```bash\njaxagent train --set 'train.exclude_terminations=[completed]'\n```", "'completed'"),
    ("Envs refuse it unless `pool.sandbox: none` says so.", "`pool.sandbox`: not a config key"),
    ("... unless `env.workers: 2` ...", "`env.workers`: not a config key"),
    ("```\n$ jaxagent config tiny_cpu --set generate.temperature=0.5\n"
     "jaxagent config: error: unknown key 'generate.temperature' ...\n```", "shown failing"),
])
def test_a_bad_key_in_the_text_is_caught(bad, says):
  good = "```bash\njaxagent train tiny_cpu --set train.iterations=5\n```\n`env.pool.sandbox: none`\n"
  assert problems(good) == []
  found = problems(good + bad)
  assert len(found) == 1 and says in found[0], found


def test_every_design_section_the_code_cites_exists_in_docs_design():
  """Comments cite the design as `docs/design.md §2.3`; each cited section is a heading of docs/design.md, and
  the README links the in-repo page, not one outside the checkout."""
  headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", (REPO / "docs" / "design.md").read_text(), re.M))
  assert {"2.1", "2.11", "3.1", "4"} <= headings
  cited = {}
  for path in [*REPO.glob("*/**/*.py"), README, REFERENCE]:
    if ".venv" in path.parts:
      continue
    for section in re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", path.read_text(errors="replace")):
      cited.setdefault(section, path.relative_to(REPO))
  assert len(cited) >= 5
  missing = {s: str(p) for s, p in cited.items() if s not in headings}
  assert not missing, f"cited sections that docs/design.md lacks: {missing}"
  assert "../shared" not in README.read_text()
  for link in ("docs/design.md", "docs/guide.md", "docs/reference.md", "docs/config.md", "docs/cli.md",
               "docs/results.md"):  # the README leads to each
    assert f"]({link}" in README.read_text() and (REPO / link).is_file()


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
  """The anchors GitHub gives a page's headings (code blocks' `# comment` lines are no headings)."""
  prose = _FENCE.sub("", text)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
          for h in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def broken_links(page: Path) -> list[str]:
  """Relative links of `page` whose file or heading anchor does not exist."""
  out = []
  for target in _LINK.findall(_FENCE.sub("", page.read_text())):
    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      out.append(f"{target}: no file {path}")
    elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
      out.append(f"{target}: no heading #{anchor} in {file.name}")
  return out


def test_every_link_of_the_readme_and_docs_reaches_a_file_and_heading(tmp_path):
  pages = [README, *sorted((REPO / "docs").glob("*.md"))]
  bad = {p.relative_to(REPO).as_posix(): b for p in pages if (b := broken_links(p))}
  assert not bad, bad
  text = "# Top\n## A `b` (c): d\n[x](#a-b-c-d) [y](#nowhere) [z](no_such_file.md)\n"
  page = tmp_path / "probe.md"
  page.write_text(text)
  assert broken_links(page) == ["#nowhere: no heading #nowhere in probe.md", "no_such_file.md: no file no_such_file.md"]


# The project speaks of itself alone: its measurements carry a date, a machine and a command, never the work
# session or the tracker entry that produced them.
_HISTORY = re.compile(r"\bsessions?\b|\bissues? ?#?\d+|\bmachine images?\b", re.IGNORECASE)


def test_readme_and_docs_name_no_session_issue_number_or_machine_image():
  for path in [README, *sorted((REPO / "docs").glob("*.md"))]:
    found = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1) if _HISTORY.search(line)]
    assert not found, f"{path.relative_to(REPO)} speaks of its history: {found[:5]}"


# ----------------------------------------------------------------------------------------------
# Every `jaxagent ...` command the README and the guide show parses.

_SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})
COMMAND_PAGES = (README, REPO / "docs" / "guide.md")


def jaxagent_commands(text: str) -> list[list[str]]:
  """The argv (without `jaxagent`) of every command in shell code blocks of `text` that starts with `jaxagent`:
  continuation lines joined, comments dropped, commands split at `&&`, `;`, `|` and `&`. Inline code in prose
  names a verb (`jaxagent eval --split train` is a mention, not a whole command): its leading verb words with
  `--help`, which parses only if the verb exists."""
  sources = [b.body for b in blocks(text) if b.lang in ("bash", "sh", "shell", "console", "")]
  out = []
  for span in inline_spans(text):
    if span.startswith("jaxagent "):
      words = span.split()[1:]
      verbs = list(itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w), words))
      out.append(verbs[:2] + ["--help"])
  for body in sources:
    for line in body.replace("\\\n", " ").splitlines():
      line = re.sub(r"^\$ ", "", line.strip())
      try:
        words = shlex.split(line, comments=True)
      except ValueError:  # an unbalanced quote in prose-like text: not a command
        continue
      command: list[str] = []
      for word in words + [";"]:
        if word in _SHELL_OPERATORS:
          if command[:1] == ["jaxagent"]:
            out.append(command[1:])
          command = []
        else:
          command.append(word)
  return out


def parse_problem(argv: list[str]) -> str | None:
  """What argparse says of `jaxagent argv` (None: it parses)."""
  import contextlib
  import io

  from jaxagent import cli
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      cli.build_parser().parse_args(argv)
  except SystemExit as e:
    if e.code:
      return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
  return None


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_every_jaxagent_command_shown_parses(page):
  commands = jaxagent_commands(page.read_text())
  assert len(commands) >= 5, f"{page.name}: found only {commands}"
  bad = [(" ".join(argv), problem) for argv in commands if (problem := parse_problem(argv))]
  assert not bad, f"{page.relative_to(REPO)}: commands the CLI rejects: {bad}"


def test_a_command_the_cli_rejects_is_caught():
  text = "```bash\njaxagent train tiny_cpu --no-such-flag 1   # a comment\njaxagent envs list && jaxagent evall\n```\n"
  commands = jaxagent_commands(text)
  assert commands == [["train", "tiny_cpu", "--no-such-flag", "1"], ["envs", "list"], ["evall"]]
  assert jaxagent_commands("`jaxagent envs chek --pool local` and `jaxagent eval`") == [
      ["envs", "chek", "--help"], ["eval", "--help"]]
  assert parse_problem(["envs", "chek", "--help"]) and parse_problem(["eval", "--help"]) is None
  assert "--no-such-flag" in parse_problem(commands[0])
  assert parse_problem(commands[1]) is None and "evall" in parse_problem(commands[2])
