"""One process of tests/test_multihost.py's bucketed-length check (run under launch/local.py, 2 processes).

    python launch/local.py -n 2 --devices-per-process 1 --module tests._batch_length

Process 0 holds an 81-token trajectory, process 1 a 157-token one; each prints one JSON line with its own
longest trajectory, the bucket that alone would give, and `learner.batch_length`'s answer (which must be the
bucket of the longest on any process, the same on both: their update programs and global batch share T).
"""

import json
import os

from jaxagent import distributed

distributed.initialize_from_env()  # before any JAX computation

from jaxagent import buckets  # noqa: E402
from jaxagent import config as config_lib  # noqa: E402
from jaxagent.train import learner  # noqa: E402
from tests import _trajectories  # noqa: E402

me = int(os.environ["JAXAGENT_PROCESS_ID"])
trajs = [_trajectories.make(seed=0) if me == 0 else _trajectories.make(seed=9, turns=(("x" * 60, "y" * 60),))]
cfg = config_lib.load("tiny_cpu", ["train.batch_length=bucket", "rollout.max_context=256"])
local = max(len(t) for t in trajs)
print(json.dumps({"process": me, "local_longest": local,
                  "local_bucket": buckets.fit(local, buckets.batch_lengths(cfg.rollout.max_context)),
                  "batch_length": learner.batch_length(cfg, trajs)}), flush=True)
