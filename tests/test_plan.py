"""`jaxagent plan`: every program of an RL iteration compiled for a TPU topology with libtpu's compiler, no TPU."""

import json
import os

import jax
import pytest

from jaxagent import cli
from jaxagent import config as config_lib
from jaxagent import plan
from jaxagent.plan import compiled as compiled_lib
from jaxagent.plan import topologies as topology_lib
from jaxagent.train import run as run_lib



@pytest.fixture
def libtpu():
  """The plan's compiler: skip with the reason without libtpu, or fail under JAXAGENT_REQUIRE_LIBTPU=1 (.ci/run)."""
  if not topology_lib.libtpu_available():
    reason = "libtpu is not installed (pip install -e '.[tpu]'): the plan compiles with it"
    if os.environ.get("JAXAGENT_REQUIRE_LIBTPU") == "1":
      pytest.fail(f"JAXAGENT_REQUIRE_LIBTPU=1 but {reason}")
    pytest.skip(reason)


# A tiny model at small sizes: every program compiles for the TPU in seconds.
SMALL = ["train.tasks_per_iteration=2", "train.group_size=4", "rollout.max_context=64", "rollout.max_new_tokens=8",
         "env.max_turns=2"]


def _plan(capsys, topology, *sets, headroom=None):
  argv = ["plan", "tiny_cpu", "--topology", topology, "--json", "--quiet"]
  argv += [a for s in SMALL + list(sets) for a in ("--set", s)]
  argv += [] if headroom is None else ["--headroom", str(headroom)]
  rc = cli.main(argv)
  captured = capsys.readouterr()
  return rc, (json.loads(captured.out) if captured.out.strip() else None), captured.err


def test_topology_names_in_both_spellings_and_bad_names_list_the_known_ones():
  assert topology_lib.parse("v5p-64")[1] == (2, 4, 4)  # 64 TensorCores = 32 chips
  assert topology_lib.parse("v5p:4x4x4")[1] == (4, 4, 4)
  assert topology_lib.parse("v6e-256")[1] == (16, 16)  # v6e counts chips
  assert topology_lib.parse("v5litepod-16")[0].generation == "v5e"
  with pytest.raises(plan.TopologyError, match="known: .*v5p-64"):
    topology_lib.parse("v9-8")
  with pytest.raises(plan.TopologyError, match="no v5p slice of that size; known: v5p-8"):
    topology_lib.parse("v5p-12")
  with pytest.raises(plan.TopologyError, match="3 dimensions"):
    topology_lib.parse("v5p:2x2")
  with pytest.raises(plan.TopologyError, match="tpu7x:2x2x1"):
    topology_lib.parse("tpu7x-8")


def test_collectives_and_refusals_are_read_from_the_compiler_text():
  hlo = """
  %all-gather = bf16[2048,4096]{1,0:T(8,128)(2,1)} all-gather(%param), channel_id=1, dimensions={1}
  %ag-start = (bf16[16,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%p), dimensions={0}
  %ag-done = bf16[64,8]{1,0} all-gather-done(%ag-start)
  ROOT %all-reduce = (f32[4]{0}, f32[2,2]{1,0}) all-reduce(%a, %b), to_apply=%add
  """
  found = {c.kind: (c.count, c.bytes) for c in plan.collectives(hlo)}
  assert found == {"all-gather": (2, 2048 * 4096 * 2 + 64 * 8 * 2), "all-reduce": (1, 16 + 16)}
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
             "(152.98G) exceeds available HBM (95.74G).")
  assert compiled_lib._refused_bytes(message) == int(152.98 * 2 ** 30)
  assert compiled_lib._refused_bytes("INTERNAL: something else") is None


def test_without_libtpu_the_error_says_what_to_install(monkeypatch, capsys):
  monkeypatch.setattr(topology_lib, "libtpu_available", lambda: False)
  assert cli.main(["plan", "tiny_cpu", "--topology", "v5p-8"]) == 2
  assert "pip install -e '.[tpu]'" in capsys.readouterr().err


