"""Terminal env: real shell commands in the bubblewrap sandbox; the verifier checks the resulting state."""

import os
import time
from pathlib import Path

import pytest

import envs
from envs import pool as pool_lib
from envs import _sandbox
from tests._sandbox import require_bwrap

SPEC = envs.get("terminal")


def test_demos_pass_and_wrong_state_fails_inprocess():
  for split in envs.SPLITS:
    for i, task in enumerate(SPEC.tasks(split, 4, 0)):
      env = SPEC.make()
      env.reset(task, i)
      results = [env.step(a) for a in SPEC.demo(task, i)]
      assert results[-1].termination == "completed" and results[-1].verdict.passed, (task, results)
      env.reset(task, i)
      assert env.step("done").verdict.passed is False   # nothing done: the verifier says so
      env.close()


def test_runs_sandboxed_with_full_replay():
  require_bwrap()
  tasks = SPEC.tasks("train", 4, 0)
  traces = []
  with pool_lib.make_pool(4, env="terminal", kind="local", sandbox="bwrap") as p:
    for _ in range(2):
      p.reset_many(range(4), tasks, range(4))
      first = p.step_many(range(4), ["sh ls -R | sort"] * 4)
      rest = [p.step_many(range(4), [SPEC.demo(t)[j] for t in tasks]) for j in range(2)]
      traces.append([r.observation.text for r in first] + [r.observation.text for rs in rest for r in rs])
      assert all(r.verdict.passed for r in rest[-1])
  assert traces[0] == traces[1]
  assert "exit 0" in traces[0][0]


@pytest.fixture(params=["none", "bwrap"])
def box(request):
  if request.param == "bwrap":
    require_bwrap()
  b = _sandbox.EpisodeSandbox(request.param)
  yield b
  b.close()


def test_a_commands_background_jobs_die_when_it_exits_and_when_it_times_out(box):
  # A background job outlives its shell unless the sandbox (pid namespace) or the group kill ends it: it must
  # not survive the step. The job would write late.txt after 1 s.
  sh = ["/bin/sh", "-c"]
  done = box.run(sh + ["(sleep 1; echo late > late1.txt) & echo started"], timeout=5)
  assert done.code == 0 and done.output == b"started\n"
  t = time.monotonic()
  done = box.run(sh + ["(sleep 1; echo late > late2.txt) & echo waiting; sleep 30"], timeout=0.5)
  assert done.code is None and done.output == b"waiting\n" and time.monotonic() - t < 5
  time.sleep(1.5)
  assert not (box.work / "late1.txt").exists() and not (box.work / "late2.txt").exists()


def test_output_flood_is_capped_in_memory_and_flagged(box):
  t = time.monotonic()
  done = box.run(["yes"], timeout=1)
  assert done.code is None and time.monotonic() - t < 5
  assert len(done.output) == _sandbox.OUTPUT_CAP_BYTES and done.total > _sandbox.OUTPUT_CAP_BYTES

  env = SPEC.make(max_obs_bytes=1000)
  env.episode_sandbox = box.mode
  env.reset(SPEC.tasks("train", 1, 0)[0], 0)
  r = env.step("sh yes | head -c 200000")
  assert r.info["exit"] == 0 and r.observation.truncated and r.observation.original_size >= 200_000
  assert len(r.observation.text.encode()) <= 1000
  env.close()


def test_the_verifier_reads_the_tree_from_outside_never_through_an_agents_links_or_fifos(tmp_path):
  task = SPEC.tasks("eval", 1, 0)[0]   # count_lines: the line count of a file, written to count.txt
  want = str(task.payload["files"][task.payload["target"]].count("\n"))
  env = SPEC.make()
  env.reset(task, 0)
  # The right answer outside the agent's tree (a sibling's or the worker's file): a link to it is not followed.
  (tmp_path / "answer.txt").write_text(want)
  os.symlink(tmp_path / "answer.txt", env.root / "count.txt")
  r = env.step("done")
  assert r.verdict.passed is False and r.verdict.evidence["not_plain"] == ["count.txt"], r.verdict
  assert "read" not in r.verdict.evidence
  # A FIFO would block a reader forever: it is refused at once.
  env.reset(task, 1)
  assert env.step("sh mkfifo count.txt").info["exit"] == 0
  t = time.monotonic()
  r = env.step("done")
  assert r.verdict.passed is False and r.verdict.evidence["not_plain"] == ["count.txt"]
  assert time.monotonic() - t < 2
  # The control: the same answer as a plain file passes, and the verdict keeps what it read.
  env.reset(task, 2)
  r = env.step(f"sh echo {want} > count.txt")
  r = env.step("done")
  assert r.verdict.passed is True and r.verdict.evidence["read"].strip() == want
  # A tree too large to judge whole fails instead of being judged on part of it.
  env.reset(task, 3)
  env.step(f"sh echo {want} > count.txt; mkdir m; cd m; seq 5000 | xargs touch")
  r = env.step("done")
  assert r.verdict.passed is False and r.verdict.evidence["too_many_entries"] is True
  env.close()


