"""The package as a user installs it: `python -m build` makes a wheel and an sdist; the wheel installs in a clean
venv (its dependencies from the index, nothing of this checkout on the path) and runs `jaxagent --version`,
`jaxagent config` on a shipped recipe and `jaxagent demo`. Both steps reach PyPI (the build's setuptools, the
wheel's dependencies): with no route to it they skip, saying so, except in CI (JAXAGENT_REQUIRE_MODELS=1, the
flag of every test that fetches from PyPI), where they fail; any other failure fails."""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import jaxagent
from jaxagent import config as config_lib
from jaxagent.evals import suite as suite_lib
from tests.conftest import _fetched

REPO = Path(__file__).resolve().parents[1]
# What pip prints when it has no route to the index (it retries, naming the connection error).
_NO_ROUTE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                       r"ConnectTimeoutError")


def _from_index(what: str, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
  """Runs `cmd`, which installs from the package index, and asserts it succeeded; no route to the index skips
  (outside CI) through conftest's rule for fetched things."""
  def run():
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if r.returncode and _NO_ROUTE.search(r.stdout + r.stderr):
      raise RuntimeError(f"no route to the package index: {_NO_ROUTE.search(r.stdout + r.stderr).group(0)}")
    return r
  r = _fetched(what, run, "JAXAGENT_REQUIRE_MODELS", "the package index (PyPI) must be reachable")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("dist")
  _from_index("the wheel build's setuptools", [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
              timeout=600)
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
  _from_index("the wheel's dependencies", [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                                            "--disable-pip-version-check", str(_wheel(dist))], timeout=900)
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
