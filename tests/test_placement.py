"""mesh.placement=disaggregated: a learner mesh and a rollout mesh on other devices; the weights cross in one
program over both (`sharding.cross_mesh_copy`). Trains and resumes in one process and in two."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent import config as config_lib
from jaxagent import sharding
from jaxagent import trajectory_store
from jaxagent.train import loop
from tests import _processes
from tests.test_train import TINY

ROOT = Path(__file__).resolve().parent.parent
DISAGGREGATED = ["mesh.placement=disaggregated", "train.eval_episodes=0", "train.plots=false",
                 "train.checkpoint_every=1", "env.pool.kind=inprocess"]


def test_placement_meshes_pair_each_learner_device_with_another_device():
  cfg = config_lib.load("tiny_cpu", ["mesh.placement=disaggregated"]).mesh
  learner, rollout = sharding.placement_meshes(cfg)
  assert learner.devices.shape == rollout.devices.shape == (4, 1, 1, 1)  # data, fsdp, expert, tensor
  assert not set(learner.devices.flat) & set(rollout.devices.flat)
  colocated = sharding.placement_meshes(config_lib.load("tiny_cpu").mesh)
  assert colocated[0] is colocated[1] and colocated[0].devices.size == 8
  with pytest.raises(ValueError, match="even number"):
    sharding.placement_meshes(cfg, jax.devices()[:3])


def test_cross_mesh_copy_moves_sharded_and_replicated_leaves_and_keeps_the_source():
  cfg = config_lib.load("tiny_cpu", ["mesh.placement=disaggregated"]).mesh
  learner, rollout = sharding.placement_meshes(cfg)
  w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(learner, P("data")))
  b = jax.device_put(jnp.ones(3), NamedSharding(learner, P()))
  out = sharding.cross_mesh_copy({"w": w, "b": b}, learner, rollout,
                                 {"w": NamedSharding(rollout, P()), "b": NamedSharding(rollout, P())})
  for name, x in (("w", w), ("b", b)):
    assert out[name].sharding.device_set == set(rollout.devices.flat), name
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(x))
  assert not w.is_deleted() and w.sharding.device_set == set(learner.devices.flat)


def _params(run_dir: Path, step: int):
  with ocp.CheckpointManager((run_dir / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  return jax.tree.leaves(jax.tree.map(np.asarray, state["params"]))


@pytest.mark.parametrize("freshness", ["sync", "async"])
def test_disaggregated_training_resumed_equals_uninterrupted_in_one_process(tmp_path, freshness):
  extra = TINY + DISAGGREGATED + [f"run.root={tmp_path}", f"train.freshness={freshness}",
                                  "train.dynamic_sampling=false"]
  loop.train(config_lib.load("tiny_cpu", extra + ["train.iterations=2"]), run_dir=tmp_path / "run")
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  moved = [r["time/weight_transfer_s"] for r in rows if "time/weight_transfer_s" in r]
  assert len(moved) == 2 and all(s > 0 for s in moved)
  loop.train(config_lib.load("tiny_cpu", extra + ["train.iterations=3"]), run_dir=tmp_path / "run", resume=True)
  trained = [t for t in trajectory_store.read(tmp_path / "run" / "trajectories") if t.metadata.get("trained", True)]
  assert len(trained) == 3 * 2 * 4
  if freshness == "sync":  # the rollout is a function of (seed, iteration): resumed = uninterrupted, bitwise
    loop.train(config_lib.load("tiny_cpu", extra + ["train.iterations=3"]), run_dir=tmp_path / "ref")
    for x, y in zip(_params(tmp_path / "run", 3), _params(tmp_path / "ref", 3)):
      np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_disaggregated_training_and_resume_in_two_processes(tmp_path):
  sets = lambda overrides: [x for o in overrides for x in ("--set", o)]
  common = TINY + DISAGGREGATED + [f"run.root={tmp_path}", "train.dynamic_sampling=false",
                                   "env.pool.kind=local", "env.pool.num_workers=1"]
  launch = lambda *args: subprocess.run(
      [sys.executable, "launch/local.py", "-n", "2", "--devices-per-process", "4", "--timeout", "420", "--",
       *args], env=_processes.cpu_env(4), cwd=ROOT, capture_output=True, text=True, timeout=900)
  first = launch("train", "tiny_cpu", *sets(common + ["train.iterations=1"]))
  assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
  (run,) = tmp_path.iterdir()
  resumed = launch("train", "--resume", str(run), *sets(["train.iterations=2"]))
  assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
  assert "resumed from" in resumed.stdout + resumed.stderr
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["iteration"] for r in rows if "time/weight_transfer_s" in r] == [1, 2]
  for p in (0, 1):  # each process rolled out its own rows
    ts = [t for path in (run / "trajectories").glob(f"trajectories-p{p}-*.array_record")
          for t in trajectory_store.read_file(path) if t.metadata.get("trained", True)]
    assert len(ts) == 2 * 4 and {t.metadata["process"] for t in ts} == {p}
