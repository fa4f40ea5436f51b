"""bench/checkpoint_memory.py on a ~1 GiB model in 128 MiB shards: export and load stream tensor by tensor, so
neither phase holds a second copy of the model on the host. Before streaming, export held the whole model (0.81x
the checkpoint besides the model itself) and load kept every shard mapped (1.36x); a phase needs a few times the
largest tensor (125 MiB here), which is under 0.6x this checkpoint. Loaded onto 8 devices, each device's slice is
read on its own, so the load needs less than loaded whole (measured: 0.215 against 0.480 GiB for 2 GiB)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "checkpoint_memory.py"


@pytest.mark.slow
def test_export_and_load_need_far_less_host_memory_than_the_checkpoint(capsys):
  spec = importlib.util.spec_from_file_location("bench_checkpoint_memory", BENCH)
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench
  spec.loader.exec_module(bench)
  export, load, load_mesh = bench.main(["--gib", "1.0", "--shard-gib", "0.125"])
  out = capsys.readouterr().out
  assert "export: checkpoint" in out and "load: checkpoint" in out and "load_mesh: checkpoint" in out
  assert export["shards"] == load["shards"] > 4 and export["checkpoint_bytes"] >= 0.9 * 2**30
  for phase in (export, load, load_mesh):
    assert phase["extra_bytes"] < 0.6 * phase["checkpoint_bytes"], phase
  assert load_mesh["extra_bytes"] < load["extra_bytes"], (load_mesh, load)
