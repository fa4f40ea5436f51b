"""TPU topologies without a TPU: chip specs, topology names, and the devices of a topology from libtpu.

`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x4x4")` gives the devices of a
slice on any host where libtpu is installed (`pip install -e '.[tpu]'`); programs laid on a mesh of them compile
with the real TPU compiler. Nothing runs on them.

Names: `v5p:2x4x4` (generation and chip grid) or an accelerator type, `v5p-64`. The number of an accelerator type
counts TensorCores for v4 and v5p (two per chip: v5p-64 is 32 chips, 2x4x4) and chips for v5e and v6e (v6e-256 is
16x16); each host has 4 chips (v4, v5p) or up to 8 (v5e, v6e). TPU7x takes the grid spelling only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
from typing import Any, Iterator

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip's published peaks (Google Cloud's TPU pages, per chip)."""
  generation: str          # the topology spelling: v4, v5e, v5p, v6e, tpu7x
  device_kind: str         # what JAX's `device.device_kind` says
  hbm_bytes: int
  bf16_flops: float        # dense bf16 FLOP/s
  hbm_bandwidth: float     # bytes/s
  dims: int                # topology dimensions: 3 (torus) or 2
  cores_per_chip: int      # how accelerator types count (v4/v5p: TensorCores; v5e/v6e: chips)


CHIPS: dict[str, Chip] = {c.generation: c for c in (
    Chip("v4", "TPU v4", 32 * GIB, 275e12, 1.23e12, 3, 2),
    Chip("v5e", "TPU v5 lite", 16 * GIB, 197e12, 0.82e12, 2, 1),
    Chip("v5p", "TPU v5", 95 * GIB, 459e12, 2.76e12, 3, 2),
    Chip("v6e", "TPU v6 lite", 32 * GIB, 918e12, 1.64e12, 2, 1),
    # Ironwood: 192 GB HBM, 7.37 TB/s, 4,614 TFLOP/s FP8 (Google's announcement); bf16 at half the FP8 rate.
    Chip("tpu7x", "TPU7x", 192 * 10 ** 9, 2307e12, 7.37e12, 3, 2),
)}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}

# The chip grids of the published slice shapes, by chip count.
GRIDS_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
            256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
GRIDS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


class TopologyError(ValueError):
  """A topology name that cannot be read or built; the message lists what would be valid."""


def known_names() -> list[str]:
  """Accelerator types this module can turn into a topology."""
  out = []
  for chip in CHIPS.values():
    if chip.generation == "tpu7x":
      continue
    for chips in (GRIDS_3D if chip.dims == 3 else GRIDS_2D):
      out.append(f"{chip.generation}-{chips * chip.cores_per_chip}")
  return out


def parse(name: str) -> tuple[Chip, tuple[int, ...]]:
  """(chip, grid) of `v5p:2x4x4` or `v5p-64`."""
  text = name.strip().lower()
  match = re.fullmatch(r"([a-z0-9]+?)(?::(\d+(?:x\d+)*)|-(\d+))", text)
  generation = ALIASES.get(match.group(1), match.group(1)) if match else None
  if not match or generation not in CHIPS:
    raise TopologyError(f"topology {name!r}: not a TPU topology; give a generation of {sorted(CHIPS)} as "
                        f"'v5p:2x4x4' (chip grid) or an accelerator type such as 'v5p-64' (known: "
                        f"{', '.join(known_names())})")
  chip = CHIPS[generation]
  if match.group(2):
    grid = tuple(int(x) for x in match.group(2).split("x"))
    if len(grid) != chip.dims or min(grid) < 1:
      raise TopologyError(f"topology {name!r}: a {generation} grid has {chip.dims} dimensions, e.g. "
                          f"{generation}:{'x'.join(map(str, (GRIDS_3D if chip.dims == 3 else GRIDS_2D)[4]))}")
    return chip, grid
  if generation == "tpu7x":
    raise TopologyError(f"topology {name!r}: give TPU7x as a chip grid, e.g. tpu7x:2x2x1")
  count = int(match.group(3))
  grids = GRIDS_3D if chip.dims == 3 else GRIDS_2D
  if count % chip.cores_per_chip or count // chip.cores_per_chip not in grids:
    known = [n for n in known_names() if n.startswith(generation + "-")]
    raise TopologyError(f"topology {name!r}: no {generation} slice of that size; known: {', '.join(known)} "
                        f"(or a grid: {generation}:AxB{'xC' if chip.dims == 3 else ''})")
  return chip, grids[count // chip.cores_per_chip]


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice's devices (from libtpu, without TPUs) and its chip's peaks."""
  name: str                           # canonical: generation:grid
  chip: Chip
  grid: tuple[int, ...]
  devices: tuple[Any, ...]            # jax TPU devices of the topology description

  @property
  def chips(self) -> int:
    return math.prod(self.grid)

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  @property
  def devices_per_chip(self) -> int:
    return max(1, len(self.devices) // self.chips)

  @property
  def device_hbm(self) -> int:
    return self.chip.hbm_bytes // self.devices_per_chip

  @property
  def device_flops(self) -> float:
    return self.chip.bf16_flops / self.devices_per_chip

  @property
  def device_bandwidth(self) -> float:
    return self.chip.hbm_bandwidth / self.devices_per_chip

  def host_devices(self) -> dict[int, int]:
    """Devices per host (process index -> count)."""
    out: dict[int, int] = {}
    for d in self.devices:
      out[d.process_index] = out.get(d.process_index, 0) + 1
    return out


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
  """Holds back what native code writes to stderr (libtpu warns about TPU_ACCELERATOR_TYPE and
  TPU_WORKER_HOSTNAMES on a host without TPUs); the text is handed back for an error message."""
  captured: list[str] = []
  with tempfile.TemporaryFile(mode="w+b") as sink:
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
      yield captured
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      captured.append(sink.read().decode(errors="replace"))


def libtpu_available() -> bool:
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None


def topology(name: str) -> Topology:
  """The devices of topology `name` (see `parse`), for compiling. Raises TopologyError without libtpu."""
  chip, grid = parse(name)
  if not libtpu_available():
    raise TopologyError("compiling for a TPU topology needs libtpu (no TPU needed): pip install -e '.[tpu]'")
  from jax.experimental import topologies
  canonical = f"{chip.generation}:{'x'.join(map(str, grid))}"
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) so that two processes never drive one TPU; a plan
  # drives none, and two plans (or test workers) at once must not refuse each other.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with _quiet_stderr() as text:
    try:
      desc = topologies.get_topology_desc(platform="tpu", topology_name=canonical)
      error = None
    except Exception as e:
      error = e
  if error is not None:
    raise TopologyError(f"libtpu could not describe {canonical}: {error}\n{''.join(text).strip()}") from None
  devices = tuple(desc.devices)
  if devices and devices[0].device_kind != chip.device_kind:
    raise TopologyError(f"{canonical}: libtpu describes {devices[0].device_kind!r} devices, expected "
                        f"{chip.device_kind!r}")
  return Topology(name=canonical, chip=chip, grid=grid, devices=devices)


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of arrays or `ShapeDtypeStruct`s with shardings (the largest shard)."""
  import jax
  total = 0
  for leaf in jax.tree.leaves(tree):
    if not hasattr(leaf, "shape"):
      continue
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return total

