"""code_repair env: mutated-package tasks fail before and pass after the inverse mutation (the env's own
verifier), splits are isolated by module, replay is exact, the bubblewrap pool runs the demos, and edited code
can neither escape the sandbox nor hang the env."""

import os
import time

import pytest

import envs
from envs import cli as envs_cli
from envs import pool as pool_lib
from envs.builtin import code_repair as cr
from tests._sandbox import require_bwrap

SPEC = envs.get("code_repair")


def _sample():
  return [t for split in envs.SPLITS for t in SPEC.tasks(split, 6, 3)]


def test_every_sampled_task_fails_before_and_passes_after_the_demo():
  sample = _sample()
  assert {t.split for t in sample} == set(envs.SPLITS)
  kinds = set()
  for i, task in enumerate(sample):
    m = task.payload["mutation"]
    kinds.add(m["kind"])
    # The mutation changes exactly the recorded line of the recorded file.
    before, after = cr.pristine(m["module"]).splitlines(), cr.apply_mutation(cr.pristine(m["module"]), m).splitlines()
    assert [k for k, (a, b) in enumerate(zip(before, after)) if a != b] == [m["line"] - 1], task
    env = SPEC.make()
    obs = env.reset(task, i)   # reset itself runs the failing test and raises unless it fails
    assert obs.text.startswith(f"The test {task.payload['failing_test']} fails:")
    # Mutated source, the env's own verifier: the failing test fails, so the verdict is a failure.
    v = env.verifier.score(task, env.root)
    assert not v.passed and v.reward == 0.0 and v.evidence["failing_test_result"] == "fail", (task, v)
    assert v.evidence["results"][task.payload["failing_test"]] == "fail"
    # The demo (inverse mutation, submit): every test passes.
    results = [env.step(a) for a in SPEC.demo(task, i)]
    final = results[-1]
    assert final.done and final.termination is envs.Termination.COMPLETED, (task, final)
    assert final.verdict.passed is True, (task, final)
    assert final.outcome is envs.Outcome.COMPLETED and final.verdict.version == env.verifier.version
    assert final.reward_components["outcome"] == 1.0
    assert set(final.verdict.evidence["results"].values()) == {"pass"}
    assert sorted(final.verdict.evidence["results"]) == sorted(cr.split_tests(task.split)[1])
    env.close()
  assert len(kinds) >= 3, kinds


def test_splits_are_isolated_by_module_and_deterministic():
  seen = {}
  for split in envs.SPLITS:
    n = sum(len(cr.valid_mutations(m)) for m in cr.SPLIT_MODULES[split])
    assert n >= 20, (split, n)
    ts = SPEC.tasks(split, n, 0)
    assert len({t.payload["mutation_id"] for t in ts}) == n   # one pass covers every mutation once
    seen[split] = {t.payload["module"] for t in ts}
    assert seen[split] == set(cr.SPLIT_MODULES[split])
    assert all(t.split == split and t.version == cr.TASK_VERSION for t in ts)
    assert [t.to_wire() for t in SPEC.tasks(split, 5, 7)] == [t.to_wire() for t in SPEC.tasks(split, 5, 7)]
    assert [t.payload for t in SPEC.tasks(split, 5, 7)] != [t.payload for t in SPEC.tasks(split, 5, 8)]
  assert not seen["train"] & seen["tune"] and not seen["train"] & seen["eval"] and not seen["tune"] & seen["eval"]
  with pytest.raises(ValueError, match="split='test'"):
    SPEC.tasks("test", 1, 0)


def test_actions_and_invalid_actions_inprocess():
  task = next(t for t in SPEC.tasks("train", 40, 0) if t.payload["module"] == "textops.py")
  env = SPEC.make()
  env.reset(task, 0)
  shown = env.step("show textops.py").observation.text
  assert shown.splitlines()[0] == '  1| """String helpers."""'
  for bad, why in [("show ../../etc/passwd", "unknown file"), ("replace pkg_tests.py:3 x = 1", "read-only"),
                   ("replace textops.py:999 x", "lines 1.."), ("replace nowhere", "use: replace"),
                   ("test now", "no argument")]:
    r = env.step(bad)
    assert r.outcome is envs.Outcome.INVALID_ACTION_CONTINUED and why in r.observation.text, (bad, r)
  # `replace LINE TEXT` edits the last shown module and keeps the indentation when TEXT has none.
  assert env.step("replace 6 while i < j:").observation.text == "textops.py:6|     while i < j:"
  n = len(cr.split_tests("train")[1])
  report = env.step("test").observation.text
  assert report.startswith(f"{n} tests: ") and "FAIL " + task.payload["failing_test"] in report
  # Fix the bug, but also slip in an import: all tests pass, the verifier still rejects it.
  env.step(SPEC.demo(task)[0])
  env.step('replace textops.py:1 import os')
  assert env.step("test").observation.text == f"{n} tests: {n} pass"
  r = env.step("submit")
  assert r.verdict.passed is False and r.verdict.evidence["new_names"] == {"textops.py": ["os"]}
  env.close()


