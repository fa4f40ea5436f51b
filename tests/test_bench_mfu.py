"""bench/mfu.py's CPU smoke run: it compiles and times the train step and the decode loop and reports MFU and
the decode roofline ratio when given the device's peaks."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "mfu.py"


def test_mfu_bench_runs_on_a_tiny_shape(capsys):
  spec = importlib.util.spec_from_file_location("bench_mfu", BENCH)
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench
  spec.loader.exec_module(bench)
  result = bench.main(["--tiny", "--steps", "2", "--peak-tflops", "1", "--bandwidth-gbs", "10"])
  out = capsys.readouterr().out
  assert "MFU" in out and "bandwidth roofline" in out
  assert result.train_flops > 0 and result.train_tokens_per_s > 0 and result.decode_tokens_per_s > 0
  assert 0 < result.mfu < 1 and result.decode_roofline_tokens_per_s > 0
  assert bench._peaks("NVIDIA H200", None, None) == (989e12, 4.8e12)  # the table a GPU run looks itself up in
