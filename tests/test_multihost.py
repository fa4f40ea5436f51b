"""Multi-host for real: 2 processes x 4 fake CPU devices train GRPO (frontier task sampler), checkpoint, and
resume as 1 process x 8 devices on a different mesh; the result equals an uninterrupted 1-process run. Each host's env workers see only
that host's trajectories."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxagent import trajectory_store
from tests import _processes
from tests.test_train import TINY

ROOT = Path(__file__).resolve().parent.parent
# The frontier sampler with a small active set: its draws span processes and its estimates gather every
# process's outcomes, so the task sequence itself depends on the gather being right. Update batches keep
# tiny_cpu.yaml's max_context length (two processes agreeing on a bucketed length: the test after it).
COMMON = TINY + ["train.eval_episodes=0", "train.plots=false", "env.pool.kind=local", "env.pool.num_workers=2",
                 "train.bc_steps=2", "train.checkpoint_every=1", "tasks.sampler=frontier", "tasks.active=3",
                 "tasks.min_attempts=4", "tasks.unsolved_attempts=4"]


def _sets(overrides):
  return [x for o in overrides for x in ("--set", o)]


def _params(run_dir: Path, step: int):
  with ocp.CheckpointManager((run_dir / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    assert mngr.latest_step() == step
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  return jax.tree.map(np.asarray, state["params"])


@pytest.mark.slow
def test_two_processes_then_one_process_on_another_mesh_equals_uninterrupted(tmp_path):
  one_proc_mesh = ["mesh.ici.data=2", "mesh.ici.fsdp=4"]
  # Uninterrupted reference: 1 process x 8 devices, 3 iterations.
  subprocess.run([sys.executable, "-m", "jaxagent", "train", "tiny_cpu",
                  *_sets(COMMON + one_proc_mesh + [f"run.root={tmp_path / 'ref'}", "train.iterations=3"])],
                 check=True, env=_processes.cpu_env(8), cwd=ROOT, capture_output=True, timeout=900)
  (ref,) = (tmp_path / "ref").iterdir()

  # 2 processes x 4 devices (data parallel across processes), 2 iterations.
  launched = subprocess.run(
      [sys.executable, "launch/local.py", "-n", "2", "--devices-per-process", "4", "--timeout", "420", "--",
       "train", "tiny_cpu", *_sets(COMMON + [f"run.root={tmp_path / 'mh'}", "train.iterations=2"])],
      env=_processes.cpu_env(4), cwd=ROOT, capture_output=True, text=True, timeout=1000)
  assert launched.returncode == 0, launched.stdout[-4000:] + launched.stderr[-4000:]
  (run,) = (tmp_path / "mh").iterdir()
  assert sorted({p.name.split("-")[1] for p in (run / "trajectories").glob("trajectories-p*")}) == ["p0", "p1"]

  # Each host's env workers saw only that host's rows.
  by_process = {0: [], 1: []}
  for path in sorted((run / "trajectories").glob("*.array_record")):
    p = int(path.name.split("-p")[1].split("-")[0])
    for t in trajectory_store.read_file(path):
      assert t.metadata["process"] == p
      by_process[p].append(t)
  # 2 iterations x 4 local rows trained (the default samples dynamically: refill rounds are stored too)
  trained = {p: [t for t in ts if t.metadata.get("trained", True)] for p, ts in by_process.items()}
  assert len(trained[0]) == len(trained[1]) == 2 * 4
  pids = {p: {t.metadata["env_worker_pid"] for t in ts} for p, ts in by_process.items()}
  assert pids[0] and pids[1] and not pids[0] & pids[1]

  # Resume the same run as 1 process x 8 devices on a different mesh, for the third iteration.
  resumed = subprocess.run([sys.executable, "-m", "jaxagent", "train", "--resume", str(run),
                            *_sets(one_proc_mesh + ["train.iterations=3"])],
                           env=_processes.cpu_env(8), cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-4000:]
  a, b = _params(ref, 3), _params(run, 3)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) > 0
  worst = max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb))
  assert worst <= 1e-6, f"max |Δparam| = {worst:.3g}"

  # Same tasks, seeds and dynamic-sampling choices (trained or not), whatever the topology.
  order = lambda ts: sorted((t.task.id, t.env.seed, t.metadata.get("trained", True)) for t in ts)
  ref_trajs = [t for t in trajectory_store.read(ref / "trajectories") if t.policy_version < 2 + 2]  # 2 BC steps
  assert order(ref_trajs) == order(by_process[0] + by_process[1])


def test_named_host_sums_read_back_by_name_with_the_values_dtype():
  """multihost.host_sums: one collective for several values (identity in one process; the two-process runs
  above sum through it every rl iteration)."""
  from jaxagent import multihost
  out = multihost.host_sums({"terminations": np.asarray([3, 0, 1]), "replays": 2, "tokens": np.int64(7)})
  assert list(out) == ["terminations", "replays", "tokens"]
  np.testing.assert_array_equal(out["terminations"], [3, 0, 1])
  assert out["replays"].shape == () and int(out["replays"]) == 2 and int(out["tokens"]) == 7
  assert out["terminations"].dtype.kind == "i"
  mixed = multihost.host_sums({"n": 3, "seconds": 0.5})
  assert mixed["n"].dtype == np.float64 and float(mixed["seconds"]) == 0.5
  assert multihost.host_sums({}) == {}


def _json_lines_by_process(module: str, key: str, *, timeout: int) -> dict[int, dict]:
  """Runs `module` as 2 processes x 1 device (launch/local.py) and returns each process's JSON line holding
  `key`, by its "process"."""
  launched = subprocess.run(
      [sys.executable, "launch/local.py", "-n", "2", "--devices-per-process", "1", "--timeout", str(timeout),
       "--module", module],
      env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=2 * timeout + 60)
  assert launched.returncode == 0, launched.stdout[-4000:] + launched.stderr[-4000:]
  lines = [json.loads(line.split(" ", 1)[1]) for line in launched.stdout.splitlines()
           if line.startswith("[p") and f'"{key}"' in line]
  by_process = {r["process"]: r for r in lines}
  assert sorted(by_process) == [0, 1]
  return by_process


def test_two_processes_pick_the_bucket_of_the_longest_trajectory_on_either():
  """train.batch_length=bucket: process 0 alone would pad to 96, process 1 to 192; both must pad to 192 (one
  update program, one global batch). Values alone would not show a disagreement: on CPU each process would
  compile its own T and the gradient sum would still agree (tests/_batch_length.py)."""
  by_process = _json_lines_by_process("tests._batch_length", "batch_length", timeout=120)
  assert (by_process[0]["local_bucket"], by_process[1]["local_bucket"]) == (96, 192)
  assert by_process[0]["batch_length"] == by_process[1]["batch_length"] == 192


@pytest.mark.slow
def test_callback_transport_on_two_processes_equals_host_loop(tmp_path):
  """rollout.env_transport=callback with 2 processes x 2 devices (4 row blocks, 2 per process): each process's
  program reaches only its own env workers, with only its own rows (io_callback inside shard_map), and produces
  the trajectories host_loop produces from the same tasks, seeds, key and weights (tests/_callback_rollout.py)."""
  launched = subprocess.run(
      [sys.executable, "launch/local.py", "-n", "2", "--devices-per-process", "2", "--timeout", "420",
       "--module", "tests._callback_rollout", "--", str(tmp_path)],
      env=_processes.cpu_env(2), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert launched.returncode == 0, launched.stdout[-4000:] + launched.stderr[-4000:]
  results = [json.loads((tmp_path / f"p{p}.json").read_text()) for p in (0, 1)]
  pids = []
  for p, r in enumerate(results):
    assert (r["process"], r["processes"], r["devices"]) == (p, 2, 2)
    assert len(r["same"]) == 32 and all(r["same"])  # this process's 4 tasks x 8 samples
    for a, b in zip(r["host_loop"], r["callback"]):
      assert a["logprobs"] == b["logprobs"] and a["termination"] == b["termination"]
      assert a["process"] == b["process"] == p
    assert {t["turns"] for t in r["callback"]} == {4}  # frames fed and envs stepped inside the program
    assert r["exchanges"] > 4
    pids.append({t["pid"] for t in r["callback"]})
  assert pids[0] and pids[1] and not pids[0] & pids[1]  # each process stepped only its own env workers


def test_two_processes_share_prefixes_in_one_packed_shape_with_the_unshared_update():
  """train.shared_prefix on two processes whose prefix trees differ: both pack to one shape (the largest tree and
  the fullest block on either), the token counts are summed over both, and the shared update's metrics equal
  the unshared update's."""
  by_process = _json_lines_by_process("tests._shared_prefix_processes", "packed_shape", timeout=300)
  assert by_process[0]["packed_shape"] == by_process[1]["packed_shape"]
  computed, unshared = by_process[0]["tokens"]
  assert by_process[1]["tokens"] == [computed, unshared] and 0 < computed < unshared
  for r in by_process.values():
    assert r["shared"]["loss_tokens"] > 0
    for key, value in r["unshared"].items():
      np.testing.assert_allclose(r["shared"][key], value, rtol=1e-5, atol=1e-5, err_msg=key)