def test_split_slices_of_the_tests_partition_them_and_hold_every_failing_test():
  everything = [line[4:line.index("(")] for line in (cr.PKG_DIR / cr.TESTS_FILE).read_text().splitlines()
                if line.startswith("def test_")]
  slices = {split: cr.split_tests(split) for split in envs.SPLITS}
  assert sorted(n for _, names in slices.values() for n in names) == sorted(everything)
  for split, (source, names) in slices.items():
    held_out = [m[:-3] for s, ms in cr.SPLIT_MODULES.items() if s != split for m in ms]
    assert not any(f"from {m} import" in source for m in held_out), split
    for task in SPEC.tasks(split, 60, 0):
      assert set(task.payload["failing_tests"]) <= set(names), task


def test_train_episodes_cannot_read_or_edit_held_out_modules():
  task = SPEC.tasks("train", 1, 0)[0]
  env = SPEC.make()
  first = env.reset(task, 0).text
  assert "search.py" not in first and "intervals.py" not in first  # only the split's modules are listed
  for action in ("show search.py", "replace search.py:1 x = 1", "show intervals.py"):
    r = env.step(action)
    assert r.outcome is envs.Outcome.INVALID_ACTION_CONTINUED, (action, r)
    assert "unknown file" in r.observation.text, (action, r)
  env.close()


@pytest.mark.alone  # a runner subprocess killed within bounds: not beside other xdist workers' tests
def test_hangs_are_bounded(monkeypatch):
  task = next(t for t in SPEC.tasks("eval", 40, 0) if t.payload["failing_test"] != "test_isqrt")
  env = SPEC.make()
  env.reset(task, 0)
  lines = cr.pristine("search.py").splitlines()
  r_inc = lines.index("        r += 1") + 1
  t0 = time.monotonic()
  r = env.step(f"replace search.py:{r_inc}         r += 0")   # isqrt never terminates: the per-test alarm
  r = env.step("test")
  assert "TIMEOUT test_isqrt" in r.observation.text and not r.done, r
  assert time.monotonic() - t0 < cr.PER_TEST_TIMEOUT_S + 2
  # Code that ignores the alarm: the runner subprocess is killed, the episode ends as env_timeout.
  monkeypatch.setattr(cr, "RUN_TIMEOUT_S", 1.5)
  env.step("replace search.py:1 import signal; signal.signal(signal.SIGALRM, signal.SIG_IGN); any(iter(int, 1))")
  t0 = time.monotonic()
  r = env.step("test")
  assert r.done and r.termination is envs.Termination.ENV_TIMEOUT and r.outcome is envs.Outcome.ENV_TIMEOUT, r
  assert time.monotonic() - t0 < 4
  env.close()


@pytest.fixture
def bwrap():
  require_bwrap()


def test_sandboxed_pool_runs_demos_with_exact_replay(bwrap):
  tasks = [t for split in envs.SPLITS for t in SPEC.tasks(split, 2, 5)]
  n = len(tasks)
  traces = []
  with pool_lib.make_pool(n, env="code_repair", kind="local", sandbox="bwrap", num_workers=2) as p:
    assert p.sandboxed and p.version == SPEC.version
    for _ in range(2):
      obs = p.reset_many(range(n), tasks, range(n))
      trace = [o.text for o in obs]
      trace += [r.observation.text for r in p.step_many(range(n), [f"show {t.payload['module']}" for t in tasks])]
      trace += [r.observation.text for r in p.step_many(range(n), ["test"] * n)]
      for j in range(2):
        rs = p.step_many(range(n), [SPEC.demo(t)[j] for t in tasks])
        trace += [(r.observation.text, r.reward, r.termination) for r in rs]
      assert all(r.done and r.verdict.passed for r in rs), rs
      traces.append(trace)
  assert traces[0] == traces[1]
  # The CLI's measurement (`jaxagent envs check code_repair --split tune`): 100% replay.
  r = envs_cli.check("code_repair", episodes=4, split="tune")
  assert r["pool"] == "local" and r["replay_rate"] == 1.0 and r["outcomes"]["completed"] == 8, r


