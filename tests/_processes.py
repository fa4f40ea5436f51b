"""Several real processes of one test (multi-host on 127.0.0.1): started together, bounded, never left behind."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_DISTRIBUTED_VARS = ("JAX_COORDINATOR_ADDRESS", "JAXAGENT_NUM_PROCESSES", "JAXAGENT_PROCESS_ID", "JAX_NUM_CPU_DEVICES")


def cpu_env(devices: int) -> dict[str, str]:
  """The environment of a child process with `devices` fake CPU devices, importing this checkout, and none of
  the distributed settings this process may carry (each child gets its own on the command line)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  for key in _DISTRIBUTED_VARS:
    env.pop(key, None)
  return env


def run_all(commands, *, timeout: float, **popen) -> list[str]:
  """Starts every command at once, waits up to `timeout` s for each, kills any still running; asserts each
  exited 0 (the message holds its output's tail). Returns their combined stdout+stderr."""
  procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
           for cmd in commands]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, out in zip(procs, outputs):
    assert proc.returncode == 0, out[-4000:]
  return outputs
