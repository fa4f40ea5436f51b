"""One process of tests/test_multihost.py's shared-prefix check (run under launch/local.py, 2 processes).

    python launch/local.py -n 2 --devices-per-process 1 --module tests._shared_prefix_processes

Process 0 holds one group of 4 trajectories (one prompt), process 1 two groups of 2 with longer actions, so their
prefix trees differ in size and number. Each prepares the same update shared and unshared and prints one JSON
line: the packed shape (which both must agree on: one program, one global batch), the tokens computed and
unshared, and the two updates' metrics.
"""

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from jaxagent import distributed

distributed.initialize_from_env()  # before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxagent import config as config_lib  # noqa: E402
from jaxagent.train import learner  # noqa: E402
from jaxagent.train import metrics as metrics_lib  # noqa: E402
from jaxagent.train.run import build_run  # noqa: E402
from tests import _trajectories  # noqa: E402
from tests.test_train import TINY  # noqa: E402

me = int(os.environ["JAXAGENT_PROCESS_ID"])
if me == 0:
  trajs = [_trajectories.make(seed=i, group_id="g0", reward=float(i % 2), turns=((f"ls {i}", "a.txt"),))
           for i in range(4)]
else:
  trajs = [_trajectories.make(seed=i, group_id=f"g{1 + i // 2}", task_id=f"task-{1 + i // 2}", reward=float(i % 2),
                              turns=((f"cat file-{i}.txt", "hello"), (f"wc -l file-{i}.txt", "3")))
           for i in range(4)]
with tempfile.TemporaryDirectory() as root:
  cfg = config_lib.load("tiny_cpu", TINY + [f"run.root={root}", "train.shared_prefix=on", "train.bc_steps=0",
                                            "train.eval_episodes=0", "train.plots=false"])
  run = build_run(cfg, Path(root) / f"run-{me}")
  try:
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, shared_prefix="off"))
    initial = run.new_state().train
    out = {"process": me}
    for name, r in (("shared", run), ("unshared", dataclasses.replace(run, config=off))):
      prepared = learner.prepare_batch(r, initial, trajs)
      if name == "shared":
        out["packed_shape"] = list(prepared.batch.shared.tokens.shape)
        out["tokens"] = [prepared.stats[metrics_lib.TOKENS_COMPUTED], prepared.stats[metrics_lib.TOKENS_UNSHARED]]
      state, metrics = learner.update(r, jax.tree.map(jnp.array, initial), prepared)
      out[name] = {k: float(v) for k, v in metrics.items()}
  finally:
    run.close()
print(json.dumps(out), flush=True)
