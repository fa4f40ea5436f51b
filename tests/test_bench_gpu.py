"""The parts of the accelerator run that need no accelerator: bench/gpu/run.sh's `check` (its wheel pins within
pyproject.toml's ranges, its train commands' configs valid), a bad pin refused by name, and
bench/real_model.py's random-weight mode (real architectures' shapes) on a 2-layer cut, ours beside
transformers on the same weights."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import models

ROOT = Path(__file__).resolve().parent.parent


def _check(root: Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
  return subprocess.run(["bash", str(root / "bench" / "gpu" / "run.sh"), "check"], cwd=root, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def test_gpu_script_check_validates_its_wheels_and_train_commands():
  done = _check(ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  pins = [line for line in (ROOT / "bench/gpu/wheels.txt").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
  assert f"check: {len(pins)} wheel pins, each within pyproject.toml's ranges" in done.stdout
  assert "check: jaxagent train qwen3_0p6b_gpu validates" in done.stdout
  assert "check: jaxagent train tiny_cpu validates" in done.stdout
  assert {"flax==0.12.8", "grain==0.2.18", "jsonschema==4.26.0", "gguf==0.19.0"} <= set(pins)


def test_gpu_script_check_refuses_a_pin_outside_pyproject_ranges(tmp_path):
  copy = tmp_path / "repo"
  (copy / "bench" / "gpu").mkdir(parents=True)
  shutil.copy(ROOT / "pyproject.toml", copy)
  shutil.copy(ROOT / "bench/gpu/run.sh", copy / "bench/gpu")
  (copy / "bench/gpu/wheels.txt").write_text("# a comment\nflax==0.11.0\n")
  done = _check(copy)
  assert done.returncode != 0
  assert "bench/gpu/wheels.txt flax==0.11.0 is outside pyproject.toml's flax<0.13,>=0.12.8" in done.stderr, \
      done.stderr


def test_architectures_are_the_published_shapes():
  assert round(models.architecture("smollm2-135m").num_params() / 1e6, 1) == 134.5   # SmolLM2-135M
  assert round(models.architecture("qwen3-0.6b").num_params() / 1e6, 1) == 596.0     # Qwen3-0.6B (0.6B)
  assert round(models.architecture("qwen3-8b").num_params() / 1e9, 2) == 8.19         # Qwen3-8B (8.2B)
  assert round(models.architecture("llama3.1-70b").num_params() / 1e9, 2) == 70.55    # Llama-3.1-70B (70.6B)
  assert round(models.architecture("gemma3-4b").num_params() / 1e9, 2) == 3.88        # Gemma 3 4B's text model
  with pytest.raises(ValueError, match=r"unknown architecture 'qwen9'; known: \['gemma3-4b', 'llama3.1-70b', "
                     r"'qwen3-0.6b', "
                     r"'qwen3-30b-a3b', 'qwen3-8b', 'smollm2-135m'\]"):
    models.architecture("qwen9")


@pytest.mark.slow
def test_real_model_bench_random_weights_mode_runs_beside_transformers(capsys):
  # One architecture: the mode is the same for each (qwen3-0.6b's 151,936 x 1,024 embedding alone costs ~15 s
  # more to write and load; its shapes are checked above). Rates are (generate - prefill) differences of the best
  # of 3 rounds: with one round a slow prefill once exceeded a fast generate (transformers' rate came out nan).
  architecture = "smollm2-135m"
  spec = importlib.util.spec_from_file_location("bench_real_model", ROOT / "bench" / "real_model.py")
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench
  spec.loader.exec_module(bench)
  rows = bench.main(["--architecture", architecture, "--num-layers", "1", "--batches", "1", "2", "--dtypes",
                     "float32", "--new", "8", "--rounds", "3", "--train-batch", "1", "--train-length", "32",
                     "--train-steps", "1", "--no-lora"])
  out = capsys.readouterr().out
  assert f"{architecture} (random weights, 1 layers)" in out and "25.6 GB/s, 188 GFLOP/s" in out, out
  assert [(r["dtype"], r["batch"]) for r in rows] == [("float32", 1), ("float32", 2)]
  assert all(r["ours"] > 0 and r["torch"] > 0 and r["roofline"] > 0 for r in rows), rows
  assert "batch 2 decodes" in out and "full     float32 : ours" in out and "transformers" in out, out
  assert bench._peaks("NVIDIA H200", "gpu") == (4800.0, 790e3)       # measured there
  assert bench._peaks("NVIDIA A100-SXM4-80GB", "gpu") == (2000.0, 312e3)  # bench/mfu.py's vendor table
  assert bench._peaks("cpu", "cpu") == (25.6, 188.0) and bench._peaks("Mystery 1", "gpu") is None


def test_gpu_script_rehearsal_runs_a_stage_in_its_own_invocation_and_writes_the_summary(tmp_path):
  """`rehearse` (all at toy sizes, on CPU) with STAGES=smoke: the stage runs under `timeout` as its own
  invocation of the script and its status and table reach $OUT/summary.txt (the full rehearsal: ~7 min)."""
  env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "STAGES": "smoke"}
  done = subprocess.run(["bash", str(ROOT / "bench/gpu/run.sh"), "rehearse"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  summary = (tmp_path / "summary.txt").read_text()
  assert summary.startswith("smoke     rc=0 ") and "bf16 1024^3 matmul" in summary, summary
  jax_pin = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                 if r.startswith("jax>="))
  assert f"pin {Requirement(jax_pin)}" in summary and "imports ok: flax " in summary, summary
  assert sorted(p.name for p in tmp_path.iterdir()) == ["smoke.log", "summary.txt"]
