"""JSON tool calls (envs): schemas, parsing, the invalid-action rule for bad calls, and the wire."""

import json

import pytest

import envs
import envs.pool
from envs.builtin.calculator import CalculatorEnv

TASK = envs.Task(id="t0", split="train", payload={"question": "3*4+5", "template": "a*b+c", "a": 3, "b": 4, "c": 5},
                 version="v")


def _step(action: str, syntax: str = "json", rule: str = "error_observation") -> envs.StepResult:
  env = CalculatorEnv(action_syntax=syntax, invalid_action=envs.InvalidActionRule(rule))
  env.reset(TASK, 0)
  return env.step(action)


@pytest.mark.parametrize("action", [
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "3*4"}}\n</tool_call>',  # Qwen / Hermes
    '{"name": "calc", "arguments": {"expression": "3*4"}}',                              # bare
    '{"name": "calc", "parameters": {"expression": "3*4"}}',                             # Llama 3
    '{"name": "calc", "arguments": "{\\"expression\\": \\"3*4\\"}"}',                    # OpenAI string
    '[{"name": "calc", "arguments": {"expression": "3*4"}}]',                            # a list of one
])
def test_json_calls_in_each_convention_parse_to_the_same_call(action):
  result = _step(action)
  assert result.outcome == envs.Outcome.OK and result.observation.text == "12"
  assert result.call == envs.Call("calc", "3*4", {"expression": "3*4"})


@pytest.mark.parametrize("action, outcome, message", [
    ('{"name": "calc", "arguments": {"expression": "3*4"}', "parser_rejected_continued",
     "malformed JSON tool call: Expecting ',' delimiter (line 1, column 52)"),
    ('<tool_call>{"name": "calc"}', "parser_rejected_continued", "<tool_call> without its closing </tool_call>"),
    ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call><tool_call>{}</tool_call>',
     "parser_rejected_continued", "one tool call per action, got 2"),
    ('{"arguments": {}}', "parser_rejected_continued", 'a tool call is a JSON object {"name"'),
    ("calc 3*4", "parser_rejected_continued", "malformed JSON tool call"),  # the line form is not JSON
    ('{"name": "sqrt", "arguments": {"x": 4}}', "invalid_action_continued", "unknown tool 'sqrt'; tools are calc answer"),
    ('{"name": "calc", "arguments": {}}', "invalid_action_continued",
     "bad arguments for 'calc': arguments: 'expression' is a required property"),
    ('{"name": "calc", "arguments": {"expression": 12}}', "invalid_action_continued",
     "bad arguments for 'calc': expression: 12 is not of type 'string'"),
    ('{"name": "calc", "arguments": [1]}', "invalid_action_continued", "arguments of 'calc' must be a JSON object"),
    ('{"name": "calc", "arguments": {"expression": "2**99"}}', "invalid_action_continued",
     "unsupported expression"),  # well-formed call, refused by the tool itself
    ('{"name": "answer", "arguments": {"answer": 100000000000000000000000}}', "invalid_action_continued",
     "does not fit in 64 bits"),  # valid JSON and schema, but the env wire (msgpack) carries int64
])
def test_bad_json_calls_follow_the_invalid_action_rule_with_a_precise_error(action, outcome, message):
  result = _step(action)
  assert result.outcome.value == outcome and not result.done
  assert result.observation.text.startswith("error: ") and message in result.observation.text, result.observation
  ended = _step(action, rule="terminate")  # the same rejection under another rule ends the episode
  assert ended.done and ended.termination.value == outcome.replace("_continued", "")


def test_line_syntax_is_unchanged_and_json_is_opt_in():
  assert _step("calc 3*4", syntax="line").call == envs.Call("calc", "3*4")
  assert _step('{"name": "calc", "arguments": {"expression": "3*4"}}', syntax="line").outcome == \
      envs.Outcome.PARSER_REJECTED_CONTINUED
  assert CalculatorEnv().versions()["parser"] == "line-v1"
  assert CalculatorEnv(action_syntax="json").versions()["parser"] == envs.JSON_PARSER_VERSION == "json-v1"
  with pytest.raises(ValueError, match="action_syntax='xml': not one of"):
    CalculatorEnv(action_syntax="xml")


def test_format_writes_a_call_that_its_parser_reads_back():
  line = CalculatorEnv.parser
  json_parser = line.with_syntax("json")
  for call in (envs.Call("calc", "12*7"), envs.Call("answer", "89")):
    text = json_parser.format(call)
    assert json.loads(text) == {"name": call.name, "arguments": {line.tools[[t.name for t in line.tools].index(
        call.name)].arg: call.arg}}
    assert json_parser.parse(text).arg == call.arg
    assert line.parse(line.format(call)) == call


