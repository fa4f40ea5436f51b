"""The package as a user installs it: `python -m build` makes a wheel and an sdist; the wheel installs in a clean
venv (its dependencies from the index, nothing of this checkout on the path) and runs `jaxagent --version`,
`jaxagent config` on a shipped recipe and `jaxagent demo`."""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import jaxagent
from jaxagent import config as config_lib
from jaxagent.evals import suite as suite_lib

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("dist")
  r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return out


def _wheel(dist: Path) -> Path:
  (wheel,) = dist.glob("jaxagent-*.whl")
  return wheel


def test_the_wheel_holds_the_packages_and_their_data_and_no_tests_benches_or_runs(dist):
  names = zipfile.ZipFile(_wheel(dist)).namelist()
  tops = {n.split("/")[0] for n in names}
  assert tops == {"jaxagent", "models", "envs", f"jaxagent-{jaxagent.__version__}.dist-info"}, tops
  shipped = {f"jaxagent/configs/{p.name}" for p in config_lib.CONFIG_DIR.glob("*.yaml")}
  shipped |= {f"jaxagent/suites/{p.name}" for p in suite_lib.SUITE_DIR.glob("*.yaml")}
  assert shipped and shipped <= set(names), shipped - set(names)
  assert "envs/Dockerfile" in names and "envs/docker/seccomp-episodes.json" in names
  metadata = email.parser.Parser().parsestr(
      zipfile.ZipFile(_wheel(dist)).read(f"jaxagent-{jaxagent.__version__}.dist-info/METADATA").decode())
  assert metadata["Version"] == jaxagent.__version__ and metadata["Requires-Python"] == ">=3.11"
  assert any(c.startswith("Topic ::") for c in metadata.get_all("Classifier"))
  assert {"test", "cuda", "tpu", "agent", "mcp", "openenv"} <= set(metadata.get_all("Provides-Extra"))
  (sdist,) = dist.glob("jaxagent-*.tar.gz")
  members = tarfile.open(sdist).getnames()
  assert not any("/runs/" in m or m.endswith(".array_record") for m in members)


@pytest.mark.slow
def test_the_wheel_installs_in_a_clean_venv_and_runs_the_demo(dist, tmp_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
  pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", str(_wheel(dist))], capture_output=True, text=True, timeout=900)
  assert pip.returncode == 0, pip.stderr[-3000:]
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(JAX_PLATFORMS="cpu")
  work = tmp_path / "work"  # not this checkout: the installed package alone
  work.mkdir()
  run = lambda *args: subprocess.run([str(venv / "bin" / "jaxagent"), *args], cwd=work, env=env,
                                     capture_output=True, text=True, timeout=600)
  where = subprocess.run([str(venv / "bin" / "python"), "-c", "import jaxagent; print(jaxagent.__file__)"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=60)
  assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
  version = run("--version")
  assert version.returncode == 0 and version.stdout.strip() == f"jaxagent {jaxagent.__version__}", version
  recipe = run("config", "smollm2_calculator_budget_cpu", "--set", "train.iterations=2")
  assert recipe.returncode == 0 and "iterations: 2" in recipe.stdout, recipe.stderr[-2000:]
  demo = run("demo", "tiny_cpu")
  assert demo.returncode == 0, demo.stderr[-3000:]
  assert "max |logit diff| = 0" in demo.stdout and "agrees with no-cache argmax on 24/24 tokens" in demo.stdout, \
      demo.stdout
