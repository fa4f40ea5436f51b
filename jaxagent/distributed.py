"""Multi-process initialization in one place: explicit flags, SLURM, TPU, or a single process.

Every host runs the same program (multi-controller SPMD). Call `initialize(config.distributed)` first thing in
a process, before any JAX computation; it wraps `jax.distributed.initialize` and lets JAX auto-detect what
JAX already detects:

- **explicit** (`distributed.coordinator_address/num_processes/process_id`, or the environment variables
  `JAX_COORDINATOR_ADDRESS` (read by JAX itself), `JAXAGENT_NUM_PROCESSES`, `JAXAGENT_PROCESS_ID`; the
  local launcher `launch/local.py` sets these): passed through with cluster detection off.
- **slurm** (inside `srun`: `SLURM_JOB_ID`, `SLURM_NTASKS`, `SLURM_PROCID`): with several tasks per node
  (one process per GPU) JAX's own SLURM detection (`cluster_detection_method="slurm"`) is used as is; it
  gives each task the GPU of its `SLURM_LOCALID`. With one task per node JAX's detection would also hide all
  but GPU 0, so the coordinator (first host of `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`) and ranks
  are read here and every local GPU stays visible. The port is `distributed.coordinator_port`, else
  `JAX_COORDINATOR_PORT`, else JAX's own choice derived from `SLURM_JOB_ID` (so both paths agree).
- **tpu** (Cloud TPU VMs and GKE TPU pods): `jax.distributed.initialize()` with no arguments; JAX reads the
  worker list from the TPU metadata server or `TPU_WORKER_HOSTNAMES`.
- **single**: one process; `jax.distributed` is not started.

`mode: auto` (the default) picks the first that applies, in that order. Calling `initialize` again is a
no-op that returns the same `ProcessInfo` (and fails if it asks for a different process count).

Run `python -m jaxagent.distributed` on every host (or under `launch/local.py`) to check a cluster: it
initializes, builds the configured mesh and prints the result of a cross-process reduction.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import jax

from jaxagent.config import DistributedConfig

F = TypeVar("F", bound=Callable[..., Any])

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX reads this one itself
ENV_NUM_PROCESSES = "JAXAGENT_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXAGENT_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # JAX reads this one itself
# Environment variables whose presence marks a TPU VM or GKE TPU pod (set by the TPU runtime / GKE webhook).
# (Not TPU_SKIP_MDS_QUERY: some images set it everywhere, and it means "no TPU metadata server".)
_TPU_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE")


class DistributedError(RuntimeError):
  """Multi-process initialization cannot proceed: a missing or inconsistent setting."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to call `jax.distributed.initialize`: the method chosen and its keyword arguments.

  Attributes:
    method: "explicit", "slurm", "slurm-jax" (JAX's own SLURM detection), "tpu" or "single".
    kwargs: keyword arguments for `jax.distributed.initialize` (empty for "single").
  """

  method: str
  kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """What this process is after initialization."""

  method: str
  process_id: int
  num_processes: int
  local_device_count: int
  device_count: int
  coordinator_address: str | None

  @property
  def is_coordinator(self) -> bool:
    return self.process_id == 0


# ----------------------------------------------------------------------------------------------
# SLURM variables (pure functions of an environment mapping; tested without a cluster).


def slurm_first_host(nodelist: str) -> str:
  """The first host of a SLURM hostlist: `node[003-010,12],gpu1` -> `node003`, `r[1-2]-n[07-09]` -> `r1-n07`.

  Args:
    nodelist: a compressed SLURM hostlist (`SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`).

  Returns:
    The first hostname, with the zero padding of the range kept.
  """
  nodelist = nodelist.strip()
  depth, end = 0, len(nodelist)
  for i, ch in enumerate(nodelist):
    depth += ch == "["
    depth -= ch == "]"
    if ch == "," and depth == 0:
      end = i
      break
  first = nodelist[:end]
  if not first or depth < 0 or first.count("[") != first.count("]"):
    raise DistributedError(f"cannot parse SLURM hostlist {nodelist!r}")
  return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def slurm_tasks_per_node(value: str) -> list[int]:
  """Expands SLURM's compressed tasks-per-node list: `2(x3),1` -> `[2, 2, 2, 1]`."""
  counts: list[int] = []
  for item in value.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
    if not m:
      raise DistributedError(f"cannot parse SLURM tasks-per-node {value!r} (expected e.g. '8' or '2(x3),1')")
    counts.extend([int(m.group(1))] * int(m.group(2) or 1))
  return counts


def _slurm_int(environ: Mapping[str, str], name: str) -> int:
  value = environ.get(name)
  if value is None:
    raise DistributedError(f"SLURM mode needs ${name} (set by srun); run the program under `srun`")
  try:
    return int(value)
  except ValueError:
    raise DistributedError(f"${name}={value!r} is not an integer") from None


def _slurm_port(config: DistributedConfig, environ: Mapping[str, str]) -> int:
  if config.coordinator_port is not None:
    return config.coordinator_port
  if "JAX_COORDINATOR_PORT" in environ:
    return int(environ["JAX_COORDINATOR_PORT"])
  # The same rule as JAX's SlurmCluster, so processes taking either path agree on the port.
  return _slurm_int(environ, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)


def _tasks_on_this_node(environ: Mapping[str, str]) -> int:
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    if name in environ:
      counts = slurm_tasks_per_node(environ[name])
      node = int(environ.get("SLURM_NODEID", "0"))
      if node >= len(counts):
        raise DistributedError(f"$SLURM_NODEID={node} but ${name}={environ[name]!r} lists {len(counts)} nodes")
      return counts[node]
  if "SLURM_NTASKS_PER_NODE" in environ:
    return int(environ["SLURM_NTASKS_PER_NODE"])
  return 1


def _slurm_plan(config: DistributedConfig, environ: Mapping[str, str], common: dict[str, Any]) -> Plan:
  num_processes = _slurm_int(environ, "SLURM_NTASKS")
  process_id = _slurm_int(environ, "SLURM_PROCID")
  tasks_here = _tasks_on_this_node(environ)
  in_step = "SLURM_STEP_NODELIST" in environ and "SLURM_LOCALID" in environ
  if (in_step and tasks_here > 1 and config.coordinator_address is None and config.coordinator_port is None
      and config.local_device_ids is None):
    # One process per device: exactly the case JAX's SlurmCluster handles (it pins device SLURM_LOCALID).
    return Plan("slurm-jax", dict(common, cluster_detection_method="slurm"))
  nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
  if config.coordinator_address is not None:
    address = config.coordinator_address
  elif nodelist:
    address = f"{slurm_first_host(nodelist)}:{_slurm_port(config, environ)}"
  else:
    raise DistributedError("SLURM mode needs $SLURM_STEP_NODELIST or $SLURM_JOB_NODELIST, or "
                           "distributed.coordinator_address")
  local = config.local_device_ids
  if local is None and tasks_here > 1:
    local = (_slurm_int(environ, "SLURM_LOCALID"),)
  return Plan("slurm", dict(common, coordinator_address=address, num_processes=num_processes,
                            process_id=process_id, local_device_ids=None if local is None else list(local),
                            cluster_detection_method="deactivate"))


# ----------------------------------------------------------------------------------------------
# Resolution and initialization.


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise DistributedError(f"${name}={value!r} is not an integer") from None


def _on_tpu(environ: Mapping[str, str]) -> bool:
  return any(name in environ for name in _TPU_ENV) or Path("/dev/accel0").exists() or Path("/dev/vfio/0").exists()


def resolve(config: DistributedConfig | None = None, environ: Mapping[str, str] | None = None) -> Plan:
  """Decides how to initialize from `config` and the environment, without starting anything.

  Args:
    config: the `distributed` config section (default: `DistributedConfig()`, i.e. mode auto).
    environ: the environment to read (default: `os.environ`).

  Returns:
    The `Plan`: method and `jax.distributed.initialize` keyword arguments.

  Raises:
    DistributedError: settings are missing or contradict each other; the message names them.
  """
  config = config or DistributedConfig()
  environ = os.environ if environ is None else environ
  common: dict[str, Any] = {"initialization_timeout": config.initialization_timeout_s}
  address = config.coordinator_address or environ.get(ENV_COORDINATOR) or None
  num = config.num_processes if config.num_processes is not None else _env_int(environ, ENV_NUM_PROCESSES)
  pid = config.process_id if config.process_id is not None else _env_int(environ, ENV_PROCESS_ID)
  given = {"coordinator_address": address, "num_processes": num, "process_id": pid}

  mode = config.mode
  if mode == "auto":
    if any(v is not None for v in given.values()):
      mode = "explicit"
    elif all(k in environ for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
      mode = "slurm"
    elif _on_tpu(environ):
      mode = "tpu"
    else:
      mode = "single"

  if mode == "single":
    return Plan("single", {})
  if mode == "tpu":
    return Plan("tpu", common)
  if mode == "slurm":
    return _slurm_plan(config, environ, common)
  if mode == "explicit":
    missing = [k for k, v in given.items() if v is None]
    if missing:
      env = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
             "process_id": ENV_PROCESS_ID}
      raise DistributedError(
          f"explicit initialization needs coordinator_address, num_processes and process_id; missing "
          f"{missing} (set distributed.<key> or ${', $'.join(env[k] for k in missing)}); given {given}")
    if not 0 <= pid < num:
      raise DistributedError(f"process_id={pid} is outside [0, num_processes={num})")
    if ":" not in address:
      raise DistributedError(f"coordinator_address={address!r}: expected host:port")
    local = config.local_device_ids
    return Plan("explicit", dict(common, coordinator_address=address, num_processes=num, process_id=pid,
                                 local_device_ids=None if local is None else list(local),
                                 cluster_detection_method="deactivate"))
  raise DistributedError(f"distributed.mode={config.mode!r}: not one of auto, single, explicit, slurm, tpu")


_ACTIVE: ProcessInfo | None = None


def _info(method: str, coordinator: str | None) -> ProcessInfo:
  return ProcessInfo(method=method, process_id=jax.process_index(), num_processes=jax.process_count(),
                     local_device_count=jax.local_device_count(), device_count=jax.device_count(),
                     coordinator_address=coordinator)


def initialize(config: DistributedConfig | None = None, environ: Mapping[str, str] | None = None) -> ProcessInfo:
  """Starts `jax.distributed` as `config` and the environment say (see the module docstring). Idempotent.

  Must run before any JAX computation in the process (JAX fixes its devices at the first one).

  Args:
    config: the `distributed` config section; None: `DistributedConfig()` (mode auto).
    environ: the environment to read (default: `os.environ`).

  Returns:
    This process's `ProcessInfo`.

  Raises:
    DistributedError: bad or missing settings, a second call asking for another process count, or JAX
      computations ran before this call.
  """
  global _ACTIVE
  plan = resolve(config, environ)
  wanted = plan.kwargs.get("num_processes")
  if _ACTIVE is not None or jax.distributed.is_initialized():
    if wanted is not None and wanted != jax.process_count():
      raise DistributedError(f"already initialized with {jax.process_count()} processes; a second "
                             f"initialize asked for num_processes={wanted}")
    if _ACTIVE is None:  # started by someone else before us
      _ACTIVE = _info("preinitialized", None)
    return _ACTIVE
  if plan.method != "single":
    try:
      jax.distributed.initialize(**plan.kwargs)
    except RuntimeError as e:
      if "before" in str(e) or "already" in str(e):
        raise DistributedError(f"jaxagent.distributed.initialize must run before any JAX computation in the "
                               f"process ({plan.method}: {dict(plan.kwargs)}): {e}") from e
      raise
  _ACTIVE = _info(plan.method, plan.kwargs.get("coordinator_address"))
  return _ACTIVE


def initialize_from_env() -> ProcessInfo:
  """`initialize()` with mode auto: explicit environment variables, SLURM, TPU, or a single process."""
  return initialize(DistributedConfig())


def is_coordinator() -> bool:
  """True on process 0, the process that writes run-level files and logs."""
  return jax.process_index() == 0


def process_zero_only(fn: F) -> F:
  """Decorator: `fn` runs on process 0 only; other processes get None.

  For host-side files and logs (run config, plots, metric lines). Never wrap collectives — Orbax saves,
  `multihost_utils` calls, jitted steps — every process must enter those.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if jax.process_index() == 0:
      return fn(*args, **kwargs)
    return None

  return wrapper  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# `python -m jaxagent.distributed`: a cluster check.


def selfcheck(mesh_config=None) -> dict[str, Any]:
  """Builds the configured mesh over all processes and reduces data that every process contributes.

  Each process provides its own rows (`process_index + 1` everywhere) of a global array sharded over all
  mesh axes; `jnp.sum` under `jit` and a `psum` inside `shard_map` both need every process's shards.

  Returns:
    A dict with the mesh shape, the two sums and the value they must equal.
  """
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxagent import config as config_lib
  from jaxagent import multihost, sharding

  mesh = sharding.mesh_from_config(mesh_config or config_lib.MeshConfig())
  axes = tuple(mesh.axis_names)
  spec = NamedSharding(mesh, P(axes))
  rows_per_device, cols = 2, 3
  local = np.full((rows_per_device * jax.local_device_count(), cols), jax.process_index() + 1, np.float32)
  x = jax.make_array_from_process_local_data(spec, local)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b), axes), mesh=mesh, in_specs=P(axes),
                               out_specs=P()))(x)
  n, per = jax.process_count(), rows_per_device * cols * jax.local_device_count()
  # Reading back: each process gets exactly its own rows, from a row-sharded and from a replicated array.
  mine = multihost.local_rows(x)
  rows = jnp.arange(x.shape[0] * cols, dtype=jnp.float32).reshape(x.shape[0], cols)
  replicated = multihost.local_rows(jax.jit(lambda: rows, out_shardings=NamedSharding(mesh, P()))())
  block = np.asarray(rows)[jax.process_index() * local.shape[0]:(jax.process_index() + 1) * local.shape[0]]
  return {"process_id": jax.process_index(), "num_processes": n, "device_count": jax.device_count(),
          "mesh": dict(mesh.shape), "sum": float(total), "psum": float(psum),
          "expected": float(per * n * (n + 1) // 2),
          "processes_in_mesh": sorted({d.process_index for d in mesh.devices.flat}),
          "local_rows": bool(np.array_equal(mine, local) and np.array_equal(replicated, block))}


def main(argv: list[str] | None = None) -> int:
  """`python -m jaxagent.distributed [--coordinator-address H:P --num-processes N --process-id I] ...`."""
  import argparse
  import json

  from jaxagent import config as config_lib

  parser = argparse.ArgumentParser(prog="python -m jaxagent.distributed", description=main.__doc__)
  parser.add_argument("--coordinator-address")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--mode", default="auto")
  parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="config override, e.g. --set mesh.dcn.data=2 --set mesh.ici.fsdp=-1")
  parser.add_argument("--out", type=Path, help="directory: every process writes p<i>.json, process 0 "
                      "also coordinator.json")
  args = parser.parse_args(argv)
  overrides = list(args.overrides) + [f"distributed.mode={args.mode}"]
  for key in ("coordinator_address", "num_processes", "process_id"):
    if getattr(args, key) is not None:
      overrides.append(f"distributed.{key}={getattr(args, key)}")
  cfg = config_lib.load(None, overrides)
  info = initialize(cfg.distributed)
  result = dict(selfcheck(cfg.mesh), method=info.method, coordinator=is_coordinator())
  line = json.dumps(result, sort_keys=True)
  print(line, flush=True)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"p{info.process_id}.json").write_text(line)
    process_zero_only(lambda: (args.out / "coordinator.json").write_text(line))()
  ok = result["sum"] == result["psum"] == result["expected"]
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