def test_format_types_arguments_by_schema_and_refuses_an_argument_nobody_takes():
  parser = envs.ActionParser(tools=(envs.Tool.with_arg("pick", "", "n", arg_type="integer"), envs.Tool("stop")),
                             syntax="json")
  assert json.loads(parser.format(envs.Call("pick", "7"))) == {"name": "pick", "arguments": {"n": 7}}
  assert parser.parse(parser.format(envs.Call("pick", "7"))).arguments == {"n": 7}
  assert json.loads(parser.format(envs.Call("stop", ""))) == {"name": "stop", "arguments": {}}
  with pytest.raises(envs.InvalidAction, match="takes no argument"):
    parser.format(envs.Call("stop", "now"))


def test_every_builtin_env_declares_tool_schemas():
  for name in ("calculator", "guess", "gridworld", "terminal", "code_repair", "database", "swe"):
    env = envs.get(name).make()
    try:
      for tool in env.parser.tools:
        schema = tool.schema()["function"]
        assert schema["description"], (name, tool.name)
        assert schema["parameters"]["type"] == "object"
        # A line tool's one argument is required; a keyword tool's are named, `arg` only says which is Call.arg.
        assert tool.keywords or tool.arg is None or tool.arg in schema["parameters"]["required"]
    finally:
      env.close()


def test_tool_declarations_are_checked():
  with pytest.raises(ValueError, match="lower-case letters"):
    envs.Tool("Calc")
  with pytest.raises(ValueError, match="arg='x' is not one of its parameters"):
    envs.Tool("calc", "", {"type": "object", "properties": {"expression": {"type": "string"}}}, arg="x")
  with pytest.raises(ValueError, match="duplicate tool names"):
    envs.ActionParser(tools=("calc", "calc"))


def test_a_json_syntax_pool_sends_the_syntax_to_its_workers():
  config = envs.pool.PoolConfig(kind="inprocess", num_workers=1, env="calculator", action_syntax="json")
  assert config.reset_options()["action_syntax"] == "json"
  assert "action_syntax" not in envs.pool.PoolConfig(kind="inprocess", env="calculator").reset_options()
  with pytest.raises(ValueError, match="action_syntax"):
    envs.pool.PoolConfig(kind="inprocess", env="calculator", action_syntax="yaml")
  with envs.pool.Pool(config, num_slots=1) as pool:
    pool.reset_many([0], [TASK], [0])
    result, = pool.step_many([0], ['<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>'])
  assert result.observation.text == "12" and result.call.arguments == {"expression": "3*4"}


EDIT = envs.Tool.with_params("edit", "Replace text.", {"path": ("string", "a file"), "old": ("string", "text"),
                                                      "new": ("string", "text"), "count": ("integer", "how many")},
                             required=("path", "old", "new"), arg="path")


@pytest.mark.parametrize("line", [
    'edit path=a/b.py old="x <= 1\\n  y" new=z count=3',    # JSON string values (escapes), bare words typed
    'edit path=a/b.py old="x <= 1\\n  y" new="z" count=3',  # a string may be quoted or bare
    'edit  count=3   new=z old="x <= 1\\n  y" path=a/b.py',  # any order, extra spaces
])
def test_keyword_line_form_gives_the_json_calls_arguments(line):
  line_parser = envs.ActionParser((EDIT,))
  json_parser = line_parser.with_syntax("json")
  call = line_parser.parse(line)
  assert dict(call.arguments) == {"path": "a/b.py", "old": "x <= 1\n  y", "new": "z", "count": 3}
  assert call.arg == "a/b.py"  # Tool.arg's value, whichever syntax
  assert json_parser.parse(json_parser.format(call)) == call  # a line demo becomes the same JSON call
  assert line_parser.parse(line_parser.format(call)) == call


@pytest.mark.parametrize("line, error, message", [
    ("edit path=a.py", envs.InvalidAction, "'old' is a required property"),
    ("edit path=a.py old=x new=y colour=red", envs.InvalidAction, "'colour' was unexpected"),
    ("edit path=a.py old=x new=y count=many", envs.InvalidAction, "count: 'many' is not of type 'integer'"),
    ("edit a.py", envs.ParseError, "expected key=value at column 1"),
    ('edit path="a.py', envs.ParseError, "path= is not a JSON value"),
    ('edit path=a.py old="x"y new=1', envs.ParseError, "expected a space after old="),
    ("edit path=a.py path=b.py old=x new=y", envs.ParseError, "path= given twice"),
])
def test_keyword_line_form_errors_name_the_bad_part(line, error, message):
  with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
    envs.ActionParser((EDIT,)).parse(line)