def _probe(p, task, line):
  p.reset(0, task, 0)
  r = p.step(0, f"replace textops.py:1 {line}")
  assert not r.done and r.outcome is envs.Outcome.OK, r
  return p.step(0, "test").observation.text


def test_edited_code_cannot_escape_the_sandbox(bwrap, secret, listener):
  task = next(t for t in SPEC.tasks("train", 40, 0) if t.payload["module"] == "textops.py")
  pkg_tests = (cr.PKG_DIR / cr.TESTS_FILE).read_bytes()
  probes = {
      "read": f"raise RuntimeError('read:' + open('{secret}').read())",
      "write": f"open('{secret.parent}/pwned', 'w').write('x'); raise RuntimeError('wrote')",
      # the tests file inside the episode's sandbox (bound read-only; envs/ itself is not there at all)
      "tests": "open('/opt/run/pkg_tests.py', 'a').write('x'); raise RuntimeError('wrote')",
      "net": f"import socket; socket.create_connection(('{listener.split(':')[0]}', {listener.split(':')[1]}), 1); raise RuntimeError('connected')",
  }
  # Control, unsandboxed: the same edits do read, write and connect, so a failure below is the sandbox's doing.
  with pool_lib.make_pool(1, env="code_repair", kind="local", sandbox="none") as p:
    assert "RuntimeError: read:42" in _probe(p, task, probes["read"])
    assert "RuntimeError: connected" in _probe(p, task, probes["net"])
    assert "RuntimeError: wrote" in _probe(p, task, probes["write"])
  os.unlink(secret.parent / "pwned")
  with pool_lib.make_pool(1, env="code_repair", kind="local", sandbox="bwrap") as p:
    assert p.sandboxed
    got = {k: _probe(p, task, line) for k, line in probes.items()}
  assert "FileNotFoundError" in got["read"] and "read:42" not in got["read"], got["read"]  # (a tmp path may hold 42)
  assert "RuntimeError: wrote" not in got["write"] and "Error" in got["write"], got["write"]
  assert "Read-only file system" in got["tests"], got["tests"]
  assert "RuntimeError: connected" not in got["net"] and ("OSError" in got["net"] or "Error" in got["net"]), got
  assert not (secret.parent / "pwned").exists() and secret.read_text() == "42\n"
  assert (cr.PKG_DIR / cr.TESTS_FILE).read_bytes() == pkg_tests


def test_pools_refuse_to_run_it_unsandboxed_unless_told():
  with pytest.raises(RuntimeError, match="needs a sandbox"):
    pool_lib.make_pool(1, env="code_repair", kind="inprocess")
  with pool_lib.make_pool(1, env="code_repair", kind="inprocess", sandbox="none") as p:  # an explicit opt-out
    assert not p.sandboxed


def test_the_verifier_copies_the_submission_out_and_tests_it_in_a_read_only_sandbox_of_its_own(bwrap):
  import hashlib
  task = next(t for t in SPEC.tasks("train", 40, 0) if t.payload["module"] == "textops.py")
  env = SPEC.make()
  env.reset(task, 0)
  for action in SPEC.demo(task)[:-1]:
    env.step(action)
  v = env.verifier.score(task, env.root)
  assert v.passed and v.evidence["sandbox"] == "bwrap" and v.evidence["tests"] == len(cr.split_tests("train")[1])
  assert v.evidence["submitted"]["textops.py"] == hashlib.sha256((env.root / "textops.py").read_bytes()).hexdigest()[:16]
  # A module that is a link (to the pristine file, which would pass) is not followed: the module is missing.
  fixed = (env.root / "textops.py").read_text()
  (env.root / "textops.py").unlink()
  os.symlink(cr.PKG_DIR / "textops.py", env.root / "textops.py")
  v = env.verifier.score(task, env.root)
  assert not v.passed and "textops.py" not in v.evidence["submitted"] and v.evidence["import_error"]
  # Code under test cannot write to what the verifier tests (its tree is read-only).
  (env.root / "textops.py").unlink()
  (env.root / "textops.py").write_text("open('textops.py', 'a').write('x')\n" + fixed)
  v = env.verifier.score(task, env.root)
  assert not v.passed and "Read-only file system" in v.evidence["report"], v.evidence["report"]
  env.close()
