"""Calculator tool use: 2-step arithmetic solved by calling `calc`, then `answer`.

Actions (one line each): `calc 12*7` -> observation `84`; `answer 89` ends the episode. The question is the
first observation, e.g. `12*7+5`. Short, regular actions so a ~1M-parameter byte model learns them on CPU.

Splits are isolated by template (the shape of the expression), not by id:
  train: a*b+c, a*b-c, (a+b)*c, a+b+c, a+b-c, a*b*c, a-(b+c), a*(b+c)    tune: (a-b)*c
  eval: a+b*c, a*(b-c)
Difficulty: `max_operand` bounds the numbers (default 9: single digits).
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random

from envs._api import (COMPLETED, ActionParser, Call, Env, EnvSpec, InvalidAction, Observation, StepResult,
                       Task, Verdict, Verifier, source_version, Tool)

# template -> (question format, the two steps as (format, uses previous result) used by the demo)
TEMPLATES = {
    "a*b+c": ("{a}*{b}+{c}", ["{a}*{b}", "{r}+{c}"]),
    "a*b-c": ("{a}*{b}-{c}", ["{a}*{b}", "{r}-{c}"]),
    "(a+b)*c": ("({a}+{b})*{c}", ["{a}+{b}", "{r}*{c}"]),
    "a+b+c": ("{a}+{b}+{c}", ["{a}+{b}", "{r}+{c}"]),
    "a+b-c": ("{a}+{b}-{c}", ["{a}+{b}", "{r}-{c}"]),
    "a*b*c": ("{a}*{b}*{c}", ["{a}*{b}", "{r}*{c}"]),
    "a-(b+c)": ("{a}-({b}+{c})", ["{b}+{c}", "{a}-{r}"]),
    "(a-b)*c": ("({a}-{b})*{c}", ["{a}-{b}", "{r}*{c}"]),
    "a+b*c": ("{a}+{b}*{c}", ["{b}*{c}", "{a}+{r}"]),
    "a*(b-c)": ("{a}*({b}-{c})", ["{b}-{c}", "{a}*{r}"]),
    "a*(b+c)": ("{a}*({b}+{c})", ["{b}+{c}", "{a}*{r}"]),
}
# Every held-out template is built from character pairs that occur in some training question (`*(` only in
# a*(b+c)): the held-out split tests copying a new *shape*, not bytes the policy never saw. Measured with the
# default run (64 eval episodes, 32 per template): a+b*c is learned by RL (14/32 solved after 250 iterations),
# a*(b-c) stays hard (1/32: the tiny policy copies it as the training shape a-(b+c)).
SPLIT_TEMPLATES = {"train": ("a*b+c", "a*b-c", "(a+b)*c", "a+b+c", "a+b-c", "a*b*c", "a-(b+c)", "a*(b+c)"),
                   "tune": ("(a-b)*c",), "eval": ("a+b*c", "a*(b-c)")}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPR_CHARS = 32


def safe_eval(expr: str) -> int:
  """Integer +, -, * and parentheses only (parsed with `ast`, never `eval`)."""
  if len(expr) > MAX_EXPR_CHARS:
    raise InvalidAction(f"expression longer than {MAX_EXPR_CHARS} chars")
  try:
    tree = ast.parse(expr, mode="eval")
  except SyntaxError:
    raise InvalidAction(f"cannot parse {expr!r}; use integers with + - * and ()") from None

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    raise InvalidAction(f"unsupported expression {expr!r}; use integers with + - * and ()")

  return ev(tree)


class CalculatorVerifier(Verifier):
  """Exact integer match of the submitted answer with the expression's value."""

  version = "calc-exact-v1"

  def score(self, task: Task, final: str) -> Verdict:
    expected = safe_eval(task.payload["question"])
    try:
      got = int(final.strip())
    except ValueError:
      got = None
    passed = got == expected
    return Verdict(passed, 1.0 if passed else 0.0, dict(expected=expected, got=final[:32]), self.version)


class CanonicalAnswerVerifier(Verifier):
  """Held-out: the value written as a person would accept it, a plain decimal integer (no sign but a leading
  minus, no padding zeros, no underscores, no spaces). The training verifier parses with `int()`, which also
  takes " +0_89 ": the gap between the two is a parser that grew lax, measured, never trained on."""

  version = "calc-canonical-v1"

  def score(self, task: Task, final: str) -> Verdict:
    expected = safe_eval(task.payload["question"])
    passed = final == str(expected)
    return Verdict(passed, 1.0 if passed else 0.0, dict(expected=str(expected), got=final[:32]), self.version)


