"""Host memory of writing and loading a sharded HF checkpoint, against the checkpoint's size.

A random Llama-shaped model of about `--gib` GiB (float32) is exported with `models.save_pretrained` in shards of
`--shard-gib`, then loaded with `models.from_pretrained`, whole (one device) and onto a mesh of 8 fake CPU devices
(FSDP over all 8: each device's slice read on its own), each in a fresh process. Per phase: the process's peak
resident memory (ru_maxrss) above what it held before the phase began, less the model's own bytes (on a CPU the
model's arrays live in host memory), i.e. what the phase needed besides the model, as a fraction of the
checkpoint's size and as a multiple of its largest tensor.

    python bench/checkpoint_memory.py            # ~2 GiB, 512 MiB shards
    python bench/checkpoint_memory.py --gib 0.2 --shard-gib 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _rss_bytes() -> int:
  """Current resident set size of this process."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
  """Starts a new high-water mark of this process's resident memory (Linux: clear_refs 5 resets VmHWM)."""
  Path("/proc/self/clear_refs").write_text("5")


def _peak_bytes() -> int:
  """This process's resident high-water mark since `_reset_peak` (VmHWM)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(gib: float):
  import models
  hidden, inter, vocab = 1024, 2816, 32000
  per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
  fixed = 2 * vocab * hidden * 4
  layers = max(1, round((gib * GIB - fixed) / per_layer))
  return models.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                            num_attention_heads=16, num_key_value_heads=16, head_dim=64, tie_word_embeddings=False)


def _phase(phase: str, directory: str, gib: float, shard_gib: float) -> None:
  """Runs in a child process: prints one JSON line."""
  import jax
  import numpy as np
  from flax import nnx
  import models
  jax.devices()
  if phase == "export":
    model = models.Transformer(_config(gib), rngs=nnx.Rngs(0))
    arrays = [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
    jax.block_until_ready(arrays)
    model_bytes = sum(a.nbytes for a in arrays)
    largest = max(a.nbytes for a in arrays)
    before = _rss_bytes()  # the model is in it
    _reset_peak()  # the init's own peak is not the export's
    models.save_pretrained(model, directory, max_shard_bytes=int(shard_gib * GIB))
    extra = _peak_bytes() - before
  else:
    mesh = rules = None
    if phase == "load_mesh":
      from jaxagent import sharding
      mesh, rules = sharding.make_mesh({"data": 1, "fsdp": 8}), sharding.FSDP_TP_RULES
    before = _rss_bytes()
    _reset_peak()
    model = models.from_pretrained(directory, mesh=mesh, rules=rules)
    arrays = [v[...] for _, v in nnx.to_flat_state(nnx.state(model))]
    model_bytes = sum(a.nbytes for a in arrays)
    largest = max(a.nbytes for a in arrays)
    extra = _peak_bytes() - before - model_bytes
  files = sorted(Path(directory).glob("*.safetensors"))
  print(json.dumps(dict(phase=phase, model_bytes=model_bytes, largest_tensor_bytes=largest,
                        checkpoint_bytes=sum(f.stat().st_size for f in files), shards=len(files),
                        extra_bytes=int(extra))))
  del np


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gib", type=float, default=2.0, help="model size in GiB (float32)")
  parser.add_argument("--shard-gib", type=float, default=0.5, help="largest safetensors shard in GiB")
  parser.add_argument("--phase", choices=("export", "load", "load_mesh"), help=argparse.SUPPRESS)
  parser.add_argument("--dir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.phase:
    _phase(args.phase, args.dir, args.gib, args.shard_gib)
    return []
  rows = []
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  with tempfile.TemporaryDirectory(prefix="ckpt-memory-") as tmp:
    for phase in ("export", "load", "load_mesh"):
      flags = "--xla_force_host_platform_device_count=8" if phase == "load_mesh" else ""
      out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", tmp, "--gib", str(args.gib),
                            "--shard-gib", str(args.shard_gib)], env=dict(env, XLA_FLAGS=flags), capture_output=True,
                           text=True, check=False)
      if out.returncode:
        raise SystemExit(f"{phase} failed:\n{out.stderr[-3000:]}")
      rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  for r in rows:
    print(f"{r['phase']:>9}: checkpoint {r['checkpoint_bytes'] / GIB:.2f} GiB in {r['shards']} shards; peak host "
          f"memory besides the model {r['extra_bytes'] / GIB:.3f} GiB = {r['extra_bytes'] / r['checkpoint_bytes']:.2f}x "
          f"the checkpoint, {r['extra_bytes'] / r['largest_tensor_bytes']:.1f}x its largest tensor "
          f"({r['largest_tensor_bytes'] / 2**20:.0f} MiB)")
  return rows


if __name__ == "__main__":
  main()