@pytest.mark.usefixtures("libtpu")
def test_the_plan_lays_parameters_out_as_build_run_does_on_a_cpu_mesh_of_the_same_shape():
  """The same builder over the topology's 4 TPU devices and over 4 fake CPU devices: equal specs per leaf."""
  cfg = config_lib.load("tiny_cpu", ["mesh.ici.fsdp=2", "mesh.ici.data=-1", "mesh.ici.tensor=2"])
  io = run_lib.build_interface(cfg)
  tpu = run_lib.build_policy(cfg, io, devices=plan.topology("v5p:2x2x1").devices, abstract=True)
  cpu = run_lib.build_policy(cfg, io, devices=jax.devices("cpu")[:4])
  assert dict(tpu.layout.mesh.shape) == dict(cpu.layout.mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1,
                                                                          "tensor": 2}
  specs = lambda p: [s.spec for s in jax.tree.leaves(p.layout.state_shardings)]
  assert specs(tpu) == specs(cpu)
  assert any(spec != jax.sharding.PartitionSpec() for spec in specs(tpu))  # something is sharded at all
  rollout = lambda p: [s.spec for s in jax.tree.leaves(p.layout.rollout_policy_shardings)]
  assert rollout(tpu) == rollout(cpu)


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_plans_of_a_tiny_run_fit_and_their_bytes_grow_with_rows_and_context(capsys):
  rc, base, _ = _plan(capsys, "v5p:2x2x1")
  assert rc == 0 and base["fits"] and base["chips"] == 4 and base["hosts"] == 1
  names = [p["name"] for p in base["programs"]]
  assert names == ["train_step", "to_rollout", "to_learner", "rollout_feed", "rollout_decode"]
  assert all(0 < p["peak_bytes"] < base["device_hbm_bytes"] for p in base["programs"])
  assert base["iteration"]["seconds"] > 0 and 0 < base["iteration"]["mfu"] < 1
  rc, rows, _ = _plan(capsys, "v5p:2x2x1", "train.tasks_per_iteration=8")
  rc, context, _ = _plan(capsys, "v6e:2x2", "rollout.max_context=256")
  decode = lambda plan_: next(p for p in plan_["programs"] if p["name"] == "rollout_decode")
  train = lambda plan_: next(p for p in plan_["programs"] if p["name"] == "train_step")
  assert decode(rows)["argument_bytes"] > decode(base)["argument_bytes"]  # the KV cache of 4x the rows
  assert decode(context)["argument_bytes"] > decode(base)["argument_bytes"]
  assert train(rows)["argument_bytes"] > train(base)["argument_bytes"]
  assert context["device_hbm_bytes"] == 32 * 2 ** 30 and context["chip"] == "v6e"
  # The compiler counts the layers' loop body once, so a rollout program's roofline takes the model's work: the
  # weights and the whole cache per call (more rows, more cache) and FLOPs that grow with the rows.
  assert decode(base)["work_bytes"] > 0 and decode(rows)["work_bytes"] > decode(base)["work_bytes"]
  assert decode(rows)["work_flops"] == pytest.approx(4 * decode(base)["work_flops"])  # 8 tasks against 2: 4x the rows
  most = lambda p, ours, xla: max(p[ours], p[xla])  # the larger of two lower bounds
  assert decode(base)["seconds"] == pytest.approx(max(
      most(decode(base), "work_flops", "flops") / base["device_bf16_flops"],
      most(decode(base), "work_bytes", "bytes_accessed") / base["device_hbm_bandwidth"]))


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_a_config_too_large_for_the_chip_is_reported_with_the_bytes_over(capsys):
  """Replicated float32 weights and Adam moments of a 1.1B model cannot fit a v5e's 16 GiB: the compiler refuses
  the train step, and the plan says so with rc 1, naming the program and its bytes over."""
  big = ["model.init.hidden_size=4096", "model.init.intermediate_size=16384", "model.init.num_hidden_layers=4",
         "model.init.num_attention_heads=32", "model.init.num_key_value_heads=8", "model.init.head_dim=128",
         "model.init.vocab_size=32000", "mesh.rules.learner=replicated", "mesh.rules.rollout=replicated",
         "mesh.max_replicated_fraction=1.0"]
  rc, report, _ = _plan(capsys, "v5e:2x2", *big)
  assert rc == 1 and not report["fits"]
  over = [p for p in report["programs"] if p["over_bytes"] > 0]
  assert [p["name"] for p in over] == ["train_step"] and over[0]["peak_bytes"] > 16 * 2 ** 30
  assert over[0]["refused"].startswith("RESOURCE_EXHAUSTED")
  assert over[0]["argument_bytes"] > 1.1e9 * 12  # float32 weights and two Adam moments, on every device
  assert all(p["over_bytes"] <= 0 for p in report["programs"] if p["name"] != "train_step")


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_fit_finds_the_largest_rows_that_fit_and_the_smallest_micro_batch_count(capsys):
  """A 2-layer model with 8 KiB of KV cache per token at 2,048 tokens, allowed 10 % of a v5e's 16 GiB
  (--headroom 0.9): the rollout holds a few dozen rows. The tasks found fit and one step more did not (both were
  compiled); the micro-batch count found fits and no smaller one did; the final plan at those settings fits."""
  small = ["model.init.hidden_size=128", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8",
           "model.init.head_dim=64", "rollout.max_context=2048", "train.remat=full", "model.attention=chunked",
           "train.logits_chunk=1024"]
  argv = ["plan", "tiny_cpu", "--topology", "v5e:2x2", "--fit", "--headroom", "0.9", "--json", "--quiet"]
  assert cli.main(argv + [a for s in small for a in ("--set", s)]) == 0
  report = json.loads(capsys.readouterr().out)
  found = report["fit"]
  tasks, step = found["tasks_per_iteration"], found["task_step"]
  by_tasks = {p["value"]: p["fits"] for p in found["probes"] if p["setting"] == "train.tasks_per_iteration"}
  assert by_tasks[tasks] and by_tasks[tasks + step] is False
  by_micro = {p["value"]: p["fits"] for p in found["probes"] if p["setting"] == "train.micro_batches"}
  assert by_micro[found["micro_batches"]] and not any(fits for m, fits in by_micro.items() if m < found["micro_batches"])
  assert report["fits"] and report["rows"] == tasks * 8 and report["micro_batches"] == found["micro_batches"]
  assert found["overrides"] == [f"train.tasks_per_iteration={tasks}", f"train.micro_batches={found['micro_batches']}"]