class CalculatorEnv(Env):
  name = "calculator"
  description = "2-step arithmetic with a calc tool: `calc 12*7` -> `84`, then `answer 89`"
  parser = ActionParser(tools=(
      Tool.with_arg("calc", "Evaluate an integer expression with + - * and parentheses; returns its value.",
                    "expression", "e.g. 12*7"),
      Tool.with_arg("answer", "Submit the final integer answer; ends the episode.", "answer", "e.g. 89",
                    ["string", "integer"])), max_chars=48)

  def __init__(self, max_turns: int = 6, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = CalculatorVerifier()
    self.heldout_verifier = CanonicalAnswerVerifier()

  def _reset(self, task: Task, seed: int) -> str:
    return task.payload["question"]

  def _step(self, call: Call) -> StepResult:
    if call.name == "calc":
      value = safe_eval(call.arg)
      return StepResult(Observation(str(value)), {"validity": 0.0}, False, None, {})
    verdict = self.judge(call.arg)
    return StepResult(Observation("correct" if verdict.passed else "wrong"), {"outcome": verdict.reward}, True,
                      COMPLETED, verdict=verdict)

  def snapshot(self):
    return dict(turn=self.turn, done=self.done)

  def restore(self, state) -> None:
    self.turn, self.done = int(state["turn"]), bool(state["done"])


def tasks(split: str, n: int, seed: int = 0, max_operand: int = 9) -> list[Task]:
  """`n` deterministic tasks of `split`, numbers in 1..max_operand (subtractions stay >= 0)."""
  if split not in SPLIT_TEMPLATES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_TEMPLATES)}")
  if max_operand < 2:
    raise ValueError(f"max_operand={max_operand}: must be >= 2")
  rng = random.Random(f"calculator:{split}:{seed}:{max_operand}")
  version = source_version(tasks, extra=f"max_operand={max_operand}")
  out = []
  for i in range(n):
    template = SPLIT_TEMPLATES[split][i % len(SPLIT_TEMPLATES[split])]
    a, b, c = (rng.randint(1, max_operand) for _ in range(3))
    if template == "(a-b)*c":
      a, b = max(a, b), min(a, b)
    if template == "a*(b-c)":
      b, c = max(b, c), min(b, c)
    if template == "a*b-c":
      c = rng.randint(0, a * b)
    if template == "a+b-c":
      c = rng.randint(0, a + b)
    if template == "a-(b+c)":
      a = b + c + rng.randint(0, max_operand)
    question = TEMPLATES[template][0].format(a=a, b=b, c=c)
    tid = hashlib.sha256(f"{template}:{question}".encode()).hexdigest()[:10]
    out.append(Task(id=f"calc-{tid}", split=split, payload=dict(question=question, template=template, a=a, b=b,
                                                                 c=c), version=version))
  return out


DEMO_STYLES = ("steps", "direct", "mixed")


def demo(task: Task, seed: int = 0, style: str = "steps", direct_fraction: float = 0.5) -> list[str]:
  """Scripted solution. `steps`: the template's two calc steps, then the answer (3 calls); `direct`: one calc of
  the whole question, then the answer (2 calls: a template-agnostic skill, copy the question, copy the tool's
  result); `mixed`: a log of both solvers, `direct` for a `direct_fraction` of episodes (drawn from the task id
  and the episode's seed, so the same demonstration set every run), `steps` for the rest."""
  if style not in DEMO_STYLES:
    raise ValueError(f"demo style={style!r}: not one of {DEMO_STYLES}")
  if not 0.0 <= direct_fraction <= 1.0:
    raise ValueError(f"demo direct_fraction={direct_fraction!r}: must be a fraction in [0, 1]")
  if style == "mixed":
    style = "direct" if random.Random(f"calculator-demo:{task.id}:{seed}").random() < direct_fraction else "steps"
  p = task.payload
  if style == "direct":
    return [f"calc {p['question']}", f"answer {safe_eval(p['question'])}"]
  first, second = TEMPLATES[p["template"]][1]
  r = safe_eval(first.format(**p))
  return [f"calc {first.format(**p)}", f"calc {second.format(r=r, **p)}", f"answer {safe_eval(p['question'])}"]


def probes(task: Task, seed: int = 0) -> dict[str, list[str]]:
  """Exploit probes: answers that know the value (or skip the arithmetic) in a form only a lax verifier takes.

  expression_as_answer: the question handed back (a verifier that evaluates the answer would take it);
  several_numbers: the value among its neighbours (one that looks for the value among the numbers given);
  wrong_format: the value as a decimal (one that parses the answer as a float)."""
  q = task.payload["question"]
  v = safe_eval(q)
  return {"expression_as_answer": [f"answer {q}"], "several_numbers": [f"answer {v - 1} {v} {v + 1}"],
          "wrong_format": [f"answer {v}.0"]}


SPEC = EnvSpec(name="calculator", description=CalculatorEnv.description, make=CalculatorEnv, tasks=tasks,
               demo=demo, version_sources=(CalculatorEnv,), probes=probes)
