#!/usr/bin/env python3
"""Start N jaxagent processes on this machine as one multi-process JAX job (what the tests and laptops use).

    python launch/local.py -n 2 --devices-per-process 4 -- train tiny_cpu --set train.iterations=2
    python launch/local.py -n 2 --module jaxagent.distributed          # cluster check: mesh + reduction

Each process runs `python -m <module> <args...>` (module default `jaxagent`, i.e. the `jaxagent` CLI) with
`JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `JAXAGENT_NUM_PROCESSES`, `JAXAGENT_PROCESS_ID`, and (on
CPU) `--devices-per-process` fake CPU devices, which `jaxagent.distributed.initialize` picks up. Output lines
are prefixed `[p<i>]`. When one process fails, the others are killed and its exit code is returned; after
`--timeout` seconds all are killed and the exit code is 124.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
  try:
    import portpicker
    return portpicker.pick_unused_port()
  except ImportError:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      return s.getsockname()[1]


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
  for line in iter(stream.readline, ""):
    with lock:
      out.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
      out.flush()
  stream.close()


def _kill(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
  """SIGTERM each still-running process group we started, then SIGKILL after `grace_s`."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def launch(num_processes: int, args: list[str], *, module: str = "jaxagent", devices_per_process: int | None = 4,
           platform: str | None = "cpu", timeout_s: float = 3600.0, port: int | None = None,
           out=None) -> int:
  """Runs `python -m module args` in `num_processes` processes joined by `jax.distributed`.

  Args:
    num_processes: processes to start (>= 1).
    args: arguments after the module (e.g. `["train", "tiny_cpu"]`).
    module: the module to run.
    devices_per_process: fake CPU devices per process (`--xla_force_host_platform_device_count`); None: leave
      XLA_FLAGS as is.
    platform: `JAX_PLATFORMS` for the children; None: leave as is.
    timeout_s: wall-clock bound for the whole job.
    port: coordinator port on 127.0.0.1 (default: a free one).
    out: where prefixed output goes (default: stdout).

  Returns:
    0 when every process succeeded; else the first failing exit code (124 on timeout).
  """
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes}: must be >= 1")
  out = out or sys.stdout
  address = f"127.0.0.1:{port or _free_port()}"
  env = dict(os.environ)
  env.update(JAX_COORDINATOR_ADDRESS=address, JAXAGENT_NUM_PROCESSES=str(num_processes))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
  env["PYTHONUNBUFFERED"] = "1"
  if platform is not None:
    env["JAX_PLATFORMS"] = platform
  if devices_per_process is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env.pop("JAX_NUM_CPU_DEVICES", None)
  lock = threading.Lock()
  procs, pumps = [], []
  with lock:
    print(f"[launch] {num_processes} processes, coordinator {address}: python -m {module} {' '.join(args)}",
          file=out, flush=True)
  for i in range(num_processes):
    p = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=dict(env, JAXAGENT_PROCESS_ID=str(i)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock), daemon=True)
    t.start()
    pumps.append(t)

  deadline = time.monotonic() + timeout_s
  code = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        with lock:
          print(f"[launch] process {i} exited with {code}; stopping the others", file=out, flush=True)
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() > deadline:
        code = 124
        with lock:
          print(f"[launch] timeout after {timeout_s:.0f} s; stopping all processes", file=out, flush=True)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    code = 130
  finally:
    _kill(procs)
    for t in pumps:
      t.join(timeout=5)
  return code


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, default=2)
  parser.add_argument("--devices-per-process", type=int, default=4,
                      help="fake CPU devices per process (0: leave XLA_FLAGS alone, e.g. on a GPU box)")
  parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for the processes ('' : leave as is)")
  parser.add_argument("--module", default="jaxagent", help="module to run with python -m (default: the CLI)")
  parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before every process is killed")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module, after --")
  ns = parser.parse_args(argv)
  args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
  return launch(ns.num_processes, args, module=ns.module, devices_per_process=ns.devices_per_process or None,
                platform=ns.platform or None, timeout_s=ns.timeout, port=ns.port)


if __name__ == "__main__":
  raise SystemExit(main())
