"""Isolation between episodes, and against held-out material, for envs that run programs (docs/design.md §2.8).

Five probes, each an agent's action in one of two concurrent episodes on ONE worker:
  read_sibling    terminal: read a file a sibling episode wrote in its own directory;
  write_sibling   terminal: write into the sibling's directory (the sibling then finds the file);
  worker_socket   terminal: connect to the worker's control socket (through which any episode can be driven);
  held_out_module code_repair, a train episode: print the pristine text of search.py (the eval split's module,
                  the answer to every eval task) through a `test` action's exception report;
  held_out_link   code_repair, a train episode: its code (run by `test`) replaces stack.py by a link to the
                  worker's pristine search.py, then `show stack.py` (the env reading a file the agent planted).
Each of the first four must SUCCEED with sandbox='none' (the control: the probes can succeed, so a failure is
isolation's doing) and FAIL with each episode in its own sandbox, in the local (bubblewrap) and the docker pool.
held_out_link fails in every mode: the env never reads a module through a link (it succeeded before that fix,
which the control cannot show: the fix is in the env, not in the sandbox).
"""

import secrets

import pytest

import envs
from envs import pool as pool_lib
from envs.builtin import code_repair as cr
from tests._sandbox import require_bwrap
from tests.test_envs_sandbox import _docker_or_skip

TERMINAL = envs.get("terminal")
CODE_REPAIR = envs.get("code_repair")
FIND = "find /tmp /work -maxdepth 3 -name mine.txt 2>/dev/null"
CONNECT = ("python3 -c \"import glob, socket; print('connected to', [p for p in glob.glob('/tmp/*/w.sock') + "
           "glob.glob('/run/*/w.sock') if socket.socket(socket.AF_UNIX).connect_ex(p) == 0])\"")
# Where a module's pristine text can be: in the episode's directory (the old layout wrote every module there),
# in the env package of a docker worker, and in this checkout's (a local worker).
HELD_OUT = ("import os; raise SystemExit(open([p for p in ('search.py', "
            "'/opt/jaxagent/envs/builtin/code_repair_pkg/search.py', "
            f"'{cr.PKG_DIR}/search.py') if os.path.exists(p)][0]).read())")


def _pool(kind: str, env: str, sandbox: str, slots: int):
  if kind == "docker":
    return pool_lib.make_pool(slots, env=env, kind="docker", num_workers=1, sandbox=sandbox, start_timeout_s=60)
  return pool_lib.make_pool(slots, env=env, kind="local", num_workers=1, sandbox=sandbox)


def probe(kind: str, sandbox: str) -> dict[str, bool]:
  """{probe: it succeeded} for two concurrent episodes on one worker of a `kind` pool."""
  secret = secrets.token_hex(8)
  out = {}
  with _pool(kind, "terminal", sandbox, 2) as p:
    p.reset_many([0, 1], TERMINAL.tasks("train", 2, 0), [0, 1])
    assert p.step(1, f"sh echo {secret} > mine.txt").info["exit"] == 0
    assert secret in p.step(1, "sh cat mine.txt").observation.text   # an episode's own files work as ever
    out["read_sibling"] = secret in p.step(0, f"sh {FIND} | xargs -r cat").observation.text
    p.step(0, f"sh for f in $({FIND}); do echo pwned-{secret} > \"${{f%/*}}/pwned.txt\"; done")
    out["write_sibling"] = f"pwned-{secret}" in p.step(1, "sh cat pwned.txt").observation.text
    # The worker's socket as a sandboxed worker (docker, bubblewrap) or an unsandboxed one sees it.
    socks = ["/run/jaxagent/w.sock"] + ([f"{p.workers[0].dir}/w.sock"] if kind == "local" else [])
    connected = p.step(0, f"sh {CONNECT}").observation.text
    out["worker_socket"] = any(f"'{sock}'" in connected for sock in socks)
  task = next(t for t in CODE_REPAIR.tasks("train", 40, 0) if t.payload["module"] == "textops.py")
  first_line = cr.pristine("search.py").splitlines()[0]
  with _pool(kind, "code_repair", sandbox, 1) as p:
    p.reset(0, task, 0)
    assert p.step(0, f"replace textops.py:1 {HELD_OUT}").outcome is envs.Outcome.OK
    report = p.step(0, "test").observation.text
    out["held_out_module"] = first_line in report and "def " in report
    # Either way the probe's code ran (a report of its import): a failed probe is no broken runner.
    assert report.startswith("cannot import the package") and ("IndexError" in report or first_line in report), report
    # The pristine module where the worker has it (a docker or bubblewrap worker binds envs/ at /opt/jaxagent).
    target = (f"{cr.PKG_DIR}/search.py" if kind == "local" and sandbox == "none" else
              "/opt/jaxagent/envs/builtin/code_repair_pkg/search.py")
    p.reset(0, task, 1)
    p.step(0, f"replace textops.py:1 import os; os.symlink('{target}', 'l'); os.replace('l', 'stack.py')")
    p.step(0, "test")
    shown = p.step(0, "show stack.py").observation.text
    out["held_out_link"] = first_line in shown
    if not out["held_out_link"]:  # the link is there, and refused: the probe ran
      assert "stack.py is not a regular file any more" in shown, shown
  print(f"isolation probes, {kind} pool, sandbox={sandbox}: {out}")
  return out


@pytest.mark.parametrize("kind", ["local", "docker"])
def test_isolation_probes_succeed_unconfined_and_fail_with_a_sandbox_per_episode(kind):
  if kind == "docker":
    _docker_or_skip()
  else:
    require_bwrap()
  probes = ("read_sibling", "write_sibling", "worker_socket", "held_out_module", "held_out_link")
  assert probe(kind, "none") == dict(dict.fromkeys(probes, True), held_out_link=False)
  assert probe(kind, "bwrap") == dict.fromkeys(probes, False)