def _without_privileges(code: str, cwd: Path) -> str:
  """Runs python `code` as a user whom file modes bind (a worker is not root: docker runs it as uid 1000; here,
  root without capabilities in a user namespace of bubblewrap's), this checkout importable; returns stdout."""
  import subprocess
  import sys
  repo = Path(__file__).resolve().parent.parent
  cmd = [sys.executable, "-c", code]
  if os.geteuid() == 0:
    require_bwrap()
    cmd = ["bwrap", "--unshare-user", "--cap-drop", "ALL", "--ro-bind", "/", "/", "--bind", str(cwd), str(cwd),
           "--dev", "/dev", "--proc", "/proc", "--chdir", str(cwd), "--"] + cmd
  r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60,
                     env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin", "TMPDIR": str(cwd)})
  assert r.returncode == 0, r.stderr
  return r.stdout


def test_a_tree_the_agent_made_unreadable_is_not_judged_and_is_still_removed(tmp_path):
  # delete_logs: a log left in a directory made unreadable (chmod 000) must not pass as deleted.
  code = """if 1:
    import os, envs
    from pathlib import Path
    from envs import _sandbox
    spec = envs.get("terminal")
    task = next(t for t in spec.tasks("train", 4, 0) if t.payload["template"] == "delete_logs")
    for mode in (0o000, 0o400):   # not listable; listable but not searchable
      box = _sandbox.EpisodeSandbox("none", prefix="t-")
      for rel, text in task.payload["files"].items():
        (box.work / rel).parent.mkdir(parents=True, exist_ok=True)
        (box.work / rel).write_text(text)
      os.remove(box.work / "top.log")
      hidden = next(p.parent for p in box.work.rglob("run.log"))
      hidden.chmod(mode)
      v = spec.make().verifier.score(task, box.work)
      print(v.passed, v.evidence.get("unreadable"))
      for d in ("a/b/c", "x/y/z"):
        os.makedirs(box.work / d)
        (box.work / d / "f").write_text("x")
      (box.work / "a" / "b").chmod(0)
      (box.work / "x" / "y").chmod(0o400)
      box.close()
      print(box.base.exists())
      _sandbox.rmtree(box.base / "work")   # twice: nothing left, nothing raised, the parent's mode untouched
      print(oct(box.base.parent.stat().st_mode & 0o777) == oct(os.stat(os.environ["TMPDIR"]).st_mode & 0o777))
  """
  out = _without_privileges(code, tmp_path).split("\n")
  for k in (0, 3):
    assert out[k].startswith("False ['"), out   # not passed, and the evidence names the unreadable directory
    assert out[k + 1] == "False", out   # rmtree removed the tree, unreadable directories included
    assert out[k + 2] == "True", out


def test_the_envs_package_is_hidden_from_episodes_when_a_system_bind_holds_it(monkeypatch):
  # As when jaxagent is installed into the interpreter's prefix: a read-only system bind holds envs/ and its
  # data. (A stand-in prefix outside /work and /tmp, which episodes have as their own mounts.)
  import shutil
  import tempfile
  require_bwrap()
  prefix = Path(tempfile.mkdtemp(dir="/var/tmp"))
  try:
    (prefix / "envs" / "builtin" / "code_repair_pkg").mkdir(parents=True)
    (prefix / "envs" / "builtin" / "code_repair_pkg" / "search.py").write_text("pristine\n")
    (prefix / "README").write_text("readme\n")
    binds = _sandbox.system_binds()
    monkeypatch.setattr(_sandbox, "system_binds", lambda: binds + ["--ro-bind", str(prefix), str(prefix)])
    monkeypatch.setattr(_sandbox, "__file__", str(prefix / "envs" / "_sandbox.py"))
    box = _sandbox.EpisodeSandbox("bwrap")
    try:
      done = box.run(["/bin/sh", "-c", f"cat {prefix}/README; cat {prefix}/envs/builtin/code_repair_pkg/search.py"],
                     timeout=5)
    finally:
      box.close()
  finally:
    shutil.rmtree(prefix)
  text = done.output.decode()
  assert text.startswith("readme\n") and "No such file" in text and "pristine" not in text, text
