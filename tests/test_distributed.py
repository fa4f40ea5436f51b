"""jaxagent.distributed: SLURM/explicit/TPU resolution without a cluster, and a real 2-process run on CPU."""

import json
import sys
from pathlib import Path

import jax
import portpicker
import pytest
from jax._src.clusters import slurm_cluster  # the reference our SLURM parsing must agree with

from jaxagent import distributed
from jaxagent.config import DistributedConfig
from tests import _processes

ROOT = Path(__file__).resolve().parent.parent

# What `srun` exports to one task of a 2-node job, 1 task per node (job 4242, this is node 1).
SLURM_ONE_PER_NODE = {
    "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}
# 2 nodes x 4 tasks (one per GPU); this is global rank 6 = node 1, local 2.
SLURM_ONE_PER_GPU = {
    "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


@pytest.mark.parametrize("nodelist, first", [
    ("node001", "node001"),
    ("node001,host2", "node001"),
    ("node[001-0015],host2", "node001"),
    ("node[007,001-005],host2", "node007"),
    ("rack[2-3]-gpu[09-12]", "rack2-gpu09"),
    ("a-[01-02],b[1-3]", "a-01"),
])
def test_slurm_first_host(nodelist, first):
  assert distributed.slurm_first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["node001", "node001,host2", "node[001-0015],host2", "node[007,001-005]"])
def test_slurm_coordinator_agrees_with_jax(nodelist, monkeypatch):
  # JAX's SlurmCluster covers single-bracket lists; where it does, the address (host and port) must match.
  env = dict(SLURM_ONE_PER_NODE, SLURM_STEP_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
  expected = slurm_cluster.SlurmCluster.get_coordinator_address(None, None)
  plan = distributed.resolve(DistributedConfig(mode="slurm"), env)
  assert plan.kwargs["coordinator_address"] == expected


def test_slurm_tasks_per_node_and_bad_lists():
  assert distributed.slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
  assert distributed.slurm_tasks_per_node("8") == [8]
  with pytest.raises(distributed.DistributedError, match=r"tasks-per-node '2\(y3\)'"):
    distributed.slurm_tasks_per_node("2(y3)")
  with pytest.raises(distributed.DistributedError, match=r"cannot parse SLURM hostlist 'node\[01-02'"):
    distributed.slurm_first_host("node[01-02")


def test_slurm_one_task_per_node_keeps_every_local_device():
  plan = distributed.resolve(DistributedConfig(), SLURM_ONE_PER_NODE)  # auto -> slurm
  assert plan.method == "slurm"
  assert dict(plan.kwargs) == {"coordinator_address": "gpu017:61586", "num_processes": 2, "process_id": 1,
                               "local_device_ids": None, "cluster_detection_method": "deactivate",
                               "initialization_timeout": 300}
  # JAX's rule for the default port: 4242 % 4096 + 61440 = 146 + 61440.


def test_slurm_one_task_per_gpu_defers_to_jax_detection():
  plan = distributed.resolve(DistributedConfig(mode="slurm"), SLURM_ONE_PER_GPU)
  assert plan.method == "slurm-jax"
  assert dict(plan.kwargs) == {"cluster_detection_method": "slurm", "initialization_timeout": 300}
  # Outside a job step (no SLURM_STEP_NODELIST), or with a configured port: read here, pin SLURM_LOCALID.
  env = {k: v for k, v in SLURM_ONE_PER_GPU.items() if k != "SLURM_STEP_NODELIST"}
  env["SLURM_TASKS_PER_NODE"] = env.pop("SLURM_STEP_TASKS_PER_NODE")
  plan = distributed.resolve(DistributedConfig(coordinator_port=7777), env)
  assert plan.method == "slurm"
  assert plan.kwargs["coordinator_address"] == "gpu017:7777"
  assert (plan.kwargs["num_processes"], plan.kwargs["process_id"], plan.kwargs["local_device_ids"]) == (8, 6, [2])
  env["JAX_COORDINATOR_PORT"] = "6000"
  assert distributed.resolve(DistributedConfig(mode="slurm"), env).kwargs["coordinator_address"] == "gpu017:6000"


def test_slurm_errors_name_the_variable():
  env = {k: v for k, v in SLURM_ONE_PER_NODE.items() if k != "SLURM_NTASKS"}
  with pytest.raises(distributed.DistributedError, match=r"\$SLURM_NTASKS.*srun"):
    distributed.resolve(DistributedConfig(mode="slurm"), env)
  with pytest.raises(distributed.DistributedError, match=r"\$SLURM_PROCID='x' is not an integer"):
    distributed.resolve(DistributedConfig(mode="slurm"), dict(SLURM_ONE_PER_NODE, SLURM_PROCID="x"))


def test_explicit_auto_tpu_and_single_resolution():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXAGENT_NUM_PROCESSES": "4", "JAXAGENT_PROCESS_ID": "3"}
  plan = distributed.resolve(DistributedConfig(), dict(env, **SLURM_ONE_PER_NODE))  # explicit beats SLURM
  assert plan.method == "explicit"
  assert (plan.kwargs["coordinator_address"], plan.kwargs["num_processes"], plan.kwargs["process_id"]) == (
      "10.0.0.1:1234", 4, 3)
  assert plan.kwargs["cluster_detection_method"] == "deactivate"
  config_wins = distributed.resolve(DistributedConfig(process_id=0, local_device_ids=(0, 1)), env)
  assert config_wins.kwargs["process_id"] == 0 and config_wins.kwargs["local_device_ids"] == [0, 1]
  with pytest.raises(distributed.DistributedError, match=r"missing \['process_id'\].*\$JAXAGENT_PROCESS_ID"):
    distributed.resolve(DistributedConfig(), {k: v for k, v in env.items() if k != "JAXAGENT_PROCESS_ID"})
  with pytest.raises(distributed.DistributedError, match=r"process_id=4 is outside \[0, num_processes=4\)"):
    distributed.resolve(DistributedConfig(process_id=4), env)
  with pytest.raises(distributed.DistributedError, match=r"coordinator_address='10.0.0.1': expected host:port"):
    distributed.resolve(DistributedConfig(coordinator_address="10.0.0.1"), env)
  tpu = distributed.resolve(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"})
  assert tpu.method == "tpu" and dict(tpu.kwargs) == {"initialization_timeout": 300}  # initialize() as is
  assert distributed.resolve(DistributedConfig(), {"TPU_SKIP_MDS_QUERY": "1"}).method == "single"
  assert distributed.resolve(DistributedConfig(mode="single"), SLURM_ONE_PER_NODE).method == "single"


def test_initialize_is_idempotent_in_one_process(monkeypatch):
  monkeypatch.setattr(distributed, "_ACTIVE", None)
  first = distributed.initialize(DistributedConfig(mode="single"), environ={})
  assert first == distributed.initialize(DistributedConfig(mode="single"), environ={})
  assert (first.method, first.process_id, first.num_processes, first.device_count) == ("single", 0, 1, 8)
  assert distributed.is_coordinator() and first.is_coordinator
  assert distributed.process_zero_only(lambda x: x + 1)(1) == 2
  with pytest.raises(distributed.DistributedError, match=r"already initialized with 1 processes.*num_processes=2"):
    distributed.initialize(DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0))


def test_two_processes_form_one_mesh_and_reduce_across_processes(tmp_path):
  """2 real processes x 4 fake CPU devices, coordinator on 127.0.0.1: one 8-device hybrid mesh (DCN data=2)."""
  port = portpicker.pick_unused_port()
  _processes.run_all([[sys.executable, "-m", "jaxagent.distributed", "--coordinator-address", f"127.0.0.1:{port}",
                       "--num-processes", "2", "--process-id", str(i), "--set",
                       "distributed.initialization_timeout_s=60", "--out", str(tmp_path)] for i in range(2)],
                     timeout=120, cwd=ROOT, env=_processes.cpu_env(4))
  results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
  for i, r in enumerate(results):
    assert r["process_id"] == i and r["num_processes"] == 2 and r["device_count"] == 8
    assert r["method"] == "explicit" and r["coordinator"] == (i == 0)
    assert r["mesh"] == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}  # dcn data=-1 -> 2 processes, ici fsdp=-1 -> 4
    assert r["processes_in_mesh"] == [0, 1]
    # Process i contributes 2*3*4 = 24 values equal to i + 1: 24*1 + 24*2 = 72 needs both processes.
    assert r["sum"] == r["psum"] == r["expected"] == 72.0
    assert r["local_rows"], "multihost.local_rows did not return this process's own rows"
  assert results[0]["sum"] == results[1]["sum"]
  # process_zero_only: exactly one coordinator file, written by process 0.
  assert json.loads((tmp_path / "coordinator.json").read_text())["process_id"] == 0
  assert len(jax.devices()) == 8  # this test process is untouched
