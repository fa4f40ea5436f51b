"""A payload for tests/test_launchers.py: `python -m tests._launch_payload fail-on <i>` or `sleep`."""

import os
import sys
import time


def main(argv):
  me = int(os.environ["JAXAGENT_PROCESS_ID"])
  if argv[:1] == ["fail-on"]:
    if me == int(argv[1]):
      sys.exit(3)
    print(f"waiting for process {argv[1]}", flush=True)
    from jaxagent import distributed
    distributed.initialize_from_env()  # blocks: the failed process never joins
  elif argv[:1] == ["sleep"]:
    print("sleeping", flush=True)
    time.sleep(120)
  else:
    sys.exit(f"unknown payload {argv}")


if __name__ == "__main__":
  main(sys.argv[1:])
