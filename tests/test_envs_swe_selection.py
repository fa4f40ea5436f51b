"""Which kept tests a source change can affect (envs/builtin/swe_selection.py): a change confined to function
bodies selects the tests that called those functions; anything else (module-level code, a def's header, a
function that ran at import, a file that does not parse) selects every kept test. And the pool raises its
timeouts to what an env says it needs here, never lowering them."""

import dataclasses

import pytest

import envs
from envs import pool as pool_lib
from envs.builtin import swe_selection as sel

SOURCE = '''import re

PATTERN = re.compile("a+")


def decorate(fn):
  return fn


@decorate
def outer(a, b=1):
  def inner():
    return 1
  return a + b + inner()


class Box:
  SIZE = 3

  def area(self):
    return self.SIZE * self.SIZE


def table():
  return {"x": 1}


TABLE = table()
'''


@pytest.mark.parametrize("old, new, expected", [
    ("return a + b + inner()", "return a - b + inner()", [10]),        # a decorated function: its decorator's line
    ("    return 1\n", "    return 0\n", [12]),                         # a nested function alone
    ("return self.SIZE * self.SIZE", "return self.SIZE + self.SIZE", [20]),  # a method
    ("SIZE = 3", "SIZE = 4", None),                                     # a class body runs at import
    ("b=1", "b=2", None),                                               # a default is part of the header
    ('PATTERN = re.compile("a+")', 'PATTERN = re.compile("b+")', None),  # module-level code
    ("import re\n", "import re\n\n\n", []),                             # line shifts alone change nothing
    ("return fn\n", "return fn\n\ndef extra():\n  pass\n", None),       # a new function is a module-level change
    ("return fn", "return (fn", None),                                  # does not parse
])
def test_changed_functions(old, new, expected):
  assert old in SOURCE
  assert sel.changed_functions(SOURCE, SOURCE.replace(old, new, 1)) == expected


def test_affected_tests_are_the_callers_of_the_changed_functions():
  kept = ["t::a", "t::b", "t::c", "t::d"]
  callers = {"pkg.py": {"10": ["t::a", "t::slow"], "12": ["t::b"], "20": ["t::c"], "24": [sel.AT_IMPORT, "t::d"]}}
  body = SOURCE.replace("return self.SIZE * self.SIZE", "return self.SIZE + self.SIZE")
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, body)]) == ["t::c"]
  both = body.replace("    return 1\n", "    return 0\n")
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, both)]) == ["t::b", "t::c"]
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, SOURCE)]) == []
  # A test that is not kept (too slow on the pristine tree) is never selected.
  decorated = SOURCE.replace("return a + b + inner()", "return a * b + inner()")
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, decorated)]) == ["t::a"]
  # table() ran at import (TABLE = table()): changing its body can change what every test sees.
  at_import = SOURCE.replace('return {"x": 1}', 'return {"x": 2}')
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, at_import)]) == kept
  assert sel.affected_tests(callers, kept, [("pkg.py", SOURCE, SOURCE.replace("SIZE = 3", "SIZE = 4"))]) == kept
  # A function no kept test called affects none.
  assert sel.affected_tests({}, kept, [("pkg.py", SOURCE, body)]) == []


MEASURED = dataclasses.replace(envs.get("calculator"), name="measured",
                               timeouts=lambda: {"action_timeout_s": 42.0, "reset_timeout_s": 5.0})
UNKNOWN = dataclasses.replace(envs.get("calculator"), name="unknown", timeouts=lambda: {"step_s": 1.0})


def test_a_pool_raises_its_timeouts_to_what_the_env_measured_and_never_lowers_them():
  cfg = pool_lib.PoolConfig(env="tests.test_envs_swe_selection:MEASURED", kind="inprocess")
  raised = pool_lib.with_env_timeouts(cfg)
  assert (raised.action_timeout_s, raised.reset_timeout_s) == (42.0, cfg.reset_timeout_s)  # 5 < 30: kept
  higher = dataclasses.replace(cfg, action_timeout_s=100.0)
  assert pool_lib.with_env_timeouts(higher).action_timeout_s == 100.0
  assert pool_lib.with_env_timeouts(pool_lib.PoolConfig(env="calculator")) == pool_lib.PoolConfig(env="calculator")
  with pool_lib.make_pool(1, cfg) as pool:
    assert pool.cfg.action_timeout_s == 42.0
  with pytest.raises(ValueError, match=r"timeouts\(\) gave \['step_s'\]; it may give \['action_timeout_s'"):
    pool_lib.with_env_timeouts(dataclasses.replace(cfg, env="tests.test_envs_swe_selection:UNKNOWN"))
