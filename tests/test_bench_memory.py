"""bench/memory.py on the tiny shape (the real vocabulary, 2 small layers): it compiles every variant and the
memory options shrink the compiled step's peak as they should."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "memory.py"


def test_memory_bench_runs_and_chunking_and_remat_lower_the_peak(capsys):
  spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench  # dataclasses look their module up
  spec.loader.exec_module(bench)
  results = bench.main(["--tiny"])
  out = capsys.readouterr().out
  assert "x direct" in out and len(out.splitlines()) == 1 + len(bench.VARIANTS)
  direct, chunked, remat, lora = (results[k] for k in ("direct", "chunked", "chunked + remat", "+ LoRA"))
  assert direct.arguments == chunked.arguments == remat.arguments  # same state and batch
  assert lora.arguments < remat.arguments / 2 and lora.peak < remat.peak  # no Adam moments for the base
  # At V = 151,936 and T = 256 the [B, T, V] float32 logits (and their gradient) dominate the direct step.
  assert chunked.temp < direct.temp / 2 and remat.peak <= chunked.peak
