"""One sync rl iteration outside the run loop, for tests: what the loop's store hook would write goes to
`writer`."""

from jaxagent.train import rl


def rl_iteration(run, state, writer=None):
  """(next state, the iteration's metrics): `rl.iteration`, its stored trajectories written to `writer`."""
  state, record = rl.iteration(run, state)
  if writer is not None:
    for t in record.stored:
      writer.write(t)
    writer.flush()
  return state, dict(record.metrics)
