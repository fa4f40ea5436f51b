"""Every launcher in launch/ is syntax-checked; launch/local.py runs for real with 2 processes."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
SHELL = sorted(p for p in LAUNCH.rglob("*") if p.suffix in (".sh", ".sbatch"))
# Trainer launchers; configs: tests/test_config.py; k8s (env servers, not a trainer): tests/test_envs_remote.py
YAML = sorted(p for p in LAUNCH.rglob("*.yaml") if not {"configs", "k8s", "suites"} & set(p.parts))


def test_launchers_exist():
  names = {p.relative_to(LAUNCH).as_posix() for p in SHELL + YAML}
  assert {"slurm/train.sbatch", "gke/xpk.sh", "tpu_vm/train.sh", "gke/jobset.yaml"} <= names


@pytest.mark.parametrize("path", SHELL, ids=lambda p: p.relative_to(LAUNCH).as_posix())
def test_shell_launchers_parse(path):
  result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
  assert result.returncode == 0, result.stderr
  assert path.read_text().startswith("#!/bin/bash\n")
  # Called without a config they explain their usage instead of starting anything.
  usage = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"})
  assert usage.returncode == 2 and "usage:" in usage.stderr, usage.stderr


@pytest.mark.parametrize("path", YAML, ids=lambda p: p.relative_to(LAUNCH).as_posix())
def test_yaml_launchers_parse(path):
  docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
  assert docs and all("apiVersion" in d and "kind" in d for d in docs)
  jobset = next(d for d in docs if d["kind"] == "JobSet")
  job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"]
  container = job["template"]["spec"]["containers"][0]
  assert container["command"][:3] == ["python", "-m", "jaxagent"]


def _local(*args, timeout=90):
  return subprocess.run([sys.executable, str(LAUNCH / "local.py"), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def test_local_launcher_runs_two_processes_as_one_job():
  result = _local("-n", "2", "--devices-per-process", "4", "--timeout", "60", "--module", "jaxagent.distributed",
                  "--", "--set", "mesh.ici.tensor=2")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  lines = {}
  for line in result.stdout.splitlines():
    if line.startswith("[p") and '"sum"' in line:
      prefix, payload = line.split(" ", 1)
      lines[prefix] = yaml.safe_load(payload)
  assert sorted(lines) == ["[p0]", "[p1]"]
  for i, r in enumerate((lines["[p0]"], lines["[p1]"])):
    assert r["process_id"] == i and r["num_processes"] == 2 and r["method"] == "explicit"
    assert r["mesh"] == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert r["sum"] == r["psum"] == r["expected"] == 72.0


def test_local_launcher_kills_all_when_one_fails():
  # Process 1 exits 3 at once; process 0 would wait up to 300 s in jax.distributed.initialize for it.
  result = _local("-n", "2", "--timeout", "60", "--module", "tests._launch_payload", "--", "fail-on", "1",
                  timeout=60)
  assert result.returncode == 3, result.stdout
  assert "[launch] process 1 exited with 3; stopping the others" in result.stdout
  assert "[p0] waiting for process 1" in result.stdout


def test_local_launcher_timeout_is_124():
  result = _local("-n", "2", "--timeout", "2", "--module", "tests._launch_payload", "--", "sleep", timeout=30)
  assert result.returncode == 124, result.stdout
  assert "[launch] timeout after 2 s" in result.stdout
