"""What the compiler says of one program: per-device memory, FLOPs, bytes and collectives, and its roofline time.

The numbers are XLA's own (`Compiled.memory_analysis()`, `cost_analysis()`, the optimized HLO text), per device.
A loop's body is counted once, in FLOPs, bytes and the collective listing alike (checked on `v5p:2x2x1`: a scan of
4 or 40 matmuls reports the FLOPs of one): a decode program's costs are one decode step's, and of a step whose
layers are scanned, one layer's. So a program's roofline time takes the larger of the compiler's count and the work
counted outside it where the planner gives it (`work_flops`, `work_bytes`: the model's FLOPs and the bytes a call
must move), both lower bounds.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from typing import Any, Callable, Sequence

from jaxagent.plan.topologies import Topology, per_device_bytes

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5,
                "u4": 0.5}
_OP = re.compile(r"=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\]\S*)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """The collectives of one kind in a compiled program: instructions and the bytes their results hold."""
  kind: str
  count: int
  bytes: int


def _shape_bytes(dtype: str, dims: str) -> int:
  size = 1
  for d in filter(None, dims.split(",")):
    size *= int(d)
  return int(size * _DTYPE_BYTES.get(dtype, 4))


def collectives(hlo_text: str) -> tuple[Collective, ...]:
  """Collectives of an optimized HLO module, by kind (an async `-start` counts once, its result's largest
  array: the gathered or reduced buffer)."""
  found: dict[str, list[int]] = {}
  for match in _OP.finditer(hlo_text):
    shapes = [_shape_bytes(t, d) for t, d in _SHAPE.findall(match.group(1))]
    nbytes = (max(shapes) if match.group(3) else sum(shapes)) if shapes else 0
    entry = found.setdefault(match.group(2), [0, 0])
    entry[0] += 1
    entry[1] += nbytes
  return tuple(Collective(kind, n, b) for kind, (n, b) in sorted(found.items()))


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One compiled program, per device. `resident_bytes`: what stays in HBM beside its arguments while it runs
  (the train state during a rollout); `calls`: how often one iteration runs it."""
  name: str
  what: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  resident_bytes: int
  flops: float
  bytes_accessed: float
  collectives: tuple[Collective, ...]
  compile_seconds: float
  calls: float
  refused: str | None = None      # the compiler's message when it refused the program for want of HBM (its
                                  # temporaries are then the bytes it names; arguments are counted here)
  work_flops: float | None = None  # per device and call, counted outside the compiler (its loops counted whole)
  work_bytes: float | None = None  # likewise the HBM bytes a call must move

  @property
  def peak_bytes(self) -> int:
    """HBM the program needs at once: arguments, outputs not aliased to a donated argument, temporaries, code,
    and what stays resident beside it."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes
            + self.resident_bytes)

  def seconds(self, topology: Topology) -> float:
    """Roofline time of one call: the larger of FLOPs at the chip's bf16 peak and bytes at its HBM bandwidth
    (`work_flops` / `work_bytes` where given: the compiler counts a loop's body once)."""
    return max(self.model_flops / topology.device_flops, self.model_bytes / topology.device_bandwidth)

  @property
  def model_flops(self) -> float:
    """The FLOPs of one call the roofline takes: the larger of the compiler's count and the planner's (both lower
    bounds: the compiler's counts a loop's body once, the planner's the model's work only)."""
    return max(self.flops, self.work_flops or 0.0)

  @property
  def model_bytes(self) -> float:
    """The bytes of one call the roofline takes: the larger of the compiler's count and the planner's."""
    return max(self.bytes_accessed, self.work_bytes or 0.0)

  def bound(self, topology: Topology) -> str:
    return "compute" if self.model_flops / topology.device_flops >= self.model_bytes / topology.device_bandwidth \
        else "memory"


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED.*?required for HLO temporaries \(([0-9.]+)([KMGT]?)\)")


def _refused_bytes(message: str) -> int | None:
  """The temporaries' bytes named by libtpu's out-of-HBM refusal, or None for any other error."""
  match = _EXHAUSTED.search(message)
  return None if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])


def compile_program(name: str, what: str, jitted: Any, args: Sequence[Any], *, resident_bytes: int = 0,
                    calls: float = 1.0, work_flops: float | None = None, work_bytes: float | None = None,
                    progress: Callable[[str], None] | None = None) -> ProgramCost:
  """Lowers `jitted` on abstract `args` (ShapeDtypeStructs with shardings), compiles it, reads its costs."""
  start = time.perf_counter()
  if progress:
    progress(f"compiling {name} ({what})")
  lowered = jitted.lower(*args)
  try:
    with warnings.catch_warnings():
      # A persistent compilation cache (JAX_COMPILATION_CACHE_DIR) holds executables for this host's client;
      # reading a TPU entry back fails ("PjRtCompiler must be constructed with a Client") and JAX recompiles.
      warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
      compiled = lowered.compile()
  except Exception as e:
    refused = _refused_bytes(str(e))
    if refused is None:
      raise
    # The compiler refuses a program whose temporaries exceed HBM: it does not fit, by the bytes it names.
    cost = lowered.cost_analysis() or {}
    return ProgramCost(name=name, what=what, argument_bytes=per_device_bytes(args), output_bytes=0, alias_bytes=0,
                       temp_bytes=refused,
                       code_bytes=0, resident_bytes=int(resident_bytes), flops=float(cost.get("flops", 0.0)),
                       bytes_accessed=float(cost.get("bytes accessed", 0.0)), collectives=(),
                       compile_seconds=time.perf_counter() - start, calls=calls,
                       refused=str(e).splitlines()[0][:300], work_flops=work_flops, work_bytes=work_bytes)
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per module
    cost = cost[0] if cost else {}
  return ProgramCost(
      name=name, what=what, argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes), alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes), code_bytes=int(memory.generated_code_size_in_bytes),
      resident_bytes=int(resident_bytes), flops=float(cost.get("flops", 0.0)),
      bytes_accessed=float(cost.get("bytes accessed", 0.0)), collectives=collectives(compiled.as_text()),
      compile_seconds=seconds, calls=calls, work_flops=work_flops, work_bytes=work_bytes)
